"""PopART's tail, second round (issue 37, ops part): op behaviour, messages and types as PopART
has them. Each test names the PopART source it follows; references are NumPy transcriptions
of PopART's rules, onnx.reference where ONNX agrees."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import popart
from popart import popart_exception

F32 = np.float32
GRAD = popart.reservedGradientPrefix()


def CPU():
    return popart.DeviceManager().createCpuDevice()


def model(nodes, feeds, outputs, opset=11, consts=(), inits=()):
    """An ONNX model of ``nodes`` whose inputs are ``feeds`` (name -> array), ``consts`` (name,
    array) Constant nodes and ``inits`` (name, array) initializers."""
    nodes = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(np.asarray(v), k))
             for k, v in consts] + list(nodes)
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, 0, None) for o in outputs]
    g = helper.make_graph(nodes, "g", ins, outs, [numpy_helper.from_array(np.asarray(v), k)
                                                  for k, v in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                               helper.make_opsetid("ai.graphcore", 1)])


def infer(proto, feeds, outputs):
    """One InferenceSession run of ``proto`` (a ModelProto or bytes): the anchors' values."""
    proto = proto if isinstance(proto, bytes) else proto.SerializeToString()
    s = popart.InferenceSession(proto, popart.DataFlow(1, list(outputs)), CPU())
    s.prepareDevice()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO(dict(feeds), a))
    return [a[o] for o in outputs]


def run(nodes, feeds, outputs, **kw):
    return infer(model(nodes, feeds, outputs, **kw), feeds, outputs)


def raises_text(text, nodes, feeds, outputs, **kw):
    """The session raises a popart_exception whose message is ``text`` (PopART's own)."""
    with pytest.raises(popart_exception) as e:
        run(nodes, feeds, outputs, **kw)
    assert e.value.args[0] == text
    return e


X23 = np.arange(6, dtype=F32).reshape(2, 3)
node = helper.make_node


# ---------------------------------------------------------------- messages (PopART's texts)
def test_matmul_messages():   # op/matmul.cpp:130, 222
    op = "Op(mm (ai.onnx.MatMul:9), inputs=[x, w], outputs=[y])"
    mm = [node("MatMul", ["x", "w"], ["y"], name="mm")]
    raises_text(f"{op} contracting dimensions unequal: lhs 'x' [2 3], rhs 'w' [2 3]",
                mm, {"x": X23, "w": X23}, ["y"])
    raises_text(f"{op} contracting dimensions unequal: lhs 'x' [1 3], rhs 'w' [2 3]",
                mm, {"x": X23[0], "w": X23}, ["y"])   # a 1-D lhs shown as [1, n]
    raises_text("np broadcasting failed on 'Op 0 (ai.onnx.MatMul:9)', frames [2] and [3] are "
                "not aligned", mm, {"x": np.ones((2, 2, 3), F32), "w": np.ones((3, 3, 4), F32)},
                ["y"])   # the batch dimensions (prettyNpOut)
    raises_text(f"{op} doesn't support scalar tensor w as the rhs input",
                mm, {"x": X23, "w": np.array(2, F32)}, ["y"])
    (y,) = run(mm, {"x": X23, "w": X23.T.copy()}, ["y"])   # the corrected call
    np.testing.assert_allclose(y, X23 @ X23.T)


