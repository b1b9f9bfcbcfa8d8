"""Private ops of the popxl front-end (domain ai.popxl): host stream transfers, the gradient
of a subgraph (VJP, differentiated by JAX), and random ops seeded by a uint32[2] seed tensor."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..tensorinfo import np_dtype
from . import losses
from .registry import LowerCtx, register

POPXL_DOMAIN = "ai.popxl"


def _p(name, **kw):
    return register(name, domain=POPXL_DOMAIN, **kw)


@_p("HostLoad")
def host_load(ctx: LowerCtx, buffer, counter, **_):
    """Element ``counter`` (mod the number of host transfers) of a stream buffer
    [transfers, *shape]; returns it and the incremented counter."""
    i = jnp.asarray(counter, jnp.int32) % buffer.shape[0]
    return lax.dynamic_index_in_dim(jnp.asarray(buffer), i, 0, keepdims=False), counter + 1


@_p("HostStore")
def host_store(ctx: LowerCtx, buffer, counter, x, **_):
    """Write ``x`` at element ``counter`` of a stream buffer; returns the buffer and the
    incremented counter."""
    i = jnp.asarray(counter, jnp.int32) % buffer.shape[0]
    buf = lax.dynamic_update_index_in_dim(jnp.asarray(buffer), jnp.asarray(x, buffer.dtype), i, 0)
    return buf, counter + 1


@_p("VJP")
def vjp(ctx: LowerCtx, *ins, fwd, provided, required, **_):
    """Gradients of forward inputs ``required`` given gradients of forward outputs
    ``provided``. Inputs: the output gradients, then every forward input."""
    grads, xs = list(ins[:len(provided)]), list(ins[len(provided):])

    def f(*req):
        full = list(xs)
        for i, v in zip(required, req):
            full[i] = v
        outs = ctx.run_subgraph(fwd, full)
        return [jnp.asarray(outs[i]) for i in provided]

    outs, pull = jax.vjp(f, *[jnp.asarray(xs[i]) for i in required])
    return list(pull([jnp.asarray(g, o.dtype).reshape(o.shape) for g, o in zip(grads, outs)]))


def _key(seed):
    s = jnp.asarray(seed).astype(jnp.uint32).reshape(-1)
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s[0]), s[-1])


def _float(dtype):
    dt = np_dtype(int(dtype))
    return dt, (jnp.float32 if dt.itemsize < 4 else dt)


@_p("RandomNormal", random=True)
def random_normal(ctx: LowerCtx, seed, shape=(), mean=0.0, scale=1.0, dtype=1, **_):
    dt, work = _float(dtype)
    return (jax.random.normal(_key(seed), tuple(shape), work) * scale + mean).astype(dt)


@_p("RandomUniform", random=True)
def random_uniform(ctx: LowerCtx, seed, shape=(), low=0.0, high=1.0, dtype=1, **_):
    dt, work = _float(dtype)
    return jax.random.uniform(_key(seed), tuple(shape), work, low, high).astype(dt)


@_p("Dropout", random=True)
def dropout(ctx: LowerCtx, x, seed, ratio=0.5, shape=None, **_):
    """Keep each element (or each element of a broadcast mask of ``shape``) with probability
    1 - ratio, scaled by 1 / (1 - ratio)."""
    if ratio == 0:
        return x
    keep = jax.random.uniform(_key(seed), tuple(shape) if shape else x.shape, jnp.float32) >= ratio
    return jnp.where(keep, x * jnp.asarray(1 / (1 - ratio), x.dtype), jnp.zeros((), x.dtype))


@_p("SplitRandomSeed", random=True)
def split_random_seed(ctx: LowerCtx, seed, **_):
    keys = jax.random.split(_key(seed), ctx.num_outputs)
    return [jax.random.bits(k, (2,), jnp.uint32) for k in keys]


@_p("NllWithSoftmaxGrad")
def nll_with_softmax_grad(ctx: LowerCtx, logits, labels, loss_grad, reduction="Mean", ignoreIndex=None, **_):
    """Nll of softmax(logits) and its gradient w.r.t. the logits, times ``loss_grad``: PopART's
    NlllWithSoftmaxGradDirect (loss -log(p + 1e-7), gradient (p - onehot) * loss_grad)."""
    f = lambda z: losses.softmax_nll(ctx, z, jax.nn.softmax(z, -1), labels, reduction, ignoreIndex)
    loss, pull = jax.vjp(f, logits)
    (dx,) = pull(jnp.broadcast_to(jnp.asarray(loss_grad, loss.dtype), loss.shape))
    return loss, dx
