"""A program's device state, for both front-ends: where each tensor lives (:class:`Home`: its
IPU, replica sharding and memory kind) and the one rule of replicated tensor sharding
(:class:`ReplicaShards`: PopART's RTS, with popxl's replica groupings). popart's sessions
choose their homes in ``engine/rts.py``, popxl's replica-sharded variables theirs in
``popxl.replica_sharded_variable``; ``placed.IpuSlots`` packs a placed program's state by
them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .compiled import REPLICA_AXIS

HOST_MEMORY = "pinned_host"   # where off-chip tensors live (a memory kind of the devices)


def shard_size(nelms: int, shards: int) -> int:
    """Elements in each of ``shards`` shards of ``nelms`` elements: ceil(nelms / shards)."""
    return -(-int(nelms) // int(shards))


class ReplicaShards:
    """How one tensor of ``shape`` is split over the replicas (PopART's RTS; popxl's
    ``replica_sharded_variable``): flattened and zero padded to ``shard_over`` shards of
    :attr:`shard_size` elements. ``assignment`` gives each replica's group of the data (a
    replica grouping: one value per group); ``const_assignment`` a refinement of it into
    groups of constant stride (default ``assignment``). The members of each constant-stride
    group are numbered 0, 1, ... in replica order; member m holds shard m mod ``shard_over``,
    so each run of ``shard_over`` members holds one full copy. A group's value is read from
    the first ``shard_over`` members of the first constant-stride group inside it.
    :meth:`over_all` is PopART's ``CommGroupType.All``: replica r holds shard r."""

    def __init__(self, shape: tuple, shard_over: int, assignment: Any,
                 const_assignment: Any = None) -> None:
        groups = list(assignment)
        const = list(groups if const_assignment is None else const_assignment)
        members: dict[int, list[int]] = {}
        for r, c in enumerate(const):
            members.setdefault(c, []).append(r)
        size = len(next(iter(members.values())))
        if shard_over < 1 or size % shard_over:
            raise ValueError(f"The replica group size ({size}) must be divisible by the "
                             f"sharding group size ({shard_over})")
        self.shape = tuple(int(d) for d in shape)
        self.nelms = int(np.prod(self.shape, dtype=np.int64))
        self.shard_over = int(shard_over)
        self.shard_size = shard_size(self.nelms, self.shard_over)
        self.padded = self.shard_over * self.shard_size
        self.replicas = len(groups)
        self.num_groups = len(set(groups))
        self.data_group = groups                                    # replica -> group of the data
        index = {r: i % self.shard_over for m in members.values() for i, r in enumerate(m)}
        self.shard_index = [index[r] for r in range(self.replicas)]  # replica -> its shard
        first: dict[int, int] = {}   # data group -> the const group of its first replica
        for c, a in zip(const, groups):
            first.setdefault(a, c)
        self.holders = [members[first[a]][:self.shard_over] for a in sorted(first)]

    @classmethod
    def over_all(cls, shape: tuple, replicas: int) -> "ReplicaShards":
        """Sharded over all ``replicas``, one group (PopART's sessions)."""
        return cls(shape, replicas, [0] * replicas)

    # ------------------------------------------------------------------ host or traced
    def flat(self, x: Any, batch: int = 0) -> Any:
        """``x`` (``batch`` leading dimensions, then ``shape``) flattened and zero padded:
        [*batch, padded], the shards in order; NumPy arrays stay NumPy."""
        rows = x.reshape(tuple(x.shape[:batch]) + (-1,))
        if self.padded == self.nelms:
            return rows
        pad = np.pad if isinstance(x, np.ndarray) else jnp.pad
        return pad(rows, ((0, 0),) * batch + ((0, self.padded - self.nelms),))

    def whole(self, x: Any, batch: int = 0) -> Any:
        """The inverse of :meth:`flat`: [*batch, padded] -> [*batch, *shape], padding removed."""
        return x[..., :self.nelms].reshape(tuple(x.shape[:batch]) + self.shape)

    # ------------------------------------------------------------------ host
    def to_replicas(self, data: Any) -> np.ndarray:
        """[replicas, shard_size]: each replica's shard of the host value ``data`` (shape
        ``shape``, or [num_groups, *shape] with more than one group)."""
        data = np.asarray(data)
        padded = self.flat(data.reshape((self.num_groups if self.num_groups > 1 else 1,) + self.shape), 1)
        k = self.shard_size
        return np.stack([padded[g, s * k:(s + 1) * k] for g, s in zip(self.data_group, self.shard_index)])

    def group_values(self, shards: np.ndarray) -> np.ndarray:
        """[num_groups, *shape]: each group's value put together from the replicas' shards
        ([replicas, shard_size]), padding removed."""
        return np.stack([self.whole(np.concatenate([shards[r] for r in h])) for h in self.holders])

    # ------------------------------------------------------------------ inside shard_map
    def local(self, x: Any) -> Any:
        """Inside a shard_map over ``REPLICA_AXIS`` (:meth:`over_all`): this replica's shard of
        the whole tensor ``x``."""
        r = jax.lax.axis_index(REPLICA_AXIS)
        return jax.lax.dynamic_slice(self.flat(x), (r * self.shard_size,), (self.shard_size,))

    def gather_local(self, x: Any) -> Any:
        """Inside a shard_map over ``REPLICA_AXIS`` (:meth:`over_all`): the whole tensor from
        this replica's shard ``x`` (an all-gather; the inverse of :meth:`local`)."""
        return self.whole(jax.lax.all_gather(x, REPLICA_AXIS, tiled=True))

    def __repr__(self) -> str:
        return (f"ReplicaShards(shape={self.shape}, shard_over={self.shard_over}, "
                f"shard_size={self.shard_size}, assignment={self.data_group})")


@dataclass(frozen=True)
class Home:
    """Where one tensor of a program's device state lives: the one record both front-ends'
    state packing reads (``rts.StateSharding.homes``, ``placed.IpuSlots``, popxl's state
    arrays). ``ipu``: the IPU whose devices hold it (placed programs; 0 otherwise);
    ``shards``: its replica sharding (None: whole on every replica); ``memory_kind``: where
    it stays between runs (None: the devices' default memory; ``HOST_MEMORY`` off chip)."""
    ipu: int = 0
    shards: Optional[ReplicaShards] = None
    memory_kind: Optional[str] = None