@pytest.mark.parametrize("nodes, feeds, consts, text", [
    ([node("Transpose", ["x"], ["y"], perm=[1])], {"x": X23}, (),   # op/transpose.cpp:117
     "Rank of permutation tensor [1], rank 1 must be equal to rank of input tensor, shape [2 3], "
     "rank 2."),
    ([node("Reshape", ["x", "s"], ["y"])], {"x": X23}, [("s", np.array([-1, -1]))],   # :155
     "Need the value of the ai.onnx.Reshape:5 input 'shape' to determine the output shape, but "
     "was unable because shape input to ReshapeOp can only use -1 to specify one unknown "
     "dimension"),
    ([node("Reshape", ["x", "s"], ["y"])], {"x": X23}, [("s", np.array([4, -1]))],
     "Need the value of the ai.onnx.Reshape:5 input 'shape' to determine the output shape, but "
     "was unable because Incompatible inferred dimension, not whole number."),
    ([node("Reshape", ["x", "s"], ["y"])], {"x": X23}, [("s", np.array([3, -2]))],
     "Need the value of the ai.onnx.Reshape:5 input 'shape' to determine the output shape, but "
     "was unable because Dimension, -2, of new shape for Reshape cannot be smaller than -1."),
    ([node("Reshape", ["x", "s"], ["y"], name="r")], {"x": X23}, [("s", np.array([4, 2]))],
     "Failure in ReshapeOp::setup() for Op(r (ai.onnx.Reshape:5), inputs=[x, s], outputs=[y]). "
     "Trying to reshape from [2 3] to [4 2]. The number of elements of the input is 6, while the "
     "number of elements of the output is 8. The number of elements cannot change for a "
     "ReshapeOp"),
    ([node("Slice", ["x", "b", "e", "a"], ["y"])], {"x": X23},   # op/slice.cpp
     [("b", np.array([0])), ("e", np.array([1])), ("a", np.array([-3]))],
     "slice op input tensor x, rank 2, axis -3 is out of range"),
    ([node("Expand", ["x", "s"], ["y"])], {"x": X23}, [("s", np.array([4, 2]))],   # expand.cpp
     "Need the value of the ai.onnx.Expand:8 input 'shape' to determine the output shape, but "
     "was unable because Expand shape constraint: corresponding dimensions must have the same "
     "value or one of them must be 1"),
    ([node("Tile", ["x", "s"], ["y"])], {"x": X23}, [("s", np.array([2]))],   # tile.cpp
     "'Repeats' tensor `s' should have one element for each dimension of the data tensor"),
    ([node("Subsample", ["x"], ["y"], domain="ai.graphcore", strides=[1, 0])], {"x": X23}, (),
     "Strides invalid. 0 stride at index 1"),   # subsample.cpp
    ([node("ShapedDropout", ["x"], ["y"], domain="ai.graphcore", shape=[2, 2], ratio=0.5)],
     {"x": X23}, (),   # op/shapeddropout.cpp:40
     "ShapedDropout: incompatible input tensor and dropout shape. ai.graphcore.ShapedDropout:1 "
     "is configured with shape [2 2] which is not broadcastable to the input tensor with shape "
     "[2 3]."),
    ([node("ShapedDropout", ["x"], ["y"], domain="ai.graphcore", shape=[1, 3], ratio=1.0)],
     {"x": X23}, (),   # dropoutbase.cpp validateRatioAttribute
     "ai.graphcore.ShapedDropout:1 ratio value 1 is not valid. Please use a value in the "
     "interval [0,1)"),
    ([node("Add", ["x", "i"], ["y"], name="add")], {"x": X23, "i": np.ones(3, np.int32)}, (),
     "np broadcasting failed on Op 0 (ai.onnx.Add:7), incompatible types FLOAT and INT32 "
     "(shapes [2 3] and [3])"),   # tensorinfo.cpp:256
])
def test_popart_messages(nodes, feeds, consts, text):
    raises_text(text, nodes, feeds, ["y"], consts=consts)


def test_shape_ops_still_compute():
    """The checked ops' valid forms against onnx.reference."""
    cases = [
        ([node("Transpose", ["x"], ["y"], perm=[1, 0])], [], {}),
        ([node("Reshape", ["x", "s"], ["y"])], [("s", np.array([3, -1]))], {}),
        ([node("Expand", ["x", "s"], ["y"])], [("s", np.array([2, 2, 3]))], {}),
        ([node("Slice", ["x", "b", "e", "a"], ["y"])],
         [("b", np.array([1])), ("e", np.array([3])), ("a", np.array([-1]))], {}),
    ]
    for nodes, consts, _ in cases:
        m = model(nodes, {"x": X23}, ["y"], consts=consts)
        (got,) = infer(m, {"x": X23}, ["y"])
        np.testing.assert_array_equal(got, ReferenceEvaluator(m).run(None, {"x": X23})[0])
    (y,) = run([node("Subsample", ["x"], ["y"], domain="ai.graphcore", strides=[2, 2])],
               {"x": X23}, ["y"])
    np.testing.assert_array_equal(y, X23[::2, ::2])


