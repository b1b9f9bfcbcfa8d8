"""Updater terms of Adam, LAMB and AdaMax (PopART's AdamUpdater op, composed from registry
ops)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from popart import AdamMode

from ...tensor import Tensor, constant
from .._base import inplace
from .._core import cast, sqrt
from .utils import Scalar, _cast, _f, handle_optimizer_value

_BIAS_CORRECTED = ("Adam", "Lamb", "AdaMax")


def weight_decay_is_required(weight_decay: Optional[Scalar]) -> bool:
    """True for a weight-decay tensor or a non-zero number."""
    if isinstance(weight_decay, Tensor):
        return True
    return weight_decay is not None and weight_decay != 0.0


def _ins(m: Tensor, v: Tensor, weight: Optional[Tensor], time_step: Optional[Tensor],
         weight_decay: Optional[Scalar]) -> Dict[int, str]:
    """PopART's AdamUpdater inputs (index -> tensor id) for these tensors."""
    ins = {1: m.id, 2: v.id}
    if weight_decay_is_required(weight_decay):
        if weight is None:
            raise ValueError("Weight decay requires weight to not be None.")
        ins[0] = weight.id
    if time_step is not None:
        ins[3] = time_step.id
    return ins


def create_adamupdater(acc_first_order: Tensor, acc_second_order: Tensor, ins: Dict[int, str], mode: Any,
                       weight: Optional[Tensor] = None, time_step: Optional[Tensor] = None,
                       weight_decay: Optional[Scalar] = None, beta1: Optional[Scalar] = None,
                       beta2: Optional[Scalar] = None, epsilon: Scalar = 1e-07) -> Tensor:
    """The updater term of PopART's AdamUpdater in ``mode`` (a ``popart.AdamMode`` or its
    name): Adam / Lamb bias-correct both moments with ``time_step`` (incremented in place),
    AdaMax the first one (``v`` is then the infinity norm, not square-rooted); the NoBias
    modes use the moments as they are. ``ins`` gets the ids of the tensor hyper-parameters at
    PopART's input indices (weight_decay 4, beta1 5, beta2 6, epsilon 7)."""
    name = str(getattr(mode, "name", mode))
    if name not in AdamMode.__members__:
        raise ValueError(f"Not a valid AdamMode: {mode}. Must choose from: {', '.join(AdamMode.__members__)}")
    for i, f in ((4, weight_decay), (5, beta1), (6, beta2), (7, epsilon)):
        handle_optimizer_value(f, ins, i)
    bias = name in _BIAS_CORRECTED
    if bias and time_step is None:
        raise ValueError(f"AdamMode.{name} requires time_step to not be None.")
    return _adam_updater(acc_first_order, acc_second_order, weight, time_step, weight_decay, beta1,
                         beta2 if name != "AdaMax" else None, epsilon, bias, name != "AdaMax")


def _adam_updater(m: Tensor, v: Tensor, weight: Optional[Tensor], time_step: Optional[Tensor],
                  weight_decay: Optional[Scalar], beta1: Optional[Scalar], beta2: Optional[Scalar],
                  epsilon: Scalar, bias_correction: bool, sqrt_v: bool) -> Tensor:
    """The updater term of AdamUpdater (see :func:`adam_updater`) in ``m``'s dtype, then the
    weight's (with weight decay)."""
    with_wd = weight_decay_is_required(weight_decay)
    if bias_correction:
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


def _moments_updater(kind: str, m: Tensor, v: Tensor, weight: Optional[Tensor], time_step: Optional[Tensor],
                     weight_decay: Optional[Scalar], beta1: Optional[Scalar], beta2: Optional[Scalar],
                     epsilon: Scalar) -> Tensor:
    """Adam's / LAMB's updater: mode ``kind`` with ``time_step``, ``kind``NoBias without."""
    ins = _ins(m, v, weight, time_step, weight_decay)
    if time_step is not None and (beta1 is None or beta2 is None):
        raise ValueError("Bias correction requires both beta1 and beta2 to not be None.")
    mode = AdamMode[kind if time_step is not None else kind + "NoBias"]
    return create_adamupdater(m, v, ins, mode, weight, time_step, weight_decay, beta1, beta2, epsilon)


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
    return _moments_updater("Adam", acc_first_order, acc_second_order, weight, time_step, weight_decay,
                            beta1, beta2, epsilon)


def lamb_updater(acc_first_order: Tensor, acc_second_order: Tensor, weight: Optional[Tensor] = None,
                 time_step: Optional[Tensor] = None, weight_decay: Optional[Scalar] = None,
                 beta1: Optional[Scalar] = None, beta2: Optional[Scalar] = None,
                 epsilon: Scalar = 1e-07) -> Tensor:
    """LAMB's updater term: the same as :func:`adam_updater` (LAMB's trust ratio is applied by
    :func:`adam_var_update` with the norms ``r1`` / ``r2``).

    Raises:
        ValueError: as :func:`adam_updater`.
    """
    return _moments_updater("Lamb", acc_first_order, acc_second_order, weight, time_step, weight_decay,
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
    ins = _ins(acc_first_order, acc_second_order, weight, time_step, weight_decay)
    if time_step is None:
        raise ValueError("AdaMax requires time_step to not be None.")
    return create_adamupdater(acc_first_order, acc_second_order, ins, AdamMode.AdaMax, weight,
                              time_step, weight_decay, beta1, None, epsilon)
