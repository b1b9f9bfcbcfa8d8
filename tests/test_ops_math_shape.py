"""Elementwise / math / reduce / shape ops on hand-written one-node ONNX graphs, checked against
onnx.reference (or NumPy / onnxruntime), across opset versions; plus finite-difference gradient
checks of the differentiable ones on PopART's supported-op list."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

import jax
import jax.numpy as jnp

from popart.engine.lower import TraceState, execute
from popart.engine.shapes import run_model
from popart.errors import popart_exception
from popart.ir.onnx_import import import_model

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

rng = np.random.default_rng(0)
F32, I64 = np.float32, np.int64


def model(op, inputs, attrs=None, opset=13, consts=None, n_out=1, domain=""):
    """A one-node model: ``inputs`` (name -> array) are graph inputs, ``consts`` initializers
    (for inputs that must be compile-time constants); "" in ``inputs`` order = omitted."""
    consts = consts or {}
    names = list(inputs)
    node = helper.make_node(op, names, [f"y{i}" for i in range(n_out)], domain=domain, **(attrs or {}))
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items() if k and k not in consts]
    outs = [helper.make_tensor_value_info(f"y{i}", 0, None) for i in range(n_out)]
    g = helper.make_graph([node], "g", ins, outs,
                          initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def ours(m, inputs, consts=None):
    consts = consts or {}
    feeds = {k: v for k, v in inputs.items() if k and k not in consts}
    res = run_model(m, feeds)
    return [res[o.name] for o in m.graph.output]


def reference(m, inputs, consts=None):
    feeds = {k: v for k, v in inputs.items() if k and k not in (consts or {})}
    return onnx.reference.ReferenceEvaluator(m).run(None, feeds)


def check(op, inputs, attrs=None, opset=13, consts=(), n_out=1, expected=None, rtol=1e-5,
          atol=1e-6):
    consts = {k: inputs[k] for k in consts}
    m = model(op, inputs, attrs, opset, consts, n_out)
    got = ours(m, inputs, consts)
    want = expected if expected is not None else reference(m, inputs, consts)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.dtype == w.dtype, f"{op}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{op}: shape {g.shape} != {w.shape}"
        if g.dtype.kind == "f" or g.dtype == ml_dtypes.bfloat16:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                       atol=atol, equal_nan=True)
        else:
            np.testing.assert_array_equal(g, w)
    return got


def r(*shape, lo=-2.0, hi=2.0, dtype=F32):
    return rng.uniform(lo, hi, shape).astype(dtype)


# ---------------------------------------------------------------------------------------
# Elementwise

UNARY = {  # op: input range
    "Abs": (-2, 2), "Neg": (-2, 2), "Exp": (-2, 2), "Log": (0.1, 3), "Sqrt": (0.1, 3),
    "Reciprocal": (0.5, 3), "Floor": (-3, 3), "Ceil": (-3, 3), "Sign": (-2, 2),
    "Sin": (-3, 3), "Cos": (-3, 3), "Tan": (-1, 1), "Asin": (-0.9, 0.9), "Acos": (-0.9, 0.9),
    "Atan": (-3, 3), "Sinh": (-2, 2), "Cosh": (-2, 2), "Asinh": (-2, 2), "Acosh": (1.1, 3),
    "Atanh": (-0.9, 0.9), "Erf": (-2, 2), "Relu": (-2, 2), "Sigmoid": (-3, 3), "Tanh": (-3, 3),
    "Softplus": (-3, 3), "Softsign": (-3, 3), "HardSwish": (-4, 4), "Mish": (-3, 3),
    "Elu": (-2, 2), "Selu": (-2, 2), "Celu": (-2, 2), "HardSigmoid": (-4, 4),
    "LeakyRelu": (-2, 2), "ThresholdedRelu": (-2, 2), "Shrink": (-2, 2), "IsNaN": (-1, 1),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@pytest.mark.parametrize("dtype", [F32, np.float64])
def test_unary(op, dtype):
    lo, hi = UNARY[op]
    opset = {"HardSwish": 14, "Mish": 18, "Celu": 12}.get(op, 13)
    check(op, {"x": r(3, 4, lo=lo, hi=hi, dtype=dtype)}, opset=opset)


@pytest.mark.parametrize("op,attrs", [
    ("LeakyRelu", {"alpha": 0.3}), ("Elu", {"alpha": 0.5}), ("Selu", {"alpha": 2.0, "gamma": 3.0}),
    ("Celu", {"alpha": 2.0}), ("HardSigmoid", {"alpha": 0.5, "beta": 0.25}),
    ("ThresholdedRelu", {"alpha": 0.5}), ("Shrink", {"lambd": 1.0, "bias": 0.5}),
])
def test_activation_attributes(op, attrs):
    check(op, {"x": r(5, 6, lo=-3, hi=3)}, attrs, opset=13)


def test_round_half_to_even_and_isinf():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.4, np.inf, -np.inf, np.nan], F32)
    (y,) = check("Round", {"x": x}, opset=11)
    np.testing.assert_array_equal(y[:6], [-2, -2, -0, 0, 2, 2])
    check("IsInf", {"x": x}, {"detect_negative": 0}, opset=10)
    (y,) = check("IsInf", {"x": x}, {"detect_positive": 0}, opset=10)
    assert y.tolist() == [False] * 8 + [True, False]


def test_gelu_opset20():
    x = r(4, 5, lo=-3, hi=3)
    check("Gelu", {"x": x}, opset=20)
    check("Gelu", {"x": x}, {"approximate": "tanh"}, opset=20)
    with pytest.raises(popart_exception, match="approximate"):
        ours(model("Gelu", {"x": x}, {"approximate": "erf"}, 20), {"x": x})


def test_not_bitwise_not():
    check("Not", {"x": np.array([True, False])}, opset=1 + 6)
    check("BitwiseNot", {"x": np.array([0, 5, -3], np.int32)}, opset=18)


BINARY = ["Add", "Sub", "Mul", "Div", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("dtype", [F32, np.int32, I64])
def test_binary_broadcast(op, dtype):
    a = r(2, 3, 4, lo=-9, hi=9).astype(dtype)
    b = r(3, 1, lo=1, hi=5).astype(dtype)
    check(op, {"a": a, "b": b}, opset=14 if op in BINARY[:4] else 16)


def test_integer_div_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 1], np.int32)
    b = np.array([2, 2, -2, -2, 3], np.int32)
    (y,) = check("Div", {"a": a, "b": b})
    assert y.tolist() == [3, -3, -3, 3, 0]


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int32, I64, F32])
def test_mod(fmod, dtype):
    a = np.array([5, -5, 5, -5, 7, -3], dtype)
    b = np.array([3, 3, -3, -3, 2, 4], dtype)
    if dtype == F32 and not fmod:
        (y,) = ours(model("Mod", {"a": a, "b": b}, {"fmod": 0}), {"a": a, "b": b})
        np.testing.assert_array_equal(y, np.mod(a, b))
        return
    (y,) = check("Mod", {"a": a, "b": b}, {"fmod": fmod})
    assert (np.sign(y[y != 0]) == np.sign((a if fmod else b)[y != 0])).all()


@pytest.mark.parametrize("base,exp", [(F32, F32), (F32, I64), (I64, F32), (np.int32, np.int32),
                                      (np.float64, np.int32)])
def test_pow_mixed_dtypes(base, exp):
    a = np.array([1, 2, 3, 4], base)
    b = np.array([2, 3, 1, 0], exp)
    (y,) = check("Pow", {"a": a, "b": b}, opset=15)
    assert y.dtype == base


def test_bitshift_and_bitwise():
    a = np.array([16, 4, 1], np.uint32)
    b = np.array([1, 2, 3], np.uint32)
    for d in ("LEFT", "RIGHT"):
        check("BitShift", {"a": a, "b": b}, {"direction": d}, opset=11)
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        check(op, {"a": np.array([12, -3], np.int32), "b": np.array([10, 6], np.int32)}, opset=18)
    for op in ("And", "Or", "Xor"):
        check(op, {"a": np.array([[True, False]]), "b": np.array([[True], [False]])}, opset=7)


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_broadcast(op):
    check(op, {"a": r(2, 3), "b": r(3), "c": r(1, 3)}, opset=13)
    check(op, {"a": r(4)}, opset=13)


def test_where_and_prelu():
    check("Where", {"c": np.array([[True, False, True]]), "x": r(2, 3), "y": r(2, 1)}, opset=16)
    check("PRelu", {"x": r(2, 3, 4), "s": r(3, 1)}, opset=16)
    check("PRelu", {"x": r(2, 3, 4), "s": r(4)}, opset=16)


def test_add6_legacy_broadcast_axis():
    """Add-6 broadcast=1 axis=1: B [3, 4] aligns with A's dims 1 and 2."""
    a, b = r(2, 3, 4, 5), r(3, 4)
    (y,) = ours(model("Add", {"a": a, "b": b}, {"broadcast": 1, "axis": 1}, opset=6), {"a": a, "b": b})
    np.testing.assert_allclose(y, a + b[None, :, :, None])
    (y,) = ours(model("Mul", {"a": a, "b": r(5)}, {"broadcast": 1}, opset=6), {"a": a, "b": b[0, :1].repeat(5)})
    np.testing.assert_allclose(y, a * b[0, 0])
    (y,) = ours(model("Sub", {"a": a, "b": r(2)}, {"broadcast": 1, "axis": 0}, opset=6),
                {"a": a, "b": np.array([1, 2], F32)})
    np.testing.assert_allclose(y, a - np.array([1, 2], F32)[:, None, None, None])


