"""popxl-addons' C++ custom ops without collectives (domain popxl.addons.ops), from their C++
sources: RotaryPosEmbed (and the copy in Graphcore's Dolly and LLaMA applications, domain
graphcore.examples.ops), GroupQuantizeDecompress, GradReduceSquareAdd, Fp8Scale (the MSE
estimate of a float8 scaling bias), LinearLayout and SparseMatmul. Ops whose C++ class has no
grad op pass no gradient."""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops.registry import LowerCtx, popart_error
from .bindings import ADDONS_DOMAIN, EXAMPLES_DOMAIN, grad_rule, register_op


def rotate_pairs(x: Any, sin: Any, cos: Any, sign: int) -> Any:
    """x [B, S, H, d] as d/2 interleaved (real, imaginary) pairs rotated by the angles of
    sin / cos [1 | B, S, d/2]: sign +1 forward (y_re = re cos - im sin, y_im = im cos +
    re sin), -1 the grad op's inverse rotation."""
    pairs = x.reshape(*x.shape[:3], x.shape[3] // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.stack([re * c - sign * im * s, im * c + sign * re * s], -1).reshape(x.shape)


def rotate_halves(x: Any, sin: Any, cos: Any, sign: int) -> Any:
    """x [B, S, H, d] as its two halves (real, imaginary) rotated by the angles of sin / cos
    [1 | B, S, d/2]: y1 = x1 cos - sign x2 sin, y2 = x2 cos + sign x1 sin (the forward of the
    copy of RotaryPosEmbed in Graphcore's Dolly and LLaMA applications)."""
    h = x.shape[3] // 2
    x1, x2 = x[..., :h], x[..., h:]
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * c - sign * x2 * s, x2 * c + sign * x1 * s], 3)


def rotary_op(ctx: LowerCtx, x: Any, sin: Any, cos: Any, rotary_dim: Optional[int],
              rotate_forward: Any) -> Any:
    """RotaryPosEmbedOp: the first ``rotary_dim`` hidden elements of x [batch, seq, heads,
    hh] rotated by ``rotate_forward`` (:func:`rotate_pairs` or :func:`rotate_halves`), the rest
    passed. RotaryPosEmbedGradOp (the same C++ in both copies): the inverse rotation of the
    output gradient's interleaved pairs; sin and cos get none."""
    x, sin, cos = jnp.asarray(x), jnp.asarray(sin), jnp.asarray(cos)
    if x.ndim != 4:
        raise popart_error(ctx, "RotaryPosEmbedOp::setup x should have rank 4 (batch, heads, seq, hh)")
    if sin.ndim != 3 or cos.ndim != 3:
        raise popart_error(ctx, "RotaryPosEmbedOp::setup trig functions should have rank 3 "
                           "(1 or batch, seq, hh/2)")
    d = int(rotary_dim) if rotary_dim else x.shape[3]
    if d % 2:
        raise popart_error(ctx, "RotaryPosEmbedOp::setup rotary dim must be a multiple of 2")

    def rotate(v: Any, s: Any, c: Any, rot: Any, sign: int) -> Any:
        return jnp.concatenate([rot(v[..., :d], s, c, sign), v[..., d:]], 3)

    return grad_rule(lambda v, s, c: (rotate(v, s, c, rotate_forward, 1), (s, c)),
                     lambda sc, g: (rotate(g, *sc, rotate_pairs, -1), None, None))(x, sin, cos)


@register_op("RotaryPosEmbed", ADDONS_DOMAIN, grad_reads=((1, 2), ()))
def rotary_pos_embed(ctx: LowerCtx, x: Any, sin: Any, cos: Any, rotary_dim: Optional[int] = None,
                     **_: Any) -> Any:
    """popxl-addons' RotaryPosEmbedOp: interleaved (real, imaginary) pairs (:func:`rotary_op`)."""
    return rotary_op(ctx, x, sin, cos, rotary_dim, rotate_pairs)


@register_op("RotaryPosEmbed", EXAMPLES_DOMAIN, grad_reads=((1, 2), ()))
def rotary_pos_embed_halves(ctx: LowerCtx, x: Any, sin: Any, cos: Any,
                            rotary_dim: Optional[int] = None, **_: Any) -> Any:
    """The RotaryPosEmbedOp of Graphcore's Dolly and LLaMA applications: the forward rotates
    the halves (:func:`rotate_halves`), the grad op is popxl-addons' (interleaved pairs), as in
    their C++ (:func:`rotary_op`)."""
    return rotary_op(ctx, x, sin, cos, rotary_dim, rotate_halves)


def unpack_nibbles(x: Any) -> Any:
    """uint16 [..., n] -> [..., 4n]: each element's four 4-bit values, high nibble first."""
    x = jnp.asarray(x).astype(jnp.uint32)
    parts = jnp.stack([(x >> s) & 15 for s in (12, 8, 4, 0)], -1)
    return parts.reshape(*x.shape[:-1], x.shape[-1] * 4)


@register_op("GroupQuantizeDecompress", ADDONS_DOMAIN)
def group_quantize_decompress(ctx: LowerCtx, x: Any, scale: Any, bias: Any, **_: Any) -> Any:
    """GroupQuantizeDecompressOp: packed uint16 x [rows, groups, ids] -> [rows, groups * ids *
    4] in the scale's type, each 4-bit value v as v * scale + bias of its group (scale, bias
    [rows, groups, 1]). No grad op."""
    x, scale, bias = (lax.stop_gradient(jnp.asarray(v)) for v in (x, scale, bias))
    if x.ndim != 3:
        raise popart_error(ctx, "GroupQuantizeDecompressOp::setup x should have rank 3")
    for t, what in ((scale, "groupScale"), (bias, "groupBias")):
        if t.ndim != x.ndim:
            raise popart_error(ctx, f"GroupQuantizeDecompressOp::setup {what} should same rank as x")
        if t.shape[2] != 1:
            raise popart_error(ctx, f"GroupQuantizeDecompressOp::setup {what} shape at last "
                               "dimension should be 1")
    y = unpack_nibbles(x).astype(scale.dtype) * scale + bias
    return y.reshape(x.shape[0], -1)


