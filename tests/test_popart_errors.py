"""PopART's checks of invalid programs (issue 15, item 5): each raises a popart_exception
subclass with PopART's message (willow's ``throw error(...)`` and the Python bindings'),
before anything is compiled where PopART raises at construction / prepare, and the session,
builder or buffers stay usable: the corrected call works."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import popart
from popart import (ArgumentError, BuilderError, DataFlowError, IrError, OptionError, StepIOError,
                    WeightsIOError, popart_exception)


def CPU():
    return popart.DeviceManager().createCpuDevice()


def two_ipus():
    return popart.DeviceManager().createIpuModelDevice({"numIPUs": 2})


def model():
    """x [2, 3] + w -> relu: (builder, x, w, add, relu)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    w = b.addInitializedInputTensor(np.ones((2, 3), np.float32))
    y = b.aiOnnx.add([x, w])
    z = b.aiOnnx.relu([y])
    b.addOutputTensor(z)
    return b, x, w, y, z


def options(**values):
    o = popart.SessionOptions()
    for k, v in values.items():
        setattr(o, k, v)
    return o


def inference(proto, anchors, opts=None, device=None, **kw):
    return popart.InferenceSession(proto, popart.DataFlow(1, anchors), device or CPU(),
                                   userOptions=opts, **kw)


def run(session, feeds):
    out = session.initAnchorArrays()
    session.run(popart.PyStepIO(feeds, out))
    return out


X = np.full((2, 3), -2.0, np.float32)


# ---------------------------------------------------------------- the error classes
def test_error_classes_are_popart_exceptions():
    for cls in (ArgumentError, BuilderError, DataFlowError, IrError, WeightsIOError):
        assert issubclass(cls, popart_exception)
    assert issubclass(ArgumentError, TypeError)   # where PopART's bindings raise TypeError


# ---------------------------------------------------------------- DataFlow (dataflow.cpp)
def test_anchor_return_type_checks():
    with pytest.raises(DataFlowError, match="Must specify return period with option 'EVERYN'"):
        popart.AnchorReturnType("EVERYN")
    with pytest.raises(DataFlowError, match="Anchor return period must be greater than zero"):
        popart.AnchorReturnType("EVERYN", 0)
    with pytest.raises(DataFlowError, match="A return period should not be supplied for this "
                                            "anchor return type"):
        popart.AnchorReturnType("ALL", 2)
    with pytest.raises(DataFlowError, match="Invalid anchor return type ID supplied: SOME"):
        popart.AnchorReturnType("SOME")
    with pytest.raises(ArgumentError):
        popart.AnchorReturnType("EVERYN", 1.5)
    assert popart.AnchorReturnType("EVERYN", 2).rp() == 2   # the corrected calls


def test_batches_per_step_and_return_periods():
    art = {"a": popart.AnchorReturnType("EVERYN", 3)}
    with pytest.raises(DataFlowError, match="'Batches per step' must be greater than zero"):
        popart.DataFlow(0, {"a": popart.AnchorReturnType("ALL")})
    with pytest.raises(DataFlowError, match="Return period must be a factor of the number of "
                                            "batches per step\n.*'a'"):   # context: a note
        popart.DataFlow(4, art)
    with pytest.raises(DataFlowError, match="Return period must be <= to the number of batches "
                                            "per step\n.*'a'"):
        popart.DataFlow(2, art)
    df = popart.DataFlow(6, art)
    with pytest.raises(DataFlowError, match="factor"):
        df.setBatchesPerStep(4)
    assert df.batchesPerStep() == 6   # unchanged by the failed call
    df.setBatchesPerStep(9)
    assert df.batchesPerStep() == 9


def test_input_shape_info_get():
    with pytest.raises(popart_exception, match="No input shape info for Tensor `t' in "
                                               "InputShapeInfo::get"):
        popart.InputShapeInfo().get("t")


