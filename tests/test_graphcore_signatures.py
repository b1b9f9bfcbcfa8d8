"""One source for ai.graphcore signatures and defaults (popart._ir.graphcore_schema), read by
the Builder and by the engine; and one DataType -> ONNX -> NumPy table.

The expected signatures below are transcribed from PopART's Python API reference
(AiGraphcoreOpset1); behaviour is checked through InferenceSessions on models written with
onnx.helper (nodes lacking attributes, as other tools write them)."""
import inspect

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

import popart
from popart.errors import ModelError, popart_exception
from popart._ir import graphcore_schema as gs
from popart.ops import registry
from popart.tensorinfo import DataType, np_dtype, onnx_dtype, to_datatype
from op_tester import infer

from helpers.graphcore_case import graphcore_op_builder, required_attrs

GC = "ai.graphcore"
R = gs.REQUIRED

# PopART's Python API reference: method -> [(parameter, default or R)] after ``args``
# (debugContext last unless listed).
REFERENCE = {
    "batchnormalization": [("num_outputs", R), ("epsilon", 1e-5), ("momentum", 0.9)],
    "bucketize": [("right", 0)],
    "call": [("num_outputs", R), ("callee", R), ("debugName", "")],   # PopART's builder.py
    "ctcbeamsearchdecoder": [("blank", 0), ("beam_width", 100), ("top_paths", 1),
                             ("debug_context", "")],
    "ctcloss": [("reduction", "Mean"), ("blank", 0), ("outDataType", "UNDEFINED"),
                ("zeroInfinity", False)],
    "depthtospace": [("blocksize", R), ("mode", R)],
    "dynamicadd": [("axes", R), ("sizes", R)],
    "dynamicslice": [("axes", R), ("sizes", R), ("noOverlap", 0)],
    "dynamicupdate": [("axes", R), ("sizes", R), ("noOverlap", 0)],
    "dynamiczero": [("axes", R), ("sizes", R)],
    "groupedgather": [("axis", 0), ("group_size", 1)],
    "groupedscatterreduce": [("axis_size", R), ("axis", -1), ("reduction", "Sum"),
                             ("group_size", 1), ("enable_index_broadcast", 1)],
    "groupnormalization": [("num_groups", R), ("epsilon", 1e-5)],
    "identityloss": [("reduction", "Mean")],
    "incrementmod": [("increment", R), ("modulus", R)],
    "l1loss": [("lambda_", R), ("reduction", "Mean")],
    "lstm": [("outputFullSequence", 1)],
    "nllloss": [("reduction", "Mean"), ("ignoreIndex", None), ("inputIsLogProbability", False)],
    "normalize_image": [("scale", 1.0)],
    "packedDataBlock": [("maxSequenceLengths", R), ("resultSize", R), ("callbackBatchSize", R),
                        ("callback", R), ("debugName", "")],   # PopART's builder.py
    "printtensor": [("print_gradient", 1), ("debugContext", ""), ("title", ""),
                    ("summariseThreshold", 1000), ("edgeItems", 3), ("maxLineWidth", 75),
                    ("digits", 8), ("floatFormat", 0), ("separator", " "), ("openBracket", "["),
                    ("closeBracket", "]")],
    "reducemedian": [("axes", None), ("keepdims", 1)],
    "replicatedallreduce": [("collectiveOperator", None), ("commGroup", None)],
    "replicatedreducescatter": [("collectiveOperator", None), ("commGroup", None)],
    "reshape": [("shape", R)],
    "reverse": [("dimensions", R)],
    "scale": [("scale", R)],
    "scaledadd": [("scale0", 1.0), ("scale1", 1.0)],
    "scatterreduce": [("axis_size", R), ("axis", -1), ("reduction", "Sum"),
                      ("enable_index_broadcast", 1)],
    "sequenceslice": [("zeroUnused", 0)],
    "shapeddropout": [("shape", R), ("ratio", 0.5)],
    "slice": [("ends", R), ("starts", R), ("axes", R)],
    "sort": [("axis", -1), ("descending", 0), ("stable", 0)],
    "splinebasis": [("degree", R)],
    "subsample": [("strides", R)],
    "tensorremap": [("remap_type", 0), ("debugPrefix", "")],
}
NO_ATTRIBUTES = ["abort", "atan2", "bitwiseand", "bitwisenot", "bitwiseor", "bitwisexnor",
                 "bitwisexor", "copyvarupdate", "detach", "expm1", "fmod", "gelu", "geluerf",
                 "log1p", "nearbyint", "nop", "remainder", "round", "splineweighting", "swish"]


