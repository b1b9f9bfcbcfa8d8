"""popxl tensors: Tensor (intermediates), Variable, Constant, TensorSpec, TensorByRef, and the
functions that make them (variable, constant, graph_input, graph_output)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import numpy as np

from popart.engine.state import ReplicaShards, shard_size

from . import context
from .dtypes import dtype as _dtype
from .errors import UndefinedValue
from .tensorlocation import TileSet

if TYPE_CHECKING:
    from .graph import Graph
    from .replica_grouping import ReplicaGrouping

# The ops Tensor's methods and operators call (``popxl.ops._core``): set by popxl.ops when it
# is imported (_bind_ops), as the ops make Tensors and so import this module.
_ops: Any = None


def _bind_ops(ops: Any) -> None:
    """Make Tensor's methods and operators call the ops of module ``ops``."""
    global _ops
    _ops = ops


#: Scalar types that can be coerced into a Tensor.
ScalarType = Union[int, float, bool]
#: Container types that can be coerced into a Tensor.
HostTensor = Union[np.ndarray, Iterable[ScalarType]]
host_tensor_types: tuple = (np.ndarray, Iterable)
try:
    import torch as _torch
    HostTensor = Union[HostTensor, _torch.Tensor]   # type: ignore[misc]
    host_tensor_types = (*host_tensor_types, _torch.Tensor)
except ModuleNotFoundError:  # pragma: no cover
    pass
#: Container and scalar types that can be coerced into a Tensor.
HostScalarTensor = Union[ScalarType, HostTensor]
#: Tensors and types that can be coerced into a Tensor.
TensorLike = Union["Tensor", HostScalarTensor]

#: PopART's tile sets by popxl's names for them.
TILE_SET_MAP = {TileSet.Compute: "compute", TileSet.IO: "io", TileSet.Undefined: "undefined"}


class TensorSpec(Mapping):
    """Shape, dtype and meta shape of a tensor (used to declare graph inputs). A mapping
    of "shape", "dtype" and "meta_shape", so ``popxl.graph_input(**spec)`` works."""

    def __init__(self, shape: Iterable[int], dtype: Any, meta_shape: Iterable[int] = ()) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = _dtype.as_dtype(dtype)
        self.meta_shape = tuple(meta_shape or ())   # None: none (popxl-addons passes it)

    def to_dict(self) -> dict:
        return {"shape": self.shape, "dtype": self.dtype, "meta_shape": self.meta_shape}

    def to_tuple(self) -> tuple:
        return self.shape, self.dtype, self.meta_shape

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorSpec) and self.to_tuple() == other.to_tuple()

    def __hash__(self) -> int:
        return hash(self.to_tuple())

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype}, meta_shape={self.meta_shape})"


class TensorLocationInfo:
    """Where a tensor lives: on the device or in a remote buffer (``remote``: a remote
    variable, with ``remote_buffer_info`` = (buffer id, offset)), whole on every replica or
    one shard per replica (``sharded``: a replica-sharded variable)."""

    def __init__(self, remote: bool = False, sharded: bool = False,
                 remote_buffer_info: Optional[tuple[int, int]] = None) -> None:
        self.remote, self.sharded = remote, sharded
        self.remote_buffer_info = remote_buffer_info

    def isRemote(self) -> bool:
        return self.remote

    def isSharded(self) -> bool:
        return self.sharded

    def getRemoteBufferInfo(self) -> Optional[tuple[int, int]]:
        """(remote buffer id, offset) of a remote variable, else None."""
        return self.remote_buffer_info

    @property
    def location(self) -> Any:
        """The :class:`popxl.TensorLocation` (storage, sharding)."""
        from .tensorlocation import ReplicatedTensorSharding, TensorLocation, TensorStorage
        return TensorLocation(TensorStorage.OffChip if self.remote else TensorStorage.OnChip,
                              ReplicatedTensorSharding.On if self.sharded else ReplicatedTensorSharding.Off)

    def __repr__(self) -> str:
        return f"TensorLocationInfo(remote={self.remote}, sharded={self.sharded})"