def test_clip_versions():
    x = r(3, 4, lo=-3, hi=3)
    (y,) = ours(model("Clip", {"x": x}, {"min": -1.0, "max": 0.5}, opset=6), {"x": x})
    np.testing.assert_array_equal(y, np.clip(x, -1, 0.5))
    assert y.dtype == F32
    lo, hi = np.array(-1, F32), np.array(0.5, F32)
    check("Clip", {"x": x, "lo": lo, "hi": hi}, opset=13)
    check("Clip", {"x": x, "lo": lo}, opset=13)                     # no max
    (y,) = check("Clip", {"x": x, "": None, "hi": hi}, opset=13)   # omitted min
    np.testing.assert_array_equal(y, np.minimum(x, hi))
    (y,) = check("Clip", {"x": x, "lo": np.array(1, F32), "hi": np.array(0, F32)}, opset=13)
    assert (y == 0).all()                                       # min > max -> max
    check("Clip", {"x": np.array([-5, 0, 9], np.int32), "lo": np.array(-2, np.int32),
                   "hi": np.array(3, np.int32)}, opset=13)


def test_float32_stays_float32():
    x = r(3, dtype=F32)
    for op, attrs in [("LeakyRelu", {"alpha": 0.1}), ("Elu", {}), ("HardSigmoid", {}), ("Selu", {})]:
        (y,) = ours(model(op, {"x": x}, attrs), {"x": x})
        assert y.dtype == F32, op


