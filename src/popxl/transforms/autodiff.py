"""popxl.transforms.autodiff: the gradient graph of a graph, as PopXL builds it.

Each forward op on a path from ``grads_required`` to ``grads_provided`` gets one grad op
(ai.popxl::OpVJP) in the gradient graph that reads the forward tensors PopART's grad op reads
(its ``gradInputInfo()``, table ``GRAD_READS``): forward inputs, forward outputs, or none.
Those forward tensors are inputs of the gradient graph; any that is not already an input or
output of the forward graph becomes a new output of it (and of every existing call of it),
so callers pass them on from the forward call (``GradGraphInfo.inputs_dict``); only for a
graph that repeat / conditional call are they recomputed in the gradient graph (PopART's
SafeAddFwdOutputStitcher). Calls, conditionals and repeats get their grad ops from the
called graphs' gradient graphs (see docs/popxl_autodiff.md). The numbers are our lowerings'
(with PopART's custom VJPs): the vjp of the op's lowering at its saved inputs, or PopART's
formula from what its grad op reads (``FROM_OUTPUT``, ``FROM_ARG_AND_OUTPUT``)."""
from __future__ import annotations

import contextlib
import enum
import dataclasses
from typing import Any, Iterable, Mapping, Optional

import jax
import numpy as np

from popart import custom_ops
from popart.errors import popart_exception
from popart.engine.graph_api import NO_GRAD_OPS, RECOMPUTE_OUTPUT, Graph as IRGraph, Node
from popart.ops.collectives import op_name
from popart.ops.popxl_grad import FROM_ARG_AND_OUTPUT, FROM_OUTPUT

from .. import _pb
from ..graph import Graph, RepeatBody
from ..ops._base import POPXL
from ..ops import dynamic_slice, reshape
from ..ops.call import CallSiteInfo, call, conditional, repeat
from ..tensor import Tensor, constant, graph_input, graph_output


class ExpectedConnectionType(enum.Enum):
    Fwd = "Fwd"            #: a tensor of the forward graph
    FwdGrad = "FwdGrad"    #: the gradient of a tensor of the forward graph


class ExpectedConnection:
    """One input or output of the gradient graph and the forward tensor it relates to."""

    def __init__(self, fwd_tensor: Tensor, connection_type: ExpectedConnectionType) -> None:
        self._fwd_tensor, self._type = fwd_tensor, connection_type

    @property
    def fwd_tensor(self) -> Tensor:
        return self._fwd_tensor

    @property
    def connection_type(self) -> ExpectedConnectionType:
        return self._type

    def __repr__(self) -> str:
        return f"({self._type}, {self._fwd_tensor})"

    @property
    def _pb_ec(self) -> _pb.ExpectedConnection:
        """PopART's binding record of the connection (``popart._internal.ir.ExpectedConnection``)."""
        return _pb.ExpectedConnection(self._fwd_tensor.id, self._type)

    @classmethod
    def _from_pb(cls, fwd_graph: _pb.Graph, pb_ec: _pb.ExpectedConnection) -> "ExpectedConnection":
        """The connection of a binding record, whose ``fwdId`` names a tensor of ``fwd_graph``."""
        g = fwd_graph._graph
        return cls(_pb.popxl_tensor(g, _pb.tensor_of(g, pb_ec.fwdId).id),
                   ExpectedConnectionType(pb_ec.type))


