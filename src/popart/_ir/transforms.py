"""IR rewrites that PopART's patterns make before a training session's gradients exist.

Most of PopART's patterns rewrite its grad ops into cheaper ones and change no number; XLA
does the equivalent on its own. The ones here change numbers, so the training IR gets them:

* ``SoftmaxGradDirect``: Softmax followed by Nll differentiates as (p - onehot) * scale with
  respect to the softmax's input, not through Nll's clamped -1/p.
* ``NlllWithSoftmaxGradDirect``: the fused op also computes the loss, as -log(p + 1e-7).
* DynamicOpTransform: a ``noOverlap`` DynamicSlice's gradient overwrites the gradient of the
  tensor it reads (``overwrite_no_overlap_grads``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from ..ops.registry import GRAPHCORE_DOMAIN, ONNX_DOMAIN
from ..tensornames import PREFIXES
from .graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph, Node, outer_reads, reads

# Ops whose outputs carry no gradient back to their inputs (PopART has no grad op for them).
_NO_GRAD = {"ArgMax", "ArgMin", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual",
            "Shape", "Size", "NonZero"}
_PLACEMENT = (VIRTUAL_GRAPH, PIPELINE_STAGE)


def ancestors(graph: Graph, tensor: str) -> set[str]:
    """Every tensor that ``tensor`` is computed from (itself included)."""
    producer = graph.producer()
    seen, todo = set(), [tensor]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        node = producer.get(t)
        if node is not None:
            todo.extend(i for i in node.inputs if i)
    return seen


# Ops with no gradient at all, and inputs that get none (SoftmaxNll, the fused Softmax -> Nll
# below, sends the gradient to the logits only).
NO_GRAD_OPS = frozenset({"Detach", "Shape", "Size", "StopGradient"})
NO_GRAD_INPUTS = {"SoftmaxNll": (1, 2)}


def gradient_flow(graph: Graph, loss: str, trainable: Any,
                  is_float: Callable[[str], bool]) -> tuple[set, set]:
    """(tensors with a gradient, forward edges (node index, input index) a gradient flows
    back through), as PopART's autodiff grows grad ops: a tensor has a gradient when it is
    floating point (``is_float``), depends on a trainable weight through ops with gradients
    and the loss depends on it."""
    from_w = {w for w in trainable if is_float(w)}
    for n in graph.nodes:   # reads(): also what If / Loop / Scan bodies read from the graph
        if n.op_type not in NO_GRAD_OPS and any(i in from_w for i in reads(n)):
            from_w.update(o for o in n.outputs if o and is_float(o))

    def grad_inputs(n: Node) -> list[tuple[int, str]]:
        if n.op_type in NO_GRAD_OPS:
            return []
        skip = NO_GRAD_INPUTS.get(n.op_type, ())
        return [(i, t) for i, t in enumerate(n.inputs) if t and i not in skip]

    to_loss = {loss}
    for n in reversed(graph.nodes):
        if any(o in to_loss for o in n.outputs if o):
            to_loss.update(t for _, t in grad_inputs(n))
            if n.op_type not in NO_GRAD_OPS:
                to_loss.update(outer_reads(n))
    has_grad = from_w & to_loss
    edges = {(k, i) for k, n in enumerate(graph.nodes) if any(o in has_grad for o in n.outputs if o)
             for i, t in grad_inputs(n) if t in has_grad}
    return has_grad, edges


def fuse_softmax_nll(graph: Graph, loss: str, enabled: Callable[[str], bool],
                     anchors: Iterable[str] = ()) -> Graph:
    """``graph`` with each ai.graphcore Nll whose probabilities come from a Softmax replaced
    by a SoftmaxNll node (same output), where PopART's SoftmaxGradDirect pattern would fuse
    NllGrad into SoftmaxGrad: the pattern is enabled, the softmax's output gets no gradient
    from anything else (its NllGrad feeds SoftmaxGrad alone), its gradient is not among the
    ``anchors`` (a pattern never touches an anchored tensor: Pattern::touchesAnchored,
    ir.cpp), and both ops have the same placement. ``enabled(name)`` tells whether a pattern
    is on. The input graph is unchanged."""
    if not enabled("SoftmaxGradDirect"):
        return graph
    anchored = set(anchors)
    producer, consumers = graph.producer(), graph.consumers()
    to_loss = ancestors(graph, loss)
    fuse_loss = 1 if enabled("NlllWithSoftmaxGradDirect") else 0
    nodes, changed = [], False
    for node in graph.nodes:
        soft = producer.get(node.inputs[0]) if node.inputs else None
        if (node.op_type == "Nll" and node.domain == GRAPHCORE_DOMAIN
                and not node.attrs.get("inputIsLogProbability", 0)
                and soft is not None and soft.op_type == "Softmax" and soft.domain == ONNX_DOMAIN
                and node.outputs[0] in to_loss
                and PREFIXES["Gradient"] + node.inputs[0] not in anchored
                and _only_gradient_consumer(node, consumers.get(node.inputs[0], []), to_loss)
                and all(node.annotations.get(k) == soft.annotations.get(k) for k in _PLACEMENT)):
            axis = soft.attrs.get("axis", 1 if graph.opsets.get(ONNX_DOMAIN, 13) < 13 else -1)
            nodes.append(dataclasses.replace(
                node, op_type="SoftmaxNll", inputs=[soft.inputs[0]] + list(node.inputs),
                attrs={**node.attrs, "axis": axis, "fuseLoss": fuse_loss}))
            changed = True
        else:
            nodes.append(node)
    return dataclasses.replace(graph, nodes=nodes) if changed else graph


def _only_gradient_consumer(nll: Node, users: list[Any], to_loss: set[str]) -> bool:
    """True when no consumer of the probabilities but ``nll`` passes gradient to the loss."""
    return all(u is nll or u.op_type in _NO_GRAD or not any(o in to_loss for o in u.outputs if o)
               for u in users)


def overwrite_no_overlap_grads(graph: Graph) -> Graph:
    """``graph`` with PopART's DynamicOpTransform rule for the gradient of a tensor that
    ``noOverlap`` DynamicSlices read: its gradient starts as the sum of its other consumers'
    gradients, then each DynamicSlice's gradient is written into it in the backward order
    (the last slice of the forward pass first): DynamicUpdate (overwrite) for a ``noOverlap``
    slice, DynamicAdd otherwise (dynamicoptransform.cpp, gradSumToGradChain). Here each
    consumer reads the tensor through a NoOverlapGradGate that zeroes its gradient in the
    regions of the ``noOverlap`` slices written after it (Constant offsets move to the
    graph's start). A gate whose offsets are computed later than its consumer is left out
    (that gradient then accumulates). The input graph
    is unchanged."""
    gates: dict = {}   # (id(consumer), tensor) -> the noOverlap slices written after it
    for x, users in graph.consumers().items():
        sl = [u for u in users if u.op_type == "DynamicSlice" and u.domain == GRAPHCORE_DOMAIN
              and u.inputs[0] == x]
        if not any(s.attrs.get("noOverlap", 0) for s in sl):
            continue
        sl_ids = {id(s) for s in sl}
        chain = [u for u in dict.fromkeys(map(id, users)) if u not in sl_ids] + \
            [id(s) for s in reversed(sl)]
        by_id = {id(u): u for u in users}
        for k, u in enumerate(chain):
            later = [by_id[v] for v in chain[k + 1:]
                     if v in sl_ids and by_id[v].attrs.get("noOverlap", 0)]
            if later:
                gates[(u, x)] = later
    if not gates:
        return graph
    offsets = {s.inputs[1] for later in gates.values() for s in later}
    hoisted = [n for n in graph.nodes if n.op_type == "Constant" and n.outputs[0] in offsets]
    known = set(graph.inputs) | set(graph.initializers) | {n.outputs[0] for n in hoisted}
    nodes: list[Node] = list(hoisted)   # constant offsets first, so every gate can read them
    for node in (n for n in graph.nodes if not any(n is h for h in hoisted)):
        renamed = {}
        for x in dict.fromkeys(t for t in node.inputs if t):
            later = gates.get((id(node), x))
            if later and all(s.inputs[1] in known for s in later):
                gated = f"{x}__noOverlapGate{len(nodes)}"
                nodes.append(Node("NoOverlapGradGate", [x] + [s.inputs[1] for s in later],
                                  [gated], {"regions": [(list(s.attrs["axes"]),
                                                         list(s.attrs["sizes"])) for s in later]},
                                  GRAPHCORE_DOMAIN, annotations=dict(node.annotations)))
                renamed[x] = gated
        nodes.append(dataclasses.replace(node, inputs=[renamed.get(t, t) for t in node.inputs])
                     if renamed else node)
        known.update(o for o in node.outputs if o)
    return dataclasses.replace(graph, nodes=nodes)
