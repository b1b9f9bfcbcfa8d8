"""Replicated collectives (ai.graphcore). Identity without replication; otherwise lax
collectives over ``ctx.replica_axis``. ``collectiveOperator`` follows popart.CollectiveOperator
name (Undefined = Add, Add, Mean, Mul, Min, Max, LogicalAnd, LogicalOr, SquareAdd, Local)
or its index in that list. ``commGroup`` [type, size] other than all replicas is an error.
Reduce-scatter flattens the input, pads it to a multiple of the replication factor and returns
this replica's 1-D shard; all-gather concatenates the replicas' flattened shards."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .registry import GRAPHCORE_DOMAIN, LowerCtx, register

_OPS = ["undefined", "add", "mean", "mul", "min", "max", "logicaland", "logicalor", "squareadd", "local"]


def _op(ctx: LowerCtx, op):
    name = _OPS[int(op)] if isinstance(op, int) or str(op).isdigit() else str(op).lower()
    name = "add" if name == "undefined" else name
    if name not in ("add", "mean", "min", "max", "local"):
        raise ctx.error(f"collectiveOperator '{op}' is not supported (Add, Mean, Min, Max, Local)")
    return name


def _inactive(ctx: LowerCtx, comm_group=None):
    off = ctx.replica_axis is None or ctx.replication_factor == 1
    if not off and comm_group and comm_group[0] != 0 and comm_group[1] not in (0, ctx.replication_factor):
        raise ctx.error(f"commGroup {list(comm_group)} (a subset of the replicas) is not supported")
    return off


def _allreduce(ctx: LowerCtx, x, op):
    a = ctx.replica_axis
    return {"add": lax.psum, "mean": lax.pmean, "min": lax.pmin, "max": lax.pmax,
            "local": lambda v, _a: v}[op](x, a)


@register("ReplicatedAllReduce", domain=GRAPHCORE_DOMAIN)
def all_reduce(ctx: LowerCtx, x, collectiveOperator=0, commGroup=None, **_):
    op = _op(ctx, collectiveOperator)
    return x if _inactive(ctx, commGroup) else _allreduce(ctx, x, op)


register("ReplicatedAllReduceInplace", domain=GRAPHCORE_DOMAIN)(all_reduce)


@register("ReplicatedReduceScatter", domain=GRAPHCORE_DOMAIN)
def reduce_scatter(ctx: LowerCtx, x, collectiveOperator=0, commGroup=None, **_):
    op = _op(ctx, collectiveOperator)
    flat = x.reshape(-1)
    if _inactive(ctx, commGroup):
        return flat
    r = ctx.replication_factor
    flat = jnp.pad(flat, (0, -flat.size % r))
    if op in ("add", "mean"):
        y = lax.psum_scatter(flat, ctx.replica_axis, scatter_dimension=0, tiled=True)
        return y / r if op == "mean" else y
    full = _allreduce(ctx, flat, op).reshape(r, -1)
    return full[lax.axis_index(ctx.replica_axis)]


@register("ReplicatedAllGather", domain=GRAPHCORE_DOMAIN)
def all_gather(ctx: LowerCtx, x, commGroup=None, **_):
    if _inactive(ctx, commGroup):
        return x
    return lax.all_gather(x.reshape(-1), ctx.replica_axis, axis=0, tiled=True)
