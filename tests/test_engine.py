"""Engine-level behaviour: constant folding, loop randomness, vectorised inference."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from popart.engine.program import vector_chunk
from popart.engine.shapes import run_model
import pytest

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly


def _model(nodes, inputs, outputs, opset=13, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_shape_arithmetic_is_folded_for_static_inputs():
    """Shape -> Gather -> Concat -> Reshape, as PyTorch exports write it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    idx = onnx.numpy_helper.from_array(np.array(0, np.int64), "idx")
    minus1 = onnx.numpy_helper.from_array(np.array([-1], np.int64), "m1")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "idx"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax"], ["b1"]),
             helper.make_node("Concat", ["b1", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    ax = onnx.numpy_helper.from_array(np.array([0], np.int64), "ax")
    data = np.random.rand(2, 3, 4).astype(np.float32)
    out = run_model(_model(nodes, [x], [y], inits=[idx, minus1, ax]), {"x": data})
    np.testing.assert_array_equal(out["y"], data.reshape(2, 12))


def test_random_op_in_loop_body_differs_per_iteration():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("RandomUniform", [], ["r"], shape=[4], dtype=TensorProto.FLOAT)],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [4])])
    trip = onnx.numpy_helper.from_array(np.array(3, np.int64), "trip")
    cond = onnx.numpy_helper.from_array(np.array(True), "cond")
    out = helper.make_tensor_value_info("rs", TensorProto.FLOAT, None)
    m = _model([helper.make_node("Loop", ["trip", "cond"], ["rs"], body=body)], [], [out],
               inits=[trip, cond])
    rs = run_model(m, {})["rs"]
    assert rs.shape == (3, 4)
    assert not np.allclose(rs[0], rs[1]) and not np.allclose(rs[1], rs[2])


def test_if_with_constant_condition_reads_traced_outer_tensor():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [3])])
    c = onnx.numpy_helper.from_array(np.array(True), "c")
    m = _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], [x], [y], inits=[c])
    data = np.array([1, -2, 3], np.float32)
    np.testing.assert_array_equal(run_model(m, {"x": data})["y"], -data)


def test_vector_chunk():
    assert vector_chunk(10, 1000) == 10
    assert vector_chunk(10, 1 << 21, budget=1 << 22) == 2
    assert vector_chunk(7, 1 << 30) == 1
    assert vector_chunk(10, 1000, budget=1) == 1


def test_channels_last_conv_gradients_equal_jax_autodiff():
    """conv_last's hand-written VJP (fast inside loops) against JAX's own, over strides,
    dilations, input dilation (ConvTranspose), groups and asymmetric padding."""
    import jax
    from popart.ops.nn import _conv, conv_last

    rs = np.random.RandomState(0)
    cases = [(1, 1, 1, 1, 1, (0, 0)), (2, 2, 1, 1, 1, (1, 2)), (2, 1, 2, 1, 2, (1, 1)),
             (2, 2, 2, 2, 1, (0, 0)), (1, 2, 1, 2, 2, (2, 0)), (2, 1, 1, 2, 2, (1, 2))]
    for n, s, rd, ld, g, pad in cases:   # (spatial dims, stride, dilation, input dilation, groups, pads)
        x = rs.randn(2, *(7, 6)[:n], 4)
        w = rs.randn(*(3, 2)[:n], 4 // g, 6)
        args = ((s,) * n, (pad,) * n, (ld,) * n, (rd,) * n, g)
        y, vjp_ref = jax.vjp(lambda x, w: _conv(x, w, *args), x, w)
        dy = rs.randn(*y.shape)
        _, vjp = jax.vjp(lambda x, w: conv_last(x, w, *args), x, w)
        for a, b in zip(vjp(dy), vjp_ref(dy)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_compile_progress_shows_for_slow_compiles_only(capsys, monkeypatch):
    import time

    from popart.engine.progress import compile_progress

    monkeypatch.delenv("POPART_PROGRESS", raising=False)
    with compile_progress("'fast'", delay=1.0):
        pass
    assert capsys.readouterr().err == ""
    with compile_progress("'slow'", delay=0.01):
        time.sleep(0.1)
    err = capsys.readouterr().err
    assert "Compiled 'slow' in" in err
    monkeypatch.setenv("POPART_PROGRESS", "0")
    with compile_progress("'quiet'", delay=0.0):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""
