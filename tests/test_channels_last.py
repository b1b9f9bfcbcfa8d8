"""The channels-last layout of a trace (popart.engine.channels_last): a convolution graph runs NHWC
from one oneDNN convolution to the next (BatchNormalization, pools, elementwise ops on the
NHWC form), with transposes only at its edges, and gives ONNX Runtime's and PyTorch's numbers,
intermediate tensors and their gradients included."""
from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import torch

import popart
import popart.testing
from popart.engine import onednn
from popart.ops import nn

pytestmark = pytest.mark.skipif(not onednn.available(),
                                reason="the oneDNN custom call cannot be built or loaded here")

C = 16
RNG = np.random.default_rng(7)
W1, W2, W3 = (RNG.standard_normal(s, dtype=np.float32) * 0.2
              for s in [(C, C, 3, 3), (C, C, 3, 3), (2 * C, C, 1, 1)])
BIAS = RNG.standard_normal(C, dtype=np.float32)
SLOPE = RNG.uniform(0.1, 0.3, (C, 1, 1)).astype(np.float32)
# Small logits (p near 0.1): the 1e-7 of PopART's fused loss, -log(p + 1e-7), stays negligible.
WFC = RNG.standard_normal((2 * C, 10), dtype=np.float32) * 0.02
X = RNG.standard_normal((4, C, 8, 8), dtype=np.float32)


def _bn(b, x, name, training=False):
    scale = b.addInitializedInputTensor(np.ones(C, np.float32), f"{name}_scale")
    bias = b.addInitializedInputTensor(np.zeros(C, np.float32), f"{name}_bias")
    mean = b.addInitializedInputTensor(np.zeros(C, np.float32), f"{name}_mean")
    var = b.addInitializedInputTensor(np.ones(C, np.float32), f"{name}_var")
    # five outputs in training: PopART's BatchNormOp uses batch statistics only then
    return b.aiOnnx.batchnormalization([x, scale, bias, mean, var], 5 if training else 1)[0]


