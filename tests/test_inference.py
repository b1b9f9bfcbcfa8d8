"""InferenceSession end to end: Builder graphs and PyTorch exports against onnxruntime,
anchor shapes, weights I/O, errors."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import popart

from models import make

CPU = popart.DeviceManager().createCpuDevice


def ort_run(proto: bytes, feeds: dict) -> list:
    sess = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def infer(proto, feeds: dict, anchors: list, bps: int = 1, opts=None, isi=None):
    df = popart.DataFlow(bps, {a: popart.AnchorReturnType("ALL") for a in anchors})
    s = popart.InferenceSession(proto, df, CPU(), inputShapeInfo=isi or popart.InputShapeInfo(),
                                userOptions=opts or popart.SessionOptions())
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO(feeds, out))
    return out, s


# ---------------------------------------------------------------- the user guide's examples

def test_builder_add_example():
    builder = popart.Builder()
    i1 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 32, 32]))
    i2 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 32, 32]))
    o = builder.aiOnnx.add([i1, i2])
    builder.addOutputTensor(o)
    proto = builder.getModelProto()
    a = np.random.rand(1, 2, 32, 32).astype(np.float32)
    b = np.random.rand(1, 2, 32, 32).astype(np.float32)
    out, _ = infer(proto, {i1: a, i2: b}, [o])
    np.testing.assert_allclose(out[o], a + b, rtol=1e-6)
    np.testing.assert_allclose(out[o], ort_run(proto, {i1: a, i2: b})[0], rtol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_pytorch_exports_match_onnxruntime(name):
    model, proto, x = make(name, batch=4)
    bps = 3
    xs = np.random.RandomState(1).randn(bps, *x.shape).astype(np.float32)
    out, s = infer(proto, {"x": xs}, ["y"], bps=bps)
    for b in range(bps):
        ref = ort_run(proto, {"x": xs[b]})[0]
        np.testing.assert_allclose(out["y"][b], ref, rtol=2e-4, atol=2e-5)
    import torch
    with torch.no_grad():
        np.testing.assert_allclose(out["y"][0], model(torch.tensor(xs[0])).numpy(), rtol=2e-4, atol=2e-5)


def test_alexnet_like_export_from_file(tmp_path):
    """User guide 2: an exported model loaded from a file path, anchors 'All', bps > 1."""
    import torch
    from torch import nn

    class AlexNetSmall(nn.Module):  # AlexNet's layer pattern, scaled down (torchvision is absent)
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
                nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
                nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
            self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
            self.classifier = nn.Sequential(nn.Dropout(), nn.Linear(32 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

    torch.manual_seed(0)
    input_ = torch.randn(4, 3, 96, 96)
    path = str(tmp_path / "alexnet.onnx")
    torch.onnx.export(AlexNetSmall().eval(), input_, path, output_names=["output"],
                      opset_version=11, dynamo=False)
    anchors = {"output": popart.AnchorReturnType("All")}
    session = popart.InferenceSession(path, popart.DataFlow(2, anchors), CPU())
    session.prepareDevice()
    out = session.initAnchorArrays()
    assert out["output"].shape == (2, 4, 10)
    in_name = onnx.load(path).graph.input[0].name
    data = np.random.randn(2, 4, 3, 96, 96).astype(np.float32)
    session.run(popart.PyStepIO({in_name: data}, out))
    ref = ort_run(open(path, "rb").read(), {in_name: data[1]})[0]
    np.testing.assert_allclose(out["output"][1], ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- anchors and input shapes

@pytest.fixture(scope="module")
def rank_model():
    """x (rank 2) and v (rank 0 after reduce), anchored with every return type."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    y = b.aiOnnx.mul([x, x])
    r = b.aiOnnx.reducesum([y], keepdims=0)
    return b.getModelProto(), x, y, r


