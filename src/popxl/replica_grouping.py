"""ReplicaGrouping: how replicas are grouped for variables and collectives."""
from __future__ import annotations

from typing import Optional, Sequence


class ReplicaGrouping:
    """Replicas r with the same ``assignment[r]`` form one group. A grouping made from
    (stride, group_size) puts replicas ``r, r + stride, ...`` (group_size of them) together."""

    def __init__(self, num_replicas: int, stride: int = 1, group_size: Optional[int] = None,
                 assignment: Optional[Sequence[int]] = None) -> None:
        self._num_replicas = int(num_replicas)
        self._stride, self._group_size, self._assignment = None, 0, []
        if assignment is not None:
            self._assignment = [int(a) for a in assignment]
            if len(self._assignment) != self._num_replicas:
                raise ValueError(f"assignment {list(assignment)} must have one entry per replica "
                                 f"({self._num_replicas})")
            self._stride, self._group_size = self._infer_stride()
            return
        stride = int(stride)
        group_size = self._num_replicas // stride if group_size is None else int(group_size)
        if stride < 1 or group_size < 1 or self._num_replicas % (stride * group_size):
            raise ValueError(f"A replica grouping with stride {stride} and group_size "
                             f"{group_size} does not partition {self._num_replicas} replicas")
        self._stride, self._group_size = stride, group_size
        block = stride * group_size
        self._assignment = [(r // block) * stride + r % stride for r in range(self._num_replicas)]

    def _infer_stride(self) -> tuple[Optional[int], int]:
        groups: dict[int, list[int]] = {}
        for r, a in enumerate(self._assignment):
            groups.setdefault(a, []).append(r)
        sizes = {len(m) for m in groups.values()}
        size = sizes.pop() if len(sizes) == 1 else max(sizes)
        strides = {b - a for m in groups.values() for a, b in zip(m, m[1:])}
        return (strides.pop() if len(strides) == 1 else (1 if not strides else None)), size

    @property
    def assignment(self) -> list[int]:
        return list(self._assignment)

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def stride(self) -> Optional[int]:
        return self._stride

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def num_groups(self) -> int:
        return len(set(self._assignment))

    @property
    def is_const(self) -> bool:
        """True when every group has a constant stride (usable by collectives)."""
        return self._stride is not None

    def first_replicas(self) -> list[int]:
        """The first replica of each group, in group order."""
        return [self._assignment.index(g) for g in sorted(set(self._assignment))]

    def transpose(self) -> "ReplicaGrouping":
        """The grouping whose groups take one replica from each of this one's groups."""
        if self._stride is None:
            raise ValueError("transpose() needs a grouping with a constant stride")
        if self._stride == 1:
            return ReplicaGrouping(self._num_replicas, self._group_size,
                                   self._num_replicas // self._group_size)
        return ReplicaGrouping(self._num_replicas, 1, self._stride)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and self._assignment == other._assignment

    def __hash__(self) -> int:
        return hash(tuple(self._assignment))

    def __repr__(self) -> str:
        return (f"ReplicaGrouping(num_replicas={self._num_replicas}, stride={self._stride}, "
                f"group_size={self._group_size}, assignment={self._assignment})")
