"""Matrix, scan, selection and quantization ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from .elementwise import c
from .registry import (add, debug_name, LowerCtx, onnx_semantics, popart_error, register,
                       shape_text)

I64 = jnp.int64

def _dt(x):
    return jnp.result_type(x)

def _static_int(ctx: LowerCtx, x, what):
    return int(ctx.static(x, what).reshape(-1)[0])

@register("MatMul")
def matmul(ctx: LowerCtx, a, b, product=None, **_):
    """MatMulOp::npMatMulOut's checks (matmul.cpp): no scalar operand, equal contracting
    dimensions (shown with a 1-D lhs promoted to [1, n], a 1-D rhs to [n, 1]); ``product``:
    a platform override's (``ops/matmul_cpu.py``), else :func:`_product`."""
    for side, x, tid in (("lhs", a, ctx.input_ids[0]), ("rhs", b, ctx.input_ids[1])):
        if jnp.ndim(x) == 0:
            raise popart_error(ctx, f"{debug_name(ctx)} doesn't support scalar tensor {tid} as "
                               f"the {side} input", "MatMul needs operands of rank 1 or more")
    ls = (1,) * (jnp.ndim(a) == 1) + tuple(jnp.shape(a))
    rs = tuple(jnp.shape(b)) + (1,) * (jnp.ndim(b) == 1)
    if ls[-1] != rs[-2]:
        raise popart_error(ctx, f"{debug_name(ctx)} contracting dimensions unequal: lhs "
                           f"'{ctx.input_ids[0]}' {shape_text(ls)}, rhs '{ctx.input_ids[1]}' "
                           f"{shape_text(rs)}", "the lhs's last dimension must equal the rhs's "
                           "second to last")
    return (product or _product)(a, b).astype(_dt(a))   # MatMulOp::setup: the lhs's type


def _product(a, b):
    """``a @ b``; by :func:`_matmul_weight` where ``b`` is a matrix (a weight) of a's float type."""
    if jnp.ndim(b) == 2 and jnp.ndim(a) >= 2 and _dt(a) == _dt(b) and jnp.issubdtype(_dt(a), jnp.floating):
        return _matmul_weight(a, b)
    return jnp.matmul(a, b)


@jax.custom_vjp
def _matmul_weight(a, w):
    """``a [..., M, K] @ w [K, N]`` (a layer's weight) with PopART's grad ops written as the
    dots they are: MatMulLhsGradOp ``dy @ w^T``, MatMulRhsGradOp ``a^T @ dy`` summed over the
    leading dimensions, in one dot each. JAX's own transpose of the matmul computes the
    weight's gradient as ``(dy^T @ a)^T``, whose transpose XLA's CPU backend copies and whose
    dot it runs on Eigen: 2x slower on ViT's shapes."""
    return jnp.matmul(a, w)


def _matmul_weight_fwd(a, w):
    return jnp.matmul(a, w), (a, w)


def _matmul_weight_bwd(res, g):
    a, w = res
    lead = tuple(range(a.ndim - 1))
    return (lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ()))),
            lax.dot_general(a, g, ((lead, lead), ((), ()))))


_matmul_weight.defvjp(_matmul_weight_fwd, _matmul_weight_bwd)

def _zp_rows(zp, ndim_is_matrix):
    """A's zero point may be per row ([M]): align it with A's rows."""
    zp = jnp.asarray(zp).astype(jnp.int32)
    return zp[:, None] if zp.ndim == 1 and ndim_is_matrix else zp

@register("MatMulInteger", since=10)
def matmul_integer(ctx: LowerCtx, a, b, a_zero_point=None, b_zero_point=None, **_):
    a, b = jnp.asarray(a).astype(jnp.int32), jnp.asarray(b).astype(jnp.int32)
    if a_zero_point is not None:
        a = a - _zp_rows(a_zero_point, a.ndim >= 2 and jnp.size(a_zero_point) > 1)
    if b_zero_point is not None:
        b = b - jnp.asarray(b_zero_point).astype(jnp.int32)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)

@register("Gemm")
def gemm(ctx: LowerCtx, a, b, cc=None, alpha=1.0, beta=1.0, transA=0, transB=0, product=None, **_):
    if jnp.ndim(a) != 2 or jnp.ndim(b) != 2:
        raise ctx.error(f"A and B must be matrices, got shapes {list(jnp.shape(a))} and {list(jnp.shape(b))}")
    a, b = (a.T if transA else a), (b.T if transB else b)
    y = (product or _product)(a, b)
    y = y if alpha == 1.0 else c(y, alpha) * y
    if cc is not None:
        y = y + (cc if beta == 1.0 else c(y, beta) * cc)
    return y

