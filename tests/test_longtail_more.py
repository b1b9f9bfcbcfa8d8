"""Issue 25, the rest: optimizer-scalar, accumulator and placed-program anchors (item 9),
auto + manual recomputation (item 8), op-level messages (item 4), constant storage (item 3),
relative external-data locations and CallOp mismatches (items 2, 11). Expected values are
PopART's rules (compoundscalarhelper.hpp, ir.cpp, tensorinfo.cpp, op/*.cpp) in NumPy."""
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import popart
from popart import testing
from op_tester import onnx_model as _model, onnx_node as _node

TP = onnx.TensorProto
CPU = popart.DeviceManager().createCpuDevice
X = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]], np.float32)
W0 = np.arange(6, dtype=np.float32).reshape(2, 3) / 10




def _l1_model():
    """y = x * w; loss = sum |y|: d loss / d w = x * sign(x w)."""
    return _model([_node("Mul", ["x", "w"], ["y"]),
                   _node("L1", ["y"], ["loss"], domain="ai.graphcore",
                         **{"lambda": 1.0, "reduction": 0})],
                  [("x", TP.FLOAT, [2, 3])], [("loss", TP.FLOAT, [])], [("w", W0)])


def _run(optimizer, anchors, accumulation=1, batches=1, art=None):
    opts = popart.SessionOptions()
    if accumulation > 1:
        opts.enableGradientAccumulation = True
        opts.accumulationFactor = accumulation
    flow = popart.DataFlow(batches, {a: art or popart.AnchorReturnType("All") for a in anchors})
    s = popart.TrainingSession(_l1_model(), flow, "loss", optimizer, CPU(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    lead = (batches, accumulation) if accumulation > 1 else (batches,)
    scale = np.arange(1, accumulation + 1, dtype=np.float32).reshape(-1, 1, 1)
    xs = np.broadcast_to(X * scale, lead + X.shape).copy()   # micro-batch k: (k + 1) X
    s.run(popart.PyStepIO({"x": xs.squeeze(0) if batches == 1 else xs}, out))
    return s, out, xs


# ------------------------------------------------------------------ item 9: optimizer scalars
def test_sgd1_scalars_anchorable():
    """SGD with momentum (SGD1, accumulator and momentum combined): scaledWeightDecay1 =
    (1 - dm) wd vs, scaledLearningRate1 = lr / vs, scaledMomentum1 = mm, dampeningScaleFactor1
    = (1 - dm) vs / ls (no accumulation, no replication); only non-const ones are tensors."""
    lr, mm, dm, wd, vs, ls = 0.5, 0.9, 0.2, 0.1, 2.0, 4.0
    opt = popart.SGD({"defaultLearningRate": (lr, False), "defaultMomentum": (mm, False),
                      "defaultDampening": (dm, True), "defaultWeightDecay": (wd, True),
                      "defaultVelocityScaling": (vs, True), "lossScaling": (ls, False)})
    names = {"scaledLearningRate1___default___FLOAT": lr / vs,
             "scaledMomentum1___default___FLOAT": mm,
             "dampeningScaleFactor1___default___FLOAT": (1 - dm) * vs / ls,
             "lossScaling_FLOAT": ls}
    _, out, _ = _run(opt, list(names) + ["loss"])
    for k, v in names.items():
        np.testing.assert_allclose(out[k], [v], rtol=1e-6, err_msg=k)
    with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):   # all const
        _run(opt, ["scaledWeightDecay1___default___FLOAT"])


def test_nesterov_scalars_anchorable():
    """SGD1 with Nesterov momentum adds nesterovDampeningScaleFactor1 = af / ((1 - dm) vs),
    nesterovGradScaleFactor1 = vs, sgdMomentum = mm (SGD::getInputIds)."""
    opt = popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, False),
                      "nesterov": (True, True), "defaultVelocityScaling": (2.0, False)})
    names = {"nesterovDampeningScaleFactor1___default___FLOAT": 1 / 2.0,
             "nesterovGradScaleFactor1___default___FLOAT": 2.0,
             "sgdMomentum___default___FLOAT": 0.9}
    _, out, _ = _run(opt, list(names))
    for k, v in names.items():
        np.testing.assert_allclose(out[k], [v], rtol=1e-6, err_msg=k)


