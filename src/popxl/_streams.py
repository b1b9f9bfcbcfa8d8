"""popxl.Session's streams on the host: a run's arrays checked (popxl's rules), the feeds
the step takes ([instance replicas, num_host_transfers, *shape]) and the run's host work
planned once (``engine.host_plan``). Host arrays are [num_host_transfers,
instance_replication_factor, *shape], size-1 dimensions of the first two dropped."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from popart.dataflow import validate_input
from popart.engine.host_plan import HostInput, HostOutput, HostPlan
from popart.tensorinfo import TensorInfo, to_datatype

from .dtypes import _DOWNCAST


def host_shape(n: int, local_r: int, shape: tuple) -> tuple:
    """A stream's host array shape for ``n`` host transfers on ``local_r`` replicas."""
    return tuple(d for d in (n, local_r) if d != 1) + tuple(shape)


class RunPlan:
    """A session's run, worked out once: its streams' dtypes and host shapes (``h2d`` and
    ``d2h``: (stream, tensor) pairs), and whether [n, local replicas] and [local replicas, n]
    differ in memory (both greater than 1)."""

    def __init__(self, h2d: Any, d2h: Any, n: int, local_r: int) -> None:
        self.swap = n > 1 and local_r > 1
        inputs = []   # [n, r, ...] host arrays as the step's [r, n, ...]
        for s, t in h2d:
            dtype, shape = np.dtype(s.dtype.as_device_numpy()), tuple(s.shape)
            inputs.append(HostInput(s, t.id, dtype, (host_shape(n, local_r, shape),),
                                    ((n, local_r) if self.swap else (local_r, n)) + shape, self.swap,
                                    downcast=dtype in _DOWNCAST))
        self.d2h = [(s, s.dtype.as_device_numpy(), host_shape(n, local_r, s.shape)) for s, _ in d2h]
        self.d2h_ids = [t.id for _, t in d2h]
        self.host = HostPlan(inputs, [HostOutput(s, shape=host) for s, _, host in self.d2h],
                             exact_outputs=True)
        self.x64 = self.host.x64   # 64-bit host data

    def feeds(self, inputs: Mapping, downcast: bool) -> Optional[dict]:
        """The step's feeds ([local replicas, n, ...]) when every stream has a NumPy array of
        its dtype (one that ``downcast`` leaves alone) and host shape; else None (the general
        path decides)."""
        return self.host.feeds(inputs, downcast)

    def outputs_fit(self, outputs: Mapping) -> bool:
        """Every output stream has a NumPy array of its host shape, and no other is given."""
        return self.host.outputs_fit(outputs)


def validate_streams(given: Mapping, expected: list, kind: str, n: int, local_r: int) -> None:
    """The streams given are exactly those expected, each with an array of the right shape.

    Raises:
        ValueError: a stream missing or unexpected ("Unexpected/Missing input" / "output"),
            or an array of the wrong shape."""
    got, want = set(given), set(expected)
    if got != want:
        unexpected = {str(x) for x in got - want}
        missing = {str(x) for x in want - got}
        raise ValueError(f"Unexpected/Missing {kind}.\n  Unexpected: {unexpected}\n  "
                         f"Missing: {missing}")
    for st, arr in given.items():
        _verify_io_shape(st, np.shape(arr), kind, n, local_r)


def _verify_io_shape(st: Any, shape: tuple, kind: str, n: int, local_r: int) -> None:
    full = host_shape(n, local_r, st.shape)
    repl_index = data_index = 0
    if n > 1:
        repl_index = data_index = 1
        if len(shape) < 1 or shape[0] < n:
            raise ValueError(f"Dimension 0 ({shape[0] if shape else None}) of the array of "
                             f"shape {tuple(shape)} provided for {kind} stream {st.tensor_id} "
                             f"is not large enough.\nIt should be at least of size "
                             f"num_host_transfers = {n}")
    if local_r > 1:
        data_index += 1
        if len(shape) <= repl_index or shape[repl_index] != local_r:
            size = shape[repl_index] if len(shape) > repl_index else None
            raise ValueError(f"Dimension {repl_index} ({size}) of the array of shape "
                             f"{tuple(shape)} provided for {kind} stream {st.tensor_id} is the "
                             f"wrong size.\nIt should be of size replication_factor = {local_r}")
    if tuple(d for d in shape if d != 1)[data_index:] == () and \
            all(d == 1 for d in shape[data_index:]) and all(d == 1 for d in st.shape):
        return   # all-ones shapes (a scalar for a [1] stream) are not compared
    if tuple(shape[data_index:]) != tuple(st.shape):
        raise ValueError(f"Shape mismatch for {kind} stream {st.tensor_id}:\nStream shape = "
                         f"{st.shape}, therefore expected full global batch shape {full}. Got "
                         f"array shape = {tuple(shape)}")


def feed(s: Any, a: np.ndarray, n: int, local_r: int) -> np.ndarray:
    """A stream's (validated) input as [instance replicas, num_host_transfers, *shape],
    after popart's StepIO rule (dtype, element count)."""
    full = (n, local_r) + tuple(s.shape)
    info = TensorInfo(to_datatype(s.dtype.as_device_numpy()), list(s.shape))
    a = validate_input(s.name, a, info, n, 1, local_r).reshape(full)
    return np.ascontiguousarray(np.swapaxes(a, 0, 1))