# ---------------------------------------------------------------- Ir::prepare checks
def test_inference_needs_an_anchor():
    b, x, w, y, z = model()
    with pytest.raises(IrError, match="User must specify an anchor tensor when doing inference."):
        inference(b.getModelProto(), [])
    s = inference(b.getModelProto(), [z])   # with one it works
    np.testing.assert_array_equal(run(s, {x: X})[z], np.zeros((2, 3), np.float32))


def test_graph_pruned_empty():
    b, x, w, y, z = model()
    with pytest.raises(IrError, match="^All operations in the main graph were pruned, nothing "
                                      "to compute"):
        inference(b.getModelProto(), [x])          # only an input anchored: every op pruned
    with pytest.raises(IrError, match="were pruned.*'nope'"):
        inference(b.getModelProto(), ["nope"])
    empty = popart.Builder()
    i = empty.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    with pytest.raises(IrError, match="were pruned"):
        inference(empty.getModelProto(), [i])
    s = inference(b.getModelProto(), [x, y])        # an op computes an anchor: fine
    out = run(s, {x: X})
    np.testing.assert_array_equal(out[x], X)
    np.testing.assert_array_equal(out[y], X + 1)


def test_gradient_accumulation_in_inference_and_accumulation_factor():
    b, x, w, y, z = model()
    with pytest.raises(OptionError, match="Gradient Accumulation only available when training."):
        inference(b.getModelProto(), [z], options(enableGradientAccumulation=True,
                                                  accumulationFactor=2))
    with pytest.raises(OptionError, match="enableGradientAccumulation is false, but "
                                          "accumulationFactor > 1"):
        inference(b.getModelProto(), [z], options(accumulationFactor=2))   # at construction


def test_replication_options():
    b, x, w, y, z = model()
    with pytest.raises(OptionError, match="enableReplicatedGraphs is false, but "
                                          "replicatedGraphCount > 1"):
        inference(b.getModelProto(), [z], options(replicatedGraphCount=2))
    o = options(enableReplicatedGraphs=True, replicatedGraphCount=2,
                enableDistributedReplicatedGraphs=True, globalReplicationFactor=2,
                globalReplicaOffset=3)
    with pytest.raises(OptionError, match="Global replica offset: 3, is larger than global "
                                          "replication factor: 2"):
        inference(b.getModelProto(), [z], o)
    o.globalReplicationFactor, o.globalReplicaOffset = 1, 0
    with pytest.raises(OptionError, match="Invalid local replication factor: 2, larger than "
                                          "global replication factor: 1"):
        inference(b.getModelProto(), [z], o)


def test_execution_phases_need_their_virtual_graph_mode():
    b, x, w, y, z = model()
    o = popart.SessionOptions()
    o.executionPhaseSettings.phases = 2
    with pytest.raises(OptionError, match="> 1 execution phases requires "
                                          "VirtualGraphMode::ExecutionPhases"):
        inference(b.getModelProto(), [z], o)


def test_reserved_prefix_and_repeated_inputs():
    x = helper.make_tensor_value_info("Gradient___x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", [x.name], ["y"])], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    with pytest.raises(IrError, match="Provided tensor Gradient___x has an invalid name: clash "
                                      "with reserved prefix Gradient___"):
        inference(m, ["y"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x, x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    with pytest.raises(IrError, match=r"Invalid ONNX Model : repeated name: \(x\) in input list"):
        inference(m, ["y"])


def _open_model(shape):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def test_inputs_without_shape_need_input_shape_info():
    with pytest.raises(IrError, match="Input tensor 'x' must be specified in InputShapeInfo, as "
                                      r"it has shape \[N, 3\], which uses an unknown value 'N'."):
        inference(_open_model(["N", 3]), ["y"])
    with pytest.raises(IrError, match="Could not find tensor x in InputShapeInfo, but no shape "
                                      "is specified in the onnx model"):
        inference(_open_model(None), ["y"])
    isi = popart.InputShapeInfo()
    isi.add("x", popart.TensorInfo("FLOAT", [2, 3]))
    s = inference(_open_model(None), ["y"], inputShapeInfo=isi)   # with InputShapeInfo
    np.testing.assert_array_equal(run(s, {"x": -X})["y"], -X)


def test_loss_tensor_checks():
    b, x, w, y, z = model()
    opt = popart.ConstSGD(0.1)
    with pytest.raises(IrError, match="Could not find loss tensor 'nope' in main graph tensors"):
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [z]), "nope", opt, CPU())
    with pytest.raises(popart_exception, match="must be a scalar"):   # Ir::prepare: constructor
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [z]), z, opt, CPU())