@register_op("GradReduceSquareAdd", ADDONS_DOMAIN)
def grad_reduce_square_add(ctx: LowerCtx, x: Any, scale: Any, **_: Any) -> Any:
    """GradReduceSquareAddOp: float32 scale * sum(x^2) (the squared norm of a gradient scaled by
    the loss scaling: scale = 1 / loss_scaling^2). No grad op."""
    x = lax.stop_gradient(jnp.asarray(x)).astype(jnp.float32)
    return (jnp.sum(x * x) * lax.stop_gradient(jnp.asarray(scale, jnp.float32))).reshape(())


FP32_BINS = 254          # 2^-126 .. 2^127
NUM_BIASES = 62          # the C++ loop's Repeat(62)


def fp8_bias_mse(hist: Any, bins: Any, min_fp32_exp_index: int, format_span: int,
                 quantisation_error: float) -> Any:
    """The C++ loop's 62 squared errors: for bias k, the bins [1, U + k) underflow (h b^2),
    [U + k, U + S + k) round (h b^2 q), [U + S + k, 254) overflow (h (b_top - b)^2, b_top the
    last rounded bin); products in the C++ expression's order."""
    u0, span = int(min_fp32_exp_index), int(format_span)
    c = np.arange(FP32_BINS)
    k = np.arange(NUM_BIASES)[:, None]
    under = (c >= 1) & (c < u0 + k)
    within = (c >= np.maximum(1, u0 + k)) & (c < u0 + span + k)
    over = (c >= np.maximum(1, u0 + span + k))
    top = bins[np.clip(u0 + span + np.arange(NUM_BIASES) - 1, 0, FP32_BINS - 1)][:, None]
    hb2 = hist * bins * bins
    terms = jnp.where(under, hb2, 0) + jnp.where(within, hb2 * jnp.float32(quantisation_error), 0) \
        + jnp.where(over, hist * (top - bins) * (top - bins), 0)
    return jnp.sum(terms, 1)


@register_op("Fp8Scale", ADDONS_DOMAIN)
def fp8_scale(ctx: LowerCtx, src: Any, min_fp32_exp_index: int = 0, format_span: int = 0,
              quantisation_error: float = 0.0, **_: Any) -> Any:
    """Fp8FindBestScaleOp: the int32 scaling bias for casting ``src`` to float8 that the C++
    op finds: a histogram of |src| over the powers of two 2^-126 .. 2^127 (levels in src's
    type), normalised; :func:`fp8_bias_mse` per bias; ``-(argmin + floor(ties / 2) - 31)``.
    No grad op."""
    x = jnp.abs(lax.stop_gradient(jnp.ravel(jnp.asarray(src))))
    levels = np.exp2(np.arange(-126, 128, dtype=np.float32))
    counts = jnp.zeros(FP32_BINS + 1, jnp.float32).at[
        jnp.searchsorted(jnp.asarray(levels, x.dtype), x, side="right")].add(1.0)
    hist = counts[1:] / jnp.float32(x.size)
    bins = jnp.asarray(levels).at[0].set(levels[0] * levels[0] / 4)
    mse = fp8_bias_mse(hist, bins, min_fp32_exp_index, format_span, quantisation_error)
    ties = jnp.sum((mse == jnp.min(mse)).astype(jnp.float32))
    return (-(jnp.argmin(mse).astype(jnp.int32) + (ties / 2).astype(jnp.int32) - 31)).reshape(())


@register_op("LinearLayout", ADDONS_DOMAIN)
def linear_layout(ctx: LowerCtx, x: Any, batchsize: int = 1, bs: Optional[int] = None,
                  **_: Any) -> Any:
    """LinearLayoutOp: a copy of x laid out linearly over the tiles; the values are x's.
    No grad op."""
    return lax.stop_gradient(jnp.asarray(x))


def csr_dense(nz: Any, cols: Any, rows: Any, k: int, n: int) -> np.ndarray:
    """The [k, n] float32 matrix of a CSR representation (values, column indices, row
    pointers)."""
    dense = np.zeros((k, n), np.float32)
    rows = np.asarray(rows, np.int64)
    for r in range(min(k, len(rows) - 1)):
        sl = slice(rows[r], rows[r + 1])
        dense[r, np.asarray(cols, np.int64)[sl]] = np.asarray(nz, np.float32)[sl]
    return dense


@register_op("SparseMatmul", ADDONS_DOMAIN)
def sparse_matmul(ctx: LowerCtx, lhs: Any, nz: Any = (), cols: Any = (), rows: Any = (),
                  output_cols: int = 0, **_: Any) -> Any:
    """DenseSparseMatMulOp: dense lhs [(1,) m, k] times the constant CSR matrix [k,
    output_cols] (its values in lhs's type). No grad op."""
    lhs = lax.stop_gradient(jnp.asarray(lhs))
    if lhs.dtype not in (jnp.float16, jnp.float32):
        raise popart_error(ctx, f"dtype {lhs.dtype} not currently supported.")
    rhs = csr_dense(nz, cols, rows, lhs.shape[-1], int(output_cols))
    return jnp.matmul(lhs, jnp.asarray(rhs, lhs.dtype))
