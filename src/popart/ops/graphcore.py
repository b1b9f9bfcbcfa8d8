"""PopART's own ops (domain ai.graphcore, opset 1), as the API reference's aiGraphcore builder
methods document them. Attribute names are the reference's keyword names; their defaults come
from the table in ``popart._ir.graphcore_schema`` (the engine fills them in), so the lowerings
of the ops it lists take those attributes as keyword-only parameters without defaults
(``None`` for an optional attribute the table leaves unset)."""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import poplar_application_runtime_error
from ..tensorinfo import np_dtype
from . import nn, reduce
from .elementwise import gelu_tanh, with_popart_grad
from .registry import (add, GRAPHCORE_DOMAIN, LowerCtx, opid, platform_lowering, popart_error,
                       register, shape_text)


def _g(name, **kw):
    return register(name, domain=GRAPHCORE_DOMAIN, **kw)


def _cast(v, x):
    return jnp.asarray(v).astype(jnp.result_type(x))


# ---------------------------------------------------------------------------------------
# Elementwise: one row each

def _atan2_grad(g, out, a, b):
    """Atan2Arg0GradOpPattern g * b / (a^2 + b^2), Atan2Arg1GradOpPattern g * -a / (a^2 +
    b^2); 0 for both where a = b = 0 (PyTorch's value there, not the patterns' 0 / 0)."""
    d = a * a + b * b
    d = jnp.where(d == 0, jnp.ones((), d.dtype), d)
    return g * (b / d), g * (-a / d)


UNARY = {
    "Gelu": gelu_tanh,        # PopART's (popnn GELU) gradient
    "GeluErf": lambda x: jax.nn.gelu(x, approximate=False),
    "Detach": lax.stop_gradient,
    "UnaryZeroGrad": lax.stop_gradient,
    "Nop": lambda x: x,
    "TensorRemap": lambda x: x,
    "AutoLossScaleProxy": lambda x: x,
    "Expm1": jnp.expm1,
    "Log1p": jnp.log1p,
    "Swish": lambda x: x * jax.nn.sigmoid(x),
    "Square": lambda x: x * x,
    "Round": jnp.round,       # half to even, like ai.onnx Round-11
    "NearbyInt": jnp.round,   # rint: the default rounding mode rounds half to even
    "BitwiseNot": jnp.bitwise_not,
    "ZerosLike": jnp.zeros_like,
}
BINARY = {
    "Atan2": with_popart_grad(jnp.arctan2, _atan2_grad),
    "Remainder": lambda a, b: jnp.remainder(a, _cast(b, a)),  # sign of the divisor
    "Fmod": lambda a, b: jnp.fmod(a, _cast(b, a)),            # sign of the dividend
    "BitwiseAnd": jnp.bitwise_and,
    "BitwiseOr": jnp.bitwise_or,
    "BitwiseXor": jnp.bitwise_xor,
    "BitwiseXnor": lambda a, b: jnp.bitwise_not(jnp.bitwise_xor(a, b)),
    "AddLhsInplace": jnp.add,
}
_INT_ONLY = {"BitwiseNot", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseXnor"}


def _row(name, fn, arity):
    def lower(ctx: LowerCtx, *xs, **_):
        if name in _INT_ONLY and not all(jnp.issubdtype(jnp.result_type(x), jnp.integer) for x in xs):
            raise ctx.error(f"inputs must be integer tensors, got {[str(jnp.result_type(x)) for x in xs]}")
        return fn(*xs[:arity])
    add(name, lower, domain=GRAPHCORE_DOMAIN)


for _n, _f in UNARY.items():
    _row(_n, _f, 1)
for _n, _f in BINARY.items():
    _row(_n, _f, 2)


@_g("Scale")
def scale(ctx: LowerCtx, x, *, scale, **_):
    return x * _cast(scale, x)


@_g("ScaledAdd")
def scaled_add(ctx: LowerCtx, a, b, s0=None, s1=None, *, scale0, scale1, **_):
    s0 = scale0 if s0 is None else s0
    s1 = scale1 if s1 is None else s1
    return a * _cast(s0, a) + b * _cast(s1, a)


_BCS_OPS = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
            "pow": jnp.power}