# ---------------------------------------------------------------------------------------
# Math

def test_matmul_gemm():
    check("MatMul", {"a": r(2, 3, 4), "b": r(4, 5)})
    check("MatMul", {"a": r(4), "b": r(3, 4, 2)})
    for ta in (0, 1):
        for tb in (0, 1):
            a, b = (r(4, 3) if ta else r(3, 4)), (r(5, 4) if tb else r(4, 5))
            check("Gemm", {"a": a, "b": b, "c": r(1, 5)},
                  {"transA": ta, "transB": tb, "alpha": 0.5, "beta": 2.0})
    check("Gemm", {"a": r(3, 4), "b": r(4, 5)}, opset=11)


def test_matmul_integer():
    a = rng.integers(0, 255, (3, 4)).astype(np.uint8)
    b = rng.integers(0, 255, (4, 2)).astype(np.uint8)
    check("MatMulInteger", {"a": a, "b": b, "az": np.array(12, np.uint8),
                            "bz": np.array([3, 200], np.uint8)}, opset=10)


def test_einsum():
    check("Einsum", {"a": r(2, 3, 4), "b": r(2, 4, 5)}, {"equation": "bij,bjk->bik"}, opset=12)
    check("Einsum", {"a": r(3, 3)}, {"equation": "ii"}, opset=12)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(exclusive, reverse):
    check("CumSum", {"x": r(3, 4), "axis": np.array(-1, np.int32)},
          {"exclusive": exclusive, "reverse": reverse}, opset=14, consts=["axis"])
    check("CumSum", {"x": np.arange(6, dtype=np.int32).reshape(2, 3), "axis": np.array(0, I64)},
          {"exclusive": exclusive, "reverse": reverse}, opset=14, consts=["axis"])


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_ties_and_versions(largest):
    x = np.array([[3, 1, 3, 2, 1, 3]], F32)
    k = np.array([3], I64)
    v, i = check("TopK", {"x": x, "k": k}, {"largest": largest}, opset=11, consts=["k"], n_out=2)
    assert i.dtype == I64
    assert i.tolist() == ([[0, 2, 5]] if largest else [[1, 4, 3]])       # ties: lower index first
    v1, i1 = ours(model("TopK", {"x": x}, {"k": 2, "axis": 1}, opset=9, n_out=2), {"x": x})
    assert i1.tolist() == [[0, 2]] and v1.tolist() == [[3, 3]]
    check("TopK", {"x": r(4, 5), "k": np.array([2], I64)}, {"axis": 0}, opset=10, consts=["k"], n_out=2)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_argmax(op, last, keepdims):
    x = np.array([[1, 3, 3, 0], [0, 0, 2, 2]], F32)
    (y,) = check(op, {"x": x}, {"axis": 1, "keepdims": keepdims, "select_last_index": last})
    assert y.dtype == I64


def test_det_trilu():
    check("Det", {"x": r(2, 3, 3)}, opset=11, rtol=1e-4)
    for upper in (0, 1):
        check("Trilu", {"x": r(2, 4, 5), "k": np.array(1, I64)}, {"upper": upper}, opset=14, consts=["k"])
        check("Trilu", {"x": r(4, 5)}, {"upper": upper}, opset=14)


