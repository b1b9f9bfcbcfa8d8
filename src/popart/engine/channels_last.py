"""Channels-last layout of a trace: convolution graphs run NHWC from one oneDNN convolution to
the next, with transposes only where a tensor leaves such a run (docs/performance.md).

A lowering that computes a 4-D tensor channels-last (the oneDNN convolution, BatchNormalization,
pools, Concat, every elementwise op whose input has a channels-last form) returns the NCHW value
``keep(y_nhwc)``: a transpose, which XLA drops where nothing reads it, remembered with its
NHWC "twin". Consumers that can take NHWC ask ``twin(x)``; every other consumer reads the
NCHW value, so names, anchors, probes and every op see ONNX's layout. The map is keyed by the
identity of the traced value, so a value an instrumented tensor (a probe or tap, a new value)
or another trace replaces simply has no twin."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

TO_LAST, TO_FIRST = (0, 2, 3, 1), (0, 3, 1, 2)


class ChannelsLast:
    """NCHW traced value -> its NHWC twin, for one trace and the traces nested in it."""

    def __init__(self) -> None:
        self._twins: dict[int, tuple[Any, Any]] = {}   # id(nchw) -> (nchw, nhwc): kept alive

    def twin(self, x: Any) -> Optional[Any]:
        """The NHWC form of ``x`` if a lowering made one, else None."""
        entry = self._twins.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def keep(self, y_nhwc: Any) -> Any:
        """The NCHW value of ``y_nhwc`` (N, H, W, C), remembered with it."""
        y = permute(y_nhwc, TO_FIRST)
        self._twins[id(y)] = (y, y_nhwc)
        return y

    def to_last(self, x: Any) -> Any:
        """``x`` (4-D NCHW) channels-last: its twin, else a transpose, remembered as its twin
        so that every consumer shares it."""
        t = self.twin(x)
        if t is None:
            t = permute(x, TO_LAST)
            self._twins[id(x)] = (x, t)
        return t

    def elementwise_inputs(self, inputs: Sequence[Any]) -> Optional[list]:
        """NHWC forms of an elementwise op's inputs when one of them has a twin and the
        output is 4-D, each other input (broadcast to 4 dimensions) transposed; else None."""
        if not any(x is not None and self.twin(x) is not None for x in inputs):
            return None
        shapes = [np.shape(x) for x in inputs if x is not None]
        try:
            if len(np.broadcast_shapes(*shapes)) != 4:
                return None
        except ValueError:
            return None          # the plain lowering reports the shapes
        return [None if x is None else self._broadcast_last(x) for x in inputs]

    def _broadcast_last(self, x: Any) -> Any:
        shape = np.shape(x)
        if len(shape) == 0:
            return x
        if len(shape) == 4 and not isinstance(x, (np.ndarray, np.generic)):
            return self.to_last(x)
        xp = np if isinstance(x, (np.ndarray, np.generic)) else jnp
        return permute(xp.reshape(x, (1,) * (4 - len(shape)) + tuple(shape)), TO_LAST)


def permute(x: Any, perm: Sequence[int]) -> Any:
    """``x.transpose(perm)``, as a reshape where the permutation only moves axes of size 1
    (squeeze-and-excitation's N, C, 1, 1 scales; pooled N, 1, 1, C): no data moves."""
    shape = np.shape(x)
    moved = [a for a in perm if shape[a] != 1]
    if moved == sorted(moved):
        return x.reshape([shape[a] for a in perm])
    return x.transpose(perm)