@_g("BinaryConstScalar")
def binary_const_scalar(ctx: LowerCtx, x, value=0.0, op="Add", scalar_in_lhs=0, **_):
    fn = _BCS_OPS.get(str(op).lower())
    if fn is None:
        raise ctx.error(f"op '{op}' is not one of Add, Sub, Mul, Div, Pow")
    v = _cast(value, x)
    return fn(v, x) if scalar_in_lhs else fn(x, v)


@_g("IncrementMod")
def increment_mod(ctx: LowerCtx, x, *, increment, modulus, **_):
    """(x + increment) rem modulus, the remainder with the dividend's sign (popops Rem)."""
    return jnp.fmod(x + _cast(increment, x), _cast(modulus, x))


@_g("Bucketize")
def bucketize(ctx: LowerCtx, x, boundaries, *, right, **_):
    """right=0: boundaries[i-1] < x <= boundaries[i]; right=1: boundaries[i-1] <= x < boundaries[i]."""
    return jnp.searchsorted(boundaries, x, side="right" if right else "left").astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# Shape-like ops with attributes

@_g("Reshape")
def reshape(ctx: LowerCtx, x, *, shape, **_):
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return jnp.reshape(x, shape)


@_g("Reverse")
def reverse(ctx: LowerCtx, x, *, dimensions, **_):
    """ReverseBaseOp::setup's checks: dimensions in [0, rank), each at most once."""
    op, seen = f"{ctx.name} ({opid(ctx)})", set()
    for d in dimensions:
        if d < 0:
            msg = f"ReverseOp '{op}' invalid dimension '{d}'. Only positive dimensions are supported"
        elif d >= x.ndim:
            msg = f"ReverseOp '{op}' invalid dimension '{d}' for input tensor of rank {x.ndim}"
        elif d in seen:
            msg = f"Dimension {d} appears multiple times in the list of dimensions of ReverseOp '{op}'"
        else:
            seen.add(d)
            continue
        raise popart_error(ctx, msg, f"dimensions {list(dimensions)}: each in [0, {x.ndim}) once")
    return jnp.flip(x, tuple(dimensions)) if dimensions else x


@_g("Slice")
def slice_(ctx: LowerCtx, x, *, starts, ends, axes=None, **_):
    """x[starts:ends] on ``axes`` (absent or empty: the leading len(starts) axes, as PopART)."""
    idx = [slice(None)] * x.ndim
    for s, e, a in zip(starts, ends, axes if axes else range(len(starts))):
        idx[a] = slice(s, e)
    return x[tuple(idx)]


@_g("Subsample")
def subsample(ctx: LowerCtx, x, *, strides, **_):
    """x[::s0, ::s1, ...]; SubsampleBaseOp::setup's check of a 0 stride."""
    if 0 in strides:
        raise popart_error(ctx, f"Strides invalid. 0 stride at index {list(strides).index(0)}",
                           f"strides {list(strides)}")
    return x[tuple(slice(None, None, s) for s in strides)]