# ---------------------------------------------------------------- reductions
def _empty_axes(op):
    n = node(op, ["x"], ["y"], keepdims=1)
    n.attribute.append(helper.make_attribute("axes", [], attr_type=onnx.AttributeProto.INTS))
    return n


def test_reduce_empty_axes_attribute_reduces_nothing():   # op/reduce.cpp:41-51
    (y,) = run([_empty_axes("ReduceSum")], {"x": X23}, ["y"])
    np.testing.assert_array_equal(y, X23)
    (y,) = run([node("ReduceSum", ["x"], ["y"], keepdims=1)], {"x": X23}, ["y"])   # absent: all
    np.testing.assert_array_equal(y, X23.sum(keepdims=True))
    raises_text("Axis -2 is out of acceptable range [-1, 0]",   # util.cpp:359
                [node("ReduceMean", ["x"], ["y"], axes=[-2])], {"x": X23[0]}, ["y"])
    raises_text("Axis 2 is out of acceptable range [-2, 1]",
                [node("ReduceMedian", ["x"], ["y", "i"], domain="ai.graphcore", axes=[2])],
                {"x": X23.astype(np.int32)}, ["y"])


def _median_rule(x, axis):
    """ReduceMedian: the lower median and its index along ``axis`` (stable order)."""
    order = np.argsort(x, axis, kind="stable")
    i = np.take(order, (x.shape[axis] - 1) // 2, axis)
    return np.take_along_axis(x, np.expand_dims(i, axis), axis).squeeze(axis), i


def test_reduce_median_int32_trains():
    """ReduceMedian of an INT32 tensor in a training model (reducemedian.cpp:39, 75): the
    median's gradient flows back through the float path that uses it."""
    xi = np.array([[3, 1, 2, 7], [5, 4, 6, 0]], np.int32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("INT32", [2, 4]), "x")
    w = b.addInitializedInputTensor(np.array([1.5, -2.0], F32), "w")
    med, idx = b.aiGraphcore.reducemedian([x], axes=[1], keepdims=0)
    y = b.aiOnnx.mul([b.aiOnnx.cast([med], "FLOAT"), w])
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [med, idx, GRAD + w]),
                               loss, popart.ConstSGD(1e-9), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: xi}, a))
    m, i = _median_rule(xi, 1)
    np.testing.assert_array_equal(a[med], m)
    np.testing.assert_array_equal(a[idx], i)
    np.testing.assert_allclose(a[GRAD + w], m * np.sign(m * np.array([1.5, -2.0])))


# ---------------------------------------------------------------- types PopART takes
def test_types_popart_accepts():
    """PopART checks no ONNX schema type at op construction: Equal-7 of FLOAT (equal.cpp:31),
    TopK's k INT32 (topk.cpp getInputScalarValue), Sqrt of INT32, Scatter indices UINT32,
    Resize sizes INT32."""
    (y,) = run([node("Equal", ["x", "z"], ["y"])], {"x": X23, "z": X23 % 2}, ["y"], opset=9)
    np.testing.assert_array_equal(y, X23 == X23 % 2)
    v, i = run([node("TopK", ["x", "k"], ["v", "i"])], {"x": X23}, ["v", "i"],
               consts=[("k", np.array([2], np.int32))])
    np.testing.assert_array_equal(v, X23[:, ::-1][:, :2])
    xi = np.array([[3, 9, 1], [4, 0, 8]], np.int32)   # TopK-10 of INT32 (topk.cpp:190)
    v, i = run([node("TopK", ["x", "k"], ["v", "i"])], {"x": xi}, ["v", "i"], opset=10,
               consts=[("k", np.array([2]))])
    np.testing.assert_array_equal(v, -np.sort(-xi, 1)[:, :2])
    xi = np.array([0, 1, 4, 8, 17], np.int32)
    (y,) = run([node("Sqrt", ["x"], ["y"])], {"x": xi}, ["y"])
    np.testing.assert_array_equal(y, np.floor(np.sqrt(xi)).astype(np.int32))
    (y,) = run([node("ScatterElements", ["x", "i", "u"], ["y"], axis=1)], {"x": X23}, ["y"],
               consts=[("i", np.array([[2], [0]], np.uint32)), ("u", np.full((2, 1), 9, F32))])
    np.testing.assert_array_equal(y, [[0, 1, 9], [9, 4, 5]])
    x4 = np.arange(4, dtype=F32).reshape(1, 1, 2, 2)
    (y,) = run([node("Resize", ["x", "", "", "s"], ["y"])], {"x": x4}, ["y"], opset=13,
               consts=[("s", np.array([1, 1, 4, 4], np.int32))])
    np.testing.assert_array_equal(y, x4.repeat(2, 2).repeat(2, 3))


