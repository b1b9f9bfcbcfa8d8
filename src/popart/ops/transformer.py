"""Transformer building blocks of recent ai.onnx opsets: RMSNormalization, RotaryEmbedding,
SwiGLU, LinearAttention and CausalConvWithState."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from .registry import LowerCtx, register
from .shape import np_type

_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")
_ACTIVATIONS = ("none", "silu", "swish")


def _wide(x: Any) -> jax.Array:
    """``x`` in at least float32 (half-precision inputs are computed in float32)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _check_shape(ctx: LowerCtx, name: str, x: Any, expected: tuple) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ctx.error(f"input '{name}' has shape {tuple(x.shape)}, expected {tuple(expected)}")


@register("RMSNormalization", since=23)
def rms_normalization(ctx: LowerCtx, x: Any, scale: Any, axis: int = -1, epsilon: float = 1e-5,
                      stash_type: int = 1, **_) -> jax.Array:
    """x / sqrt(mean(x^2 over axes [axis, rank)) + epsilon) * scale. The normalisation runs in
    the wider of x's type and ``stash_type`` (float16 inputs in float32 by default, float64
    kept as is) and is cast back to x's type before scaling."""
    if not -x.ndim <= axis < x.ndim:
        raise ctx.error(f"attribute 'axis' must lie in [{-x.ndim}, {x.ndim}) for an input of "
                        f"rank {x.ndim}, got {axis}")
    stash = np_type(ctx, stash_type)
    if not jnp.issubdtype(stash, jnp.floating):
        raise ctx.error(f"attribute 'stash_type' must name a floating-point type, got "
                        f"{stash_type} ({stash})")
    xs = x.astype(jnp.promote_types(x.dtype, stash))
    ms = jnp.mean(xs * xs, axis=tuple(range(axis % x.ndim, x.ndim)), keepdims=True)
    y = (xs * lax.rsqrt(ms + epsilon)).astype(x.dtype) * scale
    return y.astype(jnp.result_type(scale))