def test_quantize_dequantize():
    x = r(2, 3, 4, lo=-10, hi=10)
    check("QuantizeLinear", {"x": x, "s": np.array(0.1, F32), "z": np.array(3, np.int8)}, opset=13)
    check("QuantizeLinear", {"x": x, "s": np.array(0.07, F32)}, opset=10)
    check("QuantizeLinear", {"x": x, "s": np.array([0.1, 0.2, 0.3], F32),
                             "z": np.array([0, 10, 250], np.uint8)}, {"axis": 1}, opset=13)
    q = rng.integers(-128, 127, (2, 3, 4)).astype(np.int8)
    s, z = np.array([0.1, 0.2, 0.3, 0.5], F32), np.array([1, 2, 3, -4], np.int8)
    (y,) = check("DequantizeLinear", {"q": q, "s": s, "z": z}, {"axis": -1}, opset=19)
    (y13,) = ours(model("DequantizeLinear", {"q": q, "s": s, "z": z}, {"axis": -1}, opset=13),
                  {"q": q, "s": s, "z": z})
    np.testing.assert_allclose(y13, (q.astype(F32) - z) * s, rtol=1e-6)
    (y10,) = ours(model("DequantizeLinear", {"q": q, "s": np.array(0.25, F32)}, opset=10),
                  {"q": q, "s": np.array(0.25, F32)})
    assert y10.dtype == F32 and np.array_equal(y10, q * np.float32(0.25))
    check("DynamicQuantizeLinear", {"x": x}, opset=11, n_out=3)


# ---------------------------------------------------------------------------------------
# Reductions

REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_attr_and_input_axes(op, keepdims):
    x = r(2, 3, 4, lo=0.5, hi=2)
    check(op, {"x": x}, {"axes": [0, -1], "keepdims": keepdims}, opset=11, rtol=1e-4)
    check(op, {"x": x}, {"keepdims": keepdims}, opset=11, rtol=1e-4)
    new = 13 if op == "ReduceSum" else 18
    check(op, {"x": x, "axes": np.array([1], I64)}, {"keepdims": keepdims}, opset=new,
          consts=["axes"], rtol=1e-4)
    (y,) = check(op, {"x": x, "axes": np.array([], I64)}, {"noop_with_empty_axes": 1},
                 opset=new, consts=["axes"], rtol=1e-4)


def test_reduce_integer_dtype_kept():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    for op, fn in [("ReduceSum", np.sum), ("ReduceProd", np.prod), ("ReduceMax", np.max),
                   ("ReduceSumSquare", lambda v, **k: np.sum(v * v, **k))]:
        (y,) = ours(model(op, {"x": x}, {"axes": [1]}, opset=11), {"x": x})
        assert y.dtype == np.int32
        np.testing.assert_array_equal(y, fn(x, axis=1, keepdims=True))


