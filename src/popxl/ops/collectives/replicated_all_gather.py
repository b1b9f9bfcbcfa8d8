"""Gather a tensor from the replicas of each group."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...replica_grouping import ReplicaGrouping
from ...tensor import Tensor
from .._base import GC, one
from .._core import reshape
from .collectives import _group, _grouping_attr, _rearrange_input, _rearrange_output


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
        return reshape(out, (k,) + t.shape)
    return _rearrange_output(out, shape, axis if t.rank else 0)
