"""Invalid models and inputs raise popart_exception naming the node or tensor, as onnx's
checker and ONNX Runtime do, never a wrong answer or a raw exception (issue 16, item 1), and
the fuzz harness's short run (item 2)."""
from __future__ import annotations

import os
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart
from popart import cli

F, I64 = TensorProto.FLOAT, TensorProto.INT64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(nodes, inputs, outputs, inits=(), opset=16) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _session(model, outs, bps=1, **kw):
    flow = popart.DataFlow(bps, {o: popart.AnchorReturnType("ALL") for o in outs})
    s = popart.InferenceSession(model, flow, popart.DeviceManager().createCpuDevice(), **kw)
    s.prepareDevice()
    return s


def _run(model, feeds, outs=("y",), bps=1):
    s = _session(model, list(outs), bps)
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO(feeds, anchors))
    return [anchors[o] for o in outs]


def _ort(model, feeds):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


X = np.arange(20, dtype=np.float32).reshape(4, 5)
# op, attrs, index input shape, valid indices, out-of-range indices, extra inputs
CASES = {
    "Gather": ({"axis": 1}, [2], np.array([4, -5]), np.array([1, 5]), {}),
    "GatherElements": ({"axis": 0}, [2, 5], np.array([[0, 3, -4, 1, 2]] * 2),
                       np.array([[0, 3, 4, 1, 2]] * 2), {}),
    "GatherND": ({}, [2, 2], np.array([[3, 4], [-1, 0]]), np.array([[3, 4], [0, -6]]), {}),
    "ScatterElements": ({"axis": 1, "reduction": "add"}, [4, 2], np.array([[0, 4]] * 4),
                        np.array([[0, 4]] * 3 + [[7, 0]]), {"u": np.ones((4, 2), np.float32)}),
    "ScatterND": ({}, [2, 1], np.array([[3], [-4]]), np.array([[3], [4]]),
                  {"u": np.ones((2, 5), np.float32)}),
}


def _index_model(op):
    attrs, shape, _, _, extra = CASES[op]
    ins = [_vi("x", F, [4, 5]), _vi("i", I64, shape)] + [_vi(k, F, v.shape) for k, v in extra.items()]
    node = helper.make_node(op, ["x", "i", *extra], ["y"], name=f"my{op}", **attrs)
    return _model([node], ins, [_vi("y", F, None)]), extra


@pytest.mark.parametrize("op", sorted(CASES))
def test_indices_checked_at_run(op):
    model, extra = _index_model(op)
    _, _, good, bad, _ = CASES[op]
    s = _session(model, ["y"])
    for idx in (good, bad):
        feeds = {"x": X, "i": idx, **extra}
        anchors = s.initAnchorArrays()
        if idx is good:   # valid indices (negative ones too): the same numbers as onnxruntime
            s.run(popart.PyStepIO(feeds, anchors))
            np.testing.assert_array_equal(anchors["y"], _ort(model, feeds)[0])
            continue
        with pytest.raises(Exception):   # onnxruntime raises too
            _ort(model, feeds)
        with pytest.raises(popart.popart_runtime_error, match=rf"{op} node 'my{op}': index -?\d+ in 'i' "
                           r"is out of range for axis \d of 'x' \(size \d"):
            s.run(popart.PyStepIO(feeds, anchors))
    s.run(popart.PyStepIO({"x": X, "i": good, **extra}, s.initAnchorArrays()))   # still usable


def test_bad_index_in_a_later_batch_and_constant_indices():
    model, _ = _index_model("Gather")
    s = _session(model, ["y"], bps=3)
    idx = np.array([[1, 2], [0, 4], [1, -6]])
    with pytest.raises(popart.popart_runtime_error, match="index -6 in 'i'"):
        s.run(popart.PyStepIO({"x": np.stack([X] * 3), "i": idx}, s.initAnchorArrays()))
    const = _model([helper.make_node("Gather", ["x", "k"], ["y"], axis=0)], [_vi("x", F, [4, 5])],
                   [_vi("y", F, None)], [numpy_helper.from_array(np.array([0, 9]), "k")])
    with pytest.raises(popart.popart_exception, match="index 9 in 'k' is out of range for axis 0"):
        _session(const, ["y"])


def _body():
    """A Loop body gathering row ``ii + off`` of the outer 'x' (4 rows, ``off`` an outer input)."""
    B = TensorProto.BOOL
    return helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Add", ["ii", "off"], ["at"]),
         helper.make_node("Gather", ["x", "at"], ["row"], axis=0, name="g_in_body"),
         helper.make_node("Add", ["acc", "row"], ["acc_out"])],
        "body", [_vi("ii", I64, []), _vi("cond", B, []), _vi("acc", F, [5])],
        [_vi("cond_out", B, []), _vi("acc_out", F, [5])])


