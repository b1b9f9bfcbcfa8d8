"""Classical-ML ops of ai.onnx.ml: Binarizer, ArrayFeatureExtractor, LabelEncoder, TreeEnsemble.

Attribute defaults are not filled in from onnx.defs for this domain, so every lowering gives
them as keyword defaults. XLA has no string type: a LabelEncoder whose keys or values are
strings runs on the host, so its input must be known at compile time (graph inputs of string
type always are); numeric mappings run at run time as a sorted-key lookup. TreeEnsemble
evaluates every split of every tree at once and then walks all trees in lockstep, one level
per step, for as many steps as the deepest tree has levels (unrolled at trace time)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .registry import LowerCtx, ONNX_ML_DOMAIN as ML, register


def _str(v):
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _is_str(a):
    if a is None:
        return False
    dt = getattr(a, "dtype", None)
    return (np.asarray(a).dtype if dt is None else np.dtype(dt)).kind in "OUS"


@register("Binarizer", domain=ML, since=1)
def binarizer(ctx: LowerCtx, x, threshold=0.0, **_):
    return (x > jnp.asarray(threshold, jnp.result_type(x))).astype(jnp.result_type(x))


@register("ArrayFeatureExtractor", domain=ML, since=1)
def array_feature_extractor(ctx: LowerCtx, x, indices, **_):
    """x[..., indices] with the indices flattened; a 1-D x gives one row [1, k] (as
    onnxruntime does)."""
    idx = jnp.reshape(indices, (-1,)).astype(jnp.int64)
    shape = (1, idx.shape[0]) if jnp.ndim(x) == 1 else tuple(jnp.shape(x)[:-1]) + (idx.shape[0],)
    if _is_str(x):
        xs, ix = ctx.static(x, "the string input of ArrayFeatureExtractor"), ctx.static(indices, "indices")
        return np.reshape(np.take(xs, ix.reshape(-1).astype(np.int64), axis=-1), shape)
    n = jnp.shape(x)[-1]
    return jnp.reshape(jnp.take(x, jnp.where(idx < 0, idx + n, idx), axis=-1, mode="clip"), shape)


# ---------------------------------------------------------------------------------------
# LabelEncoder

def _value_default(values, default):
    """The default output for a values tensor whose dtype has no explicit default."""
    if default is not None:
        return np.asarray(default).reshape(-1)[0]
    kind = np.asarray(values).dtype.kind
    return "_Unused" if kind in "OUS" else (-0.0 if kind == "f" else -1)


def _label_map(ctx: LowerCtx, x, keys, values, default, out_dtype):
    """Map each element of ``x`` through ``dict(zip(keys, values))`` (last key wins; NaN keys
    match NaN inputs); elements without a key become ``default``."""
    if len(keys) != len(values):
        raise ctx.error(f"{len(keys)} keys but {len(values)} values")
    if _is_str(keys) or _is_str(values):
        xs = ctx.static(x, "the input of a LabelEncoder with string keys or values")
        conv = _str if _is_str(keys) else (lambda v: v)
        table, nan_val = {}, None
        for k, v in zip(np.asarray(keys, object if _is_str(keys) else None).tolist(),
                        np.asarray(values, object).tolist()):
            if isinstance(k, float) and k != k:
                nan_val = v
            else:
                table[conv(k)] = v
        is_nan = (lambda e: isinstance(e, float) and e != e) if nan_val is not None else (lambda e: False)
        fn = lambda e: nan_val if is_nan(e) else table.get(conv(e), default)  # noqa: E731
        flat = [fn(e) for e in np.asarray(xs, object).reshape(-1).tolist()]
        if np.dtype(out_dtype).kind in "OUS":
            return np.array([_str(v) for v in flat], dtype=object).reshape(np.shape(xs))
        return np.asarray(flat, out_dtype).reshape(np.shape(xs))
    xdt = jnp.result_type(x)
    k = np.asarray(keys).astype(xdt)
    v = np.asarray(values).astype(out_dtype)
    nan = np.isnan(k) if k.dtype.kind == "f" else np.zeros(k.shape, bool)
    table = dict(zip(k[~nan].tolist(), v[~nan].tolist()))          # last key wins
    ks = np.asarray(sorted(table), xdt)
    vs = np.asarray([table[a] for a in ks.tolist()], out_dtype)
    out = jnp.full(jnp.shape(x), np.asarray(default, out_dtype))
    if ks.size:
        pos = jnp.clip(jnp.searchsorted(jnp.asarray(ks), x), 0, ks.size - 1)
        out = jnp.where(jnp.asarray(ks)[pos] == x, jnp.asarray(vs)[pos], out)
    if nan.any():
        out = jnp.where(jnp.isnan(x), np.asarray(v[nan][-1], out_dtype), out)
    return out


@register("LabelEncoder", domain=ML, since=1)
def label_encoder_v1(ctx: LowerCtx, x, classes_strings=(), default_int64=-1, default_string="_Unused", **_):
    """Opset 1: strings -> their index in classes_strings, or int64 -> class string."""
    classes = list(classes_strings)
    if _is_str(x):
        return _label_map(ctx, x, classes, np.arange(len(classes), dtype=np.int64),
                          default_int64, np.int64)
    return _label_map(ctx, x, np.arange(len(classes), dtype=np.int64), np.asarray(classes, object),
                      default_string, object)


@register("LabelEncoder", domain=ML, since=2)
def label_encoder(ctx: LowerCtx, x, keys_floats=None, keys_int64s=None, keys_strings=None, keys_tensor=None,
                  values_floats=None, values_int64s=None, values_strings=None, values_tensor=None,
                  default_float=-0.0, default_int64=-1, default_string="_Unused",
                  default_tensor=None, **_):
    keys = [a for a in (keys_floats, keys_int64s, keys_strings, keys_tensor) if a is not None]
    vals = [a for a in (values_floats, values_int64s, values_strings, values_tensor) if a is not None]
    if len(keys) != 1 or len(vals) != 1:
        raise ctx.error("exactly one keys_* and one values_* attribute must be set")
    if values_tensor is not None:
        out_dtype = object if _is_str(values_tensor) else np.asarray(values_tensor).dtype
        default = _value_default(values_tensor, default_tensor)
    elif values_floats is not None:
        out_dtype, default = np.float32, default_float
    elif values_int64s is not None:
        out_dtype, default = np.int64, default_int64
    else:
        out_dtype, default = object, default_string
    if keys_strings is not None:
        keys_arr = np.asarray(list(keys_strings), object)
    elif keys_floats is not None:
        keys_arr = np.asarray(keys_floats, np.float32)
    elif keys_int64s is not None:
        keys_arr = np.asarray(keys_int64s, np.int64)
    else:
        keys_arr = np.asarray(keys_tensor)
    vals_arr = np.asarray(list(vals[0]), object) if out_dtype is object else np.asarray(vals[0], out_dtype)
    return _label_map(ctx, x, keys_arr.reshape(-1), vals_arr.reshape(-1), default, out_dtype)


# ---------------------------------------------------------------------------------------
# TreeEnsemble (opset 5)

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_CMP = {_LEQ: jnp.less_equal, _LT: jnp.less, _GTE: jnp.greater_equal, _GT: jnp.greater,
        _EQ: jnp.equal, _NEQ: jnp.not_equal}
_AGGREGATES = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}


def _post_transform(y, mode):
    if mode == 0:
        return y
    if mode == 1:
        return jax.nn.softmax(y, axis=-1)
    if mode == 2:
        return jax.nn.sigmoid(y)
    if mode == 3:   # softmax over the non-zero scores; zeros stay zero
        nz = y != 0
        e = jnp.where(nz, jnp.exp(y - jnp.max(jnp.where(nz, y, -jnp.inf), -1, keepdims=True)), 0)
        s = jnp.sum(e, -1, keepdims=True)
        return jnp.where(s > 0, e / jnp.where(s > 0, s, 1), 0).astype(y.dtype)
    return (jnp.sqrt(2.0) * jax.scipy.special.erfinv(2 * y - 1)).astype(y.dtype)   # PROBIT


@register("TreeEnsemble", domain=ML, since=5)
def tree_ensemble(ctx: LowerCtx, x, nodes_splits=None, nodes_featureids=(), nodes_modes=None,
                  nodes_truenodeids=(), nodes_falsenodeids=(), nodes_trueleafs=(),
                  nodes_falseleafs=(), leaf_targetids=(), leaf_weights=None, tree_roots=(),
                  n_targets=None, aggregate_function=1, post_transform=0,
                  nodes_missing_value_tracks_true=None, membership_values=None,
                  nodes_hitrates=None, **_):
    if aggregate_function not in _AGGREGATES:
        raise ctx.error(f"aggregate_function {aggregate_function} is not one of 0..3")
    if post_transform not in range(5):
        raise ctx.error(f"post_transform {post_transform} is not one of 0..4")
    if n_targets is None or leaf_weights is None or nodes_splits is None or nodes_modes is None:
        raise ctx.error("n_targets, leaf_weights, nodes_splits and nodes_modes are required")
    dt = jnp.result_type(x)
    x2 = jnp.reshape(x, (jnp.shape(x)[0], -1)) if jnp.ndim(x) != 2 else x
    splits = np.asarray(nodes_splits).reshape(-1)
    modes = np.asarray(nodes_modes).reshape(-1).astype(np.int64)
    feat = np.asarray(nodes_featureids, np.int64)
    t_id, f_id = np.asarray(nodes_truenodeids, np.int64), np.asarray(nodes_falsenodeids, np.int64)
    t_leaf, f_leaf = np.asarray(nodes_trueleafs, bool), np.asarray(nodes_falseleafs, bool)
    weights, targets = np.asarray(leaf_weights).reshape(-1), np.asarray(leaf_targetids, np.int64)
    nn, nl = splits.size, weights.size
    if not all(len(a) == nn for a in (modes, feat, t_id, f_id, t_leaf, f_leaf)):
        raise ctx.error("the nodes_* attributes must all have the same length")
    if len(targets) != nl:
        raise ctx.error("leaf_targetids and leaf_weights must have the same length")
    if ((targets < 0) | (targets >= n_targets)).any():
        raise ctx.error(f"leaf_targetids must lie in [0, n_targets={n_targets})")

    # Every split condition, [N, nodes].
    xv = jnp.take(x2, jnp.asarray(feat), axis=1)
    cond = jnp.zeros(xv.shape, bool)
    for m, fn in _CMP.items():
        if (modes == m).any():
            cond = jnp.where(modes == m, fn(xv, jnp.asarray(splits.astype(dt))), cond)
    if (modes == _MEMBER).any():
        if membership_values is None:
            raise ctx.error("set membership nodes (mode 6) need membership_values")
        mv = np.asarray(membership_values).reshape(-1)
        groups, cur = [], []
        for v in mv.tolist():
            if v != v:
                groups.append(cur)
                cur = []
            else:
                cur.append(v)
        member_nodes = np.flatnonzero(modes == _MEMBER)
        if len(groups) != len(member_nodes):
            raise ctx.error(f"{len(member_nodes)} set membership nodes but membership_values "
                            f"holds {len(groups)} NaN-terminated sets")
        width = max(1, max(len(g) for g in groups))
        table = np.full((nn, width), np.nan, dt)
        for n, g in zip(member_nodes, groups):
            table[n, :len(g)] = g
        hit = jnp.any(xv[:, :, None] == jnp.asarray(table)[None], axis=-1)
        cond = jnp.where(modes == _MEMBER, hit, cond)
    if nodes_missing_value_tracks_true is not None:
        mtt = np.asarray(nodes_missing_value_tracks_true, bool).reshape(-1)
        if mtt.any():
            cond = cond | (jnp.isnan(xv) & mtt)

    # One index space: nodes 0..nn-1, leaves nn..nn+nl-1 (a leaf steps to itself).
    nxt_t = np.concatenate([np.where(t_leaf, t_id + nn, t_id), nn + np.arange(nl)])
    nxt_f = np.concatenate([np.where(f_leaf, f_id + nn, f_id), nn + np.arange(nl)])
    roots = []
    for r in tree_roots:   # a tree that is just a leaf: both branches name the same leaf
        roots.append(r + nn if t_leaf[r] and f_leaf[r] and t_id[r] == f_id[r] else r)
    depth = 0
    for r in roots:   # levels of the deepest tree (host walk; guards against cycles)
        frontier, d = {r}, 0
        while any(i < nn for i in frontier):
            frontier = {j for i in frontier if i < nn for j in (nxt_t[i], nxt_f[i])}
            d += 1
            if d > nn:
                raise ctx.error("the tree nodes form a cycle")
        depth = max(depth, d)
    cond_ext = jnp.concatenate([cond, jnp.zeros((cond.shape[0], nl), bool)], axis=1)
    state = jnp.broadcast_to(jnp.asarray(roots, np.int64), (cond.shape[0], len(roots)))
    for _ in range(depth):
        c = jnp.take_along_axis(cond_ext, state, axis=1)
        state = jnp.where(c, jnp.asarray(nxt_t)[state], jnp.asarray(nxt_f)[state])
    leaf = state - nn                                     # [N, trees]
    w = jnp.asarray(weights.astype(dt))[leaf]
    tg = jnp.asarray(targets)[leaf]
    rows = jnp.broadcast_to(jnp.arange(cond.shape[0])[:, None], leaf.shape)
    agg = _AGGREGATES[aggregate_function]
    y = jnp.zeros((cond.shape[0], n_targets), dt)
    if agg in ("SUM", "AVERAGE"):
        y = y.at[rows, tg].add(w)
        if agg == "AVERAGE" and roots:
            y = y / jnp.asarray(len(roots), dt)
    else:   # targets no tree reaches stay 0 (as onnxruntime)
        hits = jnp.zeros(y.shape, jnp.int32).at[rows, tg].add(1)
        y = jnp.full(y.shape, jnp.inf if agg == "MIN" else -jnp.inf, dt)
        y = y.at[rows, tg].min(w) if agg == "MIN" else y.at[rows, tg].max(w)
        y = jnp.where(hits > 0, y, jnp.zeros((), dt))
    return _post_transform(y, post_transform).astype(dt)
