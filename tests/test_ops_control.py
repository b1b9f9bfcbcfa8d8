"""If / Loop / Scan (ai.onnx) and Call (ai.graphcore), built with sub-graph Builders and run by
the op tester, against the ONNX reference evaluator or onnxruntime; the gradient through a
Loop's scan outputs (a TrainingSession)."""
import numpy as np
import pytest

import popart

from op_tester import RefData

GRAD = popart.reservedGradientPrefix()
ORT, REF = RefData.onnxruntime, RefData.onnx_reference
OPSETS = {"ai.onnx": 16}
RNG = np.random.default_rng(0)


@pytest.fixture
def op_tester(op_tester):
    op_tester.opsets = OPSETS
    op_tester.rtol, op_tester.atol = 1e-4, 1e-5
    return op_tester


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def if_model(condition, x, static=False, else_reduces=False):
    """If(condition) then x * x else -x (or ReduceSum(x), of another shape)."""
    def init_builder(builder):
        c = (builder.addInitializedInputTensor(condition) if static
             else builder.addInputTensor(condition))
        xi = builder.addInputTensor(x)
        then_b, else_b = builder.createSubgraphBuilder(), builder.createSubgraphBuilder()
        then_b.addOutputTensor(then_b.aiOnnx.mul([xi, xi]))
        else_b.addOutputTensor(else_b.aiOnnx.reducesum([xi], keepdims=1) if else_reduces
                               else else_b.aiOnnx.neg([xi]))
        return builder.aiOnnx.logical_if([c], 1, else_b, then_b)
    return init_builder


def test_if_dynamic_and_static_condition(op_tester):
    x = rnd(3)
    for c in (True, False):
        op_tester.run(if_model(np.array(c), x), REF)
    op_tester.run(if_model(np.array(False), x, static=True), lambda ref: [-x], rtol=0, atol=0)


def test_if_mismatched_branches_is_a_clear_error(op_tester):
    with pytest.raises(Exception, match="same shapes"):
        op_tester.run(if_model(np.array(True), rnd(3), else_reduces=True), None)


def loop_body(builder, x, cond_expr=False):
    """Body (i, c_in, v_in): v_out = v_in + x, scan_out = v_out * i; the condition is kept,
    or with ``cond_expr`` becomes sum(v_out) < 10 (and no scan output)."""
    body = builder.createSubgraphBuilder()
    i = body.addInputTensor("INT64", [], "i")
    c_in = body.addInputTensor("BOOL", [], "c_in")
    v_in = body.addInputTensor("FLOAT", [2], "v_in")
    v_out = body.aiOnnx.add([v_in, x])
    if cond_expr:
        s = body.aiOnnx.reducesum([v_out], keepdims=0)
        outs = [body.aiOnnx.less([s, body.aiOnnx.constant(np.array(10, np.float32))]), v_out]
    else:
        scan_out = body.aiOnnx.mul([v_out, body.aiOnnx.cast([i], to="FLOAT")])
        outs = [body.aiOnnx.identity([c_in]), v_out, scan_out]
    for o in outs:
        body.addOutputTensor(o)
    return body


def loop_model(trip, cond, v0, x, cond_expr=False, num_outputs=1, grad=False):
    """Loop(trip, cond, v0) of loop_body; ``trip`` / ``cond``: an array fed, a constant
    (``("const", value)``) or None (omitted)."""
    def init_builder(builder):
        def operand(spec):
            if spec is None:
                return ""
            if isinstance(spec, tuple):
                return builder.aiOnnx.constant(spec[1])
            return builder.addInputTensor(spec)
        m, c = operand(trip), operand(cond)
        vi, xi = builder.addInputTensor(v0), builder.addInputTensor(x)
        outs = builder.aiOnnx.loop([m, c, vi], num_outputs, loop_body(builder, xi, cond_expr))
        return outs[::-1] + [GRAD + xi] if grad else outs
    return init_builder


