"""Collectives: across replicas, within the groups of a :class:`popxl.ReplicaGrouping`
(ai.graphcore ReplicatedAllReduce / ReplicatedReduceScatter / ReplicatedAllGather with
PopART's ``__collectiveReplicaGrouping`` attribute), and across the IPUs of one replica
(ai.graphcore AllReduce). The lowerings are in ``popart/ops/collectives.py``.

``op`` is one of "add", "mean", "mul", "min", "max", "and", "or", "square_add" (and "local"
for the all-reduces across IPUs), or a ``popart.CollectiveOperator``."""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from popart import CommGroup, CommGroupType  # noqa: F401  (popxl.ops.collectives.CommGroup)
from popart.ir.graphcore_schema import COLLECTIVE_OPS

from ..errors import UndefinedValue
from ..replica_grouping import ReplicaGrouping
from ..tensor import Tensor
from ._base import GC, inplace, node, one

_OPS = {"add": "Add", "mean": "Mean", "mul": "Mul", "min": "Min", "max": "Max", "and": "LogicalAnd",
        "or": "LogicalOr", "square_add": "SquareAdd", "local": "Local"}


def _collective_op(op: Any, allow_local: bool = False) -> str:
    """``op`` as a popart.CollectiveOperator name."""
    name = getattr(op, "name", op)
    if isinstance(name, str) and name in COLLECTIVE_OPS[1:]:
        key = next(k for k, v in _OPS.items() if v == name)
    else:
        key = str(name).lower()
        key = {"sum": "add", "logicaland": "and", "logicalor": "or", "squareadd": "square_add"}.get(key, key)
    if key not in _OPS or (key == "local" and not allow_local):
        choices = [k for k in _OPS if allow_local or k != "local"]
        raise ValueError(f"Not a valid op: {op}. Must choose from: {', '.join(choices)}")
    return _OPS[key]


def _group(t: Tensor, group: Optional[ReplicaGrouping]) -> ReplicaGrouping:
    ir = t.ir
    g = ir.replica_grouping() if group is None else group
    if not isinstance(g, ReplicaGrouping):
        raise TypeError(f"group must be a popxl.ReplicaGrouping, got {type(g).__name__}")
    if g.num_replicas != ir.replication_factor:
        raise ValueError(f"The replica grouping {g} is for {g.num_replicas} replicas, the Ir has "
                         f"{ir.replication_factor}")
    if not g.is_const:
        raise ValueError(f"Collectives need a replica grouping with a constant stride (made by "
                         f"ir.replica_grouping(stride, group_size)), got {g}")
    return g


def _grouping_attr(g: ReplicaGrouping) -> dict:
    return {"__collectiveReplicaGrouping": [g.num_replicas, g.stride, g.group_size]}


def _rearrange_input(t: Tensor, axis: int) -> tuple[Tensor, list[int]]:
    """``t`` with ``axis`` moved to the front, and that shape."""
    from . import transpose
    axis = axis % t.rank if t.rank else 0
    if axis > 0:
        perm = list(range(t.rank))
        perm.insert(0, perm.pop(axis))
        t = transpose(t, perm)
    return t, list(t.shape)


def _rearrange_output(y: Tensor, shape: list[int], axis: int) -> Tensor:
    from . import reshape, transpose
    y = reshape(y, shape)
    axis = axis % y.rank if y.rank else 0
    if axis > 0:
        perm = list(range(y.rank))
        perm.insert(axis, perm.pop(0))
        y = transpose(y, perm)
    return y


# ---------------------------------------------------------------------------------------
# Across replicas


def replicated_all_reduce(t: Tensor, op: Any = "add", group: Optional[ReplicaGrouping] = None) -> Tensor:
    """Reduce ``t`` across the replicas of each group of ``group`` (default: all replicas);
    every replica of a group gets its group's result."""
    g = _group(t, group)
    return one("ReplicatedAllReduce", t, domain=GC, name=f"{t.name}_all_reduce",
               collectiveOperator=_collective_op(op), **_grouping_attr(g))


def replicated_all_reduce_(t: Tensor, op: Any = "add", group: Optional[ReplicaGrouping] = None) -> Tensor:
    """:func:`replicated_all_reduce` in place on ``t``."""
    g = _group(t, group)
    y = one("ReplicatedAllReduceInplace", t, domain=GC, name=f"{t.name}_all_reduce",
            collectiveOperator=_collective_op(op), **_grouping_attr(g))
    return inplace(t, y)


def _reduce_scatter(t: Tensor, op: str, group: Optional[ReplicaGrouping], suffix: str,
                    rts: bool = False) -> Tensor:
    g = _group(t, group)
    out = one("ReplicatedReduceScatter", t, domain=GC, name=t.name + suffix, collectiveOperator=op,
              **_grouping_attr(g))
    if rts:
        out._meta_shape = tuple(t.shape)
    return out


def replicated_reduce_scatter(t: Tensor, op: Any = "add", group: Optional[ReplicaGrouping] = None,
                              configure_output_for_replicated_tensor_sharding: bool = False) -> Tensor:
    """Reduce the flattened ``t`` across each group; each replica keeps its rank's 1-D shard
    (the flattened tensor padded to a multiple of the group size). With
    ``configure_output_for_replicated_tensor_sharding`` the shard's meta shape is ``t``'s
    shape (a replica-sharded tensor: ``replicated_all_gather`` gives ``t``'s shape back)."""
    return _reduce_scatter(t, _collective_op(op), group, "_reduce_scattered",
                           bool(configure_output_for_replicated_tensor_sharding))


