"""A run's host side, worked out once for a compiled step (issue 28): which input arrays the
common path of a run hands to the program as they are, and which output arrays it writes in
place. popart's ``RunPlan`` (a StepIO's inputs and anchors) and ``popxl.Session`` (its
streams) describe their arrays with :class:`HostInput` / :class:`HostOutput`; anything a
:class:`HostPlan` does not take (another type, dtype, shape or layout, a missing or extra
array) returns None / False, and the front-end's general path raises its own errors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import WIDE_DTYPES


@dataclass(frozen=True)
class HostInput:
    key: Any                   # the caller's key: a tensor id, a popxl stream
    name: str                  # the step's input
    dtype: np.dtype
    shapes: tuple              # the host shapes the common path takes
    step_shape: tuple          # the shape the step takes it in ...
    swap: bool = False         # ... with its first two dimensions swapped (a copy)
    downcast: bool = False     # a dtype the caller may ask to narrow (then: the general path)


@dataclass(frozen=True)
class HostOutput:
    key: Any
    dtype: Optional[np.dtype] = None   # None: any
    shape: Optional[tuple] = None      # None: any
    size: Optional[int] = None         # None: any


class HostPlan:
    """The host arrays a run takes as they are. ``contiguous``: only C-contiguous arrays;
    ``exact_outputs``: the outputs given are exactly those planned (else others may be
    given too)."""

    def __init__(self, inputs: Sequence[HostInput], outputs: Sequence[HostOutput],
                 contiguous: bool = False, exact_outputs: bool = False) -> None:
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.input_keys = frozenset(i.key for i in self.inputs)
        self.output_keys = frozenset(o.key for o in self.outputs)
        self.contiguous, self.exact_outputs = contiguous, exact_outputs
        # 64-bit host data needs JAX's 64-bit scope to reach the step as it is
        self.x64 = any(np.dtype(i.dtype) in WIDE_DTYPES for i in self.inputs)

    def feeds(self, given: Mapping, downcast: bool = False) -> Optional[dict]:
        """The step's inputs (views where no swap is needed) from exactly the planned arrays,
        each of its dtype and one of its host shapes (and C-contiguous when asked; not
        ``downcast`` where narrowing would change it); else None."""
        if given.keys() != self.input_keys:
            return None
        feeds = {}
        for i in self.inputs:
            a = given[i.key]
            if type(a) is not np.ndarray or a.dtype != i.dtype or a.shape not in i.shapes or (
                    self.contiguous and not a.flags.c_contiguous) or (downcast and i.downcast):
                return None
            feeds[i.name] = np.ascontiguousarray(np.swapaxes(a.reshape(i.step_shape), 0, 1)) \
                if i.swap else a.reshape(i.step_shape)
        return feeds

    def outputs_fit(self, outputs: Mapping) -> bool:
        """Every planned output has a NumPy array of its dtype, shape and size (each where
        planned; C-contiguous when asked)."""
        if self.exact_outputs and outputs.keys() != self.output_keys:
            return False
        for o in self.outputs:
            dst = outputs.get(o.key)
            if type(dst) is not np.ndarray or (o.dtype is not None and dst.dtype != o.dtype) or (
                    o.shape is not None and dst.shape != o.shape) or (
                    o.size is not None and dst.size != o.size) or (
                    self.contiguous and not dst.flags.c_contiguous):
                return False
        return True