class Tensor:
    """A tensor of a graph. Operators build ops in the current graph (``a + b``, ``a @ b``)."""

    def __init__(self, graph: "Graph", tid: str) -> None:
        self._graph, self._id, self._ir_id = graph, tid, tid
        self._placement: tuple = (None, "compute")   # (IPU, tile set) when it was created
        self._meta_shape: tuple = ()                  # the full shape of a replica shard

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> str:
        return self._id

    @property
    def name(self) -> str:
        """The id without the graph scope: the name scopes and the name ('foo/bar')."""
        scope = self.scope
        return self._id[len(scope) + 1:] if scope and self._id.startswith(scope + "/") else self._id

    @property
    def scope(self) -> str:
        """The graph scope of the tensor: "" in the main graph, else the graph's id."""
        return "" if self._graph._is_main else self._graph.id

    @property
    def _spec(self) -> Any:
        return self._graph._specs[self._ir_id]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self._spec.shape)

    @property
    def dtype(self) -> _dtype:
        return _dtype.as_dtype(self._spec.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def nelms(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype, self.meta_shape)

    @property
    def meta_shape(self) -> tuple[int, ...]:
        """The full shape of the tensor a replica shard belongs to (a remote load from a
        replica-sharded buffer, a replicated reduce-scatter configured for replicated tensor
        sharding, the shard of ``replica_sharded_variable``); () for other tensors."""
        return self._meta_shape

    @property
    def graph(self) -> "Graph":
        return self._graph

    @property
    def ir(self) -> Any:
        return self._graph.ir

    @property
    def T(self) -> "Tensor":
        return self.transpose()

    @property
    def T_(self) -> "Tensor":
        """The tensor transposed with reversed axes, in place."""
        return self.transpose_()

    def strides(self, shape: Optional[Iterable[int]] = None) -> tuple[int, ...]:
        """Bytes to step in each dimension of a C-ordered array of this dtype and ``shape``
        (default: the tensor's shape), as :py:attr:`numpy.ndarray.strides`."""
        shape = self.shape if shape is None else tuple(int(d) for d in shape)
        out, step = [], self.dtype.as_device_numpy().itemsize
        for d in reversed(shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    @property
    def ipu(self) -> int:
        """The IPU the tensor was placed on (``popxl.ipu`` block around its creation).

        Raises:
            UndefinedValue: if it was created outside any ``ipu`` block.
        """
        if self._placement[0] is None:
            raise UndefinedValue("Tensor's IPU is undefined.")
        return int(self._placement[0])

    @property
    def tile_set(self) -> str:
        """"io" for a tensor created in an ``io_tiles`` block, else "compute"."""
        return self._placement[1]

    @property
    def location_info(self) -> TensorLocationInfo:
        return TensorLocationInfo()

    @property
    def _pb_tensor(self) -> Any:
        """PopART's binding view of the tensor's current value (``popart._internal.ir.Tensor``)."""
        from . import _pb
        return _pb.Tensor(self._graph, self._ir_id)

    @classmethod
    def _from_pb_tensor(cls, pb_tensor: Any) -> "Tensor":
        """The popxl tensor of a binding tensor handle (the tensor whose value it is)."""
        from . import _pb
        return _pb.popxl_tensor(pb_tensor._graph, pb_tensor.id)

    @property
    def in_sync_with_ipu(self) -> bool:
        """False for a variable whose device value, in a session of its Ir, changed since the
        last ``weights_to_host`` (the host copy is stale); True otherwise."""
        if not isinstance(self, Variable):
            return True
        session = getattr(self.ir, "_session", None)
        return True if session is None else session._host_in_sync(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}[{self.id} {self.dtype.name} {self.shape}]"

    def __len__(self) -> int:
        """The size of axis 0 (also the tensor's truth value, as in PopXL: ``assert t`` holds
        for a tensor with a non-empty axis 0).

        Raises:
            ValueError: for a scalar.
        """
        if not self.shape:
            raise ValueError("Tensor is a scalar and doesn't have a length.")
        return self.shape[0]

    __hash__ = object.__hash__  # tensors are dictionary keys (inputs_dict, session data)

    def _ensure_tensor(self, value: TensorLike, dtype: Optional[_dtype] = None) -> "Tensor":
        """``value`` as a tensor of the current graph (literals become constants of this
        tensor's dtype)."""
        if isinstance(value, Tensor):
            return value
        t = constant(value, dtype or self.dtype)
        if t.nelms == 0:
            raise ValueError("The value has 0 elements - this is most likely a mistake. If not, "
                             "initialise the tensor explicitly before using in an operation. For "
                             f"example: `popxl.variable([])`. Type: {type(value)}. Value: {value}")
        return t

    # ------------------------------------------------------------------ methods
    def transpose(self, permutation: Optional[Iterable[int]] = None) -> "Tensor":
        return _ops.transpose(self, permutation)

    def transpose_(self, permutation: Optional[Iterable[int]] = None) -> "Tensor":
        return _ops.transpose_(self, permutation)

    def reshape(self, shape: Iterable[int]) -> "Tensor":
        return _ops.reshape(self, shape)

    def reshape_(self, shape: Iterable[int]) -> "Tensor":
        return _ops.reshape_(self, shape)

    def flatten(self) -> "Tensor":
        return _ops.flatten(self)

    def flatten_(self) -> "Tensor":
        return _ops.flatten_(self)

    def detach(self) -> "Tensor":
        return _ops.detach(self)

    def detach_(self) -> "Tensor":
        return _ops.detach_(self)

    def copy_to_ipu(self, destination: int, source: Optional[int] = None) -> "Tensor":
        return _ops.ipu_copy(self, destination, source)

    def diag(self) -> "Tensor":
        """The diagonal of a 2-d tensor (``min(rows, cols)`` elements, as ``numpy.diag``).

        Raises:
            ValueError: if the tensor is not 2-d.
        """
        if self.rank != 2:
            raise ValueError("Diag expected a 2d tensor.")
        rows, cols = self.shape
        n = min(rows, cols)
        if n == 0:
            return self.flatten()[0:0]
        return self.flatten()[:(n - 1) * (cols + 1) + 1:cols + 1]

    def __getitem__(self, key: Any) -> "Tensor":
        return _ops._getitem(self, key)

    # ------------------------------------------------------------------ operators
    def _bin(self, op: str, other: TensorLike, reverse: bool = False) -> "Tensor":
        o = self._ensure_tensor(other)
        a, b = (o, self) if reverse else (self, o)
        return getattr(_ops, op)(a, b)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __mod__(self, o): return self._bin("fmod", o)
    def __rmod__(self, o): return self._bin("fmod", o, True)
    def __pow__(self, o): return self._bin("pow", o)
    def __rpow__(self, o): return self._bin("pow", o, True)
    def __matmul__(self, o): return self._bin("matmul", o)
    def __rmatmul__(self, o): return self._bin("matmul", o, True)
    def __gt__(self, o): return self._bin("greater", o)
    def __lt__(self, o): return self._bin("less", o)
    def __ge__(self, o): return self._bin("greater_equal", o)
    def __le__(self, o): return self._bin("less_equal", o)
    def __and__(self, o): return self._bin("logical_and", o)
    def __rand__(self, o): return self._bin("logical_and", o, True)
    def __or__(self, o): return self._bin("logical_or", o)
    def __ror__(self, o): return self._bin("logical_or", o, True)
    def __iadd__(self, o):
        return _ops.add_(self, self._ensure_tensor(o))

    def __neg__(self) -> "Tensor":
        return _ops.negate(self)

    def __abs__(self) -> "Tensor":
        return _ops.abs(self)

    def __invert__(self) -> "Tensor":
        return _ops.logical_not(self)

    # No iteration or ``in`` through __getitem__ (PopXL's choice: its errors would mislead).
    __iter__ = None
    __contains__ = None
    # NumPy defers to the reflected operators: ``np.ndarray @ Tensor`` is ``Tensor.__rmatmul__``.
    __array_ufunc__ = None


class Variable(Tensor):
    """A tensor of the main graph whose value lives on the device between runs.

    A remote variable (``remote_variable``, ``remote_replica_sharded_variable``,
    ``replica_sharded_variable``) lives in an entry of a remote buffer instead: ops do not
    read it directly (``ops.remote_load`` does), and ``Session.get_tensor_data`` /
    ``write_variable_data`` give its full value."""

    def __init__(self, graph: "Graph", tid: str, replica_grouping: Any = None,
                 retrieval_mode: str = "one_per_group") -> None:
        super().__init__(graph, tid)
        self.replica_grouping = replica_grouping
        self.retrieval_mode = retrieval_mode
        self._remote: Optional[tuple] = None   # (RemoteBuffer, offset) of a remote variable
        self._sharding: Any = None             # engine.state.ReplicaShards of a replica-sharded variable
        self._shard: Optional[Tensor] = None   # replica_sharded_variable: the shard tensor
        self._memmap_arr: Optional[np.memmap] = None   # the np.memmap holding its host value

    def _flush_data_if_memmap(self) -> None:
        """Write the host value to the memmap's file (a variable made from an np.memmap)."""
        if self._memmap_arr is not None:
            self._memmap_arr.flush()

    @property
    def location_info(self) -> TensorLocationInfo:
        if self._remote is None:
            return TensorLocationInfo()
        buf, off = self._remote
        return TensorLocationInfo(True, self._sharding is not None, (buf.remote_buffer_id, off))

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        g = self.replica_grouping
        return self.shape if g is None or g.num_groups == 1 else (g.num_groups,) + self.shape

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        return self.shape

    def copy_to_ipu(self, dst: int, src: int) -> Tensor:  # type: ignore[override]
        """``ops.ipu_copy(self, dst, src)``: a variable has no producer, so ``src`` is needed."""
        return _ops.ipu_copy(self, dst, src)


class Constant(Tensor):
    """A tensor whose value is fixed when the graph is built."""

    def copy_to_ipu(self, dst: int, src: int) -> Tensor:  # type: ignore[override]
        """``ops.ipu_copy(self, dst, src)``: a constant has no producer, so ``src`` is needed."""
        return _ops.ipu_copy(self, dst, src)


class TensorByRef(Tensor):
    """Type hint for ``create_graph``: the argument is passed to the graph by reference, so
    in-place changes inside the graph change the caller's tensor."""


def _resolve_data(data: Any, dtype: Any, downcast: bool, log2_scale: Optional[int] = None,
                  nan_on_overflow: Optional[bool] = None) -> np.ndarray:
    """``data`` as a NumPy array (``popxl.utils.to_numpy``; float8 data in ml_dtypes' form);
    an ``np.memmap`` is returned itself, never copied.

    Raises:
        ValueError: for an ``np.memmap`` that is not C-ordered and aligned, that needs
            downcasting, or whose dtype conflicts with ``dtype``.
    """
    if isinstance(data, Tensor):
        raise TypeError("A popxl Tensor cannot be used as the data of a variable or constant")
    from .fp8_utils import from_host_fp8
    from .utils import to_numpy
    return from_host_fp8(to_numpy(data, None if dtype is None else _dtype.as_dtype(dtype), downcast,
                                  copy=not isinstance(data, np.memmap), log2_scale=log2_scale,
                                  nan_on_overflow=nan_on_overflow))


def _host_value(arr: np.ndarray, grouping: "ReplicaGrouping", tid: str) -> np.ndarray:
    """The host value a variable keeps: the ``np.memmap`` itself (PopXL does not copy it;
    ``Session.weights_to_host`` writes into it and flushes it), else a copy. A memmap with a
    non-const replica grouping is copied, with PopXL's warning."""
    if isinstance(arr, np.memmap):
        if grouping.is_const:
            return arr
        import popart
        popart.getLogger().warn(f"In creation of variable {tid}, you have passed np.memmap data "
                                f"and a non-const replica grouping, which requires us to make a "
                                f"copy of your np.memmap data. Your variable will be treated as "
                                f"NOT an np.memmap.")
    return np.array(arr)


def _check_retrieval_mode(retrieval_mode: Optional[str]) -> None:
    if retrieval_mode not in (None, "one_per_group", "all_replicas"):
        raise ValueError(f"Invalid retrieval_mode {retrieval_mode!r}: expected 'one_per_group' "
                         f"or 'all_replicas'")


def _main_graph(what: str) -> "Graph":
    g = context.get_current_graph()
    if not g._is_main:
        raise ValueError(f"{what} can only be created in the main graph, not in '{g.name}': "
                         f"create it in the main graph and pass it as a graph input")
    return g


def _per_group(arr: np.ndarray, groups: int, name: Optional[str]) -> np.ndarray:
    """The value of one group: ``arr`` itself, or its first row with several groups."""
    if groups > 1:
        if arr.shape[:1] != (groups,):
            raise ValueError(f"Variable '{name}': with {groups} replica groups the data needs a "
                             f"leading dimension of {groups}, got shape {arr.shape}")
        return arr[0]
    return arr


def variable(data: Any, dtype: Any = None, name: Optional[str] = None, downcast: bool = True,
             replica_grouping: Optional["ReplicaGrouping"] = None,
             retrieval_mode: Optional[str] = None, log2_scale: Optional[int] = None,
             nan_on_overflow: Optional[bool] = None) -> Variable:
    """A variable of the main graph initialised with ``data``. With a replica grouping of
    more than one group, ``data`` has a leading dimension of one value per group.
    ``retrieval_mode`` (default "one_per_group") or "all_replicas": what
    ``Session.get_tensor_data`` returns. For float8 dtypes ``data`` (float16/32/64) is
    multiplied by ``2**log2_scale`` and cast (out-of-range values NaN unless
    ``nan_on_overflow`` is False, see ``popxl.utils.to_numpy``)."""
    g = _main_graph("Variables")
    _check_retrieval_mode(retrieval_mode)
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    ir = g.ir
    ir._has_read_only_memmap |= isinstance(arr, np.memmap) and not arr.flags.writeable
    grouping = replica_grouping or ir.replica_grouping()
    per = _per_group(arr, grouping.num_groups, name)
    host = _host_value(arr, grouping, g._create_tensor_id(name))
    t = g._add_constant(per if host is arr else np.array(per), name or "t", cls=Variable,
                        replica_grouping=grouping, retrieval_mode=retrieval_mode or "one_per_group")
    ir._variables.append(t)
    ir._variable_data[t] = host
    t._memmap_arr = host if isinstance(host, np.memmap) else None
    return t


class _Described:
    """What ``RemoteBuffer._check_variable`` reads of a tensor (id, shape, dtype), for
    checking data before its variable is created."""

    def __init__(self, tid: str, shape: tuple, dt: Any) -> None:
        self.id, self.shape, self.dtype = tid, tuple(shape), _dtype.as_dtype(dt)


def _remote_variable(arr: np.ndarray, per: np.ndarray, remote_buffer: Any, offset: int,
                     name: Optional[str], replica_grouping: Any, retrieval_mode: Optional[str],
                     sharding: Any = None) -> Variable:
    """A variable stored in entry ``offset`` of ``remote_buffer`` (no value in the graph:
    ops reach it through remote loads)."""
    import jax
    g = context.get_current_graph()
    ir = g.ir
    taken = ir._remote_entries.get((remote_buffer, offset))
    if taken is not None:
        raise ValueError(f"Entry {offset} of RemoteBuffer[id={remote_buffer.remote_buffer_id}] "
                         f"already holds remote variable '{taken.id}'")
    grouping = replica_grouping or ir.replica_grouping()
    ir._has_read_only_memmap |= isinstance(arr, np.memmap) and not arr.flags.writeable
    tid = g._create_tensor_id(name)
    host = _host_value(arr, grouping, tid)
    t = g._add_tensor(tid, jax.ShapeDtypeStruct(per.shape, per.dtype), Variable,
                      replica_grouping=grouping, retrieval_mode=retrieval_mode or "one_per_group")
    t._remote = (remote_buffer, offset)
    t._sharding = sharding
    ir._remote_entries[(remote_buffer, offset)] = t
    ir._variables.append(t)
    ir._variable_data[t] = host
    t._memmap_arr = host if isinstance(host, np.memmap) else None
    return t


def _check_remote_args(remote_buffer: Any, offset: Any) -> int:
    from .remote_buffer import RemoteBuffer
    if not isinstance(remote_buffer, RemoteBuffer):
        raise TypeError(f"remote_buffer must be a popxl.RemoteBuffer, got {type(remote_buffer).__name__}")
    if remote_buffer._ir is not context.get_current_graph().ir:
        raise ValueError(f"RemoteBuffer[id={remote_buffer.remote_buffer_id}] belongs to another Ir")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    return remote_buffer._check_offset(offset)


def remote_variable(data: Any, remote_buffer: Any, offset: int = 0, dtype: Any = None,
                    name: Optional[str] = None, downcast: bool = True,
                    replica_grouping: Optional["ReplicaGrouping"] = None,
                    retrieval_mode: Optional[str] = "one_per_group",
                    log2_scale: Optional[int] = None, nan_on_overflow: Optional[bool] = None) -> Variable:
    """A variable stored in entry ``offset`` of ``remote_buffer`` (Streaming Memory),
    initialised with ``data`` when the session copies the weights to the device
    (``weights_from_host``): each replica's entry gets its group's value. Ops use it through
    ``ops.remote_load(remote_buffer, offset)``; ``Session.get_tensor_data`` returns the
    entry's value (what the last ``ops.remote_store`` to it wrote). Other arguments as
    :func:`variable`.

    Raises:
        ValueError: If the variable's dtype or number of elements does not match the
            buffer's (its shape may differ, as in PopXL), if ``offset`` is not in
            [0, entries), or if the entry already holds a variable.
    """
    _main_graph("Remote variables")
    _check_retrieval_mode(retrieval_mode)
    off = _check_remote_args(remote_buffer, offset)
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    groups = 1 if replica_grouping is None else replica_grouping.num_groups
    per = _per_group(arr, groups, name)
    remote_buffer._check_variable(_Described(name or "v", per.shape, per.dtype))
    return _remote_variable(arr, per, remote_buffer, off, name, replica_grouping, retrieval_mode)


def _replication(what: str) -> int:
    rf = context.get_current_graph().ir.replication_factor
    if rf <= 1:
        raise ValueError(f"The IR's global replication factor is {rf}. It must be greater than 1 "
                         f"to create a {what}.")
    return rf


def _shard_over_for(remote_buffer: Any, grouping: "ReplicaGrouping", nelms: int) -> int:
    """The number of shards of the variables of ``remote_buffer``: the buffer's own (a
    replica_sharded_buffer, or set by its first sharded variable), else the largest divisor
    of the replica group size whose shard fits the buffer's tensor shape."""
    if remote_buffer._shard_over is not None:
        return remote_buffer._shard_over
    size = grouping.const_rg.group_size
    want = remote_buffer.tensor_shape
    for k in sorted((d for d in range(1, size + 1) if size % d == 0), reverse=True):
        if want == (shard_size(nelms, k),):
            return k
    raise ValueError(f"RemoteBuffer[id={remote_buffer.remote_buffer_id}] holds tensors of shape "
                     f"{want}, which is not the shard of a variable of {nelms} elements sharded "
                     f"over {size} replicas: that is ({shard_size(nelms, size)},) (flattened, padded "
                     f"to a multiple of the shard count; see popxl.replica_sharded_buffer)")


def remote_replica_sharded_variable(data: Any, remote_buffer: Any, offset: int = 0, dtype: Any = None,
                                    name: Optional[str] = None, downcast: bool = True,
                                    replica_grouping: Optional["ReplicaGrouping"] = None,
                                    retrieval_mode: Optional[str] = "one_per_group",
                                    log2_scale: Optional[int] = None,
                                    nan_on_overflow: Optional[bool] = None) -> Variable:
    """A variable stored in entry ``offset`` of ``remote_buffer``, scattered in equal shards
    across the replicas (replicated tensor sharding): each replica's entry holds one shard
    of the flattened value, zero padded to a multiple of the number of shards, so the
    buffer's tensor shape is (ceil(nelms / shards),) and its ``meta_shape`` the variable's
    shape (see :func:`replica_sharded_buffer`). ``ops.remote_load`` gives this replica's
    shard; ``ops.collectives.replicated_all_gather`` of it the full value.
    ``Session.get_tensor_data`` returns the full value (padding removed).

    Raises:
        ValueError: If replication is not enabled; if the buffer's meta shape is another
            shape; if its tensor shape or dtype does not fit a shard of the variable; if
            ``offset`` is out of range or the entry already holds a variable.
    """
    g = _main_graph("Remote variables")
    _replication("replica sharded variable")
    _check_retrieval_mode(retrieval_mode)
    off = _check_remote_args(remote_buffer, offset)
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    grouping = replica_grouping or g.ir.replica_grouping()
    per = _per_group(arr, grouping.num_groups, name)
    if remote_buffer.meta_shape not in ((), per.shape):
        raise ValueError(f"Cannot use RemoteBuffer[id={remote_buffer.remote_buffer_id}] for replica "
                         f"sharded variable of shape {per.shape}. The buffer's meta_shape has "
                         f"already been set to: {remote_buffer.meta_shape}.")
    k = _shard_over_for(remote_buffer, grouping, per.size)
    layout = ReplicaShards(per.shape, k, grouping.assignment, grouping.const_rg.assignment)
    if remote_buffer.tensor_dtype != _dtype.as_dtype(per.dtype):
        remote_buffer.validate_tensor_matches_buffer(
            _Described(name or "v", remote_buffer.tensor_shape, per.dtype))
    remote_buffer.meta_shape = per.shape
    remote_buffer._shard_over = k
    return _remote_variable(arr, per, remote_buffer, off, name, replica_grouping, retrieval_mode, layout)


def replica_sharded_buffer(shape: Iterable[int], dtype: Any, replica_grouping: Optional["ReplicaGrouping"] = None,
                           shard_over: Optional[int] = None, entries: int = 1) -> Any:
    """A remote buffer for replica-sharded variables of ``shape`` (with a leading group
    dimension when ``replica_grouping`` has several groups): its tensor shape is the
    flattened shard (ceil(nelms / shard_over),) and its ``meta_shape`` the variable's shape.

    ``shard_over``: how many replicas of each replica group one value is sharded over
    (default all of the group); with groups of 4 and ``shard_over`` 2 the members 0, 1 hold
    one copy and the members 2, 3 another.

    Raises:
        ValueError: If ``shard_over`` exceeds the replica group size or does not divide it.
    """
    from .remote_buffer import remote_buffer
    g = context.get_current_graph()
    grouping = (replica_grouping or g.ir.replica_grouping()).const_rg
    size = grouping.group_size
    shard_over = size if shard_over is None else int(shard_over)
    if shard_over > size:
        raise ValueError(f"The sharding group size ({shard_over}) must be less than or equal to "
                         f"the replica group size ({size}). Note that if no replica grouping was "
                         f"passed, the replica group size defaults to the IR's global replication "
                         f"factor; and if no sharding group size was passed, it defaults to the "
                         f"replica group size.")
    if shard_over < 1 or size % shard_over:
        raise ValueError(f"The replica group size ({size}) must be divisible by the sharding group "
                         f"size ({shard_over}). Note that if no replica grouping was passed, the "
                         f"replica group size defaults to the IR's global replication factor; and "
                         f"if no sharding group size was passed, it defaults to the replica group "
                         f"size.")
    shape = tuple(int(d) for d in shape)
    outer = 1 if replica_grouping is not None and replica_grouping.num_groups > 1 else 0
    tensor_shape = shape[outer:]
    nelms = int(np.prod(tensor_shape, dtype=np.int64))
    buffer = remote_buffer((shard_size(nelms, shard_over),), dtype, entries)
    buffer.meta_shape = tensor_shape
    buffer._shard_over = shard_over
    return buffer


def replica_sharded_variable(data: Any, dtype: Any = None, name: Optional[str] = None,
                             downcast: bool = True, replica_grouping: Optional["ReplicaGrouping"] = None,
                             shard_over: Optional[int] = None,
                             retrieval_mode: Optional[str] = "one_per_group",
                             log2_scale: Optional[int] = None,
                             nan_on_overflow: Optional[bool] = None) -> tuple[Variable, Tensor]:
    """Scatter a variable in equal shards across the replicas (replicated tensor sharding):
    each replica holds only its shard, ceil(nelms / shard_over) elements of the flattened,
    zero-padded value (see :func:`replica_sharded_buffer` for ``shard_over``).

    Returns ``(var, shard)``: ``var`` is the full variable, used only with the session's
    ``get_tensor_data`` / ``write_variable_data`` (the gathered value, padding removed);
    ``shard`` is this replica's shard as a tensor of the main graph (meta shape the
    variable's shape), loaded when the weights go to the device and stored back after every
    run, so in-place updates of it persist. The session keeps only the shards:
    [replicas, shard size] split over the replicas' devices.
    """
    g = _main_graph("Replica sharded variables")
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    buffer = replica_sharded_buffer(arr.shape, dtype if dtype is not None else arr.dtype,
                                    replica_grouping, shard_over)
    var = remote_replica_sharded_variable(arr, buffer, 0, dtype, name, downcast, replica_grouping,
                                          retrieval_mode)
    import jax
    layout = var._sharding
    shard = g._add_tensor(g._new_id(f"{var.name}_rts"),
                          jax.ShapeDtypeStruct((layout.shard_size,), var.dtype.as_device_numpy()))
    shard._meta_shape = var.shape
    var._shard = shard
    return var, shard


def constant(data: Any, dtype: Any = None, name: Optional[str] = None, downcast: bool = True,
             log2_scale: Optional[int] = None, nan_on_overflow: Optional[bool] = None) -> Constant:
    """A constant of the current graph (``log2_scale`` / ``nan_on_overflow``: float8 data, as
    :func:`variable`)."""
    g = context.get_current_graph()
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    return g._add_constant(np.array(arr) if isinstance(arr, np.memmap) else arr, name or "t")


def graph_input(shape: Iterable[int], dtype: Any, name: Optional[str] = None, by_ref: bool = False,
                meta_shape: Any = None) -> Tensor:
    """Add an input to the current (sub)graph (``meta_shape``: the full shape of the tensor
    a replica shard belongs to, see :attr:`Tensor.meta_shape`)."""
    import jax
    g = context.get_current_graph()
    spec = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), _dtype.as_dtype(dtype).as_device_numpy())
    t = g._add_input(spec, name or "t", by_ref)
    t._meta_shape = tuple(int(d) for d in meta_shape or ())
    return t


def graph_output(t: Tensor) -> None:
    """Mark ``t`` as the next output of the current (sub)graph."""
    g = context.get_current_graph()
    if not isinstance(t, Tensor) or t._graph is not g:
        raise ValueError(f"graph_output: {t!r} is not a tensor of graph '{g.name}'")
    g._outputs.append(t)


context._UPPER.tensor = (Tensor,)   # (context imports no module above it)
