"""In-place versions of popxl tensors: after an in-place op the popxl tensor the user holds
names the op's result (a new IR value), as in PopXL. Used by the ops (``ops._base``) and by the
binding's handles (``_pb``), so it imports neither."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .tensor import Tensor


def inplace(t: "Tensor", new: "Tensor", _from: Optional["Tensor"] = None) -> "Tensor":
    """Make ``t`` name the value ``new`` (the result of an in-place op on ``t``); the tensors
    that alias ``t`` (``ops._base.view``) follow."""
    if new.shape != t.shape:
        raise ValueError(f"In-place op on '{t.id}' would change its shape from {t.shape} to {new.shape}")
    versions = t._graph._versions
    versions[new._ir_id] = versions.get(t._ir_id, t._ir_id)
    t._ir_id = new._ir_id
    for base, back in getattr(t, "_alias_of", ()):   # t is a view: write it into its base
        if base is not _from and base._graph is t._graph:
            inplace(base, back(base, t), t)
    for v, fwd in getattr(t, "_aliases", ()):        # t has views: they read its new value
        if v is not _from and v._graph is t._graph:
            inplace(v, fwd(t), t)
    return t