def test_sgd2_and_adam_scalars_anchorable():
    """SGD2 (Separate): scaledLearningRate2 = lr / vs, dampeningScaleFactor2 = (1 - dm) vs /
    ls; Adam: learningRate, adamBeta1 and adamGradientScaling = 1 / ls (unscaled state),
    specific values named ___specific___<w>."""
    sgd2 = popart.SGD({"defaultLearningRate": (0.5, False), "defaultMomentum": (0.9, True),
                       "lossScaling": (2.0, False)},
                      accumulatorAndMomentum=popart.SGDAccumulatorAndMomentum.Separate)
    _, out, _ = _run(sgd2, ["scaledLearningRate2___default___FLOAT",
                            "dampeningScaleFactor2___default___FLOAT"])
    np.testing.assert_allclose(out["scaledLearningRate2___default___FLOAT"], [0.5])
    np.testing.assert_allclose(out["dampeningScaleFactor2___default___FLOAT"], [0.5])
    adam = popart.Adam({"defaultLearningRate": (0.01, False), "defaultBeta1": (0.8, False),
                        "lossScaling": (8.0, False)})
    adam.insertSpecific("w", {"learningRate": (0.02, False), "beta1": (0.7, False),
                              "beta2": (0.99, True), "eps": (1e-6, True),
                              "weightDecay": (0.0, True), "maxWeightNorm": (10.0, True)})
    names = {"learningRate___specific___w": 0.02, "adamBeta1___specific___w": 0.7,
             "lossScaling___specific___w": 8.0, "adamGradientScaling___specific___w": 1 / 8.0}
    _, out, _ = _run(adam, list(names))
    for k, v in names.items():
        np.testing.assert_allclose(out[k], [v], rtol=1e-6, err_msg=k)


def test_gradient_accumulator_anchor():
    """Accum___w (SGD0 with accumulationFactor 3): after micro-batch k, the sum of its
    gradients so far; SGD1 has no Accum___ tensor (Accl___ holds both)."""
    _, out, xs = _run(popart.ConstSGD(0.01), ["Accum___w"], accumulation=3)
    g = [x * np.sign(x * W0) for x in xs[0]]
    np.testing.assert_allclose(out["Accum___w"], np.cumsum(g, axis=0), rtol=1e-6)
    with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):
        _run(popart.SGD({"defaultMomentum": (0.9, True)}), ["Accum___w"], accumulation=2)


