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
