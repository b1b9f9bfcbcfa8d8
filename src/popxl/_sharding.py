"""Replicated tensor sharding (RTS) on the host: how the value of a replica-sharded variable is
split over the replicas and put together again.

As in PopART, a sharded value is flattened and zero padded to a multiple of the number of
shards ``shard_over`` (k); a shard is ceil(n / k) elements. The replicas of each group of the
variable's replica grouping (its constant-stride form, ``const_rg``) are numbered 0, 1, ... in
replica order; member m holds shard m mod k of its group's value, so each run of k members
(replicas ``stride`` apart) holds one full copy. The host value of a group is read from the
first k members of (the first constant-stride group of) that group."""
from __future__ import annotations

from typing import Any

import numpy as np

from .replica_grouping import ReplicaGrouping


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


class ShardLayout:
    """The shards of a variable of per-group ``shape`` with replica grouping ``grouping``,
    sharded over ``shard_over`` replicas of each group."""

    def __init__(self, grouping: ReplicaGrouping, shard_over: int, shape: tuple) -> None:
        const = grouping.const_rg
        if shard_over < 1 or const.group_size % shard_over:
            raise ValueError(f"The replica group size ({const.group_size}) must be divisible by the "
                             f"sharding group size ({shard_over})")
        self.grouping = grouping
        self.shape = tuple(int(d) for d in shape)
        self.nelms = int(np.prod(self.shape, dtype=np.int64))
        self.shard_over = int(shard_over)
        self.shard_size = ceil_div(self.nelms, self.shard_over)
        self.num_groups = grouping.num_groups
        members = const._members()
        index = {r: i % self.shard_over for m in members for i, r in enumerate(m)}
        self.replicas = grouping.num_replicas
        self.data_group = list(grouping.assignment)                 # replica -> group of the data
        self.shard_index = [index[r] for r in range(self.replicas)]  # replica -> its shard
        to_host = grouping.to_host_map or [const.assignment[g[0]] for g in grouping._members()]
        self.holders = [members[c][:self.shard_over] for c in to_host]   # group -> shard 0..k-1 holders
        self.shard_grouping = ReplicaGrouping(self.replicas, const.stride or 1, self.shard_over)

    def to_replicas(self, data: Any) -> np.ndarray:
        """[replicas, shard_size]: each replica's shard of the host value ``data`` (shape
        ``shape``, or [num_groups, *shape] with more than one group)."""
        data = np.asarray(data)
        rows = data.reshape(self.num_groups if self.num_groups > 1 else 1, self.nelms)
        padded = np.zeros((rows.shape[0], self.shard_over * self.shard_size), data.dtype)
        padded[:, :self.nelms] = rows
        k = self.shard_size
        return np.stack([padded[g, s * k:(s + 1) * k] for g, s in zip(self.data_group, self.shard_index)])

    def group_values(self, shards: np.ndarray) -> np.ndarray:
        """[num_groups, *shape]: each group's value put together from the replicas' shards
        ([replicas, shard_size]), padding removed."""
        return np.stack([np.concatenate([shards[r] for r in h])[:self.nelms].reshape(self.shape)
                         for h in self.holders])

    def __repr__(self) -> str:
        return (f"ShardLayout(shape={self.shape}, shard_over={self.shard_over}, "
                f"shard_size={self.shard_size}, grouping={self.grouping})")
