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
from .graphcore import print_to_stderr
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


_NO_FP8_GRAD = {   # getGradOps of PopART's float8 ops (op/pow2scalethencast.cpp, castthenpow2scale.cpp,
    # matmul.cpp, conv.cpp)
    "cast": "Floating point 8 is not supported for training. This is for op {}.",
    "matmul": "Using a scaled matmul in a backwards pass is currently not supported.",
    "conv": "Using a scaled convolution in a backwards pass is currently not supported."}


@_p("Pow2ScaleThenCast")
def pow2scale_then_cast(ctx: LowerCtx, x, log2_scale, to=1, saturate=0, no_grad="", **_):
    """``cast(x * 2**log2_scale, to)``: the product exact in float32 (float64 for float64
    data), then one rounding to ``to``. Float8 results out of range are NaN, or the largest
    finite value with ``saturate``. popxl's float8 casts and pow2-scaled matmul / conv. A
    log2_scale outside [-32, 32) fails the run, as PopART's
    ``throwIfLog2ScaleTensorNotInRange`` (default on) makes it. ``no_grad`` ("cast",
    "matmul", "conv"): differentiating the op raises PopART's error for that float8 op."""
    from .math import saturate_cast
    dt = np_dtype(int(to))
    x = jnp.asarray(x)
    s = jnp.asarray(log2_scale).astype(jnp.int32).reshape(())
    ctx.check((s < -32) | (s >= 32), "Log2 scale is not in the range [-32, 32). (log2_scale "
                                     "{log2_scale})", log2_scale=s)
    work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    y = x.astype(work) * jnp.ldexp(jnp.ones((), work), s)
    y = saturate_cast(y, dt, saturate) if dt.name.startswith("float8") else y.astype(dt)
    if not no_grad:
        return y

    @jax.custom_vjp
    def f(v):
        return y

    def bwd(_, g):
        from ..errors import popart_exception
        raise popart_exception(_NO_FP8_GRAD[no_grad].format(ctx.name))
    f.defvjp(lambda v: (y, None), bwd)
    return f(x)


# ---------------------------------------------------------------------------------------
# popxl.ops.interpolate: PopART's ai.graphcore Resize (op/resize.cpp, popx/op/resizex.cpp)

def _resize_coord(i: np.ndarray, coord: str, scale: np.float32, n_in: int) -> np.ndarray:
    """resizex.cpp's coordinateTransformation, in float32 as there (a coordinate that lands
    on .5 in float32 rounds as PopART's does)."""
    i, one, half = i.astype(np.float32), np.float32(1), np.float32(0.5)
    size = np.float32(n_in) * scale
    if coord == "half_pixel" or (coord == "pytorch_half_pixel" and size > one):
        return (i + half) / scale - half
    if coord == "asymmetric":
        return i / scale
    if coord == "align_corners" and size != one:
        return i * np.float32(n_in - 1) / (size - one)
    return np.zeros_like(i)


_ROUND = {"round_prefer_floor": lambda v: np.where(v - np.floor(v) <= 0.5, np.floor(v), np.ceil(v)),
          "round_prefer_ceil": lambda v: np.sign(v) * np.floor(np.abs(v) + 0.5),   # std::round
          "floor": np.floor, "ceil": np.ceil}


def _cubic_coeffs(r: np.ndarray, a: float = -0.75) -> np.ndarray:
    """ResizeCubicHelper::cubicCoeffs: weights of the taps at offsets -1, 0, 1, 2."""
    q = 1 - r
    return np.stack([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                     ((a + 2) * r - (a + 3)) * r * r + 1, ((a + 2) * q - (a + 3)) * q * q + 1,
                     ((a * (q + 1) - 5 * a) * (q + 1) + 8 * a) * (q + 1) - 4 * a], -1)


def _resize_matrix(n_in: int, n_out: int, scale: np.float32, mode: str, nearest: str,
                   coord: str) -> np.ndarray:
    """[n_out, n_in] weights of ResizeOpx along one axis (edge indices clamped): nearest
    (resizeNearest1D), linear (floor and ceil neighbours weighted by the fraction of
    max(x, 0)), cubic (four taps, a = -0.75)."""
    x = _resize_coord(np.arange(n_out), coord, scale, n_in)
    rows, m = np.arange(n_out), np.zeros((n_out, n_in))
    clip = lambda k: np.clip(k, 0, n_in - 1).astype(np.int64)
    if mode == "nearest":
        m[rows, clip(_ROUND[nearest](x))] = 1
    elif mode == "linear":
        f = (np.maximum(x, 0) - np.floor(np.maximum(x, 0))).astype(np.float64)
        np.add.at(m, (rows, clip(np.floor(x))), 1 - f)
        np.add.at(m, (rows, clip(np.ceil(x))), f)
    else:
        base = np.floor(x)
        w = _cubic_coeffs((x - base).astype(np.float64))
        for k in range(4):
            np.add.at(m, (rows, clip(base + k - 1)), w[:, k])
    return m


