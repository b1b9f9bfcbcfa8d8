"""Reduce-scatter across the replicas of each group, and the slices of a tensor each replica keeps."""
from __future__ import annotations

from typing import Any, Optional

from ...replica_grouping import ReplicaGrouping
from ...tensor import Tensor
from .._core import squeeze
from .collectives import _collective_op, _group, _rearrange_input, _rearrange_output, _reduce_scatter


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
        y = squeeze(y, [axis % t.rank])
    return y