class GradGraphInfo:
    """The result of ``autodiff``: the gradient graph and how its inputs / outputs relate to
    the forward graph."""

    def __init__(self, graph: Graph, fwd_graph: Graph, expected_inputs: list[ExpectedConnection],
                 expected_outputs: list[ExpectedConnection]) -> None:
        self._graph, self._fwd = graph, fwd_graph
        self._expected_inputs = expected_inputs
        self._expected_outputs = expected_outputs

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def forward_graph(self) -> Graph:
        return self._fwd

    fwd_graph = forward_graph

    @property
    def expected_inputs(self) -> tuple[ExpectedConnection, ...]:
        return tuple(self._expected_inputs)

    @property
    def expected_outputs(self) -> tuple[ExpectedConnection, ...]:
        return tuple(self._expected_outputs)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(e.fwd_tensor for e in self._expected_inputs)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(e.fwd_tensor for e in self._expected_outputs)

    def inputs_dict(self, fwd_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Gradient-graph input -> parent tensor at the forward call site, for the Fwd inputs."""
        if fwd_call_info.called_graph is not self._fwd:
            raise TypeError("The called graph does not match the graph that was differentiated.")
        return {self._graph._inputs[i]: fwd_call_info.graph_to_parent(e.fwd_tensor)
                for i, e in enumerate(self._expected_inputs)
                if e.connection_type == ExpectedConnectionType.Fwd}

    def fwd_graph_ins_to_grad_parent_outs(self, grad_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Forward-graph input -> its gradient at the gradient call site."""
        return {t: grad_call_info.graph_to_parent(self._graph._outputs[i])
                for i, t in enumerate(self.outputs)}

    def fwd_parent_ins_to_grad_parent_outs(self, fwd_call_info: CallSiteInfo,
                                           grad_call_info: CallSiteInfo) -> dict[Tensor, Tensor]:
        """Parent tensor passed to the forward call -> its gradient at the gradient call site."""
        return {fwd_call_info.graph_to_parent(t): grad_call_info.graph_to_parent(self._graph._outputs[i])
                for i, t in enumerate(self.outputs)}

    @classmethod
    def _from_pb(cls, ir: _pb.Ir, fwd_graph: _pb.Graph, bwd_info: _pb.BwdGraphInfo) -> "GradGraphInfo":
        """The GradGraphInfo of a binding ``BwdGraphInfo`` (a gradient graph of ``ir`` and its
        expected connections to ``fwd_graph``), as popxl-addons builds its own grad graphs."""
        def conns(pb: list) -> list[ExpectedConnection]:
            return [ExpectedConnection._from_pb(fwd_graph, ec) for ec in pb]
        return cls(ir.getGraph(bwd_info.bwdGraphId)._graph, fwd_graph._graph,
                   conns(bwd_info.expectedInputs), conns(bwd_info.expectedOutputs))

    def __repr__(self) -> str:
        return (f"GradGraphInfo[graph={self._graph.id} expected_inputs={list(self._expected_inputs)} "
                f"expected_outputs={list(self._expected_outputs)}]")


# What each op type's grad op reads of the forward op (PopART's gradInputInfo(), willow/src/op;
# its grad ops for inputs that need no gradient are pruned): "none": nothing but the output
# gradient (linear ops: the vjp of the lowering at zeros is the gradient); "out": its output
# only (FROM_OUTPUT gives the gradient from it); "in+out": inputs and outputs (PopART's
# ElementWiseBinaryGradOp, pooling and reduction grads); "arg+out": each required input and
# the output (NonLinearVariadicGradOp, FROM_ARG_AND_OUTPUT); "other": for
# each input's gradient the other inputs (MatMulLhsGradOp reads the rhs, ConvDataGradOp the
# weights, ...); (inputs, outputs): those indices (GroupNormGradOp: x, scale, mean, inv std).
# A custom op reads what its C++ grad op reads (``popart.custom_ops.GRAD_READS``); any other
# op type reads its inputs ("in"). Inputs that are not floating point (indices,
# labels, seeds, conditions) are read whenever the op is differentiated.
GRAD_READS = {
    **dict.fromkeys(("Add", "Sub", "Neg", "Sum", "Mean", "Identity", "Reshape", "Transpose",
                     "Flatten", "Squeeze", "Unsqueeze", "Expand", "ReduceSum", "ReduceMean",
                     "Concat", "Slice", "Split", "Scale", "Cast", "Subsample", "Resize", "Gather",
                     "GroupedGather", "DynamicSlice", "DynamicUpdate", "OneHot", "Where",
                     "Dropout", "PrintTensor", "AllReduce", "ReplicatedAllReduce",
                     "ReplicatedAllReduceInplace", "ReplicatedAllGather",
                     "ReplicatedReduceScatter"), "none"),
    **dict.fromkeys(FROM_OUTPUT, "out"),
    # TopKGradOp, ReduceMedianGradOp: the indices output (FROM_OUTPUT)
    **dict.fromkeys(("TopK", "ReduceMedian"), ((), (1,))),
    # ScatterReduceGradOp, by the reduction: sum reads the indices, none the source too,
    # max / min / mul the source, the output and the initial values
    "ScatterReduce": {"sum": "none", "none": ((0,), ()), "max": "in+out", "min": "in+out",
                      "mul": "in+out"},
    **dict.fromkeys(("MaxPool", "AveragePool", "GlobalMaxPool", "GlobalAveragePool", "ReduceMax",
                     "ReduceMin", "ReduceL2", "ReduceLogSumExp", "Mul", "Div", "Pow", "Fmod",
                     "Atan2"), "in+out"),
    **dict.fromkeys(FROM_ARG_AND_OUTPUT, "arg+out"),
    **dict.fromkeys(("MatMul", "Conv"), "other"),
    "GroupNormalization": ((0, 1), (1, 2)),
}
_NO_GRAD = NO_GRAD_OPS | {"ArgMax", "ArgMin", "Equal", "Greater", "Less", "GreaterOrEqual",
                          "LessOrEqual", "NonZero", "Detach"}


def _float(t: Tensor) -> bool:
    return t.dtype.is_floating_point


class _Fwd:
    """The forward graph seen by IR ids: specs, constants and the popxl tensor of each id."""

    def __init__(self, graph: Graph) -> None:
        self.graph, self.ir = graph, graph._finalize()
        self.consts = set(self.ir.initializers)
        self.in_ids = [graph._entry[t] for t in graph._inputs]
        self._by_id: dict[str, Tensor] = {}
        for t in list(graph._tensors.values()) + list(graph._outputs):
            self._by_id[t._ir_id] = t
        for t in graph._inputs:
            self._by_id[graph._entry[t]] = t

    def tensor(self, tid: str) -> Tensor:
        if tid not in self._by_id:    # an output stitched since, or an earlier version of a
            t = self.graph._tensors.get(tid)   # tensor that an in-place op changed
            self._by_id[tid] = t if t is not None and t._ir_id == tid else Tensor(self.graph, tid)
        return self._by_id[tid]

    def is_float(self, tid: str) -> bool:
        return _float(self.tensor(tid))


def _branches(graph: Graph, n: Node) -> Optional[tuple[Graph, Graph]]:
    """The popxl graphs of a ``conditional``'s If node (each branch calls one on parent
    tensors that are no inputs of the If node)."""
    if n.op_type != "If":
        return None
    gs = []
    for b in ("then_branch", "else_branch"):
        body = n.attrs.get(b)
        callee = body.nodes[0].attrs.get("callee") if isinstance(body, IRGraph) and \
            len(body.nodes) == 1 and body.nodes[0].op_type == "Call" else None
        gs.append(next((g for g in graph.ir._graphs if g._g is callee), None))
    if None in gs or any(g._hidden or g._by_ref_inputs for g in gs):
        return None
    return gs[0], gs[1]


def _repeated(graph: Graph, n: Node) -> Optional[Graph]:
    """The popxl graph a ``repeat``'s Loop node calls (its body calls it once on the carried
    values), when its gradient is a repeat of the graph's gradient graph."""
    body = n.attrs.get("body") if n.op_type == "Loop" else None
    if not isinstance(body, IRGraph) or len(body.nodes) != 1 or body.nodes[0].op_type != "Call" \
            or body.nodes[0].inputs != body.inputs[2:] or n.inputs[0] not in graph._g.initializers:
        return None
    g = next((g for g in graph.ir._graphs if g._g is body.nodes[0].attrs.get("callee")), None)
    return None if g is None or g._hidden or g._by_ref_inputs else g


def _trips(ir: IRGraph, n: Node) -> int:
    """A repeat's count (its Loop's constant trip count)."""
    return int(np.asarray(ir.initializers[n.inputs[0]]).reshape(()))


def _save_iterations(graph: Graph, n: Node, body_graph: Graph, sub: GradGraphInfo) -> dict:
    """Scan outputs of a repeat's Loop node ``n``: for each forward tensor that the body's
    gradient graph reads and that changes across iterations (a carried input, an output),
    its value at every iteration, stacked. Returns {forward tensor: stacked id}."""
    body = n.attrs["body"]
    middle = next(g for g in graph.ir._graphs if g._g is body)   # the repeat's RepeatBody
    call_node, n_out, trips = body.nodes[0], len(body_graph._outputs), _trips(graph._g, n)
    stacked = {}
    for e in sub.expected_inputs if trips > 0 else ():     # (no iteration: nothing to read)
        t = e.fwd_tensor
        if e.connection_type != ExpectedConnectionType.Fwd or t in stacked:
            continue
        if t in body_graph._outputs:
            src = call_node.outputs[body_graph._outputs.index(t)]
        elif body_graph._inputs.index(t) < n_out:
            src = body.inputs[2 + body_graph._inputs.index(t)]
        else:
            continue        # the same every iteration: read the Loop's input
        middle.scan_outputs.append(src)
        tid = graph._new_id(f"{n.name.split('/')[-1]}_saved")
        graph._add_tensor(tid, jax.ShapeDtypeStruct((trips, *t.shape), t.dtype.as_device_numpy()))
        n.outputs.append(tid)
        stacked[t] = tid
    middle._finalize()
    graph._finalize()
    return stacked


def _inputs(graph: Graph, n: Node) -> list[str]:
    """The ids ``n`` reads: its inputs, and for a conditional those its branches call with."""
    if _branches(graph, n) is None:
        return n.inputs
    return list(dict.fromkeys(n.inputs + [i for b in ("then_branch", "else_branch")
                                          for i in n.attrs[b].nodes[0].inputs]))


def _plan(fwd: _Fwd, provided: list[str], required: list[str]) -> tuple[list, set]:
    """The forward nodes to differentiate, last first, each with (output indices that have a
    gradient, its traced input ids that get one), and every id that gets a gradient."""
    from_req = set(required)
    for n in fwd.ir.nodes:
        if n.op_type not in _NO_GRAD and any(i in from_req for i in _inputs(fwd.graph, n) if i):
            from_req.update(o for o in n.outputs if o and fwd.is_float(o))
    has_grad, plan = {p for p in provided if fwd.is_float(p)}, []
    for n in reversed(fwd.ir.nodes):
        outs = [k for k, o in enumerate(n.outputs) if o and o in has_grad]
        wrt = [i for i in dict.fromkeys(_inputs(fwd.graph, n)) if i and i in from_req
               and i not in fwd.consts and fwd.is_float(i)]
        if n.op_type in _NO_GRAD or not outs or not wrt:
            continue
        plan.append((n, outs, wrt))
        has_grad.update(wrt)
    return plan, has_grad


def _reads(fwd: _Fwd, n: Node, wrt: list[str]) -> tuple[list[str], list[str], str]:
    """The forward input ids and output ids that the grad op of ``n`` reads to give the
    gradients of ``wrt``, and the op type when the gradient comes from its output
    (``FROM_OUTPUT``: ops of one traced input)."""
    traced = [i for i in dict.fromkeys(n.inputs) if i and i not in fwd.consts]
    kind = GRAD_READS.get(n.op_type, custom_ops.GRAD_READS.get(n.op_type, "in"))
    if isinstance(kind, dict):
        kind = kind.get(n.attrs.get("reduction"), "in")
    if kind == "out" and len(traced) != 1:
        kind = "in"
    if "collectiveOperator" in n.attrs and \
            op_name(None, n.attrs["collectiveOperator"]) not in ("add", "mean", "local"):
        kind = "in"   # a max / min / mul reduction: its gradient depends on the values
    if kind in ("other", "arg+out") and any(n.inputs.count(w) > 1 for w in wrt):
        kind = "in+out" if kind == "arg+out" else "in"   # x @ x: the gradient reads x
    if isinstance(kind, tuple):
        in_idx, out_idx = kind
        read = {i for k, i in enumerate(n.inputs) if k in in_idx}
        ins = [i for i in traced if i in read or not fwd.is_float(i)]
        outs = [n.outputs[k] for k in out_idx if k < len(n.outputs) and n.outputs[k]]
        return ins, outs, n.op_type if n.op_type in FROM_OUTPUT and not ins else ""
    ins = [i for i in traced if kind in ("in", "in+out") or not fwd.is_float(i)
           or (kind == "other" and any(w != i for w in wrt)) or (kind == "arg+out" and i in wrt)]
    outs = [o for o in n.outputs if o] if kind in ("out", "in+out", "arg+out") else []
    return ins, outs, n.op_type if kind in ("out", "arg+out") else ""


def _callee(graph: Graph, n: Node) -> Optional[Graph]:
    """The popxl graph a Call node calls, when its gradient is a call of the callee's
    gradient graph (callees with host streams, remote buffers or by-reference inputs are
    differentiated through the call op instead)."""
    if n.op_type != "Call" or not isinstance(n.attrs.get("callee"), IRGraph):
        return None
    g = next((g for g in graph.ir._graphs if g._g is n.attrs["callee"]), None)
    return None if g is None or g._hidden or g._by_ref_inputs else g


def _site_id(n: Node, callee: Graph, t: Tensor) -> str:
    """The id at call node ``n`` of an input or output ``t`` of the called graph (a repeat's
    site: its stacked iterations where it has them)."""
    if t in n.attrs.get("stacked", {}):
        return n.attrs["stacked"][t]
    if t in callee._inputs:
        return n.inputs[callee._inputs.index(t)]
    if t in callee._outputs:
        return n.outputs[callee._outputs.index(t)]
    raise ValueError(f"Tensor '{t.id}' is not an input or output of graph '{callee.name}'")


def _one_node_graph(fwd: _Fwd, n: Node) -> IRGraph:
    traced = [i for i in dict.fromkeys(n.inputs) if i and i not in fwd.consts]
    return IRGraph(name=f"{fwd.graph.name}/{n.name}", nodes=[dataclasses.replace(n, outputs=list(n.outputs))],
                   inputs=traced, outputs=[o for o in n.outputs if o],
                   initializers={i: fwd.ir.initializers[i] for i in n.inputs if i in fwd.consts},
                   opsets=dict(fwd.ir.opsets), constants={i for i in n.inputs if i in fwd.consts},
                   parent=fwd.ir.parent)


def _call_sites(graph: Graph) -> tuple[list, bool]:
    """The Call nodes that call ``graph`` (with their graphs), and whether a repeat /
    conditional wrapper calls it too (then PopART's SafeAddFwdOutputStitcher recomputes)."""
    old_ir = graph._finalize()
    graphs = [g for g in graph.ir._graphs if not isinstance(g, RepeatBody)]   # repeats' wrappers
    sites, wrapped, own = [], False, {id(g._g) for g in graphs}
    for g in graphs:
        for node in g._g.nodes:
            if node.op_type == "Call" and node.attrs.get("callee") is old_ir:
                sites.append((g, node))
            elif any(_calls(v, old_ir, own) for v in node.attrs.values() if isinstance(v, IRGraph)):
                wrapped = True
    return sites, wrapped


def _stitch(graph: Graph, ts: list[Tensor], sites: list) -> None:
    """Make ``ts`` outputs of ``graph``, and of every call of it (PopART's AddFwdOutputStitcher)."""
    if not ts:
        return
    n_old = len(graph._outputs)
    graph._outputs.extend(ts)
    graph._finalize()
    for g, node in sites:
        for k, t in enumerate(ts):
            tid = g._new_id("autodiff_output")
            g._add_tensor(tid, t._spec)
            node.outputs.insert(n_old + k, tid)


def _calls(body: IRGraph, callee: IRGraph, own: set) -> bool:
    """Whether a wrapper ``body`` (a repeat's loop body, a conditional's branch; not a popxl
    graph, ids ``own``, whose calls are call sites of their own) calls ``callee``."""
    return id(body) not in own and any(
        n.attrs.get("callee") is callee or
        any(_calls(v, callee, own) for v in n.attrs.values() if isinstance(v, IRGraph))
        for n in body.nodes)


def _recomputed(fwd: _Fwd, ids: set) -> list[Node]:
    """The forward nodes that recompute ``ids`` from the forward inputs (PopART's
    RecomputeStitcher: the forward graph copied into the gradient graph, then pruned)."""
    need, nodes = set(ids), []
    for n in reversed(fwd.ir.nodes):
        if any(o in need for o in n.outputs if o):
            nodes.append(n)
            need.update(i for i in n.inputs if i)
    return nodes[::-1]


def _grad_annotations(n: Node) -> dict:
    """A grad op's annotations: its forward op's (PopART makes grad ops with the forward
    op's settings: IPU, tile set, execution context, ...), never recomputed."""
    return {k: v for k, v in n.annotations.items() if k != RECOMPUTE_OUTPUT}


@contextlib.contextmanager
def _placed(graph: Graph, annotations: dict):
    """The nodes added to ``graph`` inside get ``annotations``, not the current context's."""
    k = len(graph._g.nodes)
    yield
    for node in graph._g.nodes[k:]:
        node.annotations = dict(annotations)


def autodiff(graph: Graph, grads_provided: Optional[Iterable[Tensor]] = None,
             grads_required: Optional[Iterable[Tensor]] = None,
             called_graphs_grad_info: Optional[Mapping[Graph, GradGraphInfo]] = None,
             return_all_grad_graphs: bool = False) -> Any:
    """Differentiate ``graph``: the gradient graph gives the gradients of ``grads_required``
    (default: every input of ``graph``; one no gradient reaches raises PopART's error) from
    those of ``grads_provided`` (default: every output, each an input of the gradient graph
    in that order); both may be any tensors of ``graph``. The forward tensors the grad ops
    read become inputs of the gradient graph (and outputs of ``graph`` where they are
    neither; for a graph that repeat / conditional call, they are recomputed in the gradient
    graph). Called graphs are differentiated with PopART's defaults for them: the outputs
    that lead to a gradient, the inputs that get one."""
    for what, ts in (("grads_provided", grads_provided), ("grads_required", grads_required)):
        for t in ts or ():
            if not isinstance(t, Tensor) or t._graph is not graph:
                raise ValueError(f"{what}: {t!r} is not a tensor of graph '{graph.name}'")
    return _autodiff(graph, list(graph.outputs if grads_provided is None else grads_provided),
                     list(graph.inputs if grads_required is None else grads_required),
                     called_graphs_grad_info, return_all_grad_graphs)


def _autodiff(graph: Graph, grads_provided: Optional[list[Tensor]],
              grads_required: Optional[list[Tensor]],
              called_graphs_grad_info: Optional[Mapping[Graph, GradGraphInfo]] = None,
              return_all_grad_graphs: bool = False) -> Any:
    """``autodiff``; None for ``grads_provided`` / ``grads_required`` is PopART's nullopt
    (the outputs that lead to a gradient; the inputs that get one)."""
    if graph._is_main:
        raise ValueError("autodiff differentiates subgraphs (made with ir.create_graph), not the main graph")
    if graph._hidden:
        raise NotImplementedError(f"autodiff of graph '{graph.name}', which uses host streams or "
                                  f"remote buffers, is not supported: load / store outside the "
                                  f"differentiated graph")
    fwd = _Fwd(graph)
    ids = lambda ts: [t._ir_id if t not in graph._inputs else graph._entry[t] for t in ts]
    provided = ids([t for t in graph._outputs if _float(t)] if grads_provided is None else grads_provided)
    required = ids([t for t in graph._inputs if _float(t)] if grads_required is None else grads_required)
    plan, has_grad = _plan(fwd, provided, required)
    if grads_required is None:
        required = [r for r in required if r in has_grad]
    missing = [r for r in required if r not in has_grad]
    if missing:
        name = f"{graph.name}_grad"
        raise popart_exception(
            f"[Autodiff] Unable to provide required gradient output for fwd id "
            f"'{fwd.tensor(missing[0]).id}' in bwd graph subgraph "
            f"'{name}_{graph.ir._graph_names.get(name, 0)}'")
    if grads_provided is None:
        used = {o for n, outs, _ in plan for k, o in enumerate(n.outputs) if k in outs}
        provided = [p for p in dict.fromkeys(provided) if p in used or p in required]
        plan, has_grad = _plan(fwd, provided, required)
    infos: dict[Graph, GradGraphInfo] = dict(called_graphs_grad_info or {})
    subs = {}   # Call / If node -> the called graphs and their gradient graphs
    for n, _, _ in plan:       # called graphs first: their added outputs are read here
        callee = _callee(graph, n) or _repeated(graph, n)
        called = (callee,) if callee is not None else _branches(graph, n)
        for g in called or ():
            if g not in infos:
                infos.update(_autodiff(g, None, None, infos, True))
        if callee is not None and n.op_type == "Loop":   # site: the Loop's inputs, stacked saves
            stacked = _save_iterations(graph, n, callee, infos[callee])
            subs[id(n)] = [(callee, infos[callee], Node("Call", n.inputs[2:], [], {"stacked": stacked}))]
        elif callee is not None:
            subs[id(n)] = [(callee, infos[callee], n)]
        elif called:     # a branch's site: the ids its Call reads, the If node's outputs
            subs[id(n)] = [(g, infos[g], Node("Call", n.attrs[b].nodes[0].inputs, n.outputs))
                           for g, b in zip(called, ("then_branch", "else_branch"))]
    reads = {}
    for n, _, wrt in plan:
        if n.op_type == "Loop" and id(n) in subs and _trips(fwd.ir, n) == 0:
            reads[id(n)] = ([], [], "")      # no iteration: the Loop passes its inputs through
        elif id(n) in subs:
            reads[id(n)] = (list(dict.fromkeys(
                n.inputs[:1 if n.op_type == "If" else 0] +
                [_site_id(site, g, e.fwd_tensor) for g, sub, site in subs[id(n)]
                 for e in sub.expected_inputs if e.connection_type == ExpectedConnectionType.Fwd])), [], "")
        else:
            reads[id(n)] = _reads(fwd, n, wrt)
    saved = {t for ins, outs, _ in reads.values() for t in ins + outs} - fwd.consts
    out_ids = {t._ir_id for t in graph._outputs}
    extra = {t for t in saved if t not in fwd.in_ids and t not in out_ids}
    sites, wrapped = _call_sites(graph)
    replay = _recomputed(fwd, extra) if wrapped else []
    if wrapped:
        saved = (saved - extra) | {i for n in replay for i in n.inputs if i in fwd.in_ids}
    else:
        _stitch(graph, [fwd.tensor(t) for t in sorted(extra)], sites)
    saved = sorted(saved)

    grad = graph.ir.create_empty_graph(f"{graph.name}_grad")
    with grad:
        gsum: dict[str, list[Tensor]] = {}
        placement: dict[int, dict] = {}      # id of a gradient tensor -> its grad op's annotations
        for p in provided:
            t = fwd.tensor(p)
            gsum.setdefault(p, []).append(graph_input(t.shape, t.dtype, f"Gradient___{t.name}"))
        val = {t: graph_input(fwd.tensor(t).shape, fwd.tensor(t).dtype, fwd.tensor(t).name)
               for t in saved}

        def total(tid: str) -> Tensor:
            parts = gsum.get(tid, [])
            if not parts:
                t = fwd.tensor(tid)
                return constant(np.zeros(t.shape, t.dtype.as_device_numpy()), t.dtype, name=f"Gradient___{t.name}")
            if len(parts) > 1:     # PopART's grad sum takes its placement from its inputs' ops
                with _placed(grad, placement.get(id(parts[0]), {})):
                    gsum[tid] = [grad._add_node("Sum", parts, name=f"Gradient___{fwd.tensor(tid).name}")[0]]
            return gsum[tid][0]

        def value(tid: str) -> Tensor:
            if tid in val:
                return val[tid]
            return constant(fwd.ir.initializers[tid], fwd.tensor(tid).dtype, name=fwd.tensor(tid).name)

        def add_grad(tid: str, g: Tensor, n: Node) -> None:
            placement[id(g)] = _grad_annotations(n)
            gsum.setdefault(tid, []).append(g)

        for n in replay:
            with _placed(grad, n.annotations):
                res = grad._add_node(n.op_type, [value(i) if i else None for i in n.inputs],
                                     n.attrs, n.domain, len(n.outputs), name=n.name.split("/")[-1])
            val.update((o, r) for o, r in zip(n.outputs, res) if o)
        for n, outs, wrt in plan:
            if id(n) in subs:
                with _placed(grad, _grad_annotations(n)):
                    res = _called_grads(fwd, n, subs[id(n)], wrt, total, value)
                for i, r in zip(wrt, res):
                    if r is not None:
                        add_grad(i, r, n)
                continue
            sub = _one_node_graph(fwd, n)
            ins, souts, rule = reads[id(n)]
            attrs = {"fwd": sub, "provided": [sub.outputs.index(n.outputs[k]) for k in outs],
                     "required": [sub.inputs.index(i) for i in wrt],
                     "given": [sub.inputs.index(i) for i in ins],
                     "specs": [[list(fwd.tensor(i).shape), fwd.tensor(i).dtype.as_device_numpy().name]
                               for i in sub.inputs],
                     "n_saved_out": len(souts), "rule": rule}
            g_outs = [total(n.outputs[k]) for k in outs]
            with _placed(grad, _grad_annotations(n)):
                res = grad._add_node("OpVJP", g_outs + [value(i) for i in ins] + [val[o] for o in souts],
                                     attrs, POPXL, len(wrt), name=f"{n.name}_grad")
            for i, r in zip(wrt, res):
                add_grad(i, r, n)
        for r in required:
            graph_output(total(r))
    grad._finalize()
    info = GradGraphInfo(
        grad, graph,
        [ExpectedConnection(fwd.tensor(t), ExpectedConnectionType.FwdGrad) for t in provided] +
        [ExpectedConnection(fwd.tensor(t), ExpectedConnectionType.Fwd) for t in saved],
        [ExpectedConnection(fwd.tensor(t), ExpectedConnectionType.FwdGrad) for t in required])
    if return_all_grad_graphs:
        return {**infos, graph: info}
    return info


def _called_grads(fwd: _Fwd, n: Node, subs: list, wrt: list[str], total, value) -> list:
    """The gradients of ``wrt`` from a Call node (a call of the callee's gradient graph,
    PopART's CallGradOp) or a conditional's If node (IfGradOp: a conditional on the same
    condition whose branches call the branches' gradient graphs; a tensor one branch gives no
    gradient gets zeros there). None where no gradient comes back."""
    def args(g: Graph, sub: GradGraphInfo, site: Node) -> list[Tensor]:
        ins = []
        for e in sub.expected_inputs:
            tid = _site_id(site, g, e.fwd_tensor)
            if e.connection_type == ExpectedConnectionType.Fwd:
                ins.append(value(tid))
            elif e.fwd_tensor not in g._outputs:
                raise ValueError(f"The gradient graph of '{g.name}' expects the gradient of "
                                 f"'{e.fwd_tensor.id}', not an output of it")
            else:
                ins.append(total(tid))
        return ins

    def grads_of(g: Graph, sub: GradGraphInfo, site: Node, res: list[Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for e, r in zip(sub.expected_outputs, res):
            if e.fwd_tensor in g._inputs:
                tid = _site_id(site, g, e.fwd_tensor)
                out[tid] = out[tid] + r if tid in out else r
        return out

    if n.op_type == "Loop":
        return _repeat_grads(fwd, n, *subs[0], wrt, total, value)
    if n.op_type == "Call":
        ((g, sub, site),) = subs
        got = grads_of(g, sub, site, call(sub.graph, *args(g, sub, site)))
        return [got.get(i) for i in wrt]
    ir = fwd.graph.ir

    def branch(g: Graph, sub: GradGraphInfo, site: Node) -> tuple[Graph, list[Tensor]]:
        a = args(g, sub, site)

        def body(*xs: Tensor) -> list[Tensor]:
            got = grads_of(g, sub, site, call(sub.graph, *xs))
            return [got[i] if i in got else constant(np.zeros(fwd.tensor(i).shape,
                                                              fwd.tensor(i).dtype.as_device_numpy()),
                                                     fwd.tensor(i).dtype) for i in wrt]
        body.__qualname__ = f"{sub.graph.name}_branch"
        return ir.create_graph(body, *[x.spec for x in a]), a

    (tg, ta), (eg, ea) = (branch(*s) for s in subs)
    return list(conditional(value(n.inputs[0]), tg, eg, ta, ea))


def _repeat_grads(fwd: _Fwd, n: Node, g: Graph, sub: GradGraphInfo, site: Node, wrt: list[str],
                  total, value) -> list:
    """The gradients of ``wrt`` from a repeat of ``g`` (PopART has no LoopGradOp): a repeat,
    as many times, of a graph that calls ``g``'s gradient graph on the saved values of
    iteration k = N-1, ..., 0 (rows of the Loop's stacked scan outputs), carrying the
    gradients of the carried values and summing those of the values every iteration reads."""
    n_out, ins, trips = len(g._outputs), n.inputs[2:], _trips(fwd.ir, n)
    carry = [j for j in range(n_out) if _float(g._outputs[j])]
    acc = [i for i in range(n_out, len(ins)) if ins[i] in wrt]

    def sum_grads(res: list[Tensor]) -> dict[str, Tensor]:
        """The gradients of the Loop's inputs from those of positions ``carry`` + ``acc``."""
        out: dict[str, Tensor] = {}
        for i, r in zip(carry + acc, res):
            if ins[i] in wrt:
                out[ins[i]] = out[ins[i]] + r if ins[i] in out else r
        return out
    fwd_in = [e for e in sub.expected_inputs if e.connection_type == ExpectedConnectionType.Fwd]
    init = [total(n.outputs[j]) for j in carry] + [total(n.outputs[i]) for i in acc]
    if trips == 0:      # the Loop passes its inputs through
        out = sum_grads(init)
        return [out.get(i) for i in wrt]
    saved = [value(_site_id(site, g, e.fwd_tensor)) for e in fwd_in]

    def body(*xs: Tensor) -> list[Tensor]:
        dys, accs = dict(zip(carry, xs)), xs[len(carry):len(carry) + len(acc)]
        k, rows = xs[len(init)], iter(xs[len(init) + 1:])
        args = []
        for e in sub.expected_inputs:
            if e.connection_type == ExpectedConnectionType.FwdGrad:
                args.append(dys[g._outputs.index(e.fwd_tensor)])
            elif e.fwd_tensor in site.attrs["stacked"]:
                row = dynamic_slice(next(rows), k, [0], [1])
                args.append(reshape(row, e.fwd_tensor.shape))
            else:
                args.append(next(rows))
        got: dict[int, Tensor] = {}
        for e, r in zip(sub.expected_outputs, call(sub.graph, *args)):
            if e.fwd_tensor in g._inputs:
                got[g._inputs.index(e.fwd_tensor)] = r
        zeros = lambda t: constant(np.zeros(t.shape, t.dtype.as_device_numpy()), t.dtype)
        return ([got[j] if j in got else zeros(g._inputs[j]) for j in carry] +
                [a + got[i] if i in got else a for a, i in zip(accs, acc)] + [k - 1])

    k0 = constant(np.int32(trips - 1), name="iteration")
    body.__qualname__ = f"{sub.graph.name}_repeat"
    rg = fwd.graph.ir.create_graph(body, *[x.spec for x in init + [k0] + saved])
    out = sum_grads(repeat(rg, trips, *init, k0, *saved))
    return [out.get(i) for i in wrt]
