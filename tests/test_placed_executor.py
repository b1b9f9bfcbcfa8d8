"""One placed executor (issue 26 item 1): a two-stage model built with the popart Builder
and the same model built with popxl run placed on two devices by ``engine.placed.Executor``,
cut by the same ``plan_stages`` into the same stage plan (stages, IPUs, the IpuCopy between
them), with the numbers of one device (NumPy's)."""
from __future__ import annotations

import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from popart import testing
from popart.engine.placed import Executor, StagePlan

B, D = 2, 4
RS = np.random.RandomState(0)
W0, W1 = (RS.randn(D, D).astype(np.float32) * 0.5 for _ in range(2))
X = RS.randn(B, D).astype(np.float32)
WANT = np.tanh(X @ W0) @ W1   # stage 0: tanh(x @ w0) on IPU 0; stage 1: @ w1 on IPU 1


def popart_run(ipus: int) -> tuple:
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [B, D]), "x")
    with b.virtualGraph(0):
        h = b.aiOnnx.tanh([b.aiOnnx.matmul([x, b.addInitializedInputTensor(W0, "w0")])])
    with b.virtualGraph(ipus - 1):
        y = b.aiOnnx.matmul([h, b.addInitializedInputTensor(W1, "w1")])
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Manual
    dev = popart.DeviceManager().acquireAvailableDevice(ipus)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), dev, userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, out))
    dev.detach()
    return out[y], s


def popxl_run(ipus: int) -> tuple:
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((B, D), popxl.float32, "x")
        ys = popxl.d2h_stream((B, D), popxl.float32, "y")
        with popxl.ipu(0):
            w0 = popxl.variable(W0, name="w0")
            h = ops.tanh(ops.host_load(xs) @ w0)
        with popxl.ipu(ipus - 1):
            w1 = popxl.variable(W1, name="w1")
            y = (ops.ipu_copy(h, 1, 0) if ipus > 1 else h) @ w1
            ops.host_store(ys, y)
    s = popxl.Session(ir, "ipu_model" if ipus > 1 else "cpu")
    with s:
        got = s.run({xs: X})[ys]
    return got, s


@pytest.mark.parametrize("front_end", [popart_run, popxl_run], ids=["popart", "popxl"])
def test_two_stages_placed_give_the_numbers_of_one_device(front_end):
    one, s1 = front_end(1)
    two, s2 = front_end(2)
    assert not testing.is_placed(s1)
    assert testing.is_placed(s2) and testing.mesh_shape(s2) == (1, 2)   # really on two devices
    np.testing.assert_allclose(one, WANT, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two, one, rtol=1e-6, atol=1e-7)
    executor = testing.placed_plan(s2).executor   # the one placed executor ...
    assert isinstance(executor, Executor) and executor.mesh.shape == {"replica": 1, "ipu": 2}
    plan = executor.plan   # ... runs a stage plan, data
    assert isinstance(plan, StagePlan) and plan.num_stages == 2 and plan.stage_ipu == [0, 1]
    [], (copy,) = executor.graph.copies   # the IpuCopy, a node (PopART's InterIpuCopy)
    assert copy.op_type == "IpuCopy" and copy.attrs == {"sourceIpu": 0, "destIpu": 1}
    (h,) = plan.boundary[0]
    assert copy.inputs == [h] and copy.outputs == [f"{h}_c1"]
    assert any(f"{h}_c1" in n.inputs for n in executor.graph.ops[1])   # its reader reads it
    if front_end is popart_run:   # the step program composes its placed plan: no subclass
        from popart.engine import pipeline
        from popart.engine.program import StepProgram
        assert type(testing.step_program(s2)) is StepProgram and not hasattr(pipeline, "PlacedProgram")
        assert isinstance(testing.placed_plan(s2), pipeline.PlacedPlan)
        assert testing.placed_plan(s1) is None


def test_in_order_copies_go_straight_to_the_ipus_reading_once():
    """popxl's copies (no pipelining): a tensor goes from the IPU computing it straight to
    each IPU that reads it, once, before the first stage there that reads it; the pipeline's
    copies relay it stage to stage."""
    from popart.engine.graph_api import Node
    from popart.engine.placed import copied, plan_stages
    nodes = [Node("Relu", ["x"], ["a"]), Node("Relu", ["a"], ["b"]),
             Node("Add", ["a", "b"], ["c"]), Node("Add", ["a", "c"], ["d"])]
    ipu = {"a": 0, "b": 1, "c": 0, "d": 1}
    plan = plan_stages(nodes, lambda n: ipu[n.outputs[0]])
    assert plan.stage_ipu == [0, 1, 0, 1]
    gives = [{"a"}, {"b"}, {"c"}, {"d"}]
    got = [[(c.inputs[0], c.attrs["sourceIpu"], c.attrs["destIpu"]) for c in cs]
           for cs in copied(plan, gives).copies]
    assert got == [[], [("a", 0, 1)], [("b", 1, 0)], [("c", 0, 1)]]   # 'a' to IPU 1 once
    assert copied(plan, gives).ops[3][0].inputs == ["a_c1", "c_c1"]   # 'd' reads the first copy
    chained = [[(c.inputs[0], c.attrs["sourceIpu"], c.attrs["destIpu"]) for c in cs]
               for cs in copied(plan).copies]
    assert chained == [[], [("a", 0, 1)], [("a_c1", 1, 0), ("b", 1, 0)],
                       [("a_c1_c0", 0, 1), ("c", 0, 1)]]


def test_shard_map_only_in_the_compiled_step_layer_and_the_executor():
    """``shard_map`` is called from engine/compiled.py and engine/placed.py only (none in
    popxl, none in the other engine modules)."""
    import pathlib
    import re
    src = pathlib.Path(popart.__file__).resolve().parent.parent
    calls = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                   if re.search(r"\bshard_map\s*\(|jax\.shard_map\b|experimental\.shard_map",
                                p.read_text()))
    assert calls == ["popart/engine/compiled.py", "popart/engine/placed.py"], calls


def test_in_order_run_refuses_a_stage_tensor_no_ipu_copy_brought():
    """The in-order run moves stage tensors only by the plan's copies: a stage reading a
    tensor of an earlier stage on another IPU that no IpuCopy brought is an internal error
    (planning: the stages run directly, so no mesh is needed to reach the check)."""
    from popart.engine.graph_api import Node
    from popart.engine.placed import InOrder, copied, plan_stages
    plan = plan_stages([Node("Relu", ["x"], ["a"]), Node("Neg", ["a"], ["b"])],
                       lambda n: 0 if n.outputs == ["a"] else 1)
    fn = lambda state, received: (state, {"a": np.float32(1)})   # noqa: E731
    run = InOrder(plan, 2, copied(plan, [set(), set()]), lambda t: None)   # no copies
    run.run(0, fn, None, {})
    with pytest.raises(RuntimeError, match=r"no IpuCopy of \['a'\] to IPU 1 before stage 1"):
        run.run(1, fn, None, {})
    assert [len(c) for c in copied(plan, [{"a"}, {"b"}]).copies] == [0, 1]   # the graph has it
