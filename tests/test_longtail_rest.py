"""Issue 25, items 2 (PopART's messages outside sessions and ops) and 11 (the rest): device
messages and defaults, SessionOptions' AttributeError, the Builder's input-count / CallOp /
attribute messages, ALS checks at construction, what PopART's transforms add to
``_serializeIr``, Auto virtual graphs, pipelining's depth checks without stages,
``__collectiveCommGroup`` and poprun's PopRun options. Expected texts and rules are
PopART's (willow/src: devicemanager.cpp, devicexmanager.cpp, builder_impl.cpp, builder.cpp,
transforms/*.cpp, patterns/sgd1decompose.cpp)."""
import json
import logging
import os
import sys
import tomllib

import numpy as np
import pytest

import popart
from popart.errors import poplar_exception, popart_exception
from popdist import poprun

HERE = os.path.dirname(os.path.abspath(__file__))


def ipus(n):
    return popart.DeviceManager().createIpuModelDevice({"numIPUs": n})


def mlp(dtype="FLOAT", np_dtype=np.float32, annotate=False):
    """x[2,4] -> matmul(w1) -> relu -> matmul(w2) -> l1loss (Sum); stages 0 / 1 if annotated."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo(dtype, [2, 4]), "x")
    w1 = b.addInitializedInputTensor(np.full((4, 4), 0.1, np_dtype), "w1")
    w2 = b.addInitializedInputTensor(np.full((4, 3), -0.2, np_dtype), "w2")
    if annotate:
        with b.virtualGraph(0), b.pipelineStage(0):
            h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
        with b.virtualGraph(1), b.pipelineStage(1):
            y = b.aiOnnx.matmul([h, w2])
            loss = b.aiGraphcore.l1loss([y], 0.5, reduction=popart.ReductionType.Sum)
    else:
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
        y = b.aiOnnx.matmul([h, w2])
        loss = b.aiGraphcore.l1loss([y], 0.5, reduction=popart.ReductionType.Sum)
    return b, x, h, loss


def training(b, loss, optimizer=None, opts=None, device=None):
    return popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                  optimizer or popart.ConstSGD(0.1), device or ipus(1),
                                  userOptions=opts or popart.SessionOptions())


def ir_ops(session):
    return json.loads(session._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]


# ---------------------------------------------------------------------------------------
# Item 2: messages outside sessions and ops


def test_package_requires_python_3_11_for_exception_notes():
    with open(os.path.join(HERE, "..", "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["requires-python"] == ">=3.11"


def test_device_acquire_messages_are_popart_text():
    dm = popart.DeviceManager()
    big = 1 << 20
    with pytest.raises(popart_exception) as e:
        dm.acquireAvailableDevice(big)
    assert e.value.args[0] == (
        f"Failed to acquire device with {big} IPUs. Ensure that there are sufficient IPUs "
        "available. If you have enabled the Poplar SDK you can check device availability "
        "with the `gc-monitor` command-line utility.")
    assert e.value.__notes__   # the package's context stays, as a note
    for acquire in (dm.acquireDeviceById, dm.tryAcquireDeviceById):
        with pytest.raises(poplar_exception):
            acquire(10 ** 6)
    with pytest.raises(popart_exception, match="^Trying to acquire a hardware device when "
                       "connectionType is DeviceConnectionType::Never"):
        dm.acquireAvailableDevice(1, connectionType=popart.DeviceConnectionType.Never)


def test_sim_and_ipu_model_devices_default_to_one_ipu_of_four_tiles():
    dm = popart.DeviceManager()
    sim = dm.createSimDevice({})                 # defaultFewTiles = 4 (defaulttilecount.hpp)
    assert (sim.type, sim.numIpus, sim.tilesPerIPU) == (popart.DeviceType.Sim, 1, 4)
    model = dm.createIpuModelDevice({})
    assert (model.numIpus, model.tilesPerIPU) == (1, 4)
    assert dm.createSimDevice({"numIPUs": 2, "tilesPerIPU": 8}).tilesPerIPU == 8


def test_unknown_session_option_raises_attribute_error():
    o = popart.SessionOptions()
    with pytest.raises(AttributeError) as e:
        o.notAnOption = 1
    assert e.value.args[0] == "'popart_core.SessionOptions' object has no attribute 'notAnOption'"
    with pytest.raises(AttributeError):
        o.accumulateOuterFragmentSettings.notASetting = 1
    o.enableReplicatedGraphs = True   # a real option is still set
    assert o.enableReplicatedGraphs


def test_builder_input_count_call_and_attribute_messages():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    with pytest.raises(popart_exception) as e:
        b.aiOnnx.add([x])
    assert e.value.args[0] == "Add has invalid number of inputs 1. Must be between 2..2"
    with pytest.raises(popart_exception) as e:
        b.aiOnnx.concat([], 0)
    assert e.value.args[0] == "Concat has invalid number of inputs 0. Must be between 1..inf"
    sub = b.createSubgraphBuilder()
    a = sub.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    sub.addOutputTensor(sub.aiOnnx.relu([a]))
    with pytest.raises(popart_exception) as e:
        b.aiGraphcore.call([x, x], 1, sub, "c")
    assert e.value.args[0] == ("For CallOp 'c', number of inputs (2) does not match that of "
                               "the callee subgraph (1)")
    with pytest.raises(popart_exception) as e:
        b.aiGraphcore.call([x], 2, sub, "c")
    assert e.value.args[0] == ("For CallOp 'c', number of outputs (2) does not match that of "
                               "the callee subgraph (1)")
    y = b.aiGraphcore.call([x], 1, sub, "c")[0]
    b.addNodeAttribute("f", 1.5, {y})
    expected = [(b.getInt64NodeAttribute, "Attribute f is not an integer."),
                (b.getInt64VectorNodeAttribute, "Attribute f is not an integer vector."),
                (b.getStringNodeAttribute, "Attribute f is not a string."),
                (b.getBoolNodeAttribute, "Attribute f is not a int.")]
    for get, text in expected:
        with pytest.raises(popart_exception) as e:
            get("f", {y})
        assert e.value.args[0] == text
    with pytest.raises(popart_exception) as e:
        b.getFloatNodeAttribute("g", {y})
    assert e.value.args[0] == "Node does not have an attribute g."
    with pytest.raises(popart_exception) as e:
        b.addNodeAttribute("f", 2.5, {y})
    assert e.value.args[0] == "Node already has attribute f."


# ---------------------------------------------------------------------------------------
# Item 11: automatic loss scaling at construction


def als_options(**kw):
    o = popart.SessionOptions()
    o.automaticLossScalingSettings = popart.AutomaticLossScalingSettings(True, **kw)
    return o


ALS_SGD = popart.SGD({"lossScaling": (2.0, False)})


def test_als_errors_are_raised_by_the_constructor():
    b, x, h, loss = mlp()                        # float32: no fp16 gradient to track
    with pytest.raises(popart_exception) as e:
        training(b, loss, ALS_SGD, als_options())
    assert e.value.args[0] == ("[AutomaticLossScale transform] No tracked gradient tensors "
                               "of type fp16 were found.")
    b, x, h, loss = mlp("FLOAT16", np.float16)
    for edge in (-0.5, 1.5):
        with pytest.raises(popart_exception) as e:
            training(b, loss, ALS_SGD, als_options(binEdgeLocation=edge))
        assert e.value.args[0] == (
            "[AutomaticLossScale transform] Out of range value for 'binEdgeLocation'. The "
            f"current value is {edge}, but it should be in the range [0, 1].")
    training(b, loss, ALS_SGD, als_options(binEdgeLocation=1.0))   # the range is closed


# ---------------------------------------------------------------------------------------
# Item 11: what PopART's transforms add to the serialized IR


def test_serialized_ir_has_sgd1_accumulator_ops_and_gradient_clipping():
    b, x, h, loss = mlp()
    opt = popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, True)},
                     clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(1.0)])
    ops = ir_ops(training(b, loss, opt))
    squares = [op for op in ops if op["type"] == "ReduceSumSquare"]
    assert [op["inputs"][0]["name"] for op in squares] == ["Gradient___w1", "Gradient___w2"]
    assert [op["outputs"][0]["name"].split("__t")[0] for op in squares] == \
        ["w1_clipping", "w2_clipping"]
    assert any(o["name"] == "GlobalNorm___0" for op in ops for o in op["outputs"])
    by_out = {o["name"]: op for op in ops for o in op["outputs"]}
    for w in ("w1", "w2"):
        acc = by_out["AcclIntoUpdate___" + w]
        assert acc["type"] == "Accumulate"
        assert acc["inputs"][0]["name"] == "Accl___" + w
        assert acc["inputs"][1]["name"].startswith(w + "_clipped")   # the clipped gradient
        assert by_out["UpdatedVar___" + w]["type"] == "SGD1VarUpdate"
        assert by_out["AcclOutOfAcclUpdate___" + w]["type"] == "SGD1AcclUpdate"
        kinds = [op["type"] for op in ops if w in {i["name"] for i in op["inputs"]} and
                 op["type"].startswith(("Accumulate", "SGD1"))]
        assert kinds == ["SGD1VarUpdate", "SGD1AcclUpdate"]   # var update before accl update


def test_serialized_ir_has_pipeline_stash_and_restore():
    b, x, h, loss = mlp(annotate=True)
    o = popart.SessionOptions()
    o.enablePipelining, o.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    o.enableGradientAccumulation, o.accumulationFactor = True, 4
    ops = ir_ops(training(b, loss, opts=o, device=ipus(2)))
    assert all(op["attributes"]["recompute"] in ("YES", "NO") for op in ops)
    stashes = {op["inputs"][0]["name"]: op for op in ops if op["type"] == "Stash"}
    assert x in stashes and h in stashes      # stage 0's activations, read by stage 2
    for t, op in stashes.items():
        # stash in stage 0; restore in 2 * (S - 1) - 0 = 2; size = 2 - 0 + 1
        assert op["outputs"][0]["name"] == "Stashed___" + t
        assert op["attributes"]["__pipeline_stage"] == "0"
        assert op["attributes"]["stashSize"] == "3"
        restore = [r for r in ops if r["type"].startswith("Restore")
                   and r["outputs"][0]["name"] == "Restored___" + t]
        assert len(restore) == 1 and restore[0]["attributes"]["__pipeline_stage"] == "2"
    grads = {op["name"]: op["attributes"]["__pipeline_stage"] for op in ops
             if op["type"].endswith("Grad")}
    assert sorted(set(grads.values())) == ["1", "2"]
    o.autoRecomputation = popart.RecomputationType.Pipeline
    ops = ir_ops(training(b, loss, opts=o, device=ipus(2)))
    fwd = [op for op in ops if "__debug_info_id" in op["attributes"]]
    assert [op["attributes"]["recompute"] for op in fwd] == ["YES", "YES", "NO", "NO"]
    assert [op["inputs"][0]["name"] for op in ops if op["type"] == "Stash"] == [x]


def test_serialized_ir_has_als_histograms():
    b, x, h, loss = mlp("FLOAT16", np.float16)
    s = training(b, loss, ALS_SGD, als_options())
    ops = ir_ops(s)
    hist = [op for op in ops if op["type"] == "Histogram"]
    assert hist and all(op["outputs"][0]["name"] == op["inputs"][0]["name"] + "_statistics"
                        for op in hist)
    level = float(np.float16(65504 * 0.125))   # binEdgeLocation default 0.125, in float16
    assert hist[0]["attributes"]["levels"] == str([level])
    types = [op["type"] for op in ops]
    assert "LossScaleUpdate" in types
    summed = next(op for op in ops if op["outputs"][0]["name"] == "summedHistograms")
    assert [i["name"] for i in summed["inputs"]] == [op["outputs"][0]["name"] for op in hist]


# ---------------------------------------------------------------------------------------
# Item 11: Auto virtual graphs, pipelining without stages


def test_auto_virtual_graph_writes_ipu_numbers_and_needs_enough_splits():
    b, x, h, loss = mlp()
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Auto
    ops = ir_ops(training(b, loss, opts=o, device=ipus(2)))
    ids = [int(op["attributes"]["__ipu_number"]) for op in ops if op["type"] in
           ("MatMul", "Relu", "L1")]
    assert ids == sorted(ids) and set(ids) == {0, 1}     # contiguous runs, every IPU used
    with pytest.raises(popart_exception) as e:   # at construction (Ir::prepare)
        training(b, loss, opts=o, device=ipus(8))
    assert e.value.args[0].startswith("[AutoVirtualGraph] Couldn't find enough splits for "
                                      "8 IPUs. Only found ")


def test_pipelining_without_stages_uses_virtual_graphs_for_the_depth_checks():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]))
    w = b.addInitializedInputTensor(np.ones((4, 4), np.float32))
    with b.virtualGraph(0):
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w])])
    with b.virtualGraph(1):
        loss = b.aiGraphcore.l1loss([h], 0.5)
    o = popart.SessionOptions()
    o.enablePipelining, o.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    with pytest.raises(popart_exception) as e:   # 2 stages (IPUs 0, 1), batchesPerStep 1
        training(b, loss, opts=o, device=ipus(2))
    assert e.value.args[0] == ("For pipelining, depth (batchesPerStep) must equal at least "
                               "the number of pipeline stages (2)")
    o.enableGradientAccumulation, o.accumulationFactor = True, 1
    with pytest.raises(popart_exception, match=r"depth \(gradient accumulation factor\)"):
        training(b, loss, opts=o, device=ipus(2))
    o.accumulationFactor = 2
    training(b, loss, opts=o, device=ipus(2))


# ---------------------------------------------------------------------------------------
# Item 11: __collectiveCommGroup


def test_comm_group_is_written_and_read_as_popart_names_it():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    with b.commGroup(popart.CommGroupType.Consecutive, 2):
        y = b.aiGraphcore.replicatedallreduce([x])
    assert b.getInt64VectorNodeAttribute("__collectiveCommGroup", {y}) == [1, 2]
    z = b.aiGraphcore.replicatedallreduce(
        [x], "Max", popart.CommGroup(popart.CommGroupType.Orthogonal, 2))
    assert b.getInt64NodeAttribute("__collectiveOperator", {z}) == 5   # Max's index
    assert b.getInt64VectorNodeAttribute("__collectiveCommGroup", {z}) == [2, 2]
    o = popart.SessionOptions()
    o.enableReplicatedGraphs, o.replicatedGraphCount = True, 4
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y, z]), ipus(4),
                                userOptions=o)
    s.prepareDevice()
    data = np.arange(12, dtype=np.float32).reshape(4, 3) ** 2 % 7
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: data}, out))
    pairs = data.reshape(2, 2, 3).sum(axis=1)        # consecutive pairs: {0, 1}, {2, 3}
    np.testing.assert_allclose(out[y], np.repeat(pairs, 2, axis=0))
    orth = np.maximum(data[[0, 1]], data[[2, 3]])    # orthogonal pairs: {0, 2}, {1, 3}
    np.testing.assert_allclose(out[z], np.concatenate([orth, orth]))


# ---------------------------------------------------------------------------------------
# Item 11: poprun


def test_poprun_accepts_popruns_partition_and_host_options(caplog):
    args = poprun.build_parser().parse_args(
        ["--vipu-partition", "p", "--update-partition", "yes", "--remove-partition", "no",
         "--offline-mode", "yes", "--host", "h1,h2", "-vv", "--num-instances", "2",
         "python", "train.py", "--lr", "0.1"])
    assert args.verbose == 2 and args.command == ["python", "train.py", "--lr", "0.1"]
    assert poprun.ignored_options(args) == [
        "--vipu-partition=p", "--update-partition=yes", "--remove-partition=no",
        "--offline-mode=yes", "--host=h1,h2"]
    with caplog.at_level(logging.WARNING, logger="poprun"):   # one line; then the usual check
        code = poprun.main(["--vipu-partition", "p", "--host", "h1", "--num-instances", "2",
                            "--num-replicas", "3", sys.executable, "-c", "pass"])
    assert code == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "poprun"]
    assert len(lines) == 1 and "--vipu-partition=p --host=h1" in lines[0]


# ---------------------------------------------------------------------------------------
# Item 11: updateExternallySavedTensorLocations before prepareDevice


def test_external_locations_can_move_before_prepare_device(tmp_path, monkeypatch):
    import onnx
    monkeypatch.chdir(tmp_path)   # a relative toLocation is written in the working directory
    b, x, h, loss = mlp()
    model = onnx.load_from_string(b.getModelProto())
    for t in model.graph.initializer:
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    s = popart.InferenceSession(str(tmp_path / "m.onnx"), popart.DataFlow(1, [h]), ipus(1))
    s.updateExternallySavedTensorLocations("w.bin", "moved.bin")   # not prepared yet
    assert (tmp_path / "moved.bin").stat().st_size == (16 + 12) * 4
    s.prepareDevice()
    data = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: data}, out))
    np.testing.assert_allclose(out[h], np.maximum(data @ np.full((4, 4), 0.1), 0), rtol=1e-6)
    s.modelToHost(str(tmp_path / "saved.onnx"))
    saved = onnx.load(str(tmp_path / "saved.onnx"), load_external_data=False)
    assert {e.value for t in saved.graph.initializer for e in t.external_data
            if e.key == "location"} == {"moved.bin"}


def test_relative_external_data_is_found_from_the_current_directory(tmp_path, monkeypatch):
    """PopART opens an initializer's external location as given (onnxutil.cpp), so a
    relative one is relative to the working directory; the model's folder is tried first."""
    import onnx
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    w = np.array([1.5, -2.0, 4.0], np.float32)
    y = b.aiOnnx.add([x, b.addInitializedInputTensor(w, "w")])
    model = onnx.load_from_string(b.getModelProto())
    t = model.graph.initializer[0]
    t.CopyFrom(onnx.numpy_helper.from_array(w, "w"))
    (tmp_path / "data").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "data" / "w.bin").write_bytes(w.tobytes())
    onnx.external_data_helper.set_external_data(t, "data/w.bin", 0, w.nbytes)
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    onnx.save(model, str(tmp_path / "models" / "m.onnx"))
    monkeypatch.chdir(tmp_path)
    s = popart.InferenceSession(str(tmp_path / "models" / "m.onnx"), popart.DataFlow(1, [y]),
                                ipus(1))
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones(3, np.float32)}, out))
    np.testing.assert_array_equal(out[y], w + 1)
