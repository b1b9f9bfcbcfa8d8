"""ONNX's loss ops (ai.onnx): NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both take scores [N, C, d1..dk] and integer targets [N, d1..dk]. A target equal to
``ignore_index`` contributes nothing (and, with reduction "mean", is not counted); an optional
per-class ``weight`` [C] scales each term, and "mean" then divides by the sum of the weights of
the selected (not ignored) targets, as ONNX defines it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .registry import LowerCtx, register

_REDUCTIONS = ("none", "sum", "mean")


def nll(ctx: LowerCtx, logp, target, weight=None, ignore_index=None, reduction="mean"):
    """-logp[n, target[n, ...], ...] * weight[target], reduced as ONNX defines it."""
    if reduction not in _REDUCTIONS:
        raise ctx.error(f"reduction '{reduction}' is not one of {', '.join(_REDUCTIONS)}")
    if logp.ndim < 2 or target.shape != logp.shape[:1] + logp.shape[2:]:
        raise ctx.error(f"input shape {logp.shape} and target shape {target.shape} do not "
                        f"match: expected input [N, C, d1..dk] and target [N, d1..dk]")
    t = jnp.asarray(target).astype(jnp.int64)
    tc = jnp.clip(t, 0, logp.shape[1] - 1)   # ignored targets may lie outside [0, C)
    picked = jnp.take_along_axis(logp, tc[:, None], axis=1)[:, 0]
    w = None if weight is None else jnp.asarray(weight).astype(logp.dtype)[tc]
    if ignore_index is not None:
        keep = t != ignore_index
        w = jnp.where(keep, jnp.ones((), logp.dtype) if w is None else w, jnp.zeros((), logp.dtype))
    loss = -picked if w is None else -picked * w
    if reduction == "none":
        return loss
    if reduction == "sum" or w is None:
        return jnp.sum(loss) if reduction == "sum" else jnp.mean(loss)
    return (jnp.sum(loss) / jnp.sum(w)).astype(logp.dtype)


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(ctx: LowerCtx, x, target, weight=None, ignore_index=None,
                                 reduction="mean", **_):
    return nll(ctx, x, target, weight, ignore_index, reduction)


@register("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(ctx: LowerCtx, x, target, weight=None, ignore_index=None,
                               reduction="mean", **_):
    """Output 1 (optional) is the log-softmax over the class axis."""
    logp = jax.nn.log_softmax(x, axis=1)
    loss = nll(ctx, logp, target, weight, ignore_index, reduction)
    return (loss, logp) if ctx.num_outputs > 1 and ctx.output_ids[1] else loss