def _annotated(vgraphs, stages=None):
    """x -> relu -> neg -> exp with the given virtual graph (and pipeline stage) per op."""
    b = popart.Builder()
    t = x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    for k, op in enumerate(("relu", "neg", "exp")):
        t = getattr(b.aiOnnx, op)([t])
        if vgraphs[k] is not None:
            b.virtualGraph(t, vgraphs[k])
        if stages is not None and stages[k] is not None:
            b.pipelineStage(t, stages[k])
    return b.getModelProto(), x, t


def test_virtual_graph_annotations_in_manual_mode():
    manual = options(virtualGraphMode=popart.VirtualGraphMode.Manual)
    proto, x, out = _annotated([0, None, 1])
    with pytest.raises(IrError) as e:
        inference(proto, [out], manual, two_ipus())
    msg = str(e.value)
    assert msg.startswith("Either all Ops must have their virtual graph ids set, or none must. "
                          "Op count per virtual graph id\n")
    assert "  -1 : 1\n" in msg and "Ops with no virtual graph id :" in msg and "Neg" in msg
    proto, x, out = _annotated([None, None, None])
    with pytest.raises(IrError, match="SessionOptions flag virtualGraphMode is "
                                      "VirtualGraphMode::Manual, but no Ops have been annotated "
                                      "with virtual graph information"):
        inference(proto, [out], manual)
    proto, x, out = _annotated([0, 1, 1])
    one_ipu = inference(proto, [out], manual)     # the device is checked in prepareDevice
    with pytest.raises(IrError, match="has been assigned to an invalid virtual graph 1. "
                                      "numIPUs = 1."):
        one_ipu.prepareDevice()                  # (IrLowering, as PopART)
    s = inference(proto, [out], manual, two_ipus())
    np.testing.assert_allclose(run(s, {x: np.array([1, -1], np.float32)})[out],
                               np.exp([-1.0, 0.0]), rtol=1e-6)
    proto, x, out = _annotated([0, None, 1])     # virtualGraphMode Off: annotations ignored
    assert inference(proto, [out]) is not None


def test_pipeline_settings():
    o = options(enablePipelining=True)
    proto, x, out = _annotated([0, 0, 1], [0, 0, 1])
    with pytest.raises(IrError, match="Pipelining requires more than 1 IPU"):
        inference(proto, [out], o)
    o.virtualGraphMode = popart.VirtualGraphMode.Manual
    proto, x, out = _annotated([0, 0, 1], [0, None, 1])
    with pytest.raises(IrError, match="Only some ops have had their pipeline stage set"):
        inference(proto, [out], o, two_ipus())
    proto, x, out = _annotated([0, 1, 1], [0, 0, 1])
    with pytest.raises(IrError, match="have the same pipeline stage 0, but different virtual "
                                      "graph ids"):
        inference(proto, [out], o, two_ipus())
    proto, x, out = _annotated([0, 0, 1], [0, 0, 2])
    with pytest.raises(IrError, match="contains 2 stages, but stage 1 is missing"):
        inference(proto, [out], o, two_ipus())
    proto, x, out = _annotated([0, 0, 1], [0, 0, 1])
    with pytest.raises(IrError, match=r"depth \(batchesPerStep\) must equal at least the "
                                      r"number of pipeline stages \(2\)"):
        inference(proto, [out], o, two_ipus())   # one batch per step, two stages


# ---------------------------------------------------------------- Builder (builder_impl.cpp)
def test_untyped_input_only_in_subgraphs():
    b = popart.Builder()
    with pytest.raises(BuilderError, match="Can not add untyped tensors to the top-level graph"):
        b.addUntypedInputTensor()
    assert b.getInputTensorIds() == []           # nothing was added
    assert b.createSubgraphBuilder().addUntypedInputTensor()


