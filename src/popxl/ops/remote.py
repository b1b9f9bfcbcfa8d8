"""Remote buffer ops: remote_load, remote_load_, remote_store (ai.popxl RemoteLoad / RemoteStore;
the lowerings are in ``popart/ops/popxl_ops.py``).

A remote buffer is hidden state of the graphs that use it, as host stream buffers are: the
main graph holds it as an array [entries, *tensor_shape] (per replica) that the session keeps
between runs; a subgraph that loads from or stores to it gets it as a hidden input (by
reference when it stores), so its stores reach the caller. A store gives the buffer a new
version, so later loads read what it wrote; loads and stores of one buffer keep their order.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import jax
import numpy as np

from ..context import get_current_graph
from ..dtypes import uint32
from ..remote_buffer import RemoteBuffer
from ..tensor import Tensor, constant
from ._base import POPXL, inplace, node


def remote_state_maker(buffer: RemoteBuffer):
    """Makes the main-graph tensor that holds ``buffer`` (no value in the graph: the
    session provides it)."""
    def make(main: Any) -> Tensor:
        spec = jax.ShapeDtypeStruct((buffer.entries,) + tuple(buffer.tensor_shape),
                                    buffer.tensor_dtype.as_device_numpy())
        return main._add_tensor(main._new_id(buffer._state_name), spec)
    return make


def _check_buffer(remote_buffer: Any) -> RemoteBuffer:
    if not isinstance(remote_buffer, RemoteBuffer):
        raise TypeError(f"remote_buffer must be a popxl.RemoteBuffer, got {type(remote_buffer).__name__}")
    if remote_buffer._ir is not get_current_graph().ir:
        raise ValueError(f"RemoteBuffer[id={remote_buffer.remote_buffer_id}] belongs to another Ir "
                         f"than the graph being built")
    return remote_buffer


def _state(remote_buffer: RemoteBuffer, by_ref: bool) -> Tensor:
    return get_current_graph()._state(remote_buffer._state_key, remote_state_maker(remote_buffer), by_ref)


def _offset(remote_buffer: RemoteBuffer, offset: Union[int, Tensor]) -> Tensor:
    """``offset`` as a tensor: an int (checked against the entries now) becomes a uint32
    constant; a tensor must hold one integer (checked against the entries at run time)."""
    if isinstance(offset, Tensor):
        if offset._graph is not get_current_graph():
            raise ValueError(f"The offset tensor '{offset.id}' is not in the graph being built "
                             f"('{get_current_graph().name}')")
        if not offset.dtype.is_int or offset.nelms != 1:
            raise ValueError(f"The offset must be an int or a rank-0 integer tensor; tensor "
                             f"'{offset.id}' is {offset.dtype.name}{list(offset.shape)}")
        return offset
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be an int or a Tensor, got {type(offset).__name__}")
    return constant(remote_buffer._check_offset(offset), uint32, name="offset")


def _attrs(remote_buffer: RemoteBuffer) -> dict:
    return {"bufferid": remote_buffer.remote_buffer_id}


def _load(remote_buffer: RemoteBuffer, offset: Union[int, Tensor], name: str) -> Tensor:
    off = _offset(remote_buffer, offset)
    buf = _state(remote_buffer, False)
    out = node("RemoteLoad", [buf, off], _attrs(remote_buffer), POPXL, name=name)[0]
    out._meta_shape = tuple(remote_buffer.meta_shape)
    return out


def remote_load(remote_buffer: RemoteBuffer, offset: Union[int, Tensor], name: Optional[str] = None) -> Tensor:
    """Load entry ``offset`` of ``remote_buffer``: a new tensor of the buffer's tensor shape
    and type (its meta shape the buffer's: for a replica-sharded buffer, this replica's
    shard of the full tensor). It reads what the last ``remote_store`` to that entry wrote
    (earlier in this run, or in an earlier run; the variable's data for the entry of a
    remote variable).

    Args:
        remote_buffer: The buffer.
        offset: The entry: an int in [0, entries), or a rank-0 integer tensor (checked at
            run time: an offset out of range fails the run).
        name: Name of the returned tensor.

    Raises:
        ValueError: If an int ``offset`` is out of range.
    """
    remote_buffer = _check_buffer(remote_buffer)
    if name is None:
        name = f"id_{remote_buffer.remote_buffer_id}_offset_" + \
            (offset.name if isinstance(offset, Tensor) else str(offset))
    return _load(remote_buffer, offset, name)


def remote_load_(remote_buffer: RemoteBuffer, offset: Union[int, Tensor], t: Tensor) -> Tensor:
    """:func:`remote_load` into the existing tensor ``t`` (in place): ``t`` gets the value of
    entry ``offset`` and is returned.

    Raises:
        ValueError: If ``t`` does not match the buffer's tensor shape and type.
    """
    remote_buffer = _check_buffer(remote_buffer)
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a popxl Tensor, got {type(t).__name__}")
    remote_buffer.validate_tensor_matches_buffer(t)
    out = _load(remote_buffer, offset, "remote_load_inplace_out")
    t._meta_shape = out._meta_shape
    return inplace(t, out)


def remote_store(remote_buffer: RemoteBuffer, offset: Union[int, Tensor], t: Tensor) -> None:
    """Store ``t`` in entry ``offset`` of ``remote_buffer``; later loads of that entry (in
    this run and in later runs) read it, and so does ``Session.get_tensor_data`` of a remote
    variable stored there.

    Args:
        remote_buffer: The buffer.
        offset: The entry: an int in [0, entries), or a rank-0 integer tensor (checked at
            run time).
        t: The tensor to store, of the buffer's tensor shape and type.

    Raises:
        ValueError: If ``t`` does not match the buffer, or an int ``offset`` is out of range.
    """
    remote_buffer = _check_buffer(remote_buffer)
    if not isinstance(t, Tensor):
        raise TypeError(f"t must be a popxl Tensor, got {type(t).__name__}")
    if t._graph is not get_current_graph():
        raise ValueError(f"Tensor '{t.id}' is not in the graph being built ('{get_current_graph().name}')")
    remote_buffer.validate_tensor_matches_buffer(t)
    off = _offset(remote_buffer, offset)
    buf = _state(remote_buffer, True)
    new = node("RemoteStore", [buf, off, t], _attrs(remote_buffer), POPXL,
               name=f"remote_store_{remote_buffer.remote_buffer_id}")[0]
    inplace(buf, new)