@register("Einsum", since=12)
def einsum(ctx: LowerCtx, *xs, equation="", **_):
    try:
        return jnp.einsum(equation.replace(" ", ""), *xs)
    except ValueError as e:
        raise ctx.error(f"invalid equation {equation!r}: {e}") from None

def _cumulative(fn, init):
    def lower(ctx: LowerCtx, x, axis, exclusive=0, reverse=0, **_):
        ax = _static_int(ctx, axis, "axis") % max(jnp.ndim(x), 1)
        x = jnp.flip(x, ax) if reverse else x
        y = fn(x, axis=ax, dtype=_dt(x))
        if exclusive:
            pad = jnp.full_like(lax.slice_in_dim(y, 0, 1, axis=ax), init)
            y = jnp.concatenate([pad, lax.slice_in_dim(y, 0, y.shape[ax] - 1, axis=ax)], ax)
        return jnp.flip(y, ax) if reverse else y
    return lower

add("CumSum", _cumulative(jnp.cumsum, 0), since=11)
add("CumProd", _cumulative(jnp.cumprod, 1), since=26)

def _float_order(x):
    """Signed integers ordered as the floats ``x`` (-0 = +0), NaN above +inf."""
    bits = jnp.dtype(f"int{jnp.dtype(x.dtype).itemsize * 8}")
    x = jnp.where(jnp.isnan(x), jnp.array(jnp.nan, x.dtype), x + jnp.zeros((), x.dtype))
    i = lax.bitcast_convert_type(x, bits)
    return jnp.where(i < 0, i ^ jnp.iinfo(bits).max, i)


def _topk(ctx: LowerCtx, x, k, axis, largest, sorted_):
    ax = axis % jnp.ndim(x)
    if not 0 <= k <= x.shape[ax]:
        raise ctx.error(f"k={k} is outside [0, {x.shape[ax]}] (the size of axis {axis})")
    xt = jnp.moveaxis(x, ax, -1)
    if largest and jnp.issubdtype(_dt(x), jnp.floating):   # NaN largest, as ONNX Runtime
        _, idx = lax.top_k(_float_order(xt), k)           # ties: lower index first
        vals = jnp.take_along_axis(xt, idx, -1)
    elif largest and not jnp.issubdtype(_dt(x), jnp.unsignedinteger) and _dt(x) != jnp.bool_:
        vals, idx = lax.top_k(xt, k)            # ties: lower index first
    else:
        key = xt if not largest else -xt.astype(I64)
        idx = jnp.argsort(key, axis=-1, stable=True)[..., :k]
        vals = jnp.take_along_axis(xt, idx, -1)
    return jnp.moveaxis(vals, -1, ax), jnp.moveaxis(idx.astype(I64), -1, ax)

add("TopK", lambda ctx, x, axis=-1, k=None, **_: _topk(ctx, x, k, axis, 1, 1), since=1)
add("TopK", lambda ctx, x, k, axis=-1, **_:
    _topk(ctx, x, _static_int(ctx, k, "k"), axis, 1, 1), since=10)
add("TopK", lambda ctx, x, k, axis=-1, largest=1, sorted=1, **_:
    _topk(ctx, x, _static_int(ctx, k, "k"), axis, largest, sorted), since=11)

def _arg(fn):
    def lower(ctx: LowerCtx, x, axis=0, keepdims=1, select_last_index=0, **_):
        ax = axis % jnp.ndim(x)
        if select_last_index:
            i = x.shape[ax] - 1 - fn(jnp.flip(x, ax), axis=ax, keepdims=bool(keepdims))
        else:
            i = fn(x, axis=ax, keepdims=bool(keepdims))
        # PopART's ArgExtremaOp gives INT32; applied where nothing reads the result but the
        # user (an anchor), so that no consumer ONNX types as INT64 (Unsqueeze -> Concat with
        # INT64 shapes, as exported models write) sees another type
        return i.astype(I64 if onnx_semantics(ctx) or ctx.consumed else jnp.int32)
    return lower

add("ArgMax", _arg(jnp.argmax))
add("ArgMin", _arg(jnp.argmin))

@register("Det", since=11)
def det(ctx: LowerCtx, x, **_):
    return jnp.linalg.det(x)

@register("Trilu", since=14)
def trilu(ctx: LowerCtx, x, k=None, upper=1, **_):
    k = 0 if k is None else _static_int(ctx, k, "k")
    return jnp.triu(x, k) if upper else jnp.tril(x, k)

# ---------------------------------------------------------------------------------------
# Quantization

