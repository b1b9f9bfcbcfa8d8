"""Private ops of the popxl front-end (domain ai.popxl): host stream transfers, remote buffer
loads and stores, the gradient of a subgraph (VJP, differentiated by JAX), random ops seeded
by a uint32[2] seed tensor, and the power-of-two scaled casts of popxl's float8 ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..tensorinfo import np_dtype
from . import losses
from .registry import LowerCtx, is_static, register

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
        outs, record = ctx.run_body(fwd, full)
        return [jnp.asarray(outs[i]) for i in provided], record

    outs, pull, record = jax.vjp(f, *[jnp.asarray(xs[i]) for i in required], has_aux=True)
    ctx.check_record(record)   # the forward graph's run-time checks
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
def nll_with_softmax_grad(ctx: LowerCtx, probs, labels, loss_grad, reduction="Mean", ignoreIndex=None, **_):
    """popxl's nll_loss_with_softmax_grad: PopART's NlllWithSoftmaxGradDirect on ``probs``
    that are already softmax outputs (``losses.nll_with_softmax_grad_direct``)."""
    return losses.nll_with_softmax_grad_direct(ctx, probs, labels, loss_grad, reduction, ignoreIndex)


@_p("Pow2ScaleThenCast")
def pow2scale_then_cast(ctx: LowerCtx, x, log2_scale, to=1, saturate=0, **_):
    """``cast(x * 2**log2_scale, to)``: the product exact in float32 (float64 for float64
    data), then one rounding to ``to``. Float8 results out of range are NaN, or the largest
    finite value with ``saturate``. popxl's float8 casts and pow2-scaled matmul / conv."""
    from .math import saturate_cast
    dt = np_dtype(int(to))
    x = jnp.asarray(x)
    work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    y = x.astype(work) * jnp.ldexp(jnp.ones((), work), jnp.asarray(log2_scale).astype(jnp.int32))
    return saturate_cast(y, dt, saturate) if dt.name.startswith("float8") else y.astype(dt)


@_p("PrintGradient")
def print_gradient(ctx: LowerCtx, x, title="", **_):
    """Identity whose gradient is printed at run time (popxl's print_tensor with
    ``print_self=False, print_gradient=True``)."""
    head = "Gradient of " + (title or ctx.input_ids[0]).replace("{", "{{").replace("}", "}}") + ": {}"

    @jax.custom_vjp
    def f(v):
        return v

    def bwd(_, g):
        jax.debug.print(head, g)
        return (g,)
    f.defvjp(lambda v: (v, None), bwd)
    return f(x)


# ---------------------------------------------------------------------------------------
# Remote buffers: the buffer [entries, *shape] is an input (hidden state the session keeps
# between runs, see popxl/ops/remote.py); RemoteStore returns its new value.

def _remote_entry(ctx: LowerCtx, buffer, offset, bufferid):
    """The entry ``offset`` names: checked now when it is known, else when the program runs
    (an offset out of [0, entries) fails the run)."""
    n = int(buffer.shape[0])
    if is_static(offset):
        i = int(np.asarray(offset).reshape(-1)[0])
        if not 0 <= i < n:
            raise ctx.error(f"offset {i} is out of range for remote buffer {bufferid} with {n} "
                            f"entries")
        return i
    i = jnp.asarray(offset).reshape(-1)[0].astype(jnp.int64)
    ctx.check((i < 0) | (i >= n), f"offset {{offset}} is out of range for remote buffer "
                                  f"{bufferid} with {n} entries", offset=i)
    return jnp.clip(i, 0, n - 1).astype(jnp.int32)


@_p("RemoteLoad")
def remote_load(ctx: LowerCtx, buffer, offset, bufferid=0, **_):
    """Entry ``offset`` of remote buffer ``buffer``."""
    i = _remote_entry(ctx, buffer, offset, bufferid)
    return lax.dynamic_index_in_dim(jnp.asarray(buffer), i, 0, keepdims=False)


@_p("RemoteStore")
def remote_store(ctx: LowerCtx, buffer, offset, x, bufferid=0, **_):
    """The remote buffer with entry ``offset`` set to ``x``."""
    i = _remote_entry(ctx, buffer, offset, bufferid)
    buf = jnp.asarray(buffer)
    return lax.dynamic_update_index_in_dim(buf, jnp.asarray(x).astype(buf.dtype).reshape(buf.shape[1:]), i, 0)