def _two_ipu_session(vgraph: bool, anchors, A=2):
    """Two MatMul + Tanh layers on IPUs 0 and 1 (virtual graphs, placed) or the same model
    on one device; SGD with a non-const learning rate; accumulationFactor A."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    rs = np.random.RandomState(0)
    h = x
    for i in range(2):
        with b.virtualGraph(i):
            w = b.addInitializedInputTensor(rs.randn(4, 4).astype(np.float32) * 0.5, f"w{i}")
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
    with b.virtualGraph(1):
        loss = b.aiGraphcore.l1loss([h], 1.0, reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Manual if vgraph else popart.VirtualGraphMode.Off
    o.enableGradientAccumulation, o.accumulationFactor = True, A
    dev = popart.DeviceManager().acquireAvailableDevice(2 if vgraph else 1)
    opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultWeightDecay": (0.01, True)})
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, anchors), loss, opt, dev,
                               userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: rs.randn(A, 2, 4).astype(np.float32)}, out))
    return s, out


def test_placed_program_anchors_updated_var_accum_and_scalars():
    """On the placed program (virtual graphs on two devices), UpdatedVar___w1 is the weight
    after the update (what readWeights then returns), Accum___w0 the accumulated gradient after
    each micro-batch and scaledLearningRate0___default___FLOAT the optimizer's lr / (ls A),
    each as the one-device program gives them."""
    names = ["UpdatedVar___w1", "Accum___w0", "scaledLearningRate0___default___FLOAT"]
    placed, got = _two_ipu_session(True, names)
    assert testing.is_placed(placed)
    _, ref = _two_ipu_session(False, names)
    for a in names:
        np.testing.assert_allclose(got[a], ref[a], rtol=1e-5, atol=1e-6, err_msg=a)
    w = {"w1": np.zeros((4, 4), np.float32)}
    placed.weightsToHost()
    placed.readWeights(popart.PyWeightsIO(w))
    np.testing.assert_allclose(got["UpdatedVar___w1"][-1], w["w1"], rtol=1e-6)
    np.testing.assert_allclose(got["scaledLearningRate0___default___FLOAT"], [0.1] * 2)
    assert not np.allclose(got["Accum___w0"][0], got["Accum___w0"][1])


# ------------------------------------------------------------------ item 8: recomputation
def _recompute_builder(mark):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(W0, "w")
    h = b.aiOnnx.tanh([b.aiOnnx.mul([x, w])])
    if mark is not None:
        b.recomputeOutputInBackwardPass(h, mark)
    return b, b.aiGraphcore.l1loss([h], 1.0, reduction=popart.ReductionType.Sum)


@pytest.mark.parametrize("auto,mark,raises", [
    ("Standard", popart.RecomputeType.Recompute, True),
    ("RecomputeAll", popart.RecomputeType.Recompute, True),
    ("Standard", popart.RecomputeType.Checkpoint, False),   # only Recompute marks count
    ("NoRecompute", popart.RecomputeType.Recompute, False)])
def test_auto_and_manual_recomputation_together(auto, mark, raises):
    """Ir::prepare: autoRecomputation other than NoRecompute with an op the user marked
    Recompute raises at construction (executionPhaseSettings.phases < 2)."""
    b, loss = _recompute_builder(mark)
    o = popart.SessionOptions()
    o.autoRecomputation = getattr(popart.RecomputationType, auto)
    make = lambda: popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                          popart.ConstSGD(0.1), CPU(), userOptions=o)
    if raises:
        with pytest.raises(popart.popart_exception) as e:
            make()
        assert e.value.args[0] == "A mixture of auto and manual recomputation is not supported"
    else:
        make()


# ------------------------------------------------------------------ item 4: op-level texts
def _construct(nodes, inputs, outputs=(("y", TP.FLOAT, None),)):
    popart.InferenceSession(_model(nodes, inputs, list(outputs)), popart.DataFlow(1, ["y"]),
                            CPU())


@pytest.mark.parametrize("op,attrs,text", [
    ("Softmax", {"axis": -3}, "Axis -3 is out of acceptable range [-2, 1]"),      # util.cpp's
    ("ArgMax", {"axis": 2}, "Axis 2 is out of acceptable range [-2, 1]"),        # argextrema
    ("LogSoftmax", {"axis": 4}, "LogSoftmax axis, 4, is outside of acceptable range [-2, 1]"),
    ("Flatten", {"axis": -4}, "invalid axis -2 in flattenOpFactory"),             # [-r, r]
    ("Split", {"axis": 2}, "Axis 2 is out of range for tensor with 2 dims"),      # SplitOp
    ("Split", {"axis": -3}, "Split op input tensor x, rank 2, axis -3 is out of range")])
def test_axis_out_of_range_texts(op, attrs, text):
    """Each op's own text (the attribute; Flatten counts a negative axis from the rank first;
    Split's factory has a text for negative axes), raised by the session's constructor; the
    node named in an exception note."""
    out = ("y", TP.INT64 if op == "ArgMax" else TP.FLOAT, None)
    with pytest.raises(popart.popart_exception) as e:
        _construct([_node(op, ["x"], ["y"], **attrs)], [("x", TP.FLOAT, [2, 3])], [out])
    assert e.value.args[0] == text
    assert f"ai.onnx::{op} node" in e.value.__notes__[0]


def test_np_broadcasting_failure_text():
    """tensorinfo.cpp's npOut: 'np broadcasting failed on 'Op <id> (<opid>)', frames [..] and
    [..] are not aligned' (the shapes comma-separated); variadic ops fold their inputs."""
    with pytest.raises(popart.popart_exception) as e:
        _construct([_node("Neg", ["x"], ["n"]), _node("Mul", ["n", "z"], ["y"])],
                   [("x", TP.FLOAT, [2, 3]), ("z", TP.FLOAT, [4, 1, 2])])
    assert e.value.args[0] == ("np broadcasting failed on 'Op 1 (ai.onnx.Mul:7)', frames "
                               "[2, 3] and [4, 1, 2] are not aligned")
    assert "'n', 'z'" in e.value.__notes__[0]
    with pytest.raises(popart.popart_exception, match=r"frames \[5, 2, 3\] and \[4\] are not"):
        _construct([_node("Sum", ["x", "w", "z"], ["y"])],
                   [("x", TP.FLOAT, [2, 3]), ("w", TP.FLOAT, [5, 1, 1]), ("z", TP.FLOAT, [4])])
    _construct([_node("Sum", ["x", "w"], ["y"])],   # broadcastable: accepted
               [("x", TP.FLOAT, [2, 3]), ("w", TP.FLOAT, [5, 1, 1])])


def test_nll_label_shape_text():
    """nll.cpp's setup: the label must have the probabilities' shape without the last axis."""
    with pytest.raises(popart.popart_exception) as e:
        _construct([_node("Nll", ["p", "l"], ["y"], domain="ai.graphcore")],
                   [("p", TP.FLOAT, [2, 3]), ("l", TP.INT32, [3])])
    assert e.value.args[0] == (
        "The label tensor (INT32   [3]) must have shape [2] to match all but the final "
        "dimension of the probabilities tensor (FLOAT   [2 3]) in Op 0 (ai.graphcore.Nll:1). ")
    assert "label 'l' has shape [3]; expected [2]" in e.value.__notes__[0]


# ------------------------------------------------------------------ item 3: constants' storage
@pytest.mark.parametrize("dtype,field", [(np.float32, "float_data"), (np.float16, "int32_data"),
                                         (np.int8, "int32_data"), (np.bool_, "int32_data"),
                                         (np.int64, "int64_data"), (np.uint32, "uint64_data")])
