"""The rest of PopART's session methods: getIr / fromIr, _serializeIr's JSON, getReport,
getSerializedGraph, engine loading and host-sync state, saveVariables, updateEngineCache,
run's programHandle overload, externally saved tensors."""
import json

import numpy as np
import onnx
import pytest

import popart
from popart import testing

CPU = lambda: popart.DeviceManager().createCpuDevice()  # noqa: E731


def mlp() -> tuple:
    """loss = L1(relu(x @ w1) @ w2), w1 [4, 3], w2 [3, 2]."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    w1 = b.addInitializedInputTensor(np.full((4, 3), 0.1, np.float32), "w1")
    w2 = b.addInitializedInputTensor(np.full((3, 2), -0.2, np.float32), "w2")
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    y = b.aiOnnx.matmul([h, w2])
    loss = b.aiGraphcore.l1loss([y], 0.5, reduction=popart.ReductionType.Sum)
    return b.getModelProto(), x, y, loss


X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


@pytest.fixture(scope="module")
def training():
    proto, x, y, loss = mlp()
    s = popart.TrainingSession(proto, popart.DataFlow(1, [y, loss]), loss,
                               popart.SGD({"defaultLearningRate": (0.1, False),
                                           "defaultMomentum": (0.9, True)}), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    return s, x, y, loss


def run(s, x_id, feed=X):
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x_id: feed}, out))
    return out


def test_serialize_ir_has_popart_layout_with_grad_and_var_update_ops(training):
    s, x, y, loss = training
    doc = json.loads(s._serializeIr(popart.IrSerializationFormat.JSON))
    ops = doc["maingraph"]
    types = [op["type"] for op in ops]
    assert types[:4] == ["MatMul", "ReluInplace", "MatMul", "L1"]   # Inplace (ir.cpp)
    assert types[4:8] == ["L1Grad", "MatMulGrad", "ReluGrad", "MatMulGrad"]   # reverse order
    assert types[8:] == ["Accumulate", "SGD1VarUpdate", "SGD1AcclUpdate"] * 2  # SGD1Decompose
    first = ops[0]
    assert first["inputs"][0] == {"name": x, "shape": "[2 4]", "type": "FLOAT", "index": "0"}
    assert first["outputs"][0]["index"] == "0" and set(first) == {"type", "name", "inputs", "outputs", "attributes"}
    grad_w1 = [op for op in ops if op["type"] == "MatMulGrad"][-1]
    assert [o["name"] for o in grad_w1["outputs"]] == ["Gradient___w1"]       # x needs no gradient
    assert s.getIr().serializeToJSON() == s._serializeIr(popart.IrSerializationFormat.JSON)


def test_report_and_serialized_graph_come_from_the_compiled_program(training):
    s = training[0]
    report = json.loads(s.getReport())
    dev = report["devices"][0]
    assert dev["platform"] == "cpu" and report["compile_seconds"] > 0
    assert dev["flops"] >= 2 * 2 * 4 * 3                 # at least the first matmul
    assert dev["argument_bytes"] >= (12 + 6) * 4          # the weights are arguments
    text = s.getSerializedGraph()
    assert isinstance(text, bytes) and b"HloModule" in text and b"dot(" in text


def test_get_ir_and_from_ir_give_an_inference_session_with_the_trained_weights(training):
    s, x, y, loss = training
    run(s, x)
    ir = s.getIr()
    assert ir.isTraining() and ir.isPrepared() and ir.getDataFlow() is s.dataFlow
    assert [n.op_type for n in ir.getMainGraph().nodes][:2] == ["MatMul", "Relu"]
    inf = popart.InferenceSession.fromIr(ir, CPU())
    inf.prepareDevice()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in ir.getModel().graph.initializer}
    assert not np.allclose(weights["w1"], 0.1)            # trained
    expected = np.maximum(X @ weights["w1"], 0) @ weights["w2"]
    np.testing.assert_allclose(run(inf, x)[y], expected, rtol=1e-6)
    with pytest.raises(popart.popart_exception, match="Ir of a session"):
        popart.InferenceSession.fromIr("not an ir", CPU())


def test_run_overloads_and_unknown_program_handle(training):
    s, x, y, loss = training
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, out), "named")
    s.run(stepio=popart.PyStepIO({x: X}, out), debugName="kw")
    with pytest.raises(popart.popart_exception, match=r"\[Devicex::run\] Program copyNamedBuffers not found"):
        s.run("copyNamedBuffers", popart.PyStepIO({x: X}, out), "")


def test_engine_not_loaded_until_needed_and_sync_flags():
    proto, x, y, loss = mlp()
    s = popart.InferenceSession(proto, popart.DataFlow(1, [y]), CPU())
    s.prepareDevice(loadEngine=False)
    assert not testing.engine_loaded(s)
    s.loadEngineAndConnectStreams()
    assert testing.engine_loaded(s)
    s.setEngineIsLoaded(False)
    first = run(s, x)[y]                     # loads again for the run
    np.testing.assert_allclose(first, np.maximum(X @ np.full((4, 3), 0.1), 0) @ np.full((3, 2), -0.2), rtol=1e-6)
    s.markHostWeightsOutOfSync()
    assert not s.areHostWeightsInSync()
    s.copyDeviceWeightsToHost()
    assert s.areHostWeightsInSync()
    s.checkInplacingAmbiguity()


def test_save_variables_and_update_engine_cache(tmp_path, training):
    s = training[0]
    s.saveVariables(str(tmp_path))
    data = np.load(tmp_path / "variables.popef")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in s.getIr().getModel().graph.initializer}
    np.testing.assert_array_equal(data["var/w1"], weights["w1"])
    assert any(k.startswith("opt/Accl___") for k in data.files)      # momentum state saved
    with pytest.raises(popart.popart_exception, match="enableEngineCaching"):
        s.updateEngineCache()


def test_update_engine_cache_writes_an_entry_the_next_session_uses(tmp_path):
    proto, x, y, loss = mlp()
    o = popart.SessionOptions()
    o.enableEngineCaching, o.cachePath = True, str(tmp_path)
    a = popart.InferenceSession(proto, popart.DataFlow(1, [y]), CPU(), userOptions=o)
    a.prepareDevice()
    entry = next(tmp_path.glob("*.popef"))
    entry.write_bytes(b"stale")
    a.updateEngineCache()
    b = popart.InferenceSession(proto, popart.DataFlow(1, [y]), CPU(), userOptions=o)
    b.prepareDevice()
    assert "executable_source: engine cache" in b.getSummaryReport()


def test_externally_saved_tensors_move_and_stay_external(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # relative locations: PopART's, from the working directory
    proto, x, y, loss = mlp()
    model = onnx.load_from_string(proto)
    for t in model.graph.initializer:   # onnx's helper moves raw_data only (PopART: float_data)
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    s = popart.InferenceSession(str(tmp_path / "m.onnx"), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    with pytest.raises(popart.popart_exception, match="no tensor"):
        s.updateExternallySavedTensorLocations("nowhere.bin", "new.bin")
    with pytest.raises(popart.popart_exception, match="already exists"):
        s.updateExternallySavedTensorLocations("w.bin", "w.bin")
    s.updateExternallySavedTensorLocations("w.bin", "new.bin")
    assert (tmp_path / "new.bin").stat().st_size == (12 + 6) * 4
    out = tmp_path / "out"
    out.mkdir()
    s.modelToHost(str(out / "saved.onnx"))
    saved = onnx.load(str(out / "saved.onnx"), load_external_data=False)
    locs = {e.value for t in saved.graph.initializer for e in t.external_data if e.key == "location"}
    assert locs == {"new.bin"}
    full = onnx.load(str(out / "saved.onnx"))
    w1 = {t.name: onnx.numpy_helper.to_array(t) for t in full.graph.initializer}["w1"]
    np.testing.assert_array_equal(w1, np.full((4, 3), 0.1, np.float32))


def pipelined(fwd_only=True, accumulate=True):
    """Two pipeline stages on two IPUs: y = relu(x @ w1) @ w2, loss = L1(y)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    w1 = b.addInitializedInputTensor(np.full((4, 3), 0.1, np.float32), "w1")
    w2 = b.addInitializedInputTensor(np.full((3, 2), -0.2, np.float32), "w2")
    with b.virtualGraph(0), b.pipelineStage(0):
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with b.virtualGraph(1), b.pipelineStage(1):
        y = b.aiOnnx.matmul([h, w2])
        loss = b.aiGraphcore.l1loss([y], 0.5, reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    o.enablePipelining, o.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    o.enableGradientAccumulation, o.accumulationFactor = accumulate, 2 if accumulate else 1
    o.createImplicitPipeliningFwdOnlyProgram = fwd_only
    return b.getModelProto(), x, y, loss, o


def test_implicit_pipelining_forward_only_program():
    """run("implicitPipeliningFwdOnly", stepio) runs the forward pass on the current weights
    and trains nothing; PopART's checks on the option."""
    proto, x, y, loss, o = pipelined()
    s = popart.TrainingSession(proto, popart.DataFlow(1, [y, loss]), loss, popart.ConstSGD(0.1),
                               popart.DeviceManager().acquireAvailableDevice(2), userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    feed = np.arange(16, dtype=np.float32).reshape(2, 2, 4) / 16     # [accumulation, batch, 4]
    run(s, x, feed)                                                   # one training step
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in s.getIr().getModel().graph.initializer}
    out = s.initAnchorArrays()
    s.run("implicitPipeliningFwdOnly", popart.PyStepIO({x: feed}, out))
    expected = np.maximum(feed @ weights["w1"], 0) @ weights["w2"]
    np.testing.assert_allclose(out[y], expected, rtol=1e-6)
    after = {t.name: onnx.numpy_helper.to_array(t) for t in s.getIr().getModel().graph.initializer}
    np.testing.assert_array_equal(after["w1"], weights["w1"])        # nothing trained
    proto, x, y, loss, o = pipelined(accumulate=False)
    with pytest.raises(popart.popart_exception, match="not supported without gradient accumulation"):
        popart.TrainingSession(proto, popart.DataFlow(2, [loss]), loss, popart.ConstSGD(0.1),
                               popart.DeviceManager().acquireAvailableDevice(2), userOptions=o)
    o.enablePipelining = False
    with pytest.raises(popart.popart_exception, match="not supported without implicit pipelining"):
        popart.TrainingSession(proto, popart.DataFlow(2, [loss]), loss, popart.ConstSGD(0.1),
                               popart.DeviceManager().acquireAvailableDevice(2), userOptions=o)