@pytest.mark.parametrize("method", sorted(REFERENCE) + NO_ATTRIBUTES)
def test_builder_signature_is_the_reference(method):
    params = inspect.signature(getattr(popart.Builder().aiGraphcore, method)).parameters
    got = [(n, R if p.default is inspect.Parameter.empty else p.default)
           for n, p in params.items() if n != "args" and p.kind != p.VAR_KEYWORD]
    exp = list(REFERENCE.get(method, []))
    if not any(n in ("debugContext", "debug_context", "debugPrefix", "debugName")
               for n, _ in exp):
        exp.append(("debugContext", ""))
    assert [n for n, _ in got] == [n for n, _ in exp]
    for (name, d), (_, e) in zip(got, exp):
        assert d is R if e is R else (d is not R and d == e), (method, name, d, e)


def test_table_lists_each_method_once():
    assert len(gs.BY_METHOD) == len(gs.SCHEMAS)
    assert set(REFERENCE) | set(NO_ATTRIBUTES) <= set(gs.BY_METHOD)


# ---------------------------------------------------------------------------------------
# The lowerings take their defaults from the table

# Lowerings in other modules that still carry keyword defaults for table attributes:
# (op type, attribute) -> where. LSTM's equals the table's; the collectives' 0 is Add, what
# an absent collectiveOperator means; PackedDataBlock's are never used (the engine raises
# for the missing required attribute first).
_OTHER_MODULES = {("LSTM", "outputFullSequence"): "rnn",
                  ("ReplicatedAllReduce", "collectiveOperator"): "collectives",
                  ("ReplicatedReduceScatter", "collectiveOperator"): "collectives",
                  **{("PackedDataBlock", a): "graphcore_internal" for a in
                     ("maxSequenceLengths", "resultSize", "callbackBatchSize", "callback")}}


def _lowering(op_type):
    fn = registry.lookup(GC, op_type, 1).lower
    return inspect.signature(getattr(fn, "__wrapped__", fn)), fn


@pytest.mark.parametrize("schema", gs.SCHEMAS, ids=lambda s: s.method)
def test_lowering_has_no_defaults_of_its_own(schema):
    sig, fn = _lowering(schema.op_type)
    for a in schema.attrs:
        p = sig.parameters.get(a.name)
        if p is None or (schema.op_type, a.name) in _OTHER_MODULES:
            continue
        if a.absent is None:   # optional and unset: the lowering's "not given" case
            assert p.default is None, (schema.op_type, a.name, p.default)
        else:
            assert p.default is inspect.Parameter.empty, (schema.op_type, a.name, p.default)
    # keyword-only parameters are attributes; a name the table does not know is never set
    names = set(gs.NODE_ATTRS[schema.op_type])
    unknown = [n for n, p in sig.parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in names]
    assert not unknown, (schema.op_type, unknown)


@pytest.mark.parametrize("schema", gs.SCHEMAS, ids=lambda s: s.method)
def test_builder_writes_the_engines_defaults(schema):
    """A Builder node made with only the required arguments holds, for each optional
    attribute, the value the engine gives a node that lacks it."""
    b, x, samples = graphcore_op_builder()
    required = required_attrs(schema, samples)
    getattr(b.aiGraphcore, schema.method)([x], *([2] if schema.outputs == "n" else []),
                                          **{("lambda_" if k == "lambda" else k): v
                                             for k, v in required.items()})
    node = b._graph.node[-1]
    written = {a.name: registry.decode_attr(helper.get_attribute_value(a))
               for a in node.attribute if a.name not in required and a.name != "__debug_info_id"}
    own = {a.name for a in schema.attrs}   # (another method may write more: groupedscatterreduce)
    engine = {k: v for k, v in gs.node_defaults(node.op_type, required, "test").items() if k in own}
    assert written == engine, schema.method
    for a in schema.attrs:   # every optional attribute with a value is written
        if a.default not in (R, None):
            assert a.name in written, (schema.method, a.name)


# ---------------------------------------------------------------------------------------
# Required attributes

def test_l1loss_without_lambda_raises_at_builder_time():
    b = popart.Builder()
    x = b.addInputTensor("FLOAT", [3])
    with pytest.raises(popart_exception, match="lambda"):
        b.aiGraphcore.l1loss([x])
    with pytest.raises(popart_exception, match="scale"):
        b.aiGraphcore.scale([x])
    y = b.aiGraphcore.l1loss([x], 0.5)
    assert y and b._graph.node[-1].attribute[0].name == "lambda"