@_g("DepthToSpace")
def depth_to_space(ctx: LowerCtx, x, *, blocksize, mode, **_):
    n, c, h, w = x.shape
    b = blocksize
    if mode == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise ctx.error(f"mode '{mode}' is not DCR or CRD")
    return y.reshape(n, c // (b * b), h * b, w * b)


@_g("Zeros")
def zeros(ctx: LowerCtx, shape=(), dtype=1, **_):
    return jnp.zeros(tuple(shape), np_dtype(dtype))


@_g("Init")
def init(ctx: LowerCtx, shape=(), data_type=1, tensor_type=None, init_type=1, batch_axis=None, **_):
    """InitType Zero (1) and NoInit (0) both give zeros (NoInit's content is undefined)."""
    return jnp.zeros(tuple(shape), np_dtype(data_type))


# ---------------------------------------------------------------------------------------
# Dynamic slicing: ``offset`` holds one start per entry of ``axes``

def _dyn_starts(x, offset, axes):
    starts = [jnp.zeros((), jnp.int32)] * x.ndim
    off = jnp.asarray(offset).reshape(-1).astype(jnp.int32)
    for i, a in enumerate(axes):
        starts[a % x.ndim] = off[i]
    return starts


def _dyn_sizes(x, axes, sizes):
    full = list(x.shape)
    for a, s in zip(axes, sizes):
        full[a % x.ndim] = s
    return full


@_g("DynamicSlice")
def dynamic_slice(ctx: LowerCtx, x, offset, slice_in=None, *, axes, sizes, **_):
    """The slice of x at ``offset``; the optional third input is the tensor PopART writes
    the slice into (DynamicSliceOp's getSliceInIndex): of the slice's shape, its values
    overwritten (no gradient reaches it)."""
    out = lax.dynamic_slice(x, _dyn_starts(x, offset, axes), _dyn_sizes(x, axes, sizes))
    if slice_in is not None and tuple(jnp.shape(slice_in)) != out.shape:
        raise popart_error(ctx, f"DynamicSliceOp: the slice input '{ctx.input_ids[2]}' has shape "
                           f"{list(jnp.shape(slice_in))}, but the slice has shape "
                           f"{list(out.shape)}", "the third input must have the slice's shape")
    return out


@_g("NoOverlapGradGate")
def no_overlap_grad_gate(ctx: LowerCtx, x, *offsets, regions, **_):
    """x unchanged; in the backward pass its gradient is zeroed in each region (``regions``:
    one (axes, sizes) per offset), so that a noOverlap DynamicSlice's gradient overwrites
    it there. Inserted by ``popart._ir.transforms.overwrite_no_overlap_grads``."""
    def zeroed(g, offs):
        for off, (axes, sizes) in zip(offs, regions):
            g = dynamic_zero(ctx, g, off, axes=axes, sizes=sizes)
        return g

    @jax.custom_vjp
    def gate(x, offs):
        return x

    gate.defvjp(lambda x, offs: (x, offs), lambda offs, g: (zeroed(g, offs), None))
    return gate(x, tuple(offsets))


@_g("DynamicUpdate")
def dynamic_update(ctx: LowerCtx, x, offset, upd, *, axes, **_):
    return lax.dynamic_update_slice(x, upd.astype(x.dtype), _dyn_starts(x, offset, axes))


@_g("DynamicAdd")
def dynamic_add(ctx: LowerCtx, x, offset, upd, *, axes, **_):
    st = _dyn_starts(x, offset, axes)
    cur = lax.dynamic_slice(x, st, upd.shape)
    return lax.dynamic_update_slice(x, cur + upd.astype(x.dtype), st)


@_g("DynamicZero")
def dynamic_zero(ctx: LowerCtx, x, offset, *, axes, sizes, **_):
    return lax.dynamic_update_slice(x, jnp.zeros(_dyn_sizes(x, axes, sizes), x.dtype),
                                    _dyn_starts(x, offset, axes))


@_g("SequenceSlice")
def sequence_slice(ctx: LowerCtx, src, dst, n, src_off, dst_off, *, zeroUnused, **_):
    """dst[dOff:dOff+N] = src[sOff:sOff+N] for each (N, sOff, dOff); entries after the first
    N == 0 are ignored."""
    s2, d2 = src.reshape(src.shape[0], -1), dst.reshape(dst.shape[0], -1)
    n, so, do = (jnp.asarray(v).reshape(-1).astype(jnp.int32) for v in (n, src_off, dst_off))
    live = jnp.cumprod(n != 0) > 0
    r = jnp.arange(d2.shape[0])[:, None]
    hit = live[None] & (r >= do[None]) & (r < (do + n)[None])          # [R, K]
    k = jnp.argmax(hit, 1)
    any_hit = jnp.any(hit, 1)
    rows = jnp.clip(so[k] + r[:, 0] - do[k], 0, s2.shape[0] - 1)
    base = jnp.zeros_like(d2) if zeroUnused else d2
    return jnp.where(any_hit[:, None], s2[rows].astype(dst.dtype), base).reshape(dst.shape)


# ---------------------------------------------------------------------------------------
# Normalization, convolution

@_g("GroupNormalization")
def group_normalization(ctx: LowerCtx, x, scale, bias, *, num_groups, epsilon, **_):
    """Outputs y, mean and inverse standard deviation, the last two of shape [N * groups].
    As PopART's GroupNormGradOp, only y is differentiated (the textbook gradient, which
    autodiff gives): mean and inverse standard deviation pass no gradient back. With the
    session option ``groupNormStridedChannelGrouping`` (poplibs' strided grouping) group g
    holds the channels c with c % num_groups == g instead of a block of neighbours."""
    strided = ctx.config is not None and ctx.config.group_norm_strided
    c = x.shape[1]
    perm = np.arange(c).reshape(c // num_groups, num_groups).T.reshape(-1) if strided else None
    y, m, inv = nn._group_norm(x if perm is None else x[:, perm], num_groups, epsilon)
    if perm is not None:   # back to the channels' own order
        y = y[:, np.argsort(perm)]
    y = y * nn._bcast(scale, x) + nn._bcast(bias, x)
    m, inv = lax.stop_gradient(m), lax.stop_gradient(inv)
    return y, m.reshape(-1).astype(x.dtype), inv.reshape(-1).astype(x.dtype)


@_g("BatchNormalization")
def batch_normalization(ctx: LowerCtx, x, scale, b, mean, var, *, epsilon, momentum, **_):
    """ONNX's BatchNormalization, except the running variance uses the unbiased (N-1)
    batch variance, like PyTorch."""
    outs = nn.batch_norm(ctx, x, scale, b, mean, var, epsilon, momentum, ctx.training,
                         unbiased_running=True)
    return outs if ctx.training else outs[0]


@_g("MultiConv")
def multi_conv(ctx: LowerCtx, *ins, dilations=(), inDilations=(), pads=(), outPads=(), strides=(), **_):
    """Independent convolutions; inputs [X0, W0, B0, X1, W1, B1, ...] (or pairs without
    biases). List attributes are per convolution, nested or flattened as PopART's
    MultiConvBaseOp keeps them: convolution i's entries start after those of the ones before
    it (its spatial rank each, pads twice that), so convolutions of different ranks mix."""
    n = ctx.num_outputs
    per = len(ins) // n
    outs, before = [], 0   # spatial dimensions of the convolutions before this one
    for i in range(n):
        x, w, b = (list(ins[i * per:(i + 1) * per]) + [None])[:3]
        sp = x.ndim - 2

        def pick(v, k):
            if not v:
                return None
            if isinstance(v[0], (list, tuple)):
                return list(v[i]) or None
            return list(v[before * k:(before + sp) * k]) or None
        ind, op = pick(inDilations, 1), pick(outPads, 2)
        if (ind and any(d != 1 for d in ind)) or (op and any(p != 0 for p in op)):
            raise ctx.error("inDilations / outPads other than 1 / 0 are not supported")
        g = x.shape[1] // w.shape[1]
        outs.append(platform_lowering(ctx, "Conv")(ctx, x, w, b, dilations=pick(dilations, 1), group=g,
                            pads=pick(pads, 2), strides=pick(strides, 1)))
        before += sp
    return outs


@_g("NormalizeImage")
@_g("Normalize_Image")  # the op type earlier versions of the Builder wrote
def normalize_image(ctx: LowerCtx, img, offsets, scales, *, scale, **_):
    """(img * scale - offsets) * scales on the 3 channels of a (B, H, W, 3) image, padded
    with a zero fourth channel; uint8 images give float16."""
    dt = jnp.float16 if img.dtype == jnp.uint8 else img.dtype
    y = (img.astype(dt) * _cast(scale, jnp.zeros((), dt)) - offsets.astype(dt)) * scales.astype(dt)
    return jnp.concatenate([y, jnp.zeros(y.shape[:-1] + (4 - y.shape[-1],), dt)], -1)


# ---------------------------------------------------------------------------------------
# Sorting, selection, scatter / gather

@_g("Sort")
def sort(ctx: LowerCtx, x, *, axis, descending, **_):
    idx = jnp.argsort(x, axis=axis, stable=True, descending=bool(descending))
    return jnp.take_along_axis(x, idx, axis), idx.astype(jnp.int32)


@_g("TopK")
def topk(ctx: LowerCtx, x, k, axis=-1, largest=1, sorted=1, **_):
    k = int(ctx.static(k, "TopK k").reshape(()))
    idx = jnp.argsort(x, axis=axis, stable=True, descending=bool(largest))
    idx = lax.slice_in_dim(idx, 0, k, axis=axis % x.ndim)
    return jnp.take_along_axis(x, idx, axis), idx.astype(jnp.int64)


@_g("ReduceMedian")
def reduce_median(ctx: LowerCtx, x, *, axes=None, keepdims, **_):
    """Lower median; indices flattened over the reduced axes. ReduceOp's axes: absent reduce
    every axis, empty none, others checked (validateReduceAxes)."""
    if axes is not None:
        reduce.check_reduce_axes(ctx, list(axes), x.ndim)
    axes = sorted({a % x.ndim for a in (range(x.ndim) if axes is None else axes)})
    keep = [a for a in range(x.ndim) if a not in axes]
    t = jnp.transpose(x, keep + axes).reshape([x.shape[a] for a in keep] + [-1])
    order = jnp.argsort(t, -1, stable=True)
    mid = (t.shape[-1] - 1) // 2
    i = order[..., mid]
    v = jnp.take_along_axis(t, i[..., None], -1)[..., 0]
    if keepdims:
        shp = [1 if a in axes else x.shape[a] for a in range(x.ndim)]
        v, i = v.reshape(shp), i.reshape(shp)
    return v, i.astype(jnp.int32)


_SCATTER = {"sum": 0, "max": 1, "min": 2, "mul": 3, "none": 4, "noreduction": 4}


def _scatter_reduction(ctx: LowerCtx, r):
    k = _SCATTER.get(r.lower()) if isinstance(r, str) else int(r)
    if k is None or not 0 <= k <= 4:
        raise ctx.error(f"reduction '{r}' is not one of Sum, Max, Min, Mul, None")
    return k


def _scatter(ctx: LowerCtx, src, index, init, axis_size, axis, reduction, enable_index_broadcast):
    axis %= src.ndim
    red = _scatter_reduction(ctx, reduction)
    if index.ndim == 1 and src.ndim > 1 and enable_index_broadcast:
        index = index.reshape((1,) * axis + (-1,) + (1,) * (src.ndim - axis - 1))
    index = jnp.broadcast_to(index, src.shape).astype(jnp.int32)
    s = jnp.moveaxis(src, axis, -1)
    ix = jnp.moveaxis(index, axis, -1)
    lead = s.shape[:-1]
    s2, ix2 = s.reshape(-1, s.shape[-1]), ix.reshape(-1, s.shape[-1])
    base = None
    if init is not None:
        base = jnp.moveaxis(jnp.asarray(init), axis, -1).reshape(-1, axis_size).astype(src.dtype)
    # Sum's autodiff is PopART's rule already; the others take ScatterReduceGradOp's
    rows_fn = _scatter_rows_grad if red and jnp.issubdtype(src.dtype, jnp.floating) else _scatter_rows
    out = rows_fn(s2, ix2, base, red, axis_size)
    return jnp.moveaxis(out.reshape(lead + (axis_size,)), -1, axis)


def _scatter_rows(s2, ix2, base, red: int, axis_size: int):
    """Row r of ``s2`` [R, n] reduced (``red``: _SCATTER's codes) into row r of an [R, axis_size]
    output at columns ``ix2`` [R, n], starting from ``base`` when given."""
    rows = jnp.arange(s2.shape[0])[:, None]
    out_shape = (s2.shape[0], axis_size)
    start = base
    if start is None:  # Max / Min start from the type's extremes, Mul from 1
        if red in (1, 2):
            big = (jnp.finfo if jnp.issubdtype(s2.dtype, jnp.floating) else jnp.iinfo)(s2.dtype).max
            start = jnp.full(out_shape, -big if red == 1 else big, s2.dtype)
        else:
            start = (jnp.ones if red == 3 else jnp.zeros)(out_shape, s2.dtype)
    at = start.at[rows, ix2]
    out = (at.add, at.max, at.min, at.multiply, at.set)[red](s2, mode="drop")
    if base is None and red in (1, 2, 3):  # slots nobody writes are 0
        touched = jnp.zeros(out_shape, bool).at[rows, ix2].set(True, mode="drop")
        out = jnp.where(touched, out, jnp.zeros((), s2.dtype))
    return out


def _scatter_rows_fwd(s2, ix2, base, red, axis_size):
    out = _scatter_rows(s2, ix2, base, red, axis_size)
    return out, (s2, ix2, base, out)


def _scatter_rows_bwd(red, axis_size, res, g):
    """PopART's ScatterReduceGradOp (popx/op/scatterreduceutilx.cpp). d src = g gathered at
    the index (0 out of range), times (src == out at the index) for Max / Min (every tie gets
    all of it) or out / src at the index for Mul; None gives every src written to a slot the
    slot's gradient. d initial_values = g, masked by (out == init) for Max / Min, times
    out / init for Mul, 0 at written slots for None."""
    s2, ix2, base, out = res
    rows = jnp.arange(s2.shape[0])[:, None]
    at_index = lambda t: t.at[rows, ix2].get(mode="fill", fill_value=0)
    ds = at_index(g)
    if red in (1, 2):
        ds = ds * (s2 == at_index(out)).astype(g.dtype)
    elif red == 3:
        ds = ds * (at_index(out) * (1 / s2))
    if base is None:
        return ds, None, None
    if red in (1, 2):
        db = g * (out == base).astype(g.dtype)
    elif red == 3:
        db = g * (out * (1 / base))
    elif red == 4:
        db = g.at[rows, ix2].set(0, mode="drop")
    else:
        db = g
    return ds, None, db


_scatter_rows_grad = jax.custom_vjp(_scatter_rows, nondiff_argnums=(3, 4))
_scatter_rows_grad.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)


@_g("ScatterReduce")
def scatter_reduce(ctx: LowerCtx, src, index, init=None, *, axis_size, axis, reduction,
                   group_size, enable_index_broadcast, **_):
    """out[i] = reduce(src[index == i]) along ``axis``; outputs nobody writes are 0 (or the
    optional initial_values input). ``group_size`` > 1: grouped (PopART's
    groupedscatterreduce), see ``grouped_scatter_reduce``."""
    if group_size != 1:
        return grouped_scatter_reduce(ctx, src, index, init, axis_size=axis_size, axis=axis,
                                      reduction=reduction,
                                      enable_index_broadcast=enable_index_broadcast)
    return _scatter(ctx, src, index, init, axis_size, axis, reduction, enable_index_broadcast)


@_g("GroupedScatterReduce")  # the op type earlier versions of the Builder wrote
def grouped_scatter_reduce(ctx: LowerCtx, src, index, init=None, *, axis_size, axis, reduction,
                           enable_index_broadcast, **_):
    """One scatter per group: the leading axis of every input is the group; ``axis`` counts
    axes including it."""
    ax = axis % src.ndim - 1
    f = lambda s, i, b: _scatter(ctx, s, i, b, axis_size, ax, reduction, enable_index_broadcast)
    if init is None:
        return jax.vmap(lambda s, i: f(s, i, None))(src, index)
    return jax.vmap(f)(src, index, init)


@_g("GroupedGather")
def grouped_gather(ctx: LowerCtx, data, indices, *, axis, **_):
    """Gather within each group: the leading axis of ``data`` and ``indices`` is the group;
    ``axis`` counts axes of ``data`` including it."""
    ax = axis % data.ndim
    if ax == 0:
        raise ctx.error("axis must not be the group axis 0")
    return jax.vmap(lambda d, i: jnp.take(d, i, axis=ax - 1))(data, indices)


@_g("Histogram")
def histogram(ctx: LowerCtx, x, *, levels, absoluteOfInput, **_):
    """Counts of x in (-inf, l0), [l0, l1), ..., [l_last, inf): len(levels)+1 uint32 bins."""
    v = jnp.abs(x) if absoluteOfInput else x
    b = jnp.searchsorted(jnp.asarray(levels, v.dtype), v.reshape(-1), side="right")
    return jnp.zeros(len(levels) + 1, jnp.uint32).at[b].add(1)


# ---------------------------------------------------------------------------------------
# Random

@_g("ShapedDropout", random=True)
def shaped_dropout(ctx: LowerCtx, x, *, shape, ratio, **_):
    """Dropout with one mask of ``shape`` broadcast over x; only active in training.
    ShapedDropoutOp's checks: the ratio in [0, 1), ``shape`` broadcastable to x."""
    nn.check_dropout_ratio(ctx, ratio)
    if len(shape) > x.ndim or any(s not in (1, d) for s, d in zip(shape[::-1], x.shape[::-1])):
        raise popart_error(ctx, f"ShapedDropout: incompatible input tensor and dropout shape. "
                           f"{opid(ctx)} is configured with shape {shape_text(shape)} which is "
                           f"not broadcastable to the input tensor with shape "
                           f"{shape_text(x.shape)}.", f"shape {list(shape)}")
    if not ctx.training:
        return x
    keep = jax.random.uniform(ctx.rng(), tuple(shape), jnp.float32) >= ratio
    return jnp.where(keep, x * _cast(1 / (1 - ratio), x), jnp.zeros((), x.dtype))


# ---------------------------------------------------------------------------------------
# Side effects

def print_to_stderr(fmt: str, x) -> None:
    """``jax.debug.print(fmt, x)`` to stderr, where PopART's PrintTensor writes."""
    jax.debug.callback(lambda v: print(fmt.format(v), file=sys.stderr, flush=True), x)


def _print(title, x, print_gradient):
    @jax.custom_vjp
    def f(x):
        print_to_stderr(title + "{}", x)
        return x

    def fwd(x):
        return f(x), None

    def bwd(_, g):
        if print_gradient:
            print_to_stderr("Gradient of " + title + "{}", g)
        return (g,)
    f.defvjp(fwd, bwd)
    return f(x)


@_g("PrintTensor")
def print_tensor(ctx: LowerCtx, x, *, print_gradient, title, **_):
    """Identity that prints the tensor (and its gradient, when print_gradient) at run time."""
    head = (title or ctx.input_ids[0]) + ": "
    return _print(head.replace("{", "{{").replace("}", "}}"), x, print_gradient)


@_g("Abort")
def abort(ctx: LowerCtx, cond=None, **_):
    """AbortOpx: the run stops with poplar_application_runtime_error (a poplar_runtime_error)
    when the scalar condition input is non-zero, and always without one (poplar's Abort /
    AbortOnCondition)."""
    if cond is not None and jnp.size(cond) > 1:
        raise popart_error(ctx, "Conditional abort op can only test a scalar tensor",
                           f"the condition '{ctx.input_ids[0]}' has shape {list(jnp.shape(cond))}")
    failed = True if cond is None else jnp.asarray(cond).reshape(()) != 0
    ctx.check(failed, "Abort program reached" + ("" if cond is None else " (its condition is true)"),
              error_class=poplar_application_runtime_error)
    return []


@_g("CopyVarUpdate")
def copy_var_update(ctx: LowerCtx, var, updater, **_):
    """Write ``updater`` to the variable ``var`` at the end of the step; returns the new value."""
    new = updater.astype(var.dtype)
    ctx.assign(ctx.input_ids[0], new)
    return new


# ---------------------------------------------------------------------------------------
# Splines (torch_spline_conv semantics)

@_g("SplineBasis")
def spline_basis(ctx: LowerCtx, pseudo, kernel_size, is_open_spline, *, degree, **_):
    """B-spline basis [E, S] and weight indices [E, S], S = (degree+1)^D."""
    e, d = pseudo.shape
    s = (degree + 1) ** d
    ks = jnp.asarray(kernel_size).astype(jnp.int32)
    op = jnp.asarray(is_open_spline).astype(jnp.int32)
    basis = jnp.ones((e, s), pseudo.dtype)
    wi = jnp.zeros((e, s), jnp.int32)
    offset = 1
    for dd in range(d):
        v = pseudo[:, dd] * (ks[dd] - degree * op[dd]).astype(pseudo.dtype)
        fl = jnp.floor(v)
        frac = v - fl
        for si in range(s):
            k_mod = (si // ((degree + 1) ** dd)) % (degree + 1)
            if degree == 1:
                b = 1 - frac - k_mod + 2 * frac * k_mod
            elif degree == 2:
                b = [0.5 * (1 - frac) ** 2, -frac * frac + frac + 0.5, 0.5 * frac * frac][k_mod]
            elif degree == 3:
                b = [(1 - frac) ** 3 / 6, (3 * frac ** 3 - 6 * frac ** 2 + 4) / 6,
                     (-3 * frac ** 3 + 3 * frac ** 2 + 3 * frac + 1) / 6, frac ** 3 / 6][k_mod]
            else:
                raise ctx.error(f"degree must be 1, 2 or 3, got {degree}")
            basis = basis.at[:, si].multiply(b.astype(pseudo.dtype))
            wi = wi.at[:, si].add(((fl.astype(jnp.int32) + k_mod) % ks[dd]) * offset)
        offset = offset * ks[dd]
    return basis, wi


@_g("SplineWeighting")
def spline_weighting(ctx: LowerCtx, x, weight, basis, weight_index, **_):
    """out[e] = sum_s basis[e, s] * (x[e] @ weight[weight_index[e, s]])."""
    w = weight[weight_index]                      # [E, S, Cin, Cout]
    return jnp.einsum("es,ei,esio->eo", basis, x, w, precision=lax.Precision.HIGHEST)
