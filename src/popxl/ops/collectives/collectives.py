"""Collectives: across replicas, within the groups of a :class:`popxl.ReplicaGrouping`
(ai.graphcore ReplicatedAllReduce / ReplicatedReduceScatter / ReplicatedAllGather with
PopART's ``__collectiveReplicaGrouping`` attribute), and across the IPUs of one replica
(ai.graphcore AllReduce). The lowerings are in ``popart/ops/collectives.py``.

``op`` is one of "add", "mean", "mul", "min", "max", "and", "or", "square_add" (and "local"
for the all-reduces across IPUs), or a ``popart.CollectiveOperator``."""
from __future__ import annotations

from typing import Any, Literal, Optional

from popart import CommGroup, CommGroupType  # noqa: F401  (popxl.ops.collectives.CommGroup)
from popart.engine.graph_api import COLLECTIVE_OPS

from ...replica_grouping import ReplicaGrouping
from ...tensor import Tensor
from .._base import GC, one
from .._core import reshape, transpose

# PopXL's op names -> PopART's CollectiveOperator (by name; PopXL's table maps "mul" to Mean,
# a slip: here it is Mul)
OP_MAP = {"add": "Add", "mean": "Mean", "mul": "Mul", "min": "Min", "max": "Max", "and": "LogicalAnd",
          "or": "LogicalOr", "square_add": "SquareAdd"}
_OPS = {**OP_MAP, "local": "Local"}

CollectiveOps = Literal["add", "mean", "mul", "min", "max", "and", "or", "square_add"]


def to_collective_op(op: CollectiveOps) -> str:
    """PopART's CollectiveOperator (its name) for ``op``.

    Raises:
        ValueError: ``op`` not one of :data:`CollectiveOps`.
    """
    try:
        return OP_MAP[op]
    except (KeyError, TypeError):
        raise ValueError(f"Not a valid op: {op}. Must choose from: {', '.join(OP_MAP)}") from None


def _collective_op(op: Any, allow_local: bool = False) -> str:
    """``op`` (a name of :data:`CollectiveOps`, "local" where ``allow_local``, or a
    CollectiveOperator name / enum) as a popart.CollectiveOperator name."""
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
    axis = axis % t.rank if t.rank else 0
    if axis > 0:
        perm = list(range(t.rank))
        perm.insert(0, perm.pop(axis))
        t = transpose(t, perm)
    return t, list(t.shape)


def _rearrange_output(y: Tensor, shape: list[int], axis: int) -> Tensor:
    y = reshape(y, shape)
    axis = axis % y.rank if y.rank else 0
    if axis > 0:
        perm = list(range(y.rank))
        perm.insert(axis, perm.pop(0))
        y = transpose(y, perm)
    return y


def _reduce_scatter(t: Tensor, op: str, group: Optional[ReplicaGrouping], suffix: str,
                    rts: bool = False) -> Tensor:
    g = _group(t, group)
    out = one("ReplicatedReduceScatter", t, domain=GC, name=t.name + suffix, collectiveOperator=op,
              **_grouping_attr(g))
    if rts:
        out._meta_shape = tuple(t.shape)
    return out
