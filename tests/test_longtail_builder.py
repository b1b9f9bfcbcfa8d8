"""Issue 25, the Builder's part: PopART's default ai.onnx opset (10) and opset selection
(item 1), the Builder's call forms and shape inference (item 5), its construction-time
checks (item 8, builder_helper.cpp), its DEBUG line (item 10) and the popart names of the
module audit (item 13). Expected values are PopART's rules and messages, written out here;
model semantics are checked against onnxruntime."""
from __future__ import annotations

import inspect
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import popart
from popart.builder import AiGraphcore, AiOnnx10, AiOnnxMl, Builder

F32 = np.float32


def _model(b: Builder) -> onnx.ModelProto:
    return onnx.load_from_string(b.getModelProto())


def _node(b: Builder, out: str) -> onnx.NodeProto:
    return next(n for n in _model(b).graph.node if out in n.output)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _ort(b: Builder, outs: list, feeds: dict) -> list:
    for o in outs:
        b.addOutputTensor(o)
    sess = ort.InferenceSession(b.getModelProto(), providers=["CPUExecutionProvider"])
    return sess.run(outs, feeds)


# --------------------------------------------------------------------------- item 1

def test_default_ai_onnx_opset_is_10():
    assert popart.defaultAiOnnxOpset == 10
    b = Builder()
    assert b.aiOnnx.version == 10 and str(b.aiOnnx) == "AiOnnx10"
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    b.addOutputTensor(b.aiOnnx.relu([x]))
    assert [(o.domain, o.version) for o in _model(b).opset_import] == [("", 10)]


def test_opset_10_forms_pad_clip_resize_scatter_constant():
    """At opset 10, Pad and Clip take attributes, Resize takes [X, scales], Scatter exists
    and constant's second positional argument is the debug name."""
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    p = b.aiOnnx.pad([x], [0, 1, 1, 0], "constant", 5.0)
    c = b.aiOnnx.clip([x], 0.5, -0.5)                       # (args, max, min) as PopART's
    scales = b.aiOnnx.constant(np.array([1, 2], F32), "myscales")
    r = b.aiOnnx.resize([x, scales])
    idx = b.aiOnnx.constant(np.array([[1, 0, 1]], np.int64))
    upd = b.aiOnnx.constant(np.array([[7, 8, 9]], F32))
    s = b.aiOnnx.scatter([x, idx, upd], axis=0)
    assert scales == "myscales:0" and _node(b, scales).name == "myscales"
    assert _attrs(_node(b, p))["pads"] == [0, 1, 1, 0] and len(_node(b, p).input) == 1
    assert _attrs(_node(b, c))["max"] == pytest.approx(0.5) and len(_node(b, c).input) == 1
    assert len(_node(b, r).input) == 2 and _node(b, s).op_type == "Scatter"
    xv = np.arange(6, dtype=F32).reshape(2, 3) / 4 - 0.5
    got = _ort(b, [p, c, r, s], {x: xv})
    np.testing.assert_allclose(got[0], np.pad(xv, [(0, 1), (1, 0)], constant_values=5.0))
    np.testing.assert_allclose(got[1], np.clip(xv, -0.5, 0.5))
    np.testing.assert_allclose(got[2], np.repeat(xv, 2, axis=1))
    ref = xv.copy()
    ref[[1, 0, 1], [0, 1, 2]] = [7, 8, 9]
    np.testing.assert_allclose(got[3], ref)


def test_first_ai_onnx_opset_wins():
    b = Builder()
    assert b.aiOnnxOpset11.version == 11 and b.aiOnnx.version == 11
    with pytest.raises(RuntimeError) as e:
        b.aiOnnxOpset10
    assert e.value.args[0] == ("Invalid opset 'aiOnnxOpset10' selected. Opset for domain "
                               "ai.onnx already defined as 11")
    b2 = Builder()
    b2.aiOnnx.relu
    with pytest.raises(RuntimeError, match="^Invalid opset 'aiOnnxOpset11' selected. Opset for "
                                           "domain ai.onnx already defined as 10$"):
        b2.aiOnnxOpset11
    assert Builder(opsets={"ai.onnx": 9, "ai.graphcore": 1}).aiOnnx.version == 9


