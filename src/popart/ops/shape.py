"""Shape, indexing, layout and type ops. Inputs that decide an output's shape (Reshape's
shape, Slice's starts, Pad's pads, ...) must be compile-time constants: ``ctx.static``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from jax import lax

from ..errors import UnsupportedOperatorError, noted
from .math import saturate_cast
from .registry import add, debug_name, LowerCtx, opid, popart_error, register, shape_text

I64 = np.int64


def ints(ctx: LowerCtx, x, what):
    """A static input as a list of Python ints (None stays None)."""
    return None if x is None else [int(v) for v in ctx.static(x, what).reshape(-1)]


def np_type(ctx: LowerCtx, onnx_type):
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(onnx_type)))
    except Exception:
        raise ctx.error(f"ONNX data type {onnx_type} is not supported") from None


def _norm_axes(ctx: LowerCtx, axes, rank):
    if any(not -rank <= a < rank for a in axes):
        raise ctx.error(f"axes {list(axes)} out of range for rank {rank}")
    return [a % rank for a in axes]


# ---------------------------------------------------------------------------------------
# Reshaping

def shape_input_error(ctx: LowerCtx, what: str, problem: str, note: str) -> Exception:
    """PopART's error for a shape input whose value does not give an output shape (the
    connectInTensor of ReshapeOp, ExpandOp, SliceOp)."""
    purpose = "slicing direction" if what == "steps" else "output shape"
    return popart_error(ctx, f"Need the value of the {opid(ctx)} input '{what}' to determine "
                        f"the {purpose}, but was unable because {problem}", note)


def shape_ints(ctx: LowerCtx, x, what: str, k: int):
    """``ints`` of input ``k`` named ``what`` by PopART (Reshape's shape, Expand's shape,
    Slice's starts ... steps): a value computed at run time is PopART's error."""
    try:
        return ints(ctx, x, what)
    except UnsupportedOperatorError as e:
        # Still an UnsupportedOperatorError (a run-time shape is what XLA cannot do; the ONNX
        # backend specialises on such inputs and retries), with PopART's text as args[0].
        err = shape_input_error(ctx, what, f"[Tensor::getDataViaGraphTraversal] Could not work "
                                f"out tensor data for {ctx.input_ids[k]}.", str(e))
        raise noted(UnsupportedOperatorError(*err.args), *err.__notes__) from None


def _reshape(ctx: LowerCtx, x, shape, allowzero=0):
    """ReshapeBaseOp::finaliseShape and setup's checks, with PopART's texts."""
    shape, given = list(shape), list(shape)
    note = f"shape {given} for an input of shape {list(jnp.shape(x))}"
    bad = next((d for d in shape if d < -1), None)
    if bad is not None:
        raise shape_input_error(ctx, "shape", f"Dimension, {bad}, of new shape for Reshape "
                                f"cannot be smaller than -1.", note)
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    if -1 in shape:
        known = -int(np.prod(shape))
        if known and jnp.size(x) % known:
            raise shape_input_error(ctx, "shape", "Incompatible inferred dimension, not whole "
                                    "number.", note)
        if shape.count(-1) > 1:
            raise shape_input_error(ctx, "shape", "shape input to ReshapeOp can only use -1 to "
                                    "specify one unknown dimension", note)
        shape[shape.index(-1)] = jnp.size(x) // known if known else 0
    if int(np.prod(shape)) != jnp.size(x):
        raise popart_error(ctx, f"Failure in ReshapeOp::setup() for {debug_name(ctx)}. Trying "
                           f"to reshape from {shape_text(jnp.shape(x))} to {shape_text(shape)}. "
                           f"The number of elements of the input is {jnp.size(x)}, while the "
                           f"number of elements of the output is {int(np.prod(shape))}. The "
                           f"number of elements cannot change for a ReshapeOp", note)
    return jnp.reshape(x, shape)


add("Reshape", lambda ctx, x, shape=(), **_: _reshape(ctx, x, shape), since=1)
add("Reshape", lambda ctx, x, shape, allowzero=0, **_:
    _reshape(ctx, x, shape_ints(ctx, shape, "shape", 1), allowzero), since=5, static_inputs=(1,))


@register("Transpose")
def transpose(ctx: LowerCtx, x, perm=None, **_):
    """TransposeBaseOp::setup's check of the permutation's rank (PopART's text); a
    permutation of the right rank that is not one is this runtime's error."""
    if perm and len(perm) != jnp.ndim(x):
        raise popart_error(ctx, f"Rank of permutation tensor {shape_text(perm)}, rank "
                           f"{len(perm)} must be equal to rank of input tensor, shape "
                           f"{shape_text(jnp.shape(x))}, rank {jnp.ndim(x)}.",
                           f"perm {list(perm)} for input '{ctx.input_ids[0]}'")
    if perm is not None and sorted(perm) != list(range(jnp.ndim(x))):
        raise ctx.error(f"perm {list(perm)} is not a permutation of the {jnp.ndim(x)} axes")
    return jnp.transpose(x, perm)


@register("Flatten")
def flatten(ctx: LowerCtx, x, axis=1, **_):
    ax = axis + x.ndim if axis < 0 else axis
    return jnp.reshape(x, (int(np.prod(x.shape[:ax])), int(np.prod(x.shape[ax:]))))


def _squeeze(ctx: LowerCtx, x, axes):
    if axes is None or len(axes) == 0:
        return jnp.squeeze(x, [i for i, d in enumerate(x.shape) if d == 1])
    axes = _norm_axes(ctx, axes, x.ndim)
    if any(x.shape[a] != 1 for a in axes):
        raise ctx.error(f"cannot squeeze axes {axes} of shape {list(x.shape)}: not all have size 1")
    return jnp.squeeze(x, axes)


def _unsqueeze(ctx: LowerCtx, x, axes):
    axes = sorted(_norm_axes(ctx, axes, jnp.ndim(x) + len(axes)))
    return jnp.expand_dims(x, axes)


add("Squeeze", lambda ctx, x, axes=None, **_: _squeeze(ctx, x, axes), since=1)
add("Squeeze", lambda ctx, x, axes=None, **_: _squeeze(ctx, x, ints(ctx, axes, "axes")),
    since=13, static_inputs=(1,))
add("Unsqueeze", lambda ctx, x, axes=(), **_: _unsqueeze(ctx, x, axes), since=1)
add("Unsqueeze", lambda ctx, x, axes, **_: _unsqueeze(ctx, x, ints(ctx, axes, "axes")),
    since=13, static_inputs=(1,))


@register("Concat")
def concat(ctx: LowerCtx, *xs, axis=1, **_):
    """Images (4-D) with a channels-last form concatenate in it (DenseNet, U-Net skips)."""
    if xs and all(jnp.ndim(x) == 4 for x in xs) and any(ctx.channels_last(x) is not None for x in xs):
        last = [ctx.channels_last(x, transpose=True) for x in xs]
        return ctx.keep_channels_last(jnp.concatenate(last, axis=(0, 3, 1, 2)[axis % 4]))
    return jnp.concatenate(xs, axis=axis)


def _split(ctx: LowerCtx, x, split, axis, num_outputs=None):
    ax = axis % x.ndim
    n, dim = num_outputs or ctx.num_outputs, x.shape[ax]
    if split is None or len(split) == 0:
        if num_outputs is not None:          # opset 18: last chunk may be smaller
            size = -(-dim // n)
            split = [min(size, dim - i * size) for i in range(n)]
        elif dim % n:
            raise ctx.error(f"cannot split axis {axis} of size {dim} into {n} equal parts")
        else:
            split = [dim // n] * n
    if sum(split) != dim:
        raise ctx.error(f"split {list(split)} does not add up to the size {dim} of axis {axis}")
    return tuple(jnp.split(x, np.cumsum(split)[:-1].tolist(), axis=ax))


add("Split", lambda ctx, x, split_in=None, split=None, axis=0, **_:
    _split(ctx, x, ints(ctx, split_in, "split") if split_in is not None else split, axis), since=1)
add("Split", lambda ctx, x, split=None, axis=0, **_: _split(ctx, x, split, axis), since=2)
add("Split", lambda ctx, x, split=None, axis=0, **_:
    _split(ctx, x, ints(ctx, split, "split"), axis), since=13, static_inputs=(1,))
add("Split", lambda ctx, x, split=None, axis=0, num_outputs=None, **_:
    _split(ctx, x, ints(ctx, split, "split"), axis, num_outputs), since=18, static_inputs=(1,))


def _slice(ctx: LowerCtx, x, starts, ends, axes=None, steps=None):
    bad = next((a for a in axes or () if not -x.ndim <= a < x.ndim), None)
    if bad is not None:   # BaseSliceOp::connectInTensor
        raise popart_error(ctx, f"slice op input tensor {ctx.input_ids[0]}, rank {x.ndim}, axis "
                           f"{bad} is out of range", f"axes {list(axes)}")
    axes = list(range(len(starts))) if axes is None else _norm_axes(ctx, axes, x.ndim)
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ctx.error("starts, ends, axes and steps must have the same length")
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st == 0:
            raise ctx.error("slice step must not be 0")
        idx[a] = slice(*slice(s, e, st).indices(x.shape[a]))
        if idx[a].stop < 0:                   # negative step down to and including index 0
            idx[a] = slice(idx[a].start, None, st)
    return x[tuple(idx)]


add("Slice", lambda ctx, x, starts=(), ends=(), axes=None, **_:
    _slice(ctx, x, starts, ends, axes), since=1)
add("Slice", lambda ctx, x, starts, ends, axes=None, steps=None, **_: _slice(
    ctx, x, shape_ints(ctx, starts, "starts", 1), shape_ints(ctx, ends, "ends", 2),
    shape_ints(ctx, axes, "axes", 3), shape_ints(ctx, steps, "steps", 4)), since=10,
    static_inputs=(1, 2, 3, 4))


@register("Expand", since=8, static_inputs=(1,))
def expand(ctx: LowerCtx, x, shape, **_):
    shape = shape_ints(ctx, shape, "shape", 1)
    try:
        return jnp.broadcast_to(x, np.broadcast_shapes(jnp.shape(x), tuple(shape)))
    except ValueError:   # ExpandOp::finaliseShape
        raise shape_input_error(ctx, "shape", "Expand shape constraint: corresponding "
                                "dimensions must have the same value or one of them must be 1",
                                f"cannot expand shape {list(jnp.shape(x))} to {shape}") from None


add("Tile", lambda ctx, x, tiles, axis, **_: jnp.tile(x, [int(ctx.static(tiles, "tiles")) if i == int(
    ctx.static(axis, "axis")) else 1 for i in range(x.ndim)]), since=1, static_inputs=(1, 2))
def tile(ctx: LowerCtx, x, repeats, **_):
    """TileOp::connectInTensor's checks: INT64 repeats of rank 1, one per dimension, each >= 1."""
    reps = ctx.static(repeats, "repeats")
    rid, problem = ctx.input_ids[1], ""
    if reps.dtype != np.int64:
        problem = f"'Repeats' tensor `{rid}' is not INT64, it is {reps.dtype.name.upper()}"
    elif reps.ndim != 1:
        problem = f"'Repeats' tensor `{rid}' should be rank 1 in TileOp constructor"
    elif reps.size != x.ndim:
        problem = (f"'Repeats' tensor `{rid}' should have one element for each dimension of the "
                   f"data tensor")
    elif (reps < 1).any():
        i = int(np.argmax(reps < 1))
        problem = f"'Repeats' tensor `{rid}' has invalid value `{int(reps[i])}' at index {i}"
    if problem:
        raise popart_error(ctx, problem, f"repeats {reps.tolist()} for data of shape {list(x.shape)}")
    return jnp.tile(x, [int(v) for v in reps])


add("Tile", tile, since=6, static_inputs=(1,))


def _pad(ctx: LowerCtx, x, pads, mode="constant", value=0.0, axes=None):
    r = x.ndim
    axes = list(range(r)) if axes is None else _norm_axes(ctx, axes, r)
    if len(pads) != 2 * len(axes):
        raise ctx.error(f"pads has {len(pads)} values; expected {2 * len(axes)}")
    width = [[0, 0] for _ in range(r)]
    for i, a in enumerate(axes):
        width[a] = [pads[i], pads[i + len(axes)]]
    # Negative pads crop.
    x = x[tuple(slice(max(-b, 0), x.shape[d] - max(-e, 0)) for d, (b, e) in enumerate(width))]
    width = [(max(b, 0), max(e, 0)) for b, e in width]
    if mode == "constant":
        v = jnp.zeros((), x.dtype) if value is None else jnp.asarray(value).reshape(()).astype(x.dtype)
        return lax.pad(x, v, [(b, e, 0) for b, e in width])
    if mode not in ("reflect", "edge", "wrap"):
        raise ctx.error(f"mode must be constant, reflect, edge or wrap; got {mode!r}")
    return jnp.pad(x, width, mode=mode)


add("Pad", lambda ctx, x, paddings=(), mode="constant", value=0.0, **_:
    _pad(ctx, x, paddings, mode, value), since=1)
add("Pad", lambda ctx, x, pads=(), mode="constant", value=0.0, **_:
    _pad(ctx, x, pads, mode, value), since=2)
add("Pad", lambda ctx, x, pads, constant_value=None, axes=None, mode="constant", **_:
    _pad(ctx, x, ints(ctx, pads, "pads"), mode, constant_value, ints(ctx, axes, "axes")),
    since=11, static_inputs=(1, 3))


@register("DepthToSpace")
def depth_to_space(ctx: LowerCtx, x, blocksize=1, mode="DCR", **_):
    b, ch, h, w = x.shape
    bs = blocksize
    if mode == "DCR":
        y = x.reshape(b, bs, bs, ch // bs ** 2, h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        y = x.reshape(b, ch // bs ** 2, bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise ctx.error(f"mode must be DCR or CRD, got {mode!r}")
    return y.reshape(b, ch // bs ** 2, h * bs, w * bs)


@register("SpaceToDepth")
def space_to_depth(ctx: LowerCtx, x, blocksize=1, mode="DCR", **_):
    b, ch, h, w = x.shape
    bs = blocksize
    y = x.reshape(b, ch, h // bs, bs, w // bs, bs)
    if mode not in ("DCR", "CRD"):
        raise ctx.error(f"mode must be DCR or CRD, got {mode!r}")
    y = y.transpose((0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4))
    return y.reshape(b, ch * bs * bs, h // bs, w // bs)


@register("CenterCropPad", since=18, static_inputs=(1,))
def center_crop_pad(ctx: LowerCtx, x, shape, axes=None, **_):
    shape = ints(ctx, shape, "shape")
    axes = _norm_axes(ctx, axes if axes is not None else range(x.ndim), x.ndim)
    for a, t in zip(axes, shape):
        d = x.shape[a]
        if t < d:
            x = lax.slice_in_dim(x, (d - t) // 2, (d - t) // 2 + t, axis=a)
        elif t > d:
            cfg = [(0, 0, 0)] * x.ndim
            cfg[a] = ((t - d) // 2, t - d - (t - d) // 2, 0)
            x = lax.pad(x, jnp.zeros((), x.dtype), cfg)
    return x


# ---------------------------------------------------------------------------------------
# Indexing

def _checked_indices(ctx: LowerCtx, idx, sizes, k: int = 1, first_axis: int = 0):
    """Input ``k`` (indices) with negative entries wrapped, each checked to lie in
    [-size, size - 1] of its axis, as ONNX Runtime does: ``sizes`` is the size of the indexed
    axis ``first_axis``, or the sizes along the indices' last dimension (GatherND, ScatterND).
    Constant indices out of range raise at compile time, others after the run
    (``ctx.check``). PopART on the IPU does not check: out-of-range indices read undefined
    data there (zeros with popxl's ``zero_OOR``)."""
    xp = jnp if isinstance(idx, jax.core.Tracer) else np
    idx = xp.asarray(idx)
    n = xp.asarray(sizes, dtype=idx.dtype)
    if idx.size:   # two vectorised reductions per indexed axis: the largest and smallest index
        sizes = n.reshape(-1)                    # they repeat along idx's last axis
        cols = idx.reshape(-1, sizes.size)
        big, small = cols.max(axis=0), cols.min(axis=0)
        bad = big >= sizes
        if idx.dtype.kind != "u":   # -size would wrap around in an unsigned type
            bad = bad | (small < -sizes)
        j = xp.argmax(bad)                       # the first axis with an index out of range
        data = ctx.input_ids[0] if ctx.input_ids else "data"
        ctx.check(bad[j], f"index {{index}} in '{ctx.input_ids[k]}' is out of range for axis "
                  f"{{axis}} of '{data}' (size {{size}}: valid indices are -{{size}} to {{last}})",
                  index=xp.where(big[j] >= sizes[j], big[j], small[j]), axis=first_axis + j,
                  size=sizes[j], last=sizes[j] - 1)
    return xp.where(idx < 0, idx + n, idx)


@register("Gather")
def gather(ctx: LowerCtx, x, idx, axis=0, zero_OOR=0, **_):
    """ONNX Gather; out-of-range indices raise (see ``_checked_indices``). popxl's
    ``gather(zero_OOR=True)`` (an attribute ONNX models cannot set: the importer's checker
    rejects it) gives zeros for them instead, as PopART does."""
    ax = _norm_axes(ctx, [axis], x.ndim)[0]
    n = x.shape[ax]
    if not zero_OOR:
        return jnp.take(x, _checked_indices(ctx, idx, n, first_axis=ax), axis=ax, mode="clip")
    idx = jnp.asarray(idx)
    valid = ((idx >= -n) & (idx < n)).reshape((1,) * ax + idx.shape + (1,) * (x.ndim - ax - 1))
    y = jnp.take(x, jnp.where(idx < 0, idx + n, idx), axis=ax, mode="clip")
    return jnp.where(valid, y, jnp.zeros((), x.dtype))


@register("GatherElements", since=11)
def gather_elements(ctx: LowerCtx, x, idx, axis=0, **_):
    """ONNX GatherElements; out-of-range indices raise (see ``_checked_indices``)."""
    ax = _norm_axes(ctx, [axis], x.ndim)[0]
    idx = _checked_indices(ctx, idx, x.shape[ax], first_axis=ax)
    _elements_shapes(ctx, x, idx, ax)
    x = x[tuple(slice(None) if d == ax else slice(0, idx.shape[d]) for d in range(x.ndim))]
    return jnp.take_along_axis(x, idx, axis=ax, mode="clip")


def _elements_shapes(ctx: LowerCtx, x, idx, ax, updates=None):
    """GatherElements / ScatterElements: indices of data's rank, no larger than data but along
    ``ax``; ScatterElements' updates of the indices' shape."""
    if jnp.ndim(idx) != x.ndim or any(i > d for k, (i, d) in enumerate(zip(jnp.shape(idx), x.shape))
                                      if k != ax):
        raise ctx.error(f"indices of shape {list(jnp.shape(idx))} do not fit data of shape "
                        f"{list(x.shape)} (the same rank, no larger but along axis {ax})")
    if updates is not None and jnp.shape(updates) != jnp.shape(idx):
        raise ctx.error(f"updates of shape {list(jnp.shape(updates))} must have the indices' "
                        f"shape {list(jnp.shape(idx))}")


def _nd_indices(ctx: LowerCtx, x, idx, batch_dims=0):
    """GatherND / ScatterND indices, checked: the last dimension indexes data's axes after
    the batch dimensions."""
    m = jnp.shape(idx)[-1] if jnp.ndim(idx) else 0
    if jnp.ndim(idx) < 1 or not 1 <= m <= x.ndim - batch_dims:
        raise ctx.error(f"indices of shape {list(jnp.shape(idx))} cannot index data of rank "
                        f"{x.ndim} (batch_dims {batch_dims}): the last dimension must be 1 to "
                        f"{x.ndim - batch_dims}")
    return _checked_indices(ctx, idx, x.shape[batch_dims:batch_dims + m], first_axis=batch_dims), m


@register("GatherND", since=11)
def gather_nd(ctx: LowerCtx, x, idx, batch_dims=0, **_):
    """ONNX GatherND; out-of-range indices raise (see ``_checked_indices``)."""
    idx, m = _nd_indices(ctx, x, idx, batch_dims)

    def g(d, i):
        return d[tuple(i[..., j] for j in range(m))]
    for _ in range(batch_dims):
        g = jax.vmap(g)
    return g(x, jnp.asarray(idx))


_SCATTER = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}


def _scatter_at(ctx: LowerCtx, x, coords, updates, reduction):
    if reduction not in _SCATTER:
        raise ctx.error(f"reduction must be one of {list(_SCATTER)}, got {reduction!r}")
    return getattr(jnp.asarray(x).at[coords], _SCATTER[reduction])(updates, mode="drop")


def scatter_elements(ctx: LowerCtx, x, idx, updates, axis=0, reduction="none", **_):
    """ONNX ScatterElements (and Scatter-9); out-of-range indices raise (see
    ``_checked_indices``)."""
    ax = _norm_axes(ctx, [axis], x.ndim)[0]
    idx = jnp.asarray(_checked_indices(ctx, idx, x.shape[ax], first_axis=ax))
    _elements_shapes(ctx, x, idx, ax, updates)
    grid = list(jnp.indices(idx.shape, sparse=True))
    grid[ax] = idx
    return _scatter_at(ctx, x, tuple(grid), updates, reduction)


add("Scatter", scatter_elements, since=9)
add("ScatterElements", scatter_elements, since=11)


@register("ScatterND", since=11)
def scatter_nd(ctx: LowerCtx, x, idx, updates, reduction="none", **_):
    """ONNX ScatterND; out-of-range indices raise (see ``_checked_indices``)."""
    idx, m = _nd_indices(ctx, x, idx)
    idx = jnp.asarray(idx)
    want = list(idx.shape[:-1]) + list(x.shape[m:])
    if list(jnp.shape(updates)) != want:
        raise ctx.error(f"updates of shape {list(jnp.shape(updates))} must have the shape "
                        f"{want} (indices' shape but the last, then data's from axis {m})")
    return _scatter_at(ctx, x, tuple(idx[..., j] for j in range(m)), updates, reduction)


@register("TensorScatter", since=24)
def tensor_scatter(ctx: LowerCtx, past, update, write_indices=None, mode="linear", axis=-2, **_):
    """Write ``update`` into the cache ``past`` at per-batch offsets along ``axis``."""
    ax = axis % past.ndim
    n, s = past.shape[ax], update.shape[ax]
    wi = jnp.zeros((past.shape[0],), I64) if write_indices is None else jnp.asarray(write_indices)
    pos = wi[:, None] + jnp.arange(s)[None, :]                       # [batch, s]
    if mode == "circular":
        pos = pos % n
    elif mode != "linear":
        raise ctx.error(f"mode must be 'linear' or 'circular', got {mode!r}")
    shape = [1] * past.ndim
    shape[0], shape[ax] = past.shape[0], s
    grid = list(jnp.indices(update.shape, sparse=True))
    grid[ax] = pos.reshape(shape)
    return jnp.asarray(past).at[tuple(grid)].set(update, mode="drop")


def shape_deciding(ctx: LowerCtx, x, what: str) -> np.ndarray:
    """``x`` (an input whose values decide a data-dependent op's output shape) as NumPy; on
    run-time data, the error says where such ops run (engine/segments.py)."""
    return ctx.static(x, f"{what} of {ctx.op_type} (its values decide the output shape: "
                         f"an InferenceSession and the ONNX backend run such a node on the host "
                         f"between compiled segments, a TrainingSession and popxl cannot; "
                         f"docs/data_dependent_shapes.md)")


@register("Compress", since=9, data_dependent=(1,))
def compress(ctx: LowerCtx, x, cond, axis=None, **_):
    keep = np.nonzero(shape_deciding(ctx, cond, "the condition"))[0]
    if axis is None:
        return jnp.take(jnp.reshape(x, -1), keep)
    return jnp.take(x, keep, axis=axis % x.ndim)


@register("ReverseSequence", since=10)
def reverse_sequence(ctx: LowerCtx, x, lens, batch_axis=1, time_axis=0, **_):
    t = jnp.arange(x.shape[time_axis]).reshape([-1 if d == time_axis else 1 for d in range(x.ndim)])
    n = jnp.asarray(lens).reshape([-1 if d == batch_axis else 1 for d in range(x.ndim)])
    src = jnp.where(t < n, n - 1 - t, t)
    return jnp.take_along_axis(x, jnp.broadcast_to(src, x.shape), axis=time_axis)


@register("OneHot", since=9, static_inputs=(1,))
def one_hot(ctx: LowerCtx, idx, depth, values, axis=-1, **_):
    d = int(ctx.static(depth, "depth").reshape(-1)[0])
    idx = jnp.asarray(idx).astype(I64)
    idx = jnp.where(idx < 0, idx + d, idx)
    hot = jnp.expand_dims(idx, -1) == jnp.arange(d)
    y = jnp.where(hot, values[1], values[0])
    return jnp.moveaxis(y, -1, axis % y.ndim)


@register("NonZero", since=9, data_dependent=(0,))
def nonzero(ctx: LowerCtx, x, **_):
    x = shape_deciding(ctx, x, "the input")
    return np.array(np.nonzero(x), dtype=I64).reshape(x.ndim, -1)


@register("Unique", since=11, data_dependent=(0,))
def unique(ctx: LowerCtx, x, sorted=1, axis=None, **_):
    x = shape_deciding(ctx, x, "the input")
    y, first, inv, counts = np.unique(x, return_index=True, return_inverse=True,
                                      return_counts=True, axis=axis)
    if not sorted:
        order = np.argsort(first, kind="stable")
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts = first[order], counts[order]
        inv = np.argsort(order)[inv]
    return y, first.astype(I64), inv.reshape(-1).astype(I64), counts.astype(I64)


# ---------------------------------------------------------------------------------------
# Constants, shapes, types

@register("Shape")
def shape(ctx: LowerCtx, x, start=0, end=None, **_):
    return np.array(jnp.shape(x)[slice(start, end)], dtype=I64)


@register("Size")
def size(ctx: LowerCtx, x, **_):
    return np.array(jnp.size(x), dtype=I64)


_CONST_ATTRS = {"value_float": np.float32, "value_floats": np.float32, "value_int": I64,
                "value_ints": I64, "value_string": object, "value_strings": object}


@register("Constant")
def constant(ctx: LowerCtx, value=None, **attrs):
    if value is not None:
        return np.asarray(value)
    given = {k: v for k, v in attrs.items() if k in _CONST_ATTRS and v is not None}
    if "sparse_value" in attrs or len(given) != 1:
        raise ctx.error("Constant needs exactly one of value, value_float(s), value_int(s), "
                        "value_string(s) (sparse_value is unsupported)")
    (k, v), = given.items()
    return np.array(v, dtype=_CONST_ATTRS[k])


@register("ConstantOfShape", since=9, static_inputs=(0,))
def constant_of_shape(ctx: LowerCtx, shape, value=None, **_):
    v = np.zeros((1,), np.float32) if value is None else np.asarray(value)
    return np.full(ints(ctx, shape, "shape"), v.reshape(-1)[0], dtype=v.dtype)


def cast_to(ctx: LowerCtx, x, dt, saturate=1):
    if dt == np.object_ or jnp.result_type(x) == np.object_:
        if isinstance(x, np.ndarray):
            return x.astype(dt if dt != np.object_ else str).astype(dt)
        raise ctx.error("string tensors are only supported as compile-time constants")
    if dt == np.bool_:
        return x != 0
    if dt.name in ("int4", "uint4", "int2", "uint2"):   # truncate, then wrap as the bits do
        bits, lo = int(dt.name[-1]), (-(1 << (int(dt.name[-1]) - 1)) if dt.name[0] == "i" else 0)
        v = jnp.asarray(x).astype(jnp.int64)
        return (jnp.mod(v - lo, 1 << bits) + lo).astype(dt)
    if dt.name.startswith("float8") or dt.name.startswith("float4"):
        return saturate_cast(jnp.asarray(x).astype(jnp.float32) if jnp.result_type(x) != jnp.float64
                             else x, dt, saturate)
    return jnp.asarray(x).astype(dt)


add("Cast", lambda ctx, x, to=None, saturate=1, **_: cast_to(ctx, x, np_type(ctx, to), saturate))
add("CastLike", lambda ctx, x, like, saturate=1, **_:
    cast_to(ctx, x, np.dtype(jnp.result_type(like)), saturate), since=15)


@register("EyeLike", since=9)
def eye_like(ctx: LowerCtx, x, dtype=None, k=0, **_):
    dt = np_type(ctx, dtype) if dtype is not None else jnp.result_type(x)
    return jnp.eye(x.shape[0], x.shape[1], k, dtype=dt)


@register("Range", since=11, static_inputs=(0, 1, 2))
def range_(ctx: LowerCtx, start, limit, delta, **_):
    s, l, d = (ctx.static(v, n) for v, n in ((start, "start"), (limit, "limit"), (delta, "delta")))
    for v, name in ((s, "start"), (l, "limit"), (d, "delta")):
        if v.size != 1:   # scalars by the spec; one-element tensors (sliced shapes) are accepted
            raise ctx.error(f"input '{name}' must be a scalar, got shape {v.shape}")
    s, l, d = s.reshape(()), l.reshape(()), d.reshape(())
    n = max(int(np.ceil((float(l) - float(s)) / float(d))), 0)
    return (np.arange(n).astype(s.dtype) * d + s).astype(s.dtype)