def _model(op_type, inputs, n_out=1, **attrs):
    """A one-node ai.graphcore model written with onnx.helper (node name "n0")."""
    node = helper.make_node(op_type, list(inputs), [f"y{i}" for i in range(n_out)],
                            name="n0", domain=GC, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in inputs.items()],
        [onnx.ValueInfoProto(name=f"y{i}") for i in range(n_out)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                   helper.make_opsetid(GC, 1)])


def run(op_type, inputs, n_out=1, **attrs):
    outs = infer(_model(op_type, inputs, n_out, **attrs), inputs, [f"y{i}" for i in range(n_out)])
    return outs if n_out > 1 else outs[0]


X = np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.5


@pytest.mark.parametrize("op_type,inputs,attrs,missing", [
    ("L1", {"x": X}, {"reduction": "Sum"}, "lambda"),
    ("Scale", {"x": X}, {}, "scale"),
    ("ScatterReduce", {"x": X, "i": np.zeros((3, 4), np.int32)}, {}, "axis_size"),
    ("DynamicSlice", {"x": X, "o": np.zeros(1, np.int32)}, {"sizes": [1]}, "axes"),
    ("GroupNormalization", {"x": X, "s": np.ones(4, np.float32), "b": np.zeros(4, np.float32)},
     {"epsilon": 1e-5}, "num_groups"),
])
def test_node_without_required_attribute_is_a_model_error(op_type, inputs, attrs, missing):
    model = _model(op_type, inputs, **attrs).SerializeToString()
    df = popart.DataFlow(1, {"y0": popart.AnchorReturnType("ALL")})
    with pytest.raises(ModelError) as info:
        s = popart.InferenceSession(model, df, popart.DeviceManager().createCpuDevice())
        s.prepareDevice()
    msg = str(info.value)
    assert "'n0'" in msg and f"ai.graphcore::{op_type}" in msg and f"'{missing}'" in msg