def test_each_opset_has_popart_ops():
    """PopART's generated opsets keep ops ONNX deprecated: Upsample in 10 and 11, Scatter in
    11; Range first appears in 11."""
    def ops(v: int) -> set:
        return set(dir(Builder().__getattr__(f"aiOnnxOpset{v}")))
    assert {"upsample", "scatter"} <= ops(9) and {"upsample", "scatter"} <= ops(10)
    assert {"upsample", "scatter", "scatterelements", "range"} <= ops(11)
    assert "range" not in ops(10)
    b = Builder(opsets={"ai.onnx": 11, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]))
    i = b.aiOnnx.constant(np.array([3, 0], np.int64))
    u = b.aiOnnx.constant(np.array([1, 2], F32))
    s = b.aiOnnx.scatter([x, i, u], axis=0)
    node = _node(b, s)
    assert (node.op_type, list(node.input), _attrs(node)["axis"]) == ("Scatter", [x, i, u], 0)


# --------------------------------------------------------------------------- item 5

def test_ops_without_inputs_take_no_args():
    b = Builder()
    params = list(inspect.signature(b.aiOnnx.randomuniform).parameters)
    assert params == ["shape", "dtype", "high", "low", "seed", "debugContext"]
    assert list(inspect.signature(b.aiOnnx.randomnormal).parameters)[0] == "shape"
    r = b.aiOnnx.randomuniform([2, 3], high=2.0, debugContext="ru")
    node = _node(b, r)
    assert list(node.input) == [] and _attrs(node)["shape"] == [2, 3] and node.name == "ru"
    with pytest.raises(TypeError):
        b.aiOnnx.randomnormal(shape=[2], mean=0.0, bogus=1)


def test_signatures_are_the_generated_bindings():
    b = Builder()
    names = lambda f: [n for n, p in inspect.signature(f).parameters.items()   # noqa: E731
                       if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert names(b.aiOnnx.conv) == ["args", "dilations", "group", "kernel_shape", "pads",
                                    "strides", "debugContext"]
    assert names(b.aiOnnx.maxpool) == ["args", "num_outputs", "kernel_shape", "ceil_mode",
                                       "dilations", "pads", "storage_order", "strides",
                                       "debugContext"]
    assert names(AiOnnx10.constant) == ["self", "value", "debugContext"]
    assert names(b.aiGraphcore.call) == ["args", "num_outputs", "callee", "debugName"]
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 4, 4]))
    w = b.addInitializedInputTensor(np.ones([1, 1, 3, 3], F32))
    y = b.aiOnnx.conv([x, w], [1, 1], 1, [3, 3], [1, 1, 1, 1], [1, 1], "myconv")
    assert _node(b, y).name == "myconv"              # 7th positional: the debug name
    with pytest.raises(TypeError):
        b.aiOnnx.conv([x, w], [1, 1], 1, [3, 3], [1, 1, 1, 1], [1, 1], "a", "b")
    with pytest.raises(TypeError):
        b.aiOnnx.constant(np.ones(2, F32), True)      # opset 10 has no is_value_sparse
    with pytest.raises(TypeError):
        b.aiOnnx.add([x, 1])                           # an id that is not a str
    with pytest.raises(TypeError):
        b.aiOnnx.leakyrelu([x], alpha="high")          # a FLOAT attribute


def test_builder_shape_inference_subsample_floor_and_nll():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [5, 7, 6]))
    s = b.aiGraphcore.subsample([x], [2, 3, 4])
    assert b.getTensorShape(s) == [5 // 2, 7 // 3, 6 // 4]       # defs.cpp: floor
    p = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]))
    lab = b.addInputTensor(popart.TensorInfo("INT32", [5]))     # shape not checked here
    n = b.aiGraphcore.nllloss([p, lab], reduction=popart.ReductionType.NoReduction)
    m = b.aiGraphcore.nllloss([p, lab])
    assert b.getTensorShape(n) == [5] and b.getTensorShape(m) == []
    assert b.getTensorDtypeString(n) == "float32"