def test_attribute_set_twice():
    b, x, w, y, z = model()
    b.addNodeAttribute("myAttr", 1, {y})
    with pytest.raises(BuilderError, match="Node already has attribute myAttr."):
        b.addNodeAttribute("myAttr", 2, {y})
    assert b.getInt64NodeAttribute("myAttr", {y}) == 1
    b.removeNodeAttribute("myAttr", {y})        # the fix: remove, then set
    b.addNodeAttribute("myAttr", 2, {y})
    assert b.getInt64NodeAttribute("myAttr", {y}) == 2
    with pytest.raises(BuilderError, match="Cannot remove attribute other as it does not exist."):
        b.removeNodeAttribute("other", {y})
    with pytest.raises(BuilderError, match="Could not find a node with outputs nope. Must "
                                           "specify all outputs of a node"):
        b.addNodeAttribute("myAttr", 1, {"nope"})
    with b.virtualGraph(0):
        t = b.aiOnnx.neg([z])
    with pytest.raises(BuilderError, match="Node already has attribute __ipu_number."):
        b.virtualGraph(t, 1)                      # already set by the context manager
    assert b.getVirtualGraph(t) == 0


def test_annotation_setters_override_rules():
    b, x, w, y, z = model()
    with pytest.raises(BuilderError, match=r"availableMemoryProportion must be in \(0,1\]"):
        b.setAvailableMemoryProportion(y, 0.0)
    b.setAvailableMemoryProportion(y, 0.5)
    b.setAvailableMemoryProportion(y, 0.25)      # PopART replaces this one
    assert b.getFloatNodeAttribute("__available_memory_proportion", [y]) == 0.25
    with pytest.raises(BuilderError, match="Unsupported mat mul serialization mode 'rows'"):
        b.setSerializeMatMul({y}, "rows", 2)
    b.setSerializeMatMul({y}, "none")            # sets nothing
    assert not b.nodeHasAttribute("__serialize_matmul_mode", [y])
    b.setSerializeMatMul({y}, "output_channels", 2)
    with pytest.raises(BuilderError, match="Node already has attribute __serialize_matmul_mode"):
        b.setSerializeMatMul({y}, "input_channels", 4)
    assert b.getStringNodeAttribute("__serialize_matmul_mode", [y]) == "output_channels"
    assert b.getInt64NodeAttribute("__serialize_matmul_factor", [y]) == 2
    with pytest.raises(BuilderError, match="enableConvDithering must be a bool value"):
        b.setEnableConvDithering(y, 2)
    # the builder still makes a model that runs
    s = inference(b.getModelProto(), [z])
    np.testing.assert_array_equal(run(s, {x: -X})[z], -X + 1)


# ---------------------------------------------------------------- host buffers (popart.cpp)
def test_non_contiguous_step_io_arrays():
    b, x, w, y, z = model()
    s = inference(b.getModelProto(), [z])
    s.prepareDevice()
    data = np.ascontiguousarray(X.T).T            # X's values, Fortran order
    assert not data.flags.c_contiguous
    with pytest.raises(StepIOError, match="PyStepIO is unable to use the numpy input array for "
                                          f"tensor '{x}' as it is not c-contiguous"):
        popart.PyStepIO({x: data}, s.initAnchorArrays())
    bad_out = {z: np.zeros((3, 2), np.float32).T}
    with pytest.raises(StepIOError, match="numpy output array for tensor .* not c-contiguous"):
        popart.PyStepIO({x: X}, bad_out)
    io = popart.PyStepIO({x: X}, s.initAnchorArrays())
    io.outputs[z] = bad_out[z]                    # replaced after construction: run checks
    with pytest.raises(StepIOError, match="output array .* not c-contiguous"):
        s.run(io)
    out = run(s, {x: np.ascontiguousarray(data)})  # the fix; the session still runs
    np.testing.assert_array_equal(out[z], np.zeros((2, 3), np.float32))