def test_required_attribute_given_runs():
    np.testing.assert_allclose(run("L1", {"x": X}, **{"lambda": 0.5}, reduction="Sum"),
                               0.5 * np.abs(X).sum(), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Optional attributes: the table's default takes effect on a node without them

def test_loss_defaults_are_mean():
    p = np.full((3, 4), 0.25, np.float32)
    p[:, 1] = 0.5
    p /= p.sum(-1, keepdims=True)
    label = np.array([1, 0, 3], np.int32)
    per = -np.log(p[np.arange(3), label])
    np.testing.assert_allclose(run("Nll", {"p": p, "l": label}), per.mean(), rtol=1e-6)
    np.testing.assert_allclose(run("L1", {"x": X}, **{"lambda": 2.0}), 2 * np.abs(X).mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(run("IdentityLoss", {"x": X}), X.mean(), rtol=1e-6)
    # PopART's encoding of NoReduction is "None"
    np.testing.assert_allclose(run("Nll", {"p": p, "l": label}, reduction="None"), per, rtol=1e-6)


def test_elementwise_and_shape_defaults():
    y = X[::-1].copy()
    np.testing.assert_allclose(run("ScaledAdd", {"a": X, "b": y}), X + y, rtol=1e-6)
    v, i = run("Sort", {"x": y * -1}, n_out=2)     # last axis, ascending
    np.testing.assert_allclose(v, np.sort(-y, -1))
    np.testing.assert_array_equal(i, np.argsort(-y, -1, kind="stable"))
    m, _ = run("ReduceMedian", {"x": X}, n_out=2)  # every axis, keepdims
    assert m.shape == (1, 1) and m.item() == np.sort(X.ravel())[5]
    np.testing.assert_array_equal(run("Slice", {"x": X}, starts=[1, 1], ends=[3, 3]), X[1:3, 1:3])
    np.testing.assert_array_equal(run("PrintTensor", {"x": X}), X)


def test_depthtospace_mode_defaults_to_dcr():
    x = np.arange(2 * 8 * 2 * 3, dtype=np.float32).reshape(2, 8, 2, 3)
    n, c, h, w = x.shape
    dcr = x.reshape(n, 2, 2, c // 4, h, w).transpose(0, 3, 4, 1, 5, 2).reshape(n, c // 4, h * 2, w * 2)
    crd = x.reshape(n, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c // 4, h * 2, w * 2)
    assert not np.array_equal(dcr, crd)
    np.testing.assert_array_equal(run("DepthToSpace", {"x": x}, blocksize=2), dcr)
    np.testing.assert_array_equal(run("DepthToSpace", {"x": x}, blocksize=2, mode="CRD"), crd)


def test_scatterreduce_defaults_and_popart_encoding():
    src = np.array([[1, 5, 2, 7], [3, 1, 4, 1], [0, 2, 6, 9]], np.float32)
    idx = np.array([0, 2, 0, 1], np.int32)             # broadcast along the last axis
    exp = np.zeros((3, 3), np.float32)
    for j, k in enumerate(idx):
        exp[:, k] += src[:, j]
    np.testing.assert_allclose(run("ScatterReduce", {"s": src, "i": idx}, axis_size=3), exp)
    got = run("ScatterReduce", {"s": src, "i": idx}, axis_size=3, reduction="max")
    np.testing.assert_allclose(got, np.stack([np.maximum(src[:, 0], src[:, 2]), src[:, 3],
                                              src[:, 1]], 1))


def test_grouped_scatterreduce_is_a_scatterreduce_with_group_size():
    """As PopART writes it: ScatterReduce with group_size; the leading axis is the group."""
    b = popart.Builder(opsets={"ai.onnx": 13, "ai.graphcore": 1})
    src = np.array([[1, 4, 4, -1], [3, 3, 5, 2]], np.float32)
    idx = np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int32)
    s, i = b.addInputTensor(popart.TensorInfo(src)), b.addInputTensor(popart.TensorInfo(idx))
    y = b.aiGraphcore.groupedscatterreduce([s, i], axis_size=3, axis=1, group_size=2)
    b.addOutputTensor(y)
    assert b._graph.node[-1].op_type == "ScatterReduce"
    got = infer(b.getModelProto(), {s: src, i: idx}, [y])[0]
    np.testing.assert_allclose(got, [[1, 8, -1], [7, 0, 6]])


def test_ctc_out_data_type():
    T_, N, C = 4, 2, 3
    lp = np.log(np.full((T_, N, C), 1 / C, np.float16))
    feeds = {"lp": lp, "t": np.array([[1], [2]], np.uint32),
             "il": np.array([4, 4], np.uint32), "tl": np.array([1, 1], np.uint32)}
    assert run("Ctc", feeds).dtype == np.float16          # UNDEFINED: the input's type
    assert run("Ctc", feeds, outDataType=onnx.TensorProto.FLOAT).dtype == np.float32
    b = popart.Builder()
    ids = [b.addInputTensor(popart.TensorInfo(v)) for v in feeds.values()]
    b.aiGraphcore.ctcloss(ids, outDataType="FLOAT")
    attr = {a.name: helper.get_attribute_value(a) for a in b._graph.node[-1].attribute}
    assert attr["outDataType"] == onnx.TensorProto.FLOAT and attr["reduction"] == b"Mean"


def test_builder_writes_popart_encodings():
    b = popart.Builder()
    x = b.addInputTensor("FLOAT", [3])
    b.aiGraphcore.identityloss([x], reduction=popart.ReductionType.NoReduction)
    b.aiGraphcore.printtensor([x], separator=";")
    red, pt = b._graph.node[-2], b._graph.node[-1]
    assert helper.get_attribute_value(red.attribute[0]) == b"None"
    sep = next(a for a in pt.attribute if a.name == "separator")
    assert sep.type == onnx.AttributeProto.INT and sep.i == ord(";")
    assert popart.Builder().aiGraphcore.normalize_image.__name__ == "normalize_image"


# ---------------------------------------------------------------------------------------
# dtypes: DataType -> ONNX in one table, NumPy from onnx.helper

@pytest.mark.parametrize("dt", [d for d in DataType if d is not DataType.UNDEFINED],
                         ids=lambda d: d.value)
def test_datatype_onnx_numpy_round_trip(dt):
    t = onnx_dtype(dt)
    assert np_dtype(dt) == np.dtype(helper.tensor_dtype_to_np_dtype(t))
    assert to_datatype(t) is dt and to_datatype(np_dtype(dt)) is dt


def test_datatype_special_cases():
    assert np_dtype("BFLOAT16") == np.dtype(ml_dtypes.bfloat16)
    assert np_dtype("FLOAT8_143") == np.dtype(ml_dtypes.float8_e4m3fnuz)
    assert np_dtype(DataType.FLOAT8_152) == np.dtype(ml_dtypes.float8_e5m2fnuz)
    assert onnx_dtype("UNDEFINED") == onnx.TensorProto.UNDEFINED
    with pytest.raises(popart_exception, match="UNDEFINED"):
        np_dtype("UNDEFINED")


def test_optimizer_enums_are_the_options_enums():
    import popart.optimizers as opt
    import popart.options as options
    for name in ("WeightDecayMode", "AdamMode", "AdaptiveMode", "SGDAccumulatorAndMomentum"):
        assert getattr(opt, name) is getattr(options, name)
