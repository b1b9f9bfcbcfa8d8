"""Subgraph calls (call, repeat, conditional) and host transfers (host_load, host_store).

A call is an ai.graphcore Call node; repeat is an ai.onnx Loop (static trip count) whose body
calls the graph; conditional is an ai.onnx If whose branches call the graphs. Inputs passed by
reference (and the hidden stream state of graphs that use host streams) come back as extra
outputs, and the caller's tensors move to them."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np

from popart.engine.graph_api import Graph as IRGraph, Node
from popart.engine.lower import info_text
from popart.errors import IrError
from popart.tensorinfo import to_datatype

from ..context import get_current_graph
from ..graph import OPSETS, Graph, RepeatBody
from ..streams import DeviceToHostStream, HostToDeviceStream
from ..tensor import Tensor, constant
from ..utils import table_to_string
from ._base import GC, ONNX, POPXL, inplace, node


class _SubgraphOp:
    """The op a :class:`CallSiteInfo` describes: the called graph, the calling graph, the
    IR node and where the called graph's outputs start among the node's outputs. Outputs
    are read from the node, so outputs that ``transforms.autodiff`` adds to the called graph
    later appear at existing call sites too."""

    def __init__(self, graph: Graph, parent: Graph, node_: Node, inputs: list[Tensor],
                 first_output: int = 0) -> None:
        self.graph, self.parent, self.node = graph, parent, node_
        self.inputs, self.first_output = list(inputs), first_output

    def outputs(self) -> list[Tensor]:
        ids = self.node.outputs[self.first_output:self.first_output + len(self.graph._outputs)]
        return [self.parent._tensors[i] for i in ids]

    def __getattr__(self, name: str) -> Any:
        """PopART's binding methods of the op (``popart._internal.ir.CallOp`` / ``LoopOp``),
        which PopXL's ``CallSiteInfo._op`` is and popxl-addons uses."""
        from .._pb import op_handle
        return getattr(op_handle(self.parent, self.node), name)


class CallSiteInfo:
    """A call site: the called graph, the parent tensors passed in and the outputs."""

    def __init__(self, subgraph_op: _SubgraphOp) -> None:
        self._op = subgraph_op

    @property
    def called_graph(self) -> Graph:
        return self._op.graph

    @property
    def _graph(self) -> Graph:
        return self._op.graph

    @property
    def _inputs(self) -> list[Tensor]:
        return self._op.inputs

    @property
    def _outputs(self) -> list[Tensor]:
        return self._op.outputs()

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(self._outputs)

    def parent_input(self, idx: int) -> Tensor:
        return self._inputs[idx]

    def parent_output(self, idx: int) -> Tensor:
        return self._outputs[idx]

    def graph_to_parent_input_index(self, idx: int) -> int:
        """The op's input index of the called graph's input ``idx`` (a repeat's is 2 more:
        its trip count and condition come first)."""
        return self._op.subgraphInToOpInIndex(idx)

    def parent_to_graph_input_index(self, idx: int) -> int:
        """The called graph's input index of the op's input ``idx``."""
        return self._op.opInToSubgraphInIndex(idx)

    def graph_to_parent_output_index(self, idx: int) -> int:
        return idx   # the same for calls and repeats (PopART's CallOp / LoopOp)

    def parent_to_graph_output_index(self, idx: int) -> int:
        return idx

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        """The parent tensor connected to an input or output of the called graph."""
        g = self._graph
        if graph_tensor in g._inputs:
            return self._inputs[g._inputs.index(graph_tensor)]
        if graph_tensor in g._outputs:
            return self._outputs[g._outputs.index(graph_tensor)]
        raise ValueError(f"Tensor {graph_tensor.id} is not an input or output of the called graph(s).")

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        for i, t in enumerate(self._inputs):
            if t is parent_tensor:
                return self._graph._inputs[i]
        raise ValueError(f"Tensor {parent_tensor.id} is not a parent graph input of the call site.")

    def set_parent_input_modified(self, parent_tensor: Tensor, infer_modified_regions: bool = False) -> None:
        """This call modifies its input ``parent_tensor`` (PopXL's): the called graph's in-place
        changes to that input reach ``parent_tensor``, as if the graph took it by reference,
        at this call only. ``infer_modified_regions``: only where ops of the called graph
        modify the input (none: nothing changes); else the whole tensor."""
        from .._pb import Region
        index = self._op.inIndex(parent_tensor._pb_tensor)
        graph = self._op.getCalledGraph()
        sg_tensor = graph.getInputTensor(self.parent_to_graph_input_index(index))
        regions = (sg_tensor.modifiedRegionsByOps(graph.getOps()) if infer_modified_regions
                   else [Region.getFull(parent_tensor.shape)])
        self._op.addModified(index, regions)