def _resize_dim(y, ax: int, m: np.ndarray, nearest: bool):
    """Apply one axis's weights ``m`` [n_out, n_in] (a gather for nearest: exact in every
    dtype)."""
    if nearest:
        return jnp.take(y, jnp.asarray(m.argmax(1)), axis=ax)
    work = jnp.float32 if y.dtype == jnp.float16 else y.dtype
    out = jnp.tensordot(y.astype(work), jnp.asarray(m, work), ((ax,), (1,)), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(out, -1, ax).astype(y.dtype)


def _nearest_grad_dim(g, ax: int, n_in: int, scale: np.float32):
    """ResizeGradOpx's nearest rule for one axis: output gradient i goes to input position
    floor(i / scale) (float32), summed when upsampling (reduceDimension), the last one
    kept when downsampling (padDimension), whatever the nearest or coordinate mode."""
    n_out = g.shape[ax]
    idx = np.floor(np.arange(n_out, dtype=np.float32) * (np.float32(1) / scale)).astype(np.int64)
    gm = jnp.moveaxis(g, ax, 0)
    if n_out > n_in:
        out = jax.ops.segment_sum(gm, jnp.asarray(idx), n_in)
    else:
        src = np.full(n_in, -1)
        for i, j in enumerate(idx):
            if j < n_in:
                src[j] = i
        keep = jnp.asarray(src >= 0).reshape((n_in,) + (1,) * (gm.ndim - 1))
        out = jnp.where(keep, gm[jnp.asarray(np.maximum(src, 0))], jnp.zeros((), g.dtype))
    return jnp.moveaxis(out, 0, ax)


@_p("Resize")
def resize(ctx: LowerCtx, x, *, scales, mode="nearest", nearest_mode="round_prefer_floor",
           coordinate_transformation_mode="half_pixel", **_):
    """Output size floor(n * scale) (float32); each axis whose scale is not 1 resized as
    ResizeOpx does (``_resize_matrix``; ONNX Resize's rules with the given scale, the
    coordinates in float32, cubic with a = -0.75 and edge pixels repeated). Gradients: nearest by
    ResizeGradOpx's rule (``_nearest_grad_dim``), cubic the exact transpose; linear has no
    gradient in PopART ("Resize mode 'linear' is not supported when training.")."""
    from ..errors import popart_exception
    sc = [np.float32(s) for s in scales]
    if len(sc) != x.ndim:
        raise popart_exception(f"The number of dimensions of the resize op scales ({len(sc)}) must "
                               f"match the number of dimensions of the input ({x.ndim})")
    if coordinate_transformation_mode == "tf_crop_and_resize":
        raise popart_exception("Unsupported coordinate transformation mode")
    outs = [int(np.floor(np.float32(n) * s)) for n, s in zip(x.shape, sc)]

    mats = {ax: _resize_matrix(n, outs[ax], s, mode, nearest_mode, coordinate_transformation_mode)
            for ax, (n, s) in enumerate(zip(x.shape, sc)) if s != 1}

    def fwd(v):
        for ax, m in mats.items():
            v = _resize_dim(v, ax, m, mode == "nearest")
        return v
    if mode == "cubic":
        return fwd(x)

    @jax.custom_vjp
    def f(v):
        return fwd(v)

    def bwd(_, g):
        if mode == "linear":
            raise popart_exception("Resize mode 'linear' is not supported when training.")
        for ax, n in enumerate(x.shape):
            if outs[ax] != n:
                g = _nearest_grad_dim(g, ax, n, sc[ax])
        return (g,)
    f.defvjp(lambda v: (f(v), None), bwd)
    return f(x)


@_p("PrintGradient")
def print_gradient(ctx: LowerCtx, x, title="", **_):
    """Identity whose gradient is printed at run time (popxl's print_tensor with
    ``print_self=False, print_gradient=True``)."""
    head = "Gradient of " + (title or ctx.input_ids[0]).replace("{", "{{").replace("}", "}}") + ": {}"

    @jax.custom_vjp
    def f(v):
        return v

    def bwd(_, g):
        print_to_stderr(head, g)
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
