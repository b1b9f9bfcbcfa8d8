"""NumPy transcriptions of the C++ rules of popxl-addons' custom ops (tests/test_custom_ops*.py)."""
from __future__ import annotations

import numpy as np


def groups(r, stride, size):
    block = stride * size
    return [[f + i * stride for i in range(size)] for f in range(r) if f % block < stride]


def member_sum(x, grps):
    """[R, ...]: each replica's row is the sum over its group."""
    out = np.empty_like(x)
    for g in grps:
        out[g] = x[g].sum(0)
    return out


def layer_norm_reference(xs, w, b, g, eps):
    """The C++ rule on the unsharded [N, H]: statistics E[x^2] - E[x]^2; dX from dY as given
    (poplin's distributedNormStatisticsGradients), dScale / dBias summed over N."""
    x = np.concatenate(xs, 1).astype(np.float64)
    gy = np.concatenate(g, 1).astype(np.float64)
    mean = x.mean(1)
    inv = 1 / np.sqrt((x * x).mean(1) - mean ** 2 + eps)
    xhat = (x - mean[:, None]) * inv[:, None]
    y = xhat * np.concatenate(w) + np.concatenate(b)
    dx = inv[:, None] * (gy - gy.mean(1, keepdims=True) - xhat * (gy * xhat).mean(1, keepdims=True))
    return y, mean, inv, dx, (gy * xhat).sum(0), gy.sum(0)


def log_softmax(x):
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))


def fp8_mse_scale_reference(src, U, S, q):
    """Fp8FindBestScaleOpx::grow step by step: histogram over 2^-126 .. 2^127, the 62 biases'
    loops (underflow, within, overflow), argmin and the ties."""
    levels = np.exp2(np.arange(-126, 128, dtype=np.float32))
    a = np.abs(src.reshape(-1)).astype(src.dtype)
    hist = np.bincount(np.searchsorted(levels.astype(src.dtype), a, side="right"),
                       minlength=255).astype(np.float32) / np.float32(a.size)
    hist = hist[1:255]
    bins = levels.copy()
    bins[0] = np.float32(bins[0] * bins[0] / 4)
    mse = np.zeros(62, np.float32)
    under, over = U, U + S
    for k in range(62):
        acc, c = np.float32(0), 1
        while c < under:
            acc = np.float32(acc + hist[c] * bins[c] * bins[c])
            c += 1
        while under <= c < over:
            acc = np.float32(acc + hist[c] * bins[c] * bins[c] * np.float32(q))
            last = bins[c]
            c += 1
        while over <= c < 254:
            acc = np.float32(acc + hist[c] * (last - bins[c]) * (last - bins[c]))
            c += 1
        mse[k] = acc
        under, over = under + 1, over + 1
    ties = int(np.sum(mse == mse.min()))
    return -(int(np.argmin(mse)) + ties // 2 - 31)


def cross_entropy_reference(logits, labels, g):
    """Loss -log_softmax[label] (0 for a label out of range), the negative log-softmax, and the
    grad op's dL/dlogits = g * softmax - g at the label."""
    n, c = logits.shape
    ls = log_softmax(logits.astype(np.float64))
    ok = (labels >= 0) & (labels < c)
    loss = np.where(ok, -ls[np.arange(n), np.clip(labels, 0, c - 1)], 0)
    d = np.exp(ls) * g[:, None]
    d[np.arange(n)[ok], labels[ok]] -= g[ok]
    return loss, -ls, d


def rotate_complex(v, phi, d, sign):
    """RoPE as complex arithmetic: pairs (v[2i], v[2i+1]) of the first ``d`` hidden elements of
    v [B, S, H, hh] times exp(sign i phi) (phi [1 | B, S, d / 2])."""
    z = (v[..., 0:d:2] + 1j * v[..., 1:d:2]) * np.exp(sign * 1j * phi)[:, :, None, :]
    out = v.copy()
    out[..., 0:d:2], out[..., 1:d:2] = z.real, z.imag
    return out


def pack_nibbles(vals):
    """[..., 4n] values in [0, 16) -> uint16 [..., n], the first of each four in the high
    nibble."""
    packed = np.zeros((*vals.shape[:-1], vals.shape[-1] // 4), np.uint16)
    for k, shift in enumerate((12, 8, 4, 0)):
        packed |= (vals[..., k::4].astype(np.uint16) << shift).astype(np.uint16)
    return packed
