"""Sequence and Optional ops. A sequence is a Python list of arrays (its length is static);
an empty optional is ``None``. Ops whose output may be a sequence return ``(value,)``
(a bare list would read as several outputs)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .registry import add, is_static, LowerCtx, register
from .shape import ints, _split


def _pos(ctx: LowerCtx, seq, pos, insert=False):
    p = int(ctx.static(pos, "position").reshape(-1)[0])
    n = len(seq) + (1 if insert else 0)
    if not -n <= p < n:
        raise ctx.error(f"position {p} is out of range for a sequence of length {len(seq)}")
    return p % n


add("SequenceConstruct", lambda ctx, *xs, **_: (list(xs),), since=11)
add("SequenceEmpty", lambda ctx, dtype=None, **_: ([],), since=11)
add("SequenceLength", lambda ctx, seq, **_: np.array(len(seq), np.int64), since=11)


@register("SequenceAt", since=11)
def sequence_at(ctx: LowerCtx, seq, pos, **_):
    """A run-time position works when all elements have the same shape and dtype."""
    if is_static(pos) or not seq:
        return (seq[_pos(ctx, seq, pos)],)
    if len({(jnp.shape(x), jnp.result_type(x)) for x in seq}) != 1:
        raise ctx.error("a position computed at run time needs elements of one shape and dtype")
    p = jnp.asarray(pos).reshape(())
    return jnp.stack(seq)[jnp.where(p < 0, p + len(seq), p)]


@register("SequenceErase", since=11, static_inputs=(1,))
def sequence_erase(ctx: LowerCtx, seq, pos=None, **_):
    p = len(seq) - 1 if pos is None else _pos(ctx, seq, pos)
    return (seq[:p] + seq[p + 1:],)


@register("SequenceInsert", since=11, static_inputs=(2,))
def sequence_insert(ctx: LowerCtx, seq, x, pos=None, **_):
    p = len(seq) if pos is None else _pos(ctx, seq, pos, insert=True)
    return (seq[:p] + [x] + seq[p:],)


@register("SplitToSequence", since=11, static_inputs=(1,))
def split_to_sequence(ctx: LowerCtx, x, split=None, axis=0, keepdims=1, **_):
    ax = axis % x.ndim
    if split is None:
        parts = [jnp.take(x, i, axis=ax) for i in range(x.shape[ax])]
        return (parts if not keepdims else [jnp.expand_dims(p, ax) for p in parts],)
    s = ints(ctx, split, "split")
    if np.ndim(ctx.static(split, "split")) == 0:
        n = x.shape[ax]
        s = [min(s[0], n - i) for i in range(0, n, s[0])]
    return (list(_split(ctx, x, s, ax)),)


@register("ConcatFromSequence", since=11)
def concat_from_sequence(ctx: LowerCtx, seq, axis=0, new_axis=0, **_):
    if not seq:
        raise ctx.error("cannot concatenate an empty sequence")
    return jnp.stack(seq, axis=axis) if new_axis else jnp.concatenate(seq, axis=axis)


add("Optional", lambda ctx, x=None, type=None, **_: (x,), since=15)
add("OptionalHasElement", lambda ctx, x=None, **_: np.array(x is not None), since=15)


@register("OptionalGetElement", since=15)
def optional_get_element(ctx: LowerCtx, x=None, **_):
    if x is None:
        raise ctx.error("the optional is empty")
    return (x,)


@register("SequenceMap", since=17)
def sequence_map(ctx: LowerCtx, seq, *extra, body=None, **_):
    """``body`` on each element (sequences among ``extra`` are walked in step)."""
    outs = [ctx.run_subgraph(body, [seq[i]] + [e[i] if isinstance(e, list) else e for e in extra])
            for i in range(len(seq))]
    return tuple(list(o) for o in zip(*outs)) if outs else tuple([] for _ in range(ctx.num_outputs))