def test_constant_attributes_in_popart_fields(dtype, field):
    """A Constant's 'value' is written as PopART's populateTensorProtoFromConstVoidData writes
    it (named after the attribute, PopART's field per type, never raw_data); onnx reads the
    values back and the session computes with them."""
    value = np.array([[1, 0, 3], [2, 5, 1]]).astype(dtype)
    b = popart.Builder()
    c = b.aiOnnx.constant(value, "c")
    y = b.aiOnnx.cast([c], "FLOAT")
    proto = onnx.load_from_string(b.getModelProto())
    t = next(n for n in proto.graph.node if n.op_type == "Constant").attribute[0].t
    assert t.name == "value" and not t.raw_data
    assert [f.name for f, _ in t.ListFields() if f.name.endswith("_data")] == [field]
    np.testing.assert_array_equal(numpy_helper.to_array(t), value)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, out))
    np.testing.assert_array_equal(out[y], value.astype(np.float32))


# ------------------------------------------------------------------ items 2, 11: files, CallOp
def test_relative_to_location_is_written_in_the_working_directory(tmp_path, monkeypatch):
    """session.cpp checks and writes a relative toLocation as given, i.e. in the working
    directory (not the model's folder); the moved tensors keep their values."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    w = np.array([1.5, -2.0, 4.0], np.float32)
    y = b.aiOnnx.mul([x, b.addInitializedInputTensor(w, "w")])
    model = onnx.load_from_string(b.getModelProto())
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    (tmp_path / "models").mkdir()
    (tmp_path / "run").mkdir()
    onnx.save_model(model, str(tmp_path / "models" / "m.onnx"), save_as_external_data=True,
                    location="w.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path / "run")
    s = popart.InferenceSession(str(tmp_path / "models" / "m.onnx"), popart.DataFlow(1, [y]),
                                CPU())
    s.updateExternallySavedTensorLocations("w.bin", "moved.bin")
    assert not (tmp_path / "models" / "moved.bin").exists()
    np.testing.assert_array_equal(
        np.frombuffer((tmp_path / "run" / "moved.bin").read_bytes(), np.float32), w)
    with pytest.raises(popart.popart_runtime_error) as e:   # exists in the working directory
        s.updateExternallySavedTensorLocations("moved.bin", "moved.bin")
    assert e.value.args[0] == ("Updating externally saved tensor location from file "
                               "'moved.bin' to file 'moved.bin', but file 'moved.bin' already "
                               "exists")
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones(3, np.float32)}, out))
    np.testing.assert_array_equal(out[y], w)


def test_call_input_takes_the_callers_info():
    """An ONNX Call's callee inputs take the caller's TensorInfos (call.cpp:285-293), so a
    callee input declared [3] runs on the [2, 3] it is given (CallOp::setup's check cannot
    fail there; popxl's calls keep it)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    sb = b.createSubgraphBuilder()
    a = sb.addInputTensor(popart.TensorInfo("FLOAT", [3]), "a")
    sb.addOutputTensor(sb.aiOnnx.neg([a]))
    y = b.aiGraphcore.call([x], 1, sb)[0]
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    out = s.initAnchorArrays()
    xv = np.arange(6, dtype=np.float32).reshape(2, 3)
    s.run(popart.PyStepIO({x: xv}, out))
    np.testing.assert_array_equal(out[y], -xv)


def test_pipelined_program_updated_var_and_accum():
    """A pipelined model: UpdatedVar___w1 from the placed pipeline equals the plain program's;
    an Accum___ anchor (a value per micro-batch, which the pipeline does not keep) runs the
    model on the plain program, as the placed program's other unsupported cases do."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 4]), "x")
    h = x
    for i in range(2):
        with b.virtualGraph(i), b.pipelineStage(i):
            w = b.addInitializedInputTensor(np.full((4, 4), 0.1 * (i + 1), np.float32), f"w{i}")
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
    with b.virtualGraph(1), b.pipelineStage(1):
        loss = b.aiGraphcore.l1loss([h], 1.0, reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, True
    o.enableGradientAccumulation, o.accumulationFactor = True, 3
    xs = np.random.RandomState(0).randn(3, 2, 4).astype(np.float32)

    def run(names):
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, names), loss,
                                   popart.ConstSGD(0.1),
                                   popart.DeviceManager().acquireAvailableDevice(2), userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: xs}, out))
        return testing.is_placed(s), out
    placed, got = run(["UpdatedVar___w1"])
    fallback, ref = run(["UpdatedVar___w1", "Accum___w0"])
    assert placed and not fallback
    np.testing.assert_allclose(got["UpdatedVar___w1"], ref["UpdatedVar___w1"], rtol=1e-6)
    assert ref["Accum___w0"].shape == (3, 4, 4)