def test_loop_static_trip_count_with_scan_outputs_and_grad(op_tester):
    """scans[i] = (v0 + (i+1) x) * i, so d(sum(scans * G))/dx = sum_i i (i+1) G[i]."""
    v0, x = rnd(2), rnd(2)
    i = np.arange(4)[:, None]

    def reference(ref):
        v, scans = ref.onnxruntime()[1::-1]
        return [scans, v, ((i * (i + 1)) * ref.getOutputTensorGrad(0)).sum(0).astype(np.float32)]

    scans, _, _ = op_tester.run(loop_model(("const", np.array(4, np.int64)), None, v0, x,
                                           num_outputs=2, grad=True),
                                reference, step_type="train")
    assert scans.shape == (4, 2)


def test_loop_data_dependent_condition(op_tester):
    x = np.array([1.0, 2.0], np.float32)
    v0, true = np.zeros(2, np.float32), ("const", np.array(True))
    # no trip count: while_loop
    (v,) = op_tester.run(loop_model(None, true, v0, x, cond_expr=True), REF)
    np.testing.assert_allclose(v, [4, 8])
    # static trip count that the condition cuts short: masked scan
    (v,) = op_tester.run(loop_model(("const", np.array(2, np.int64)), true, v0, x, cond_expr=True),
                         REF)
    np.testing.assert_allclose(v, [2, 4])
    # run-time trip count
    op_tester.run(loop_model(np.array(3, np.int64), None, v0, x, cond_expr=True),
                  lambda ref: [np.float32([3, 6])])


def test_loop_scan_outputs_need_static_trip_count(op_tester):
    with pytest.raises(Exception, match="trip count"):
        op_tester.run(loop_model(np.array(3, np.int64), None, rnd(2), rnd(2), num_outputs=2), None)


def scan_model(s0, x, w, scan_axis=0, opset9=True, **attrs):
    """Scan over x (slices of shape [3]): state s + xi, scan output xi * w (w a weight)."""
    def init_builder(builder):
        si, xi = builder.addInputTensor(s0), builder.addInputTensor(x)
        wi = builder.addInitializedInputTensor(w)
        body = builder.createSubgraphBuilder()
        s_in, x_in = body.addInputTensor("FLOAT", [3]), body.addInputTensor("FLOAT", [3])
        body.addOutputTensor(body.aiOnnx.add([s_in, x_in]))
        body.addOutputTensor(body.aiOnnx.mul([x_in, wi]))
        inputs = [si, xi] if opset9 else ["", si, xi]
        return builder.aiOnnx.scan(inputs, 2, body, num_scan_inputs=1, **attrs)
    return init_builder


@pytest.mark.parametrize("attrs", [{}, {"scan_input_axes": [1], "scan_output_axes": [1]},
                                   {"scan_input_directions": [1]},
                                   {"scan_output_directions": [1], "scan_input_axes": [-1]}])
def test_scan9(op_tester, attrs):
    ax = attrs.get("scan_input_axes", [0])[0]
    x = rnd(4, 3) if ax == 0 else rnd(3, 4)  # the body sees slices of shape [3]

    def popart_scan(ref):   # PopART's ScanOp concatenates the body's [3] outputs: [12]
        s, ys = ref.onnxruntime()
        return [s, np.moveaxis(ys, attrs.get("scan_output_axes", [0])[0], 0).reshape(-1)]
    op_tester.run(scan_model(rnd(3), x, rnd(3), **attrs), popart_scan)


def test_scan8_batched(op_tester):
    s0, x, w = rnd(2, 3), rnd(2, 4, 3), rnd(3)
    s, _ = op_tester.run(scan_model(s0, x, w, opset9=False), lambda ref: [None, x * w],
                         opsets={"ai.onnx": 8}, rtol=1e-6, atol=0)
    np.testing.assert_allclose(s, s0 + x.sum(1), rtol=1e-5)


def test_call(op_tester):
    x, y, k = rnd(2), rnd(2), rnd(2)

    def init_builder(builder):
        xi, yi, ki = (builder.addInputTensor(v) for v in (x, y, k))
        callee = builder.createSubgraphBuilder()
        a, b = callee.addInputTensor("FLOAT", [2]), callee.addInputTensor("FLOAT", [2])
        callee.addOutputTensor(callee.aiOnnx.add([callee.aiOnnx.mul([a, b]), ki]))
        return builder.aiGraphcore.call([xi, yi], 1, callee)

    op_tester.run(init_builder, lambda ref: [x * y + k], rtol=1e-6, atol=1e-7)
