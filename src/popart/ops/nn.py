"""Neural-network ops of ai.onnx: convolution, pooling, normalization, dropout, softmax."""
from __future__ import annotations

import contextlib
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..engine import onednn
from ..engine.backends import backend
from . import conv_fusion
from .registry import LowerCtx, fmt_float, onnx_semantics, opid, popart_error, register

HIGHEST = lax.Precision.HIGHEST


def _conv_args(x, w, strides, padding, lhs_dilation, rhs_dilation) -> tuple:
    """(w in x's dtype, strides, padding, lhs_dilation, rhs_dilation) as tuples (dilations 1
    where None)."""
    ones = (1,) * (x.ndim - 2)
    return (w.astype(x.dtype), tuple(strides), tuple(map(tuple, padding)),
            tuple(lhs_dilation or ones), tuple(rhs_dilation or ones))


def xla_conv(ctx: LowerCtx, x, w, strides, padding, lhs_dilation=None, rhs_dilation=None, groups=1):
    """ONNX's channels-first convolution (x: N,C,*sp; w: O,I,*k) as an XLA convolution on
    channels-last operands, the generic lowering's: XLA's CPU convolutions are several times
    faster so, and its layout pass cannot pick that layout for weights carried through the step
    program's loops, so the transposes are explicit (they fuse into neighbouring ops)."""
    n = x.ndim - 2
    to_last, to_first = (0, *range(2, n + 2), 1), (0, n + 1, *range(1, n + 1))
    w, strides, padding, lhs_dilation, rhs_dilation = _conv_args(x, w, strides, padding,
                                                                 lhs_dilation, rhs_dilation)
    y = conv_last(x.transpose(to_last), w.transpose(*range(2, n + 2), 1, 0), strides, padding,
                  lhs_dilation, rhs_dilation, int(groups))
    return y.transpose(to_first)


# ---- The CPU backend's convolution (registered below as its override of Conv and
# ConvTranspose; engine/backends.py). ----

def conv_nc(ctx: LowerCtx, x, w, strides, padding, lhs_dilation=None, rhs_dilation=None, groups=1):
    """ONNX's channels-first convolution on the CPU: float32 2D convolutions (grouped and
    depthwise too) are oneDNN custom calls where the library is built (``_use_onednn``,
    docs/performance.md); else matmuls over patches (``conv_patches``) where that applies;
    otherwise ``xla_conv``."""
    w, strides, padding, lhs_dilation, rhs_dilation = _conv_args(x, w, strides, padding,
                                                                 lhs_dilation, rhs_dilation)
    if _use_onednn(ctx, x, w, strides, lhs_dilation, rhs_dilation, groups):
        x_last = ctx.channels_last(x)
        nhwc = x_last is not None or onednn.channels_last(x.shape, w.shape, ctx.training)
        if nhwc and x_last is None:
            x_last = ctx.channels_last(x, transpose=True)
        x_in, static = (x_last if nhwc else x), (strides, padding, rhs_dilation, nhwc, groups)
        y = conv_fusion.start(x_in, w, onednn.conv2d(x_in, w, *static), static)
        return ctx.keep_channels_last(y) if nhwc else y
    if _use_patches(x, w, strides, lhs_dilation, groups):
        return conv_patches(x, w, strides, padding, rhs_dilation)
    return xla_conv(ctx, x, w, strides, padding, lhs_dilation, rhs_dilation, groups)


# ---- oneDNN dispatch (issue 28 item 2): the oneDNN custom call where it is built and the shape
# is one it runs faster (popart.engine.onednn.prefers), else XLA (the code below). ----
_ONEDNN_ON = [True]


@contextlib.contextmanager
def onednn_off():
    """Convolutions traced inside run on XLA only (benchmarks, tests)."""
    saved, _ONEDNN_ON[0] = _ONEDNN_ON[0], False
    try:
        yield
    finally:
        _ONEDNN_ON[0] = saved


def _use_onednn(ctx: LowerCtx, x, w, strides, lhs_dilation, rhs_dilation, groups) -> bool:
    """Whether the oneDNN custom call computes this convolution: switched on, offered by the
    platform's backend, float32 2D, input undilated, a shape it runs faster."""
    return (_ONEDNN_ON[0] and onednn.TARGET in backend(ctx.platform).custom_call_targets
            and x.ndim == 4 and x.dtype == np.float32 and all(d == 1 for d in lhs_dilation)
            and onednn.prefers(x.shape, w.shape, strides, rhs_dilation, groups) and onednn.available())
# ---- end of the oneDNN dispatch ----


PATCH_BYTES = 1 << 28  # 256 MiB


def _use_patches(x, w, strides, lhs_dilation, groups) -> bool:
    """Whether a CPU convolution runs as a matmul over its input's patches (im2col): XLA's CPU
    matmuls (and their gradients) outrun its convolutions. For ungrouped, input-undilated
    convolutions whose patch matrices, the forward's and the input gradient's (the output
    gradient dilated by the strides, convolved), fit PATCH_BYTES."""
    if groups != 1 or any(d != 1 for d in lhs_dilation):
        return False
    forward = x.size * math.prod(w.shape[2:]) * x.dtype.itemsize
    backward = forward * w.shape[0] / w.shape[1] * math.prod(strides)
    return max(forward, backward) <= PATCH_BYTES


