"""popxl.transforms.autodiff: the gradient graph of a graph.

The gradient graph holds one ai.popxl::VJP node that keeps the forward IR graph as an
attribute and lowers to ``jax.vjp`` over it: it recomputes the forward pass from the forward
inputs and pulls the provided output gradients back. So its expected inputs are the provided
output gradients followed by every forward input."""
from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping, Optional

from ..graph import Graph
from ..ops._base import POPXL
from ..ops.call import CallSiteInfo
from ..tensor import Tensor, graph_input, graph_output


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


class GradGraphInfo:
    """The result of ``autodiff``: the gradient graph and how its inputs / outputs relate to
    the forward graph."""

    def __init__(self, graph: Graph, fwd_graph: Graph, expected_inputs: list[ExpectedConnection],
                 expected_outputs: list[ExpectedConnection]) -> None:
        self._graph, self._fwd = graph, fwd_graph
        self._expected_inputs, self._expected_outputs = expected_inputs, expected_outputs

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

    def __repr__(self) -> str:
        return (f"GradGraphInfo[graph={self._graph.id} expected_inputs={list(self._expected_inputs)} "
                f"expected_outputs={list(self._expected_outputs)}]")


def _float(t: Tensor) -> bool:
    return t.dtype.is_floating_point


def autodiff(graph: Graph, grads_provided: Optional[Iterable[Tensor]] = None,
             grads_required: Optional[Iterable[Tensor]] = None,
             called_graphs_grad_info: Optional[Mapping[Graph, GradGraphInfo]] = None,
             return_all_grad_graphs: bool = False) -> Any:
    """Differentiate ``graph``: gradients of ``grads_required`` (default: its floating-point
    inputs) given gradients of ``grads_provided`` (default: its floating-point outputs).
    Subgraphs it calls are differentiated through by JAX."""
    if graph._is_main:
        raise ValueError("autodiff differentiates subgraphs (made with ir.create_graph), not the main graph")
    if graph._hidden:
        raise NotImplementedError(f"autodiff of graph '{graph.name}', which uses host streams or "
                                  f"remote buffers, is not supported: load / store outside the "
                                  f"differentiated graph")
    provided = [t for t in graph._outputs if _float(t)] if grads_provided is None else list(grads_provided)
    required = [t for t in graph._inputs if _float(t)] if grads_required is None else list(grads_required)
    for t in provided:
        if t not in graph._outputs:
            raise NotImplementedError(f"grads_provided: '{t.id}' is not an output of graph "
                                      f"'{graph.name}' (only outputs are supported)")
    for t in required:
        if t not in graph._inputs:
            raise NotImplementedError(f"grads_required: '{t.id}' is not an input of graph "
                                      f"'{graph.name}' (only inputs are supported)")
    fwd_ir = graph._finalize()
    grad = graph.ir.create_empty_graph(f"{graph.name}_grad")
    with grad:
        g_ins = [graph_input(t.shape, t.dtype, f"Gradient___{t.name}") for t in provided]
        f_ins = [graph_input(t.shape, t.dtype, t.name) for t in graph._inputs]
        attrs = {"fwd": fwd_ir, "provided": [graph._outputs.index(t) for t in provided],
                 "required": [graph._inputs.index(t) for t in required]}
        outs = grad._add_node("VJP", g_ins + f_ins, attrs, POPXL, len(required),
                              name=f"Gradient___{graph.name}")
        for o in outs:
            graph_output(o)
    grad._finalize()
    info = GradGraphInfo(
        grad, graph,
        [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in provided] +
        [ExpectedConnection(t, ExpectedConnectionType.Fwd) for t in graph._inputs],
        [ExpectedConnection(t, ExpectedConnectionType.FwdGrad) for t in required])
    if return_all_grad_graphs:
        return [info]
    return info
