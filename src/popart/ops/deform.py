"""ai.onnx DeformConv: multilinear samples of the input at the kernel's grid positions moved
by per-pixel offsets, then one grouped contraction with the weight (any spatial rank)."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .image import sample
from .nn import conv_attrs, window_pads
from .registry import LowerCtx, register


@register("DeformConv", since=19)
def deform_conv(ctx: LowerCtx, x: Any, w: Any, offset: Any, b: Optional[Any] = None,
                mask: Optional[Any] = None, dilations=None, group: int = 1, kernel_shape=None,
                offset_group: int = 1, pads=None, strides=None, **_) -> jax.Array:
    """Deformable convolution: each kernel tap samples X at (grid position + offset) with
    (bi)linear interpolation, zero outside the input, scaled by ``mask`` (default 1). Offsets
    are (N, offset_group * kH * kW * 2, oH, oW) with (h, w) pairs (N-D alike); X's channels
    split evenly over the offset groups and, for the weights, over ``group``."""
    nd = x.ndim - 2
    if nd < 1 or w.ndim != x.ndim:
        raise ctx.error(f"inputs 'X' (N, C, D1, ...) and 'W' (oC, C/group, k1, ...) must have "
                        f"the same rank >= 3, got shapes {tuple(x.shape)} and {tuple(w.shape)}")
    n, c, sp = x.shape[0], x.shape[1], list(x.shape[2:])
    oc = w.shape[0]
    strides, dil, k = conv_attrs(ctx, x, w, kernel_shape, strides, dilations)
    if group < 1 or c != w.shape[1] * group or oc % group:
        raise ctx.error(f"X's {c} channels and W's {oc} output channels must both split into "
                        f"group={group} groups (W of shape (oC, C/group, ...)); got W of shape "
                        f"{tuple(w.shape)}")
    if offset_group < 1 or c % offset_group:
        raise ctx.error(f"X's {c} channels must be divisible by offset_group={offset_group}")
    pp, out = window_pads(ctx, "NOTSET", sp, k, strides, dil, pads)
    kk = int(np.prod(k))
    want = (n, offset_group * kk * nd, *out)
    if tuple(offset.shape) != want:
        raise ctx.error(f"input 'offset' must have shape (N, offset_group * kernel size * "
                        f"{nd}, *output spatial) = {want}, got {tuple(offset.shape)}")
    if mask is not None and tuple(mask.shape) != (n, offset_group * kk, *out):
        raise ctx.error(f"input 'mask' must have shape (N, offset_group * kernel size, *output "
                        f"spatial) = {(n, offset_group * kk, *out)}, got {tuple(mask.shape)}")
    if b is not None and tuple(b.shape) != (oc,):
        raise ctx.error(f"input 'B' must have shape ({oc},), got {tuple(b.shape)}")

    # Sampling positions per spatial axis, [N * offset_group, kernel size, *out], in pixels.
    taps = np.meshgrid(*[np.arange(kd) * d for kd, d in zip(k, dil)], indexing="ij")
    off = offset.reshape(n * offset_group, kk, nd, *out)
    pos = []
    for a in range(nd):
        shape = [1] * (nd + 1)
        shape[a + 1] = out[a]
        grid = (np.arange(out[a]) * strides[a] - pp[a][0]).reshape(shape)
        pos.append(taps[a].reshape((kk,) + (1,) * nd) + grid + off[:, :, a])
    cg = c // offset_group
    cols = sample(x.reshape(n * offset_group, cg, *sp), pos)   # [N*og, C/og, K, *out]
    if mask is not None:
        cols = cols * mask.reshape(n * offset_group, 1, kk, *out)
    cols = cols.reshape(n, group, c // group, kk, -1)
    wg = w.reshape(group, oc // group, c // group, kk)
    y = jnp.einsum("ngckp,gock->ngop", cols, wg, precision=lax.Precision.HIGHEST)
    y = y.reshape(n, oc, *out)
    return y if b is None else y + b.reshape((1, oc) + (1,) * nd)