# ---------------------------------------------------------------- subgraphs
def _graph(name, nodes, ins, outs):
    info = helper.make_tensor_value_info
    return helper.make_graph(nodes, name, [info(*i) for i in ins], [info(*o) for o in outs])


def test_scan_rank1_input_slices_to_shape_1():
    """PopART's ScanOp slices a rank-1 scan input to [1] (scan.cpp:304-313) and concatenates
    the scan outputs (scan.cpp:97-105): Shape of each slice is [1], four blocks give [4]. ONNX
    (onnx.reference) slices scalars: the stacked shapes are [4, 0]."""
    i64 = TensorProto.INT64
    body = _graph("body", [node("Add", ["s", "xi"], ["s2"]), node("Shape", ["xi"], ["sh"])],
                  [("s", TensorProto.FLOAT, [1]), ("xi", TensorProto.FLOAT, None)],
                  [("s2", TensorProto.FLOAT, [1]), ("sh", i64, None)])
    xs = np.array([1, 2, 3, 4], F32)
    nodes = [node("Scan", ["s0", "x"], ["s", "shapes"], body=body, num_scan_inputs=1)]
    m = model(nodes, {"s0": np.zeros(1, F32), "x": xs}, ["s", "shapes"])
    s, shapes = infer(m, {"s0": np.zeros(1, F32), "x": xs}, ["s", "shapes"])
    np.testing.assert_array_equal(s, [10])
    np.testing.assert_array_equal(shapes, [1, 1, 1, 1])
    ref = ReferenceEvaluator(m).run(None, {"s0": np.zeros(1, F32), "x": xs})
    assert ref[1].shape == (4, 0)   # ONNX's rule, which the session does not follow


def test_loop_body_takes_the_callers_infos():
    """A Loop body input declared [1] runs on the [2, 3] the Loop carries (loop.cpp:384-398:
    the callee's inputs take the op's input infos)."""
    f = TensorProto.FLOAT
    body = _graph("body", [node("Identity", ["c"], ["c2"]), node("Add", ["v", "v"], ["v2"])],
                  [("i", TensorProto.INT64, []), ("c", TensorProto.BOOL, []), ("v", f, [1])],
                  [("c2", TensorProto.BOOL, []), ("v2", f, [1])])
    (y,) = run([node("Loop", ["m", "", "x"], ["y"], body=body)], {"x": X23}, ["y"],
               consts=[("m", np.array(3))])
    np.testing.assert_array_equal(y, X23 * 8)


