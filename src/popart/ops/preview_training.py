"""Optimizer ops of ai.onnx.preview.training: Adagrad, Adam, Momentum (standard / nesterov).

Each takes the learning rate R and update count T (scalars) followed by n tensors to optimize,
then their n gradients, then one or two groups of n accumulators, and returns the n updated
tensors followed by the n updated accumulators of each group; the formulas are those of the
ONNX operator docs, applied to each tensor independently. R- and T-dependent scalars are
computed in float64 and cast to each tensor's dtype. Attribute defaults are not filled in from
onnx.defs for this domain, so they are keyword defaults here (Momentum's are required)."""
from __future__ import annotations

import jax.numpy as jnp

from .registry import LowerCtx, register

DOMAIN = "ai.onnx.preview.training"


def _groups(ctx: LowerCtx, args, k):
    """Split the inputs after R, T into k groups of n (X, G, then k-2 accumulator groups)."""
    if len(args) < k or len(args) % k:
        raise ctx.error(f"expected R, T and {k} groups of equally many tensors, got "
                        f"{len(args) + 2} inputs")
    n = len(args) // k
    return [args[i * n:(i + 1) * n] for i in range(k)]


def _scalar(v, x):
    return jnp.asarray(v).astype(jnp.result_type(x))


def _rt(r, t):
    return jnp.reshape(jnp.asarray(r), ()).astype(jnp.float64), jnp.reshape(jnp.asarray(t), ()).astype(jnp.float64)


@register("Adagrad", domain=DOMAIN, since=1)
def adagrad(ctx: LowerCtx, r, t, *args, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0, **_):
    xs, gs, hs = _groups(ctx, args, 3)
    r, t = _rt(r, t)
    lr = r / (1 + t * decay_factor)
    x_new, h_new = [], []
    for x, g, h in zip(xs, gs, hs):
        gr = _scalar(norm_coefficient, x) * x + g
        hn = h + gr * gr
        x_new.append(x - _scalar(lr, x) * gr / (jnp.sqrt(hn) + _scalar(epsilon, x)))
        h_new.append(hn.astype(jnp.result_type(h)))
    return tuple(x_new + h_new)


@register("Adam", domain=DOMAIN, since=1)
def adam(ctx: LowerCtx, r, t, *args, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0, **_):
    xs, gs, vs, hs = _groups(ctx, args, 4)
    r, t = _rt(r, t)
    safe_t = jnp.where(t > 0, t, 1.0)
    lr = jnp.where(t > 0, r * jnp.sqrt(1 - beta ** safe_t) / (1 - alpha ** safe_t), r)
    x_new, v_new, h_new = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        c = lambda a: _scalar(a, x)  # noqa: E731
        gr = c(norm_coefficient) * x + g
        vn = c(alpha) * v + c(1 - alpha) * gr
        hn = c(beta) * h + c(1 - beta) * gr * gr
        xn = x - c(lr) * vn / (jnp.sqrt(hn) + c(epsilon))
        x_new.append(c(1 - norm_coefficient_post) * xn)
        v_new.append(vn.astype(jnp.result_type(v)))
        h_new.append(hn.astype(jnp.result_type(h)))
    return tuple(x_new + v_new + h_new)


@register("Momentum", domain=DOMAIN, since=1)
def momentum(ctx: LowerCtx, r, t, *args, alpha=None, beta=None, mode=None, norm_coefficient=None, **_):
    missing = [k for k, v in (("alpha", alpha), ("beta", beta), ("mode", mode),
                              ("norm_coefficient", norm_coefficient)) if v is None]
    if missing:
        raise ctx.error(f"required attribute(s) {', '.join(missing)} missing")
    if mode not in ("standard", "nesterov"):
        raise ctx.error(f"mode '{mode}' is not one of standard, nesterov")
    xs, gs, vs = _groups(ctx, args, 3)
    r, t = _rt(r, t)
    beta_adj = jnp.where(t > 0, beta, 1.0)
    x_new, v_new = [], []
    for x, g, v in zip(xs, gs, vs):
        gr = _scalar(norm_coefficient, x) * x + g
        vn = _scalar(alpha, x) * v + _scalar(beta_adj, x) * gr
        step = vn if mode == "standard" else gr + _scalar(alpha, x) * vn
        x_new.append(x - _scalar(r, x) * step)
        v_new.append(vn.astype(jnp.result_type(v)))
    return tuple(x_new + v_new)