@pytest.mark.parametrize("art,expect", [
    (("ALL",), lambda v, bps: v),
    (("EVERYN", 2), lambda v, bps: v[1::2]),
    (("FINAL",), lambda v, bps: v[-1]),
    (("SUM",), lambda v, bps: v.sum(0)),
])
def test_anchor_return_types(rank_model, art, expect):
    proto, x, y, r = rank_model
    bps = 4
    df = popart.DataFlow(bps, {y: popart.AnchorReturnType(*art), r: popart.AnchorReturnType(*art)})
    s = popart.InferenceSession(proto, df, CPU())
    s.prepareDevice()
    out = s.initAnchorArrays()
    lead = {"ALL": [bps], "EVERYN": [bps // 2], "FINAL": [], "SUM": []}[art[0]]
    assert list(out[y].shape) == lead + [2, 3]
    assert list(out[r].shape) == lead
    data = np.random.rand(bps, 2, 3).astype(np.float32)
    s.run(popart.PyStepIO({x: data}, out))
    np.testing.assert_allclose(out[y], expect(data * data, bps), rtol=1e-6)
    np.testing.assert_allclose(out[r], expect((data * data).sum((1, 2)), bps), rtol=1e-5)


def test_anchor_shapes_with_replication_and_bps():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [5]))
    y = b.aiOnnx.relu([x])
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
    df = popart.DataFlow(3, {y: popart.AnchorReturnType("ALL")})
    s = popart.InferenceSession(b.getModelProto(), df, popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=opts)
    s.prepareDevice()
    out = s.initAnchorArrays()
    assert out[y].shape == (3, 2, 5)  # [bps, repl, *shape]
    data = np.random.randn(3, 2, 5).astype(np.float32)
    s.run(popart.PyStepIO({x: data}, out))
    np.testing.assert_allclose(out[y], np.maximum(data, 0))


def test_input_with_right_element_count_any_shape():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]))
    y = b.aiOnnx.neg([x])
    data = np.arange(12, dtype=np.float32)
    df = popart.DataFlow(3, {y: popart.AnchorReturnType("ALL")})
    s = popart.InferenceSession(b.getModelProto(), df, CPU())
    s.prepareDevice()
    out = s.initAnchorArrays()
    stepio = popart.PyStepIO({x: data}, out)
    stepio.enableRuntimeAsserts(False)
    s.run(stepio)
    np.testing.assert_allclose(out[y], -data.reshape(3, 2, 2))


# ---------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def relu_session():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    y = b.aiOnnx.relu([x])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(2, {y: popart.AnchorReturnType("ALL")}), CPU())
    s.prepareDevice()
    return s, x, y


def test_wrong_shape_dtype_missing_input_then_session_still_works(relu_session):
    s, x, y = relu_session
    out = s.initAnchorArrays()
    with pytest.raises(popart.popart_exception, match=rf"{x}.*\[2, 2, 3\]"):
        s.run(popart.PyStepIO({x: np.zeros((2, 4), np.float32)}, out))
    with pytest.raises(popart.popart_exception, match=rf"{x}.*(FLOAT|float32).*(int32|INT32)"):
        s.run(popart.PyStepIO({x: np.zeros((2, 2, 3), np.int32)}, out))
    with pytest.raises(popart.popart_exception, match=rf"{x}.*missing"):
        s.run(popart.PyStepIO({}, out))
    good = np.random.randn(2, 2, 3).astype(np.float32)
    s.run(popart.PyStepIO({x: good}, out))
    np.testing.assert_allclose(out[y], np.maximum(good, 0))


