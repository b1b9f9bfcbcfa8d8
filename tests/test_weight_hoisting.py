"""Weight hoisting in inference (popart.engine.hoist) and oneDNN's matmul on packed weights
(popart.engine.onednn matmul / pack): outputs against onnxruntime, NumPy and the unhoisted
step; the derived values follow writeWeights and resetHostWeights; values that would grow stay
in the step; the pack runs once per weights version."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart
from popart.engine import hoist, onednn

needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="the oneDNN custom call cannot be built or loaded here")
K, H, N, ROWS, BPS = 64, 128, 192, 32, 3
RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((H, K), dtype=np.float32)   # held transposed: Transpose -> MatMul
W2 = RNG.standard_normal((N, H), dtype=np.float32)   # Gemm transB=1
BIAS = RNG.standard_normal((N,), dtype=np.float32)
X = RNG.standard_normal((BPS, ROWS, K), dtype=np.float32)


def model(w1=W1, w2=W2, bias=BIAS) -> bytes:
    """y = Gemm(relu(x @ W1^T), W2, transB) + Expand(bias, [ROWS, N]) (a broadcast of a
    weight: larger than the weight, so it stays in the step)."""
    nodes = [helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w1t"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["g"], transB=1),
             helper.make_node("Expand", ["bias", "shape"], ["b"]),
             helper.make_node("Add", ["g", "b"], ["y"])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(bias, "bias"),
             numpy_helper.from_array(np.array([ROWS, N], np.int64), "shape")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def numpy_ref(x, w1=W1, w2=W2, bias=BIAS):
    return np.maximum(x @ w1.T, 0) @ w2.T + bias


def session(hoisted: bool = True):
    old = os.environ.get("POPART_HOIST")
    os.environ["POPART_HOIST"] = "1" if hoisted else "0"
    try:
        opts = popart.SessionOptions()
        opts.constantWeights = False
        s = popart.InferenceSession(model(), popart.DataFlow(BPS, {"y": popart.AnchorReturnType("All")}),
                                    popart.DeviceManager().createCpuDevice(), userOptions=opts)
        s.prepareDevice()
    finally:
        os.environ.pop("POPART_HOIST") if old is None else os.environ.__setitem__("POPART_HOIST", old)
    s.weightsFromHost()
    return s


def run(s) -> np.ndarray:
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": X}, anchors))
    return anchors["y"].copy()


@pytest.fixture(scope="module")
def hoisted():
    return session(True)


@pytest.fixture(scope="module")
def plain():
    return session(False)


def test_hoisted_matches_unhoisted_and_onnxruntime(hoisted, plain):
    assert isinstance(hoisted._program.step, hoist.HoistedStep) and hoisted._program.step.derive
    assert plain._program.step.__class__.__name__ == "CompiledStep"
    ours, theirs = run(hoisted), run(plain)
    ref = ort.InferenceSession(model(), providers=["CPUExecutionProvider"])
    expected = np.stack([ref.run(None, {"x": x})[0] for x in X])
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run(hoisted), ours, rtol=0, atol=0)   # the cached residuals


def test_broadcast_of_a_weight_is_not_hoisted(hoisted):
    """The Expand of the bias to [ROWS, N] grows: recomputed in the step, not a residual;
    the residuals are no larger than the weights they come from."""
    specs = hoisted._program.step.res_specs
    assert specs, "nothing hoisted"
    sizes = sorted(int(np.prod(s.shape)) for s in specs)
    assert ROWS * N not in sizes
    assert sum(sizes) * 4 <= 1.25 * (W1.nbytes + W2.nbytes + BIAS.nbytes) + 3 * onednn.PACK_SLACK


def test_split_guards_growth_and_cap():
    w = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    grows = hoist.split(lambda w, x: (w, x @ jnp.broadcast_to(w, (512, 8, 16))), (w, x))
    assert grows is None   # the broadcast (64x the weight) stays in the step: nothing to hoist
    parts = hoist.split(lambda w, x: (w, x @ (w * 2.0).reshape(16, 8).T), (w, x))
    assert parts is not None and [s.shape for s in parts.res_specs] == [(8, 16)]
    wv, xv = np.arange(128, dtype=np.float32).reshape(8, 16), np.ones((4, 8), np.float32)
    res = parts.derive(wv)
    out = parts.step(wv, xv, res)
    np.testing.assert_allclose(out[1], xv @ (wv * 2.0).reshape(16, 8).T)
    assert hoist.split(lambda w, x: (w, x @ (w * 2.0).reshape(16, 8).T), (w, x), cap=0) is None


def test_write_weights_rederives(hoisted):
    w2 = RNG.standard_normal((N, H), dtype=np.float32)
    bias = RNG.standard_normal((N,), dtype=np.float32)
    try:
        hoisted.writeWeights(popart.PyWeightsIO({"w2": w2, "bias": bias}))
        np.testing.assert_allclose(run(hoisted), numpy_ref(X, W1, w2, bias), rtol=1e-4, atol=1e-4)
    finally:
        hoisted.writeWeights(popart.PyWeightsIO({"w2": W2, "bias": BIAS}))
    np.testing.assert_allclose(run(hoisted), numpy_ref(X), rtol=1e-4, atol=1e-4)


def test_reset_host_weights_rederives(hoisted):
    w1 = RNG.standard_normal((H, K), dtype=np.float32)
    try:
        hoisted.resetHostWeights(onnx.load_from_string(model(w1=w1)))
        hoisted.weightsFromHost()
        np.testing.assert_allclose(run(hoisted), numpy_ref(X, w1), rtol=1e-4, atol=1e-4)
    finally:
        hoisted.resetHostWeights(onnx.load_from_string(model()))
        hoisted.weightsFromHost()
    np.testing.assert_allclose(run(hoisted), numpy_ref(X), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_pack_runs_once_per_weights_version(hoisted):
    run(hoisted)
    before = onednn.packs_run()
    for _ in range(3):
        run(hoisted)
    assert onednn.packs_run() == before   # cached: no pack in the step
    hoisted.writeWeights(popart.PyWeightsIO({"w2": W2}))
    run(hoisted)
    run(hoisted)
    assert onednn.packs_run() == before + 2   # both weights' packs, once


@needs_onednn
@pytest.mark.parametrize("trans", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("packed", [False, True], ids=["reorder", "packed"])
def test_onednn_matmul_matches_numpy(trans, packed):
    a = RNG.standard_normal((2, 37, 130), dtype=np.float32)
    w = RNG.standard_normal((130, 70), dtype=np.float32)
    wop = np.ascontiguousarray(w.T) if trans else w

    def f(a, w):
        return onednn.matmul(a, onednn.pack(w, trans) if packed else w, 70, trans=trans and not packed,
                             packed=packed)
    np.testing.assert_allclose(jax.jit(f)(a, wop), a @ w, rtol=1e-4, atol=1e-4)
    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(np.stack([a, 2 * a]), wop)
    np.testing.assert_allclose(batched, np.stack([a @ w, 2 * a @ w]), rtol=1e-4, atol=1e-4)


def conv_model(w: np.ndarray, b: np.ndarray, dw: np.ndarray) -> bytes:
    """A depthwise Conv by ``dw`` after Relu(Conv(x, w, b))."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Conv", ["r", "dw"], ["y"], pads=[1, 1, 1, 1], group=w.shape[0])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(dw, "dw")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 12, 10])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