def test_input_value_ids_and_debug_info_ids():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    w = b.addInitializedInputTensor(np.ones(2, F32), "w")
    z = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "z")
    a = b.aiOnnx.add([x, w])
    o = b.aiOnnx.mul([a, z])
    b.addOutputTensor(o)
    assert b.getInputTensorIds() == [x, w, z]
    assert b.getValueTensorIds() == [a, o]
    ids = [_attrs(n)["__debug_info_id"] for n in _model(b).graph.node]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(isinstance(i, int) for i in ids)


def test_debug_info_id_names_the_builder_record(tmp_path):
    def build() -> Builder:
        b = Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
        b.addOutputTensor(b.aiOnnx.add([x, x], "sum"))
        return b
    assert build().getModelProto() == build().getModelProto()   # the same model, same bytes
    path = tmp_path / "debug.json"
    popart.initializePoplarDebugInfo(str(path), "json")
    try:
        b = build()
    finally:
        popart.closePoplarDebugInfo()
    node = _model(b).graph.node[0]
    doc = __import__("json").loads(path.read_text())
    record = next(c for c in doc["contexts"] if c["id"] == _attrs(node)["__debug_info_id"])
    names = doc["stringTable"]
    assert record["layer"] == "popartbuilder" and names[record["name"]] == "sum"
    assert record["category"] == "api" and record["api"] == "Add"
    assert record["inputs"] == ["x", "x"] and record["outputs"] == list(node.output)


def test_zero_d_array_is_a_float_attribute():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    y = b.aiOnnx.leakyrelu([x], np.array(0.25))
    assert _node(b, y).attribute[0].type == onnx.AttributeProto.FLOAT
    xv = np.array([-4, 0, 2], F32)
    got = _ort(b, [y], {x: xv})[0]
    np.testing.assert_allclose(got, np.where(xv > 0, xv, 0.25 * xv))
    z = b.aiGraphcore.scale([x], np.array(3.0, np.float32))
    assert _node(b, z).attribute[0].type == onnx.AttributeProto.FLOAT
    assert _attrs(_node(b, z))["scale"] == pytest.approx(3.0)


@pytest.fixture(scope="module")
def if_and_call():
    """An If whose branches capture x through addInputTensorFromParentGraph, and a Call
    whose body's input (added the same way, named x) binds to the Call's input y."""
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    y = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "y")
    c = b.addInputTensor(popart.TensorInfo("BOOL", []), "c")
    then_b, else_b, body = (b.createSubgraphBuilder() for _ in range(3))
    for sub in (then_b, else_b, body):
        sub.addInputTensorFromParentGraph(x)
    then_b.addOutputTensor(then_b.aiOnnx.mul([x, x]))
    else_b.addOutputTensor(else_b.aiOnnx.neg([x]))
    body.addOutputTensor(body.aiOnnx.sin([x]))
    (o_if,) = b.aiOnnx.logical_if([c], 1, else_b, then_b)
    (o_call,) = b.aiGraphcore.call([y], 1, body)
    b.addOutputTensor(o_if)
    b.addOutputTensor(o_call)
    sess = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [o_if, o_call]),
                                   popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    return b, sess, (x, y, c, o_if, o_call)


@pytest.mark.parametrize("cond", [True, False])
def test_parent_graph_inputs_if_by_name_call_by_position(if_and_call, cond):
    b, sess, (x, y, c, o_if, o_call) = if_and_call
    if_node = _node(b, o_if)
    assert all(len(a.g.input) == 0 for a in if_node.attribute if a.type == a.GRAPH)
    xv, yv = np.array([1, -2, 3], F32), np.array([0.5, 1, 1.5], F32)
    anchors = sess.initAnchorArrays()
    sess.run(popart.PyStepIO({x: xv, y: yv, c: np.array(cond)}, anchors))
    np.testing.assert_allclose(anchors[o_if], xv * xv if cond else -xv)
    np.testing.assert_allclose(anchors[o_call], np.sin(yv), rtol=1e-6)