def _qrange(dt):
    dt = np.dtype(dt)
    if jnp.issubdtype(dt, jnp.integer):
        i = ml_dtypes.iinfo(dt)
        return int(i.min), int(i.max)
    return None

def _expand_param(ctx: LowerCtx, p, x, axis, block_size):
    """Scale / zero point broadcast against ``x``: scalar, per-axis 1-D, or blocked."""
    p = jnp.asarray(p)
    if p.ndim == 0 or (p.ndim == 1 and p.shape[0] == 1 and not block_size):
        return p.reshape(())
    ax = axis % x.ndim
    if block_size:
        if p.ndim != x.ndim:
            raise ctx.error(f"blocked quantization needs a scale of rank {x.ndim}, got {p.shape}")
        return lax.slice_in_dim(jnp.repeat(p, block_size, axis=ax), 0, x.shape[ax], axis=ax)
    if p.ndim != 1 or p.shape[0] != x.shape[ax]:
        raise ctx.error(f"per-axis scale / zero point must be 1-D of size {x.shape[ax]} "
                        f"(axis {axis}), got shape {p.shape}")
    return p.reshape([-1 if d == ax else 1 for d in range(x.ndim)])

def saturate_cast(y, dt, saturate=1):
    """Round-half-even and clamp to an integer type, or (saturate=1) clamp to a float8's
    finite range; other float types are a plain cast."""
    dt = np.dtype(dt)
    r = _qrange(dt)
    if r is not None:
        return jnp.clip(jnp.round(y), r[0], r[1]).astype(dt)
    if saturate and dt.name.startswith("float8"):
        m = float(ml_dtypes.finfo(dt).max)     # +-inf saturate too (Cast's table), NaN stays
        y = jnp.clip(y, -m, m)
    return y.astype(dt)

def _calc_dtype(dt):
    return jnp.float64 if np.dtype(dt) == np.float64 else jnp.float32

@register("QuantizeLinear", since=10)
def quantize_linear(ctx: LowerCtx, x, y_scale, y_zero_point=None, axis=1, saturate=1, block_size=0,
                    output_dtype=0, precision=0, **_):
    from ..tensorinfo import np_dtype
    dt = (jnp.result_type(y_zero_point) if y_zero_point is not None
          else np_dtype(int(output_dtype)) if output_dtype else np.dtype(np.uint8))
    s = _expand_param(ctx, y_scale, x, axis, block_size)
    cd = _calc_dtype(s.dtype)
    y = x.astype(cd) / s.astype(cd)
    if _qrange(dt):
        y = jnp.round(y)
    if y_zero_point is not None:
        y = y + _expand_param(ctx, y_zero_point, x, axis, block_size).astype(cd)
    return saturate_cast(y, dt, saturate)

@register("DequantizeLinear", since=10)
def dequantize_linear(ctx: LowerCtx, x, x_scale, x_zero_point=None, axis=1, block_size=0,
                      output_dtype=0, **_):
    from ..tensorinfo import np_dtype
    s = _expand_param(ctx, x_scale, x, axis, block_size)
    out = np_dtype(int(output_dtype)) if output_dtype else s.dtype
    cd = _calc_dtype(s.dtype)
    xf = jnp.asarray(x).astype(cd)
    if x_zero_point is not None:
        xf = xf - _expand_param(ctx, x_zero_point, x, axis, block_size).astype(cd)
    return (xf * s.astype(cd)).astype(out)

@register("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx: LowerCtx, x, **_):
    lo = jnp.minimum(jnp.min(x), 0.0)
    hi = jnp.maximum(jnp.max(x), 0.0)
    scale = ((hi - lo) / 255.0).astype(x.dtype)
    zp = jnp.clip(jnp.round((0.0 - lo) / scale), 0, 255)
    y = jnp.clip(jnp.round(x / scale) + zp, 0, 255).astype(jnp.uint8)
    return y, scale, zp.astype(jnp.uint8)

@register("QLinearMatMul", since=10)
def qlinear_matmul(ctx: LowerCtx, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp, **_):
    """Integer matmul, rescaled by a_scale * b_scale / y_scale (per-row a / per-column b)."""
    acc = matmul_integer(ctx, a, b, a_zp, b_zp)
    cd = _calc_dtype(jnp.result_type(a_scale))
    a_s = jnp.asarray(a_scale, cd)
    a_s = a_s.reshape(-1, 1) if a_s.size > 1 else a_s.reshape(())
    real = acc.astype(cd) * a_s * jnp.asarray(b_scale, cd) / jnp.asarray(y_scale, cd)
    return saturate_cast(jnp.round(real) + jnp.asarray(y_zp).astype(cd), jnp.result_type(y_zp))