def test_unknown_anchor_op_and_model_errors(tmp_path):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.relu([x])
    with pytest.raises(popart.popart_exception, match="nope"):
        s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, {"nope": popart.AnchorReturnType("ALL")}), CPU())
        s.prepareDevice()
    node = onnx.helper.make_node("FancyOp", ["x"], ["y"], domain="com.acme")
    g = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", 1, [2])],
                               [onnx.helper.make_tensor_value_info("y", 1, [2])])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 11), onnx.helper.make_opsetid("com.acme", 1)])
    with pytest.raises(popart.popart_exception, match="FancyOp"):
        s = popart.InferenceSession(m.SerializeToString(), popart.DataFlow(1, ["y"]), CPU())
        s.prepareDevice()
    with pytest.raises(popart.popart_exception, match="missing.onnx"):
        popart.InferenceSession(str(tmp_path / "missing.onnx"), popart.DataFlow(1, ["y"]), CPU())
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(popart.popart_exception, match="bad.onnx"):
        popart.InferenceSession(str(bad), popart.DataFlow(1, ["y"]), CPU())
    m.opset_import[0].version = 99
    with pytest.raises(popart.popart_exception, match="opset 99"):
        popart.InferenceSession(m.SerializeToString(), popart.DataFlow(1, ["y"]), CPU())


def test_input_shape_info_for_open_dims():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])
    m = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Exp", ["x"], ["y"])], "g", [x], [y]),
                               opset_imports=[onnx.helper.make_opsetid("", 11)])
    with pytest.raises(popart.popart_exception, match="inputShapeInfo"):
        popart.InferenceSession(m.SerializeToString(), popart.DataFlow(1, ["y"]), CPU())
    isi = popart.InputShapeInfo()
    isi.add("x", popart.TensorInfo("FLOAT", [4, 3]))
    data = np.random.rand(4, 3).astype(np.float32)
    out, _ = infer(m.SerializeToString(), {"x": data}, ["y"], isi=isi)
    np.testing.assert_allclose(out["y"], np.exp(data), rtol=1e-6)


# ---------------------------------------------------------------- weights, files, rng

def test_weights_io_model_to_host_and_reset(tmp_path):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]))
    w0 = np.arange(6, dtype=np.float32).reshape(3, 2)
    w = b.addInitializedInputTensor(w0)
    y = b.aiOnnx.matmul([x, w])
    opts = popart.SessionOptions()
    opts.constantWeights = False
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    s.writeWeights(popart.PyWeightsIO({w: w0 * 2}))
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones((1, 3), np.float32)}, out))
    np.testing.assert_allclose(out[y], np.ones((1, 3)) @ (w0 * 2))
    read = np.zeros_like(w0)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({w: read}))
    np.testing.assert_allclose(read, w0 * 2)
    path = tmp_path / "m.onnx"
    s.modelToHost(str(path))
    saved = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    np.testing.assert_allclose(saved[w], w0 * 2)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # atomic write left nothing
    # resetHostWeights from another model, then weightsFromHost
    b2 = popart.Builder()
    x2 = b2.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]))
    b2.aiOnnx.matmul([x2, b2.addInitializedInputTensor(w0 * 3)])
    s.resetHostWeights(b2.getModelProto())
    assert not s.areHostWeightsInSync()
    s.weightsFromHost()
    s.run(popart.PyStepIO({x: np.ones((1, 3), np.float32)}, out))
    np.testing.assert_allclose(out[y], np.ones((1, 3)) @ (w0 * 3))


def test_rng_state_roundtrip_and_info():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    y = b.aiOnnx.sqrt([x])
    opts = popart.SessionOptions()
    opts.enableLoadAndOffloadRNGState = True
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU(), userOptions=opts)
    s.setRandomSeed(42)                  # Sqrt has no random behaviour: PopART does nothing
    assert s.getRandomSeed() == 0
    with pytest.raises(popart.popart_exception, match="getRNGState: the session is not prepared"):
        s.getRNGState()   # PopART: Devicex::prepare() must be called first
    s.prepareDevice()
    state = s.getRNGState()
    s.setRNGState(state)
    assert s.getRNGState() == state
    assert s.getInfo(y) == popart.TensorInfo("FLOAT", [4])
    assert {x, y} <= s.getTensorIds()
    assert s.replicationFactor == 1 and s.accumulationFactor == 1
    assert "compile" in s.getSummaryReport()


