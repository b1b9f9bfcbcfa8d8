"""PopART's InterIpuCopy (transforms/interipucopy.cpp) as a transform of a staged graph
(``popart/_ir/interipucopy.py``): a small graph of three stages on two IPUs, IPU 0, 1, 0.
The expectations are PopART's rules written out by hand: a copy is an ``ai.graphcore``
``IpuCopy`` with ``sourceIpu`` / ``destIpu``, on the destination IPU, its output
``<t>_c<destIpu>`` (``generateCopiedTensorId``); every reader on one IPU reads one copy;
a pipeline chains the copies stage to stage."""
from __future__ import annotations

import pytest

from popart._ir.graph import VIRTUAL_GRAPH, Graph, Node
from popart._ir.interipucopy import copied_id, inter_ipu_copy
from popart.engine.placed import copied, plan_stages

IPU = {"a": 0, "b": 1, "b2": 1, "c": 0}   # stage 0 on IPU 0, stage 1 on IPU 1, stage 2 on IPU 0


@pytest.fixture
def plan():
    nodes = [Node("Relu", ["x"], ["a"]),                 # stage 0
             Node("Neg", ["a"], ["b"]), Node("Mul", ["a", "b"], ["b2"]),   # stage 1: a twice
             Node("Add", ["a", "b2"], ["c"])]            # stage 2: a (made here) and b2
    return plan_stages(nodes, lambda n: IPU[n.outputs[0]])


def facts(copies):
    return [[(c.op_type, c.domain, c.inputs, c.outputs, c.attrs, c.annotations[VIRTUAL_GRAPH])
             for c in cs] for cs in copies]


def copy(t, src, dst):
    return ("IpuCopy", "ai.graphcore", [t], [f"{t}_c{dst}"], {"sourceIpu": src, "destIpu": dst}, dst)


def test_the_stage_plan(plan):
    assert plan.stage_ipu == [0, 1, 0] and plan.boundary == [["a"], ["a", "b2"]]


def test_pipeline_copies_chain_stage_to_stage(plan):
    """A pipeline: each boundary's tensors copied from the stage before's IPU to the next
    stage's, 'a' passing through IPU 1 to reach stage 2 (``a_c1_c0``); the readers rewired."""
    g = copied(plan)
    assert facts(g.copies) == [[], [copy("a", 0, 1)], [copy("a_c1", 1, 0), copy("b2", 1, 0)]]
    assert [n.inputs for n in g.ops[1]] == [["a_c1"], ["a_c1", "b"]]   # one copy, two readers
    assert [n.inputs for n in g.ops[2]] == [["a_c1_c0", "b2_c0"]]
    assert g.source == {"a_c1": "a", "a_c1_c0": "a", "b2_c0": "b2"}
    assert g.local(2, "a") == "a_c1_c0" and g.local(2, "x") == "x"
    assert [n.op_type for n in g.nodes(2)] == ["IpuCopy", "IpuCopy", "Add"]   # copies first
    assert [n.inputs for n in plan.nodes[1]] == [["a"], ["a", "b"]]   # the plan's nodes as they were


def test_in_order_copies_go_straight_from_the_ipu_making_the_tensor(plan):
    """An in-order run: a tensor copied once to each other IPU reading it, from the IPU
    making it; a stage on the IPU making it reads it as it is."""
    g = copied(plan, [{"a"}, {"b", "b2"}, {"c"}])
    assert facts(g.copies) == [[], [copy("a", 0, 1)], [copy("b2", 1, 0)]]
    assert [n.inputs for n in g.ops[1]] == [["a_c1"], ["a_c1", "b"]]
    assert [n.inputs for n in g.ops[2]] == [["a", "b2_c0"]]


def test_called_graphs_read_the_outer_ids():
    """A node whose called graph reads a copied tensor from the enclosing graph: its
    inputs are rewired, its graph is not (the schedules bind the copy's value to both ids)."""
    body = Graph(name="b", nodes=[Node("Neg", ["a"], ["y"])], outputs=["y"])
    nodes = [Node("Relu", ["x"], ["a"]), Node("If", ["a"], ["z"], {"then_branch": body, "else_branch": body})]
    g = inter_ipu_copy([[nodes[0]], [nodes[1]]], [0, 1], [["a"]], chained=True)
    (node,) = g.ops[1]
    assert node.inputs == ["a_c1"] and node.attrs["then_branch"].nodes[0].inputs == ["a"]
    assert copied_id("a", 1) == "a_c1"