def _prep_inputs(parent: Graph, graph: Graph, inputs: Sequence[Any],
                 inputs_dict: Optional[Mapping[Tensor, Any]], check: bool = True,
                 graph_name: str = "called") -> list[Tensor]:
    """The caller's tensors for ``graph``'s inputs, in input order: ``inputs`` (lists and
    tuples among them flattened), then ``inputs_dict``; other values become constants of
    the graph input's dtype. PopXL's checks and texts (``check``: missing inputs, as
    ``check_inputs``); an input of another type or shape fails as PopART's CallOp::setup.

    Raises:
        ValueError: too many or (``check``) too few inputs, a tensor of another graph, an
            input given twice.
        TypeError: a value that cannot be coerced into a tensor.
        popart.popart_exception: an input of another type or shape than the graph input.
    """
    flat = [y for x in inputs for y in (x if isinstance(x, (list, tuple)) else (x,))]
    gin = graph._inputs
    if len(flat) > len(gin):
        raise ValueError(f"Too many inputs have been provided to the {graph_name} graph. The number "
                         f"of positional inputs exceeds the number of inputs of the graph. "
                         f"{len(flat)} > {len(gin)}. For graph: {graph}")
    for pt in flat:
        if isinstance(pt, Tensor) and pt._graph is not parent:
            raise ValueError(f'Parent input tensor "{pt}" is not in parent graph "{parent}".')
    given = {i: (pt, f'Input at position "{i}"') for i, pt in enumerate(flat)}
    for gt, pt in (inputs_dict or {}).items():
        i = next((k for k, g in enumerate(gin) if g is gt), None)
        if i is None:
            raise ValueError(f'The graph input tensor "{gt}" is not in the {graph_name} graph ({graph}).')
        if isinstance(pt, Tensor) and pt._graph is not parent:
            raise ValueError(f'The parent input tensor "{pt}" is not in the parent graph ({parent}).')
        if i < len(flat):
            raise ValueError(f"Graph input tensor is specified twice for the {graph_name} graph, in "
                             f"`inputs_dict` and positionally in `inputs`: {gt}")
        given[i] = (pt, f'Input "{gt}"')
    out = {}
    for i, (pt, what) in given.items():
        if not isinstance(pt, Tensor):
            try:
                pt = constant(pt, gin[i].dtype)
            except ValueError:
                raise TypeError(f"{what} could not be coerced into a tensor for the {graph_name} "
                                f"graph: Type {type(pt)}. Value: {pt}") from None
        out[i] = pt
    if check and len(out) < len(gin):
        missing = [("Index", "Graph Tensor")] + [(i, t.id) for i, t in enumerate(gin) if i not in out]
        connected = [("Index", "Graph Tensor", "Parent Graph Tensor")] + \
            [(i, gin[i].id, out[i].id) for i in sorted(out)]
        raise ValueError(f"Not enough inputs have been provided for the {graph_name} graph ({graph})."
                         f"\n\nMissing inputs:\n{table_to_string(missing)}\n\nConnected inputs:\n"
                         f"{table_to_string(connected)}")
    for i, gt in enumerate(gin):
        pt = out.get(i)
        if pt is None:
            raise ValueError(f"No input was given for input {i} ('{gt.id}') of graph '{graph.name}'")
        if pt.shape != gt.shape or pt.dtype != gt.dtype:   # PopART's CallOp::setup
            raise IrError(f"CallOp input (@{i}) does not match callee input tensor (@{i}):\n"
                          f"   {pt.id} -> {gt.id}\n   {_info(pt)} vs {_info(gt)}")
    return [out[i] for i in range(len(gin))]


