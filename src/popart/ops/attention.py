"""Attention ops: ai.onnx Attention (opset 23+) and ai.onnx.preview FlexAttention.

Both compute ``softmax((Q * sqrt(scale)) @ (K * sqrt(scale))^T) @ V`` over rank-4
``[batch, heads, seq, head_size]`` tensors, with grouped-query attention (each K/V head shared
by a contiguous group of ``q_heads / kv_heads`` query heads). They share the score and softmax
helpers below and differ in what happens around the softmax:

* Attention adds an additive bias built from ``attn_mask``, ``is_causal`` (bottom-right aligned
  at the cached-key offset), the local window (opset 25) and ``nonpad_kv_seqlen``; a query row
  whose bias is ``-inf`` everywhere yields zeros. It also takes 3-D ``[batch, seq, hidden]``
  inputs split into ``q_num_heads`` / ``kv_num_heads`` heads, concatenates ``past_key`` /
  ``past_value`` into ``present_key`` / ``present_value`` and can expose the scores
  (``qk_matmul_output``).
* FlexAttention runs the ``score_mod`` / ``prob_mod`` subgraphs on the scores and the
  probabilities, computed in ``softmax_precision`` (float32 by default, float64 for double).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from .registry import LowerCtx, register
from .shape import np_type

# softmax_precision values (TensorProto data types) the ops accept.
_PRECISIONS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
               onnx.TensorProto.BFLOAT16)


# ---------------------------------------------------------------------------------------
# Shared core

def _repeat_kv(ctx: LowerCtx, q_heads: int, *kv: jax.Array) -> list:
    """Repeat each K/V head ``q_heads / kv_heads`` times along axis 1: [h0, h0, h1, h1, ...]."""
    kv_heads = kv[0].shape[1]
    if any(x.shape[1] != kv_heads for x in kv) or q_heads % kv_heads:
        raise ctx.error(f"the number of query heads ({q_heads}) must be a multiple of the "
                        f"number of key/value heads, got key/value heads "
                        f"{[x.shape[1] for x in kv]}")
    return [jnp.repeat(x, q_heads // kv_heads, axis=1) for x in kv]


def _scores(q: jax.Array, k: jax.Array, scale: Optional[float]) -> jax.Array:
    """``(q * s) @ (k * s)^T`` with ``s = sqrt(scale)`` in q's dtype; ``scale`` defaults to
    ``1 / sqrt(head_size)``."""
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = jnp.asarray(np.sqrt(scale), q.dtype)
    return jnp.matmul(q * s, jnp.swapaxes(k * s, -1, -2))


def _softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis; a row that is ``-inf`` everywhere gives zeros, not NaN."""
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isneginf(m), jnp.zeros((), x.dtype), m))
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(s == 0, jnp.ones((), x.dtype), s)


def _precision(ctx: LowerCtx, softmax_precision: Optional[int], default: Any) -> Any:
    if softmax_precision is None:
        return default
    if softmax_precision not in _PRECISIONS:
        raise ctx.error(f"softmax_precision must be one of {sorted(_PRECISIONS)} (FLOAT, "
                        f"FLOAT16, DOUBLE, BFLOAT16), got {softmax_precision}")
    return np_type(ctx, softmax_precision)


# ---------------------------------------------------------------------------------------
# ai.onnx Attention

