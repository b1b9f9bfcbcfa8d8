"""popxl tensors: Tensor (intermediates), Variable, Constant, TensorSpec, TensorByRef, and the
functions that make them (variable, constant, graph_input, graph_output)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import numpy as np

from . import context
from .dtypes import dtype as _dtype
from .errors import UndefinedValue

if TYPE_CHECKING:
    from .graph import Graph
    from .replica_grouping import ReplicaGrouping

TensorLike = Union["Tensor", float, int, bool, np.ndarray, list]


class TensorSpec:
    """Shape and dtype of a tensor (used to declare graph inputs)."""

    def __init__(self, shape: Iterable[int], dtype: Any, meta_shape: Iterable[int] = ()) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = _dtype.as_dtype(dtype)
        self.meta_shape = tuple(meta_shape)

    def to_tuple(self) -> tuple:
        return self.shape, self.dtype, self.meta_shape

    def __iter__(self):
        return iter(self.to_tuple())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorSpec) and self.to_tuple() == other.to_tuple()

    def __hash__(self) -> int:
        return hash(self.to_tuple())

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype})"


class TensorLocationInfo:
    """Where a tensor lives: on the device (``remote`` False) and whole on every replica
    (``sharded`` False). Tensors of this Ir are never remote or sharded."""

    def __init__(self, remote: bool = False, sharded: bool = False) -> None:
        self.remote, self.sharded = remote, sharded

    def isRemote(self) -> bool:
        return self.remote

    def isSharded(self) -> bool:
        return self.sharded

    def __repr__(self) -> str:
        return f"TensorLocationInfo(remote={self.remote}, sharded={self.sharded})"


class Tensor:
    """A tensor of a graph. Operators build ops in the current graph (``a + b``, ``a @ b``)."""

    def __init__(self, graph: "Graph", tid: str) -> None:
        self._graph, self._id, self._ir_id = graph, tid, tid
        self._placement: tuple = (None, "compute")   # (IPU, tile set) when it was created

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> str:
        return self._id

    @property
    def name(self) -> str:
        return self._id.rsplit("/", 1)[-1]

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
        return TensorSpec(self.shape, self.dtype)

    @property
    def meta_shape(self) -> tuple:
        return ()

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
        out, step = [], self.dtype.as_numpy().itemsize
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
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        raise TypeError("A popxl Tensor has no truth value while the graph is being built; "
                        "use ops.conditional for data-dependent control flow")

    __hash__ = object.__hash__  # tensors are dictionary keys (inputs_dict, session data)

    def _ensure_tensor(self, value: TensorLike, dtype: Optional[_dtype] = None) -> "Tensor":
        """``value`` as a tensor of the current graph (literals become constants of this
        tensor's dtype)."""
        if isinstance(value, Tensor):
            return value
        return constant(value, dtype or self.dtype)

    # ------------------------------------------------------------------ methods
    def transpose(self, permutation: Optional[Iterable[int]] = None) -> "Tensor":
        from . import ops
        return ops.transpose(self, permutation)

    def transpose_(self, permutation: Optional[Iterable[int]] = None) -> "Tensor":
        from . import ops
        return ops.transpose_(self, permutation)

    def reshape(self, shape: Iterable[int]) -> "Tensor":
        from . import ops
        return ops.reshape(self, shape)

    def reshape_(self, shape: Iterable[int]) -> "Tensor":
        from . import ops
        return ops.reshape_(self, shape)

    def flatten(self) -> "Tensor":
        from . import ops
        return ops.flatten(self)

    def flatten_(self) -> "Tensor":
        from . import ops
        return ops.flatten_(self)

    def detach(self) -> "Tensor":
        from . import ops
        return ops.detach(self)

    def detach_(self) -> "Tensor":
        from . import ops
        return ops.detach_(self)

    def copy_to_ipu(self, destination: int, source: Optional[int] = None) -> "Tensor":
        from . import ops
        return ops.ipu_copy(self, destination, source)

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
        from . import ops
        return ops._getitem(self, key)

    # ------------------------------------------------------------------ operators
    def _bin(self, op: str, other: TensorLike, reverse: bool = False) -> "Tensor":
        from . import ops
        o = self._ensure_tensor(other)
        a, b = (o, self) if reverse else (self, o)
        return getattr(ops, op)(a, b)

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __mod__(self, o): return self._bin("fmod", o)
    def __pow__(self, o): return self._bin("pow", o)
    def __rpow__(self, o): return self._bin("pow", o, True)
    def __matmul__(self, o): return self._bin("matmul", o)
    def __rmatmul__(self, o): return self._bin("matmul", o, True)
    def __gt__(self, o): return self._bin("greater", o)
    def __lt__(self, o): return self._bin("less", o)
    def __ge__(self, o): return self._bin("greater_equal", o)
    def __le__(self, o): return self._bin("less_equal", o)
    def __and__(self, o): return self._bin("logical_and", o)
    def __or__(self, o): return self._bin("logical_or", o)
    def __iadd__(self, o):
        from . import ops
        return ops.add_(self, self._ensure_tensor(o))

    def __neg__(self) -> "Tensor":
        from . import ops
        return ops.negate(self)

    def __abs__(self) -> "Tensor":
        from . import ops
        return ops.abs(self)

    def __invert__(self) -> "Tensor":
        from . import ops
        return ops.logical_not(self)


class Variable(Tensor):
    """A tensor of the main graph whose value lives on the device between runs."""

    def __init__(self, graph: "Graph", tid: str, replica_grouping: Any = None,
                 retrieval_mode: str = "one_per_group") -> None:
        super().__init__(graph, tid)
        self.replica_grouping = replica_grouping
        self.retrieval_mode = retrieval_mode

    @property
    def shape_on_host(self) -> tuple[int, ...]:
        g = self.replica_grouping
        return self.shape if g is None or g.num_groups == 1 else (g.num_groups,) + self.shape

    @property
    def shape_on_replica(self) -> tuple[int, ...]:
        return self.shape

    def copy_to_ipu(self, dst: int, src: int) -> Tensor:  # type: ignore[override]
        """``ops.ipu_copy(self, dst, src)``: a variable has no producer, so ``src`` is needed."""
        from . import ops
        return ops.ipu_copy(self, dst, src)


class Constant(Tensor):
    """A tensor whose value is fixed when the graph is built."""

    def copy_to_ipu(self, dst: int, src: int) -> Tensor:  # type: ignore[override]
        """``ops.ipu_copy(self, dst, src)``: a constant has no producer, so ``src`` is needed."""
        from . import ops
        return ops.ipu_copy(self, dst, src)


class TensorByRef(Tensor):
    """Type hint for ``create_graph``: the argument is passed to the graph by reference, so
    in-place changes inside the graph change the caller's tensor."""


def _resolve_data(data: Any, dtype: Any, downcast: bool, log2_scale: Optional[int] = None,
                  nan_on_overflow: Optional[bool] = None) -> np.ndarray:
    if isinstance(data, Tensor):
        raise TypeError("A popxl Tensor cannot be used as the data of a variable or constant")
    from .utils import to_numpy
    return to_numpy(data, None if dtype is None else _dtype.as_dtype(dtype), downcast,
                    log2_scale=log2_scale, nan_on_overflow=nan_on_overflow)


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
    g = context.get_current_graph()
    if not g._is_main:
        raise ValueError(f"Variables can only be created in the main graph, not in '{g.name}': "
                         f"create it in the main graph and pass it as a graph input")
    if retrieval_mode not in (None, "one_per_group", "all_replicas"):
        raise ValueError(f"Invalid retrieval_mode {retrieval_mode!r}: expected 'one_per_group' "
                         f"or 'all_replicas'")
    arr = _resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow)
    ir = g.ir
    groups = 1 if replica_grouping is None else replica_grouping.num_groups
    if groups > 1:
        if arr.shape[:1] != (groups,):
            raise ValueError(f"Variable '{name}': with {groups} replica groups the data needs a "
                             f"leading dimension of {groups}, got shape {arr.shape}")
        per = arr[0]
    else:
        per = arr
    t = g._add_constant(np.array(per), name or "v", cls=Variable,
                        replica_grouping=replica_grouping or ir.replica_grouping(),
                        retrieval_mode=retrieval_mode or "one_per_group")
    ir._variables.append(t)
    ir._variable_data[t] = np.array(arr)
    return t


def constant(data: Any, dtype: Any = None, name: Optional[str] = None, downcast: bool = True,
             log2_scale: Optional[int] = None, nan_on_overflow: Optional[bool] = None) -> Constant:
    """A constant of the current graph (``log2_scale`` / ``nan_on_overflow``: float8 data, as
    :func:`variable`)."""
    g = context.get_current_graph()
    return g._add_constant(_resolve_data(data, dtype, downcast, log2_scale, nan_on_overflow),
                           name or "c")


def graph_input(shape: Iterable[int], dtype: Any, name: Optional[str] = None, by_ref: bool = False,
                meta_shape: Any = None) -> Tensor:
    """Add an input to the current (sub)graph."""
    import jax
    g = context.get_current_graph()
    spec = jax.ShapeDtypeStruct(tuple(int(d) for d in shape), _dtype.as_dtype(dtype).as_numpy())
    return g._add_input(spec, name or "input", by_ref)


def graph_output(t: Tensor) -> None:
    """Mark ``t`` as the next output of the current (sub)graph."""
    g = context.get_current_graph()
    if not isinstance(t, Tensor) or t._graph is not g:
        raise ValueError(f"graph_output: {t!r} is not a tensor of graph '{g.name}'")
    g._outputs.append(t)