# ---------------------------------------------------------------- DynamicSlice
def test_dynamic_slice_third_input_and_gradient():
    """DynamicSliceOp's optional third input (the tensor the slice is written into): the
    output is the slice, the third input gets no gradient; x's gradient is the slice's
    gradient at the offset, zero elsewhere (DynamicSlicePadGradOp), with noOverlap too."""
    xv = np.arange(12, dtype=F32).reshape(4, 3)
    g = np.array([[1, 2, 3], [4, 5, 6]], F32)
    for no_overlap in (0, 1):
        b = popart.Builder()
        x = b.addInitializedInputTensor(xv, "x")
        into = b.addInitializedInputTensor(np.full((2, 3), 7, F32), "into")
        off = b.aiOnnx.constant(np.array([1], np.uint32))
        sl = b.aiGraphcore.dynamicslice([x, off, into], axes=[0], sizes=[2], noOverlap=no_overlap)
        loss = b.aiGraphcore.identityloss([b.aiOnnx.reducesum(
            [b.aiOnnx.mul([sl, b.aiOnnx.constant(g)])], keepdims=0)])
        s = popart.TrainingSession(b.getModelProto(),
                                   popart.DataFlow(1, [sl, GRAD + x, GRAD + into]), loss,
                                   popart.ConstSGD(1e-9), CPU())
        s.prepareDevice()
        s.weightsFromHost()
        a = s.initAnchorArrays()
        s.run(popart.PyStepIO({}, a))
        np.testing.assert_array_equal(a[sl], xv[1:3])
        want = np.zeros_like(xv)
        want[1:3] = g
        np.testing.assert_array_equal(a[GRAD + x], want)
        np.testing.assert_array_equal(a[GRAD + into], np.zeros((2, 3), F32))


# ---------------------------------------------------------------- LSTM / RNN
def test_onnx_and_graphcore_lstm_agree_bit_for_bit():
    """aiOnnx.lstm and aiGraphcore.lstm on the same weights (PopART's [4, I + H, H] in
    poplibs' gate order f, i, c, o; ONNX's W [1, 4H, I], R [1, 4H, H] in i, o, f, c; one bias
    Wb + Rb): outputs and final cell states are equal bit for bit."""
    T, B, I, H = 5, 2, 3, 4
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, B, I), dtype=F32)
    wi, wh = rng.standard_normal((4, I, H), dtype=F32), rng.standard_normal((4, H, H), dtype=F32)
    bias = rng.standard_normal((4, H), dtype=F32)
    h0, c0 = rng.standard_normal((2, B, H), dtype=F32)
    order = [1, 3, 0, 2]   # i, o, f, c out of f, i, c, o
    W = np.concatenate([wi[k].T for k in order])[None]
    R = np.concatenate([wh[k].T for k in order])[None]
    Bv = np.concatenate([bias[k] for k in order] + [np.zeros(4 * H, F32)])[None]
    b = popart.Builder()
    xi = b.addInputTensor(popart.TensorInfo("FLOAT", [T, B, I]), "x")
    y1, h1, c1 = b.aiOnnx.lstm([xi, b.aiOnnx.constant(W), b.aiOnnx.constant(R),
                                b.aiOnnx.constant(Bv), "", b.aiOnnx.constant(h0[None]),
                                b.aiOnnx.constant(c0[None])], 3)
    y2, c2 = b.aiGraphcore.lstm([xi, b.aiOnnx.constant(np.concatenate([wi, wh], 1)),
                                 b.aiOnnx.constant(bias), b.aiOnnx.constant(np.stack([h0, c0]))])
    outs = [y1, c1, y2, c2]
    got = infer(b.getModelProto(), {xi: x}, outs)
    np.testing.assert_array_equal(got[0][:, 0], got[2])
    np.testing.assert_array_equal(got[1][0], got[3])
    # and ai.onnx's against onnx.reference (ONNX's own rule)
    m = model([node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"],
                    hidden_size=H)], {"x": x}, ["y", "yh", "yc"],
              inits=[("W", W), ("R", R), ("B", Bv), ("h0", h0[None]), ("c0", c0[None])])
    ref = ReferenceEvaluator(m).run(None, {"x": x})
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)


def test_rnn_activation_messages():   # op/rnn.cpp:170, 175
    op = "Op(r[ai.onnx.RNN:7], inputs=[x, w, rr], outputs=[y])"
    consts = [("w", np.ones((1, 2, 3), F32)), ("rr", np.ones((1, 2, 2), F32))]
    for acts, text in ((["Cube"], f"Activation type 'Cube' is not supported for {op}"),
                       (["Tanh", "Relu", "Relu"], f"{op} only supports 1 activation, 3 were "
                                                  f"specified")):
        raises_text(text, [node("RNN", ["x", "w", "rr"], ["y"], hidden_size=2, activations=acts,
                                name="r")], {"x": np.ones((2, 1, 3), F32)}, ["y"], consts=consts)