@needs_onednn
def test_convolution_on_packed_weights_matches_onnxruntime():
    """Conv's weights are packed once (hoisted) and read packed by the oneDNN forward; after
    writeWeights every weight is packed again, once."""
    w, w2 = (RNG.standard_normal((16, 8, 3, 3), dtype=np.float32) for _ in range(2))
    b = RNG.standard_normal((16,), dtype=np.float32)
    dw = RNG.standard_normal((16, 1, 3, 3), dtype=np.float32)
    x = RNG.standard_normal((2, 8, 12, 10), dtype=np.float32)
    opts = popart.SessionOptions()
    opts.constantWeights = False
    s = popart.InferenceSession(conv_model(w, b, dw), popart.DataFlow(1, {"y": popart.AnchorReturnType("All")}),
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    stepio = popart.PyStepIO({"x": x}, anchors)

    def expected(w):
        ref = ort.InferenceSession(conv_model(w, b, dw), providers=["CPUExecutionProvider"])
        return ref.run(None, {"x": x})[0]
    s.run(stepio)
    np.testing.assert_allclose(anchors["y"], expected(w), rtol=1e-4, atol=1e-4)
    before = onednn.packs_run()
    s.run(stepio)
    s.run(stepio)
    assert onednn.packs_run() == before
    s.writeWeights(popart.PyWeightsIO({"w": w2}))
    s.run(stepio)
    assert onednn.packs_run() == before + 2   # both convolutions' weights
    np.testing.assert_allclose(anchors["y"], expected(w2), rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("packed", [False, True], ids=["reorder", "packed"])
def test_onednn_matmul_batched_weight(packed):
    """Under vmap a weight with the batch (an activation in the step's vmap over batches) runs
    one product per item; a shared lhs with a batched weight too."""
    a = RNG.standard_normal((3, 5, 64), dtype=np.float32)
    w = RNG.standard_normal((3, 64, 80), dtype=np.float32)

    def f(a, w):
        return onednn.matmul(a, onednn.pack(w) if packed else w, 80, packed=packed)
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(a, w), a @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, in_axes=(None, 0)))(a[0], w), a[0] @ w,
                               rtol=1e-4, atol=1e-4)


def test_product_of_two_activations_in_a_hoisted_step():
    """A MatMul whose right operand comes from the feeds (batched in the step's vmap) beside one
    by a weight: the step is hoisted, the activation's product (packed in the step where oneDNN
    is built) is right."""
    w = RNG.standard_normal((96, 128), dtype=np.float32)
    nodes = [helper.make_node("Transpose", ["b"], ["bt"], perm=[1, 0]),
             helper.make_node("MatMul", ["a", "bt"], ["p"]),
             helper.make_node("MatMul", ["a", "w"], ["q"]),
             helper.make_node("Add", ["p", "q"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 96]),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT, [128, 96])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    s = popart.InferenceSession(proto, popart.DataFlow(2, {"y": popart.AnchorReturnType("All")}),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    assert s._program.step.derive is not None
    if onednn.available():
        assert s._program.step.compiled.as_text().count("custom_call_target=\"popart_onednn_pack\"") == 1   # b's
    a = RNG.standard_normal((2, 64, 96), dtype=np.float32)
    b = RNG.standard_normal((2, 128, 96), dtype=np.float32)
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"a": a, "b": b}, anchors))
    np.testing.assert_allclose(anchors["y"], a @ b.transpose(0, 2, 1) + a @ w, rtol=1e-4, atol=1e-4)
