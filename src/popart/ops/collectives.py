"""Collectives (ai.graphcore): across replicas (ReplicatedAllReduce, ReplicatedReduceScatter,
ReplicatedAllGather) and across the IPUs of one replica (AllReduce).

Replicated collectives run over ``ctx.replica_axis`` within groups of replicas
(``__collectiveReplicaGrouping`` or the Builder's ``commGroup``); groups, operators, shapes and
gradients are PopART's. See docs/replication.md."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import GRAPHCORE_DOMAIN, LowerCtx, register

OPS = ["undefined", "add", "mean", "mul", "min", "max", "logicaland", "logicalor", "squareadd",
       "local"]
_ALIASES = {"sum": "add", "and": "logicaland", "or": "logicalor", "square_add": "squareadd",
            "prod": "mul"}


def op_name(ctx: Optional[LowerCtx], op: Any) -> str:
    """A CollectiveOperator (name, enum or index) as a lower-case name of ``OPS``."""
    if isinstance(op, (int, np.integer)) or str(op).isdigit():
        name = OPS[int(op)] if 0 <= int(op) < len(OPS) else ""
    else:
        name = str(getattr(op, "name", op)).lower()
        name = _ALIASES.get(name, name)
    if name not in OPS:
        msg = f"collectiveOperator '{op}' is not one of {', '.join(OPS)}"
        raise ctx.error(msg) if ctx is not None else ValueError(msg)
    return "add" if name == "undefined" else name


# ---------------------------------------------------------------------------------------
# Groups


def groups_of(num_replicas: int, stride: int, group_size: int) -> list[list[int]]:
    """The replicas of each group, in rank order (popxl.ReplicaGrouping's assignment)."""
    block = stride * group_size
    if stride < 1 or group_size < 1 or num_replicas % block:
        raise ValueError(f"A replica grouping with stride {stride} and group size {group_size} "
                         f"does not partition {num_replicas} replicas")
    out: dict[int, list[int]] = {}
    for r in range(num_replicas):
        out.setdefault((r // block) * stride + r % stride, []).append(r)
    return [out[g] for g in sorted(out)]


def _popart_attr(ctx: LowerCtx, name: str, default: Any = None) -> Any:
    """An attribute PopART's Builder writes under a reserved name (``__collectiveCommGroup``
    INTS [type, size], ``__collectiveOperator`` INT): the importer keeps those on the node's
    annotations."""
    return getattr(getattr(ctx, "node", None), "annotations", {}).get(name, default)


def _grouping(ctx: LowerCtx, attrs: dict) -> list[list[int]]:
    r = ctx.replication_factor
    if getattr(ctx, "replica_axis", None) is None and r == 1:
        return [[0]]   # not traced over replicas (shape inference): one group of one
    rg = attrs.get("__collectiveReplicaGrouping")
    cg = attrs.get("commGroup", _popart_attr(ctx, "__collectiveCommGroup"))
    if rg is not None and cg is not None:
        raise ctx.error("setting both '__collectiveReplicaGrouping' and 'commGroup' is not allowed")
    if rg is not None and len(rg):
        n, stride, size = (int(v) for v in rg)
        if n != r:
            raise ctx.error(f"the replica grouping is for {n} replicas but the program runs "
                            f"{r} replicas")
    elif cg is not None and len(cg):
        kind, size = int(cg[0]), int(cg[1])
        if kind == 0 or (kind in (1, 2) and size in (0, r)):
            stride, size = 1, r
        elif kind == 3:
            stride, size = 1, 1
        elif kind in (1, 2):
            if size < 1 or r % size:
                raise ctx.error(f"commGroup {list(cg)}: the group size must divide the "
                                f"replica count {r}")
            stride = 1 if kind == 1 else r // size
        else:
            raise ctx.error(f"commGroup {list(cg)}: unknown CommGroupType {kind}")
    else:
        stride, size = 1, r
    try:
        return groups_of(r, stride, size)
    except ValueError as e:
        raise ctx.error(str(e)) from None


def _active(ctx: LowerCtx, groups: list[list[int]]) -> bool:
    return ctx.replica_axis is not None and ctx.replication_factor > 1 and len(groups[0]) > 1


def _member_table(groups: list[list[int]], r: int) -> tuple[np.ndarray, np.ndarray]:
    """[R, G] members of each replica's group (rank order) and [R] each replica's rank."""
    members, rank = np.zeros((r, len(groups[0])), np.int32), np.zeros(r, np.int32)
    for g in groups:
        for i, rep in enumerate(g):
            members[rep], rank[rep] = g, i
    return members, rank


def _native(fn):
    """Run ``fn`` (a collective with ``axis_index_groups``); None where the axis does not
    support groups (vmap)."""
    try:
        return fn()
    except NotImplementedError:
        return None


def _group_rows(ctx: LowerCtx, x, groups):
    """[G, *x.shape]: the values of this replica's group, in rank order (all-gather of the
    whole axis, then this group's rows)."""
    members, _ = _member_table(groups, ctx.replication_factor)
    allx = lax.all_gather(x, ctx.replica_axis, axis=0)
    return jnp.take(allx, jnp.asarray(members)[lax.axis_index(ctx.replica_axis)], axis=0)


def _rank(ctx: LowerCtx, groups):
    _, rank = _member_table(groups, ctx.replication_factor)
    return jnp.asarray(rank)[lax.axis_index(ctx.replica_axis)]


def _prepare(x, op):
    """The value each replica contributes to reduction ``op``."""
    if op == "squareadd":
        return x * x
    if op in ("logicaland", "logicalor"):
        return jnp.asarray(x) != 0
    return x


def _finish(y, x, op):
    return y.astype(x.dtype) if op in ("logicaland", "logicalor") else y


def _reduce_rows(rows, op, n):
    if op in ("add", "squareadd"):
        return jnp.sum(rows, 0)
    if op == "mean":
        return jnp.sum(rows, 0) / jnp.asarray(n, rows.dtype)
    if op == "mul":
        return jnp.prod(rows, 0)
    if op in ("min", "logicaland"):
        return jnp.min(rows, 0)
    return jnp.max(rows, 0)   # max, logicalor


def reduce_over(ctx: LowerCtx, x, op: str, groups: list[list[int]]):
    """All-reduce ``x`` with ``op`` over this replica's group."""
    if op == "local":
        return x
    v = _prepare(x, op)
    if not _active(ctx, groups):
        return _finish(v, x, op)
    n = len(groups[0])
    lax_op = {"add": lax.psum, "squareadd": lax.psum, "mean": lax.psum, "min": lax.pmin,
              "max": lax.pmax, "logicaland": lax.pmin, "logicalor": lax.pmax}.get(op)
    whole = n == ctx.replication_factor
    y = None
    if lax_op is not None:
        if whole:
            y = lax_op(v, ctx.replica_axis)
        else:
            y = _native(lambda: lax_op(v, ctx.replica_axis, axis_index_groups=groups))
        if y is not None and op == "mean":
            y = y / jnp.asarray(n, y.dtype)
    if y is None:
        y = _reduce_rows(_group_rows(ctx, v, groups), op, n)
    return _finish(y, x, op)


def _pad_flat(x, n):
    flat = jnp.reshape(x, (-1,))
    return jnp.pad(flat, (0, -flat.size % n))


def _local_slice(ctx: LowerCtx, x, groups):
    """This replica's shard (its rank in the group) of the flattened, padded ``x``."""
    n = len(groups[0])
    flat = _pad_flat(x, n)
    if not _active(ctx, groups):
        return flat
    return lax.dynamic_slice_in_dim(flat, _rank(ctx, groups) * (flat.size // n), flat.size // n)


def _gather(ctx: LowerCtx, x, groups):
    """The group's flattened ``x`` concatenated in rank order."""
    flat = jnp.reshape(x, (-1,))
    if not _active(ctx, groups):
        return flat
    if len(groups[0]) == ctx.replication_factor:
        return lax.all_gather(flat, ctx.replica_axis, axis=0, tiled=True)
    y = _native(lambda: lax.all_gather(flat, ctx.replica_axis, axis=0, tiled=True,
                                       axis_index_groups=groups))
    return y if y is not None else _group_rows(ctx, flat, groups).reshape(-1)


def _reduce_scatter(ctx: LowerCtx, x, op, groups):
    n = len(groups[0])
    if op == "local" or not _active(ctx, groups):
        return _local_slice(ctx, reduce_over(ctx, x, op, groups) if op != "local" else x, groups)
    flat = _pad_flat(x, n)
    if op in ("add", "mean"):
        whole = n == ctx.replication_factor
        y = lax.psum_scatter(flat, ctx.replica_axis, scatter_dimension=0, tiled=True) if whole else \
            _native(lambda: lax.psum_scatter(flat, ctx.replica_axis, scatter_dimension=0,
                                             tiled=True, axis_index_groups=groups))
        if y is not None:
            return y / jnp.asarray(n, y.dtype) if op == "mean" else y
    return _local_slice(ctx, reduce_over(ctx, flat, op, groups), groups)


# The gradients PopART gives (docs/replication.md): custom VJPs around the group
# functions, with the lowering context and groups as static arguments.

def _with_vjp(forward: Callable, backward: Callable) -> Callable:
    """``forward(ctx, x, groups)`` as a custom VJP (called with the context a ``_Static``
    and the groups a tuple of tuples) whose gradient is ``backward(ctx, g, groups)`` cut to
    ``x``'s size and shape."""
    @partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def fn(ctx, groups, x):
        return forward(ctx.value, x, groups)

    def fwd(ctx, groups, x):
        return forward(ctx.value, x, groups), x.shape

    def bwd(ctx, groups, shape, g):
        size = int(np.prod(shape, dtype=np.int64))
        return (backward(ctx.value, g, groups)[:size].reshape(shape),)

    fn.defvjp(fwd, bwd)
    return fn


# An all-gather's gradient is this replica's part of it; a local scatter's, the parts gathered.
_all_gather_fn = _with_vjp(_gather, _local_slice)
_local_scatter_fn = _with_vjp(_local_slice, _gather)


class _Static:
    """A hashable wrapper (custom_vjp's static arguments must be hashable)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and other.value is self.value


# ---------------------------------------------------------------------------------------
# Lowerings


@register("ReplicatedAllReduce", domain=GRAPHCORE_DOMAIN)
def all_reduce(ctx: LowerCtx, x, collectiveOperator=None, **attrs):
    op = _popart_attr(ctx, "__collectiveOperator", 0) if collectiveOperator is None \
        else collectiveOperator
    return reduce_over(ctx, x, op_name(ctx, op), _grouping(ctx, attrs))


register("ReplicatedAllReduceInplace", domain=GRAPHCORE_DOMAIN)(all_reduce)


@register("ReplicatedReduceScatter", domain=GRAPHCORE_DOMAIN)
def reduce_scatter(ctx: LowerCtx, x, collectiveOperator=None, **attrs):
    op = _popart_attr(ctx, "__collectiveOperator", 0) if collectiveOperator is None \
        else collectiveOperator
    op, groups = op_name(ctx, op), _grouping(ctx, attrs)
    if op == "local":
        return _local_scatter_fn(_Static(ctx), tuple(map(tuple, groups)), x)
    return _reduce_scatter(ctx, x, op, groups)


@register("ReplicatedAllGather", domain=GRAPHCORE_DOMAIN)
def all_gather(ctx: LowerCtx, x, **attrs):
    return _all_gather_fn(_Static(ctx), tuple(map(tuple, _grouping(ctx, attrs))), x)


def _ipu_reduce(xs, op):
    v = [_prepare(x, op) for x in xs]
    if op == "local":
        return list(xs)
    y = _finish(_reduce_rows(jnp.stack(jnp.broadcast_arrays(*v)), op, len(v)), xs[0], op)
    return [y.astype(x.dtype) for x in xs]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _identical_inputs(op, *xs):
    return list(xs)


_identical_inputs.defvjp(lambda op, *xs: (list(xs), None),
                         lambda op, _, gs: tuple(_ipu_reduce(gs, "add")))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _identical_grad_inputs(op, *xs):
    return _ipu_reduce(xs, op)


_identical_grad_inputs.defvjp(lambda op, *xs: (_ipu_reduce(xs, op), None),
                              lambda op, _, gs: tuple(gs))


@register("AllReduce", domain=GRAPHCORE_DOMAIN)
def ipu_all_reduce(ctx: LowerCtx, *xs, collectiveOperator=0, ipus=None, identicalInputs=0,
                   identicalGradInputs=0, **_):
    """Reduce tensors held on the IPUs ``ipus`` of one replica; output i (on IPU ipus[i]) is
    the reduction of every input. With ``identicalInputs`` the inputs are known to be equal:
    the outputs are the inputs and the gradient is the all-reduce of the output gradients;
    with ``identicalGradInputs`` the gradient of each input is its output's gradient. The
    IPUs of a replica share one device here, so the reduction is local."""
    op = op_name(ctx, collectiveOperator)
    if not xs:
        raise ctx.error("AllReduce needs at least one input")
    if ipus is not None and len(ipus) != len(xs):
        raise ctx.error(f"AllReduce: {len(xs)} inputs but {len(ipus)} IPUs")
    if len({tuple(jnp.shape(x)) for x in xs}) != 1:
        raise ctx.error(f"AllReduce inputs must have one shape, got {[tuple(jnp.shape(x)) for x in xs]}")
    xs = [jnp.asarray(x) for x in xs]
    if identicalInputs:
        return list(_identical_inputs(op, *xs))
    if identicalGradInputs:
        return list(_identical_grad_inputs(op, *xs))
    return _ipu_reduce(xs, op)
