"""Depthwise and grouped convolutions through oneDNN (popart.engine.onednn, groups > 1) against
PyTorch: forward and both gradients of the custom call, and a MobileNet-style block (stem,
hard-swish, dilated depthwise, squeeze-and-excitation, grouped convolution) in an
InferenceSession (onnxruntime) and a TrainingSession (PyTorch's SGD), kept channels-last by the
layout pass from the stem to the pooled head."""
from __future__ import annotations

import re

import jax
import numpy as np
import onnxruntime as ort
import pytest
import torch

import popart
import popart.testing
from popart.engine import onednn
from test_channels_last import transposes_4d
from test_onednn_conv import torch_conv

pytestmark = pytest.mark.skipif(not onednn.available(),
                                reason="the oneDNN custom call cannot be built or loaded here")
F = torch.nn.functional

# (N, C, H, W, O, groups, kernel, strides, ((top, bottom), (left, right)), dilation)
CASES = [(2, 8, 9, 10, 8, 8, 3, (1, 1), ((1, 1), (1, 1)), (1, 1)),       # depthwise
         (2, 8, 11, 9, 16, 8, 3, (2, 2), ((2, 2), (2, 2)), (2, 2)),       # x2 multiplier, s2, dil
         (1, 12, 9, 10, 24, 3, 3, (2, 1), ((2, 0), (1, 1)), (1, 1)),      # grouped, uneven pads
         (2, 16, 14, 14, 16, 16, 5, (2, 2), ((2, 2), (2, 2)), (1, 1)),    # depthwise 5x5 s2
         (2, 6, 8, 8, 4, 2, 1, (1, 1), ((0, 0), (0, 0)), (1, 1))]         # grouped 1x1


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"c{c[1]}o{c[4]}g{c[5]}k{c[6]}s{c[7][0]}d{c[9][0]}")
def test_grouped_forward_and_gradients_match_torch(case):
    n, c, h, w_, o, g, k, st, pad, dil = case
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w_), dtype=np.float32)
    w = rng.standard_normal((o, c // g, k, k), dtype=np.float32)

    def f(x, w):
        return onednn.conv2d(x.transpose(0, 2, 3, 1), w, st, pad, dil, True, g).transpose(0, 3, 1, 2)
    y, vjp = jax.vjp(f, x, w)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx, dw = vjp(dy)
    ty, tdx, tdw = torch_conv(x, w, st, pad, dil, dy, groups=g)
    for got, want in ((y, ty), (dx, tdx), (dw, tdw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)


def test_grouped_nchw_and_batched_weights():
    """NCHW activations, and per-replica weights under vmap (one call each) as shared ones."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 6, 7, 7), dtype=np.float32)
    w = rng.standard_normal((3, 6, 1, 3, 3), dtype=np.float32)
    pad = ((1, 1), (1, 1))
    y = jax.vmap(lambda x, w: onednn.conv2d(x, w, (1, 1), pad, (1, 1), False, 6))(x, w)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(y[i]), F.conv2d(
            torch.from_numpy(x[i]), torch.from_numpy(w[i]), padding=1, groups=6).numpy(),
            rtol=1e-4, atol=1e-4)


C, O = 16, 32
RNG = np.random.default_rng(5)
X = RNG.standard_normal((4, 8, 12, 12), dtype=np.float32)
PARAMS = {k: (RNG.standard_normal(s, dtype=np.float32) * sc).astype(np.float32) for k, s, sc in [
    ("stem", (C, 8, 3, 3), 0.3), ("dw", (C, 1, 3, 3), 0.4), ("se1", (4, C, 1, 1), 0.4),
    ("se1_b", (4,), 0.1), ("se2", (C, 4, 1, 1), 0.4), ("se2_b", (C,), 0.1),
    ("grp", (O, C // 4, 3, 3), 0.3), ("fc", (O, 10), 0.1)]}


def block_model():
    """stem 3x3 s2 -> hard-swish -> depthwise 3x3 dilation 2 -> hard-swish -> SE (global
    average pool, 1x1 conv + bias, ReLU, 1x1 conv + bias, hard-sigmoid, Mul) -> grouped 3x3
    s2 (4 groups, 16 -> 32) -> global average pool -> MatMul."""
    b = popart.Builder(opsets={"ai.onnx": 14, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(X.shape)), "x")
    p = {k: b.addInitializedInputTensor(v, k) for k, v in PARAMS.items()}
    o = b.aiOnnx
    h = o.hardswish([o.conv([x, p["stem"]], pads=[1] * 4, strides=[2, 2])])
    d = o.hardswish([o.conv([h, p["dw"]], pads=[2] * 4, dilations=[2, 2], group=C)])
    s = o.relu([o.conv([o.globalaveragepool([d]), p["se1"], p["se1_b"]])])
    s = o.hardsigmoid([o.conv([s, p["se2"], p["se2_b"]])], alpha=1 / 6, beta=0.5)
    e = o.conv([o.mul([d, s]), p["grp"]], pads=[1] * 4, strides=[2, 2], group=4)
    logits = o.matmul([o.flatten([o.globalaveragepool([e])]), p["fc"]])
    return b, x, logits


def torch_block(p: dict, x):
    h = F.hardswish(F.conv2d(x, p["stem"], stride=2, padding=1))
    d = F.hardswish(F.conv2d(h, p["dw"], padding=2, dilation=2, groups=C))
    s = F.relu(F.conv2d(d.mean((2, 3), keepdim=True), p["se1"], p["se1_b"]))
    s = F.hardsigmoid(F.conv2d(s, p["se2"], p["se2_b"]))
    e = F.conv2d(d * s, p["grp"], stride=2, padding=1, groups=4)
    return e.mean((2, 3)) @ p["fc"]


def test_block_inference_matches_onnxruntime_channels_last():
    b, x, logits = block_model()
    b.addOutputTensor(logits)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [logits]),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, anchors))
    ref = ort.InferenceSession(b.getModelProto(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(anchors[logits], ref.run([logits], {x: X})[0], rtol=1e-4, atol=1e-5)
    assert s.getSerializedGraph().decode().count('custom_call_target="popart_onednn_conv"') == 5
    # Only the input into the stem: the SE scales and the pooled head are reshapes, the rest
    # runs NHWC.
    assert transposes_4d(s) == 1


def test_block_training_matches_pytorch_channels_last():
    """Two SGD steps (lr 0.1): the losses and every weight, the grouped ones included."""
    labels = RNG.integers(0, 10, X.shape[0]).astype(np.int32)
    b, x, logits = block_model()
    label = b.addInputTensor(popart.TensorInfo("INT32", [X.shape[0]]), "label")
    loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([logits], axis=1), label])
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    losses = []
    for _ in range(2):
        s.run(popart.PyStepIO({x: X, label: labels}, anchors))
        losses.append(float(anchors[loss]))
    p = {k: torch.tensor(v, requires_grad=True) for k, v in PARAMS.items()}
    want = []
    for _ in range(2):
        out = F.nll_loss(torch.log_softmax(torch_block(p, torch.tensor(X)), 1),
                         torch.tensor(labels.astype(np.int64)))
        out.backward()
        want.append(out.item())
        with torch.no_grad():
            for v in p.values():
                v -= 0.1 * v.grad
                v.grad = None
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    s.weightsToHost()
    got = {k: np.zeros_like(v) for k, v in PARAMS.items()}
    s.readWeights(popart.PyWeightsIO(got))
    for k, v in p.items():
        np.testing.assert_allclose(got[k], v.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    # The stem's input, forward only (x is no weight: no gradient goes back into it).
    assert transposes_4d(s) == 1


def test_efficientnet_head_pool_is_clipped_to_the_input():
    """transformers' EfficientNet head: AveragePool with a 1280 x 1280 kernel and stride,
    ceil_mode and count_include_pad over a 7 x 7 map, i.e. a global average. The window is
    clipped to the input (no 1280-wide padding in the program) and gives onnxruntime's mean."""
    from onnx import TensorProto, helper
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[1280, 1280],
                            strides=[1280, 1280], ceil_mode=1, count_include_pad=1)
    graph = helper.make_graph([node], "head", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 5, 7, 7])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString()
    x = RNG.standard_normal((2, 5, 7, 7), dtype=np.float32)
    s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": x}, anchors))
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(anchors["y"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(anchors["y"], x.mean((2, 3), keepdims=True), rtol=1e-5, atol=1e-6)
    windows = re.findall(r"window_dimensions = array<i64: ([\d, ]+)>", popart.testing.lowered_text(s))
    assert windows == ["1, 1, 1, 7, 7"]   # (one replica's leading 1)