# --------------------------------------------------------------------------- item 8

def test_conv_checks_at_builder_time():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 5, 5]))
    w = b.addInitializedInputTensor(np.ones([3, 2, 3, 3], F32), "w")
    with pytest.raises(popart.popart_exception) as e:
        b.aiOnnx.conv([x, w], kernel_shape=[2, 2])
    assert e.value.args[0] == ("kernel_shape, [2 2], does not match inferred shape from "
                               "weight input 'w', [3 3]")
    small = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 1, 1]))
    with pytest.raises(popart.popart_exception) as e:   # 1 - 1 - 2*(3-1) < 0
        b.aiOnnx.conv([small, w], dilations=[2, 2])
    assert e.value.args[0] == ("Window parameter values combine to give invalid spatial "
                               "output shape: [-3 -3]")
    with pytest.raises(popart.popart_exception, match=r"^Padding vector \(length 2\) does not "
                                                      r"have 2 values for each spatial "
                                                      r"dimension 2$"):
        b.aiOnnx.averagepool([x], kernel_shape=[2, 2], pads=[1, 1])
    with pytest.raises(popart.popart_exception, match=r"^Length of strides vector 1 != number "
                                                      r"of spatial dimensions 2$"):
        b.aiOnnx.maxpool([x], 1, kernel_shape=[2, 2], strides=[1])
    y = b.aiOnnx.conv([x, w], pads=[1, 1, 1, 1])
    assert b.getTensorShape(y) == [1, 3, 5, 5]


def test_conv_dithering_only_on_conv():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 1, 3, 3]))
    w = b.addInitializedInputTensor(np.ones([1, 1, 1, 1], F32))
    y = b.aiOnnx.conv([x, w])
    r = b.aiOnnx.relu([y])
    with pytest.raises(popart.popart_exception) as e:
        b.setEnableConvDithering(r, 1)
    assert e.value.args[0] == ("Builder::setEnableConvDithering should only be called on "
                               "convolutions but was given: Relu")
    b.setEnableConvDithering(y, 1)
    assert b.getInt64NodeAttribute("__enable_conv_dithering", [y]) == 1


def test_multiconv_checks():
    b = Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 4, 4]))
    w = b.addInitializedInputTensor(np.ones([2, 2, 1, 1], F32))
    with pytest.raises(popart.popart_exception) as e:
        b.aiGraphcore.multiconv([[x, w], [x, w]], dilations=[[1, 1]], debugContext="mc")
    assert e.value.args[0] == ("For MultiConvOp 'mc', number of dilations parameter sets (1) "
                               "does not match the number of input sets (2)")
    with pytest.raises(popart.popart_exception) as e:
        b.aiGraphcore.multiconv([[x, w]], dilations=[[1]])
    assert e.value.args[0] == "Length of dilations vector 1 != number of spatial dimensions 2"
    with pytest.raises(popart.popart_exception, match="must have at least two inputs"):
        b.aiGraphcore.multiconv([[x]])
    assert len(b.aiGraphcore.multiconv([[x, w], [x, w]], dilations=[[1, 1], [2, 2]])) == 2


# --------------------------------------------------------------------------- item 10

def test_debug_line_adding_op_to_builder_opset(caplog):
    logger = popart.getLogger("builder")
    before = logger.getLevel()
    logger.setLevel("DEBUG")
    try:
        with caplog.at_level(logging.DEBUG, logger="popart.builder"):
            b = Builder()
            x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
            b.aiOnnx.add([x, x], "sum")
            b.aiGraphcore.scale([x], 2.0)
    finally:
        logger.setLevel(before)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "popart.builder" and r.levelno == logging.DEBUG]
    assert "Adding ai.onnx.Add:7 to builder opset:10, numInputs:2 numOutputs:1 " \
           "numAttributes:1 name:sum" in lines
    assert "Adding ai.graphcore.Scale:1 to builder opset:1, numInputs:1 numOutputs:1 " \
           "numAttributes:2 name:" in lines