@pytest.mark.parametrize("where", ["loop_scan", "loop_while", "if", "scan"])
def test_indices_checked_inside_control_flow(where):
    x, zero = _vi("x", F, [4, 5]), numpy_helper.from_array(np.zeros(5, np.float32), "zero")
    if where.startswith("loop"):   # a static trip count lowers to lax.scan, a run-time one to while_loop
        static = where == "loop_scan"
        inits = [zero] + ([numpy_helper.from_array(np.int64(4), "n")] if static else [])
        model = _model([helper.make_node("Loop", ["n", "", "zero"], ["y"], body=_body())],
                       [x, _vi("off", I64, [])] + ([] if static else [_vi("n", I64, [])]),
                       [_vi("y", F, None)], inits)
        feeds = [{"x": X, "off": np.int64(off), **({} if static else {"n": np.int64(4)})}
                 for off in (0, 1)]
    elif where == "if":
        branch = lambda name, i: helper.make_graph(
            [helper.make_node("Gather", ["x", i], [name], axis=0, name="g_in_branch")], name, [],
            [_vi(name, F, [5])])
        model = _model([helper.make_node("If", ["c"], ["y"], then_branch=branch("a", "i"),
                                         else_branch=branch("b", "zi"))],
                       [x, _vi("c", TensorProto.BOOL, []), _vi("i", I64, [])], [_vi("y", F, None)],
                       [numpy_helper.from_array(np.int64(0), "zi")])
        feeds = [{"x": X, "c": np.bool_(c), "i": np.int64(i)} for c, i in ((False, 9), (True, 9))]
    else:
        # j is a scalar in ONNX's Scan, [1] in PopART's (scan.cpp): the row is reshaped to [5]
        body = helper.make_graph(
            [helper.make_node("Gather", ["x", "j"], ["row"], axis=0, name="g_in_scan"),
             helper.make_node("Reshape", ["row", "five"], ["row5"]),
             helper.make_node("Add", ["acc", "row5"], ["acc_out"])],
            "body", [_vi("acc", F, [5]), _vi("j", I64, [])], [_vi("acc_out", F, [5])])
        model = _model([helper.make_node("Scan", ["zero", "js"], ["y"], body=body, num_scan_inputs=1)],
                       [x, _vi("js", I64, [3])], [_vi("y", F, None)],
                       [zero, numpy_helper.from_array(np.array([5]), "five")])
        feeds = [{"x": X, "js": np.array(j)} for j in ([0, 3, -4], [0, 4, 1])]
    s = _session(model, ["y"])
    good, bad = feeds
    s.run(popart.PyStepIO(good, s.initAnchorArrays()))   # the valid run is unchanged
    with pytest.raises(Exception):
        _ort(model, bad)
    with pytest.raises(popart.popart_runtime_error, match=r"Gather node 'g_in_\w+': index (4|9) in"):
        s.run(popart.PyStepIO(bad, s.initAnchorArrays()))


def test_indices_checked_in_training():
    b = popart.Builder(opsets={"ai.onnx": 13, "ai.graphcore": 1})
    w = b.addInitializedInputTensor(np.ones((4, 3), np.float32))
    i = b.addInputTensor(popart.TensorInfo("INT32", [2]))
    loss = b.aiGraphcore.l1loss([b.aiOnnx.gather([w, i], axis=0)], 1.0)
    flow = popart.DataFlow(1, {loss: popart.AnchorReturnType("ALL")})
    s = popart.TrainingSession(b.getModelProto(), flow, loss, popart.ConstSGD(0.1),
                               popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    s.run(popart.PyStepIO({i: np.array([0, 3], np.int32)}, s.initAnchorArrays()))
    with pytest.raises(popart.popart_runtime_error, match="index 4 in"):
        s.run(popart.PyStepIO({i: np.array([0, 4], np.int32)}, s.initAnchorArrays()))


def test_axis_out_of_range():
    b = popart.Builder(opsets={"ai.onnx": 13, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 5]))
    i = b.addInputTensor(popart.TensorInfo("INT64", [2]))
    with pytest.raises(popart.popart_exception) as e:
        b.aiOnnx.gather([x, i], axis=2)          # at build time
    assert e.value.args[0] == "GatherOp::setup axis = 2 is outside the acceptable range [-2, 1]"
    texts = {"Gather": "GatherOp::setup axis = -3 is outside the acceptable range [-2, 1]",
             "Softmax": "Axis 2 is out of acceptable range [-2, 1]",
             "Concat": "Attribute 'axis' of ConcatOp, 5, is outside of acceptable range [-2, 1]"}
    for op, attrs in [("Gather", {"axis": -3}), ("Softmax", {"axis": 2}), ("Concat", {"axis": 5})]:
        ins = ["x", "i"] if op == "Gather" else ["x", "x"] if op == "Concat" else ["x"]
        model = _model([helper.make_node(op, ins, ["y"], name="n", **attrs)],
                       [_vi("x", F, [4, 5]), _vi("i", I64, [2])][:len(set(ins))], [_vi("y", F, None)])
        with pytest.raises(popart.popart_exception) as e:   # PopART's text; the node in a note
            _session(model, ["y"])               # at construction
        assert e.value.args[0] == texts[op] and f"{op} node 'n'" in e.value.__notes__[0]


