"""Remote buffers: storage in "Streaming Memory" for ``entries`` tensors of one shape and dtype.

On XLA a remote buffer is a separate array of shape [entries, *tensor_shape] per replica that
``popxl.Session`` keeps between runs (as it keeps variables) outside the step's working set:
in host memory where the backend offers it (a ``pinned_host`` memory kind, see
``popxl.Session``), else in device memory. ``ops.remote_store`` writes an entry,
``ops.remote_load`` reads one; remote variables are entries initialised from host data."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Optional

from .context import gcg
from .dtypes import dtype as _dtype

if TYPE_CHECKING:
    from .tensor import Tensor


def _shape(shape: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in shape)


class RemoteBuffer:
    """Store to or load from a remote buffer residing in Streaming Memory.

    The buffer belongs to the Ir of the current graph and gets the next free id (from 1).

    Args:
        tensor_shape: The shape of the tensors stored in the buffer.
        tensor_dtype: The type of the tensors stored in the buffer.
        entries: How many tensors of that shape and type the buffer holds.

    Raises:
        ValueError: If ``entries`` is not a positive integer.
    """

    def __init__(self, tensor_shape: Iterable[int], tensor_dtype: Any, entries: int) -> None:
        _check_entries(entries)
        ir = gcg().ir
        self._ir = ir
        self._meta_shape: tuple[int, ...] = ()
        self._shard_over: Optional[int] = None    # replica_sharded_buffer: shards of its variables
        self._replica_grouping: Any = None        # replica_sharded_buffer: the variables' grouping
        self._remote_buffer_id = max(ir._remote_buffers, default=0) + 1
        ir._remote_buffers[self._remote_buffer_id] = self
        self._info: tuple = ((), None, 1)
        self.set_remote_buffer_info(tensor_dtype, tensor_shape, entries)

    def set_remote_buffer_info(self, tensor_dtype: Any, tensor_shape: Iterable[int], entries: int) -> None:
        """Set the type and shape of the buffer's tensors and the number of entries.

        As PopXL, which sizes a buffer when the program is lowered, the number of entries
        may change after ops use the buffer (popxl-addons grows buffers as it adds entries).

        Raises:
            ValueError: If ``entries`` is not a positive integer, or if ops already use the
                buffer with another tensor shape or type (the program is built for those).
        """
        _check_entries(entries)
        info = (_shape(tensor_shape), _dtype.as_dtype(tensor_dtype), int(entries))
        used = self._state_spec()
        if used is not None and used[1:] != (info[0], info[1].as_device_numpy()):
            raise ValueError(f"RemoteBuffer[id={self._remote_buffer_id}] is already used by ops with "
                             f"tensors of {self.tensor_dtype.name}{list(self.tensor_shape)}; its "
                             f"tensor shape and type cannot change any more")
        if used is not None and used[0] != info[2]:
            self._resize_state(info[2])
        self._info = info

    def _resize_state(self, entries: int) -> None:
        """Every value of the buffer in the Ir's graphs (its hidden state, each version of it
        that ops and calls make) now holds ``entries`` entries."""
        import jax
        for g in self._ir._graphs:
            t = g._hidden.get(self._state_key)
            if t is None:
                continue
            first = g._versions.get(t._ir_id, t._ir_id)
            for tid in [first, *(v for v, f in g._versions.items() if f == first)]:
                old = g._specs[tid]
                g._specs[tid] = jax.ShapeDtypeStruct((entries, *old.shape[1:]), old.dtype)

    def validate_tensor_matches_buffer(self, t: Tensor, num_shards: int = 1) -> None:
        """Check that ``t`` has the buffer's tensor shape (its meta shape when ``num_shards``
        is more than 1: the tensor is the full value of a sharded entry) and type.

        Raises:
            ValueError: If the tensor does not match the buffer.
        """
        existing = self.tensor_shape if num_shards == 1 else self.meta_shape
        dt = self.tensor_dtype
        if tuple(t.shape) != tuple(existing) or t.dtype != dt:
            raise ValueError(f"Tensor {t.id} does not match buffer.\nExisting remote buffer has "
                             f"shape={tuple(existing)} and dtype={dt.name}.\nThe tensor has "
                             f"shape={tuple(t.shape)}, dtype={t.dtype.name}.")

    def _check_variable(self, t: Any) -> None:
        """Check that remote variable ``t`` fits an entry: the buffer's type and number of
        elements. As in PopXL, the variable's data fill the entry whatever its shape (data of
        shape (1, 1) for a buffer of (1,)); loads and stores must match the buffer's shape.

        Raises:
            ValueError: another type or number of elements (:meth:`validate_tensor_matches_buffer`'s text).
        """
        if t.dtype != self.tensor_dtype or math.prod(t.shape) != math.prod(self.tensor_shape):
            self.validate_tensor_matches_buffer(t)

    @property
    def remote_buffer_id(self) -> int:
        """The id of the buffer (read only)."""
        return self._remote_buffer_id

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """The shape of the tensors stored in the buffer (read only)."""
        return self._info[0]

    @property
    def tensor_dtype(self) -> _dtype:
        """The type of the tensors stored in the buffer (read only)."""
        return self._info[1]

    @property
    def entries(self) -> int:
        """The number of tensors the buffer holds. Setting it resizes the buffer.

        Raises:
            ValueError: If set to a value that is not a positive integer.
        """
        return self._info[2]

    @entries.setter
    def entries(self, entries: int) -> None:
        _check_entries(entries)
        self.set_remote_buffer_info(self.tensor_dtype, self.tensor_shape, entries)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        """The full (unsharded) shape of the tensors a replica-sharded buffer holds shards of;
        () for other buffers."""
        return self._meta_shape

    @meta_shape.setter
    def meta_shape(self, shape: Iterable[int]) -> None:
        self._meta_shape = _shape(shape)

    # ------------------------------------------------------------------ internal
    @property
    def _state_key(self) -> tuple:
        """Key of the buffer's hidden state in the graphs that use it."""
        return ("remote", self)

    @property
    def _state_name(self) -> str:
        return f"remote_buffer_{self._remote_buffer_id}"

    def _state_spec(self) -> Optional[tuple]:
        """(entries, tensor shape, numpy dtype) of the buffer as ops use it; None before any
        op did."""
        t = self._ir.main_graph._hidden.get(self._state_key)
        return None if t is None else (t.shape[0], t.shape[1:], t.dtype.as_device_numpy())

    def _check_offset(self, offset: int, what: str = "offset") -> int:
        """``offset`` as an int in [0, entries).

        Raises:
            ValueError: if it is out of range.
        """
        off = int(offset)
        if off < 0:
            raise ValueError(f"The value of {what} must be >= 0. Got {off}")
        if off >= self.entries:
            raise ValueError(f"The {what} {off} is out of range for RemoteBuffer[id="
                             f"{self._remote_buffer_id}] with {self.entries} entries "
                             f"(valid offsets: 0 to {self.entries - 1})")
        return off

    def __hash__(self) -> int:
        return hash((id(self._ir), self._remote_buffer_id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteBuffer) and other._ir is self._ir and \
            other._remote_buffer_id == self._remote_buffer_id

    def __repr__(self) -> str:
        return (f"RemoteBuffer(id={self._remote_buffer_id}, tensor_shape={self.tensor_shape}, "
                f"tensor_dtype={self.tensor_dtype.name}, entries={self.entries})")


def _check_entries(entries: Any) -> None:
    if isinstance(entries, bool) or not isinstance(entries, int) and not hasattr(entries, "__index__") \
            or int(entries) < 1:
        raise ValueError(f"Entries must be a non-zero, positive integer. Got {entries}")


def remote_buffer(tensor_shape: Iterable[int], tensor_dtype: Any, entries: int = 1) -> RemoteBuffer:
    """A remote buffer of the current graph's Ir for ``entries`` tensors of shape
    ``tensor_shape`` and type ``tensor_dtype``."""
    return RemoteBuffer(tensor_shape, tensor_dtype, entries)
