"""What every popxl op uses: append a node of a registry op to the current graph."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from popart.tensorinfo import onnx_dtype

from ..context import get_current_graph
from ..dtypes import dtype as _dtype
from ..tensor import Tensor, constant

ONNX = "ai.onnx"
GC = "ai.graphcore"
POPXL = "ai.popxl"


def node(op_type: str, inputs: Sequence[Optional[Tensor]], attrs: Optional[dict] = None,
         domain: str = ONNX, num_outputs: int = 1, name: Optional[str] = None) -> list[Tensor]:
    """Append ``domain::op_type`` to the current graph; returns its outputs."""
    return get_current_graph()._add_node(op_type, inputs, attrs, domain, num_outputs, name)


def one(op_type: str, *inputs: Optional[Tensor], domain: str = ONNX, name: Optional[str] = None,
        **attrs: Any) -> Tensor:
    """A single-output node."""
    return node(op_type, inputs, attrs, domain, 1, name)[0]


def as_tensor(x: Any, like: Optional[Tensor] = None, dtype: Any = None) -> Tensor:
    """``x`` as a tensor of the current graph (literals become constants of ``like``'s dtype)."""
    if isinstance(x, Tensor):
        return x
    if dtype is None and like is not None:
        dtype = like.dtype
    return constant(x, dtype)


def ints(values: Union[int, Iterable[int]]) -> Tensor:
    """An int64 constant (axes, sizes and other compile-time operands)."""
    return constant(np.asarray(values, np.int64).reshape(-1), "int64", name="const_i64")


def inplace(t: Tensor, new: Tensor, _from: Optional[Tensor] = None) -> Tensor:
    """Make ``t`` name the value ``new`` (the result of an in-place op on ``t``); the tensors
    that alias ``t`` (see :func:`view`) follow."""
    if new.shape != t.shape:
        raise ValueError(f"In-place op on '{t.id}' would change its shape from {t.shape} to {new.shape}")
    versions = t._graph._versions
    versions[new._ir_id] = versions.get(t._ir_id, t._ir_id)
    t._ir_id = new._ir_id
    for base, back in getattr(t, "_alias_of", ()):   # t is a view: write it into its base
        if base is not _from and base._graph is t._graph:
            inplace(base, back(base, t), t)
    for v, fwd in getattr(t, "_aliases", ()):        # t has views: they read its new value
        if v is not _from and v._graph is t._graph:
            inplace(v, fwd(t), t)
    return t


def view(base: Tensor, out: Tensor, fwd: Any, back: Any) -> Tensor:
    """Make ``out`` (``fwd(base)``) an alias of ``base``, as PopXL's view-changing in-place
    ops (``reshape_``, ``transpose_``, ``slice_``, ...) return: an in-place op on ``out``
    changes ``base`` (to ``back(base, out)``), and one on ``base`` changes ``out``."""
    out._alias_of = [*getattr(out, "_alias_of", ()), (base, back)]
    base._aliases = [*getattr(base, "_aliases", ()), (out, fwd)]
    return out


def onnx_type(dt: Any) -> int:
    return onnx_dtype(_dtype.as_dtype(dt).as_numpy())


def axes_list(axis: Union[None, int, Iterable[int]], rank: int) -> Optional[list[int]]:
    if axis is None:
        return None
    return [int(axis)] if isinstance(axis, (int, np.integer)) else [int(a) for a in axis]


def reduction_name(r: Any) -> str:
    """ReductionType (popart / popxl enum, string or int) as the loss ops' string."""
    if isinstance(r, str):
        return r
    if hasattr(r, "name"):
        return str(r.name)
    return ["Sum", "Mean", "NoReduction"][int(r)]


def reshape_(t: Tensor, shape: Any) -> Tensor:
    return one("Reshape", t, domain=GC, shape=[int(d) for d in shape])