def _info(t: Tensor) -> str:
    """PopART's TensorInfo text of ``t``."""
    return info_text(to_datatype(t.dtype.as_device_numpy()).name, t.shape)


def _hidden_inputs(parent: Graph, graph: Graph) -> list[Tensor]:
    """The caller's tensors for the callee's hidden state (stream buffers and counters)."""
    return [parent._state(k, _maker(k), k in graph._hidden_by_ref) for k in graph._hidden]


def _moves(graph: Graph, t: Tensor) -> bool:
    """Whether a new call of ``graph`` moves the caller's tensor for by-reference input ``t``:
    not for an input the graph returns only because another call was marked as modifying it
    (``CallSiteInfo.set_parent_input_modified``: that call's own)."""
    return not any(t is m for m in getattr(graph, "_modified_by_calls", ()))


def _connect_by_ref(graph: Graph, all_in: list[Tensor], extra: list[Tensor]) -> None:
    """Move the caller's by-reference tensors to their values after the call."""
    refs = graph._by_ref_list()
    pos = {id(t): i for i, t in enumerate(graph._all_inputs())}
    for t, new in zip(refs, extra):
        if _moves(graph, t):
            inplace(all_in[pos[id(t)]], new)


def call_with_info(graph: Graph, *inputs: Any, inputs_dict: Optional[Mapping[Tensor, Any]] = None,
                   check_inputs: bool = True) -> CallSiteInfo:
    """Call ``graph`` (ai.graphcore Call) and return the call site's information."""
    parent = get_current_graph()
    user_in = _prep_inputs(parent, graph, inputs, inputs_dict, check_inputs)
    all_in = user_in + _hidden_inputs(parent, graph)
    ir_graph = graph._finalize()
    n_out = len(graph._outputs)
    outs = node("Call", all_in, {"callee": ir_graph}, GC, len(ir_graph.outputs),
                name=f"call_{graph.name}")
    for out, g_out in zip(outs, graph._outputs):   # CallOp::setup: the callee's TensorInfo,
        out._meta_shape = g_out._meta_shape        # its meta shape included
    _connect_by_ref(graph, all_in, outs[n_out:])
    return CallSiteInfo(_SubgraphOp(graph, parent, parent._g.nodes[-1], user_in))


def call(graph: Graph, *inputs: Any, inputs_dict: Optional[Mapping[Tensor, Any]] = None,
         check_inputs: bool = True) -> tuple[Tensor, ...]:
    """Call ``graph``; returns its outputs in the calling graph."""
    return call_with_info(graph, *inputs, inputs_dict=inputs_dict, check_inputs=check_inputs).outputs


class _RepeatOp(_SubgraphOp):
    """A repeat's op as its :class:`CallSiteInfo` sees it: the Loop as a call of the repeated
    graph (whose inputs come after the trip count and condition). The binding's LoopOp
    (``info._op.getCalledGraphs()``, ``addLoopInput``, ...) sees PopXL's middle graph."""

    def __init__(self, graph: Graph, parent: Graph, node_: Node, inputs: list[Tensor],
                 middle: RepeatBody) -> None:
        super().__init__(graph, parent, node_, inputs)
        self.middle = middle

    def opInToSubgraphInIndex(self, i: int) -> int:
        return int(i) - 2

    def subgraphInToOpInIndex(self, i: int) -> int:
        return int(i) + 2

    def getCalledGraph(self) -> Any:
        return self.graph._pb_graph

    def addModified(self, index: int, regions: Iterable[Any]) -> None:
        """The repeated graph changes input ``index`` in place, each iteration seeing the last
        one's value, and the caller's tensor moves to its value after the last."""
        from .._pb import op_handle
        op_handle(self.middle, self.middle._g.nodes[0]).addModified(int(index) - 2, regions)
        op_handle(self.parent, self.node).addModified(index, regions)


