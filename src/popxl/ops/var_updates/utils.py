"""Helpers of the variable-update ops."""
from __future__ import annotations

from typing import Any, Dict, Union

from popart import OptimizerValue

from ...tensor import Tensor
from .._base import as_tensor
from .._core import cast

Scalar = Union[float, Tensor]


def _f(x: Scalar, like: Tensor) -> Tensor:
    return as_tensor(x, like)


def _cast(x: Tensor, like: Tensor) -> Tensor:
    return x if x.dtype == like.dtype else cast(x, like.dtype)


def handle_optimizer_value(f: Any, ins: Dict[int, str], index: int) -> OptimizerValue:
    """PopXL's reading of an optimizer hyper-parameter ``f``: a tensor goes in ``ins[index]``
    (its id) and gives a non-const OptimizerValue; None the default OptimizerValue; a number
    a const one."""
    if isinstance(f, Tensor):
        ins[index] = f.id
        return OptimizerValue(0.0, False)
    if f is None:
        return OptimizerValue()
    return OptimizerValue(f, True)