def residual_model(training: bool):
    """conv-bn-relu-conv(bias)-bn-add-prelu-sum-clip-maxpool-avgpool-conv1x1-maxpool(tiled)-
    globalpool-matmul:
    a residual block and one op of each channels-last kind. Returns the builder and the ids
    (input, activation after the block, logits)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(X.shape)), "x")
    h = b.aiOnnx.conv([x, b.addInitializedInputTensor(W1, "w1")], pads=[1] * 4)
    h = b.aiOnnx.relu([_bn(b, h, "bn1", training)])
    h = b.aiOnnx.conv([h, b.addInitializedInputTensor(W2, "w2"),
                       b.addInitializedInputTensor(BIAS, "b2")], pads=[1] * 4)
    h = b.aiOnnx.add([_bn(b, h, "bn2", training), x])
    block = b.aiOnnx.prelu([h, b.aiOnnx.constant(SLOPE)])
    h = b.aiOnnx.sum([block, block, b.aiOnnx.constant(np.float32(0.5))])
    h = b.aiOnnx.clip([h], min=-3.0, max=3.0)
    h = b.aiOnnx.maxpool([h], num_outputs=1, kernel_shape=[3, 3], pads=[1] * 4,
                         strides=[1, 1])[0]
    h = b.aiOnnx.averagepool([h], kernel_shape=[2, 2], strides=[2, 2])
    h = b.aiOnnx.conv([h, b.addInitializedInputTensor(W3, "w3")])
    h = b.aiOnnx.maxpool([h], num_outputs=1, kernel_shape=[2, 2], strides=[2, 2])[0]
    h = b.aiOnnx.flatten([b.aiOnnx.globalaveragepool([h])])
    logits = b.aiOnnx.matmul([h, b.addInitializedInputTensor(WFC, "wfc")])
    return b, x, block, logits


def _session(training: bool, anchors: list, **kw):
    b, x, block, logits = residual_model(training)
    ids = {"block": block, "logits": logits, "x": x}
    opts = popart.SessionOptions()
    if not training:
        for t in (block, logits):
            b.addOutputTensor(t)
        s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [ids[a] for a in anchors]),
                                    popart.DeviceManager().createCpuDevice(), userOptions=opts)
        return s, b, x, ids
    label = b.addInputTensor(popart.TensorInfo("INT32", [X.shape[0]]), "label")
    loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([logits], axis=1), label])
    names = [popart.reservedGradientPrefix() + block if a == "block_grad" else ids[a]
             for a in anchors]
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, names + [loss]), loss,
                               popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice(),
                               userOptions=opts)
    ids.update(label=label, loss=loss, block_grad=names[anchors.index("block_grad")]
               if "block_grad" in anchors else None)
    return s, b, x, ids


@pytest.fixture(scope="module")
def inference():
    s, b, x, ids = _session(False, ["block", "logits"])
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, anchors))
    return s, b, ids, anchors


def test_inference_matches_onnxruntime_with_transposes_only_at_the_edges(inference):
    s, b, ids, anchors = inference
    ref = ort.InferenceSession(b.getModelProto(), providers=["CPUExecutionProvider"])
    block, logits = ref.run([ids["block"], ids["logits"]], {ids["x"]: X})
    np.testing.assert_allclose(anchors[ids["block"]], block, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(anchors[ids["logits"]], logits, rtol=1e-4, atol=1e-4)
    assert s.getSerializedGraph().decode().count('custom_call_target="popart_onednn_conv"') == 3
    # The input into the first convolution, the anchor "block" out: the rest runs NHWC. (Before
    # the layout pass: a transpose on each side of the 3x3 convolutions, 4 here.)
    assert transposes_4d(s) == 2
    # The 3x3 max pool is inference's max over strided slices (nn._window_slices); only the
    # average pool is a reduce_window.
    assert popart.testing.lowered_text(s).count("stablehlo.reduce_window") == 1


def transposes_4d(session) -> int:
    """NCHW <-> NHWC transposes in the session's step (StableHLO; 5-D: one replica's)."""
    perms = r"\[0, 2, 3, 1\]|\[0, 3, 1, 2\]|\[0, 1, 3, 4, 2\]|\[0, 1, 4, 2, 3\]"
    return len(re.findall(rf"stablehlo\.transpose %\S+, dims = (?:{perms})",
                          popart.testing.lowered_text(session)))


def test_the_layout_only_follows_onednn():
    """With XLA's convolution (oneDNN switched off) nothing is channels-last: the numbers
    are the same."""
    with nn.onednn_off():
        s, b, x, ids = _session(False, ["logits"])
        s.prepareDevice()
        anchors = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: X}, anchors))
    assert "popart_onednn_conv" not in s.getSerializedGraph().decode()
    ref = ort.InferenceSession(b.getModelProto(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(anchors[ids["logits"]], ref.run([ids["logits"]], {ids["x"]: X})[0],
                               rtol=1e-4, atol=1e-4)


def torch_residual(labels: np.ndarray, steps: int):
    """PyTorch's run of residual_model's training: SGD lr 0.1, batch statistics; returns the
    weights, the block activation and its gradient of the first step, and the losses."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in
         dict(w1=W1, w2=W2, b2=BIAS, w3=W3, wfc=WFC, bn1_scale=np.ones(C, np.float32),
              bn1_bias=np.zeros(C, np.float32), bn2_scale=np.ones(C, np.float32),
              bn2_bias=np.zeros(C, np.float32)).items()}
    F = torch.nn.functional
    x, y = torch.tensor(X), torch.tensor(labels.astype(np.int64))
    first, losses = None, []
    for _ in range(steps):
        h = F.conv2d(x, p["w1"], padding=1)
        h = F.relu(F.batch_norm(h, None, None, p["bn1_scale"], p["bn1_bias"], training=True))
        h = F.conv2d(h, p["w2"], p["b2"], padding=1)
        h = F.batch_norm(h, None, None, p["bn2_scale"], p["bn2_bias"], training=True) + x
        block = torch.where(h < 0, h * torch.tensor(SLOPE), h)
        block.retain_grad()
        h = torch.clamp(block + block + 0.5, -3, 3)
        h = F.avg_pool2d(F.max_pool2d(h, 3, 1, 1), 2, 2)
        h = F.max_pool2d(F.conv2d(h, p["w3"]), 2).mean((2, 3))
        loss = F.nll_loss(torch.log(torch.softmax(h @ p["wfc"], 1)), y)
        loss.backward()
        if first is None:
            first = (block.detach().numpy().copy(), block.grad.numpy().copy())
        losses.append(loss.item())
        with torch.no_grad():
            for v in p.values():
                v -= 0.1 * v.grad
                v.grad = None
    return {k: v.detach().numpy() for k, v in p.items()}, first, losses


