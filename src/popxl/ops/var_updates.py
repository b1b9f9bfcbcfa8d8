"""In-place variable updates (accumulators, copies, Adam / LAMB / AdaMax helpers) composed from
registry ops.
Each updates ``t`` (it names the new value afterwards) and returns it."""
from __future__ import annotations

from typing import Optional, Union

from ..tensor import Tensor, constant
from ._base import GC, as_tensor, inplace, node, one

Scalar = Union[float, Tensor]


def _f(x: Scalar, like: Tensor) -> Tensor:
    return as_tensor(x, like)


def _cast(x: Tensor, like: Tensor) -> Tensor:
    from . import cast
    return x if x.dtype == like.dtype else cast(x, like.dtype)


def accumulate_(t: Tensor, X: Tensor, f: Optional[Scalar] = None) -> Tensor:
    """t = t + f * X (f defaults to 1)."""
    from . import scaled_add
    return inplace(t, scaled_add(t, _cast(X, t), 1.0, 1.0 if f is None else f))


def accumulate_square_(t: Tensor, X: Tensor, f: Scalar = 1.0) -> Tensor:
    """t = t + f * X^2."""
    from . import scaled_add
    x = _cast(X, t)
    return inplace(t, scaled_add(t, x * x, 1.0, f))


def accumulate_mean_(t: Tensor, X: Tensor, step: Scalar) -> Tensor:
    """t = (step / (step + 1)) * t + X / (step + 1): the running mean of the values seen."""
    s = _f(step, t)
    n = s + 1.0
    return inplace(t, (s / n) * t + _cast(X, t) / n)


def accumulate_moving_average_(t: Tensor, X: Tensor, f: Scalar) -> Tensor:
    """t = f * t + (1 - f) * X."""
    from . import scaled_add
    if isinstance(f, Tensor):
        return inplace(t, f * t + (1.0 - f) * _cast(X, t))
    return inplace(t, scaled_add(t, _cast(X, t), float(f), 1.0 - float(f)))


def accumulate_moving_average_square_(t: Tensor, X: Tensor, f: Scalar) -> Tensor:
    """t = f * t + (1 - f) * X^2."""
    x = _cast(X, t)
    return accumulate_moving_average_(t, x * x, f)


def accumulator_scale_(t: Tensor, f: Scalar) -> Tensor:
    """t = f * t."""
    if isinstance(f, Tensor):
        return inplace(t, t * _cast(f, t))
    return inplace(t, one("Scale", t, domain=GC, scale=float(f)))


def accumulator_zero_(t: Tensor) -> Tensor:
    return accumulator_scale_(t, 0.0)


def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:
    """t = X (ai.graphcore CopyVarUpdate)."""
    return inplace(t, node("CopyVarUpdate", [t, _cast(X, t)], {}, GC)[0])


def sparse_accumulate_(t: Tensor, X: Tensor, indices: Tensor, axis: int = 0,
                       f: Optional[Scalar] = None, W: Optional[Tensor] = None) -> Tensor:
    """t[indices[i]] += f * X[i] along ``axis``."""
    from . import scaled_add, scatter_reduce
    upd = scatter_reduce(_cast(X, t), indices, "sum", axis=axis, axis_size=t.shape[axis])
    return inplace(t, scaled_add(t, upd, 1.0, 1.0 if f is None else f))


def _wd_required(weight_decay: Optional[Scalar]) -> bool:
    if isinstance(weight_decay, Tensor):
        return True
    return weight_decay is not None and float(weight_decay) != 0.0