def test_reduce_noop_semantics():
    x = r(2, 3)
    (y,) = ours(model("ReduceSum", {"x": x, "axes": np.zeros(0, I64)}, {"noop_with_empty_axes": 1},
                      opset=13, consts={"axes": np.zeros(0, I64)}), {"x": x})
    np.testing.assert_array_equal(y, x)
    (y,) = ours(model("ReduceSum", {"x": x, "axes": np.zeros(0, I64)}, {}, opset=13,
                      consts={"axes": np.zeros(0, I64)}), {"x": x})
    np.testing.assert_allclose(y, x.sum(keepdims=True), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Shape ops

def test_reshape():
    x = r(2, 3, 4)
    check("Reshape", {"x": x, "s": np.array([0, -1], I64)}, opset=14, consts=["s"])
    check("Reshape", {"x": x, "s": np.array([4, 0, 2, -1], I64)}, opset=14, consts=["s"])
    z = np.zeros((0, 3), F32)
    (y,) = check("Reshape", {"x": z, "s": np.array([3, 0], I64)}, {"allowzero": 1}, opset=14,
                 consts=["s"])
    assert y.shape == (3, 0)
    with pytest.raises(popart_exception, match="Reshape"):
        ours(model("Reshape", {"x": x, "s": np.array([5, -1], I64)}, opset=14,
                   consts={"s": np.array([5, -1], I64)}), {"x": x})
    with pytest.raises(popart_exception, match="compile time"):
        ours(model("Reshape", {"x": x, "s": np.array([6, 4], I64)}, opset=14),
             {"x": x, "s": np.array([6, 4], I64)})


def test_transpose_concat_flatten():
    check("Transpose", {"x": r(2, 3, 4)}, {"perm": [2, 0, 1]})
    check("Transpose", {"x": r(2, 3, 4)})
    check("Concat", {"a": r(2, 3), "b": r(2, 1), "c": r(2, 2)}, {"axis": -1})
    for axis in (0, 1, 2, -1, -3):
        check("Flatten", {"x": r(2, 3, 4)}, {"axis": axis})


def test_split_versions():
    x = r(6, 4)
    check("Split", {"x": x}, {"axis": 0, "split": [2, 4]}, opset=11, n_out=2)
    check("Split", {"x": x}, {"axis": 1}, opset=11, n_out=2)
    check("Split", {"x": x, "s": np.array([1, 5], I64)}, opset=13, consts=["s"], n_out=2)
    outs = check("Split", {"x": x}, {"num_outputs": 4}, opset=18, n_out=4)
    assert [o.shape[0] for o in outs] == [2, 2, 2, 0]
    outs = check("Split", {"x": r(7)}, {"num_outputs": 3}, opset=18, n_out=3)
    assert [o.shape[0] for o in outs] == [3, 3, 1]


def test_slice_v1_attrs_vs_v10_inputs():
    x = r(5, 6, 7)
    (a,) = ours(model("Slice", {"x": x}, {"starts": [1, -3], "ends": [100, -1], "axes": [0, 2]},
                      opset=1 + 8), {"x": x})
    np.testing.assert_array_equal(a, x[1:, :, -3:-1])
    c = {"s": np.array([1, -3], I64), "e": np.array([100, -1], I64), "a": np.array([0, 2], I64)}
    (b,) = check("Slice", {"x": x, **c}, opset=10, consts=list(c))
    np.testing.assert_array_equal(a, b)
    c = {"s": np.array([-1, 5], I64), "e": np.array([-100, 0], I64), "a": np.array([1, 2], I64),
         "st": np.array([-2, -1], I64)}
    (y,) = check("Slice", {"x": x, **c}, opset=13, consts=list(c))
    np.testing.assert_array_equal(y, x[:, ::-2, 5:0:-1])


def test_gathers_and_scatters():
    x = r(4, 5, 3)
    check("Gather", {"x": x, "i": np.array([[0, -1], [2, 1]], I64)}, {"axis": 1})
    check("GatherElements", {"x": r(3, 4), "i": np.array([[0, -1], [2, 1], [3, 3]], I64)}, {"axis": 1})
    (y,) = ours(model("GatherElements", {"x": x[:, :, 0], "i": np.array([[0, -1]], I64)}, {"axis": 1}),
                {"x": x[:, :, 0], "i": np.array([[0, -1]], I64)})     # smaller index on axis 0
    np.testing.assert_array_equal(y, x[:1, [0, 4], 0])
    check("GatherND", {"x": x, "i": np.array([[1, 2], [3, -1]], I64)})
    check("GatherND", {"x": x, "i": np.array([[1], [2], [0], [4]], I64)}, {"batch_dims": 1})
    for red in ("none", "add", "mul", "max", "min"):
        check("ScatterElements", {"x": r(3, 4), "i": np.array([[1, 0], [2, 3]], I64),
                                  "u": r(2, 2)}, {"axis": 1, "reduction": red}, opset=18)
        check("ScatterND", {"x": r(4, 3), "i": np.array([[1], [3]], I64), "u": r(2, 3)},
              {"reduction": red}, opset=18)
    x3, u = r(3, 3), r(1, 3)
    (y,) = ours(model("Scatter", {"x": x3, "i": np.array([[1, 0, 2]], I64), "u": u}, opset=9),
                {"x": x3, "i": np.array([[1, 0, 2]], I64), "u": u})
    x3[[1, 0, 2], [0, 1, 2]] = u[0]
    np.testing.assert_array_equal(y, x3)


def test_squeeze_unsqueeze_versions():
    x = r(1, 3, 1, 2)
    (a,) = check("Squeeze", {"x": x}, {"axes": [0, -2]}, opset=11)
    (b,) = check("Squeeze", {"x": x, "a": np.array([0, -2], I64)}, opset=13, consts=["a"])
    np.testing.assert_array_equal(a, b)
    assert check("Squeeze", {"x": x}, opset=13)[0].shape == (3, 2)
    (u1,) = check("Unsqueeze", {"x": r(3, 2)}, {"axes": [0, -1]}, opset=11)
    (u2,) = check("Unsqueeze", {"x": r(3, 2), "a": np.array([0, -1], I64)}, opset=13, consts=["a"])
    assert u1.shape == u2.shape == (1, 3, 2, 1)
    with pytest.raises(popart_exception, match="squeeze"):
        ours(model("Squeeze", {"x": x}, {"axes": [1]}, opset=11), {"x": x})


def test_expand_tile():
    check("Expand", {"x": r(3, 1), "s": np.array([2, 1, 4], I64)}, opset=13, consts=["s"])
    check("Tile", {"x": r(2, 3), "rp": np.array([2, 3], I64)}, opset=13, consts=["rp"])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(mode):
    x = r(3, 4)
    p = np.array([1, 2, 2, 1], I64)
    check("Pad", {"x": x, "p": p, "v": np.array(1.5, F32)}, {"mode": mode}, opset=19,
          consts=["p", "v"])
    if mode != "wrap":
        (y,) = ours(model("Pad", {"x": x}, {"pads": [1, 2, 2, 1], "mode": mode}, opset=6), {"x": x})
        np.testing.assert_allclose(y, np.pad(x, [(1, 2), (2, 1)], mode={"constant": "constant",
                                   "reflect": "reflect", "edge": "edge"}[mode]))
    c = {"p": np.array([1, -1], I64), "v": np.array(0, F32), "a": np.array([1], I64)}
    (y,) = ours(model("Pad", {"x": x, **c}, {"mode": mode}, opset=19, consts=c), {"x": x})
    np.testing.assert_array_equal(y[:, 1:], x[:, :-1])          # negative pad crops


def test_shape_size_constant_forms():
    x = r(2, 3, 4)
    (s,) = check("Shape", {"x": x}, {"start": 1, "end": -1}, opset=15)
    assert s.tolist() == [3] and s.dtype == I64
    assert check("Size", {"x": x})[0] == 24
    for attrs in [{"value": numpy_helper.from_array(r(2, 2))}, {"value_float": 1.5},
                  {"value_floats": [1.0, 2.0]}, {"value_int": 3}, {"value_ints": [1, 2]}]:
        m = model("Constant", {}, attrs)
        (got,) = ours(m, {})
        (want,) = reference(m, {})
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    check("ConstantOfShape", {"s": np.array([2, 3], I64)},
          {"value": numpy_helper.from_array(np.array([7], np.int32))}, opset=9, consts=["s"])


def test_depth_space():
    x = r(1, 8, 2, 3)
    for mode in ("DCR", "CRD"):
        check("DepthToSpace", {"x": x}, {"blocksize": 2, "mode": mode})
    check("SpaceToDepth", {"x": r(1, 2, 4, 6)}, {"blocksize": 2})


def test_compress_reverse_sequence_onehot():
    check("Compress", {"x": r(3, 4), "c": np.array([True, False, True])}, {"axis": 0},
          opset=11, consts=["c"])
    check("Compress", {"x": r(3, 4), "c": np.array([False, True, True, False, True])},
          opset=11, consts=["c"])
    check("ReverseSequence", {"x": r(4, 3, 2), "l": np.array([4, 1, 3], I64)},
          {"batch_axis": 1, "time_axis": 0}, opset=10)
    check("OneHot", {"i": np.array([[0, 2], [-1, 1]], I64), "d": np.array(3, I64),
                     "v": np.array([-1, 5], F32)}, {"axis": 1}, opset=11, consts=["d"])


def test_data_dependent_shapes_need_constants():
    x = np.array([[1, 0], [0, 3]], F32)
    check("NonZero", {"x": x}, consts=["x"])
    with pytest.raises(popart_exception, match="data-dependent"):
        ours(model("NonZero", {"x": x}), {"x": x})
    u = np.array([2, 1, 2, 3, 1], F32)
    check("Unique", {"x": u}, {"sorted": 0}, opset=11, consts=["x"], n_out=4)
    check("Unique", {"x": u}, opset=11, consts=["x"], n_out=4)
    with pytest.raises(popart_exception, match="data-dependent"):
        ours(model("Unique", {"x": u}, opset=11), {"x": u})


def test_range_cast_eyelike():
    check("Range", {"a": np.array(1, I64), "b": np.array(10, I64), "c": np.array(3, I64)},
          opset=11, consts=["a", "b", "c"])
    check("Range", {"a": np.array(1.0, F32), "b": np.array(-2.0, F32), "c": np.array(-0.5, F32)},
          opset=11, consts=["a", "b", "c"])
    # one-element limits (a sliced Shape, as AffineGrid's function body has) are accepted
    for limit, err in ((np.array([4], I64), None), (np.array([4, 5], I64), "'limit' must be a scalar")):
        ins = {"a": np.array(0, I64), "b": limit, "c": np.array(1, I64)}
        m = model("Range", ins, opset=11, consts=ins)
        if err:
            with pytest.raises(popart_exception, match=err):
                ours(m, {})
        else:
            np.testing.assert_array_equal(ours(m, {})[0], np.arange(4))
    x = np.array([-1.7, 0.0, 0.3, 2.5, 300.0], F32)
    for to in (TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.DOUBLE,
               TensorProto.UINT8, TensorProto.BFLOAT16):
        (y,) = ours(model("Cast", {"x": x}, {"to": to}, opset=13), {"x": x})
        assert y.dtype == helper.tensor_dtype_to_np_dtype(to)
        if to in (TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.DOUBLE):
            np.testing.assert_array_equal(y, x.astype(y.dtype))
    (y,) = ours(model("Cast", {"x": x}, {"to": TensorProto.FLOAT8E4M3FN}, opset=19), {"x": x})
    assert y.dtype == ml_dtypes.float8_e4m3fn and float(y[-1]) == 288.0   # 300 -> nearest
    (y,) = ours(model("Cast", {"x": np.array([1e6], F32)}, {"to": TensorProto.FLOAT8E4M3FN},
                      opset=19), {"x": np.array([1e6], F32)})
    assert float(y[0]) == 448.0                                       # saturated
    check("CastLike", {"x": x, "t": np.zeros(1, np.float16)}, opset=15)
    check("EyeLike", {"x": r(3, 4)}, {"k": 1}, opset=9)
    check("EyeLike", {"x": r(4, 3)}, {"k": -1, "dtype": TensorProto.INT32}, opset=9)


def test_center_crop_pad():
    x = r(5, 4, 3)
    c = {"s": np.array([3, 6], I64)}
    (y,) = ours(model("CenterCropPad", {"x": x, **c}, {"axes": [0, 1]}, opset=18, consts=c), {"x": x})
    want = np.zeros((3, 6, 3), F32)
    want[:, 1:5] = x[1:4]
    np.testing.assert_array_equal(y, want)
    check("CenterCropPad", {"x": x, "s": np.array([2, 7, 3], I64)}, opset=18, consts=["s"])


def test_sequences():
    a, b = r(2, 3), r(1, 3)
    m = onnx.helper.make_model(onnx.helper.make_graph([
        helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
        helper.make_node("SequenceInsert", ["s", "a"], ["s2"]),
        helper.make_node("SequenceLength", ["s2"], ["n"]),
        helper.make_node("ConcatFromSequence", ["s2"], ["c"], axis=0),
        helper.make_node("SequenceAt", ["s2", "one"], ["at"]),
    ], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
             helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info(o, 0, None) for o in ("n", "c", "at")],
        initializer=[numpy_helper.from_array(np.array(1, I64), "one")]),
        opset_imports=[helper.make_opsetid("", 13)])
    res = run_model(m, {"a": a, "b": b})
    assert res["n"] == 3
    np.testing.assert_array_equal(res["c"], np.concatenate([a, b, a]))
    np.testing.assert_array_equal(res["at"], b)


