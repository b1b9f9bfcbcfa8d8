"""Image ops: Resize / Upsample (separable interpolation matrices built at compile time),
GridSample, RoiAlign, AffineGrid."""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import LowerCtx, onnx_semantics, popart_error, register

HI = lax.Precision.HIGHEST


def _coord(mode, x, scale, n_in, n_out, roi_start=0.0, roi_end=1.0, popart=False):
    """Input coordinate of output positions ``x`` (NumPy float64) per ONNX's
    coordinate_transformation_mode; with ``popart``, pytorch_half_pixel tests the unfloored
    length n_in * scale > 1 as PopART's coordinateTransformation (resizex.cpp) does, where
    ONNX tests the output length."""
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adj = n_out / (n_in * scale)
        return n_in / 2 * (1 - adj) + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if (n_in * scale if popart else n_out) > 1 \
            else np.zeros_like(x)
    if mode == "align_corners":   # the resized length is n_in * scale, not rounded (as onnx's)
        return x * (n_in - 1) / (n_in * scale - 1) if n_in * scale > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nearest":
        return (x + 0.5) / scale
    if mode == "tf_crop_and_resize":
        if n_out > 1:
            return roi_start * (n_in - 1) + x * (roi_end - roi_start) * (n_in - 1) / (n_out - 1)
        return np.full_like(x, 0.5 * (roi_start + roi_end) * (n_in - 1))
    raise ValueError(mode)


_NEAREST = {
    "round_prefer_floor": lambda v: np.where(v - np.floor(v) == 0.5, np.floor(v), np.round(v)),
    "round_prefer_ceil": lambda v: np.floor(v + 0.5),
    "floor": np.floor, "ceil": np.ceil,
    "simple": np.floor,
    "pytorch": np.floor,   # PopART's: floor(i / scale) in float32, whatever the coordinate mode
}


def _cubic(a):
    def k(d):
        d = np.abs(d)
        return np.where(d <= 1, (a + 2) * d**3 - (a + 3) * d**2 + 1,
                        np.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0))
    return k


def interp_matrix(ctx: LowerCtx, mode, coord_mode, nearest_mode, n_in, n_out, scale, cubic_a,
                  exclude_outside, antialias, roi=(0.0, 1.0), popart=False):
    """[n_out, n_in] weights of one axis, and the mask of output positions that fall
    outside the input (only used by tf_crop_and_resize)."""
    if mode == "nearest" and nearest_mode == "pytorch":
        x = np.arange(n_out, dtype=np.float32) / np.float32(scale)
    else:
        x = _coord(coord_mode, np.arange(n_out, dtype=np.float64), scale, n_in, n_out, *roi,
                   popart=popart)
    outside = (x < 0) | (x > n_in - 1)
    m = np.zeros((n_out, n_in))
    if mode == "nearest":
        if nearest_mode not in _NEAREST:
            raise ctx.error(f"nearest_mode '{nearest_mode}' is not supported")
        idx = np.clip(_NEAREST[nearest_mode](x).astype(np.int64), 0, n_in - 1)
        m[np.arange(n_out), idx] = 1
        return m, outside
    if mode == "linear":
        kern, radius = (lambda d: np.clip(1 - np.abs(d), 0, 1)), 1
    elif mode == "cubic":
        kern, radius = _cubic(cubic_a), 2
    else:
        raise ctx.error(f"mode '{mode}' is not nearest, linear or cubic")
    s = min(scale, 1.0) if antialias else 1.0
    start = int(np.floor(-radius / s)) + 1
    ks = np.arange(start, 1 - start + 1)
    fl = np.floor(x)
    taps = fl[:, None] + ks[None]                           # [n_out, K]
    w = kern((taps - x[:, None]) * s)
    if exclude_outside:
        w = np.where((taps < 0) | (taps > n_in - 1), 0.0, w)
    w = w / w.sum(1, keepdims=True)
    np.add.at(m, (np.repeat(np.arange(n_out), len(ks)), np.clip(taps, 0, n_in - 1).astype(np.int64).ravel()),
              w.ravel())
    return m, outside


