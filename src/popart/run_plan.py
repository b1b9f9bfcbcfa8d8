"""The per-call work of a prepared session's ``run(stepio)``, worked out once (issue 28).

A :class:`RunPlan` holds what does not change between runs of one compiled program: each
input's dtype, host shapes and the [B, A, R, ...] shape the step takes; each anchor's dtype
and element count; the hyper-parameters already on the device. A run then checks the
StepIO's arrays with a few comparisons and hands them to the compiled program as they are
(the program's call moves them to its input shardings), and copies the anchors back in one
go. Anything off the common path (a StepIO other than a PyStepIO, runtime asserts disabled,
INT64 data for an INT32 input, a shape other than the host or full one, a missing or extra
array, an output array of another dtype or size, global replication, stream callbacks,
anchors of the optimizer's scalars) returns None, and the session takes its general path,
which raises PopART's errors.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from . import dataflow as _df
from .engine.compiled import fetch
from .engine.host_plan import HostInput, HostOutput, HostPlan
from .engine.lower import CHECKS, raise_failed_checks
from .session_io import HostIO


class RunPlan:
    """The common path of ``session.run(stepio)`` for a session's current ``program`` (a
    prepared ``StepProgram``) and optimizer (its runtime hyper-parameters ``hyper``), with the
    session's ``HostIO`` (data flow, factors, inputs, anchors); the session makes a new plan
    when the program or the optimizer changes."""

    def __init__(self, program: Any, hio: HostIO, hyper: Mapping[str, Any]) -> None:
        df = hio.dataFlow
        bps, A, R = hio.factors()
        self.program = program
        self.hyper = program.put_hyper(dict(hyper))   # placed once
        self.synthetic = hio.synthetic()   # syntheticDataMode's inputs, or None
        inputs = []   # the host shape or the full one, as the step takes it: [B, A, R, ...]
        for tid, info in hio.input_infos.items():
            shape = tuple(info.shape())
            full = (bps, A, R) + shape
            inputs.append(HostInput(tid, tid, np.dtype(info.np_dtype()),
                                    (tuple(_df.input_host_shape(shape, bps, A, R)), full), full))
        self.anchors: Optional[list] = None   # (id, dtype, host element count); None: general path
        if program.cfg.replication_factor == R and not program.placement.across_processes \
                and not getattr(program, "host_anchors", None):
            # (global replication: the general path picks this process's replicas; anchors of
            # the optimizer's scalars are written from the host by the general path)
            self.anchors = []
            for a in df.anchors():
                shape, dtype = hio.anchor_info(program, a)
                host = _df.anchor_host_shape(shape, df.art(a), bps, A, R)
                self.anchors.append((a, np.dtype(dtype), int(np.prod(host, dtype=np.int64))))
        self.names = [a for a, _, _ in self.anchors or ()]
        self.host = HostPlan(inputs, [HostOutput(a, dtype, size=n) for a, dtype, n in self.anchors or ()],
                             contiguous=True)
        # 64-bit host data needs JAX's 64-bit scope to reach the step as it is; 32-bit data
        # and device arrays do not (the step was compiled in the scope either way)
        self.x64 = self.host.x64

    def feeds(self, stepio: Any) -> Optional[dict]:
        """The step's feeds ([B, A, R, ...] views of a PyStepIO's arrays), or None: the
        general path (``_gather_inputs``) decides."""
        if type(stepio) is not _df.PyStepIO or stepio.runtime_asserts is False:
            return None
        return self.host.feeds(stepio.inputs)

    def outputs(self, stepio: Any, callbacks: dict) -> Optional[dict]:
        """A PyStepIO's anchor arrays when each is a C-contiguous array of its anchor's
        dtype and size, or None: the general path (``_check_outputs``) decides."""
        if self.anchors is None or callbacks or type(stepio) is not _df.PyStepIO:
            return None
        outs = stepio.outputs
        return outs if type(outs) is dict and self.host.outputs_fit(outs) else None

    def write(self, outs: dict, anchors: dict) -> None:
        """Copy a run's anchors (and its run-time checks' record) to the host in one go;
        raise a failed check's error before writing any anchor, as the general path does."""
        flags = anchors.pop(CHECKS, None)
        values = [anchors[a] for a in self.names]
        if flags is not None:
            values.append(flags)
        values = fetch(values, local=True)
        if flags is not None:
            raise_failed_checks(values.pop(), self.program.run_checks)
        for a, val in zip(self.names, values):
            dst = outs[a]
            np.copyto(dst, val.reshape(dst.shape), casting="unsafe")