def _patches(xc, k, strides, padding, rhs_dil, lhs_dil):
    """Patch matrix [C*K, N*out] of xc (C, N, *sp): strided slices of the padded (and
    lhs-dilated) input, one per kernel offset, stacked after C; and the output sizes."""
    n = xc.ndim - 2
    xp = lax.pad(xc, np.array(0, xc.dtype), [(0, 0, 0), (0, 0, 0),
                                             *((lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dil))])
    out = [(xp.shape[2 + a] - (k[a] - 1) * rhs_dil[a] - 1) // strides[a] + 1 for a in range(n)]
    starts = [[i * d for i, d in zip(off, rhs_dil)] for off in np.ndindex(*k)]
    cols = [lax.slice(xp, (0, 0, *st), (*xp.shape[:2], *(b + (m - 1) * s + 1 for b, m, s in
                                                         zip(st, out, strides))), (1, 1, *strides))
            for st in starts]
    cols = cols[0][:, None] if len(cols) == 1 else jnp.stack(cols, axis=1)
    return cols.reshape(xc.shape[0] * len(starts), -1), out


def _conv_cn(xc, w, strides, padding, rhs_dil, lhs_dil):
    """Convolution of xc (C, N, *sp) by w (O, C, *k) as one matmul, y: (O, N, *out)."""
    cols, out = _patches(xc, w.shape[2:], strides, padding, rhs_dil, lhs_dil)
    y = jnp.dot(w.reshape(w.shape[0], -1), cols, precision=HIGHEST)
    return y.reshape(w.shape[0], xc.shape[1], *out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def conv_patches(x, w, strides, padding, rhs_dil):
    """Channels-first convolution (x: N,C,*sp; w: O,C,*k) computed in the (C, N, *sp) layout,
    where patches @ weights lands in (O, N, *out) and moving N is a copy of whole rows. The
    gradients are matmuls of the same kinds: dW = dy @ patches^T, dx = the convolution of dy
    by the flipped kernel (no scatter of patch gradients)."""
    return _conv_patches_fwd(x, w, strides, padding, rhs_dil)[0]


def _conv_patches_fwd(x, w, strides, padding, rhs_dil):
    ones = (1,) * (x.ndim - 2)
    y = _conv_cn(x.swapaxes(0, 1), w, strides, padding, rhs_dil, ones)
    return y.swapaxes(0, 1), (x, w)


def _input_grad_pads(k, rhs_dil, padding, in_sp, out_sp, strides) -> list:
    """Padding of the output gradient (dilated by the strides) whose convolution by the
    flipped kernel gives the input gradient over ``in_sp`` (the lhs-dilated input sizes)."""
    k_eff = [(kk - 1) * d + 1 for kk, d in zip(k, rhs_dil)]
    return [(ke - 1 - lo, i - 1 + lo - (o - 1) * s)
            for ke, (lo, _), i, o, s in zip(k_eff, padding, in_sp, out_sp, strides)]


def _conv_patches_bwd(strides, padding, rhs_dil, res, dy):
    x, w = res
    n = w.ndim - 2
    in_sp = x.shape[2:]
    cols, _ = _patches(x.swapaxes(0, 1), w.shape[2:], strides, padding, rhs_dil, (1,) * n)
    dyc = dy.swapaxes(0, 1)                                               # O, N, *out
    dw = lax.dot_general(dyc.reshape(w.shape[0], -1), cols, (((1,), (1,)), ((), ())),
                         precision=HIGHEST).reshape(w.shape)
    pads = _input_grad_pads(w.shape[2:], rhs_dil, padding, in_sp, dy.shape[2:], strides)
    wt = jnp.flip(w, tuple(range(2, n + 2))).swapaxes(0, 1)              # C, O, *k
    dxc = _conv_cn(dyc, wt, (1,) * n, pads, rhs_dil, strides)
    return dxc.swapaxes(0, 1), dw


conv_patches.defvjp(_conv_patches_fwd, _conv_patches_bwd)


def _conv(x, w, strides, padding, lhs_dil, rhs_dil, groups=1, batch_groups=1):
    sp = "DHW"[3 - (x.ndim - 2):]
    return lax.conv_general_dilated(
        x, w, strides, padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
        feature_group_count=groups, batch_group_count=batch_groups,
        dimension_numbers=(f"N{sp}C", f"{sp}IO", f"N{sp}C"), precision=HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def conv_last(x, w, strides, padding, lhs_dil, rhs_dil, groups):
    """Channels-last convolution (x: N,*sp,C; w: *k,I,O) whose gradients are channels-last
    convolutions too. JAX's own gradient of the filter has the batch as its contraction
    dimension, a layout XLA's CPU backend only runs fast outside loops."""
    return _conv(x, w, strides, padding, lhs_dil, rhs_dil, groups)


def _conv_fwd(x, w, strides, padding, lhs_dil, rhs_dil, groups):
    return _conv(x, w, strides, padding, lhs_dil, rhs_dil, groups), (x, w)


def _conv_bwd(strides, padding, lhs_dil, rhs_dil, groups, res, dy):
    x, w = res
    n = x.ndim - 2
    sp_in, k, sp_out = x.shape[1:1 + n], w.shape[:n], dy.shape[1:1 + n]
    dil_in = [(h - 1) * d + 1 for h, d in zip(sp_in, lhs_dil)]
    cin_g, cout = w.shape[n], w.shape[n + 1]
    # d/dx: a transposed convolution with the flipped kernel, its I and O swapped per group.
    wt = jnp.flip(w, tuple(range(n))).reshape(*k, cin_g, groups, cout // groups)
    wt = wt.transpose(*range(n), n + 2, n + 1, n).reshape(*k, cout // groups, groups * cin_g)
    pads = _input_grad_pads(k, rhs_dil, padding, dil_in, sp_out, strides)
    dx = _conv(dy, wt, (1,) * n, pads, strides, rhs_dil, groups)
    dx = dx[(slice(None), *(slice(None, None, d) for d in lhs_dil))]
    # d/dw: the input (channels as batch) convolved with dy (batch as contraction).
    lhs = x.transpose(n + 1, *range(1, n + 1), 0)
    rhs = dy.transpose(*range(1, n + 1), 0, n + 1)
    dw = _conv(lhs, rhs, rhs_dil, list(padding), lhs_dil, strides, batch_groups=groups)
    dw = dw.transpose(*range(1, n + 1), 0, n + 1)[tuple(slice(0, kk) for kk in k)]
    return dx.astype(x.dtype), dw.astype(w.dtype)


conv_last.defvjp(_conv_fwd, _conv_bwd)


# ---------------------------------------------------------------------------------------
# Shared window helpers (Conv, ConvTranspose, pools)

def _list(v, n, fill):
    return list(v) if v else [fill] * n


def window_pads(ctx: LowerCtx, auto_pad, in_sp, k_sp, strides, dil, pads, ceil_mode=0):
    """[(lo, hi)] per spatial axis and the output sizes, as ONNX defines them for Conv and
    pools; ``ceil_mode`` extends ``hi`` so the last partial window is kept."""
    n = len(in_sp)
    eff = [(k - 1) * d + 1 for k, d in zip(k_sp, dil)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(in_sp, strides)]
        tot = [max(0, (o - 1) * s + e - i) for o, s, e, i in zip(out, strides, eff, in_sp)]
        lo = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in tot]
        return [(l, t - l) for l, t in zip(lo, tot)], out
    if auto_pad == "VALID":
        pads = [0] * (2 * n)
    elif auto_pad not in ("NOTSET", "", None):
        raise ctx.error(f"auto_pad '{auto_pad}' is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    pads = _list(pads, 2 * n, 0)
    if len(pads) != 2 * n or min(pads) < 0 or len(strides) != n or len(dil) != n \
            or min([*strides, *dil], default=1) < 1:
        raise ctx.error(f"pads {list(pads)} (2 x {n} values >= 0), strides {list(strides)} and "
                        f"dilations {list(dil)} ({n} values >= 1 each) do not fit {n} spatial axes")
    pp, out = [], []
    for a in range(n):
        lo, hi = pads[a], pads[a + n]
        span = in_sp[a] + lo + hi - eff[a]
        o = (-(-span // strides[a]) if ceil_mode else span // strides[a]) + 1
        if ceil_mode and (o - 1) * strides[a] >= in_sp[a] + lo:
            o -= 1  # the last window must start inside the input or left padding
        pp.append((lo, max(hi, (o - 1) * strides[a] + eff[a] - in_sp[a] - lo)))
        out.append(o)
    return pp, out


def _spatial_attrs(x, kernel_shape, strides, dilations):
    n = x.ndim - 2
    return _list(strides, n, 1), _list(dilations, n, 1), list(kernel_shape)


def conv_attrs(ctx: LowerCtx, x, w, kernel_shape, strides, dilations):
    """(strides, dilations, kernel) of a convolution of x by weight w; a ``kernel_shape``
    attribute, when given, must be w's spatial shape."""
    if kernel_shape and list(kernel_shape) != list(w.shape[2:]):
        raise ctx.error(f"kernel_shape {list(kernel_shape)} does not match the weight's "
                        f"spatial shape {list(w.shape[2:])}")
    return _spatial_attrs(x, w.shape[2:], strides, dilations)


@register("Conv")
def conv(ctx: LowerCtx, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None, conv_nd=xla_conv, **_):
    """Conv, computing with ``conv_nd`` (a platform's override passes its own)."""
    n = x.ndim - 2
    strides, dil, k = conv_attrs(ctx, x, w, kernel_shape, strides, dilations)
    pp, _o = window_pads(ctx, auto_pad, x.shape[2:], k, strides, dil, pads)
    y = conv_nd(ctx, x, w, strides, pp, rhs_dilation=dil, groups=group)
    if b is None:
        return y
    y_last = ctx.channels_last(y)
    fused = conv_fusion.with_bias(ctx, y if y_last is None else y_last, b)
    if y_last is None:
        return y + b.reshape((1, -1) + (1,) * n) if fused is None else fused
    return ctx.keep_channels_last(y_last + b if fused is None else fused)


@register("ConvTranspose")
def conv_transpose(ctx: LowerCtx, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1,
                   kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                   strides=None, conv_nd=xla_conv, **_):
    """ConvTranspose, computing with ``conv_nd`` (a platform's override passes its own)."""
    n = x.ndim - 2
    strides, dil, k = _spatial_attrs(x, w.shape[2:], strides, dilations)
    in_sp = x.shape[2:]
    opad = _list(output_padding, n, 0)
    full = [s * (i - 1) + op + (kk - 1) * d + 1 for s, i, op, kk, d in zip(strides, in_sp, opad, k, dil)]
    if not onnx_semantics(ctx):   # PopART's ConvTransposeOp::setup: auto_pad only places the
        if output_shape:          # cropping output_shape asks for, the odd one at the start
            if auto_pad == "VALID":   # for SAME_UPPER, at the end otherwise; pads otherwise
                raise popart_error(ctx, "`VALID` type for auto_pad cannot be used if the "
                                   "`output_shape` is also set")
            tot = [f - t for f, t in zip(full, list(output_shape)[-n:])]
            lo = [t - t // 2 if auto_pad == "SAME_UPPER" else t // 2 for t in tot]
            pads = lo + [t - l for t, l in zip(tot, lo)]
        pads = pads or [0] * (2 * n)
    elif output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = list(output_shape)[-n:] if output_shape else [i * s for i, s in zip(in_sp, strides)]
        tot = [f - t for f, t in zip(full, target)]
        if auto_pad == "SAME_UPPER":
            lo = [t // 2 for t in tot]
        else:
            lo = [t - t // 2 for t in tot]
        pads = lo + [t - l for t, l in zip(tot, lo)]
    elif auto_pad == "VALID" or not pads:
        pads = [0] * (2 * n)
    c, m = w.shape[0], w.shape[1] * group
    # [C, M/g, k] -> [M, C/g, k] with flipped spatial axes.
    wt = w.reshape((group, c // group, m // group) + tuple(k)).swapaxes(1, 2)
    wt = jnp.flip(wt.reshape((m, c // group) + tuple(k)), axis=tuple(range(2, 2 + n)))
    pp = [((kk - 1) * d - pads[a], (kk - 1) * d - pads[a + n] + opad[a])
          for a, (kk, d) in enumerate(zip(k, dil))]
    y = conv_nd(ctx, x, wt, [1] * n, pp, lhs_dilation=strides, rhs_dilation=dil, groups=group)
    return y if b is None else y + b.reshape((1, -1) + (1,) * n)


@register("Conv", platform="cpu")
def conv_cpu(ctx: LowerCtx, *inputs, **attrs):
    """Conv on the CPU: oneDNN's convolution or matmuls over patches where they apply (conv_nc)."""
    return conv(ctx, *inputs, **attrs, conv_nd=conv_nc)


@register("ConvTranspose", platform="cpu")
def conv_transpose_cpu(ctx: LowerCtx, *inputs, **attrs):
    """ConvTranspose on the CPU, as Conv (conv_nc)."""
    return conv_transpose(ctx, *inputs, **attrs, conv_nd=conv_nc)


# ---------------------------------------------------------------------------------------
# Pooling

def _pool_window(ctx: LowerCtx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    strides, dil, k = _spatial_attrs(x, kernel_shape, strides, dilations)
    pp, out = window_pads(ctx, auto_pad, x.shape[2:], k, strides, dil, pads, ceil_mode)
    return (1, 1, *k), (1, 1, *strides), ((0, 0), (0, 0), *pp), (1, 1, *dil)


def _blocks(x, k, first=2):
    """x with spatial axes from ``first`` (2: N, C, *sp; 1: N, *sp, C) cut into non-overlapping
    windows k: (N, C, *out, K) or (N, *out, C, K), a trailing partial window dropped."""
    n, lead = len(k), x.shape[:first]
    out = [d // kk for d, kk in zip(x.shape[first:first + n], k)]
    x = x[(slice(None),) * first + tuple(slice(0, o * kk) for o, kk in zip(out, k))]
    trail = x.shape[first + n:]
    x = x.reshape(*lead, *(d for o, kk in zip(out, k) for d in (o, kk)), *trail)
    pairs = range(first, first + 2 * n, 2)
    perm = (*range(first), *pairs, *range(first + 2 * n, x.ndim), *(a + 1 for a in pairs))
    return x.transpose(perm).reshape(*lead, *out, *trail, math.prod(k))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def max_blocks(x, k, first=2):
    """Max pool whose windows tile the input (stride == kernel, no padding; spatial axes from
    ``first``). Its gradient goes to the first maximum of each window, as XLA's
    select-and-scatter does, without select-and-scatter, which XLA's CPU backend runs
    slowly."""
    return jnp.max(_blocks(x, k, first), axis=-1)


def _max_blocks_fwd(x, k, first=2):
    return max_blocks(x, k, first), x


def _max_blocks_bwd(k, first, x, dy):
    blocks, unblock = jax.vjp(lambda v: _blocks(v, k, first), x)
    first_max = jnp.argmax(blocks, axis=-1)[..., None] == np.arange(blocks.shape[-1])
    return unblock(jnp.where(first_max, dy[..., None], jnp.zeros((), dy.dtype)))


max_blocks.defvjp(_max_blocks_fwd, _max_blocks_bwd)


@register("MaxPool")
def max_pool(ctx: LowerCtx, x, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=(),
             pads=None, storage_order=0, strides=None, **_):
    win, st, pp, dil = _pool_window(ctx, x, kernel_shape, strides, dilations, pads, auto_pad,
                                    ceil_mode)
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    if win == st and all(p == (0, 0) for p in pp) and all(d == 1 for d in dil):
        x_last = ctx.channels_last(x)
        y = (max_blocks(x, win[2:]) if x_last is None
             else ctx.keep_channels_last(max_blocks(x_last, win[2:], 1)))
    else:
        y = _pool(ctx, x, np.array(lowest, x.dtype), lax.max, win, st, pp, dil)
    if ctx.num_outputs < 2 or not ctx.output_ids[1]:
        return y
    sp = x.shape[2:]
    if storage_order:  # column-major over the spatial axes
        idx = np.arange(math.prod(sp)).reshape(sp[::-1]).T
    else:
        idx = np.arange(math.prod(sp)).reshape(sp)
    base = (np.arange(x.shape[0] * x.shape[1]) * math.prod(sp)).reshape(x.shape[:2] + (1,) * len(sp))
    idx = jnp.asarray(np.broadcast_to(idx + base, x.shape), jnp.int64)

    def pick(a, b):
        take = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
        return jnp.where(take, b[0], a[0]), jnp.where(take, b[1], a[1])
    xs = lax.stop_gradient(x)
    _y, i = lax.reduce_window((xs, idx), (np.array(lowest, x.dtype), jnp.array(2**62, jnp.int64)),
                              pick, win, st, pp, window_dilation=dil)
    return y, i


def _avg(ctx: LowerCtx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, count_include_pad):
    win, st, pp, dil = _pool_window(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    with jax.ensure_compile_time_eval():  # window element counts are constants
        ones, count_pp = jnp.ones((1, 1) + x.shape[2:], x.dtype), pp
        if count_include_pad:  # explicit pads count, the ceil_mode extension does not
            _, _, explicit, _ = _pool_window(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, 0)
            ones = jnp.pad(ones, explicit, constant_values=1)
            count_pp = tuple((0, hi - e_hi) for (_lo, hi), (_e, e_hi) in zip(pp, explicit))
        cnt = np.asarray(lax.reduce_window(ones, np.array(0, x.dtype), lax.add, win, st, count_pp,
                                           window_dilation=dil))
    return _pool(ctx, x, np.array(0, x.dtype), lax.add, win, st, pp, dil, cnt)


def _pool(ctx: LowerCtx, x, init, op, win, st, pp, dil, divisor=None):
    """lax.reduce_window over x's windows (NCHW order), divided by ``divisor`` (NCHW, for
    averages); channels-last where x has that form, the result keeping it."""
    win, pp = _clip_windows(x.shape, win, st, pp, dil)
    x_last = ctx.channels_last(x)
    # Inference's max pools (ties need no gradient rule) as slices of the input.
    reduce = (_window_slices if op is lax.max and not ctx.training and math.prod(win) <= 64
              else lax.reduce_window)
    if x_last is None:
        y = reduce(x, init, op, win, st, pp, window_dilation=dil)
        return y if divisor is None else y / divisor

    def last(t):
        return (t[0], *t[2:], t[1])
    y = reduce(x_last, init, op, last(win), last(st), last(pp), window_dilation=last(dil))
    return ctx.keep_channels_last(y if divisor is None else y / divisor.transpose(0, 2, 3, 1))


def _window_slices(x, init, op, win, st, pp, window_dilation):
    """``lax.reduce_window`` as ``op`` over one strided slice of the padded input per window
    position: one loop XLA's CPU backend vectorises, where it runs reduce_window element by
    element (a 3x3 stride-2 max pool over 8 x 24 x 112 x 112: 7 ms, docs/performance.md)."""
    xp = lax.pad(x, np.asarray(init, x.dtype), [(lo, hi, 0) for lo, hi in pp])
    out = [(d - (w - 1) * dl - 1) // s + 1 for d, w, s, dl in zip(xp.shape, win, st, window_dilation)]
    y = None
    for pos in itertools.product(*(range(w) for w in win)):
        start = [i * dl for i, dl in zip(pos, window_dilation)]
        part = lax.slice(xp, start, [b + (n - 1) * s + 1 for b, n, s in zip(start, out, st)], st)
        y = part if y is None else op(y, part)
    return y


def _clip_windows(shape, win, st, pp, dil):
    """A window past the end of the input along an axis with one output (a global pool
    written as a huge kernel: transformers' EfficientNet exports a 1280 x 1280 AveragePool
    with ceil_mode over 7 x 7) reads only padding there, which adds nothing: it is clipped to
    the input, else XLA pads the input to the window (gigabytes)."""
    win, pp = list(win), list(pp)
    for a in range(2, len(shape)):
        lo, hi = pp[a]
        if dil[a] == 1 and win[a] >= shape[a] + lo and shape[a] + lo + hi - win[a] < st[a]:
            win[a], pp[a] = shape[a] + lo, (lo, 0)
    return tuple(win), tuple(pp)


@register("AveragePool")
def average_pool(ctx: LowerCtx, x, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=(), pads=None, strides=None, **_):
    return _avg(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode, count_include_pad)


@register("LpPool")
def lp_pool(ctx: LowerCtx, x, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=(), p=2,
            pads=None, strides=None, **_):
    win, st, pp, dil = _pool_window(ctx, x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    s = lax.reduce_window(jnp.abs(x) ** p, np.array(0, x.dtype), lax.add, win, st, pp,
                          window_dilation=dil)
    return s ** (1.0 / p)


def _spatial(x):
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool")
def global_average_pool(ctx: LowerCtx, x, **_):
    x_last = ctx.channels_last(x)
    if x_last is None:
        return jnp.mean(x, _spatial(x), keepdims=True)
    return jnp.mean(x_last, (1, 2)).reshape(*x.shape[:2], 1, 1)


register("GlobalMaxPool")(lambda ctx, x, **_: jnp.max(x, _spatial(x), keepdims=True))
register("GlobalLpPool")(
    lambda ctx, x, p=2, **_: jnp.sum(jnp.abs(x) ** p, _spatial(x), keepdims=True) ** (1.0 / p))


@register("MaxRoiPool")
def max_roi_pool(ctx: LowerCtx, x, rois, pooled_shape=(), spatial_scale=1.0, **_):
    ph, pw = pooled_shape
    h, w = x.shape[2:]

    def one(roi):
        b = roi[0].astype(jnp.int32)
        x1, y1, x2, y2 = [jnp.round(v * spatial_scale).astype(jnp.int32) for v in roi[1:]]
        rh = jnp.maximum(y2 - y1 + 1, 1).astype(x.dtype) / ph
        rw = jnp.maximum(x2 - x1 + 1, 1).astype(x.dtype) / pw
        img = x[b]
        ys, xs = jnp.arange(h), jnp.arange(w)

        def cell(i, j):
            hs = jnp.clip(jnp.floor(i * rh).astype(jnp.int32) + y1, 0, h)
            he = jnp.clip(jnp.ceil((i + 1) * rh).astype(jnp.int32) + y1, 0, h)
            ws = jnp.clip(jnp.floor(j * rw).astype(jnp.int32) + x1, 0, w)
            we = jnp.clip(jnp.ceil((j + 1) * rw).astype(jnp.int32) + x1, 0, w)
            m = ((ys >= hs) & (ys < he))[:, None] & ((xs >= ws) & (xs < we))[None, :]
            v = jnp.max(jnp.where(m, img, -jnp.inf), axis=(1, 2))
            return jnp.where(jnp.any(m), v, 0).astype(x.dtype)
        ii, jj = jnp.meshgrid(jnp.arange(ph), jnp.arange(pw), indexing="ij")
        return jax.vmap(jax.vmap(cell))(ii, jj).transpose(2, 0, 1)
    return jax.vmap(one)(rois)


@register("MaxUnpool", since=9)
def max_unpool(ctx: LowerCtx, x, idx, output_shape=None, kernel_shape=(), pads=None, strides=None, **_):
    """Scatters x to the flat positions ``idx`` of the output. With ``output_shape`` the
    indices address that shape, as in onnxruntime and PyTorch, so MaxPool's indices of an
    odd-sized input put every maximum back in place; ONNX's reference instead addresses the
    shape inferred from kernel_shape, strides and pads and zero-pads it to output_shape."""
    n = x.ndim - 2
    strides, pads = _list(strides, n, 1), _list(pads, 2 * n, 0)
    if output_shape is not None:
        out = tuple(int(v) for v in ctx.static(output_shape, "MaxUnpool output_shape"))
        if len(out) != x.ndim or out[:2] != tuple(x.shape[:2]):
            raise ctx.error(f"output_shape must be (N, C, *spatial) with N, C = "
                            f"{tuple(x.shape[:2])} of input 'X', got {out}")
    else:
        out = x.shape[:2] + tuple((i - 1) * s + k - pads[a] - pads[a + n]
                                  for a, (i, s, k) in enumerate(zip(x.shape[2:], strides, kernel_shape)))
    flat = jnp.zeros((math.prod(out),), x.dtype).at[idx.reshape(-1)].set(x.reshape(-1))
    return flat.reshape(out)


# ---------------------------------------------------------------------------------------
# Normalization

def _bcast(v, x, axis=1):
    return v.reshape((1,) * axis + v.shape + (1,) * (x.ndim - axis - v.ndim))


def _channel_sums(x, axis=1):
    """Sums over every axis but ``axis`` (1, or the last of a channels-last tensor), in at
    least float32, as matrix-vector products: XLA's CPU backend runs these multithreaded, and
    its reductions to few outputs on one thread."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    if axis == x.ndim - 1 and axis != 1:
        x2 = x.reshape(-1, x.shape[-1])
        return lax.dot_general(jnp.ones(x2.shape[0], x.dtype), x2, (((0,), (0,)), ((), ())),
                               precision=HIGHEST, preferred_element_type=acc)
    x3 = x.reshape(x.shape[0], x.shape[1], -1)
    rows = lax.dot_general(x3, jnp.ones(x3.shape[2], x.dtype), (((2,), (0,)), ((), ())),
                           precision=HIGHEST, preferred_element_type=acc)
    return rows.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def batch_norm_train(x, scale, b, epsilon: float, grad_rstd_scale: float = 1.0, axis: int = 1):
    """(y, batch mean, batch variance) of batch normalization over every axis but ``axis``
    (the channels), with the textbook gradient (two channel sums of the output gradient). The
    gradient takes the inverse standard deviation 1/sqrt(var + epsilon) times
    ``grad_rstd_scale`` (PopART's ai.graphcore BatchNormalization: see ``batch_norm``)."""
    return _bn_fwd(x, scale, b, epsilon, grad_rstd_scale, axis)[0]


def _bn_fwd(x, scale, b, epsilon, grad_rstd_scale=1.0, axis=1):
    n = x.size // x.shape[axis]
    mean = _channel_sums(x, axis) / n
    centered = x - _bcast(mean.astype(x.dtype), x, axis)
    var = _channel_sums(jnp.square(centered.astype(mean.dtype)), axis) / n
    rstd = lax.rsqrt(var + epsilon)
    y = (centered * _bcast((rstd * scale).astype(x.dtype), x, axis)
         + _bcast(b, x, axis).astype(x.dtype))
    out = (y, mean.astype(scale.dtype), var.astype(scale.dtype))   # the statistics' type
    return out, (x, mean, rstd, scale)


def _bn_bwd(epsilon, grad_rstd_scale, axis, res, cts):
    x, mean, rstd, scale = res
    rstd = rstd * grad_rstd_scale
    dy, dmean, dvar = cts
    n = x.size // x.shape[axis]

    def per_channel(v):
        return _bcast(v.astype(x.dtype), x, axis)
    centered = x - per_channel(mean)
    xhat = centered * per_channel(rstd)
    db, dscale = _channel_sums(dy, axis), _channel_sums(dy * xhat, axis)
    k = rstd * scale
    dx = (dy * per_channel(k) - per_channel(k * db / n - dmean / n)
          - xhat * per_channel(k * dscale / n) + centered * per_channel(2 * dvar / n))
    return dx, dscale.astype(scale.dtype), db.astype(scale.dtype)


batch_norm_train.defvjp(_bn_fwd, _bn_bwd)


def batch_norm(ctx: LowerCtx, x, scale, b, mean, var, epsilon, momentum, training, unbiased_running=False):
    """Normalize over every axis but 1; in training use batch statistics and return
    (y, new running mean, new running var, batch mean, batch var).

    Training differentiates as PopART's BatchNormGradOp: only y passes a gradient back (to
    x, scale and b; the statistics outputs and the mean / var inputs get none), with the
    inverse standard deviation the grad op derives from the saved variance, 1/sqrt(var +
    eps). With ``unbiased_running`` (ai.graphcore) PopART multiplies that inverse deviation
    by sqrt((n - 1) / n) before it saves the variance, so the gradient uses the product.
    An x with a channels-last form is normalized in that form (y keeps one)."""
    x_last = ctx.channels_last(x)
    xs, axis = (x, 1) if x_last is None else (x_last, 3)

    def output(y):
        return y if x_last is None else ctx.keep_channels_last(y)
    if not training:
        y = ((xs - _bcast(mean, xs, axis)) * lax.rsqrt(_bcast(var, xs, axis) + epsilon)
             * _bcast(scale, xs, axis) + _bcast(b, xs, axis))
        return output(y.astype(x.dtype)), mean, var, None, None
    n = x.size // x.shape[1]
    c = math.sqrt((n - 1) / n) if unbiased_running and n > 0 else 1.0
    y, bm, bv = batch_norm_train(xs, scale, b, float(epsilon), c, axis)
    bm, bv = lax.stop_gradient(bm), lax.stop_gradient(bv)
    rv = bv * (n / max(n - 1, 1)) if unbiased_running else bv
    new_m = lax.stop_gradient(mean * momentum + bm * (1 - momentum)).astype(mean.dtype)
    new_v = lax.stop_gradient(var * momentum + rv * (1 - momentum)).astype(var.dtype)
    ctx.assign(ctx.input_ids[3], new_m)
    ctx.assign(ctx.input_ids[4], new_v)
    return output(y), new_m, new_v, bm.astype(mean.dtype), bv.astype(var.dtype)


@register("BatchNormalization")
def batch_normalization(ctx: LowerCtx, x, scale, b, mean, var, epsilon=1e-5, momentum=0.9, spatial=1,
                        training_mode=0, **_):
    """Before opset 14 PopART's BatchNormOp (batchnorm.cpp:50-66): batch statistics whenever
    the node has more than one output, in any session; one output is inference mode (in a
    training session too, differentiated as such where PopART's BatchNormGradOp raises).
    From opset 14 ONNX's training_mode, or a training session's forward pass."""
    training = ctx.num_outputs > 1 if ctx.version < 14 else bool(ctx.training or training_mode)
    if not spatial:  # statistics per (C, D1, ...) element: fold the spatial axes into C
        shp = x.shape
        x2 = x.reshape(shp[0], -1)
        outs = batch_norm(ctx, x2, scale.reshape(-1), b.reshape(-1), mean.reshape(-1),
                          var.reshape(-1), epsilon, momentum, training)
        outs = (outs[0].reshape(shp),) + tuple(None if o is None else o.reshape(shp[1:]) for o in outs[1:])
    else:
        outs = batch_norm(ctx, x, scale, b, mean, var, epsilon, momentum, training)
    if ctx.version >= 14:
        return outs[:3] if training else outs[0]
    return outs if training else outs[0]


@register("InstanceNormalization")
def instance_normalization(ctx: LowerCtx, x, scale, b, epsilon=1e-5, **_):
    ax = _spatial(x)
    m = jnp.mean(x, ax, keepdims=True)
    v = jnp.var(x, ax, keepdims=True)
    return (x - m) * lax.rsqrt(v + epsilon) * _bcast(scale, x) + _bcast(b, x)


def _stash(x, stash_type):
    return x.astype(jnp.float32) if stash_type == 1 and x.dtype in (jnp.float16, jnp.bfloat16) else x


@register("LayerNormalization", since=17)
def layer_normalization(ctx: LowerCtx, x, scale, b=None, axis=-1, epsilon=1e-5, stash_type=1, **_):
    axis = axis % x.ndim
    ax = tuple(range(axis, x.ndim))
    xs = _stash(x, stash_type)
    m = jnp.mean(xs, ax, keepdims=True)
    inv = lax.rsqrt(jnp.var(xs, ax, keepdims=True) + epsilon)
    y = ((xs - m) * inv).astype(x.dtype) * scale
    y = y if b is None else y + b
    return y, m, inv


def _group_norm(x, num_groups, epsilon, stash_type=1):
    n, c = x.shape[:2]
    g = _stash(x, stash_type).reshape((n, num_groups, -1))
    m = jnp.mean(g, -1, keepdims=True)
    inv = lax.rsqrt(jnp.var(g, -1, keepdims=True) + epsilon)
    return ((g - m) * inv).reshape(x.shape).astype(x.dtype), m[..., 0], inv[..., 0]


@register("GroupNormalization", since=18)
def group_normalization(ctx: LowerCtx, x, scale, b, epsilon=1e-5, num_groups=None, stash_type=1, **_):
    y, _m, _i = _group_norm(x, num_groups, epsilon, stash_type)
    c = x.shape[1]
    if ctx.version < 21:  # scale and bias per group
        scale, b = jnp.repeat(scale, c // num_groups), jnp.repeat(b, c // num_groups)
    return y * _bcast(scale, x) + _bcast(b, x)


@register("LRN")
def lrn(ctx: LowerCtx, x, size, alpha=1e-4, beta=0.75, bias=1.0, **_):
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = lax.reduce_window(x * x, np.array(0, x.dtype), lax.add, (1, size) + (1,) * (x.ndim - 2),
                           (1,) * x.ndim, ((0, 0), (lo, hi)) + ((0, 0),) * (x.ndim - 2))
    return x / (bias + alpha / size * sq) ** beta


@register("MeanVarianceNormalization", since=9)
def mvn(ctx: LowerCtx, x, axes=(0, 2, 3), **_):
    ax = tuple(a % x.ndim for a in axes)
    m = jnp.mean(x, ax, keepdims=True)
    sd = jnp.sqrt(jnp.mean(x * x, ax, keepdims=True) - m * m)
    return (x - m) / (sd + 1e-9)


@register("LpNormalization")
def lp_normalization(ctx: LowerCtx, x, axis=-1, p=2, **_):
    """x divided by its L1 or L2 norm along ``axis``; slices of norm 0 give 0 (as ONNX's
    reference), with a finite (zero) gradient: the norm is taken of 1 there."""
    if p not in (1, 2):
        raise ctx.error(f"p must be 1 or 2, got {p}")
    s = jnp.sum(jnp.abs(x) if p == 1 else x * x, axis, keepdims=True)
    zero = s == 0
    s = jnp.where(zero, jnp.ones((), s.dtype), s)
    return jnp.where(zero, jnp.zeros((), x.dtype), x / (s if p == 1 else jnp.sqrt(s)))


# ---------------------------------------------------------------------------------------
# Dropout

def check_dropout_ratio(ctx: LowerCtx, ratio: float) -> None:
    """DropoutBaseOp::validateRatioAttribute: the 'ratio' attribute in [0, 1)."""
    if not 0 <= ratio < 1:
        raise popart_error(ctx, f"{opid(ctx)} ratio value {fmt_float(ratio)} is not valid. Please "
                           f"use a value in the interval [0,1)", "the 'ratio' attribute")


@register("Dropout", random=True)
def dropout(ctx: LowerCtx, x, ratio_in=None, training_mode=None, ratio=0.5, is_test=0, seed=None, **_):
    """Active in a training session's forward pass, or when the training_mode input is true
    (a run-time training_mode selects at run time). Kept elements are scaled by 1/(1-ratio)."""
    r = ratio if ratio_in is None else ratio_in
    if ctx.version < 12:
        check_dropout_ratio(ctx, ratio)
    active = bool(ctx.training and not is_test)
    if training_mode is not None:
        active = bool(training_mode) if isinstance(training_mode, (np.ndarray, np.generic, bool)) \
            else jnp.asarray(training_mode, bool)
    mask_dtype = x.dtype if ctx.version < 10 else jnp.bool_
    if active is False:
        return x, jnp.ones(x.shape, mask_dtype)
    key = ctx.rng() if seed is None else jax.random.fold_in(ctx.rng(), seed)
    keep = jax.random.uniform(key, x.shape, jnp.float32) >= r
    scale = (1 / (1 - jnp.asarray(r, jnp.float32))).astype(x.dtype)
    if active is not True:
        keep, scale = keep | ~active, jnp.where(active, scale, jnp.ones((), x.dtype))
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep.astype(mask_dtype)


# ---------------------------------------------------------------------------------------
# Softmax family: before opset 13 the input is flattened to 2D at ``axis`` (default 1).

def _softmax_family(fn):
    def old(ctx: LowerCtx, x, axis=1, **_):
        axis %= max(x.ndim, 1)
        return fn(x.reshape(math.prod(x.shape[:axis]), -1), 1).reshape(x.shape)

    def new(ctx: LowerCtx, x, axis=-1, **_):
        return fn(x, axis)
    return old, new


def _hardmax(x, axis):
    return jax.nn.one_hot(jnp.argmax(x, axis), x.shape[axis], dtype=x.dtype, axis=axis)


for _name, _fn in {"Softmax": jax.nn.softmax, "LogSoftmax": jax.nn.log_softmax,
                   "Hardmax": _hardmax}.items():
    _old, _new = _softmax_family(_fn)
    register(_name, since=1)(_old)
    register(_name, since=13)(_new)
