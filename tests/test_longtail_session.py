"""PopART's long tail on the session side (issue 25): initializer storage fields, checks at
session construction, anchors and StepIO, random seeds, logging, PopART's messages."""
import logging

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import popart
from op_tester import onnx_model as _model, onnx_node as _node
from popart.fileio import initializer_proto, unpack_popart_data

TP = onnx.TensorProto


def _fields(t):
    return [f.name for f, _ in t.ListFields() if f.name.endswith("_data")]


# ------------------------------------------------------------------ item 3: storage fields
# BuilderImpl::populateTensorProtoFromConstVoidData's field per type.
POPART_FIELD = {np.float32: "float_data", np.int8: "int32_data", np.uint8: "int32_data",
                np.int16: "int32_data", np.uint16: "int32_data", np.int32: "int32_data",
                np.bool_: "int32_data", np.float16: "int32_data", np.int64: "int64_data",
                np.uint32: "uint64_data", np.uint64: "uint64_data"}


@pytest.mark.parametrize("dtype", list(POPART_FIELD))
def test_builder_initializer_fields(dtype):
    value = np.array([[1, 0, 1], [0, 1, 1]]).astype(dtype)
    b = popart.Builder()
    b.addInitializedInputTensor(value)
    (t,) = onnx.load_from_string(b.getModelProto()).graph.initializer
    assert _fields(t) == [POPART_FIELD[dtype]] and not t.HasField("raw_data")
    if dtype == np.float16:   # two halves per entry, as PopART's Builder packs them
        assert len(t.int32_data) == -(-value.size // 2)
        t = unpack_popart_data(t)
    else:
        assert len(getattr(t, POPART_FIELD[dtype])) == value.size   # one value per entry (ONNX)
    np.testing.assert_array_equal(numpy_helper.to_array(t), value)   # onnx reads it as given


def _popart_packed(value, field, field_dtype, entries):
    """A TensorProto as PopART memcpy'd ``value``'s bytes into ``field`` (``entries`` long)."""
    t = TP(name="w", data_type=onnx.helper.np_dtype_to_tensor_dtype(value.dtype),
           dims=list(value.shape))
    buf = np.zeros(entries, field_dtype)
    buf.view(np.uint8)[:value.nbytes] = np.frombuffer(value.tobytes(), np.uint8)
    getattr(t, field).extend(buf.tolist())
    return t


@pytest.mark.parametrize("value", [
    np.array([1.5, -2.25, 65504, 3], np.float16),
    np.array([1.5, -2.25, 7], np.float16),
    np.array([-1, 5, 0, 127, -128], np.int8),
    np.array([300, -7, 2], np.int16),
    np.array([True, True, False], np.bool_),
    np.array([4000000000, 7, 1], np.uint32)])
def test_reads_popart_packed_layouts(value):
    field, fdt = ("uint64_data", np.uint64) if value.dtype == np.uint32 else ("int32_data", np.int32)
    n = -(-value.size // 2) if value.dtype == np.float16 else value.size
    t = _popart_packed(value, field, fdt, n)
    np.testing.assert_array_equal(numpy_helper.to_array(unpack_popart_data(t)), value)
    # and through a session: the initializer feeds an Identity output
    g = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [],
                               [onnx.helper.make_tensor_value_info("y", t.data_type, list(value.shape))],
                               [t])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 11)])
    s = popart.InferenceSession(model.SerializeToString(), popart.DataFlow(1, ["y"]),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, anchors))
    np.testing.assert_array_equal(anchors["y"], value)


def test_ambiguous_packed_int8_reads_as_onnx():
    """All entries inside int8's range: read one value per entry (what ONNX defines)."""
    t = TP(name="w", data_type=TP.INT8, dims=[5])
    t.int32_data.extend([5, 7, 0, 0, 0])
    assert unpack_popart_data(t) is t
    np.testing.assert_array_equal(numpy_helper.to_array(unpack_popart_data(t)), [5, 7, 0, 0, 0])


