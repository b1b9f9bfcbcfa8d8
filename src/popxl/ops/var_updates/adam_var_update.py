"""Adam / LAMB's variable update."""
from __future__ import annotations

from typing import Optional

from ...tensor import Tensor, constant
from .._base import inplace
from .._core import where
from .utils import Scalar, _cast, _f


def adam_var_update(t: Tensor, x: Tensor, r1: Optional[Tensor] = None, r2: Optional[Tensor] = None,
                    learning_rate: Optional[Scalar] = None, max_weight_norm: Optional[Scalar] = None) -> Tensor:
    """t = t - lr * x (with LAMB's trust ratio r1 / r2 when given); returns t."""
    lr = 1.0 if learning_rate is None else learning_rate
    step = _cast(x, t) * _f(lr, t)
    if r1 is not None and r2 is not None:
        ratio = where(r2 > 0.0, r1 / r2, constant(1.0, t.dtype))
        step = step * _cast(ratio, t)
    return inplace(t, t - step)