# --------------------------------------------------------------------------- item 13

def test_module_audit_names():
    info = popart.TensorInfo("FLOAT16", [2, 3, 4])
    assert info.strides([2, 3, 4]) == list(np.zeros([2, 3, 4], np.float16).strides)
    assert info.metaShape() == []
    info.set("INT32", [6], [12])
    assert (info.data_type(), info.shape(), info.metaShape()) == ("INT32", [6], [12])
    dev = popart.DeviceManager().createCpuDevice()
    assert dev.tilesPerIpu == dev.tilesPerIPU and dev.ipuVersion == dev.version
    assert dev.numWorkerContexts == 6
    assert {"IPU_RESET", "LINK_RESET", "PARTITION_RESET", "FULL_RESET"} <= set(
        popart.RecoveryAction.__members__)
    opts = popart.SessionOptions()
    opts.updatableBuffers = ["buf"]
    assert opts.updatableNamedBuffers == ["buf"] and opts.updatableBuffers == ["buf"]
    err = popart.OutOfMemoryException("boom")
    assert err.error == "boom" and str(err) == "boom"
    assert popart.getLogger().module == "popart" and "name" in inspect.signature(
        popart.getLogger).parameters
    sgd = popart.SGD({}, [], popart.SGDAccumulatorAndMomentum.Combined,
                     popart.DataType.UNDEFINED, popart.DataType.UNDEFINED, "mysgd")
    adam = popart.Adam({}, popart.AdamMode.Adam, popart.WeightDecayMode.Decay,
                       popart.DataType.UNDEFINED, popart.DataType.FLOAT, popart.DataType.FLOAT,
                       [], False, "myadam")
    assert (sgd.debugContext, adam.debugContext) == ("mysgd", "myadam")


def test_builder_opset_audit_names():
    b = Builder()
    with pytest.raises(ValueError):
        b.aiOnnxOpsetVersion(5)
    b.aiOnnxOpsetVersion(11)          # chooses nothing, as PopART's
    assert b.aiOnnx.version == 10
    assert b.aiOnnx.aiOnnx is b.aiOnnx and isinstance(b.aiGraphcore.aiGraphcore, AiGraphcore)
    assert isinstance(b.aiOnnxMl.aiOnnxMl, AiOnnxMl)
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    sub = b.createSubgraphBuilder()
    sub.addOutputTensor(sub.aiOnnx.neg([x]))
    (o,) = b.aiGraphcore.call([], 1, sub, debugName="mycall")
    assert _node(b, o).name == "mycall"


def test_gradient_through_call_of_parent_graph_input_is_not_doubled():
    """The Call body's input (added by addInputTensorFromParentGraph, named w) binds to the
    Call's input w by position: d sum(w * w) / dw = 2 w, counted once."""
    b = Builder()
    wv = np.array([1.0, 2.0, 3.0], F32)
    w = b.addInitializedInputTensor(wv, "w")
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    body = b.createSubgraphBuilder()
    body.addInputTensorFromParentGraph(w)
    body.addOutputTensor(body.aiOnnx.mul([w, w]))
    (o,) = b.aiGraphcore.call([w], 1, body)
    loss = b.aiGraphcore.l1loss([b.aiOnnx.add([o, x])], 1.0,
                                reduction=popart.ReductionType.Sum)
    grad = popart.reservedGradientPrefix() + w
    sess = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [grad]), loss,
                                  popart.ConstSGD(1e-9), popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    sess.weightsFromHost()
    anchors = sess.initAnchorArrays()
    sess.run(popart.PyStepIO({x: np.zeros(3, F32)}, anchors))
    np.testing.assert_allclose(anchors[grad], 2 * wv)
