"""Copy a value into a variable in place."""
from __future__ import annotations

from ...tensor import Tensor
from .._base import GC, inplace, node
from .utils import _cast


def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:
    """t = X (ai.graphcore CopyVarUpdate)."""
    return inplace(t, node("CopyVarUpdate", [t, _cast(X, t)], {}, GC)[0])