def test_initializer_proto_float_fast_path_exact():
    a = np.random.default_rng(0).standard_normal((7, 9)).astype(np.float32)
    t = initializer_proto(a, "a")
    assert _fields(t) == ["float_data"] and list(t.dims) == [7, 9]
    np.testing.assert_array_equal(np.array(t.float_data, np.float32).reshape(7, 9), a)


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    """modelToHost of a session trained one step with momentum SGD on a Builder model."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    k = b.addInitializedInputTensor(np.array([3, 1], np.int32), "k")
    y = b.aiOnnx.mul([x, w])
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.SGD({"defaultLearningRate": (0.5, False),
                                           "defaultMomentum": (0.9, False)}),
                               popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones([2, 3], np.float32)}, anchors))
    fn = str(tmp_path_factory.mktemp("m") / "trained.onnx")
    s.modelToHost(fn)
    return onnx.load(fn), w, k


def test_model_to_host_fields_and_order(trained_model):
    model, w, k = trained_model
    names = [t.name for t in model.graph.initializer]
    assert names[:2] == [w, k]                    # the original initializers first, in order
    assert len(names) > 2 and all(n.startswith(("Accl", "Step", "Accum")) for n in names[2:])
    for t in model.graph.initializer:             # every one in PopART's typed field
        assert not t.HasField("raw_data")
        assert _fields(t) == [{TP.FLOAT: "float_data", TP.INT32: "int32_data"}[t.data_type]]
    got = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # L1 sum of x*w with x = 1: d/dw = sign(w) (0 at w = 0: PopART's L1Grad), lr 0.5, first step
    w0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(got[w], w0 - 0.5 * np.sign(w0), rtol=1e-6)
    np.testing.assert_array_equal(got[k], [3, 1])


# ------------------------------------------------------------------ models without the Builder


CPU = popart.DeviceManager().createCpuDevice
W23 = ("w", np.arange(6, dtype=np.float32).reshape(2, 3))


def _training(model, loss, anchors=None, opts=None, device=None):
    return popart.TrainingSession(model, popart.DataFlow(1, anchors or [loss]), loss,
                                  popart.ConstSGD(0.1), device or CPU(), userOptions=opts)


# ------------------------------------------------------------------ item 4: construction checks
def test_shape_inference_errors_raise_at_construction():
    """A Softmax axis out of range, an Add that does not broadcast: the constructor raises
    (PopART's Ir::prepare), before any prepareDevice."""
    bad_axis = _model([_node("Mul", ["x", "w"], ["m"]), _node("Softmax", ["m"], ["y"], axis=5)],
                      [("x", TP.FLOAT, [2, 3])], [("y", TP.FLOAT, [2, 3])], [W23])
    bad_bcast = _model([_node("Mul", ["x", "w"], ["m"]), _node("Add", ["m", "z"], ["y"])],
                       [("x", TP.FLOAT, [2, 3]), ("z", TP.FLOAT, [4])], [("y", TP.FLOAT, [2, 3])],
                       [W23])
    for model in (bad_axis, bad_bcast):
        with pytest.raises(popart.popart_exception):
            popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())


def _loss_model(keepdims, axes):
    return _model([_node("Mul", ["x", "w"], ["m"]),
                   _node("ReduceSum", ["m"], ["loss"], keepdims=keepdims, **axes)],
                  [("x", TP.FLOAT, [2, 3])], [("loss", TP.FLOAT, None)], [W23])


def test_loss_of_more_than_one_element_rejected_at_construction():
    with pytest.raises(popart.popart_exception) as e:
        _training(_loss_model(0, {"axes": [1]}), "loss")
    assert e.value.args[0] == "Loss tensor, 'loss', must be a scalar tensor"   # Ir::setFinalLoss


def test_loss_with_one_element_trains():
    """A loss of shape [1, 1] (ReduceSum keepdims=1) is accepted; its gradient is x."""
    s = _training(_loss_model(1, {}), "loss", anchors=["loss", "Gradient___w"])
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    s.run(popart.PyStepIO({"x": x}, anchors))
    assert anchors["loss"].shape == (1, 1)
    np.testing.assert_allclose(anchors["loss"].reshape(()), (x * W23[1]).sum())
    np.testing.assert_allclose(anchors["Gradient___w"], x)


