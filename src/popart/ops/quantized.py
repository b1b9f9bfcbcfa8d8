"""Quantized convolutions of ai.onnx: ConvInteger and QLinearConv.

Both subtract the zero points (scalar for x; scalar or per output channel for w), convolve
exactly in int32 through Conv's lowering (same attributes, padding and grouping), and
QLinearConv then rescales by x_scale * w_scale / y_scale and saturates to y's type."""
from __future__ import annotations

import jax.numpy as jnp

from .math import _calc_dtype, saturate_cast
from .registry import LowerCtx, platform_lowering, register

I32 = jnp.int32


def _centered(v, zp, per_channel=False):
    """``v - zp`` in int32; a per-output-channel zero point [M] is aligned with a weight's
    axis 0."""
    v = jnp.asarray(v).astype(I32)
    if zp is None:
        return v
    zp = jnp.asarray(zp).astype(I32)
    if per_channel and zp.size > 1:
        return v - zp.reshape((-1,) + (1,) * (v.ndim - 1))
    return v - zp.reshape(())


def conv_integer_nc(ctx: LowerCtx, x, w, x_zp, w_zp, attrs):
    return platform_lowering(ctx, "Conv")(ctx, _centered(x, x_zp), _centered(w, w_zp, per_channel=True), None, **attrs)


@register("ConvInteger", since=10)
def conv_integer(ctx: LowerCtx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
    return conv_integer_nc(ctx, x, w, x_zero_point, w_zero_point, attrs)


@register("QLinearConv", since=10)
def qlinear_conv(ctx: LowerCtx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale,
                 y_zero_point=None, b=None, **attrs):
    acc = conv_integer_nc(ctx, x, w, x_zero_point, w_zero_point, attrs)
    n = acc.ndim - 2
    if b is not None:
        acc = acc + jnp.asarray(b).astype(I32).reshape((1, -1) + (1,) * n)
    cd = _calc_dtype(jnp.result_type(x_scale))
    ws = jnp.asarray(w_scale, cd)
    ws = ws.reshape((1, -1) + (1,) * n) if ws.size > 1 else ws.reshape(())
    real = acc.astype(cd) * (jnp.asarray(x_scale, cd).reshape(()) * ws / jnp.asarray(y_scale, cd).reshape(()))
    out_dt = jnp.result_type(y_zero_point) if y_zero_point is not None else jnp.result_type(x)
    if y_zero_point is not None:
        real = real + jnp.asarray(y_zero_point).astype(cd).reshape(())
    return saturate_cast(real, out_dt)
