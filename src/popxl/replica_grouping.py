"""ReplicaGrouping: how replicas are grouped for variables and collectives."""
from __future__ import annotations

from typing import Any, Optional, Sequence

_NON_CONST = ("This ReplicaGrouping has a non-constant stride and has no PopART C++ representation. "
              "You can't use this ReplicaGrouping with GCL ops. ")


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
    def stride(self) -> int:
        """The distance between the members of a group.

        Raises:
            NotImplementedError: for a grouping without a constant stride (PopXL's).
        """
        if self._stride is None:
            raise NotImplementedError(_NON_CONST)
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
        """The grouping whose k-th group holds the k-th member of every group of this one,
        e.g. [0, 0, 1, 1] -> [0, 1, 0, 1] and [0, 1, 0, 1, 2, 3, 2, 3] -> [0, 0, 1, 1, 0, 0, 1, 1]
        (in group-matrix terms: rows are groups, values replicas; the transpose swaps rows and
        columns)."""
        rows = self._members()
        if len({len(m) for m in rows}) != 1:
            raise ValueError(f"transpose() needs groups of one size, got {self}")
        assignment = [0] * self._num_replicas
        for row in rows:
            for k, rep in enumerate(row):
                assignment[rep] = k
        return ReplicaGrouping(self._num_replicas, assignment=assignment)

    def _members(self) -> list[list[int]]:
        """The replicas of each group (in group order), each in increasing order."""
        groups: dict[int, list[int]] = {}
        for r, a in enumerate(self._assignment):
            groups.setdefault(a, []).append(r)
        return [groups[g] for g in sorted(groups)]

    @property
    def const_rg(self) -> "ReplicaGrouping":
        """A grouping with a constant stride that refines this one: this grouping itself
        when its stride is constant; otherwise its groups are split where a member is
        farther than the smallest stride from the previous one, and the result regrouped
        with that stride and the greatest common divisor of the pieces' sizes. For example
        [0, 0, 1, 1, 0, 0, 1, 1] -> [0, 0, 1, 1, 2, 2, 3, 3]."""
        if self.is_const:
            return self
        import math
        rows = self._members()
        gaps = {b - a for m in rows for a, b in zip(m, m[1:])}
        stride = min(gaps) if gaps else 1
        sizes = []
        for m in rows:
            run = 1
            for a, b in zip(m, m[1:]):
                if b - a > stride:
                    sizes.append(run)
                    run = 1
                else:
                    run += 1
            sizes.append(run)
        size = 0
        for n in sizes:
            size = math.gcd(size, n)
        return ReplicaGrouping(self._num_replicas, stride if size > 1 else 1, size)

    @property
    def to_device_map(self) -> Optional[list[int]]:
        """For a grouping without a constant stride: this grouping's group of each group of
        :attr:`const_rg` (None when the stride is constant)."""
        if self.is_const:
            return None
        out: dict[int, int] = {}
        for c, a in zip(self.const_rg.assignment, self._assignment):
            out.setdefault(c, a)
        return [out[c] for c in sorted(out)]

    @property
    def to_host_map(self) -> Optional[list[int]]:
        """For a grouping without a constant stride: the first group of :attr:`const_rg`
        inside each group of this grouping (None when the stride is constant)."""
        if self.is_const:
            return None
        out: dict[int, int] = {}
        for c, a in zip(self.const_rg.assignment, self._assignment):
            out.setdefault(a, c)
        return [out[a] for a in sorted(out)]

    def _to_variable_settings(self, retrieval_mode: Optional[str] = None) -> Any:
        """This grouping as ``popart.VariableSettings(stride, group_size, mode)``.

        Raises:
            NotImplementedError: for a grouping without a constant stride.
            ValueError: for a ``retrieval_mode`` other than None, "one_per_group" or
                "all_replicas".
        """
        from popart.options import VariableRetrievalMode, VariableSettings
        if not self.is_const:
            raise NotImplementedError("This ReplicaGrouping has a non-constant stride and has no "
                                      "PopART C++ ReplicaGrouping or VariableSettings "
                                      "representation. ")
        modes = {None: VariableRetrievalMode.OnePerGroup,
                 "one_per_group": VariableRetrievalMode.OnePerGroup,
                 "all_replicas": VariableRetrievalMode.AllReplicas}
        if retrieval_mode not in modes:
            raise ValueError(f"Invalid retrieval_mode: {retrieval_mode}")
        return VariableSettings(self._stride, self._group_size, modes[retrieval_mode])

    @property
    def _pb_replica_grouping(self) -> Any:
        """PopART's binding view (``popart._internal.ir.ReplicaGrouping``)."""
        from . import _pb
        return _pb.ReplicaGroupingHandle(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and self._assignment == other._assignment

    def __hash__(self) -> int:
        return hash(tuple(self._assignment))

    def __repr__(self) -> str:
        if not self.is_const:   # PopXL's two forms
            return f"ReplicaGrouping(assignment={self._assignment})"
        return (f"ReplicaGrouping(num_replicas={self._num_replicas}, stride={self._stride}, "
                f"group_size={self._group_size}, num_groups={self.num_groups})")