@register("RotaryEmbedding", since=23)
def rotary_embedding(ctx: LowerCtx, x: Any, cos_cache: Any, sin_cache: Any,
                     position_ids: Optional[Any] = None, interleaved: int = 0,
                     num_heads: Optional[int] = None, rotary_embedding_dim: int = 0,
                     **_) -> jax.Array:
    """Rotates the first ``rotary_embedding_dim`` features of each head by the angles in the
    caches. X is [B, H, S, D] or [B, S, H*D] (then ``num_heads`` gives H)."""
    if x.ndim == 4:
        xb = jnp.swapaxes(x, 1, 2)                     # [B, S, H, D]
    elif x.ndim == 3:
        if not num_heads or num_heads < 0 or x.shape[2] % num_heads:
            raise ctx.error(f"attribute 'num_heads' must be a positive divisor of the hidden "
                            f"size {x.shape[2]} for a 3-D input, got {num_heads}")
        xb = x.reshape(x.shape[:2] + (num_heads, -1))
    else:
        raise ctx.error(f"input 'X' must be 3-D [B, S, H*D] or 4-D [B, H, S, D], got shape "
                        f"{tuple(x.shape)}")
    head = xb.shape[-1]
    rd = rotary_embedding_dim or head
    if rd % 2 or not 0 < rd <= head:
        raise ctx.error(f"attribute 'rotary_embedding_dim' must be even and in (0, {head}] "
                        f"(the head size), got {rd}")
    if position_ids is not None:
        cos_cache = jnp.asarray(cos_cache)[position_ids]
        sin_cache = jnp.asarray(sin_cache)[position_ids]
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        _check_shape(ctx, name + (" (after indexing with position_ids)" if position_ids is not
                                  None else ""), c, xb.shape[:2] + (rd // 2,))
    cos, sin = cos_cache[:, :, None, :], sin_cache[:, :, None, :]
    rot = xb[..., :rd]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :rd // 2], rot[..., rd // 2:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rot = jnp.stack([real, imag], axis=-1).reshape(rot.shape)
    else:
        rot = jnp.concatenate([real, imag], axis=-1)
    y = jnp.concatenate([rot, xb[..., rd:]], axis=-1).astype(x.dtype)
    return y.reshape(x.shape) if x.ndim == 3 else jnp.swapaxes(y, 1, 2)


@register("SwiGLU", since=28)
def swiglu(ctx: LowerCtx, a: Any, b: Any, alpha: float = 1.0, **_) -> jax.Array:
    """a * sigmoid(alpha * a) * b; A and B have the same shape (no broadcasting)."""
    _check_shape(ctx, "B", b, a.shape)
    return (a * jax.nn.sigmoid(alpha * a) * b).astype(a.dtype)


@register("CausalConvWithState", since=27)
def causal_conv_with_state(ctx: LowerCtx, x: Any, weight: Any, bias: Optional[Any] = None,
                           past_state: Optional[Any] = None, activation: str = "none",
                           **_) -> tuple:
    """Depthwise causal 1-D convolution of x [B, C, L] with weight [C, 1, k], the k-1 steps
    before x taken from ``past_state`` (zeros if omitted). Returns (output, present_state),
    the state being the last k-1 steps of the padded sequence."""
    if activation not in _ACTIVATIONS:
        raise ctx.error(f"attribute 'activation' must be one of {', '.join(_ACTIVATIONS)}, "
                        f"got '{activation}'")
    if x.ndim != 3:
        raise ctx.error(f"input 'input' must be 3-D [B, C, L], got shape {tuple(x.shape)}")
    n, c, length = x.shape
    if weight.ndim != 3 or weight.shape[:2] != (c, 1):
        raise ctx.error(f"input 'weight' must have shape ({c}, 1, k), got {tuple(weight.shape)}")
    k = weight.shape[2]
    if past_state is None:
        past_state = jnp.zeros((n, c, k - 1), x.dtype)
    _check_shape(ctx, "past_state", past_state, (n, c, k - 1))
    padded = jnp.concatenate([jnp.asarray(past_state, x.dtype), x], axis=2)
    xs, w = _wide(padded), _wide(weight)
    y = sum(w[:, 0, j, None] * xs[:, :, j:j + length] for j in range(k))
    if bias is not None:
        _check_shape(ctx, "bias", bias, (c,))
        y = y + _wide(bias)[:, None]
    if activation != "none":
        y = jax.nn.silu(y)
    return y.astype(x.dtype), padded[:, :, length:]


@register("LinearAttention", since=27)
def linear_attention(ctx: LowerCtx, query: Any, key: Any, value: Any, past_state: Optional[Any] = None,
                     decay: Optional[Any] = None, beta: Optional[Any] = None,
                     q_num_heads: int = 0, kv_num_heads: int = 0, scale: float = 0.0,
                     update_rule: str = "gated_delta", **_) -> tuple:
    """The recurrence S_t = a_t S_{t-1} + k_t (x) v'_t, o_t = scale * q_t^T S_t of
    ``update_rule`` run over time with ``lax.scan`` in float32 (a_t = exp(decay_t) when gated,
    v'_t = beta_t (v_t - a_t S_{t-1}^T k_t) with the delta rule, else v_t). Query head h reads
    the state of KV head h // (q_num_heads / kv_num_heads). Returns (output, present_state)."""
    if update_rule not in _UPDATE_RULES:
        raise ctx.error(f"attribute 'update_rule' must be one of {', '.join(_UPDATE_RULES)}, "
                        f"got '{update_rule}'")
    if q_num_heads <= 0 or kv_num_heads <= 0 or q_num_heads % kv_num_heads:
        raise ctx.error(f"attribute 'q_num_heads' must be a positive multiple of "
                        f"'kv_num_heads', got q_num_heads={q_num_heads}, "
                        f"kv_num_heads={kv_num_heads}")
    gated, delta = "gated" in update_rule, "delta" in update_rule
    for name, x, needed in (("decay", decay, gated), ("beta", beta, delta)):
        if (x is None) == needed:
            raise ctx.error(f"update_rule '{update_rule}' {'requires' if needed else 'forbids'}"
                            f" input '{name}'")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 3 or x.shape[2] % (q_num_heads if name == "query" else kv_num_heads):
            raise ctx.error(f"input '{name}' must be 3-D [B, T, heads*dim], got shape "
                            f"{tuple(x.shape)}")
    n, t, _ = query.shape
    hq, hkv = q_num_heads, kv_num_heads
    dk, dv = query.shape[2] // hq, value.shape[2] // hkv
    _check_shape(ctx, "key", key, (n, t, hkv * dk))
    _check_shape(ctx, "value", value, (n, t, hkv * dv))
    if decay is not None and decay.shape not in ((n, t, hkv), (n, t, hkv * dk)):
        raise ctx.error(f"input 'decay' must have shape {(n, t, hkv)} or {(n, t, hkv * dk)}, "
                        f"got {tuple(decay.shape)}")
    if beta is not None and beta.shape not in ((n, t, hkv), (n, t, 1)):
        raise ctx.error(f"input 'beta' must have shape {(n, t, hkv)} or {(n, t, 1)}, got "
                        f"{tuple(beta.shape)}")
    state_dtype = query.dtype if past_state is None else past_state.dtype
    if past_state is None:
        past_state = jnp.zeros((n, hkv, dk, dv), jnp.float32)
    _check_shape(ctx, "past_state", past_state, (n, hkv, dk, dv))

    def time_major(x, heads):    # [B, T, heads*D] -> [T, B, heads, D] in float32
        return None if x is None else jnp.moveaxis(_wide(x).reshape(n, t, heads, -1), 1, 0)

    xs = (time_major(query, hkv), time_major(key, hkv), time_major(value, hkv),
          time_major(decay, hkv), time_major(beta, None if beta is None else beta.shape[2]))
    scale = scale or dk ** -0.5

    def step(s, xt):                # s [B, Hkv, dk, dv]; q_t [B, Hkv, group * dk]
        q_t, k_t, v_t, g_t, b_t = xt
        if gated:
            s = s * jnp.exp(g_t)[..., None]
        if delta:
            v_t = b_t * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * v_t[..., None, :]
        o_t = jnp.einsum("bhgk,bhkv->bhgv", q_t.reshape(n, hkv, hq // hkv, dk), s)
        return s, scale * o_t.reshape(n, hq * dv)

    state, out = lax.scan(step, _wide(past_state), xs)
    return jnp.moveaxis(out, 0, 1).astype(query.dtype), state.astype(state_dtype)
