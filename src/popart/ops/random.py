"""Random ops of ai.onnx, drawn from ``ctx.rng()``; a ``seed`` attribute folds into the key."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..tensorinfo import np_dtype
from .registry import LowerCtx, register


def _key(ctx: LowerCtx, seed):
    k = ctx.rng()
    return k if seed is None else jax.random.fold_in(k, int(np.float32(seed).view(np.int32)))


def _dtype(ctx: LowerCtx, dtype, like=None, default=np.float32):
    if dtype is None:
        return np.dtype(default if like is None else like.dtype)
    dt = np_dtype(int(dtype))
    if not np.issubdtype(dt, np.floating):
        raise ctx.error(f"dtype must be a floating-point type, got {dt}")
    return dt


def _normal(ctx: LowerCtx, shape, dtype, mean, scale, seed):
    z = jax.random.normal(_key(ctx, seed), tuple(shape), jnp.float32 if dtype.itemsize < 4 else dtype)
    return (z * scale + mean).astype(dtype)


def _uniform(ctx: LowerCtx, shape, dtype, low, high, seed):
    u = jax.random.uniform(_key(ctx, seed), tuple(shape), jnp.float32 if dtype.itemsize < 4 else dtype)
    return (u * (high - low) + low).astype(dtype)


@register("RandomNormal", random=True)
def random_normal(ctx: LowerCtx, dtype=1, mean=0.0, scale=1.0, seed=None, shape=(), **_):
    return _normal(ctx, shape, _dtype(ctx, dtype), mean, scale, seed)


@register("RandomUniform", random=True)
def random_uniform(ctx: LowerCtx, dtype=1, high=1.0, low=0.0, seed=None, shape=(), **_):
    return _uniform(ctx, shape, _dtype(ctx, dtype), low, high, seed)


@register("RandomNormalLike", random=True)
def random_normal_like(ctx: LowerCtx, x, dtype=None, mean=0.0, scale=1.0, seed=None, **_):
    return _normal(ctx, x.shape, _dtype(ctx, dtype, x), mean, scale, seed)


@register("RandomUniformLike", random=True)
def random_uniform_like(ctx: LowerCtx, x, dtype=None, high=1.0, low=0.0, seed=None, **_):
    return _uniform(ctx, x.shape, _dtype(ctx, dtype, x), low, high, seed)


@register("Bernoulli", since=15, random=True)
def bernoulli(ctx: LowerCtx, p, dtype=None, seed=None, **_):
    dt = np.dtype(p.dtype) if dtype is None else np_dtype(int(dtype))
    return (jax.random.uniform(_key(ctx, seed), p.shape, jnp.float32) < p).astype(dt)


@register("Multinomial", since=7, random=True)
def multinomial(ctx: LowerCtx, x, dtype=6, sample_size=1, seed=None, **_):
    """``x`` holds unnormalized log-probabilities [batch, classes]."""
    dt = np_dtype(int(dtype))
    if dt not in (np.int32, np.int64):
        raise ctx.error(f"dtype must be int32 or int64, got {dt}")
    s = jax.random.categorical(_key(ctx, seed), x, axis=-1, shape=(sample_size, x.shape[0]))
    return s.T.astype(dt)
