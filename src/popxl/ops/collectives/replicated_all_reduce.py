"""Reduce a tensor across the replicas of each group."""
from __future__ import annotations

from typing import Any, Optional

from ...replica_grouping import ReplicaGrouping
from ...tensor import Tensor
from .._base import GC, inplace, one
from .collectives import _collective_op, _group, _grouping_attr


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