def test_onnxruntime_agrees_on_a_chain():
    """A small shape-computing chain checked against onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["d0"], axis=0),
             helper.make_node("Unsqueeze", ["d0", "zero1"], ["d0u"]),
             helper.make_node("Concat", ["d0u", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y0"]),
             helper.make_node("ReduceLogSumExp", ["y0", "one1"], ["y"], keepdims=0)]
    init = [numpy_helper.from_array(np.array(0, I64), "zero"),
            numpy_helper.from_array(np.array([0], I64), "zero1"),
            numpy_helper.from_array(np.array([-1], I64), "m1"),
            numpy_helper.from_array(np.array([1], I64), "one1")]
    m = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], initializer=init),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    x = r(2, 3, 4)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(run_model(m, {"x": x})["y"], want, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Gradients: jax.grad through the lowering vs central differences in float64

GRAD = [  # (op, inputs (float64; first is differentiated), attrs, opset, consts)
    ("Abs", [(3, 4)], {}, 13, {}), ("Asin", [0.8], {}, 13, {}), ("Atan", [(3, 4)], {}, 13, {}),
    ("Cos", [(3, 4)], {}, 13, {}), ("Cosh", [(3, 4)], {}, 13, {}), ("Sin", [(3, 4)], {}, 13, {}),
    ("Sinh", [(3, 4)], {}, 13, {}), ("Tan", [1.0], {}, 13, {}), ("Tanh", [(3, 4)], {}, 13, {}),
    ("Exp", [(3, 4)], {}, 13, {}), ("Log", ["pos"], {}, 13, {}),
    ("Sqrt", ["pos"], {}, 13, {}), ("Reciprocal", ["pos"], {}, 13, {}),
    ("Neg", [(3, 4)], {}, 13, {}), ("Erf", [(3, 4)], {}, 13, {}), ("Relu", [(3, 4)], {}, 13, {}),
    ("Sigmoid", [(3, 4)], {}, 13, {}), ("Softplus", [(3, 4)], {}, 13, {}),
    ("Softsign", [(3, 4)], {}, 13, {}), ("Elu", [(3, 4)], {"alpha": 0.7}, 13, {}),
    ("Selu", [(3, 4)], {}, 13, {}), ("LeakyRelu", [(3, 4)], {"alpha": 0.2}, 13, {}),
    ("HardSigmoid", [(3, 4)], {}, 13, {}), ("Shrink", [(3, 4)], {"lambd": 0.3}, 13, {}),
    ("ThresholdedRelu", [(3, 4)], {"alpha": 0.3}, 13, {}),
    ("Add", [(3, 4), (4,)], {}, 13, {}), ("Sub", [(3, 4), (3, 1)], {}, 13, {}),
    ("Mul", [(3, 4), (4,)], {}, 13, {}), ("Div", [(3, 4), "pos4"], {}, 13, {}),
    ("Pow", [(3, 4), "pos"], {}, 13, {}), ("Max", [(3, 4), (4,)], {}, 13, {}),
    ("Min", [(3, 4), (4,)], {}, 13, {}), ("Mean", [(3, 4), (3, 4)], {}, 13, {}),
    ("Sum", [(3, 4), (1, 4)], {}, 13, {}), ("MatMul", [(3, 4), (4, 2)], {}, 13, {}),
    ("Gemm", [(3, 4), (2, 4), (2,)], {"transB": 1, "alpha": 0.5}, 13, {}),
    ("Clip", [(3, 4), "lo", "hi"], {}, 13, {}), ("Where", ["mask", (3, 4), (3, 4)], {}, 13, {}),
    ("CumSum", [(3, 4), "axis1"], {"exclusive": 1}, 14, {1}),
    ("Transpose", [(2, 3, 4)], {"perm": [1, 2, 0]}, 13, {}),
    ("Reshape", [(3, 4), "shape"], {}, 13, {1}), ("Concat", [(3, 4), (3, 2)], {"axis": 1}, 13, {}),
    ("Slice", [(5, 6), "st", "en", "ax", "stp"], {}, 13, {1, 2, 3, 4}),
    ("Gather", [(5, 3), "idx"], {"axis": 0}, 13, {}),
    ("Pad", [(3, 4), "pads"], {"mode": "reflect"}, 13, {1}),
    ("Squeeze", [(3, 1, 4), "ax1"], {}, 13, {1}), ("Unsqueeze", [(3, 4), "ax1"], {}, 13, {1}),
    ("Tile", [(2, 3), "reps"], {}, 13, {1}), ("Expand", [(3, 1), "eshape"], {}, 13, {1}),
    ("Split", [(4, 3)], {"axis": 0}, 13, {}), ("Flatten", [(2, 3, 4)], {}, 13, {}),
    ("Scatter", [(3, 3), "sidx", (1, 3)], {}, 9, {}),
    ("TopK", [(3, 5), "k2"], {}, 11, {1}), ("ArgMax", [(3, 5)], {}, 13, {}),
] + [(op, ["pos3"] if op in ("ReduceLogSum", "ReduceL2", "ReduceProd") else [(2, 3, 4)],
      {"axes": [1]}, 11, {}) for op in REDUCE]
SPECIAL = {
    "pos": lambda: rng.uniform(0.5, 2, (3, 4)), "pos3": lambda: rng.uniform(0.5, 2, (2, 3, 4)), "pos4": lambda: rng.uniform(0.5, 2, (4,)),
    "lo": lambda: np.array(-0.5), "hi": lambda: np.array(0.7), "axis1": lambda: np.array(1, I64),
    "mask": lambda: rng.uniform(size=(3, 4)) > 0.5, "shape": lambda: np.array([2, 6], I64),
    "st": lambda: np.array([4, 1], I64), "en": lambda: np.array([0, 5], I64),
    "ax": lambda: np.array([0, 1], I64), "stp": lambda: np.array([-2, 2], I64),
    "idx": lambda: np.array([[4, 0], [-1, 0]], I64), "pads": lambda: np.array([1, 2, 0, 1], I64),
    "ax1": lambda: np.array([1], I64), "reps": lambda: np.array([2, 2], I64),
    "eshape": lambda: np.array([2, 3, 4], I64), "sidx": lambda: np.array([[2, 0, 1]], I64),
    "k2": lambda: np.array([2], I64),
}


def _grad_inputs(spec, op):
    out = []
    for s in spec:
        if isinstance(s, tuple):
            out.append(rng.uniform(-1.5, 1.5, s))
        elif isinstance(s, float):      # inputs kept inside (-bound, bound)
            out.append(rng.uniform(-s, s, (3, 4)) * 0.9)
        else:
            out.append(SPECIAL[s]())
    if op == "Pow":
        out[0], out[1] = np.abs(out[0]) + 0.5, rng.uniform(-1.5, 1.5, (3, 4))
    return out


@pytest.mark.parametrize("op,spec,attrs,opset,const_idx", GRAD, ids=[g[0] for g in GRAD])
def test_gradient_finite_difference(op, spec, attrs, opset, const_idx):
    vals = _grad_inputs(spec, op)
    names = [f"i{k}" for k in range(len(vals))]
    if op in ("TopK", "ArgMax", "Split"):
        n_out = {"TopK": 2, "ArgMax": 1, "Split": 2}[op]
    else:
        n_out = 1
    consts = {names[k]: vals[k] for k in const_idx}
    m = model(op, dict(zip(names, vals)), attrs, opset, consts, n_out)
    graph, _ = import_model(m)
    diff = [k for k, v in enumerate(vals) if v.dtype == np.float64 and names[k] not in consts]
    outs = [o.name for o in m.graph.output]
    wts = None

    def f(*xs):
        nonlocal wts
        feeds = {names[k]: vals[k] for k in range(len(vals)) if names[k] not in consts}
        feeds.update({names[k]: x for k, x in zip(diff, xs)})
        env = execute(graph, feeds, TraceState())
        ys = [env[o] for o in outs if jnp.issubdtype(jnp.result_type(env[o]), jnp.floating)]
        if wts is None:
            wts = [np.random.default_rng(1).uniform(-1, 1, np.shape(y)) for y in ys]
        return sum(jnp.sum(y * w) for y, w in zip(ys, wts)) if ys else jnp.zeros(())

    args = [jnp.asarray(vals[k]) for k in diff]
    f(*args)
    grads = jax.grad(f, argnums=tuple(range(len(args))))(*args)
    eps = 1e-6
    for a, (k, g) in enumerate(zip(diff, grads)):
        num = np.zeros(vals[k].size)
        for j in range(vals[k].size):
            plus = [np.array(x) for x in args]
            minus = [np.array(x) for x in args]
            plus[a].flat[j] += eps
            minus[a].flat[j] -= eps
            num[j] = (float(f(*plus)) - float(f(*minus))) / (2 * eps)
        np.testing.assert_allclose(np.asarray(g).reshape(-1), num, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{op}: d/d{names[k]}")
    if op == "ArgMax":
        assert all(float(np.abs(g).max()) == 0 for g in grads)
