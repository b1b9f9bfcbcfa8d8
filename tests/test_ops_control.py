"""If / Loop / Scan (ai.onnx) and Call (ai.graphcore) against the ONNX reference evaluator."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import jax
import jax.numpy as jnp

from popart.engine.lower import TraceState, execute
from popart.ir.onnx_import import import_model
from test_ops_nn import check, ours, rnd

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

F32, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
vi = helper.make_tensor_value_info


def model(nodes, inputs, outputs, opset=16, inits=(), extra_opsets=()):
    g = helper.make_graph(nodes, "m", inputs, [onnx.ValueInfoProto(name=o) for o in outputs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets], ir_version=10)


def body(nodes, inputs, outputs, name="body"):
    return helper.make_graph(nodes, name, inputs, [onnx.ValueInfoProto(name=o) for o in outputs])


def branches():
    then = body([helper.make_node("Mul", ["x", "x"], ["t"])], [], ["t"], "then")
    els = body([helper.make_node("Neg", ["x"], ["e"])], [], ["e"], "else")
    return then, els


def test_if_dynamic_and_static_condition():
    then, els = branches()
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els)],
              [vi("c", B, []), vi("x", F32, [3])], ["y"])
    x = rnd(3)
    for c in (True, False):
        check(m, {"c": np.array(c), "x": x}, ref="ref")
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els)],
              [vi("x", F32, [3])], ["y"], inits=[onnx.numpy_helper.from_array(np.array(False), "c")])
    np.testing.assert_array_equal(ours(m, {"x": x})[0], -x)


def test_if_mismatched_branches_is_a_clear_error():
    then = body([helper.make_node("Mul", ["x", "x"], ["t"])], [], ["t"])
    els = body([helper.make_node("ReduceSum", ["x"], ["e"], keepdims=1)], [], ["e"])
    m = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=els)],
              [vi("c", B, []), vi("x", F32, [3])], ["y"])
    with pytest.raises(Exception, match="same shapes"):
        ours(m, {"c": np.array(True), "x": rnd(3)})


def _loop_body(cond_expr=False):
    nodes = [helper.make_node("Add", ["v_in", "x"], ["v_out"]),
             helper.make_node("Cast", ["i"], ["i_f"], to=F32),
             helper.make_node("Mul", ["v_out", "i_f"], ["scan_out"])]
    if cond_expr:  # continue while sum(v) < 10
        nodes += [helper.make_node("ReduceSum", ["v_out"], ["s"], keepdims=0),
                  helper.make_node("Less", ["s", "ten"], ["c_out"])]
        outs = ["c_out", "v_out"]
    else:
        nodes += [helper.make_node("Identity", ["c_in"], ["c_out"])]
        outs = ["c_out", "v_out", "scan_out"]
    return helper.make_graph(nodes, "body", [vi("i", I64, []), vi("c_in", B, []), vi("v_in", F32, [2])],
                             [onnx.ValueInfoProto(name=o) for o in outs])


def test_loop_static_trip_count_with_scan_outputs_and_grad():
    m = model([helper.make_node("Loop", ["M", "", "v0"], ["v", "scans"], body=_loop_body())],
              [vi("v0", F32, [2]), vi("x", F32, [2])], ["v", "scans"],
              inits=[onnx.numpy_helper.from_array(np.array(4, np.int64), "M")])
    feeds = {"v0": rnd(2), "x": rnd(2)}
    v, scans = check(m, feeds)
    assert scans.shape == (4, 2)
    graph, _ = import_model(m)
    f = lambda x: jnp.sum(execute(graph, {"v0": feeds["v0"], "x": x}, TraceState())["scans"])
    # scans[i] = (v0 + (i+1) x) * i  ->  d/dx sum = sum_i i (i+1) = 0+2+6+12
    np.testing.assert_allclose(jax.grad(f)(jnp.asarray(feeds["x"])), [20, 20])


def test_loop_data_dependent_condition():
    ten = onnx.numpy_helper.from_array(np.array(10, np.float32), "ten")
    b = _loop_body(cond_expr=True)
    b.initializer.append(ten)
    x = np.array([1.0, 2.0], np.float32)
    feeds = {"v0": np.zeros(2, np.float32), "x": x}
    # no trip count: while_loop
    m = model([helper.make_node("Loop", ["", "c0", "v0"], ["v"], body=b)],
              [vi("v0", F32, [2]), vi("x", F32, [2])], ["v"],
              inits=[onnx.numpy_helper.from_array(np.array(True), "c0")])
    np.testing.assert_allclose(check(m, feeds, ref="ref")[0], [4, 8])
    # static trip count that the condition cuts short: masked scan
    m = model([helper.make_node("Loop", ["M", "c0", "v0"], ["v"], body=b)],
              [vi("v0", F32, [2]), vi("x", F32, [2])], ["v"],
              inits=[onnx.numpy_helper.from_array(np.array(True), "c0"),
                     onnx.numpy_helper.from_array(np.array(2, np.int64), "M")])
    np.testing.assert_allclose(check(m, feeds, ref="ref")[0], [2, 4])
    # run-time trip count
    m = model([helper.make_node("Loop", ["M", "", "v0"], ["v"], body=b)],
              [vi("M", I64, []), vi("v0", F32, [2]), vi("x", F32, [2])], ["v"])
    np.testing.assert_allclose(ours(m, dict(feeds, M=np.array(3, np.int64)))[0], [3, 6])


def test_loop_scan_outputs_need_static_trip_count():
    m = model([helper.make_node("Loop", ["M", "", "v0"], ["v", "s"], body=_loop_body())],
              [vi("M", I64, []), vi("v0", F32, [2]), vi("x", F32, [2])], ["v", "s"])
    with pytest.raises(Exception, match="trip count"):
        ours(m, {"M": np.array(3, np.int64), "v0": rnd(2), "x": rnd(2)})


def _scan_body():
    return helper.make_graph(
        [helper.make_node("Add", ["s_in", "xi"], ["s_out"]),
         helper.make_node("Mul", ["xi", "w"], ["yi"])],
        "body", [vi("s_in", F32, [3]), vi("xi", F32, [3])], [onnx.ValueInfoProto(name="s_out"),
                                                           onnx.ValueInfoProto(name="yi")])


@pytest.mark.parametrize("attrs", [{}, {"scan_input_axes": [1], "scan_output_axes": [1]},
                                   {"scan_input_directions": [1]},
                                   {"scan_output_directions": [1], "scan_input_axes": [-1]}])
def test_scan9(attrs):
    ax = attrs.get("scan_input_axes", [0])[0]
    x = rnd(4, 3) if ax == 0 else rnd(3, 4)  # the body sees slices of shape [3]
    m = model([helper.make_node("Scan", ["s0", "x"], ["s", "y"], body=_scan_body(), num_scan_inputs=1, **attrs)],
              [vi("s0", F32, [3]), vi("x", F32, list(x.shape))], ["s", "y"],
              inits=[onnx.numpy_helper.from_array(rnd(3), "w")])
    check(m, {"s0": rnd(3), "x": x})


def test_scan8_batched():
    b = _scan_body()
    m = model([helper.make_node("Scan", ["", "s0", "x"], ["s", "y"], body=b, num_scan_inputs=1)],
              [vi("s0", F32, [2, 3]), vi("x", F32, [2, 4, 3])], ["s", "y"], opset=8,
              inits=[onnx.numpy_helper.from_array(rnd(3), "w")])
    s0, x = rnd(2, 3), rnd(2, 4, 3)
    s, y = ours(m, {"s0": s0, "x": x})
    np.testing.assert_allclose(s, s0 + x.sum(1), rtol=1e-5)
    np.testing.assert_allclose(y, x * onnx.numpy_helper.to_array(m.graph.initializer[0]), rtol=1e-6)


def test_call():
    callee = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["c"]), helper.make_node("Add", ["c", "k"], ["d"])],
                               "callee", [vi("a", F32, [2]), vi("b", F32, [2])],
                               [onnx.ValueInfoProto(name="d")])
    m = model([helper.make_node("Call", ["x", "y"], ["z"], domain="ai.graphcore", callee=callee)],
              [vi("x", F32, [2]), vi("y", F32, [2]), vi("k", F32, [2])], ["z"],
              extra_opsets=[helper.make_opsetid("ai.graphcore", 1)])
    x, y, k = rnd(2), rnd(2), rnd(2)
    np.testing.assert_allclose(ours(m, {"x": x, "y": y, "k": k})[0], x * y + k, rtol=1e-6)