def resize_core(ctx: LowerCtx, x, out_shape, scales, mode, coord_mode, nearest_mode, cubic_a=-0.75,
                exclude_outside=0, antialias=0, roi=None, extrapolation_value=0.0):
    y = x
    is_int = not jnp.issubdtype(x.dtype, jnp.floating)
    work = jnp.float32 if is_int else x.dtype
    valid = None
    for ax, (n_in, n_out, sc) in enumerate(zip(x.shape, out_shape, scales)):
        if n_in == n_out and (sc == 1.0 or nearest_mode == "pytorch" and mode == "nearest") \
                and coord_mode != "tf_crop_and_resize":   # PopART's pytorch mode: by shape
            continue
        r = (roi[ax], roi[ax + x.ndim]) if roi is not None else (0.0, 1.0)
        m, outside = interp_matrix(ctx, mode, coord_mode, nearest_mode, n_in, n_out, sc, cubic_a,
                                   exclude_outside, antialias, r, not onnx_semantics(ctx))
        if mode == "nearest":  # a gather keeps every dtype exact
            y = jnp.take(y, jnp.asarray(m.argmax(1)), axis=ax)
        else:
            y = jnp.moveaxis(jnp.tensordot(y.astype(work), jnp.asarray(m, work), ((ax,), (1,)),
                                           precision=HI), -1, ax)
        if coord_mode == "tf_crop_and_resize" and outside.any():
            shp = [1] * x.ndim
            shp[ax] = n_out
            v = jnp.asarray(~outside).reshape(shp)
            valid = v if valid is None else valid & v
    if valid is not None:
        y = jnp.where(valid, y, jnp.asarray(extrapolation_value, y.dtype))
    if is_int and mode != "nearest":
        info = jnp.iinfo(x.dtype)
        y = jnp.clip(jnp.round(y), info.min, info.max)
    return y.astype(x.dtype)


def _opt_static(ctx: LowerCtx, v, what):
    if v is None:
        return None
    a = ctx.static(v, what)
    return None if a.size == 0 else a


@register("Resize", since=10)
def resize(ctx: LowerCtx, x, roi=None, scales=None, sizes=None, mode="nearest", antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", nearest_mode=None,
           **_):
    """ONNX's Resize. Resize-10 (inputs X, scales) in a session is PopART's: nearest_mode
    "pytorch" (floor(i / scale), resizing only the axes whose size changes) and half_pixel
    coordinates unless the node sets others (PopART reads both attributes on Resize-10 too);
    elsewhere ONNX's (asymmetric, floor). Scales and sizes that both have data are PopART's
    error (getScales, resize.cpp), as ONNX's."""
    if ctx.version < 11:
        scales, roi = roi, None
        if onnx_semantics(ctx):
            coordinate_transformation_mode, nearest_mode = "asymmetric", "floor"
        nearest_mode = nearest_mode or "pytorch"
    r = x.ndim
    axes = [a % r for a in axes] if axes else list(range(r))
    scales = _opt_static(ctx, scales, "Resize scales")
    sizes = _opt_static(ctx, sizes, "Resize sizes")
    roi = _opt_static(ctx, roi, "Resize roi")
    if sizes is not None and scales is not None:
        raise popart_error(ctx, "Resize op has inputs for `sizes` and `scales`. Only one of these "
                           "tensors should be present. If `sizes` is needed, please pass an "
                           "empty string as the name of `scales` in the input list ( resize([X, "
                           "roi, '', sizes]) ). If the proto is not generated from the PopART "
                           "Builder, please confirm that only one of the two tensors shall have "
                           "data.", f"scales {scales.tolist()}, sizes {sizes.tolist()}")
    sc = [1.0] * r
    out = list(x.shape)
    if sizes is not None:
        sz = [int(v) for v in sizes]
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            s = pick(sz[i] / x.shape[a] for i, a in enumerate(axes))
            sz = [int(math.floor(s * x.shape[a] + 0.5)) for a in axes]
            for a, n in zip(axes, sz):
                sc[a], out[a] = s, n
        else:
            for a, n in zip(axes, sz):
                sc[a], out[a] = n / x.shape[a], n
    elif scales is not None:
        for a, s in zip(axes, scales):
            sc[a], out[a] = float(s), int(np.floor(np.float32(x.shape[a]) * np.float32(s)))  # float32
    elif len(ctx.input_ids) > 3 and ctx.input_ids[2] and ctx.input_ids[3]:   # getScales' texts
        raise popart_error(ctx, "Resize op has  inputs for `sizes` and `scales`,but none of them "
                           "have data.", "scales and sizes are both empty")
    else:
        raise popart_error(ctx, "Resize op has no input for `size` or `scales`. One of these "
                           "tensors needs to be present.", "give scales or sizes")
    if roi is not None and len(axes) != r:
        full = [0.0] * r + [1.0] * r
        for i, a in enumerate(axes):
            full[a], full[a + r] = roi[i], roi[i + len(axes)]
        roi = full
    return resize_core(ctx, x, out, sc, mode, coordinate_transformation_mode, nearest_mode,
                       cubic_coeff_a, exclude_outside, antialias,
                       None if roi is None else [float(v) for v in roi], extrapolation_value)


@register("Upsample")
def upsample(ctx: LowerCtx, x, scales_in=None, mode="nearest", scales=None, **_):
    sc = [float(v) for v in (scales if scales_in is None else ctx.static(scales_in, "Upsample scales"))]
    out = [int(math.floor(n * s)) for n, s in zip(x.shape, sc)]
    return resize_core(ctx, x, out, sc, "linear" if mode in ("linear", "bilinear") else mode,
                       "asymmetric", "floor")