def test_non_contiguous_callback_arrays():
    b, x, w, y, z = model()
    s = inference(b.getModelProto(), [z])
    s.prepareDevice()
    result = np.zeros((2, 3), np.float32)

    def cb(input_order):
        data = np.asfortranarray(-X) if input_order == "F" else -X
        return popart.PyStepIOCallback(lambda i, p: data, lambda i: None,
                                       lambda a: result, lambda a: None)

    with pytest.raises(StepIOError, match="numpy input array for tensor .* not c-contiguous"):
        s.run(cb("F"))
    s.run(cb("C"))
    np.testing.assert_array_equal(result, -X + 1)


def test_weights_io_checks():
    b, x, w, y, z = model()
    s = inference(b.getModelProto(), [z], options(constantWeights=False))
    s.prepareDevice()
    with pytest.raises(WeightsIOError, match="PyWeightsIO is unable to use the provided numpy "
                                             f"output array for tensor '{w}' as it is not "
                                             "c-contiguous"):
        popart.PyWeightsIO({w: np.zeros((3, 2), np.float32).T})
    with pytest.raises(WeightsIOError, match="'nope' is not a weight"):
        s.readWeights(popart.PyWeightsIO({"nope": np.zeros(1, np.float32)}))
    with pytest.raises(WeightsIOError, match="'nope' is not a weight"):
        s.writeWeights(popart.PyWeightsIO({"nope": np.zeros(1, np.float32)}))
    with pytest.raises(WeightsIOError, match=rf"sizes \(in bytes\) of src \(24\) and dst \(36\) "
                                             rf"differ in hostStreamToHost for {w}"):
        s.readWeights(popart.PyWeightsIO({w: np.zeros((3, 3), np.float32)}))
    with pytest.raises(WeightsIOError, match="The shape of the MutableVoidData for IO does not "
                                             "not match the expected write region"):
        s.writeWeights(popart.PyWeightsIO({w: np.zeros((3, 3), np.float32)}))
    s.writeWeights(popart.PyWeightsIO({w: np.full((2, 3), 3.0, np.float32)}))   # the fix
    got = np.zeros((2, 3), np.float32)
    s.readWeights(popart.PyWeightsIO({w: got}))
    np.testing.assert_array_equal(got, np.full((2, 3), 3.0))
    np.testing.assert_array_equal(run(s, {x: X})[z], np.ones((2, 3)))


# ---------------------------------------------------------------- session arguments
def test_random_seed_must_be_an_unsigned_64_bit_integer():
    b, x, w, y, z = model()
    s = inference(b.getModelProto(), [z], options(enableStochasticRounding=True))   # seedable
    s.prepareDevice()
    for bad in (-1, 1.5, "3", 2 ** 64, True):
        with pytest.raises(ArgumentError, match=r"setRandomSeed\(\): incompatible function arguments"):
            s.setRandomSeed(bad)
        with pytest.raises(TypeError):   # as PopART's binding raises
            s.setRandomSeed(bad)
    s.setRandomSeed(2 ** 64 - 1)
    assert s.getRandomSeed() == 2 ** 64 - 1
    s.setRandomSeed(np.uint64(7))
    assert s.getRandomSeed() == 7
    np.testing.assert_array_equal(run(s, {x: X})[z], np.zeros((2, 3)))


def test_session_arguments():
    b, x, w, y, z = model()
    with pytest.raises(popart_exception, match="Must pass a valid deviceInfo to "
                                               "InferenceSession::createFromOnnxModel"):
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [z]), None)
    with pytest.raises(ArgumentError, match=r"__init__\(\): incompatible constructor arguments"):
        popart.InferenceSession(b.getModelProto(), {z: "ALL"}, CPU())


def test_unknown_program_handle():
    b, x, w, y, z = model()
    s = inference(b.getModelProto(), [z])
    with pytest.raises(popart_exception, match=r"\[Devicex::run\] Program foo not found."):
        s.run("foo", popart.PyStepIO({x: X}, s.initAnchorArrays()))
    np.testing.assert_array_equal(run(s, {x: X})[z], np.zeros((2, 3)))
