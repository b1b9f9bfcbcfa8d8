"""Text ops of ai.onnx: TfIdfVectorizer.

The n-gram pool is an attribute, so the counting is unrolled at trace time: one comparison of
shifted slices of the input per (pool n-gram, skip distance). Integer inputs may be run-time
data; string inputs (which XLA has no type for) are mapped to token ids on the host."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .registry import LowerCtx, register


def _pool_ngrams(ngram_counts, pool, lo, hi):
    """(n-gram index, tokens) of every pool n-gram whose length is in [lo, hi]."""
    out, k = [], 0
    bounds = list(ngram_counts) + [len(pool)]
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
        for s in range(a, b - n + 1, n):
            if lo <= n <= hi:
                out.append((k, list(pool[s:s + n])))
            k += 1
    return out


@register("TfIdfVectorizer", since=9)
def tfidf_vectorizer(ctx: LowerCtx, x, max_gram_length=1, max_skip_count=0, min_gram_length=1, mode="TF",
                     ngram_counts=(), ngram_indexes=(), pool_int64s=None, pool_strings=None,
                     weights=None, **_):
    if mode not in ("TF", "IDF", "TFIDF"):
        raise ctx.error(f"mode '{mode}' is not one of TF, IDF, TFIDF")
    if jnp.ndim(x) > 2:
        raise ctx.error(f"input must be [C] or [N, C], got shape {list(jnp.shape(x))}")
    pool = list(pool_strings) if pool_strings else list(pool_int64s or [])
    if pool_strings:  # strings -> token ids (-1: not in the pool)
        vocab = {t: i for i, t in enumerate(dict.fromkeys(pool))}
        xs = ctx.static(x, "the string input of TfIdfVectorizer")
        x = np.vectorize(lambda t: vocab.get(t.decode() if isinstance(t, bytes) else str(t), -1),
                         otypes=[np.int64])(xs) if xs.size else xs.astype(np.int64)
        pool = [vocab[t] for t in pool]
    rows = x if jnp.ndim(x) == 2 else jnp.reshape(x, (1, -1))
    size = max(ngram_indexes) + 1 if ngram_indexes else 0
    counts = jnp.zeros((rows.shape[0], size), jnp.float32)
    C = rows.shape[1]
    for skip in range(max_skip_count + 1):
        d = skip + 1   # unigrams are counted once, at distance 1
        for k, toks in _pool_ngrams(ngram_counts, pool, min_gram_length if d == 1
                                    else max(min_gram_length, 2), max_gram_length):
            span = (len(toks) - 1) * d
            if span >= C:
                continue
            hit = jnp.ones((rows.shape[0], C - span), bool)
            for j, t in enumerate(toks):
                hit = hit & (rows[:, j * d: j * d + C - span] == t)
            counts = counts.at[:, ngram_indexes[k]].add(jnp.sum(hit, 1, dtype=jnp.float32))
    w = jnp.asarray(np.asarray(weights, np.float32)) if weights else None
    if mode == "IDF":
        y = (counts > 0).astype(jnp.float32) * (1 if w is None else w)
    elif mode == "TFIDF" and w is not None:
        y = counts * w
    else:
        y = counts
    return y if jnp.ndim(x) == 2 else y[0]
