"""decompose_sum: Sum ops with more than two inputs as a chain of Adds."""
from __future__ import annotations

from popart.engine.graph_api import Node

from ..graph import Graph


def decompose_sum(graph: Graph) -> Graph:
    """Replace each ai.onnx Sum node of ``graph`` with more than two inputs by Adds that add
    the inputs in order (each partial sum as soon as its input exists, so only one partial
    sum is live at a time). The values are those of the Sum. Returns ``graph``."""
    g = graph._g
    new_nodes = []
    for n in g.nodes:
        ins = [i for i in n.inputs if i]
        if n.domain not in ("", "ai.onnx") or n.op_type != "Sum" or len(ins) <= 2:
            new_nodes.append(n)
            continue
        acc = ins[0]
        for k, x in enumerate(ins[1:], 1):
            last = k == len(ins) - 1
            out = n.outputs[0] if last else graph._new_id(f"{n.name or 'sum'}_partial{k}")
            add = Node("Add", [acc, x], [out], {}, "ai.onnx", name=f"{n.name or 'sum'}_add{k}",
                       annotations=dict(n.annotations))
            if not last:   # the partial sum's shape (the inputs so far, broadcast)
                graph._specs[out] = graph._infer(add)[0]
            new_nodes.append(add)
            acc = out
    g.nodes[:] = new_nodes
    return graph