def test_virtual_graph_beyond_the_device_checked_at_prepare_device():
    m = _model([_node("Mul", ["x", "w"], ["y"])], [("x", TP.FLOAT, [2, 3])],
               [("y", TP.FLOAT, [2, 3])], [W23])
    model = onnx.load_from_string(m)
    a = model.graph.node[0].attribute.add()
    a.name, a.type, a.i = "__ipu_number", onnx.AttributeProto.INT, 3
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    s = popart.InferenceSession(model.SerializeToString(), popart.DataFlow(1, ["y"]),
                                popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=opts)   # constructed: the device is not checked yet
    with pytest.raises(popart.popart_exception, match=r"has been assigned to an invalid virtual "
                                                      r"graph 3\. numIPUs = 2\."):
        s.prepareDevice()


# ------------------------------------------------------------------ item 12: seeds
def test_seed_attribute_rejected_by_sessions_not_by_the_onnx_backend():
    model = _model([_node("RandomUniform", [], ["r"], shape=[3], seed=2.0),
                    _node("Add", ["x", "r"], ["y"])],
                   [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    with pytest.raises(popart.popart_exception) as e:
        popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
    assert e.value.args[0] == ("ai.onnx.RandomUniform:1: Optional seed attribute is not "
                               "supported. Use session::setRandomSeed instead.")
    from popart import onnx_backend
    out = onnx_backend.prepare(onnx.load_from_string(model)).run([np.zeros(3, np.float32)])[0]
    assert out.shape == (3,) and ((0 <= out) & (out < 1)).all()


def test_set_random_seed_rules(caplog):
    rand = _model([_node("RandomUniform", [], ["r"], shape=[3]), _node("Add", ["x", "r"], ["y"])],
                  [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    s = popart.InferenceSession(rand, popart.DataFlow(1, ["y"]), CPU())
    with pytest.raises(popart.popart_runtime_error) as e:
        s.setRandomSeed(3)
    assert e.value.args[0] == ("Devicex::prepare() must be called before "
                               "Devicex::setRandomSeedFromHost(uint64_t) is called.")
    s.prepareDevice()
    s.setRandomSeed(3)
    assert s.getRandomSeed() == 3
    plain = _model([_node("Neg", ["x"], ["y"])], [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    s = popart.InferenceSession(plain, popart.DataFlow(1, ["y"]), CPU())
    with caplog.at_level(logging.WARNING, logger="popart.session"):
        s.setRandomSeed(3)   # before prepareDevice too: nothing to seed, nothing done
    assert "Trying to set the random seed, but this session has no random behaviour. Doing " \
           "nothing." in caplog.text
    assert s.getRandomSeed() == 0


# ------------------------------------------------------------------ item 9: anchors and StepIO
def _mul_loss_model():
    """y = x * w; loss = L1(y) (sum); side = Neg(x) does not lead to the loss."""
    return _model([_node("Mul", ["x", "w"], ["y"]), _node("Neg", ["x"], ["side"]),
                   _node("L1", ["y"], ["loss"], domain="ai.graphcore", **{"lambda": 1.0, "reduction": 0})],
                  [("x", TP.FLOAT, [2, 3])], [("loss", TP.FLOAT, []), ("side", TP.FLOAT, [2, 3])],
                  [W23])


def test_anchoring_a_gradient_never_computed_raises():
    with pytest.raises(popart.popart_exception) as e:
        _training(_mul_loss_model(), "loss", anchors=["loss", "Gradient___side"])
    assert e.value.args[0] == (
        "Anchor tensor `Gradient___side' not in Ir Tensors. \nInterestingly, `side' IS in "
        "tensors.\nNote that not all tensors can have their gradients anchored:\nif an "
        "activation tensor does not lead to the loss,\nits gradient is zero and never computed.")
    with pytest.raises(popart.popart_exception, match="Anchor tensor `nope' not in Ir Tensors. "
                                                      "The tensors are:\n"):
        _training(_mul_loss_model(), "loss", anchors=["nope"])


def _neg_session(bps=4, anchors=None, opts=None, accl=1):
    """Inference y = -x (x [2]), or a training session with accumulation when accl > 1."""
    model = _model([_node("Neg", ["x"], ["y"])], [("x", TP.FLOAT, [2])], [("y", TP.FLOAT, [2])])
    s = popart.InferenceSession(model, popart.DataFlow(bps, anchors or {"y": popart.AnchorReturnType("ALL")}),
                                CPU(), userOptions=opts)
    s.prepareDevice()
    return s


def test_stepio_wraps_around_without_runtime_asserts():
    """PopART's StepIO reads one micro-batch per call from its offset and starts again at
    the buffer's end; the offset stays with the StepIO between runs."""
    s = _neg_session(bps=4)
    data = np.array([[1, 2], [3, 4], [5, 6]], np.float32)   # 3 micro-batches for 4
    anchors = s.initAnchorArrays()
    io = popart.PyStepIO({"x": data}, anchors)
    io.enableRuntimeAsserts(False)
    s.run(io)
    np.testing.assert_array_equal(anchors["y"], -data[[0, 1, 2, 0]])
    s.run(io)
    np.testing.assert_array_equal(anchors["y"], -data[[1, 2, 0, 1]])
    with pytest.raises(popart.popart_exception) as e:   # with PopART's runtime asserts (default)
        s.run(popart.PyStepIO({"x": data}, anchors))
    assert e.value.args[0].startswith("Unexpected number of input elements for Tensor x. "
                                      "Expected 8, but received 6.\n")


def test_stepio_extra_inputs_as_popart_runtime_asserts():
    b_model = _model([_node("Mul", ["x", "w"], ["y"])], [("x", TP.FLOAT, [2, 3]), ("w", TP.FLOAT, [2, 3])],
                     [("y", TP.FLOAT, [2, 3])], [W23])   # w: a graph input (as the Builder writes)
    s = popart.InferenceSession(b_model, popart.DataFlow(1, ["y"]), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    x = np.ones((2, 3), np.float32)
    s.run(popart.PyStepIO({"x": x, "w": np.zeros((2, 3), np.float32)}, anchors))   # ignored
    np.testing.assert_array_equal(anchors["y"], W23[1])
    with pytest.raises(popart.popart_exception) as e:
        s.run(popart.PyStepIO({"x": x, "zz": x}, anchors))
    assert e.value.args[0] == ("Testing that the buffer provided by user for input Tensor zz "
                               "has the correct number of elements, But there is no Tensor "
                               "named zz in the Ir's main Graph, and it does not exist in the "
                               "original ONNX Model.")


def test_every_n_counts_micro_batches():
    """EveryN(2) with accumulationFactor 2 and 2 batches: PopART's batch counter counts
    micro-batches, so micro-batches 2 and 4 (1-based) come back, as [bps/N, A] = [1, 2]."""
    model = _mul_loss_model()
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation = True
    opts.accumulationFactor = 2
    s = popart.TrainingSession(model, popart.DataFlow(2, {"y": popart.AnchorReturnType("EVERYN", 2)}),
                               "loss", popart.ConstSGD(1e-9), CPU(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    x = np.arange(1, 5, dtype=np.float32)[:, None, None] * np.ones((4, 2, 3), np.float32)
    s.run(popart.PyStepIO({"x": x.reshape(2, 2, 2, 3)}, anchors))
    assert anchors["y"].shape == (2, 2, 3)
    np.testing.assert_array_equal(anchors["y"], x[[1, 3]] * W23[1])


def test_synthetic_data_ignores_host_inputs():
    opts = popart.SessionOptions()
    opts.syntheticDataMode = popart.SyntheticDataMode.Zeros
    opts.enableLoadAndOffloadRNGState = True
    s = _neg_session(bps=2, opts=opts)
    anchors = s.initAnchorArrays()
    anchors["y"][...] = 7.0
    s.run(popart.PyStepIO({}, anchors))   # no input needed, no anchor written
    np.testing.assert_array_equal(anchors["y"], 7.0)
    assert s.getRNGState() == []


# ------------------------------------------------------------------ item 10: PopART's INFO lines
def test_info_lines_at_popart_levels_and_loggers(caplog, tmp_path):
    model = _model([_node("Neg", ["x"], ["y"])], [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    with caplog.at_level(logging.INFO, logger="popart.devicex"), \
            caplog.at_level(logging.INFO, logger="popart.session"):
        s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
        s.prepareDevice()
        s.saveExecutable(str(tmp_path / "e.popef"))
        s2 = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
        s2.loadExecutable(str(tmp_path / "e.popef"))
    lines = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    info = logging.INFO
    assert ("popart.devicex", info, "Starting compilation") in lines
    assert ("popart.devicex", info, "Graph compiled") in lines
    assert ("popart.devicex", info, "Engine loaded") in lines
    assert ("popart.session", info, f"Loading serialized PopART executable from "
                                    f"{tmp_path / 'e.popef'}") in lines
    loaded = lines[[m for _, _, m in lines].index(f"Loading serialized PopART executable from "
                                                    f"{tmp_path / 'e.popef'}"):]
    assert ("popart.devicex", info, "Starting compilation") not in loaded   # not compiled again


# ------------------------------------------------------------------ item 2: PopART's messages
def test_popart_messages_verbatim_with_context_in_notes():
    with pytest.raises(popart.popart_exception) as e:
        popart.AnchorReturnType("SOMETIMES")
    assert e.value.args[0] == "Invalid anchor return type ID supplied: SOMETIMES"
    assert e.value.__notes__   # the package's context: what is accepted
    with pytest.raises(popart.popart_exception) as e:
        popart.DataFlow(0, ["y"])
    assert e.value.args[0] == "'Batches per step' must be greater than zero"
    model = _model([_node("Neg", ["x"], ["y"])], [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    opts = popart.SessionOptions()
    opts.enableLoadAndOffloadRNGState = True
    s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU(), userOptions=opts)
    with pytest.raises(popart.popart_runtime_error) as e:
        s.loadEngineAndConnectStreams()
    assert e.value.args[0] == ("Trying to load an engine but no compiled engine. Did you forget "
                               "to call prepareDevice()?")
    with pytest.raises(popart.popart_runtime_error) as e:
        s.getRNGState()
    assert e.value.args[0] == ("Devicex::prepare() must be called before "
                               "Devicex::getRngStateToHost is called.")
    s.prepareDevice()
    with pytest.raises(popart.popart_exception) as e:
        s.writeWeights(popart.PyWeightsIO({}))
    assert e.value.args[0] == ("Cannot call writeWeights when constantWeights is set. Set "
                               "`constantWeights` to False in the `SessionOption`s when "
                               "initialising the session to enable this behaviour.")


def test_int64_host_data_for_int32_input_narrowed_once(caplog, monkeypatch):
    import popart.dataflow as df
    monkeypatch.setattr(df, "_warned_int64", False)
    model = _model([_node("Neg", ["i"], ["y"])], [("i", TP.INT32, [3])], [("y", TP.INT32, [3])])
    s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    with caplog.at_level(logging.WARNING, logger="popart.devicex"):
        for _ in range(2):
            s.run(popart.PyStepIO({"i": np.array([1, -2, 2 ** 31 - 1], np.int64)}, anchors))
    np.testing.assert_array_equal(anchors["y"], [-1, 2, -(2 ** 31 - 1)])
    warned = [r.getMessage() for r in caplog.records if r.name == "popart.devicex"]
    assert warned == ["Copying (host) tensor i from INT64 to INT32. Will only warn once"]
    with pytest.raises(popart.popart_exception, match="does not fit INT32"):
        s.run(popart.PyStepIO({"i": np.array([1, 2, 2 ** 31], np.int64)}, anchors))


def test_updated_var_anchor_is_the_weight_after_the_update():
    s = popart.TrainingSession(_mul_loss_model(), popart.DataFlow(1, ["UpdatedVar___w"]), "loss",
                               popart.ConstSGD(0.5), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": np.ones((2, 3), np.float32)}, anchors))
    np.testing.assert_allclose(anchors["UpdatedVar___w"], W23[1] - 0.5 * np.sign(W23[1]))


def test_training_run_needs_weights_from_host():
    s = popart.TrainingSession(_mul_loss_model(), popart.DataFlow(1, ["loss"]), "loss",
                               popart.ConstSGD(0.5), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    io = popart.PyStepIO({"x": np.ones((2, 3), np.float32)}, anchors)
    with pytest.raises(popart.popart_runtime_error) as e:
        s.run(io)
    assert e.value.args[0] == ("Must call weightsFromHost before run as the model has "
                               "initializers and the session has been created in training mode")
    s.weightsFromHost()
    s.run(io)
    np.testing.assert_allclose(anchors["loss"], np.abs(W23[1]).sum())


@pytest.mark.parametrize("value", [np.zeros(32, np.float16), np.arange(6, dtype=np.int8),
                                   np.array([0, 1, 0, 0], np.bool_)])
def test_one_value_per_entry_is_read_as_onnx_defines_it(value):
    """Fields one value per entry (what the Builder writes now), zeros after the first
    entries included: never taken for PopART's packed layout."""
    t = initializer_proto(value, "w")
    assert unpack_popart_data(t) is t
    np.testing.assert_array_equal(numpy_helper.to_array(t), value)


def test_optimizer_scalar_anchors_of_sgd0():
    """SGD without momentum (PopART's SGD0ComboOp): its non-const compound scalars are tensors
    that can be anchored: scaledLearningRate0 = lr (1 - dp) / ls, weightDecayScaleFactor0 =
    1 - lr (1 - dp) wd; they follow updateOptimizerFromHost."""
    names = ["scaledLearningRate0___default___FLOAT", "weightDecayScaleFactor0___default___FLOAT",
             "lossScaling_FLOAT"]
    opt = lambda lr: popart.SGD({"defaultLearningRate": (lr, False),
                                 "defaultWeightDecay": (0.1, False), "lossScaling": (4.0, False)})
    s = popart.TrainingSession(_mul_loss_model(), popart.DataFlow(2, names + ["loss"]), "loss",
                               opt(0.5), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    io = popart.PyStepIO({"x": np.ones((2, 2, 3), np.float32)}, anchors)
    s.run(io)
    np.testing.assert_allclose(anchors[names[0]], [0.5 / 4.0] * 2)
    np.testing.assert_allclose(anchors[names[1]], [1 - 0.5 * 0.1] * 2)
    np.testing.assert_allclose(anchors[names[2]], [4.0] * 2)
    s.updateOptimizerFromHost(opt(0.25))
    s.run(io)
    np.testing.assert_allclose(anchors[names[0]], [0.25 / 4.0] * 2)
    with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):   # const: no tensor
        popart.TrainingSession(_mul_loss_model(), popart.DataFlow(1, [names[0]]), "loss",
                               popart.ConstSGD(0.5), CPU()).prepareDevice()


def test_compile_and_export_makes_its_folder(tmp_path):
    from popart.session import makedirsAndCheckWritable
    model = _model([_node("Neg", ["x"], ["y"])], [("x", TP.FLOAT, [3])], [("y", TP.FLOAT, [3])])
    s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
    target = tmp_path / "new" / "deeper" / "e.popef"
    s.compileAndExport(str(target))
    assert target.is_file()
    makedirsAndCheckWritable(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_every_n_is_refused_for_pipelined_models():
    m = onnx.load_from_string(_model([_node("Neg", ["x"], ["h"]), _node("Exp", ["h"], ["y"])],
                                     [("x", TP.FLOAT, [2])], [("y", TP.FLOAT, [2])]))
    for k, n in enumerate(m.graph.node):
        for key in ("__ipu_number", "__pipeline_stage"):
            a = n.attribute.add()
            a.name, a.type, a.i = key, onnx.AttributeProto.INT, k
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    opts.enablePipelining = True
    s = popart.InferenceSession(m.SerializeToString(),
                                popart.DataFlow(2, {"y": popart.AnchorReturnType("EVERYN", 2)}),
                                popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=opts)
    with pytest.raises(popart.popart_exception) as e:
        s.prepareDevice()
    assert e.value.args[0] == "AnchorReturnType::EVERYN is not valid for pipelined models"