def replica_sharded_slice(t: Tensor, group: Optional[ReplicaGrouping] = None) -> Tensor:
    """This replica's shard of the flattened ``t`` (a Local reduce-scatter: no communication),
    a replica-sharded tensor of meta shape ``t.shape``; its gradient is the all-gather of the
    shards' gradients."""
    return _reduce_scatter(t, "Local", group, "_sharded_slice", True)


def replicated_slice(t: Tensor, axis: int = 0, group: Optional[ReplicaGrouping] = None) -> Tensor:
    """Each replica of a group takes its rank's equal slice of ``t`` along ``axis`` (the axis
    keeps its place; a slice of size 1 drops the axis). Its gradient is an all-gather.

    Raises:
        ValueError: if the group size does not divide the axis.
    """
    g = _group(t, group)
    if t.shape[axis] % g.group_size:
        raise ValueError(f"Replicated slice must equally divide axis. Axis size: {t.shape[axis]}. "
                         f"Replica group size: {g.group_size}")
    x, shape = _rearrange_input(t, axis)
    shape[0] //= g.group_size
    y = _rearrange_output(_reduce_scatter(x, "Local", g, "_replicated_slice"), shape, axis)
    if shape[0] == 1:
        from . import squeeze
        y = squeeze(y, [axis % t.rank])
    return y


def replicated_all_gather(t: Tensor, axis: int = 0, group: Optional[ReplicaGrouping] = None,
                          output_shape: str = "auto") -> Tensor:
    """Gather ``t`` from the replicas of each group (rank order). ``output_shape``:
    "new_axis" gives (group_size, *t.shape); "concat" concatenates along ``axis``;
    "meta_shape" gives ``t.meta_shape`` (the shards of a replica-sharded tensor put together,
    padding removed); "auto" is "meta_shape" for a tensor with a meta shape, else "concat".
    Its gradient is this replica's slice of the output gradient.

    Raises:
        ValueError: for another ``output_shape`` or a non-int ``axis``.
    """
    g = _group(t, group)
    if not isinstance(axis, int):
        raise ValueError(f"Axis should be an int. Type: {type(axis)}. Value: {axis}")
    if output_shape == "auto":
        output_shape = "meta_shape" if t.meta_shape else "concat"
    if output_shape not in ("new_axis", "concat", "meta_shape"):
        raise ValueError("output_shape must equal one of 'new_axis', 'concat', 'meta_shape', "
                         f"'auto'. Value: {output_shape}")
    k = g.group_size
    if output_shape == "meta_shape":
        from . import reshape
        meta = tuple(t.meta_shape)
        n = int(np.prod(meta, dtype=np.int64))
        if t.nelms * k < n:
            raise ValueError(f"replicated_all_gather: the {k} shards of {t.nelms} elements of "
                             f"'{t.id}' cannot hold its meta shape {meta}")
        out = one("ReplicatedAllGather", t, domain=GC, name=t.name + "_all_gathered", **_grouping_attr(g))
        if out.nelms != n:    # the shards are padded to a multiple of the shard count
            out = out[:n]
        return reshape(out, meta)
    if t.rank == 0:
        x, shape = t, [k]
    else:
        x, shape = _rearrange_input(t, axis)
        shape[0] *= k
    out = one("ReplicatedAllGather", x, domain=GC, name=t.name + "_all_gathered", **_grouping_attr(g))
    if output_shape == "new_axis":
        from . import reshape
        return reshape(out, (k,) + t.shape)
    return _rearrange_output(out, shape, axis if t.rank else 0)


# ---------------------------------------------------------------------------------------
# Across the IPUs of a replica


def _all_reduce(ts: List[Tensor], ipus: Optional[List[int]], op: Any, identical_inputs: bool = False,
                identical_grad_inputs: bool = False) -> List[Tensor]:
    ts = list(ts)
    if not ts:
        raise ValueError("all_reduce needs at least one tensor")
    if ipus is None:
        try:
            ipus = [t.ipu for t in ts]
        except UndefinedValue as e:
            raise ValueError("Could not automatically infer the IPU of all input Tensors `ts`. "
                             "Please specify the IPUs via the `ipus` parameter.") from e
    ipus = [int(i) for i in ipus]
    if len(ts) != len(ipus):
        raise ValueError(f"Number of specified tensor does not equal number of specified IPUs. "
                         f"{len(ts)} != {len(ipus)}")
    return node("AllReduce", ts, {"collectiveOperator": _collective_op(op, allow_local=True),
                                  "ipus": ipus, "identicalInputs": int(identical_inputs),
                                  "identicalGradInputs": int(identical_grad_inputs)},
                GC, len(ts), name="all_reduce_out")


def all_reduce(ts: List[Tensor], ipus: Optional[List[int]] = None, op: Any = "add") -> List[Tensor]:
    """Reduce the tensors ``ts``, held on the IPUs ``ipus`` (default: each tensor's IPU) of
    one replica; returns one result per IPU."""
    return _all_reduce(ts, ipus, op)


def all_reduce_identical_inputs(ts: List[Tensor], ipus: Optional[List[int]] = None,
                                op: Any = "add") -> List[Tensor]:
    """:func:`all_reduce` of tensors known to be equal: the outputs are the inputs and the
    gradient is the all-reduce (add) of the output gradients."""
    return _all_reduce(ts, ipus, op, identical_inputs=True)


def all_reduce_identical_grad_inputs(ts: List[Tensor], ipus: Optional[List[int]] = None,
                                     op: Any = "add") -> List[Tensor]:
    """:func:`all_reduce` whose output gradients are known to be equal: the outputs are the
    reduction and each input's gradient is its output's gradient."""
    return _all_reduce(ts, ipus, op, identical_grad_inputs=True)