# ---------------------------------------------------------------------------------------
# GridSample, RoiAlign, AffineGrid

def _unnormalize(g, n, align):
    return (g + 1) / 2 * (n - 1) if align else ((g + 1) * n - 1) / 2


def _reflect(c, lo, hi):
    span = hi - lo
    if span <= 0:
        return jnp.zeros_like(c)
    d = jnp.abs(c - lo)
    flips = jnp.floor(d / span)
    extra = d - flips * span
    return jnp.where(flips % 2 == 0, lo + extra, hi - extra)


@register("GridSample", since=16)
def grid_sample(ctx: LowerCtx, x, grid, align_corners=0, mode="linear", padding_mode="zeros", **_):
    """Samples X (N, C, D1, ..., Dr) at the normalized positions in grid (N, D1_out, ...,
    Dr_out, r), whose last axis lists the coordinates innermost axis first (x, y, z, ...)."""
    r = x.ndim - 2
    if r < 1 or grid.ndim != r + 2 or grid.shape[0] != x.shape[0] or grid.shape[-1] != r:
        raise ctx.error(f"expected X (N, C, D1, ..., Dr) and grid (N, D1_out, ..., Dr_out, r), "
                        f"got X {x.shape} and grid {grid.shape}")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.error(f"mode '{mode}' is not nearest, linear or cubic")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise ctx.error(f"padding_mode '{padding_mode}' is not zeros, border or reflection")
    coords, bounds = [], []
    for a, n in enumerate(x.shape[2:]):
        c = _unnormalize(grid[..., r - 1 - a], n, align_corners)
        lo, hi = (0, n - 1) if align_corners else (-0.5, n - 0.5)
        if mode == "nearest":  # rounded (half to even) before the padding rule, as PyTorch
            c = jnp.round(c)
        if padding_mode == "border":
            c = jnp.where((c < lo) | (c > hi), jnp.clip(c, 0, n - 1), c)
        elif padding_mode == "reflection":
            c = _reflect(c, lo, hi)
        coords.append(c)
        bounds.append((lo, hi))
    return sample(x, coords, mode, padding_mode, bounds)


def sample(x, coords: list, mode: str = "linear", padding_mode: str = "zeros",
           bounds: Optional[list] = None) -> jax.Array:
    """Samples ``x`` [N, C, *sp] at pixel coordinates (one [N, *P] array per spatial axis):
    [N, C, *P]. Taps outside the input read zero (``zeros``), the nearest edge (``border``)
    or their reflection in ``bounds`` (``reflection``: (lo, hi) per axis). One gather of every
    tap (1, 2 or 4 per axis for nearest, linear and cubic) for any number of axes."""
    r = len(coords)
    flat, weight, inside = 0, 1, True   # over the taps: [N, K1, ..., Kr, *P]
    for a, (c, n) in enumerate(zip(coords, x.shape[2:])):
        if mode == "nearest":
            taps = c[:, None]
        else:
            c0 = jnp.floor(c)
            f = c - c0
            offsets = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
            taps = jnp.stack([c0 + d for d in offsets], 1)
            w = jnp.stack([1 - f, f] if mode == "linear" else [_jk(f - d) for d in offsets], 1)
            weight = weight * _tap_axis(w, a, r)
        if padding_mode == "zeros":
            inside = inside & _tap_axis((taps >= 0) & (taps <= n - 1), a, r)
        elif padding_mode == "reflection":
            taps = _reflect(taps, *bounds[a])
        flat = flat * n + _tap_axis(jnp.clip(taps, 0, n - 1).astype(jnp.int32), a, r)
    v = jnp.take_along_axis(x.reshape(x.shape[:2] + (-1,)), flat.reshape(len(flat), 1, -1), -1)
    v = v.reshape(x.shape[:2] + flat.shape[1:])       # [N, C, K1, ..., Kr, *P]
    if padding_mode == "zeros":
        v = jnp.where(inside[:, None], v, jnp.zeros((), x.dtype))
    if mode == "nearest":
        return v.reshape(x.shape[:2] + coords[0].shape[1:])
    return jnp.sum(v * weight[:, None], tuple(range(2, 2 + r))).astype(x.dtype)


def _tap_axis(v, a, r):
    """``v`` ([N, K, *out]) with its K taps on tap axis ``a`` of ``r``: [N, 1.., K, ..1, *out]."""
    return v.reshape(v.shape[:1] + (1,) * a + v.shape[1:2] + (1,) * (r - 1 - a) + v.shape[2:])


def _jk(d, a=-0.75):
    d = jnp.abs(d)
    return jnp.where(d <= 1, (a + 2) * d**3 - (a + 3) * d**2 + 1,
                     jnp.where(d < 2, a * d**3 - 5 * a * d**2 + 8 * a * d - 4 * a, 0.0))