def test_training_matches_pytorch_with_the_block_and_its_gradient():
    """Three SGD steps: weights, losses, and the first step's anchored activation inside the
    channels-last run and its gradient (a probe: the tensor leaves the NHWC run there)."""
    labels = RNG.integers(0, 10, X.shape[0]).astype(np.int32)
    s, b, x, ids = _session(True, ["block", "block_grad"])
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    runs = []
    for _ in range(3):
        s.run(popart.PyStepIO({x: X, ids["label"]: labels}, anchors))
        runs.append({k: np.array(v) for k, v in anchors.items()})
    weights, (block, block_grad), losses = torch_residual(labels, 3)
    assert "popart_onednn_conv" in s.getSerializedGraph().decode()
    # x in, "block" out to its anchor and (its gradient anchored, a probe) its gradient back in
    # (7 without the layout pass).
    assert transposes_4d(s) == 3
    np.testing.assert_allclose(runs[0][ids["block"]], block, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(runs[0][ids["block_grad"]], block_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([r[ids["loss"]] for r in runs], losses, rtol=1e-4)
    s.weightsToHost()
    got = {k: np.zeros_like(v) for k, v in weights.items()}
    s.readWeights(popart.PyWeightsIO(got))
    for k, v in weights.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_mixed_consumers_and_subgraphs_match_onnxruntime():
    """A convolution's output read channels-last and channels-first side by side: a compare
    (bool) and its Cast, a product with that, Identity, a variadic Sum with a Where (no NHWC
    form), a Reshape and a ReduceSum, an If whose branches read the outer tensor, a Concat of
    channels; then another convolution."""
    from onnx import TensorProto, helper, numpy_helper
    f32 = TensorProto.FLOAT
    w = RNG.standard_normal((C, C, 3, 3), dtype=np.float32) * 0.2
    branch = {k: helper.make_graph([helper.make_node(op, ["c"], [f"{k}_out"])], k, [],
                                   [helper.make_tensor_value_info(f"{k}_out", f32, None)])
              for k, op in (("then", "Relu"), ("else", "Neg"))}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 4),
        helper.make_node("Greater", ["c", "zero"], ["g"]),
        helper.make_node("Cast", ["g"], ["m"], to=f32),
        helper.make_node("Mul", ["c", "m"], ["p"]),
        helper.make_node("Identity", ["p"], ["i"]),
        helper.make_node("Neg", ["c"], ["nc"]),
        helper.make_node("Where", ["g", "c", "nc"], ["t"]),
        helper.make_node("Sum", ["i", "t", "c"], ["u"]),
        helper.make_node("Reshape", ["i", "shape"], ["r"]),
        helper.make_node("ReduceSum", ["u"], ["s"], axes=[1], keepdims=1),
        helper.make_node("If", ["flag"], ["b"], then_branch=branch["then"],
                         else_branch=branch["else"]),
        helper.make_node("Add", ["b", "u"], ["v"]),
        helper.make_node("Concat", ["v", "c"], ["cc"], axis=1),
        helper.make_node("Conv", ["cc", "w2"], ["y"], pads=[1] * 4),
    ]
    w2 = RNG.standard_normal((C, 2 * C, 3, 3), dtype=np.float32) * 0.2
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(np.float32(0), "zero"),
             numpy_helper.from_array(np.array([X.shape[0], -1], np.int64), "shape")]
    outs = ["r", "s", "b", "y"]
    graph = helper.make_graph(
        nodes, "mixed", [helper.make_tensor_value_info("x", f32, list(X.shape)),
                         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(o, f32, None) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    s = popart.InferenceSession(model.SerializeToString(), popart.DataFlow(1, outs),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    assert "popart_onednn_conv" in s.getSerializedGraph().decode()
    for flag in (True, False):
        feeds = {"x": X, "flag": np.array(flag)}
        s.run(popart.PyStepIO(feeds, anchors))
        for name, want in zip(outs, ref.run(outs, feeds)):
            np.testing.assert_allclose(anchors[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_gelu_20_runs_on_the_channels_last_form():
    """ai.onnx Gelu (opset 20, ConvNeXt's and transformers' exports) between two convolutions
    keeps the NHWC form: only the input's and the output's transposes are left, and the values
    are onnxruntime's (both approximations)."""
    from onnx import TensorProto, helper, numpy_helper
    w2 = RNG.standard_normal((4, C, 3, 3), dtype=np.float32) * 0.2
    for approximate in ("none", "tanh"):
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Gelu", ["c"], ["g"], approximate=approximate),
             helper.make_node("Conv", ["g", "w2"], ["y"], pads=[1, 1, 1, 1])], "gelu",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X.shape))],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(W1, "w"), numpy_helper.from_array(w2, "w2")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
        s = popart.InferenceSession(model.SerializeToString(),
                                    popart.DataFlow(1, {"y": popart.AnchorReturnType("ALL")}),
                                    popart.DeviceManager().createCpuDevice())
        s.prepareDevice()
        anchors = s.initAnchorArrays()
        s.run(popart.PyStepIO({"x": X}, anchors))
        ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(anchors["y"], ref.run(None, {"x": X})[0], rtol=1e-4, atol=1e-4)
        assert transposes_4d(s) == 2
