"""popxl.ops.utils: the checks and conversions PopXL's ops (and libraries built on popxl, such
as popxl-addons) use. PopART's ``convert_optional_*`` return C++ ``Optional*`` binding
objects for its IR; here, with no such binding, they return the value (or None)."""
from __future__ import annotations

from typing import Any, List, Optional

from ..dtypes import dtype
from ..errors import UndefinedValue
from ..graph import Graph
from ..tensor import Tensor
from ._core import cast

__all__ = ["cast_if_needed", "check_in_graph", "check_tensor_ipu_and_tile_set", "handle_negative_axis",
           "convert_optional_float", "convert_optional_int", "convert_optional_dtype",
           "convert_optional_int64_list"]


def cast_if_needed(t: Tensor, data_type: dtype) -> Tensor:
    """``t`` cast to ``data_type``, or ``t`` itself when it already has that type."""
    return t if t.dtype == data_type else cast(t, data_type)


def _keywords_only(args: tuple) -> None:
    if args:
        raise Exception("Internal error: please specify all tensors as keyword arguments.")


def check_in_graph(graph: Graph, *args: Any, **tensors: Tensor) -> None:
    """Check that each keyword argument is a Tensor of ``graph``.

    Raises:
        TypeError: a value is not a Tensor.
        ValueError: a tensor is not in ``graph``.
    """
    _keywords_only(args)
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"The input `{name}` is not a Tensor. Type: {type(t)}. Value: {t}.")
        if t not in graph:
            raise ValueError(f"The input tensor `{name}` is not in the current Graph {graph.name}.")


def _ipu_and_tile_set(t: Tensor) -> tuple:
    try:
        ipu = t.ipu
    except UndefinedValue:
        ipu = None
    return ipu, getattr(t, "tile_set", None)


def check_tensor_ipu_and_tile_set(*args: Any, **tensors: Tensor) -> None:
    """Check that the keyword-argument tensors are on one IPU and one tile set (tensors whose
    IPU is undefined are not compared).

    Raises:
        ValueError: two tensors on different IPUs or tile sets.
    """
    _keywords_only(args)
    placed = [(name, *_ipu_and_tile_set(t)) for name, t in tensors.items()]
    for what, col in (("IPUs", 1), ("tile sets", 2)):
        known = [(p[0], p[col]) for p in placed if p[col] not in (None, -1, "undefined")]
        for name, v in known[1:]:
            if v != known[0][1]:
                raise ValueError(f"The input tensors `{known[0][0]}` and `{name}` are located on "
                                 f"different {what}: {known[0][1]} != {v}.")


def handle_negative_axis(t: Tensor, axis: int) -> int:
    """``axis`` counted from the front (``t.rank + axis`` for a negative one)."""
    return len(t.shape) + axis if axis < 0 else axis


def convert_optional_float(v: Optional[float]) -> Optional[float]:
    return None if v is None else float(v)


def convert_optional_int(v: Optional[int]) -> Optional[int]:
    return None if v is None else int(v)


def convert_optional_dtype(dt: Optional[dtype]) -> Optional[dtype]:
    return None if dt is None else dtype.as_dtype(dt)


def convert_optional_int64_list(l: Optional[List[int]]) -> Optional[List[int]]:  # noqa: E741
    return None if l is None else [int(v) for v in l]
