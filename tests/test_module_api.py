"""The rest of PopART's module: GraphTransformer, supported-operator queries, debug info,
reserved prefixes, settings structures and the smaller module-level names."""
import copy
import inspect
import json
import struct

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import popart
from popart.ops import registry


# ---------------------------------------------------------------------------------------
# helpers

def _model(nodes, inputs, outputs, initializers=(), opset=13, value_info=(),
           inits_as_inputs=False):
    inputs = list(inputs)
    if inits_as_inputs:   # IR-3 style: every initializer is also a graph input
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in initializers]
    g = helper.make_graph(nodes, "g", inputs, outputs, list(initializers),
                          value_info=list(value_info))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _ort(model, feeds):
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _load(gt):
    return onnx.load_from_string(gt.getModelProto())


def _float_model():
    """y = MatMul(x, W) + C;  z = Cast(i -> FLOAT) * y;  f = ConstantOfShape(shape) (float)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    c = rng.standard_normal((4,)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(c)),
        helper.make_node("Add", ["mm", "C"], ["y"]),
        helper.make_node("Cast", ["i"], ["ic"], to=TP.FLOAT),
        helper.make_node("Mul", ["ic", "y"], ["z"]),
        helper.make_node("ConstantOfShape", ["shape"], ["f"],
                         value=numpy_helper.from_array(np.array([1.25], np.float32))),
    ]
    m = _model(nodes, [_vi("x", TP.FLOAT, [2, 3]), _vi("i", TP.INT32, [2, 4])],
               [_vi("y", TP.FLOAT, [2, 4]), _vi("z", TP.FLOAT, [2, 4]), _vi("f", TP.FLOAT, [3])],
               [numpy_helper.from_array(w, "W"),
                numpy_helper.from_array(np.array([3], np.int64), "shape")],
               value_info=[_vi("mm", TP.FLOAT, [2, 4])])
    return m, w, c


# ---------------------------------------------------------------------------------------
# GraphTransformer

def test_graph_transformer_binds_every_popart_method():
    for name in ("getModelProto", "removeUnusedInputs", "prepareNodesForTraining",
                 "convertFloatsToHalfs", "convertUINT8ToINT32", "convertUINT16ToINT32",
                 "convertINT8ToINT32", "convertINT16ToINT32", "convertINT64ToINT32",
                 "convertDoublesToFloats", "convertDoublesToHalfs", "convertBFloats16ToFloat32",
                 "convertInitializersToConstants", "convertAllFixedPointInitializersToConstants",
                 "saveInitializersExternally"):
        assert callable(getattr(popart.GraphTransformer, name)), name
    assert list(inspect.signature(popart.GraphTransformer.convertINT64ToINT32).parameters) == \
        ["self", "clip"]
    assert inspect.signature(popart.GraphTransformer.convertINT64ToINT32).parameters[
        "clip"].default is False
    assert list(inspect.signature(popart.GraphTransformer.saveInitializersExternally)
                .parameters) == ["self", "ids", "filename"]


def test_constructor_sources_and_errors(tmp_path):
    m, _, _ = _float_model()
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    before = m.SerializeToString()
    for source in (str(path), path, m.SerializeToString(), m):
        gt = popart.GraphTransformer(source)
        gt.convertFloatsToHalfs()
        assert _load(gt).graph.input[0].type.tensor_type.elem_type == TP.FLOAT16
    assert m.SerializeToString() == before   # a ModelProto argument is not modified
    with pytest.raises(popart.popart_exception, match="does not exist"):
        popart.GraphTransformer(str(tmp_path / "missing.onnx"))
    bad = copy.deepcopy(m)
    bad.graph.node[0].input[1] = "nowhere"
    with pytest.raises(popart.popart_exception, match="not a valid ONNX model"):
        popart.GraphTransformer(bad.SerializeToString())


def test_convert_floats_to_halfs_runs_under_onnxruntime():
    m, w, c = _float_model()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    i = rng.integers(-3, 4, (2, 4)).astype(np.int32)
    gt = popart.GraphTransformer(m.SerializeToString())
    gt.convertFloatsToHalfs()
    out = _load(gt)
    assert [v.type.tensor_type.elem_type for v in out.graph.input] == [TP.FLOAT16, TP.INT32]
    assert {v.type.tensor_type.elem_type for v in out.graph.output} == {TP.FLOAT16}
    assert out.graph.value_info[0].type.tensor_type.elem_type == TP.FLOAT16
    w16 = numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "W"))
    assert w16.dtype == np.float16 and np.array_equal(w16, w.astype(np.float16))
    shape = numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "shape"))
    assert shape.dtype == np.int64            # other types untouched
    cast = next(n for n in out.graph.node if n.op_type == "Cast")
    assert helper.get_attribute_value(cast.attribute[0]) == TP.FLOAT16
    y, z, f = _ort(out, {"x": x.astype(np.float16), "i": i})
    assert y.dtype == z.dtype == f.dtype == np.float16
    y_ref, z_ref, f_ref = _ort(m, {"x": x, "i": i})
    np.testing.assert_allclose(y.astype(np.float32), y_ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(z.astype(np.float32), z_ref, rtol=1e-2, atol=2e-2)
    np.testing.assert_array_equal(f, np.full(3, 1.25, np.float16))
    # the half model computes with the half-rounded weights
    exp = x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32) \
        + c.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(y.astype(np.float32), exp, rtol=2e-3, atol=2e-3)


def test_convert_floats_to_halfs_inside_subgraphs():
    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(
            np.array([1.5, -2.0], np.float32)))], "then", [], [_vi("t", TP.FLOAT, [2])])
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", TP.FLOAT, [2])])
    m = _model([helper.make_node("If", ["cond"], ["out"], then_branch=then_g,
                                 else_branch=else_g)],
               [_vi("cond", TP.BOOL, []), _vi("x", TP.FLOAT, [2])], [_vi("out", TP.FLOAT, [2])])
    gt = popart.GraphTransformer(m)
    gt.convertFloatsToHalfs()
    out = _load(gt)
    x = np.array([0.25, 3.0], np.float16)
    (r,) = _ort(out, {"cond": np.array(True), "x": x})
    assert r.dtype == np.float16 and np.array_equal(r, np.array([1.5, -2.0], np.float16))
    (r,) = _ort(out, {"cond": np.array(False), "x": x})
    assert np.array_equal(r, -x)


@pytest.mark.parametrize("method,src", [("convertUINT8ToINT32", np.uint8),
                                        ("convertUINT16ToINT32", np.uint16),
                                        ("convertINT8ToINT32", np.int8),
                                        ("convertINT16ToINT32", np.int16)])
def test_convert_small_ints_to_int32(method, src):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(src))
    info = np.iinfo(src)
    k = np.array([info.min, info.max, 7, 0], src)
    m = _model([helper.make_node("Add", ["x", "K"], ["y"]),
                helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(k[:2]))],
               [_vi("x", elem, [4])], [_vi("y", elem, [4]), _vi("c", elem, [2])],
               [numpy_helper.from_array(k, "K")])
    gt = popart.GraphTransformer(m)
    getattr(gt, method)()
    out = _load(gt)
    assert out.graph.input[0].type.tensor_type.elem_type == TP.INT32
    k32 = numpy_helper.to_array(out.graph.initializer[0])
    assert k32.dtype == np.int32 and np.array_equal(k32, k.astype(np.int32))
    x = np.array([1, -1 if info.min < 0 else 1, 5, 9], np.int32)
    y, c = _ort(out, {"x": x})
    assert y.dtype == np.int32 and np.array_equal(y, x + k.astype(np.int32))
    assert c.dtype == np.int32 and np.array_equal(c, [info.min, info.max])


def _int64_model(values):
    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    return _model([helper.make_node("Gather", ["data", "idx"], ["g"], axis=0),
                   helper.make_node("Add", ["n", "off"], ["n2"]),
                   helper.make_node("Cast", ["n2"], ["nc"], to=TP.INT64)],
                  [_vi("n", TP.INT64, [2])],
                  [_vi("g", TP.FLOAT, [3, 2]), _vi("nc", TP.INT64, [2])],
                  [numpy_helper.from_array(data, "data"),
                   numpy_helper.from_array(np.array([5, 0, 2], np.int64), "idx"),
                   numpy_helper.from_array(np.array(values, np.int64), "off")]), data


def test_convert_int64_to_int32():
    m, data = _int64_model([10, -20])
    gt = popart.GraphTransformer(m)
    gt.convertINT64ToINT32()
    out = _load(gt)
    assert all(t.data_type in (TP.FLOAT, TP.INT32) for t in out.graph.initializer)
    g, nc = _ort(out, {"n": np.array([1, 2], np.int32)})
    assert np.array_equal(g, data[[5, 0, 2]])
    assert nc.dtype == np.int32 and np.array_equal(nc, [11, -18])


def test_convert_int64_to_int32_range_and_clip():
    big = [2 ** 40, -(2 ** 33)]
    m, _ = _int64_model(big)
    gt = popart.GraphTransformer(m)
    before = gt.getModelProto()
    with pytest.raises(popart.popart_exception, match=r"'off' holds 2 value.*the first 1099511627776.*clip=True"):
        gt.convertINT64ToINT32()
    assert gt.getModelProto() == before    # nothing half-converted
    with pytest.raises(popart.popart_exception, match="clip must be a bool"):
        gt.convertINT64ToINT32("yes")
    gt.convertINT64ToINT32(clip=True)
    off = numpy_helper.to_array(next(t for t in _load(gt).graph.initializer if t.name == "off"))
    assert off.dtype == np.int32 and off.tolist() == [2 ** 31 - 1, -(2 ** 31)]


@pytest.mark.parametrize("method,dst,np_dst", [("convertDoublesToFloats", TP.FLOAT, np.float32),
                                               ("convertDoublesToHalfs", TP.FLOAT16,
                                                np.float16)])
def test_convert_doubles(method, dst, np_dst):
    k = np.array([1.0 / 3.0, 1e-3, 70000.0 if np_dst == np.float32 else 1000.5, -2.5])
    m = _model([helper.make_node("Mul", ["x", "K"], ["y"])], [_vi("x", TP.DOUBLE, [4])],
               [_vi("y", TP.DOUBLE, [4])], [numpy_helper.from_array(k, "K")])
    gt = popart.GraphTransformer(m)
    getattr(gt, method)()
    out = _load(gt)
    kc = numpy_helper.to_array(out.graph.initializer[0])
    assert kc.dtype == np_dst and np.array_equal(kc, k.astype(np_dst))   # rounded once
    x = np.array([3.0, 2.0, 0.5, -1.0])
    (y,) = _ort(out, {"x": x.astype(np_dst)})
    assert y.dtype == np_dst
    (ref,) = _ort(m, {"x": x})
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=1e-6 if np_dst == np.float32
                               else 2e-3)


def test_convert_bfloat16_to_float32():
    k = np.array([1.5, -0.0078125, 3.0e38, 7.0], ml_dtypes.bfloat16)
    m = _model([helper.make_node("Add", ["x", "K"], ["y"])], [_vi("x", TP.BFLOAT16, [4])],
               [_vi("y", TP.BFLOAT16, [4])], [numpy_helper.from_array(k, "K")])
    gt = popart.GraphTransformer(m)
    gt.convertBFloats16ToFloat32()
    out = _load(gt)
    k32 = numpy_helper.to_array(out.graph.initializer[0])
    assert k32.dtype == np.float32 and np.array_equal(k32, k.astype(np.float32))   # exact
    assert out.graph.output[0].type.tensor_type.elem_type == TP.FLOAT
    x = np.array([1.0, 2.0, 0.0, -7.0], np.float32)
    (y,) = _ort(out, {"x": x})
    np.testing.assert_array_equal(y, x + k.astype(np.float32))


def test_convert_initializers_to_constants():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 2)).astype(np.float32)
    m = _model([helper.make_node("MatMul", ["x", "W"], ["y"]),
                helper.make_node("Reshape", ["y", "shape"], ["r"])],
               [_vi("x", TP.FLOAT, [2, 3])], [_vi("r", TP.FLOAT, [4])],
               [numpy_helper.from_array(w, "W"),
                numpy_helper.from_array(np.array([4], np.int64), "shape")],
               inits_as_inputs=True)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    (ref,) = _ort(m, {"x": x})
    gt = popart.GraphTransformer(m)
    gt.convertInitializersToConstants(["W"])
    out = _load(gt)
    assert [t.name for t in out.graph.initializer] == ["shape"]
    assert [v.name for v in out.graph.input] == ["x", "shape"]
    first = out.graph.node[0]
    assert (first.op_type, first.name, list(first.output)) == ("Constant", "W", ["W"])
    assert np.array_equal(numpy_helper.to_array(first.attribute[0].t), w)
    (r,) = _ort(out, {"x": x})
    np.testing.assert_array_equal(r, ref)
    with pytest.raises(popart.popart_exception, match="TensorId nope not in the model initalizers"):
        gt.convertInitializersToConstants(["shape", "nope"])
    assert [t.name for t in _load(gt).graph.initializer] == ["shape"]   # unchanged
    with pytest.raises(popart.popart_exception, match="tensor ids"):
        gt.convertInitializersToConstants([3])
    # the integer initializers: "shape" only, not the float one
    gt2 = popart.GraphTransformer(m)
    gt2.convertAllFixedPointInitializersToConstants()
    out2 = _load(gt2)
    assert [t.name for t in out2.graph.initializer] == ["W"]
    assert [n.output[0] for n in out2.graph.node if n.op_type == "Constant"] == ["shape"]
    (r,) = _ort(out2, {"x": x})
    np.testing.assert_array_equal(r, ref)


def test_remove_unused_inputs():
    m = _model([helper.make_node("Add", ["a", "K"], ["y"])],
               [_vi("a", TP.FLOAT, [2]), _vi("unused", TP.FLOAT, [2])], [_vi("y", TP.FLOAT, [2])],
               [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "K"),
                numpy_helper.from_array(np.array([9.0], np.float32), "J")],
               inits_as_inputs=True)
    gt = popart.GraphTransformer(m)
    gt.removeUnusedInputs()
    out = _load(gt)
    assert [v.name for v in out.graph.input] == ["a", "K"]
    assert [t.name for t in out.graph.initializer] == ["K"]
    (y,) = _ort(out, {"a": np.array([0.5, 0.5], np.float32)})
    np.testing.assert_array_equal(y, [1.5, 2.5])
    once = gt.getModelProto()
    gt.removeUnusedInputs()
    assert gt.getModelProto() == once


@pytest.mark.parametrize("opset,n_outputs", [(9, 5), (15, 3)])
def test_prepare_nodes_for_training(opset, n_outputs):
    stats = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in
             (("s", [1.0, 2.0]), ("b", [0.5, -1.0]), ("m", [1.0, 2.0]), ("v", [1.0, 2.0]))]
    m = _model([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"],
                                 name="bn")],
               [_vi("x", TP.FLOAT, [4, 2])], [_vi("y", TP.FLOAT, [4, 2])], stats, opset=opset)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    (inference,) = _ort(m, {"x": x})
    gt = popart.GraphTransformer(m)
    gt.prepareNodesForTraining()
    out = _load(gt)
    node = out.graph.node[0]
    assert len(node.output) == n_outputs
    for index, name in enumerate(node.output[1:], start=1):
        assert name.startswith(f"BatchNormalization_bn_oi{index}_")
    assert len(set(node.output)) == n_outputs
    if opset >= 14:
        assert helper.get_attribute_value(node.attribute[0]) == 1   # training_mode
    onnx.checker.check_model(out)
    # run the training variety: Y normalises with the batch's statistics
    out.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in node.output[1:])
    y, running_mean, running_var = _ort(out, {"x": x})[:3]
    mean, var = x.mean(0), x.var(0)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5) * [1, 2] + [0.5, -1],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(running_mean, 0.9 * np.array([1, 2]) + 0.1 * mean, rtol=1e-6)
    assert not np.allclose(y, inference)


def test_save_initializers_externally(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    m = _model([helper.make_node("Gemm", ["x", "W", "B"], ["y"])],
               [_vi("x", TP.FLOAT, [2, 4])], [_vi("y", TP.FLOAT, [2, 3])],
               [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    x = rng.standard_normal((2, 4)).astype(np.float32)
    (ref,) = _ort(m, {"x": x})
    monkeypatch.chdir(tmp_path)
    gt = popart.GraphTransformer(m)
    gt.saveInitializersExternally(["W", "B"], "weights.bin")
    raw = (tmp_path / "weights.bin").read_bytes()
    assert raw == w.tobytes() + b.tobytes()
    out = _load(gt)
    info = {t.name: {e.key: e.value for e in t.external_data} for t in out.graph.initializer}
    assert info["W"] == {"location": "weights.bin", "offset": "0", "length": str(w.nbytes)}
    assert info["B"]["offset"] == str(w.nbytes)
    assert all(t.data_location == TP.EXTERNAL and not t.raw_data for t in out.graph.initializer)
    (tmp_path / "model.onnx").write_bytes(gt.getModelProto())
    (y,) = ort.InferenceSession(str(tmp_path / "model.onnx"),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, ref)
    # a model with external data keeps working through GraphTransformer (loaded from file)
    gt2 = popart.GraphTransformer(str(tmp_path / "model.onnx"))
    gt2.convertFloatsToHalfs()
    w16 = numpy_helper.to_array(_load(gt2).graph.initializer[0])
    assert np.array_equal(w16, w.astype(np.float16))
    with pytest.raises(popart.popart_exception, match="already has an external data_location"):
        gt.saveInitializersExternally(["W"], "again.bin")
    with pytest.raises(popart.popart_exception, match="'x' is not an initializer"):
        popart.GraphTransformer(m).saveInitializersExternally(["x"], "w2.bin")
    assert not (tmp_path / "w2.bin").exists()
    with pytest.raises(popart.popart_exception, match="parent directory .* does not exist"):
        popart.GraphTransformer(m).saveInitializersExternally(["W"], "no/such/dir/w.bin")


def test_graph_transformer_output_runs_in_a_popart_session():
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]))
    w = builder.addInitializedInputTensor(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    y = builder.aiOnnx.matmul([x, w])
    builder.addOutputTensor(y)
    gt = popart.GraphTransformer(builder.getModelProto())
    gt.convertFloatsToHalfs()
    session = popart.InferenceSession(gt.getModelProto(),
                                      popart.DataFlow(1, {y: popart.AnchorReturnType("All")}),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    xv = np.array([[1.0, 0.5], [-1.0, 2.0]], np.float16)
    session.run(popart.PyStepIO({x: xv}, anchors))
    assert anchors[y].dtype == np.float16
    np.testing.assert_allclose(anchors[y].astype(np.float32),
                               xv.astype(np.float32) @ [[1, 2], [3, 4]], rtol=1e-3)


# ---------------------------------------------------------------------------------------
# Supported operators

def test_operator_identifier():
    a = popart.OperatorIdentifier("", "Add", 7)
    b = popart.OperatorIdentifier(domain="ai.onnx", type="Add", version=7, numInputs=2,
                                  numOutputs=1)
    assert a.domain == "ai.onnx" and (a.type, a.version) == ("Add", 7)
    assert a == b and hash(a) == hash(b) and a != popart.OperatorIdentifier("", "Add", 13)
    assert b.numInputs == popart.NumInputs(2, 2) and b.numOutputs == 1
    assert popart.OperatorIdentifier("ai.onnx", "Concat", 4, (1, -1), 1).numInputs.max == -1
    assert str(a) == "ai.onnx.Add:7"
    assert sorted([popart.OperatorIdentifier("ai.onnx", "Sub", 7), a])[0] is a
    with pytest.raises(AttributeError):
        a.version = 8
    with pytest.raises(popart.popart_exception, match="domain: expected a str, got 1"):
        popart.OperatorIdentifier(1, "Add", 7)
    with pytest.raises(popart.popart_exception, match="version: expected an int >= 0"):
        popart.OperatorIdentifier("ai.onnx", "Add", -1)


def test_get_supported_operations():
    public = popart.getSupportedOperations(False)
    everything = popart.getSupportedOperations(includeInternal=True)
    assert public == sorted(public) and len(set(public)) == len(public)
    assert set(public) < set(everything)
    assert {o.domain for o in set(everything) - set(public)} == {"ai.popxl"}
    for opid in [("ai.onnx", "Add", 7), ("ai.onnx", "Constant", 9), ("ai.onnx", "Shape", 1),
                 ("ai.onnx", "ConstantOfShape", 9), ("ai.onnx", "Greater", 9),
                 ("ai.graphcore", "Scale", 1), ("ai.graphcore", "IdentityLoss", 1)]:
        assert popart.OperatorIdentifier(*opid) in public, opid
    add7 = next(o for o in public if (o.type, o.version) == ("Add", 7))
    assert add7.numInputs == popart.NumInputs(2, 2) and add7.numOutputs == 1
    concat = next(o for o in public if (o.type, o.version) == ("Concat", 4))
    assert (concat.numInputs.min, concat.numInputs.max) == (1, -1)
    # every listed ai.onnx version is an ONNX schema version the registry lowers
    for o in public:
        if o.domain == "ai.onnx":
            assert onnx.defs.get_schema(o.type, o.version, "").since_version == o.version
            assert registry.lookup(o.domain, o.type, o.version) is not None
    with pytest.raises(popart.popart_exception, match="includeInternal must be a bool"):
        popart.getSupportedOperations("no")


def test_get_supported_operations_definition():
    defs = popart.getSupportedOperationsDefinition(False)
    assert list(defs) == popart.getSupportedOperations(False)
    reshape = defs[popart.OperatorIdentifier("ai.onnx", "Reshape", 5)]
    assert [i.name for i in reshape.inputs] == ["data", "shape"]
    assert [i.constant for i in reshape.inputs] == [False, True]
    assert reshape.inputs[1].supportedTensors == [popart.DataType.INT64]
    assert [o.name for o in reshape.outputs] == ["reshaped"]
    conv = defs[popart.OperatorIdentifier("ai.onnx", "Conv", 11)]
    assert {"pads", "strides", "group", "dilations"} <= set(conv.attributes)
    assert conv.attributes["pads"].supportedValuesRegex == "*"
    assert popart.DataType.FLOAT16 in conv.inputs[0].supportedTensors
    assert popart.DataType.INT32 not in conv.inputs[0].supportedTensors
    scale = defs[popart.OperatorIdentifier("ai.graphcore", "Scale", 1)]
    assert set(scale.attributes) == {"scale"} and len(scale.inputs) == 1
    assert isinstance(scale.inputs[0], popart.OpDefinition.Input)
    assert getattr(popart, "OpDefinition::Input") is popart.OpDefinition.Input


def test_get_unsupported_operations():
    for opset in (10, 11, 20):
        unsupported = popart.getUnsupportedOperations(opset)
        supported = {(o.type, o.version) for o in popart.getSupportedOperations(False)}
        assert not supported & {(o.type, o.version) for o in unsupported}
        for o in unsupported:
            with pytest.raises(popart.popart_exception):
                registry.lookup(o.domain, o.type, o.version)
            assert onnx.defs.get_schema(o.type, opset, "").since_version == o.version
    # every op of opset 11 that is not reported unsupported can be lowered at opset 11
    reported = {o.type for o in popart.getUnsupportedOperations(11)}
    for s in onnx.defs.get_all_schemas():
        if s.domain == "" and s.since_version <= 11 and s.name not in reported:
            schema = onnx.defs.get_schema(s.name, 11, "")
            if not schema.deprecated:
                registry.lookup("ai.onnx", s.name, schema.since_version)
    with pytest.raises(popart.popart_exception, match="opsetVersion must be an int in 1.."):
        popart.getUnsupportedOperations(0)


# ---------------------------------------------------------------------------------------
# Debug info

def _bar(arg, debugContext):
    di = popart.DebugInfo(debugContext, "unit_test")
    di.setValue("arg", str(arg))
    return di.getPathName()


def _foo(arg, debugContext):
    di = popart.DebugInfo(debugContext, "unit_test")
    di.setValue("arg", str(arg))
    di.setValue("count", 3)
    di.setValue("shape", [2, 3])
    line = inspect.currentframe().f_lineno + 1
    path = _bar(123, debugContext=popart.DebugContext(di, "bar"))
    return line, path


def test_debug_info_json_file(tmp_path):
    filename = tmp_path / "debug.json"
    popart.initializePoplarDebugInfo(str(filename), "json")
    foo_line = inspect.currentframe().f_lineno + 1
    bar_line, bar_path = _foo(42, popart.DebugContext("top"))
    assert not filename.exists()            # written when the streamer is closed
    popart.closePoplarDebugInfo()
    popart.closePoplarDebugInfo()           # a second close does nothing
    assert bar_path == "top/bar"
    data = json.loads(filename.read_text())
    strings = data["stringTable"]
    bar, foo = data["contexts"]             # written as destroyed: bar's first
    assert (foo["id"], bar["parentId"]) == (1, 1) and "parentId" not in foo
    assert strings[foo["name"]] == "top" and strings[bar["name"]] == "bar"
    assert foo["layer"] == bar["layer"] == "unit_test"
    assert (foo["arg"], bar["arg"], foo["count"], foo["shape"]) == ("42", "123", 3, [2, 3])
    assert strings[foo["location"]["functionName"]] == "test_debug_info_json_file"
    assert strings[bar["location"]["functionName"]] == "_foo"
    assert strings[foo["location"]["fileName"]].endswith("test_module_api.py")
    assert (foo["location"]["lineNumber"], bar["location"]["lineNumber"]) == (foo_line, bar_line)


def test_debug_info_values_contexts_and_errors(tmp_path):
    di = popart.DebugInfo("from a str", "layer")      # a str is a DebugContext
    assert di.getPathName() == "from a str"
    assert di.setValue("k", popart.ProfileValue({"a": [1, "x", True]})) is True
    assert di.setValue("k", "again") is False          # already set
    assert di.setValue("layer", "x") is False          # one of the record's own fields
    with pytest.raises(popart.popart_exception, match="expected a str, number, bool"):
        di.setValue("obj", object())
    loc = popart.SourceLocation("fn", "file.py", 7)
    dc = popart.DebugContext("n", loc)
    assert dc.location == loc and dc.getPathName() == "n"
    assert popart.DebugContext(di, "child").getPathName() == "from a str/child"
    assert popart.DebugContext(popart.DebugContext(di, "c")).getPathName() == "from a str/c"
    assert popart.DebugContext().getPathName() == ""
    with pytest.raises(popart.popart_exception, match="loc must be a SourceLocation"):
        popart.DebugContext("n", "not a location")
    with pytest.raises(popart.popart_exception, match="format must be 'json' or 'cbor', got 'xml'"):
        popart.initializePoplarDebugInfo(str(tmp_path / "d.json"), "xml")
    with pytest.raises(popart.popart_exception, match="does not exist"):
        popart.initializePoplarDebugInfo(str(tmp_path / "no" / "d.json"))
    # the Builder takes a DebugContext where it takes a debugContext name
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    assert b.aiOnnx.relu([x], debugContext=popart.DebugContext("myrelu")).startswith("myrelu")


def _cbor_decode(data, pos=0):
    head = data[pos]
    major, info = head >> 5, head & 31
    pos += 1
    if major == 7:
        if info == 27:
            return struct.unpack(">d", data[pos:pos + 8])[0], pos + 8
        return {20: False, 21: True, 22: None}[info], pos
    if info < 24:
        n = info
    else:
        size = {24: 1, 25: 2, 26: 4, 27: 8}[info]
        n = int.from_bytes(data[pos:pos + size], "big")
        pos += size
    if major == 0:
        return n, pos
    if major == 1:
        return -1 - n, pos
    if major == 3:
        return data[pos:pos + n].decode(), pos + n
    if major == 4:
        out = []
        for _ in range(n):
            v, pos = _cbor_decode(data, pos)
            out.append(v)
        return out, pos
    if major == 5:
        out = {}
        for _ in range(n):
            k, pos = _cbor_decode(data, pos)
            out[k], pos = _cbor_decode(data, pos)
        return out, pos
    raise AssertionError(major)


def test_debug_info_cbor_file(tmp_path):
    lines = []
    for name, fmt in (("d.json", "json"), ("d.cbor", "cbor")):
        popart.initializePoplarDebugInfo(str(tmp_path / name), fmt)
        lines.append(inspect.currentframe().f_lineno + 1)
        kept = popart.DebugInfo(popart.DebugContext("a"), "popart")   # alive at close
        kept.setValue("v", -2.5)
        kept.setValue("big", 70000)
        popart.closePoplarDebugInfo()
    data = (tmp_path / "d.cbor").read_bytes()
    doc, end = _cbor_decode(data)
    assert end == len(data)
    assert doc == json.loads((tmp_path / "d.json").read_text())
    context = doc["contexts"][0]
    assert (context["v"], context["big"], context["layer"]) == (-2.5, 70000, "popart")
    assert context["location"]["lineNumber"] == lines[1]
    assert doc["stringTable"][context["name"]] == "a"


# ---------------------------------------------------------------------------------------
# Reserved prefixes, settings, the smaller names

BOUND_PREFIXES = {
    "reservedGradientPrefix": "Gradient___", "reservedUpdatedVarPrefix": "UpdatedVar___",
    "reservedAccumPrefix": "Accum___", "reservedAcclPrefix": "Accl___",
    "reservedAccl1Prefix": "Accl1___", "reservedAccl2Prefix": "Accl2___",
    "reservedAccl3Prefix": "Accl3___", "reservedStepPrefix": "Step___",
    "reservedAcclToReducePrefix": "AcclIntoReduce___",
    "reservedAcclToUpdatePrefix": "AcclIntoUpdate___",
    "reservedAcclFinalOutPrefix": "AcclOutOfAcclUpdate___",
    "reservedFinalReducedGradPrefix": "FinalReducedGradient___",
    "reservedAdamUpdaterPrefix": "AdamUpdater___", "reservedLambR1SqPrefix": "LambR1Sq___",
    "reservedLambR2SqPrefix": "LambR2Sq___", "reservedStashedPrefix": "Stashed___",
    "reservedRestoredPrefix": "Restored___", "reservedLossScalingPrefix": "lossScaling_",
    "reservedRandomSeedPrefix": "randomSeed___",
    "reservedSeedModifierPrefix": "randomSeedModifier___",
    "reservedRemoteArgPrefix": "RemoteArg___",
    "reservedDefaultWeightDecayScaleFactor0Prefix": "weightDecayScaleFactor0___default___",
    "reservedSpecificWeightDecayScaleFactor0Prefix": "weightDecayScaleFactor0___specific___",
    "reservedDefaultScaledLearningRate0Prefix": "scaledLearningRate0___default___",
    "reservedSpecificScaledLearningRate0Prefix": "scaledLearningRate0___specific___",
    "reservedDefaultScaledWeightDecay1Prefix": "scaledWeightDecay1___default___",
    "reservedSpecificScaledWeightDecay1Prefix": "scaledWeightDecay1___specific___",
    "reservedDefaultScaledLearningRate1Prefix": "scaledLearningRate1___default___",
    "reservedSpecificScaledLearningRate1Prefix": "scaledLearningRate1___specific___",
    "reservedDefaultDampeningScaleFactor1Prefix": "dampeningScaleFactor1___default___",
    "reservedSpecificDampeningScaleFactor1Prefix": "dampeningScaleFactor1___specific___",
    "reservedDefaultScaledMomentum1Prefix": "scaledMomentum1___default___",
    "reservedSpecificScaledMomentum1Prefix": "scaledMomentum1___specific___",
    "reservedDefaultLearningRatePrefix": "learningRate___default___",
    "reservedSpecificLearningRatePrefix": "learningRate___specific___",
    "reservedDefaultWeightDecayPrefix": "weightDecay___default___",
    "reservedSpecificWeightDecayPrefix": "weightDecay___specific___",
    "reservedDefaultLossScalingPrefix": "lossScaling___default___",
    "reservedSpecificLossScalingPrefix": "lossScaling___specific___",
    "reservedDefaultMaxWeightNormPrefix": "maxWeightNorm___default___",
    "reservedSpecificMaxWeightNormPrefix": "maxWeightNorm___specific___",
    "reservedAutomaticLossScalePrefix": "AutomaticLossScaleProxy___",
    "reservedDefaultAdamBeta1Prefix": "adamBeta1___default___",
    "reservedSpecificAdamBeta1Prefix": "adamBeta1___specific___",
    "reservedDefaultAdamBeta2Prefix": "adamBeta2___default___",
    "reservedSpecificAdamBeta2Prefix": "adamBeta2___specific___",
    "reservedDefaultAdamEpsPrefix": "adamEps___default___",
    "reservedSpecificAdamEpsPrefix": "adamEps___specific___",
    "reservedDefaultStepPrefix": "step___default___",
    "reservedSpecificStepPrefix": "step___specific___",
}


def test_reserved_prefixes():
    for name, value in BOUND_PREFIXES.items():
        assert getattr(popart, name)() == value, name


def test_experimental_settings_and_other_setting_structures():
    opts = popart.SessionOptions()
    exp = opts.experimentalSettings
    assert isinstance(exp, popart.ExperimentalSettings)
    assert exp.customTransformApplierSettings == {}
    assert exp.createHostTransferableTensorWithOffset is False
    assert opts._enableRngStateManagement is False
    exp.customTransformApplierSettings = {"Fwd0": ["A", "B"]}
    exp.customTransformApplierSettings["Fwd1"] = ["C"]      # PopART's dict wrapper semantics
    assert exp._customTransformApplierSettings == {"Fwd0": ["A", "B"], "Fwd1": ["C"]}
    assert "experimentalSettings" in opts.summary()
    copied = copy.copy(opts)
    copied.experimentalSettings.createHostTransferableTensorWithOffset = True
    assert opts.experimentalSettings.createHostTransferableTensorWithOffset is False
    with pytest.raises(popart.popart_exception, match="expected str -> list of str"):
        exp.customTransformApplierSettings = {"Fwd0": "A"}
    with pytest.raises(popart.popart_exception, match="no setting 'typo'"):
        exp.typo = 1
    with pytest.raises(popart.popart_exception, match="expected a ExperimentalSettings"):
        opts.experimentalSettings = {"customTransformApplierSettings": {}}
    opts.experimentalSettings = popart.ExperimentalSettings()
    assert "experimentalSettings" not in opts.summary()
    opts.numIOTiles = popart.NumIOTiles(64)
    assert opts.numIOTiles == 64 and popart.NumIOTiles() == 0
    eps = popart.ExecutionPhaseSettings(2, 3, popart.ExecutionPhaseIOSchedule.OnDemand,
                                        popart.ExecutionPhaseIOSchedule.OnDemand,
                                        popart.ExecutionPhaseIOSchedule.Preload,
                                        popart.ExecutionPhaseIOSchedule.Preload,
                                        optimizerSchedule=popart.ExecutionPhaseSchedule.Batch)
    assert (eps.phases, eps.stages, eps.schedule) == (2, 3, popart.ExecutionPhaseSchedule.Batch)


def test_small_module_names(tmp_path):
    assert popart.versionString() == popart.__version__
    assert ".".join(map(str, popart.versionNumber())) == popart.__version__
    assert len(popart.packageHash()) == 10
    assert (popart.defaultAiOnnxMlOpset, popart.defaultAiGraphcoreOpset) == (1, 1)
    assert popart.getTensorInfo(np.zeros((2, 3), np.float16)) == popart.TensorInfo("FLOAT16",
                                                                                   [2, 3])
    assert popart.syncPatternFromString("singlePipeline") == popart.SyncPattern.SinglePipeline
    assert popart.syncPatternToString(popart.SyncPattern.ReplicaAndLadder) == "replicaAndLadder"
    with pytest.raises(popart.popart_exception, match="Unknown syncPattern setting: 'half'"):
        popart.syncPatternFromString("half")
    assert isinstance(popart.PyStepIO({}, {}), popart.IStepIO)
    assert isinstance(popart.PyWeightsIO({}), popart.IWeightsIO)
    assert popart.OutOfMemoryError().isSuccessful()
    b = popart.Builder()
    assert isinstance(b.aiGraphcore, popart.AiGraphcoreOpset1)
    assert isinstance(b.nameScope("s"), popart.NameContextManager)
    assert isinstance(popart.Logger("session"), popart.Logger)
    for fn, exc in ((popart._throw_popart_error, popart.popart_exception),
                    (popart._throw_recoverable_runtime_error,
                     popart.poplar_recoverable_runtime_error),
                    (popart._throw_unknown_runtime_error, popart.poplar_unknown_runtime_error)):
        with pytest.raises(exc, match="boom"):
            fn("boom")


def test_numerics_report(tmp_path):
    rng = np.random.default_rng(4)
    w0, v0 = rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(4)
    da, db = rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal((3, 2))
    paths = []
    for name, w, v in (("a0", w0, v0), ("a1", w0 + da, v0), ("b0", w0, v0),
                       ("b1", (w0 + db).astype(np.float32), v0)):
        m = _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x", TP.FLOAT, [1])],
                   [_vi("y", TP.FLOAT, [1])],
                   [numpy_helper.from_array(w, "w"),
                    numpy_helper.from_array(np.arange(3, dtype=np.int64), "n")])
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(m, paths[-1])
    report = popart.NumericsReport(*paths)
    a = (w0 + da).astype(np.float64) - w0
    b = (w0 + db).astype(np.float32).astype(np.float64) - w0
    expected = np.sum((a - b) ** 2) / (np.sqrt(np.sum(a * a) * np.sum(b * b)) + 1e-8)
    assert set(report.getRelativeErrors()) == {"w"}     # integer weights are skipped
    assert report.getRelativeErrors()["w"] == pytest.approx(expected, rel=1e-9)
    assert report.report("w").startswith("|dA - dB|^2 / (|dA||dB| + 1e-8)  = ")
    assert report.fullReport().startswith("\nw : \n|dA - dB|^2")
    with pytest.raises(popart.popart_exception, match="No report available for 'n'"):
        report.report("n")
    with pytest.raises(popart.popart_exception, match="not a regular file"):
        popart.NumericsReport(paths[0], paths[1], paths[2], str(tmp_path / "none.onnx"))


def test_net_writer():
    class Writer(popart.writer.NetWriter):
        def infer(self, inputsMap):
            return ("infer", inputsMap)

        def train(self, inputsMap):
            return ("train", inputsMap)

    df = popart.DataFlow(1, {"y": popart.AnchorReturnType("All")})
    w = Writer(["x"], ["y"], None, df, popart.InputShapeInfo())
    assert w.step({"x": 1}) == ("infer", {"x": 1})
    assert Writer(["x"], ["y"], popart.ConstSGD(0.1), df, None).step({}) == ("train", {})
    with pytest.raises(NotImplementedError, match="saveModel"):
        w.saveModel("m.onnx")
    with pytest.raises(popart.popart_exception, match="inNames must be a list"):
        Writer("x", ["y"], None, df, None)
