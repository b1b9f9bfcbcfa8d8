"""The oneDNN matmul custom call (popart.engine.onednn.linear) against NumPy and onnxruntime,
the inference-only MatMul / Gemm (+ Relu) dispatch, and its fallback to XLA's dot."""
from __future__ import annotations

import re

import jax
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart
import popart.testing
from popart.engine import onednn
from popart.ops import nn

needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="the oneDNN custom call cannot be built or loaded here "
                                         "(onednn-cpu-gomp / onednn-devel-cpu-gomp, g++)")
RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def matmul_on(monkeypatch):
    """The dispatch is opt-in (POPART_ONEDNN_MATMUL=1): on for these tests unless one says."""
    monkeypatch.setenv("POPART_ONEDNN_MATMUL", "1")


def _ref(a, w, bias, trans_b, relu):
    y = a.astype(np.float64) @ (w.T if trans_b else w).astype(np.float64)
    y = y if bias is None else y + bias
    return np.maximum(y, 0) if relu else y


@needs_onednn
@pytest.mark.parametrize("trans_b", [True, False], ids=["transB", "plain"])
@pytest.mark.parametrize("bias, relu", [(False, False), (True, False), (True, True),
                                        (False, True)], ids=["mm", "bias", "bias-relu", "relu"])
def test_linear_matches_numpy(trans_b, bias, relu):
    a = RNG.standard_normal((5, 7), dtype=np.float32)
    w = RNG.standard_normal((3, 7) if trans_b else (7, 3), dtype=np.float32)
    b = RNG.standard_normal(3, dtype=np.float32) if bias else None
    y = jax.jit(lambda a, w, b: onednn.linear(a, w, b, trans_b, relu))(a, w, b)
    assert y.shape == (5, 3)
    np.testing.assert_allclose(y, _ref(a, w, b, trans_b, relu), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_leading_dims_vmap_and_empty_operands():
    a = RNG.standard_normal((2, 4, 6), dtype=np.float32)        # leading dims fold into M
    w = RNG.standard_normal((6, 5), dtype=np.float32)
    b = RNG.standard_normal(5, dtype=np.float32)
    np.testing.assert_allclose(onednn.linear(a, w, b, False, True), _ref(a, w, b, False, True),
                               rtol=1e-5, atol=1e-5)
    ws = RNG.standard_normal((3, 6, 5), dtype=np.float32)        # batched weights: a loop
    ys = jax.vmap(lambda a, w: onednn.linear(a, w, b, False, False))(a[:1].repeat(3, 0), ws)
    np.testing.assert_allclose(ys, [_ref(a[0], wi, b, False, False) for wi in ws],
                               rtol=1e-5, atol=1e-5)
    empty_k = onednn.linear(np.zeros((3, 0), np.float32), np.zeros((0, 2), np.float32),
                            np.array([1, -1], np.float32), False, True)
    np.testing.assert_array_equal(empty_k, [[1, 0]] * 3)
    assert onednn.linear(np.zeros((0, 4), np.float32), w[:4], None, False, False).shape == (0, 5)


@needs_onednn
def test_gradients_are_xlas_dots():
    a = RNG.standard_normal((2, 4, 6), dtype=np.float32)
    w = RNG.standard_normal((5, 6), dtype=np.float32)
    b = RNG.standard_normal(5, dtype=np.float32)

    def loss(f):
        return lambda a, w, b: (f(a, w, b) ** 2).sum()
    ours = jax.grad(loss(lambda a, w, b: onednn.linear(a, w, b, True, True)), (0, 1, 2))(a, w, b)
    xla = jax.grad(loss(lambda a, w, b: jax.nn.relu(a @ w.T + b)), (0, 1, 2))(a, w, b)
    for g, r in zip(ours, xla):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ through a session
def _mlp_model():
    """Gemm(transB) + Relu, Gemm(no bias) , MatMul + Add + Relu: the shapes of a small MLP."""
    w1 = RNG.standard_normal((16, 12), dtype=np.float32) * 0.3
    b1 = RNG.standard_normal(16, dtype=np.float32)
    w2 = RNG.standard_normal((16, 8), dtype=np.float32) * 0.3
    w3 = RNG.standard_normal((8, 4), dtype=np.float32) * 0.3
    b3 = RNG.standard_normal(4, dtype=np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["g1"], transB=1),
             helper.make_node("Relu", ["g1"], ["r1"]),
             helper.make_node("Gemm", ["r1", "w2"], ["g2"]),
             helper.make_node("MatMul", ["g2", "w3"], ["m3"]),
             helper.make_node("Add", ["m3", "b3"], ["a3"]),
             helper.make_node("Relu", ["a3"], ["y"])]
    inits = [numpy_helper.from_array(v, k) for k, v in
             dict(w1=w1, b1=b1, w2=w2, w3=w3, b3=b3).items()]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [6, 12])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