def _split_heads(ctx: LowerCtx, x: jax.Array, heads: Optional[int], name: str, attr: str) -> jax.Array:
    """[B, S, heads * size] -> [B, heads, S, size]."""
    if heads is None:
        raise ctx.error(f"3-D input {name} {x.shape} needs attribute {attr} (its number of "
                        f"heads), which is not given")
    if heads <= 0 or x.shape[2] % heads:
        raise ctx.error(f"{attr}={heads} must be positive and divide the hidden size "
                        f"{x.shape[2]} of {name} {x.shape}")
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _attention_bias(ctx: LowerCtx, mask: Any, sq: int, skv: int, offset: Any, is_causal: bool,
                    left: int, right: int, nonpad: Any, dtype: Any) -> Optional[jax.Array]:
    """The additive bias (0 or -inf, plus a float mask) broadcastable to [B, H, sq, skv].

    ``offset`` (an int, or [B, 1, 1, 1] per batch) is the absolute position of query 0: query
    ``i`` may attend key ``j <= i + offset`` when causal, and keys within the window
    ``[i + offset - left, i + offset + right]`` (a side is unbounded when its size is -1)."""
    bias = None
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape[-1] > skv:
            raise ctx.error(f"attn_mask {mask.shape} is longer than the {skv} keys in its "
                            f"last dimension")
        is_bool = mask.dtype == jnp.bool_
        if mask.shape[-1] < skv:   # a shorter mask leaves the remaining keys masked out
            pad = [(0, 0)] * (mask.ndim - 1) + [(0, skv - mask.shape[-1])]
            mask = jnp.pad(mask, pad, constant_values=False if is_bool else -jnp.inf)
        bias = jnp.where(mask, jnp.zeros((), dtype), -jnp.inf).astype(dtype) if is_bool else mask
    pos = jnp.arange(sq)[:, None] + offset    # absolute position of each query
    key = jnp.arange(skv)
    allowed = []
    if is_causal:
        allowed.append(key <= pos)
    if left >= 0:
        allowed.append(pos - key <= left)
    if right >= 0:
        allowed.append(key - pos <= right)
    if nonpad is not None:
        allowed.append(key < jnp.reshape(nonpad, (-1, 1, 1, 1)))
    if allowed:
        ok = functools.reduce(operator.and_, allowed)
        positional = jnp.where(ok, jnp.zeros((), dtype), -jnp.inf).astype(dtype)
        bias = positional if bias is None else bias + positional
    return bias