def repeat_with_info(graph: Graph, repeat_count: int, *inputs: Any,
                     inputs_dict: Optional[Mapping[Tensor, Any]] = None,
                     check_inputs: bool = True) -> CallSiteInfo:
    """Call ``graph`` ``repeat_count`` times; its N outputs feed its first N inputs. As PopXL,
    the Loop repeats a *middle graph* (:class:`popxl.graph.RepeatBody`) that calls ``graph``."""
    if repeat_count < 0:
        raise ValueError(f"Repeat count must be >= 0. Repeat count: {repeat_count}. Graph: {graph}")
    n_out = len(graph._outputs)
    if len(graph._inputs) < n_out:
        raise ValueError(f"To repeat the subgraph ({graph.id}) the number of inputs must be greater "
                         f"than or equal to the number of outputs. {len(graph._inputs)} < {n_out}")
    parent = get_current_graph()
    user_in = _prep_inputs(parent, graph, inputs, inputs_dict, check_inputs)
    for i in range(n_out):
        o, t = graph._outputs[i], graph._inputs[i]
        if (o.shape, o.dtype) != (t.shape, t.dtype):
            raise ValueError(f"Repeated graph '{graph.name}': output {i} ({o.dtype.name}{list(o.shape)}) "
                             f"must match input {i} ({t.dtype.name}{list(t.shape)}) it is carried into")
    ir = parent.ir
    mid = RepeatBody(ir, ir._create_name(f"{graph.name}__loop_wrapper"), parent=parent)
    ir._graphs.append(mid)
    cond = [mid._add_input(jax.ShapeDtypeStruct((), d), n)
            for d, n in ((np.int64, "Iterator___"), (np.bool_, "LoopCond___"))][1]
    carried = [mid._add_input(t._spec, t.name) for t in user_in]
    with mid:
        outs = call(graph, *carried, check_inputs=check_inputs)
    mid._outputs = [cond, *outs, *carried[n_out:]]
    mid._finalize()
    all_in = user_in + _hidden_inputs(parent, mid)
    trip = constant(np.array(repeat_count, np.int64), name="trip_count", downcast=False)
    keep_going = constant(np.array(True), name="cond")
    outs = node("Loop", [trip, keep_going] + all_in, {"body": mid._g}, ONNX, len(all_in),
                name=f"repeat_{graph.name}")
    for i, t in enumerate(mid._all_inputs()[2:]):
        if t._ir_id != mid._entry[t]:   # changed in place (by reference): the caller's moves
            inplace(all_in[i], outs[i])
    return CallSiteInfo(_RepeatOp(graph, parent, parent._g.nodes[-1], user_in, mid))


def repeat(graph: Graph, repeat_count: int, *inputs: Any,
           inputs_dict: Optional[Mapping[Tensor, Any]] = None) -> tuple[Tensor, ...]:
    """Call ``graph`` ``repeat_count`` times; returns the final loop-carried outputs."""
    return repeat_with_info(graph, repeat_count, *inputs, inputs_dict=inputs_dict).outputs


def _branch(parent: Graph, graph: Graph, ins: list[Tensor], tag: str) -> IRGraph:
    """An If branch (no inputs) that calls ``graph`` on the parent's tensors ``ins``."""
    if graph._hidden or graph._by_ref_inputs:
        raise NotImplementedError("conditional: branches that use host streams, remote buffers "
                                  "or by-reference inputs are not supported")
    ir_graph = graph._finalize()
    br = IRGraph(name=f"{graph.name}__{tag}", opsets=dict(OPSETS), parent=parent._g)
    br.outputs = [f"{br.name}/out{i}" for i in range(len(ir_graph.outputs))]
    br.nodes = [Node("Call", [t._ir_id for t in ins], list(br.outputs), {"callee": ir_graph}, GC)]
    return br