# ---------------------------------------------------------------- BatchNormalization
BN_X = np.random.default_rng(3).standard_normal((4, 2, 3, 3), dtype=F32)
BN_P = [np.array([1.5, 0.5], F32), np.array([0.1, -0.2], F32), np.array([0.3, -0.1], F32),
        np.array([2.0, 0.5], F32)]   # scale, bias, running mean, running var


def _bn_rule(x, scale, bias, mean, var, eps=1e-5):
    sh = (1, -1, 1, 1)
    xhat = (x - mean.reshape(sh)) / np.sqrt(var.reshape(sh) + eps)
    return xhat * scale.reshape(sh) + bias.reshape(sh)


def test_batchnorm_mode_follows_its_outputs():
    """BatchNormOp::setup (batchnorm.cpp:50-66): more than one output is training mode (batch
    statistics) in an InferenceSession too; one output is inference mode (running statistics)
    in a TrainingSession too."""
    b = popart.Builder(opsets={"ai.onnx": 9, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(BN_X.shape)), "x")
    ins = [x] + [b.addInitializedInputTensor(v) for v in BN_P]
    y, m, v, _sm, _sv = b.aiOnnx.batchnormalization(ins, 5, momentum=0.75)
    (y1,) = b.aiOnnx.batchnormalization(ins, 1)
    y_got, m_got, v_got, y1_got = infer(b.getModelProto(), {x: BN_X}, [y, m, v, y1])
    bm, bv = BN_X.mean((0, 2, 3)), BN_X.var((0, 2, 3))
    np.testing.assert_allclose(y_got, _bn_rule(BN_X, BN_P[0], BN_P[1], bm, bv), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(m_got, 0.75 * BN_P[2] + 0.25 * bm, rtol=1e-6)
    np.testing.assert_allclose(v_got, 0.75 * BN_P[3] + 0.25 * bv, rtol=1e-5)
    np.testing.assert_allclose(y1_got, _bn_rule(BN_X, *BN_P), rtol=1e-5, atol=1e-6)


def test_one_output_batchnorm_in_training_uses_running_statistics():
    b = popart.Builder(opsets={"ai.onnx": 9, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(BN_X.shape)), "x")
    scale = b.addInitializedInputTensor(BN_P[0], "scale")
    ins = [x, scale] + [b.addInitializedInputTensor(v) for v in BN_P[1:]]
    (y,) = b.aiOnnx.batchnormalization(ins, 1)
    loss = b.aiGraphcore.identityloss([b.aiOnnx.reducesum([y], keepdims=0)])
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [y, GRAD + scale]), loss,
                               popart.ConstSGD(1e-9), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: BN_X}, a))
    np.testing.assert_allclose(a[y], _bn_rule(BN_X, *BN_P), rtol=1e-5, atol=1e-6)
    xhat = _bn_rule(BN_X, np.ones(2, F32), np.zeros(2, F32), BN_P[2], BN_P[3])
    np.testing.assert_allclose(a[GRAD + scale], xhat.sum((0, 2, 3)), rtol=1e-5)


