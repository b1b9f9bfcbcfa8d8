"""Replicated collectives over the replicas of the Ir (ai.graphcore ops; JAX collectives over
the session's replica axis)."""
from __future__ import annotations

from typing import Any

from ..tensor import Tensor
from ._base import GC, inplace, node, one, reshape_


def _op_name(op: Any) -> str:
    name = str(getattr(op, "name", op)).lower()
    return {"sum": "add", "and": "logicaland", "or": "logicalor"}.get(name, name)


def _check_group(t: Tensor, group: Any) -> bool:
    """True when the collective is the identity (one replica per group)."""
    r = t.ir.replication_factor
    if group is None or group.num_groups == 1:
        return r == 1
    if group.group_size == 1:
        return True
    raise NotImplementedError(f"Collectives over replica groups other than all replicas or "
                              f"single replicas are not supported (got {group})")


def replicated_all_reduce(t: Tensor, op: Any = "add", group: Any = None) -> Tensor:
    """Reduce ``t`` across replicas (add, mean, min, max); every replica gets the result."""
    if _check_group(t, group):
        return one("Identity", t)
    return one("ReplicatedAllReduce", t, domain=GC, collectiveOperator=_op_name(op))


def replicated_all_reduce_(t: Tensor, op: Any = "add", group: Any = None) -> Tensor:
    return inplace(t, replicated_all_reduce(t, op, group))


def replicated_reduce_scatter(t: Tensor, op: Any = "add", group: Any = None,
                              configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:
    """Reduce the flattened ``t`` across replicas; each replica keeps its 1/R shard
    (padded to a multiple of the replication factor)."""
    if _check_group(t, group):
        return reshape_(t, (-1,))
    return one("ReplicatedReduceScatter", t, domain=GC, collectiveOperator=_op_name(op))


def replicated_all_gather(t: Tensor, group: Any = None, output_shape: Any = "auto") -> Tensor:
    """Gather every replica's ``t``: ``"new_axis"`` gives [R, *shape]; ``"concat"`` / ``"auto"``
    concatenates along axis 0 (flat for 0-d inputs)."""
    if _check_group(t, group):
        r = 1
        out = t
    else:
        r = t.ir.replication_factor
        out = node("ReplicatedAllGather", [t], {}, GC)[0]
    if output_shape == "new_axis":
        return reshape_(out, (r,) + t.shape)
    if output_shape in ("concat", "auto", "meta_shape") and t.rank > 0:
        return reshape_(out, (r * t.shape[0],) + t.shape[1:])
    return reshape_(out, (-1,))


all_reduce = replicated_all_reduce