class ConditionalSiteInfo(CallSiteInfo):
    """A conditional's call site. The op's inputs are ``cond`` (index 0), the then-branch's
    inputs, then the else-branch's; both branches' outputs map to the op's outputs."""

    def __init__(self, then_branch: Graph, else_branch: Graph, cond: Tensor, then_inputs: list[Tensor],
                 else_inputs: list[Tensor], outputs: list[Tensor]) -> None:
        self._branches = (then_branch, else_branch)
        self._branch_inputs = (list(then_inputs), list(else_inputs))
        self._all_inputs = [cond] + list(then_inputs) + list(else_inputs)
        self._outs = list(outputs)

    @property
    def called_graph(self) -> tuple[Graph, Graph]:  # type: ignore[override]
        """The then and else graphs."""
        return self._branches

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(self._all_inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(self._outs)

    def parent_input(self, idx: int) -> Tensor:
        return self._all_inputs[idx]

    def parent_output(self, idx: int) -> Tensor:
        return self._outs[idx]

    def _first(self, then_branch: bool) -> int:
        return 1 if then_branch else 1 + len(self._branch_inputs[0])

    def graph_to_parent_input_index(self, idx: int, then_branch: bool = True) -> int:
        if not 0 <= idx < len(self._branch_inputs[0 if then_branch else 1]):
            raise IndexError("Invalid graph input index")
        return self._first(then_branch) + idx

    def is_parent_index_in_then_branch(self, idx: int) -> bool:
        """True when op input ``idx`` feeds the then-branch, False for the else-branch.

        Raises:
            IndexError: ``idx`` feeds neither (0 is the condition)."""
        n_then, n_else = (len(b) for b in self._branch_inputs)
        if 1 <= idx <= n_then:
            return True
        if n_then < idx <= n_then + n_else:
            return False
        raise IndexError("Invalid parent graph input index")

    def parent_to_graph_input_index(self, idx: int) -> int:
        return idx - self._first(self.is_parent_index_in_then_branch(idx))

    def graph_to_parent_output_index(self, idx: int, then_branch: bool = True) -> int:
        if not 0 <= idx < len(self._outs):
            raise IndexError("Invalid graph input index")
        return idx

    parent_to_graph_output_index = graph_to_parent_output_index

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        """The op's input or output connected to an input or output of either branch.

        Raises:
            ValueError: ``graph_tensor`` is neither."""
        for g, then in zip(self._branches, (True, False)):
            if graph_tensor in g._inputs:
                return self._all_inputs[self.graph_to_parent_input_index(g._inputs.index(graph_tensor), then)]
            if graph_tensor in g._outputs:
                return self._outs[g._outputs.index(graph_tensor)]
        raise ValueError(f"Tensor {graph_tensor.name} is not an input or output of the called graph(s).")

    def parent_to_graph(self, parent_tensor: Tensor) -> Tensor:
        """The branch input that the first use of ``parent_tensor`` as an op input feeds.

        Raises:
            ValueError: ``parent_tensor`` is not a branch input of this op."""
        for idx in range(1, len(self._all_inputs)):
            if self._all_inputs[idx] is parent_tensor:
                then = self.is_parent_index_in_then_branch(idx)
                return self._branches[0 if then else 1]._inputs[self.parent_to_graph_input_index(idx)]
        raise ValueError(f"Tensor {parent_tensor.name} is not a parent graph input of the call site.")

    def set_parent_input_modified(self, parent_tensor: Tensor, infer_modified_regions: bool = True) -> None:
        """Not implemented for the conditional op, as in PopXL.

        Raises:
            NotImplementedError: always."""
        raise NotImplementedError("Parent input modification is not yet implemented for the conditional op.")


def conditional_with_info(cond: Tensor, then_branch: Graph, else_branch: Graph,
                          then_inputs: Optional[Iterable[Any]] = None,
                          else_inputs: Optional[Iterable[Any]] = None,
                          then_inputs_dict: Optional[Mapping[Tensor, Any]] = None,
                          else_inputs_dict: Optional[Mapping[Tensor, Any]] = None,
                          check_inputs: bool = True) -> CallSiteInfo:
    """Run ``then_branch`` when ``cond`` is true, else ``else_branch`` (ai.onnx If); both must
    have outputs of the same shapes and dtypes. ``check_inputs``: the inputs must have the
    shapes and dtypes of the branches' graph inputs."""
    parent = get_current_graph()
    t_in = _prep_inputs(parent, then_branch, list(then_inputs or []), then_inputs_dict, check_inputs,
                        "then_branch")
    e_in = _prep_inputs(parent, else_branch, list(else_inputs or []), else_inputs_dict, check_inputs,
                        "else_branch")
    if [(o.shape, o.dtype) for o in then_branch._outputs] != [(o.shape, o.dtype) for o in else_branch._outputs]:
        raise ValueError("conditional: then_branch and else_branch outputs must have the same shapes and dtypes")
    attrs = {"then_branch": _branch(parent, then_branch, t_in, "then"),
             "else_branch": _branch(parent, else_branch, e_in, "else")}
    outs = node("If", [cond], attrs, ONNX, len(then_branch._outputs), name="conditional")
    return ConditionalSiteInfo(then_branch, else_branch, cond, t_in, e_in, outs)


def conditional(cond: Tensor, then_branch: Graph, else_branch: Graph, then_inputs: Any = None,
                else_inputs: Any = None, then_inputs_dict: Any = None, else_inputs_dict: Any = None,
                check_inputs: bool = True) -> tuple[Tensor, ...]:
    return conditional_with_info(cond, then_branch, else_branch, then_inputs, else_inputs,
                                 then_inputs_dict, else_inputs_dict, check_inputs).outputs


# ---------------------------------------------------------------------------------------
# Host streams. Main-graph state: an h2d buffer [transfers, *shape] is a graph input, a d2h
# buffer is a graph input the session fills with zeros; each has an int32 counter.

def _maker(key: tuple):
    """Creates the main-graph tensor of hidden state ``key`` = (kind, stream) or ("remote",
    RemoteBuffer)."""
    kind, stream = key
    if kind == "remote":
        from .remote import remote_state_maker
        return remote_state_maker(stream)
    if kind.endswith("#"):
        return lambda main: main._add_constant(np.array(0, np.int32), f"{stream.name}_counter")

    def make(main: Graph) -> Tensor:
        spec = jax.ShapeDtypeStruct((1,) + stream.shape, stream.dtype.as_device_numpy())
        t = main._add_tensor(main._new_id(stream.name), spec)
        main._stream_inputs.append((kind, stream, t))
        return t
    return make


def _stream_states(kind: str, stream: Any) -> tuple[Tensor, Tensor]:
    """The current graph's buffer and counter of ``stream`` (``kind`` "h2d" or "d2h"), the
    stream registered with the IR. A d2h buffer is written (by reference), an h2d one read."""
    g = get_current_graph()
    streams = g.ir._h2d if kind == "h2d" else g.ir._d2h
    if stream not in streams:
        streams.append(stream)
    buf = g._state((kind, stream), _maker((kind, stream)), kind == "d2h")
    count = g._state((kind + "#", stream), _maker((kind + "#", stream)), True)
    return buf, count


def host_load(h2d_stream: HostToDeviceStream, name: Optional[str] = None) -> Tensor:
    """The next element of a host-to-device stream."""
    if not isinstance(h2d_stream, HostToDeviceStream):
        raise TypeError(f"host_load expects a HostToDeviceStream, got {type(h2d_stream).__name__}")
    buf, count = _stream_states("h2d", h2d_stream)
    value, new_count = node("HostLoad", [buf, count], {}, POPXL, 2, name=name or h2d_stream.name)
    inplace(count, new_count)
    return value


def host_store(d2h_stream: DeviceToHostStream, t: Tensor) -> None:
    """Write ``t`` as the next element of a device-to-host stream."""
    if not isinstance(d2h_stream, DeviceToHostStream):
        raise TypeError(f"host_store expects a DeviceToHostStream, got {type(d2h_stream).__name__}")
    if tuple(t.shape) != d2h_stream.shape or t.dtype != d2h_stream.dtype:
        raise ValueError(f"host_store: tensor '{t.id}' is {t.dtype.name}{list(t.shape)} but stream "
                         f"'{d2h_stream.name}' is {d2h_stream.dtype.name}{list(d2h_stream.shape)}")
    buf, count = _stream_states("d2h", d2h_stream)
    new_buf, new_count = node("HostStore", [buf, count, t], {}, POPXL, 2, name=f"store_{d2h_stream.name}")
    inplace(buf, new_buf)
    inplace(count, new_count)