def test_offline_device_compiles_but_refuses_to_run():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    y = b.aiOnnx.abs([x])
    dev = popart.DeviceManager().createOfflineIPUDevice({"numIPUs": 1})
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), dev)
    s.prepareDevice()
    with pytest.raises(popart.popart_exception, match="offline"):
        s.run(popart.PyStepIO({x: np.zeros(4, np.float32)}, s.initAnchorArrays()))


def test_step_io_callback():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    y = b.aiOnnx.add([x, x])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(3, [y]), CPU())
    s.prepareDevice()
    data = [np.full(3, i, np.float32) for i in range(3)]
    got, done = [], []

    def output(tid):
        got.append(np.zeros(3, np.float32))
        return got[-1]

    cb = popart.PyStepIOCallback(lambda tid, prefetch: data.pop(0), done.append, output, lambda tid: None)
    s.run(cb)
    assert len(done) == 3
    np.testing.assert_allclose(np.stack(got), 2 * np.arange(3)[:, None] * np.ones(3))


def test_init_anchor_arrays_before_prepare_device_and_saved_file_mode(tmp_path):
    """The talk's order: initAnchorArrays() first; the session compiles on the first run."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    y = b.aiOnnx.exp([x])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(2, [y]), CPU())
    out = s.initAnchorArrays()
    assert out[y].shape == (2, 2)
    s.run(popart.PyStepIO({x: np.zeros((2, 2), np.float32)}, out))
    np.testing.assert_allclose(out[y], np.ones((2, 2)))
    path = tmp_path / "model.onnx"
    s.modelToHost(str(path))
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == 0o666 & ~umask
    assert all(d.platform == "cpu" for d in CPU().jax_devices)


def test_external_data_is_loaded_and_confined_to_the_model_folder(tmp_path):
    w0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2]))
    w = b.addInitializedInputTensor(w0)
    y = b.aiOnnx.matmul([x, w])
    model = onnx.load_from_string(b.getModelProto())
    for t in model.graph.initializer:   # onnx's helper moves raw_data only (PopART: float_data)
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name))
    onnx.external_data_helper.convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save(model, str(tmp_path / "m.onnx"))
    out, _ = infer(str(tmp_path / "m.onnx"), {x: np.ones((1, 2), np.float32)}, [y])
    np.testing.assert_allclose(out[y], np.ones((1, 2)) @ w0)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside.bin"
    onnx.save(model, str(tmp_path / "bad.onnx"))
    with pytest.raises(popart.popart_exception, match="leaves the model's folder"):
        popart.InferenceSession(str(tmp_path / "bad.onnx"), popart.DataFlow(1, [y]), CPU())


def test_rng_state_needs_its_option_and_constant_weights_are_frozen():
    """PopART's session.cpp: get/setRNGState need enableLoadAndOffloadRNGState; an inference
    session with constantWeights (the default) refuses writeWeights / resetHostWeights."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 3]))
    w = b.addInitializedInputTensor(np.ones((3, 3), np.float32))
    y = b.aiOnnx.matmul([x, w])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    for call in (s.getRNGState, lambda: s.setRNGState([0, 0])):
        with pytest.raises(popart.OptionError, match="enableLoadAndOffloadRNGState must be set to True"):
            call()
    with pytest.raises(popart.OptionError, match="Cannot call writeWeights when constantWeights is set"):
        s.writeWeights(popart.PyWeightsIO({w: np.zeros((3, 3), np.float32)}))
    with pytest.raises(popart.OptionError, match="Cannot call resetHostWeights when constantWeights"):
        s.resetHostWeights(b.getModelProto())
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones((1, 3), np.float32)}, out))
    np.testing.assert_array_equal(out[y], np.full((1, 3), 3.0))   # weights unchanged