# ---------------------------------------------------------------- patterns and anchors
def test_anchored_probability_gradient_survives_softmax_nll_fusion():
    """A pattern never fuses away an anchored tensor (ir.cpp's touchesAnchored; the
    SoftmaxGradDirect fuser touches NllGrad's output, fuser.cpp:87): with Gradient___<probs>
    anchored, NllGrad (-onehot / p / N) and SoftmaxGrad run unfused."""
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((3, 4)).astype(F32)
    lab = np.array([0, 2, 3], np.int32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3, 4]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 4), F32), "w")
    lbl = b.addInputTensor(popart.TensorInfo("INT32", [3]), "l")
    logits = b.aiOnnx.mul([x, w])
    p = b.aiOnnx.softmax([logits], axis=1)
    loss = b.aiGraphcore.nllloss([p, lbl], reduction=popart.ReductionType.Mean)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [GRAD + p, GRAD + logits]),
                               loss, popart.ConstSGD(1e-9), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: xv, lbl: lab}, a))
    e = np.exp(xv - xv.max(1, keepdims=True))
    probs, onehot = e / e.sum(1, keepdims=True), np.eye(4, dtype=F32)[lab]
    np.testing.assert_allclose(a[GRAD + p], -onehot / probs / 3, rtol=1e-5)
    np.testing.assert_allclose(a[GRAD + logits], (probs - onehot) / 3, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- Resize
def test_resize_pytorch_half_pixel_tests_the_unfloored_length():
    """popx/op/resizex.cpp:93-99: pytorch_half_pixel takes (i + 0.5) / scale - 0.5 while
    inputSize * scale > 1, unfloored: 3 * 0.5 = 1.5 gives one output at coordinate 0.5
    (linear: the mean of x0 and x1); ONNX Runtime tests the output length, 1, and takes
    coordinate 0."""
    ort = pytest.importorskip("onnxruntime")
    x = np.array([10, 20, 30], F32).reshape(1, 1, 1, 3)
    nodes = [node("Resize", ["x", "", "sc"], ["y"], mode="linear",
                  coordinate_transformation_mode="pytorch_half_pixel")]
    m = model(nodes, {"x": x}, ["y"], opset=13, consts=[("sc", np.array([1, 1, 1, 0.5], F32))])
    (y,) = infer(m, {"x": x}, ["y"])
    np.testing.assert_array_equal(y.reshape(-1), [15])
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": x})[0].reshape(-1).tolist() == [10]


def test_resize10_reads_nearest_mode():
    """resize.cpp:300-311: Resize-10 reads nearest_mode (default "pytorch": floor(i / scale));
    with "floor" and half_pixel coordinates floor((i + 0.5) / 1.5 - 0.5), clamped."""
    x = np.arange(4, dtype=F32).reshape(1, 1, 1, 4)
    sc = [("sc", np.array([1, 1, 1, 1.5], F32))]
    (y,) = run([node("Resize", ["x", "sc"], ["y"], mode="nearest", nearest_mode="floor")],
               {"x": x}, ["y"], opset=10, consts=sc)
    i = np.clip(np.floor((np.arange(6) + 0.5) / 1.5 - 0.5), 0, 3).astype(int)
    np.testing.assert_array_equal(y.reshape(-1), x.reshape(-1)[i])
    (y,) = run([node("Resize", ["x", "sc"], ["y"], mode="nearest")], {"x": x}, ["y"], opset=10,
               consts=sc)
    i = np.floor(np.arange(6, dtype=F32) / F32(1.5)).astype(int)
    np.testing.assert_array_equal(y.reshape(-1), x.reshape(-1)[i])


def test_resize_sizes_and_scales_both_given():   # resize.cpp:213
    x = np.arange(4, dtype=F32).reshape(1, 1, 2, 2)
    with pytest.raises(popart_exception) as e:
        run([node("Resize", ["x", "r", "sc", "sz"], ["y"])], {"x": x}, ["y"],
            consts=[("r", np.zeros(0, F32)), ("sc", np.array([1, 1, 2, 2], F32)),
                    ("sz", np.array([1, 1, 4, 4]))])
    assert e.value.args[0].startswith("Resize op has inputs for `sizes` and `scales`. Only one "
                                      "of these tensors should be present.")
    empty = [("r", np.zeros(0, F32)), ("sc", np.zeros(0, F32)), ("sz", np.zeros(0, np.int64))]
    raises_text("Resize op has  inputs for `sizes` and `scales`,but none of them have data.",
                [node("Resize", ["x", "r", "sc", "sz"], ["y"])], {"x": x}, ["y"], consts=empty)


# ---------------------------------------------------------------- ArgMax's INT32
def test_argmax_int32_only_where_no_op_reads_it():
    """PopART's ArgExtremaOp gives INT32; the graph torch's exporter writes for CLIP's text
    model (ArgMax -> Unsqueeze -> Concat with an INT64 Range -> GatherND), valid ONNX, runs:
    an ArgMax that ops read is ONNX's INT64, one only anchored is PopART's INT32."""
    rng = np.random.default_rng(1)
    ids, hidden = rng.integers(0, 50, (3, 5)), rng.standard_normal((3, 5, 4), dtype=F32)
    nodes = [node("ArgMax", ["ids"], ["am"], axis=-1, keepdims=0),
             node("ArgMax", ["ids"], ["am_out"], axis=-1, keepdims=0),
             node("Range", ["zero", "three", "one"], ["rows"]),
             node("Unsqueeze", ["rows", "ax1"], ["rows1"]),
             node("Unsqueeze", ["am", "ax1"], ["am1"]),
             node("Concat", ["rows1", "am1"], ["idx"], axis=1),
             node("GatherND", ["h", "idx"], ["y"])]
    consts = [("zero", np.array(0)), ("three", np.array(3)), ("one", np.array(1)),
              ("ax1", np.array([1]))]
    feeds = {"ids": ids, "h": hidden}
    m = model(nodes, feeds, ["y", "am_out"], opset=13, consts=consts)
    y, am_out = infer(m, feeds, ["y", "am_out"])
    np.testing.assert_array_equal(y, hidden[np.arange(3), ids.argmax(-1)])
    assert am_out.dtype == np.int32
    np.testing.assert_array_equal(am_out, ids.argmax(-1))


# ---------------------------------------------------------------- GroupNormalization
def _group_norm_rule(x, scale, bias, groups, eps, strided):
    """Group normalization; strided (poplibs' groupNormStridedChannelGrouping): group g holds
    channels g, g + G, g + 2G, ..., else the block [g * C/G, (g + 1) * C/G)."""
    n, c = x.shape[:2]
    group_of = np.arange(c) % groups if strided else np.arange(c) // (c // groups)
    y = np.empty_like(x)
    for g in range(groups):
        sel = group_of == g
        v = x[:, sel]
        m = v.mean(axis=tuple(range(1, v.ndim)), keepdims=True)
        var = v.var(axis=tuple(range(1, v.ndim)), keepdims=True)
        y[:, sel] = (v - m) / np.sqrt(var + eps)
    sh = (1, c) + (1,) * (x.ndim - 2)
    return y * scale.reshape(sh) + bias.reshape(sh)


@pytest.mark.parametrize("strided", [False, True])
def test_group_norm_strided_channel_grouping(strided):
    x = np.random.default_rng(5).standard_normal((2, 6, 3), dtype=F32)
    x *= np.arange(1, 7, dtype=F32)[:, None]
    scale, bias = np.linspace(0.5, 1.5, 6, dtype=F32), np.linspace(-1, 1, 6, dtype=F32)
    b = popart.Builder()
    xi = b.addInputTensor(popart.TensorInfo("FLOAT", list(x.shape)), "x")
    y = b.aiGraphcore.groupnormalization([xi, b.aiOnnx.constant(scale), b.aiOnnx.constant(bias)],
                                         2, 1e-5)[0]
    opts = popart.SessionOptions()
    opts.groupNormStridedChannelGrouping = strided
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU(), userOptions=opts)
    s.prepareDevice()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({xi: x}, a))
    np.testing.assert_allclose(a[y], _group_norm_rule(x, scale, bias, 2, 1e-5, strided),
                               rtol=1e-5, atol=1e-5)


def test_shape_inputs_known_only_at_run_time():   # op/slice.cpp:384, reshape.cpp, expand.cpp
    fed = {"x": X23, "s": np.array([0])}
    raises_text("Need the value of the ai.onnx.Slice:11 input 'starts' to determine the output "
                "shape, but was unable because [Tensor::getDataViaGraphTraversal] Could not work "
                "out tensor data for s.",
                [node("Slice", ["x", "s", "e"], ["y"])], fed, ["y"], consts=[("e", np.array([1]))])
    raises_text("Need the value of the ai.onnx.Reshape:5 input 'shape' to determine the output "
                "shape, but was unable because [Tensor::getDataViaGraphTraversal] Could not work "
                "out tensor data for s.",
                [node("Reshape", ["x", "s"], ["y"])], {"x": X23, "s": np.array([3, 2])}, ["y"])
