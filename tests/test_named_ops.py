"""Every lowering runs under jax.named_scope of its ONNX node: the compiled program names the
user's nodes in the forward and backward passes, and the names change no number."""
import re

import numpy as np
import pytest

import popart
from popart.engine import lower


def _train(steps: int = 3):
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [4, 8]), "x")
    lbl = builder.addInputTensor(popart.TensorInfo("INT32", [4]), "label")
    rng = np.random.default_rng(0)
    w1 = builder.addInitializedInputTensor(rng.normal(size=(8, 16)).astype(np.float32), "w1")
    w2 = builder.addInitializedInputTensor(rng.normal(size=(16, 3)).astype(np.float32), "w2")
    with builder.nameScope("layer1"):
        h = builder.aiOnnx.relu([builder.aiOnnx.matmul([x, w1])])
    logits = builder.aiOnnx.matmul([h, w2])
    probs = builder.aiOnnx.softmax([logits])
    loss = builder.aiGraphcore.nllloss([probs, lbl])
    session = popart.TrainingSession(
        fnModel=builder.getModelProto(),
        dataFlow=popart.DataFlow(1, {loss: popart.AnchorReturnType("ALL")}),
        loss=loss, optimizer=popart.ConstSGD(0.1),
        deviceInfo=popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    losses = []
    for i in range(steps):
        data = {x: rng.normal(size=(4, 8)).astype(np.float32),
                lbl: rng.integers(0, 3, size=4).astype(np.int32)}
        session.run(popart.PyStepIO(data, anchors))
        losses.append(anchors[loss].copy())
    weights = {w1: np.zeros((8, 16), np.float32), w2: np.zeros((16, 3), np.float32)}
    session.weightsToHost()
    session.readWeights(popart.PyWeightsIO(weights))
    return session, np.array(losses), weights


@pytest.fixture(scope="module")
def named():
    return _train()


def test_compiled_program_names_nodes_forward_and_backward(named):
    session, _, _ = named
    text = session.getSerializedGraph().decode()
    names = set(re.findall(r'op_name="([^"]*)"', text))
    assert any("layer1/MatMul" in n and "transpose(jvp(" not in n for n in names)
    assert any("transpose(jvp(layer1/MatMul" in n for n in names)
    assert any("layer1/Relu" in n for n in names)


def test_unnamed_nodes_are_named_by_type_and_position():
    from onnx import TensorProto, helper
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Tanh", ["r"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    session = popart.InferenceSession(model.SerializeToString(),
                                      popart.DataFlow(1, {"y": popart.AnchorReturnType("ALL")}),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    text = session.getSerializedGraph().decode()
    # XLA fuses the two ops and keeps one op's name on the fusion
    assert re.search(r'op_name="[^"]*(Relu_0|Tanh_1)[/)]', text)


def test_names_change_no_number(named, monkeypatch):
    _, losses, weights = named
    monkeypatch.setattr(lower, "node_scope_name", lambda *a, **k: "")
    session, losses2, weights2 = _train()
    text = session.getSerializedGraph().decode()
    assert "layer1/MatMul" not in text
    np.testing.assert_array_equal(losses, losses2)
    for k in weights:
        np.testing.assert_array_equal(weights[k], weights2[k])
