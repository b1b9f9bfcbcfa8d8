"""Leftover ai.onnx tensor ops: signal processing (windows, DFT, STFT, MelWeightMatrix),
BitCast, Col2Im, and string ops (on compile-time constant strings only: XLA has no strings)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import add, LowerCtx, register
from .shape import ints, np_type


# ---------------------------------------------------------------------------------------
# Signal processing

def _window(fn):
    def lower(ctx: LowerCtx, size, output_datatype=1, periodic=1, **_):
        n = int(ctx.static(size, "size").reshape(-1)[0])
        k = np.arange(n, dtype=np.float64)
        w = fn(2 * np.pi * k / (n if periodic else n - 1))
        return w.astype(np_type(ctx, output_datatype))
    return lower


add("HannWindow", _window(lambda t: 0.5 - 0.5 * np.cos(t)), since=17, static_inputs=(0,))
add("HammingWindow", _window(lambda t: 25 / 46 - 21 / 46 * np.cos(t)), since=17,
    static_inputs=(0,))
add("BlackmanWindow", _window(lambda t: 0.42 - 0.5 * np.cos(t) + 0.08 * np.cos(2 * t)),
    since=17, static_inputs=(0,))


def _complex(x):
    """[..., 1] real or [..., 2] (re, im) -> complex128 (computed in double, like onnx)."""
    x = jnp.asarray(x).astype(jnp.float64)
    return x[..., 0] + 1j * x[..., 1] if x.shape[-1] == 2 else x[..., 0].astype(jnp.complex128)


def _real_pair(y, dtype):
    return jnp.stack([jnp.real(y), jnp.imag(y)], -1).astype(dtype)


def _dft(ctx: LowerCtx, x, n, axis, inverse, onesided):
    ax = axis % x.ndim
    if ax == x.ndim - 1:
        raise ctx.error("axis must not be the last (real / imaginary) dimension")
    c = _complex(x)
    if onesided and inverse:                     # irfft: one-sided spectrum -> real signal
        return jnp.fft.irfft(c, n=n, axis=ax)[..., None].astype(x.dtype)
    y = (jnp.fft.ifft if inverse else jnp.fft.fft)(c, n=n, axis=ax)
    if onesided:
        y = lax.slice_in_dim(y, 0, y.shape[ax] // 2 + 1, axis=ax)
    return _real_pair(y, x.dtype)


def _len(ctx: LowerCtx, v, what):
    return None if v is None else int(ctx.static(v, what).reshape(-1)[0])


add("DFT", lambda ctx, x, dft_length=None, axis=1, inverse=0, onesided=0, **_:
    _dft(ctx, x, _len(ctx, dft_length, "dft_length"), axis, inverse, onesided),
    since=17, static_inputs=(1,))
add("DFT", lambda ctx, x, dft_length=None, axis=None, inverse=0, onesided=0, **_:
    _dft(ctx, x, _len(ctx, dft_length, "dft_length"),
         -2 if axis is None else _len(ctx, axis, "axis"), inverse, onesided),
    since=20, static_inputs=(1, 2))


@register("STFT", since=17, static_inputs=(1, 3))
def stft(ctx: LowerCtx, x, frame_step, window=None, frame_length=None, onesided=1, **_):
    step = _len(ctx, frame_step, "frame_step")
    length = _len(ctx, frame_length, "frame_length") or (None if window is None else window.shape[0])
    if length is None:
        raise ctx.error("either window or frame_length is required")
    frames = 1 + (x.shape[1] - length) // step
    idx = step * np.arange(frames)[:, None] + np.arange(length)[None, :]
    f = _complex(x)[:, idx]                                       # [batch, frames, length]
    if window is not None:
        f = f * window
    y = jnp.fft.fft(f, axis=-1)
    if onesided:
        y = y[..., : length // 2 + 1]
    return _real_pair(y, x.dtype)


@register("MelWeightMatrix", since=17, static_inputs=(0, 1, 2, 3, 4))
def mel_weight_matrix(ctx: LowerCtx, num_mel_bins, dft_length, sample_rate, lower_edge_hertz,
                      upper_edge_hertz, output_datatype=1, **_):
    nmel, n, sr = (_len(ctx, v, w) for v, w in ((num_mel_bins, "num_mel_bins"),
                                                   (dft_length, "dft_length"),
                                                   (sample_rate, "sample_rate")))
    lo, hi = (float(ctx.static(v, w)) for v, w in ((lower_edge_hertz, "lower_edge_hertz"),
                                                    (upper_edge_hertz, "upper_edge_hertz")))
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    pts = np.arange(nmel + 2) * (mel(hi) - mel(lo)) / (nmel + 2) + mel(lo)
    bins = (((n + 1) * (700 * (10 ** (pts / 2595) - 1))) // sr).astype(int)
    out = np.zeros((n // 2 + 1, nmel))
    for i in range(nmel):
        l, cen, h = bins[i:i + 3]
        if cen == l:
            out[cen, i] = 1
        else:
            out[l:cen + 1, i] = (np.arange(l, cen + 1) - l) / (cen - l)
        if h > cen:
            out[cen:h, i] = (h - np.arange(cen, h)) / (h - cen)
    return out.astype(np_type(ctx, output_datatype))


# ---------------------------------------------------------------------------------------
# Bits and blocks

@register("BitCast", since=26)
def bitcast(ctx: LowerCtx, x, to=None, **_):
    dt = np_type(ctx, to)
    if dt.itemsize != jnp.result_type(x).itemsize:
        raise ctx.error(f"BitCast needs types of the same bit width; got {x.dtype} -> {dt}")
    if np.bool_ in (dt, jnp.result_type(x)):       # bool is one byte 0 / 1
        return x != 0 if dt == np.bool_ else x.astype(dt)
    return lax.bitcast_convert_type(x, dt)


@register("Col2Im", since=18, static_inputs=(1, 2))
def col2im(ctx: LowerCtx, x, image_shape, block_shape, dilations=None, pads=None, strides=None, **_):
    img, blk = ints(ctx, image_shape, "image_shape"), ints(ctx, block_shape, "block_shape")
    d = len(img)
    dil, st = dilations or [1] * d, strides or [1] * d
    pads = pads or [0] * (2 * d)
    nblk = [(img[i] + pads[i] + pads[i + d] - dil[i] * (blk[i] - 1) - 1) // st[i] + 1 for i in range(d)]
    b = np.stack(np.meshgrid(*[np.arange(k) for k in blk], indexing="ij"), -1).reshape(-1, 1, d)
    l = np.stack(np.meshgrid(*[np.arange(k) for k in nblk], indexing="ij"), -1).reshape(1, -1, d)
    coord = l * np.array(st) - np.array(pads[:d]) + b * np.array(dil)     # [B, L, d]
    ok = np.all((coord >= 0) & (coord < np.array(img)), -1)
    flat = np.where(ok, np.ravel_multi_index(tuple(np.clip(coord, 0, np.array(img) - 1).T),
                                             img).T, int(np.prod(img))).reshape(-1)
    n, cb, _ = x.shape
    ch = cb // int(np.prod(blk))
    out = jnp.zeros((n, ch, int(np.prod(img))), x.dtype).at[:, :, flat].add(
        x.reshape(n, ch, -1), mode="drop")
    return out.reshape([n, ch] + img)


# ---------------------------------------------------------------------------------------
# Strings (compile-time constants only)

def _strings(ctx: LowerCtx, x, what="input"):
    x = ctx.static(x, f"the string {what}")
    return x.astype(object)


@register("StringConcat", since=20)
def string_concat(ctx: LowerCtx, a, b, **_):
    return _strings(ctx, a) + _strings(ctx, b)


@register("RegexFullMatch", since=20)
def regex_full_match(ctx: LowerCtx, x, pattern="", **_):
    rx = re.compile(pattern)
    return np.vectorize(lambda s: rx.fullmatch(s) is not None, otypes=[bool])(_strings(ctx, x))


@register("StringSplit", since=20)
def string_split(ctx: LowerCtx, x, delimiter=None, maxsplit=None, **_):
    x = _strings(ctx, x)
    parts = [s.split(delimiter or None, -1 if maxsplit is None else maxsplit) for s in x.reshape(-1)]
    width = max([len(p) for p in parts] or [0])
    y = np.full((len(parts), width), "", dtype=object)
    for i, p in enumerate(parts):
        y[i, :len(p)] = p
    return y.reshape(x.shape + (width,)), np.array([len(p) for p in parts], np.int64).reshape(x.shape)


@register("StringNormalizer", since=10)
def string_normalizer(ctx: LowerCtx, x, case_change_action="NONE", is_case_sensitive=0, locale=None,
                      stopwords=None, **_):
    x = _strings(ctx, x)
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise ctx.error(f"input must have shape [C] or [1, C], got {list(x.shape)}")
    conv = {"NONE": str, "LOWER": str.lower, "UPPER": str.upper}.get(case_change_action)
    if conv is None:
        raise ctx.error(f"unknown case_change_action {case_change_action!r}")
    fold = (lambda s: s) if is_case_sensitive else str.lower
    stops = {fold(w) for w in stopwords or []}
    kept = [conv(s) for s in x.reshape(-1) if fold(s) not in stops] or [""]
    return np.array(kept, dtype=object).reshape(x.shape[:-1] + (len(kept),))