def _adam_updater(m: Tensor, v: Tensor, weight: Optional[Tensor], time_step: Optional[Tensor],
                  weight_decay: Optional[Scalar], beta1: Optional[Scalar], beta2: Optional[Scalar],
                  epsilon: Scalar, bias_correction: bool, sqrt_v: bool) -> Tensor:
    """The updater term of AdamUpdater (see :func:`adam_updater`) in ``m``'s dtype, then the
    weight's (with weight decay)."""
    from . import sqrt
    with_wd = _wd_required(weight_decay)
    if with_wd and weight is None:
        raise ValueError("Weight decay requires weight to not be None.")
    if bias_correction:
        from . import cast
        step = inplace(time_step, time_step + 1)
        t = cast(step, "float32")       # corrections in float32, as PopART, then m's / v's type

        def correction(beta: Scalar, like: Tensor) -> Tensor:
            b = beta if isinstance(beta, Tensor) else constant(float(beta), "float32")
            return _cast(1.0 - _cast(b, t) ** t, like)
        m = m / correction(beta1, m)
        if beta2 is not None:
            v = v / correction(beta2, v)
    m = _cast(m, v)
    denom = (sqrt(v) if sqrt_v else v) + _f(epsilon, v)
    upd = m / denom
    if with_wd:
        upd = _cast(upd, weight) + _f(weight_decay, weight) * weight
    return upd


def adam_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Optional[Tensor] = None,
                 time_step: Optional[Tensor] = None, weight_decay: Optional[Scalar] = None,
                 beta1: Optional[Scalar] = None, beta2: Optional[Scalar] = None,
                 epsilon: Scalar = 1e-07) -> Tensor:
    """Adam's updater term ``mc / (sqrt(vc) + epsilon) (+ weight_decay * weight)``. With
    ``time_step`` (``t``, incremented by 1 in place first) the moments are bias corrected:
    ``mc = m / (1 - beta1 ** t)``, ``vc = v / (1 - beta2 ** t)``; without it ``mc = m``,
    ``vc = v``.

    Raises:
        ValueError: ``weight_decay`` set (non-zero or a tensor) without ``weight``, or
            ``time_step`` without both ``beta1`` and ``beta2``.
    """
    if time_step is not None and (beta1 is None or beta2 is None):
        raise ValueError("Bias correction requires both beta1 and beta2 to not be None.")
    return _adam_updater(acc_first_order, acc_second_order, weight, time_step, weight_decay,
                         beta1, beta2, epsilon, time_step is not None, True)


def lamb_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Optional[Tensor] = None,
                 time_step: Optional[Tensor] = None, weight_decay: Optional[Scalar] = None,
                 beta1: Optional[Scalar] = None, beta2: Optional[Scalar] = None,
                 epsilon: Scalar = 1e-07) -> Tensor:
    """LAMB's updater term: the same as :func:`adam_updater` (LAMB's trust ratio is applied by
    :func:`adam_var_update` with the norms ``r1`` / ``r2``).

    Raises:
        ValueError: as :func:`adam_updater`.
    """
    return adam_updater(acc_first_order, acc_second_order, weight, time_step, weight_decay,
                        beta1, beta2, epsilon)


def adamax_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Optional[Tensor] = None,
                   time_step: Optional[Tensor] = None, weight_decay: Optional[Scalar] = None,
                   beta1: Scalar = 0.9, epsilon: Scalar = 1e-07) -> Tensor:
    """AdaMax's updater term ``mc / (v + epsilon) (+ weight_decay * weight)`` with
    ``mc = m / (1 - beta1 ** t)`` (``t``: ``time_step``, incremented by 1 in place first) and
    ``v`` the accumulated infinity norm.

    Raises:
        ValueError: ``weight_decay`` set without ``weight``, or no ``time_step``.
    """
    if time_step is None:
        raise ValueError("AdaMax requires time_step to not be None.")
    return _adam_updater(acc_first_order, acc_second_order, weight, time_step, weight_decay,
                         beta1, None, epsilon, True, False)


def adam_var_update(t: Tensor, x: Tensor, r1: Optional[Tensor] = None, r2: Optional[Tensor] = None,
                    learning_rate: Optional[Scalar] = None, max_weight_norm: Optional[Scalar] = None) -> Tensor:
    """t = t - lr * x (with LAMB's trust ratio r1 / r2 when given); returns t."""
    lr = 1.0 if learning_rate is None else learning_rate
    step = _cast(x, t) * _f(lr, t)
    if r1 is not None and r2 is not None:
        from . import where
        ratio = where(r2 > 0.0, r1 / r2, constant(1.0, t.dtype))
        step = step * _cast(ratio, t)
    return inplace(t, t - step)