def test_input_and_anchor_dtypes_are_checked():
    model, _ = _index_model("Gather")
    s = _session(model, ["y"])
    anchors = s.initAnchorArrays()
    with pytest.raises(popart.popart_exception, match=r"Input tensor 'x'.*data type int64 does not "
                       r"match float32"):
        s.run(popart.PyStepIO({"x": X.astype(np.int64), "i": np.array([0, 1])}, anchors))
    with pytest.raises(popart.popart_exception, match=r"anchor 'y' has dtype float64, but the "
                       r"tensor is float32"):
        s.run(popart.PyStepIO({"x": X, "i": np.array([0, 1])}, {"y": np.zeros((4, 2))}))


def test_no_implicit_promotion():
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
                   [_vi("a", F, [2, 3]), _vi("b", I64, [3, 2])], [_vi("y", F, None)])
    with pytest.raises(Exception):
        _ort(model, {"a": np.ones((2, 3), np.float32), "b": np.ones((3, 2), np.int64)})
    with pytest.raises(popart.popart_exception, match=r"MatMul node 'mm': input 1 \('b'\) is int64 "
                       r"but input 0 \('a'\) is float32"):
        _session(model, ["y"])


def test_graph_structure_errors():
    relu = helper.make_node("Relu", ["t"], ["y"], name="r")
    neg = helper.make_node("Neg", ["x"], ["t"], name="n")
    io = ([_vi("x", F, [2])], [_vi("y", F, None)])
    # Out of order (onnxruntime sorts too): runs.
    np.testing.assert_array_equal(_run(_model([relu, neg], *io), {"x": np.array([1, -2], np.float32)})[0],
                                  [0, 2])
    cycle = _model([helper.make_node("Add", ["x", "y"], ["t"], name="a"), relu], *io)
    with pytest.raises(popart.popart_exception, match="has a cycle: nodes 'a' \\(Add\\), 'r'"):
        _session(cycle, ["y"])
    twice = _model([neg, helper.make_node("Abs", ["x"], ["t"], name="b"), relu], *io)
    with pytest.raises(popart.popart_exception, match="tensor 't' is written by node 'b'"):
        _session(twice, ["y"])
    arity = _model([neg, helper.make_node("Relu", ["t", "x"], ["y"], name="r2")], *io)
    with pytest.raises(popart.popart_exception, match="Relu node 'r2'.* input size 2"):
        _session(arity, ["y"])


def test_lowering_errors_name_the_node(tmp_path, capsys):
    # Incompatible MatMul shapes: PopART's check (matmul.cpp), a popart error naming the node.
    model = _model([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
                   [_vi("a", F, [2, 3]), _vi("b", F, [4, 2])], [_vi("y", F, None)])
    with pytest.raises(popart.popart_exception, match=r"Op\(mm \(ai.onnx.MatMul:13\).* "
                                                      "contracting dimensions unequal"):
        _session(model, ["y"])
    path = tmp_path / "m.onnx"
    path.write_bytes(model)
    assert cli.main(["run", str(path), "--runs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("popart: error:") and "Op(mm " in err and "internal" not in err


def test_fuzz_short_run():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import fuzz
    records = fuzz.fuzz(40, seed=1, jobs=2, timeout=120, log=print)
    print(fuzz.summary(records))
    bad = [r for r in records if r["outcome"] in fuzz.BAD]
    assert not bad, bad


def test_popxl_gather_checks_indices_or_zeroes_them():
    import popxl
    import popxl.ops as ops
    ir = popxl.Ir()
    with ir.main_graph:
        i_stream = popxl.h2d_stream([2], popxl.int32, "i")
        x, i = popxl.variable(X, name="x"), ops.host_load(i_stream, "i")
        streams = {}
        for name, zero in (("checked", False), ("zeroed", True)):
            y = ops.gather(x, i, zero_OOR=zero)
            streams[name] = popxl.d2h_stream(y.shape, y.dtype, name)
            ops.host_store(streams[name], y)
    with popxl.Session(ir, "cpu") as s:
        out = s.run({i_stream: np.array([3, -1], np.int32)})
        np.testing.assert_array_equal(out[streams["checked"]], X[[3, -1]])
        with pytest.raises(popart.popart_runtime_error, match="index 4 in"):
            s.run({i_stream: np.array([4, 0], np.int32)})
    ir = popxl.Ir()
    with ir.main_graph:
        y = ops.gather(popxl.variable(X), popxl.constant(np.array([4, -5, 1], np.int32)), zero_OOR=True)
        st = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(st, y)
    with popxl.Session(ir, "cpu") as s:
        np.testing.assert_array_equal(s.run()[st], [np.zeros(5), np.zeros(5), X[1]])