MODEL = _mlp_model()
X = RNG.standard_normal((3, 6, 12), dtype=np.float32)
ORT = np.stack([ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"]).run(
    None, {"x": xi})[0] for xi in X])


def _session(bps, opts=None):
    s = popart.InferenceSession(MODEL, popart.DataFlow(bps, {"y": popart.AnchorReturnType("ALL")}),
                                popart.DeviceManager().createCpuDevice(),
                                userOptions=opts or popart.SessionOptions())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": X[:bps] if bps > 1 else X[0]}, anchors))
    return s, anchors["y"].reshape(-1, 6, 4)


def _flags(session) -> list[str]:
    """The oneDNN matmul calls of the compiled step, by their mm flags (trans_b, bias, relu)."""
    hlo = popart.testing.compiled(session).as_text()
    calls = [ln for ln in hlo.splitlines() if f'"{onednn.MATMUL_TARGET}"' in ln]
    return [re.search(r"mm = dense<([^>]*)>", ln).group(1) for ln in calls]


@needs_onednn
@pytest.mark.parametrize("bps", [1, 3])
def test_inference_session_runs_matmuls_on_onednn_with_relu_fused(bps):
    s, y = _session(bps)
    np.testing.assert_allclose(y, ORT[:bps], rtol=1e-5, atol=1e-5)
    # Gemm+Relu fused (the unfused product is dead code), Gemm without bias, MatMul (its Add
    # stays XLA's, so its Relu does too); a splat dense<1> is [1, 1, 1], dense<0> [0, 0, 0].
    assert sorted(_flags(s)) == ["0", "0", "1"]


@needs_onednn
def test_switched_off_and_training_stay_on_xla():
    with nn.onednn_off():
        s, y = _session(3)
    assert _flags(s) == []
    np.testing.assert_allclose(y, ORT, rtol=1e-5, atol=1e-5)
    # Training keeps XLA's dots (the same numbers as before).
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [6, 12]))
    w = b.addInitializedInputTensor(RNG.standard_normal((12, 4), dtype=np.float32))
    out = b.aiOnnx.relu([b.aiOnnx.matmul([x, w])])
    loss = b.aiGraphcore.l1loss([out], 0.1)
    ts = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss=loss,
                                optimizer=popart.ConstSGD(0.01),
                                deviceInfo=popart.DeviceManager().createCpuDevice())
    ts.prepareDevice()
    assert onednn.MATMUL_TARGET not in popart.testing.lowered_text(ts)


@needs_onednn
def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("POPART_ONEDNN_MATMUL")
    assert not onednn.matmul_enabled()
    s, y = _session(1)
    assert _flags(s) == []
    np.testing.assert_allclose(y, ORT[:1], rtol=1e-5, atol=1e-5)


def test_dispatch_rules():
    assert onednn.prefers_matmul(128, 784, 512) and onednn.prefers_matmul(4096, 512, 10)
    assert not onednn.prefers_matmul(1024, 256, 1024)      # BERT's rows: XLA's dot
    assert not onednn.prefers_matmul(128, 0, 512)


@needs_onednn
def test_engine_cache_holds_the_target(tmp_path):
    opts = popart.SessionOptions()
    opts.enableEngineCaching, opts.cachePath = True, str(tmp_path)
    sources = []
    for _ in range(2):
        s, y = _session(1, opts)
        np.testing.assert_allclose(y, ORT[:1], rtol=1e-5, atol=1e-5)
        sources.append(popart.testing.executable_source(s))
    assert sources == ["compiled (cached)", "engine cache"]
    entry = next(tmp_path.glob("InferenceSession-*.popef"))
    assert onednn.MATMUL_TARGET.encode() in entry.read_bytes()


def test_fallback_when_switched_off(monkeypatch):
    """POPART_ONEDNN=0: available() is False and the session's products are XLA's dots."""
    was = onednn.available()
    monkeypatch.setenv("POPART_ONEDNN", "0")
    onednn.available.cache_clear()
    try:
        assert not onednn.available()
        s, y = _session(1)
        assert onednn.MATMUL_TARGET not in popart.testing.lowered_text(s)
        np.testing.assert_allclose(y, ORT[:1], rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.undo()
        onednn.available.cache_clear()
        assert onednn.available() == was


@needs_onednn
def test_mismatched_shapes_are_xlas_error():
    with pytest.raises(Exception, match="do not match"):
        jax.jit(lambda a, w: onednn.linear(a, w, None, False, False))(
            np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