@register("AffineGrid", since=20)
def affine_grid(ctx: LowerCtx, theta, size, align_corners=0, **_):
    shp = [int(v) for v in ctx.static(size, "AffineGrid size")]
    sp = shp[2:][::-1]  # W, H(, D)

    def lin(n):
        v = np.linspace(-1, 1, n) if align_corners else (np.arange(n) * 2 + 1) / n - 1
        return v if n > 1 or align_corners else np.zeros(1)
    grids = np.meshgrid(*[lin(n) for n in shp[2:]], indexing="ij")  # (H, W) order
    coords = np.stack(list(grids[::-1]) + [np.ones_like(grids[0])], -1)      # [..., (x, y, 1)]
    base = jnp.asarray(coords, theta.dtype).reshape(-1, len(sp) + 1)
    out = jnp.einsum("pk,njk->npj", base, theta, precision=HI)
    return out.reshape([shp[0]] + shp[2:] + [len(sp)])


@register("RoiAlign", since=10)
def roi_align(ctx: LowerCtx, x, rois, batch_indices, coordinate_transformation_mode="half_pixel",
              mode="avg", output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0, **_):
    x = jnp.asarray(x)   # a constant image is indexed by traced batch indices below
    N, C, H, W = x.shape
    off = 0.5 if (ctx.version >= 16 and coordinate_transformation_mode == "half_pixel") else 0.0
    if sampling_ratio <= 0:
        # adaptive sampling counts depend on the data: bound them by the static image size
        ratio = None
    else:
        ratio = int(sampling_ratio)

    def one(roi, b):
        x1, y1, x2, y2 = roi * spatial_scale - off
        rw, rh = x2 - x1, y2 - y1
        if off == 0.0:
            rw, rh = jnp.maximum(rw, 1.0), jnp.maximum(rh, 1.0)
        bh, bw = rh / output_height, rw / output_width
        gh = ratio or int(math.ceil(H / output_height))
        gw = ratio or int(math.ceil(W / output_width))
        nh = jnp.asarray(ratio, jnp.int32) if ratio else jnp.ceil(rh / output_height).astype(jnp.int32)
        nw = jnp.asarray(ratio, jnp.int32) if ratio else jnp.ceil(rw / output_width).astype(jnp.int32)
        iy = jnp.arange(gh)
        ix = jnp.arange(gw)
        ys = y1 + jnp.arange(output_height)[:, None] * bh + (iy[None] + 0.5) * bh / nh   # [oh, gh]
        xs = x1 + jnp.arange(output_width)[:, None] * bw + (ix[None] + 0.5) * bw / nw    # [ow, gw]
        my, mx = iy < nh, ix < nw
        img = x[b]

        def bil(yy, xx):
            out_of = (yy < -1) | (yy > H) | (xx < -1) | (xx > W)
            yy, xx = jnp.maximum(yy, 0), jnp.maximum(xx, 0)
            y0 = jnp.minimum(jnp.floor(yy).astype(jnp.int32), H - 1)
            x0 = jnp.minimum(jnp.floor(xx).astype(jnp.int32), W - 1)
            y1_, x1_ = jnp.minimum(y0 + 1, H - 1), jnp.minimum(x0 + 1, W - 1)
            yy = jnp.where(y0 >= H - 1, y0.astype(yy.dtype), yy)
            xx = jnp.where(x0 >= W - 1, x0.astype(xx.dtype), xx)
            ly, lx = yy - y0, xx - x0
            hy, hx = 1 - ly, 1 - lx
            terms = [hy * hx * img[:, y0, x0], hy * lx * img[:, y0, x1_],
                     ly * hx * img[:, y1_, x0], ly * lx * img[:, y1_, x1_]]
            return terms, out_of
        Y = ys[:, None, :, None]   # [oh, 1, gh, 1]
        X = xs[None, :, None, :]   # [1, ow, 1, gw]
        Y, X = jnp.broadcast_arrays(Y, X)
        terms, oob = bil(Y, X)      # each term [C, oh, ow, gh, gw]
        valid = (my[None, None, :, None] & mx[None, None, None, :]) & ~oob
        cnt = jnp.maximum(nh * nw, 1).astype(x.dtype)
        if mode == "avg":
            v = sum(terms)
            return jnp.sum(jnp.where(valid, v, 0), (-2, -1)) / cnt
        if mode == "max":
            v = jnp.max(jnp.stack(terms), 0)
            return jnp.max(jnp.where(valid, v, -jnp.inf), (-2, -1)).astype(x.dtype)
        raise ctx.error(f"mode '{mode}' is not avg or max")
    return jax.vmap(one)(rois, batch_indices.astype(jnp.int32))
