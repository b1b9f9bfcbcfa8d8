"""popxl.Graph: a popxl view of one IR Graph (src/popart/ir/graph.py).

Tensors are SSA values of the IR. An in-place op gives its tensor a new IR id (a new
version); the popxl Tensor object then names that version, so later ops read the new value.
A subgraph input passed by reference returns its last version as an extra output of the
call, and the caller's tensor moves to it. Host streams use the same mechanism: their
buffers and counters are hidden inputs of every graph that loads or stores them; so do remote
buffers (``ops.remote_load`` / ``remote_store``). A remote variable has no value in the
graph: ops read it through remote loads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional, Sequence

import jax
import numpy as np
from popart.engine import in_x64

from popart.engine.lower import trace_node
from popart.engine.compiled import REPLICA_AXIS
from popart.engine.graph_api import Graph as IRGraph, Node, reads

from . import _pb, context
from .tensor import Constant, Tensor, Variable

if TYPE_CHECKING:
    from .ir import Ir

# Opsets every popxl graph imports: the op versions popxl's ops are written against.
OPSETS = {"ai.onnx": 18, "ai.graphcore": 1, "ai.popxl": 1}


class Graph:
    """A graph of the IR: the main graph or a subgraph. ``with graph:`` adds ops to it."""

    def __init__(self, ir: "Ir", name: str, parent: Optional["Graph"] = None) -> None:
        self._ir = ir
        self._g = IRGraph(name=name, opsets=dict(OPSETS), parent=None if parent is None else parent._g)
        self._specs: dict[str, jax.ShapeDtypeStruct] = {}
        self._tensors: dict[str, Tensor] = {}
        self._inputs: list[Tensor] = []
        self._outputs: list[Tensor] = []
        self._by_ref_inputs: list[Tensor] = []
        self._hidden: dict[Hashable, Tensor] = {}      # key -> hidden input (or main-graph state)
        self._hidden_by_ref: set[Hashable] = set()
        self._entry: dict[Tensor, str] = {}            # input tensor -> its IR input id
        self._versions: dict[str, str] = {}            # in-place result -> its tensor's first id
        self._stream_inputs: list = []                 # main graph: (kind, stream, buffer tensor)

    # ------------------------------------------------------------------ properties
    @property
    def ir(self) -> "Ir":
        return self._ir

    @property
    def name(self) -> str:
        return self._g.name

    @property
    def id(self) -> str:
        return self._g.name

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def inputs_by_name(self) -> dict[str, Tensor]:
        """The graph inputs by name."""
        return {t.name: t for t in self._inputs}

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(self._outputs)

    @property
    def main_graph(self) -> "Graph":
        return self._ir.main_graph

    @property
    def called_graphs(self) -> tuple["Graph", ...]:
        """The graphs that ops of this graph call (call, repeat, conditional branches)."""
        return tuple(_pb.called_graphs(self._ir, self._g.nodes))

    @property
    def _pb_graph(self) -> _pb.Graph:
        """PopART's binding view of this graph (``popart._internal.ir.Graph``), live."""
        return _pb.Graph(self)

    @classmethod
    def _from_pb(cls, pb_graph: _pb.Graph) -> "Graph":
        """The popxl graph of a binding graph handle."""
        return pb_graph._graph

    def register_op_created_hook(self, fn: Callable[[Node], Any]) -> int:
        """Call ``fn(op)`` after each op is created in this graph (``op``: a
        ``popart._internal.ir.Op``, which also has the IR node's ``op_type``, ``domain``,
        ``inputs``, ``outputs``, ``attrs``); returns a handle for
        :meth:`remove_op_created_hook`."""
        return context.register_op_created_hook(self, fn)

    def remove_op_created_hook(self, handle: int) -> None:
        context.remove_op_created_hook(handle)

    @property
    def variables(self) -> tuple[Variable, ...]:
        return tuple(t for t in self._tensors.values() if isinstance(t, Variable))

    @property
    def constants(self) -> tuple[Constant, ...]:
        return tuple(t for t in self._tensors.values() if isinstance(t, Constant))

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self._tensors.values())

    def get_tensor(self, tensor_id: str) -> Tensor:
        return self._tensors[tensor_id]

    def __contains__(self, t: Any) -> bool:
        return isinstance(t, Tensor) and t._graph is self

    def __call__(self) -> "Graph":
        """``ir.main_graph()`` (popart.ir's spelling) returns the graph itself."""
        return self

    def __enter__(self) -> "Graph":
        context.get_current_context().push_graph(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        context.get_current_context().pop_graph()

    def __repr__(self) -> str:
        return f"Graph[id={self.id} inputs={[t.id for t in self._inputs]} " \
               f"outputs={[t.id for t in self._outputs]}]"

    @property
    def _is_main(self) -> bool:
        return self is self._ir._main

    # ------------------------------------------------------------------ tensors
    def _create_tensor_id(self, name: Optional[str] = None) -> str:
        """A new tensor id (PopXL's rule): ``name`` (default "t") after the name scopes and the
        graph's scope (a subgraph's id; none for the main graph), made unique in the graph by
        the Ir's ``__t<n>`` suffix."""
        name = "/".join((*context.get_current_context().name_scopes, name or "t"))
        base = name if self._is_main else f"{self.id}/{name}"
        tid = base
        while tid in self._specs:
            tid = f"{base}__t{next(self._ir._intermediate_ids)}"
        return tid

    _new_id = _create_tensor_id

    def _add_tensor(self, tid: str, spec: jax.ShapeDtypeStruct, cls: type = Tensor,
                    **kw: Any) -> Tensor:
        self._specs[tid] = jax.ShapeDtypeStruct(tuple(spec.shape), np.dtype(spec.dtype))
        t = cls(self, tid, **kw)
        t._placement = context.placement()
        self._tensors[tid] = t
        return t

    def _add_constant(self, data: np.ndarray, name: str, cls: type = Constant, **kw: Any) -> Tensor:
        tid = self._new_id(name)
        self._g.initializers[tid] = data
        if cls is Constant:
            self._g.constants.add(tid)
        return self._add_tensor(tid, jax.ShapeDtypeStruct(data.shape, data.dtype), cls, **kw)

    def _add_input(self, spec: jax.ShapeDtypeStruct, name: str, by_ref: bool = False,
                   hidden: Optional[Hashable] = None) -> Tensor:
        if self._is_main and hidden is None:
            raise ValueError("The main graph has no graph inputs: use popxl.h2d_stream and "
                             "ops.host_load to feed it")
        t = self._add_tensor(self._new_id(name), spec)
        self._entry[t] = t._ir_id
        if hidden is None:
            self._inputs.append(t)
            if by_ref:
                self._by_ref_inputs.append(t)
        else:
            self._hidden[hidden] = t
            if by_ref:
                self._hidden_by_ref.add(hidden)
        return t

    def _state(self, key: Hashable, make: Callable[["Graph"], Tensor], by_ref: bool) -> Tensor:
        """The tensor of hidden state ``key`` in this graph: created by ``make`` in the main
        graph, a hidden input of subgraphs (by reference when the state changes)."""
        if key not in self._hidden:
            if self._is_main:
                self._hidden[key] = make(self)
            else:
                spec = self._ir._main._state(key, make, by_ref)._spec
                parts = key if isinstance(key, tuple) else (key,)
                name = getattr(parts[-1], "_state_name", None) or \
                    "_".join(str(getattr(k, "name", k)) for k in parts)
                self._add_input(spec, name, by_ref, hidden=key)
        if by_ref and not self._is_main:
            self._hidden_by_ref.add(key)
        return self._hidden[key]

    # ------------------------------------------------------------------ IR
    def _all_inputs(self) -> list[Tensor]:
        return list(self._inputs) + list(self._hidden.values())

    def _by_ref_list(self) -> list[Tensor]:
        """Inputs whose last version the graph returns after its outputs, in input order."""
        refs = set(self._by_ref_inputs) | {self._hidden[k] for k in self._hidden_by_ref}
        return [t for t in self._all_inputs() if t in refs]

    def _finalize(self, lowering: bool = False) -> IRGraph:
        """Bring the IR graph's inputs / outputs up to date (the main graph's: every
        subgraph's, which binding handles may have changed after it was called); returns the
        IR graph. ``lowering`` (a session is built from it): raise PopART's lowering errors
        for ops that a pattern must replace first."""
        if self._is_main:
            if lowering:
                from .transforms.patterns import check_lowerable
                check_lowerable(self)
            for g in self._ir._graphs[1:]:
                g._finalize()
        else:
            self._g.inputs = [self._entry[t] for t in self._all_inputs()]
            self._g.outputs = [t._ir_id for t in self._outputs] + \
                              [t._ir_id for t in self._by_ref_list()]
        return self._g

    @in_x64
    def _infer(self, node: Node) -> list[Optional[jax.ShapeDtypeStruct]]:
        """Output shapes / dtypes of ``node`` by tracing its lowering abstractly."""
        static, specs = {}, {}
        for i in reads(node):
            if i in self._g.constants:
                static[i] = self._g.initializers[i]
            else:
                specs[i] = self._specs[i]
        r = self._ir.replication_factor

        def run(env: dict) -> list:
            return trace_node(node, self._g, {**static, **env},
                              replica_axis=REPLICA_AXIS if r > 1 else None, replication_factor=r)

        try:
            if r > 1:
                rspecs = {k: jax.ShapeDtypeStruct((r,) + tuple(s.shape), s.dtype) for k, s in specs.items()}
                out = jax.eval_shape(jax.vmap(run, axis_name=REPLICA_AXIS, axis_size=r), rspecs)
                out = [None if o is None else jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in out]
            else:
                out = jax.eval_shape(run, specs)
        except Exception as e:
            shapes = {i: (tuple(s.shape), str(s.dtype)) for i, s in specs.items()}
            raise type(e)(f"popxl: {node.describe()} with inputs {shapes}: {e}") from e
        return list(out)

    def _add_node(self, op_type: str, inputs: Iterable[Optional[Tensor]], attrs: Optional[dict] = None,
                  domain: str = "ai.onnx", num_outputs: int = 1, name: Optional[str] = None,
                  out_names: Optional[Sequence[str]] = None) -> list[Tensor]:
        """Append one IR node (named ``name``, default the op type in lower case); returns its
        output tensors (named ``out_names``, default the node's name; shapes from the lowering)."""
        inputs = list(inputs)
        ins = []
        for t in inputs:
            if t is None:
                ins.append("")
                continue
            if t._graph is not self:
                raise ValueError(f"Tensor '{t.id}' belongs to graph '{t._graph.name}', not to "
                                 f"graph '{self.name}' that is being built: pass it to the "
                                 f"subgraph as an input")
            remote = getattr(t, "_remote", None)
            if remote is not None:
                buf, off = remote
                hint = ("; its shard on each replica is the tensor that replica_sharded_variable "
                        "returned with it" if t._shard is not None else "")
                raise ValueError(f"Variable '{t.id}' is stored in RemoteBuffer[id="
                                 f"{buf.remote_buffer_id}] at offset {off}: ops cannot read it "
                                 f"directly, load it with ops.remote_load(buffer, {off}){hint}")
            ins.append(t._ir_id)
        base = name or op_type.lower()
        outs = []
        for i in range(num_outputs):
            outs.append(self._new_id(out_names[i] if out_names else base))
            self._specs[outs[-1]] = None  # reserve the id
        ctx = context.get_current_context()
        node = Node(op_type, ins, outs, dict(attrs or {}), domain,
                    name="/".join((*ctx.name_scopes, base)), annotations=context.current_annotations())
        try:
            specs = self._infer(node)
        except Exception:
            for o in outs:
                del self._specs[o]
            raise
        self._g.nodes.append(node)
        result = []
        for o, s in zip(outs, specs):
            if s is None:
                del self._specs[o]
                continue
            result.append(self._add_tensor(o, s))
        # PopXL's debug record of the op (layer "popxl"; see popxl.context.op_debug_context)
        node._debug_info = context._op_debug_info(base, inputs, context._user_location())
        context._set_outputs(node._debug_info, result)
        _pb.op_created(self, node)
        return result


class RepeatBody(Graph):
    """PopXL's *middle graph* of ``ops.repeat`` (the body of its Loop): inputs (iteration,
    condition, the carried values, the repeated graph's hidden state), one Call of the
    repeated graph, outputs (condition, each carried value after the iteration: the call's
    output, or the input's last version). Its outputs are its IR outputs, as ONNX's Loop
    body needs: one per carried input, then the Loop's scan outputs (``scan_outputs``: ids
    whose value at every iteration the Loop stacks, for autodiff)."""

    def __init__(self, ir: "Ir", name: str, parent: Optional[Graph] = None) -> None:
        super().__init__(ir, name, parent)
        self.scan_outputs: list[str] = []

    def _finalize(self, lowering: bool = False) -> IRGraph:
        self._g.inputs = [self._entry[t] for t in self._all_inputs()]
        self._g.outputs = [t._ir_id for t in (*self._outputs, *self._hidden.values())] + \
            self.scan_outputs
        return self._g