def _attention(ctx: LowerCtx, Q, K, V, attn_mask=None, past_key=None, past_value=None,
               nonpad_kv_seqlen=None, *, scale=None, is_causal=0, q_num_heads=None,
               kv_num_heads=None, softmax_precision=None, softcap=0.0, qk_matmul_output_mode=0,
               left_window_size=-1, right_window_size=-1, check_4d_heads=False) -> tuple:
    """Attention at any opset; ``check_4d_heads`` rejects head counts given with 4-D inputs
    (opset 25)."""
    Q, K, V = (jnp.asarray(x) for x in (Q, K, V))
    if not Q.ndim == K.ndim == V.ndim or Q.ndim not in (3, 4):
        raise ctx.error(f"Q, K and V must all be 3-D or all 4-D, got shapes {Q.shape}, "
                        f"{K.shape}, {V.shape}")
    if (past_key is None) != (past_value is None):
        raise ctx.error("past_key and past_value must be given together, got only "
                        + ("past_key" if past_value is None else "past_value"))
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise ctx.error("nonpad_kv_seqlen (an external KV cache) cannot be combined with "
                        "past_key / past_value")
    if qk_matmul_output_mode not in (0, 1, 2, 3):
        raise ctx.error(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {qk_matmul_output_mode}")
    for attr, w in (("left_window_size", left_window_size),
                    ("right_window_size", right_window_size)):
        if w < -1:
            raise ctx.error(f"{attr} must be -1 (unbounded) or nonnegative, got {w}")
    three_d = Q.ndim == 3
    if three_d:
        Q = _split_heads(ctx, Q, q_num_heads, "Q", "q_num_heads")
        K = _split_heads(ctx, K, kv_num_heads, "K", "kv_num_heads")
        V = _split_heads(ctx, V, kv_num_heads, "V", "kv_num_heads")
    elif check_4d_heads and (q_num_heads is not None or kv_num_heads is not None):
        raise ctx.error(f"q_num_heads / kv_num_heads must not be given with 4-D inputs, got "
                        f"q_num_heads={q_num_heads}, kv_num_heads={kv_num_heads}")
    if past_key is not None:
        K = jnp.concatenate([jnp.asarray(past_key), K], axis=2)
        V = jnp.concatenate([jnp.asarray(past_value), V], axis=2)
    present_key, present_value = K, V
    sq, skv = Q.shape[2], K.shape[2]

    if past_key is not None:
        offset = past_key.shape[2]
    elif nonpad_kv_seqlen is not None:
        offset = jnp.reshape(jnp.asarray(nonpad_kv_seqlen), (-1, 1, 1, 1)) - sq
    else:
        offset = 0
    bias = _attention_bias(ctx, attn_mask, sq, skv, offset, bool(is_causal), left_window_size,
                           right_window_size, nonpad_kv_seqlen, Q.dtype)

    K, V = _repeat_kv(ctx, Q.shape[1], K, V)
    raw = _scores(Q, K, scale)
    qk = softcap * jnp.tanh(raw / softcap) if softcap > 0 else raw
    logits = qk if bias is None else qk + bias
    probs = _softmax(logits.astype(_precision(ctx, softmax_precision, logits.dtype)))
    if bias is not None:   # rows with no attendable key are zero (even if their logits are NaN)
        probs = jnp.where(jnp.all(jnp.isneginf(bias), axis=-1, keepdims=True),
                          jnp.zeros((), probs.dtype), probs)
    probs = probs.astype(Q.dtype)
    Y = jnp.matmul(probs, V)
    if three_d:
        Y = Y.transpose(0, 2, 1, 3).reshape(Y.shape[0], sq, -1)
    qk_out = (raw, qk, logits, probs)[qk_matmul_output_mode].astype(Q.dtype)
    return (Y, present_key, present_value, qk_out)[:ctx.num_outputs]


@register("Attention", since=23)
def attention_23(ctx: LowerCtx, Q, K, V, attn_mask=None, past_key=None, past_value=None,
                 nonpad_kv_seqlen=None, **attrs) -> tuple:
    """Opsets 23 and 24 (24 adds the nonpad_kv_seqlen input)."""
    return _attention(ctx, Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs)


@register("Attention", since=25)
def attention_25(ctx: LowerCtx, Q, K, V, attn_mask=None, past_key=None, past_value=None,
                 nonpad_kv_seqlen=None, **attrs) -> tuple:
    """Opset 25: local windows; head counts are only allowed with 3-D inputs."""
    return _attention(ctx, Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen,
                      check_4d_heads=True, **attrs)


# ---------------------------------------------------------------------------------------
# ai.onnx.preview FlexAttention

def _run_mod(ctx: LowerCtx, graph: Any, x: jax.Array, attr: str) -> jax.Array:
    """Run a score_mod / prob_mod subgraph on ``x``; its output must keep x's shape."""
    outs = ctx.run_subgraph(graph, [x])
    if len(outs) != 1 or jnp.shape(outs[0]) != x.shape:
        raise ctx.error(f"{attr} must return one tensor of shape {x.shape}, got shapes "
                        f"{[jnp.shape(o) for o in outs]}")
    return jnp.asarray(outs[0]).astype(x.dtype)


@register("FlexAttention", domain="ai.onnx.preview", since=1)
def flex_attention(ctx: LowerCtx, Q, K, V, scale=None, score_mod=None, prob_mod=None,
                   softmax_precision=None, **_) -> jax.Array:
    Q, K, V = (jnp.asarray(x) for x in (Q, K, V))
    if not Q.ndim == K.ndim == V.ndim == 4:
        raise ctx.error(f"Q, K and V must be rank-4, got shapes {Q.shape}, {K.shape}, {V.shape}")
    if K.shape[2] != V.shape[2] or K.shape[3] != Q.shape[3]:
        raise ctx.error(f"K {K.shape} must match V's sequence length and Q's head size "
                        f"(Q {Q.shape}, V {V.shape})")
    dtype = _precision(ctx, softmax_precision,
                       jnp.float64 if Q.dtype == jnp.float64 else jnp.float32)
    K, V = _repeat_kv(ctx, Q.shape[1], K, V)
    scores = _scores(Q, K, scale).astype(dtype)
    if score_mod is not None:
        scores = _run_mod(ctx, score_mod, scores, "score_mod")
    probs = _softmax(scores)
    if prob_mod is not None:
        probs = _run_mod(ctx, prob_mod, probs, "prob_mod")
    return jnp.matmul(probs, V.astype(dtype)).astype(V.dtype)
