"""Elementwise / math / reduce / shape ops run by the op tester, checked against onnx.reference
(or NumPy / onnxruntime), across opset versions; plus finite-difference gradient checks (a
TrainingSession, float64) of the differentiable ones on PopART's supported-op list."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from popart.errors import popart_exception

from op_tester import Const, RefData, one_op

REF = RefData.onnx_reference
rng = np.random.default_rng(0)
F32, I64 = np.float32, np.int64


@pytest.fixture
def op_tester(op_tester):
    op_tester.opsets = {"ai.onnx": 13}
    op_tester.rtol, op_tester.atol, op_tester.equal_nan = 1e-5, 1e-6, True
    return op_tester


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
def test_unary(op_tester, op, dtype):
    lo, hi = UNARY[op]
    opset = {"HardSwish": 14, "Mish": 18, "Celu": 12}.get(op, 13)
    op_tester.run(one_op(op, [r(3, 4, lo=lo, hi=hi, dtype=dtype)]), REF, opsets={"ai.onnx": opset})


@pytest.mark.parametrize("op,attrs", [
    ("LeakyRelu", {"alpha": 0.3}), ("Elu", {"alpha": 0.5}), ("Selu", {"alpha": 2.0, "gamma": 3.0}),
    ("Celu", {"alpha": 2.0}), ("HardSigmoid", {"alpha": 0.5, "beta": 0.25}),
    ("ThresholdedRelu", {"alpha": 0.5}), ("Shrink", {"lambd": 1.0, "bias": 0.5}),
])
def test_activation_attributes(op_tester, op, attrs):
    op_tester.run(one_op(op, [r(5, 6, lo=-3, hi=3)], **attrs), REF)


def test_round_half_to_even_and_isinf(op_tester):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.4, np.inf, -np.inf, np.nan], F32)
    (y,) = op_tester.run(one_op("Round", [x]), REF, opsets={"ai.onnx": 11})
    np.testing.assert_array_equal(y[:6], [-2, -2, -0, 0, 2, 2])
    op_tester.run(one_op("IsInf", [x], detect_negative=0), REF, opsets={"ai.onnx": 10})
    (y,) = op_tester.run(one_op("IsInf", [x], detect_positive=0), REF, opsets={"ai.onnx": 10})
    assert y.tolist() == [False] * 8 + [True, False]


def test_gelu_opset20(op_tester):
    x = r(4, 5, lo=-3, hi=3)
    op_tester.run(one_op("Gelu", [x]), REF, opsets={"ai.onnx": 20})
    op_tester.run(one_op("Gelu", [x], approximate="tanh"), REF, opsets={"ai.onnx": 20})
    with pytest.raises(popart_exception, match="approximate"):
        op_tester.run(one_op("Gelu", [x], approximate="erf"), None, opsets={"ai.onnx": 20})


def test_not_bitwise_not(op_tester):
    op_tester.run(one_op("Not", [np.array([True, False])]), REF, opsets={"ai.onnx": 1 + 6})
    op_tester.run(one_op("BitwiseNot", [np.array([0, 5, -3], np.int32)]), REF,
                  opsets={"ai.onnx": 18})


BINARY = ["Add", "Sub", "Mul", "Div", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("dtype", [F32, np.int32, I64])
def test_binary_broadcast(op_tester, op, dtype):
    a = r(2, 3, 4, lo=-9, hi=9).astype(dtype)
    b = r(3, 1, lo=1, hi=5).astype(dtype)
    op_tester.run(one_op(op, [a, b]), REF, opsets={"ai.onnx": 14 if op in BINARY[:4] else 16})


def test_integer_div_truncates_toward_zero(op_tester):
    a = np.array([7, -7, 7, -7, 1], np.int32)
    b = np.array([2, 2, -2, -2, 3], np.int32)
    (y,) = op_tester.run(one_op("Div", [a, b]), REF)
    assert y.tolist() == [3, -3, -3, 3, 0]


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", [np.int32, I64, F32])
def test_mod(op_tester, fmod, dtype):
    a = np.array([5, -5, 5, -5, 7, -3], dtype)
    b = np.array([3, 3, -3, -3, 2, 4], dtype)
    if dtype == F32 and not fmod:
        (y,) = op_tester.run(one_op("Mod", [a, b], fmod=0), None)
        np.testing.assert_array_equal(y, np.mod(a, b))
        return
    (y,) = op_tester.run(one_op("Mod", [a, b], fmod=fmod), REF)
    assert (np.sign(y[y != 0]) == np.sign((a if fmod else b)[y != 0])).all()


@pytest.mark.parametrize("base,exp", [(F32, F32), (F32, I64), (I64, F32), (np.int32, np.int32),
                                      (np.float64, np.int32)])
def test_pow_mixed_dtypes(op_tester, base, exp):
    a = np.array([1, 2, 3, 4], base)
    b = np.array([2, 3, 1, 0], exp)
    (y,) = op_tester.run(one_op("Pow", [a, b]), REF, opsets={"ai.onnx": 15})
    assert y.dtype == base


def test_bitshift_and_bitwise(op_tester):
    a = np.array([16, 4, 1], np.uint32)
    b = np.array([1, 2, 3], np.uint32)
    for d in ("LEFT", "RIGHT"):
        op_tester.run(one_op("BitShift", [a, b], direction=d), REF, opsets={"ai.onnx": 11})
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        op_tester.run(one_op(op, [np.array([12, -3], np.int32), np.array([10, 6], np.int32)]), REF,
                      opsets={"ai.onnx": 18})
    for op in ("And", "Or", "Xor"):
        op_tester.run(one_op(op, [np.array([[True, False]]), np.array([[True], [False]])]), REF,
                      opsets={"ai.onnx": 7})


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_broadcast(op_tester, op):
    op_tester.run(one_op(op, [r(2, 3), r(3), r(1, 3)]), REF)
    op_tester.run(one_op(op, [r(4)]), REF)


def test_where_and_prelu(op_tester):
    op_tester.run(one_op("Where", [np.array([[True, False, True]]), r(2, 3), r(2, 1)]), REF,
                  opsets={"ai.onnx": 16})
    op_tester.run(one_op("PRelu", [r(2, 3, 4), r(3, 1)]), REF, opsets={"ai.onnx": 16})
    op_tester.run(one_op("PRelu", [r(2, 3, 4), r(4)]), REF, opsets={"ai.onnx": 16})


def test_add6_legacy_broadcast_axis(op_tester):
    """Add-6 broadcast=1 axis=1: B [3, 4] aligns with A's dims 1 and 2."""
    a, b = r(2, 3, 4, 5), r(3, 4)
    (y,) = op_tester.run(one_op("Add", [a, b], broadcast=1, axis=1), None, opsets={"ai.onnx": 6})
    np.testing.assert_allclose(y, a + b[None, :, :, None])
    (y,) = op_tester.run(one_op("Mul", [a, b[0, :1].repeat(5)], broadcast=1), None,
                         opsets={"ai.onnx": 6})
    np.testing.assert_allclose(y, a * b[0, 0])
    (y,) = op_tester.run(one_op("Sub", [a, np.array([1, 2], F32)], broadcast=1, axis=0), None,
                         opsets={"ai.onnx": 6})
    np.testing.assert_allclose(y, a - np.array([1, 2], F32)[:, None, None, None])


def test_clip_versions(op_tester):
    x = r(3, 4, lo=-3, hi=3)
    (y,) = op_tester.run(one_op("Clip", [x], min=-1.0, max=0.5), None, opsets={"ai.onnx": 6})
    np.testing.assert_array_equal(y, np.clip(x, -1, 0.5))
    assert y.dtype == F32
    lo, hi = np.array(-1, F32), np.array(0.5, F32)
    op_tester.run(one_op("Clip", [x, lo, hi]), REF)
    op_tester.run(one_op("Clip", [x, lo]), REF)                     # no max
    (y,) = op_tester.run(one_op("Clip", [x, None, hi]), REF)   # omitted min
    np.testing.assert_array_equal(y, np.minimum(x, hi))
    (y,) = op_tester.run(one_op("Clip", [x, np.array(1, F32), np.array(0, F32)]), REF)
    assert (y == 0).all()                                       # min > max -> max
    op_tester.run(one_op("Clip",
                         [np.array([-5, 0, 9], np.int32), np.array(-2, np.int32), np.array(3, np.int32)]),
                  REF)


def test_float32_stays_float32(op_tester):
    x = r(3, dtype=F32)
    for op, attrs in [("LeakyRelu", {"alpha": 0.1}), ("Elu", {}), ("HardSigmoid", {}), ("Selu", {})]:
        (y,) = op_tester.run(one_op(op, [x], **attrs), None)
        assert y.dtype == F32, op


# ---------------------------------------------------------------------------------------
# Math

def test_matmul_gemm(op_tester):
    op_tester.run(one_op("MatMul", [r(2, 3, 4), r(4, 5)]), REF)
    op_tester.run(one_op("MatMul", [r(4), r(3, 4, 2)]), REF)
    for ta in (0, 1):
        for tb in (0, 1):
            a, b = (r(4, 3) if ta else r(3, 4)), (r(5, 4) if tb else r(4, 5))
            op_tester.run(one_op("Gemm", [a, b, r(1, 5)], transA=ta, transB=tb, alpha=0.5,
                                 beta=2.0),
                          REF)
    op_tester.run(one_op("Gemm", [r(3, 4), r(4, 5)]), REF, opsets={"ai.onnx": 11})


def test_matmul_integer(op_tester):
    a = rng.integers(0, 255, (3, 4)).astype(np.uint8)
    b = rng.integers(0, 255, (4, 2)).astype(np.uint8)
    op_tester.run(one_op("MatMulInteger",
                         [a, b, np.array(12, np.uint8), np.array([3, 200], np.uint8)]),
                  REF, opsets={"ai.onnx": 10})


def test_einsum(op_tester):
    op_tester.run(one_op("Einsum", [r(2, 3, 4), r(2, 4, 5)], equation="bij,bjk->bik"), REF,
                  opsets={"ai.onnx": 12})
    op_tester.run(one_op("Einsum", [r(3, 3)], equation="ii"), REF, opsets={"ai.onnx": 12})


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(op_tester, exclusive, reverse):
    op_tester.run(one_op("CumSum", [r(3, 4), Const(np.array(-1, np.int32))], exclusive=exclusive,
                         reverse=reverse),
                  REF, opsets={"ai.onnx": 14})
    op_tester.run(one_op("CumSum",
                         [np.arange(6, dtype=np.int32).reshape(2, 3), Const(np.array(0, I64))],
                         exclusive=exclusive, reverse=reverse),
                  REF, opsets={"ai.onnx": 14})


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_ties_and_versions(op_tester, largest):
    x = np.array([[3, 1, 3, 2, 1, 3]], F32)
    k = np.array([3], I64)
    v, i = op_tester.run(one_op("TopK", [x, Const(k)], num_outputs=2, largest=largest), REF,
                         opsets={"ai.onnx": 11})
    assert i.dtype == I64
    assert i.tolist() == ([[0, 2, 5]] if largest else [[1, 4, 3]])       # ties: lower index first
    v1, i1 = op_tester.run(one_op("TopK", [x], num_outputs=2, k=2, axis=1), None,
                           opsets={"ai.onnx": 9})
    assert i1.tolist() == [[0, 2]] and v1.tolist() == [[3, 3]]
    op_tester.run(one_op("TopK", [r(4, 5), Const(np.array([2], I64))], num_outputs=2, axis=0), REF,
                  opsets={"ai.onnx": 10})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_argmax(op_tester, op, last, keepdims):
    x = np.array([[1, 3, 3, 0], [0, 0, 2, 2]], F32)
    (y,) = op_tester.run(one_op(op, [x], axis=1, keepdims=keepdims, select_last_index=last),
                         lambda ref: [ref.onnx_reference()[0].astype(np.int32)])
    assert y.dtype == np.int32   # PopART's ArgExtremaOp: INT32


def test_det_trilu(op_tester):
    op_tester.run(one_op("Det", [r(2, 3, 3)]), REF, opsets={"ai.onnx": 11}, rtol=1e-4)
    for upper in (0, 1):
        op_tester.run(one_op("Trilu", [r(2, 4, 5), Const(np.array(1, I64))], upper=upper), REF,
                      opsets={"ai.onnx": 14})
        op_tester.run(one_op("Trilu", [r(4, 5)], upper=upper), REF, opsets={"ai.onnx": 14})


def test_quantize_dequantize(op_tester):
    x = r(2, 3, 4, lo=-10, hi=10)
    op_tester.run(one_op("QuantizeLinear", [x, np.array(0.1, F32), np.array(3, np.int8)]), REF)
    op_tester.run(one_op("QuantizeLinear", [x, np.array(0.07, F32)]), REF, opsets={"ai.onnx": 10})
    op_tester.run(one_op("QuantizeLinear",
                         [x, np.array([0.1, 0.2, 0.3], F32), np.array([0, 10, 250], np.uint8)],
                         axis=1),
                  REF)
    q = rng.integers(-128, 127, (2, 3, 4)).astype(np.int8)
    s, z = np.array([0.1, 0.2, 0.3, 0.5], F32), np.array([1, 2, 3, -4], np.int8)
    (y,) = op_tester.run(one_op("DequantizeLinear", [q, s, z], axis=-1), REF,
                         opsets={"ai.onnx": 19})
    (y13,) = op_tester.run(one_op("DequantizeLinear", [q, s, z], axis=-1), None)
    np.testing.assert_allclose(y13, (q.astype(F32) - z) * s, rtol=1e-6)
    (y10,) = op_tester.run(one_op("DequantizeLinear", [q, np.array(0.25, F32)]), None,
                           opsets={"ai.onnx": 10})
    assert y10.dtype == F32 and np.array_equal(y10, q * np.float32(0.25))
    op_tester.run(one_op("DynamicQuantizeLinear", [x], num_outputs=3), REF, opsets={"ai.onnx": 11})


# ---------------------------------------------------------------------------------------
# Reductions

REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCE)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_attr_and_input_axes(op_tester, op, keepdims):
    x = r(2, 3, 4, lo=0.5, hi=2)
    op_tester.run(one_op(op, [x], axes=[0, -1], keepdims=keepdims), REF, opsets={"ai.onnx": 11},
                  rtol=1e-4)
    op_tester.run(one_op(op, [x], keepdims=keepdims), REF, opsets={"ai.onnx": 11}, rtol=1e-4)
    new = 13 if op == "ReduceSum" else 18
    op_tester.run(one_op(op, [x, Const(np.array([1], I64))], keepdims=keepdims), REF,
                  opsets={"ai.onnx": new}, rtol=1e-4)
    (y,) = op_tester.run(one_op(op, [x, Const(np.array([], I64))], noop_with_empty_axes=1), REF,
                         opsets={"ai.onnx": new}, rtol=1e-4)


def test_reduce_integer_dtype_kept(op_tester):
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    for op, fn in [("ReduceSum", np.sum), ("ReduceProd", np.prod), ("ReduceMax", np.max),
                   ("ReduceSumSquare", lambda v, **k: np.sum(v * v, **k))]:
        (y,) = op_tester.run(one_op(op, [x], axes=[1]), None, opsets={"ai.onnx": 11})
        assert y.dtype == np.int32
        np.testing.assert_array_equal(y, fn(x, axis=1, keepdims=True))


def test_reduce_noop_semantics(op_tester):
    x = r(2, 3)
    (y,) = op_tester.run(one_op("ReduceSum", [x, Const(np.zeros(0, I64))], noop_with_empty_axes=1),
                         None)
    np.testing.assert_array_equal(y, x)
    (y,) = op_tester.run(one_op("ReduceSum", [x, Const(np.zeros(0, I64))]), None)
    np.testing.assert_allclose(y, x.sum(keepdims=True), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Shape ops

def test_reshape(op_tester):
    x = r(2, 3, 4)
    op_tester.run(one_op("Reshape", [x, Const(np.array([0, -1], I64))]), REF,
                  opsets={"ai.onnx": 14})
    op_tester.run(one_op("Reshape", [x, Const(np.array([4, 0, 2, -1], I64))]), REF,
                  opsets={"ai.onnx": 14})
    z = np.zeros((0, 3), F32)
    (y,) = op_tester.run(one_op("Reshape", [z, Const(np.array([3, 0], I64))], allowzero=1), REF,
                         opsets={"ai.onnx": 14})
    assert y.shape == (3, 0)
    with pytest.raises(popart_exception, match="Reshape"):
        op_tester.run(one_op("Reshape", [x, Const(np.array([5, -1], I64))]), None,
                      opsets={"ai.onnx": 14})
    with pytest.raises(popart_exception, match="compile time"):
        op_tester.run(one_op("Reshape", [x, np.array([6, 4], I64)]), None, opsets={"ai.onnx": 14})


def test_transpose_concat_flatten(op_tester):
    op_tester.run(one_op("Transpose", [r(2, 3, 4)], perm=[2, 0, 1]), REF)
    op_tester.run(one_op("Transpose", [r(2, 3, 4)]), REF)
    op_tester.run(one_op("Concat", [r(2, 3), r(2, 1), r(2, 2)], axis=-1), REF)
    for axis in (0, 1, 2, -1, -3):
        op_tester.run(one_op("Flatten", [r(2, 3, 4)], axis=axis), REF)


def test_split_versions(op_tester):
    x = r(6, 4)
    op_tester.run(one_op("Split", [x], num_outputs=2, axis=0, split=[2, 4]), REF,
                  opsets={"ai.onnx": 11})
    op_tester.run(one_op("Split", [x], num_outputs=2, axis=1), REF, opsets={"ai.onnx": 11})
    op_tester.run(one_op("Split", [x, Const(np.array([1, 5], I64))], num_outputs=2), REF)
    def split18(x, n):   # customOp: the Builder has no Split method from opset 18 (its
        def init_builder(builder):   # num_outputs attribute clashes with the outputs' count)
            return builder.customOp("Split", 18, "", [builder.addInputTensor(x)], {"num_outputs": n}, n)
        return init_builder
    outs = op_tester.run(split18(x, 4), REF, opsets={"ai.onnx": 18})
    assert [o.shape[0] for o in outs] == [2, 2, 2, 0]
    outs = op_tester.run(split18(r(7), 3), REF, opsets={"ai.onnx": 18})
    assert [o.shape[0] for o in outs] == [3, 3, 1]


def test_slice_v1_attrs_vs_v10_inputs(op_tester):
    x = r(5, 6, 7)
    (a,) = op_tester.run(one_op("Slice", [x], starts=[1, -3], ends=[100, -1], axes=[0, 2]), None,
                         opsets={"ai.onnx": 1 + 8})
    np.testing.assert_array_equal(a, x[1:, :, -3:-1])
    c = {"s": np.array([1, -3], I64), "e": np.array([100, -1], I64), "a": np.array([0, 2], I64)}
    (b,) = op_tester.run(one_op("Slice", [x] + [Const(v) for v in c.values()]), REF,
                         opsets={"ai.onnx": 10})
    np.testing.assert_array_equal(a, b)
    c = {"s": np.array([-1, 5], I64), "e": np.array([-100, 0], I64), "a": np.array([1, 2], I64),
         "st": np.array([-2, -1], I64)}
    (y,) = op_tester.run(one_op("Slice", [x] + [Const(v) for v in c.values()]), REF)
    np.testing.assert_array_equal(y, x[:, ::-2, 5:0:-1])


def test_gathers_and_scatters(op_tester):
    x = r(4, 5, 3)
    op_tester.run(one_op("Gather", [x, np.array([[0, -1], [2, 1]], I64)], axis=1), REF)
    op_tester.run(one_op("GatherElements", [r(3, 4), np.array([[0, -1], [2, 1], [3, 3]], I64)],
                         axis=1),
                  REF)
    (y,) = op_tester.run(one_op("GatherElements", [x[:, :, 0], np.array([[0, -1]], I64)], axis=1),
                         None)     # smaller index on axis 0
    np.testing.assert_array_equal(y, x[:1, [0, 4], 0])
    op_tester.run(one_op("GatherND", [x, np.array([[1, 2], [3, -1]], I64)]), REF)
    op_tester.run(one_op("GatherND", [x, np.array([[1], [2], [0], [4]], I64)], batch_dims=1), REF)
    for red in ("none", "add", "mul", "max", "min"):
        op_tester.run(one_op("ScatterElements", [r(3, 4), np.array([[1, 0], [2, 3]], I64), r(2, 2)],
                             axis=1, reduction=red),
                      REF, opsets={"ai.onnx": 18})
        op_tester.run(one_op("ScatterND", [r(4, 3), np.array([[1], [3]], I64), r(2, 3)],
                             reduction=red),
                      REF, opsets={"ai.onnx": 18})
    x3, u = r(3, 3), r(1, 3)
    (y,) = op_tester.run(one_op("Scatter", [x3, np.array([[1, 0, 2]], I64), u]), None,
                         opsets={"ai.onnx": 9})
    x3[[1, 0, 2], [0, 1, 2]] = u[0]
    np.testing.assert_array_equal(y, x3)


def test_squeeze_unsqueeze_versions(op_tester):
    x = r(1, 3, 1, 2)
    (a,) = op_tester.run(one_op("Squeeze", [x], axes=[0, -2]), REF, opsets={"ai.onnx": 11})
    (b,) = op_tester.run(one_op("Squeeze", [x, Const(np.array([0, -2], I64))]), REF)
    np.testing.assert_array_equal(a, b)
    assert op_tester.run(one_op("Squeeze", [x]), REF)[0].shape == (3, 2)
    (u1,) = op_tester.run(one_op("Unsqueeze", [r(3, 2)], axes=[0, -1]), REF, opsets={"ai.onnx": 11})
    (u2,) = op_tester.run(one_op("Unsqueeze", [r(3, 2), Const(np.array([0, -1], I64))]), REF)
    assert u1.shape == u2.shape == (1, 3, 2, 1)
    with pytest.raises(popart_exception, match="squeeze"):
        op_tester.run(one_op("Squeeze", [x], axes=[1]), None, opsets={"ai.onnx": 11})


def test_expand_tile(op_tester):
    op_tester.run(one_op("Expand", [r(3, 1), Const(np.array([2, 1, 4], I64))]), REF)
    op_tester.run(one_op("Tile", [r(2, 3), Const(np.array([2, 3], I64))]), REF)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(op_tester, mode):
    x = r(3, 4)
    p = np.array([1, 2, 2, 1], I64)
    op_tester.run(one_op("Pad", [x, Const(p), Const(np.array(1.5, F32))], mode=mode), REF,
                  opsets={"ai.onnx": 19})
    if mode != "wrap":
        (y,) = op_tester.run(one_op("Pad", [x], pads=[1, 2, 2, 1], mode=mode), None,
                             opsets={"ai.onnx": 6})
        np.testing.assert_allclose(y, np.pad(x, [(1, 2), (2, 1)], mode={"constant": "constant",
                                   "reflect": "reflect", "edge": "edge"}[mode]))
    c = {"p": np.array([1, -1], I64), "v": np.array(0, F32), "a": np.array([1], I64)}
    (y,) = op_tester.run(one_op("Pad", [x] + [Const(v) for v in c.values()], mode=mode), None,
                         opsets={"ai.onnx": 19})
    np.testing.assert_array_equal(y[:, 1:], x[:, :-1])          # negative pad crops


def test_shape_size_constant_forms(op_tester):
    x = r(2, 3, 4)
    (s,) = op_tester.run(one_op("Shape", [x], start=1, end=-1), REF, opsets={"ai.onnx": 15})
    assert s.tolist() == [3] and s.dtype == I64
    assert op_tester.run(one_op("Size", [x]), REF)[0] == 24
    value = r(2, 2)
    op_tester.run(lambda builder: [builder.aiOnnx.constant(value)], REF, rtol=0, atol=0)
    for attrs in [{"value_float": 1.5}, {"value_floats": [1.0, 2.0]}, {"value_int": 3},
                  {"value_ints": [1, 2]}]:
        op_tester.run(lambda builder: builder.customOp("Constant", 13, "", [], attrs, 1), REF,
                      rtol=0, atol=0)
    op_tester.run(one_op("ConstantOfShape", [Const(np.array([2, 3], I64))],
                         value=np.array([7], np.int32)),
                  REF, opsets={"ai.onnx": 9})


def test_depth_space(op_tester):
    x = r(1, 8, 2, 3)
    for mode in ("DCR", "CRD"):
        op_tester.run(one_op("DepthToSpace", [x], blocksize=2, mode=mode), REF)
    op_tester.run(one_op("SpaceToDepth", [r(1, 2, 4, 6)], blocksize=2), REF)


def test_compress_reverse_sequence_onehot(op_tester):
    op_tester.run(one_op("Compress", [r(3, 4), Const(np.array([True, False, True]))], axis=0), REF,
                  opsets={"ai.onnx": 11})
    op_tester.run(one_op("Compress", [r(3, 4), Const(np.array([False, True, True, False, True]))]),
                  REF, opsets={"ai.onnx": 11})
    op_tester.run(one_op("ReverseSequence", [r(4, 3, 2), np.array([4, 1, 3], I64)], batch_axis=1,
                         time_axis=0),
                  REF, opsets={"ai.onnx": 10})
    op_tester.run(one_op("OneHot",
                         [np.array([[0, 2], [-1, 1]], I64), Const(np.array(3, I64)), np.array([-1, 5], F32)],
                         axis=1),
                  REF, opsets={"ai.onnx": 11})


def test_data_dependent_shapes(op_tester):
    """Folded on constants; on run-time data, run on the host between compiled segments
    (tests/test_data_dependent_shapes.py)."""
    x = np.array([[1, 0], [0, 3]], F32)
    op_tester.run(one_op("NonZero", [Const(x)]), REF)
    op_tester.run(one_op("NonZero", [x]), REF)
    u = np.array([2, 1, 2, 3, 1], F32)
    op_tester.run(one_op("Unique", [Const(u)], num_outputs=4, sorted=0), REF,
                  opsets={"ai.onnx": 11})
    op_tester.run(one_op("Unique", [Const(u)], num_outputs=4), REF, opsets={"ai.onnx": 11})
    op_tester.run(one_op("Unique", [u], num_outputs=4), REF, opsets={"ai.onnx": 11})


def test_range_cast_eyelike(op_tester):
    op_tester.run(one_op("Range",
                         [Const(np.array(1, I64)), Const(np.array(10, I64)), Const(np.array(3, I64))]),
                  REF, opsets={"ai.onnx": 11})
    op_tester.run(one_op("Range",
                         [Const(np.array(1.0, F32)), Const(np.array(-2.0, F32)), Const(np.array(-0.5, F32))]),
                  REF, opsets={"ai.onnx": 11})
    # one-element limits (a sliced Shape, as AffineGrid's function body has) are accepted
    for limit, err in ((np.array([4], I64), None), (np.array([4, 5], I64), "'limit' must be a scalar")):
        init_builder = one_op("Range", [Const(np.array(0, I64)), Const(limit), Const(np.array(1, I64))])
        if err:
            with pytest.raises(popart_exception, match=err):
                op_tester.run(init_builder, None, opsets={"ai.onnx": 11})
        else:
            op_tester.run(init_builder, lambda ref: [np.arange(4)], opsets={"ai.onnx": 11})
    x = np.array([-1.7, 0.0, 0.3, 2.5, 300.0], F32)
    for to in (TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.DOUBLE,
               TensorProto.UINT8, TensorProto.BFLOAT16):
        (y,) = op_tester.run(one_op("Cast", [x], to=to), None)
        assert y.dtype == helper.tensor_dtype_to_np_dtype(to)
        if to in (TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.INT32, TensorProto.DOUBLE):
            np.testing.assert_array_equal(y, x.astype(y.dtype))
    (y,) = op_tester.run(one_op("Cast", [x], to=TensorProto.FLOAT8E4M3FN), None,
                         opsets={"ai.onnx": 19})
    assert y.dtype == ml_dtypes.float8_e4m3fn and float(y[-1]) == 288.0   # 300 -> nearest
    (y,) = op_tester.run(one_op("Cast", [np.array([1e6], F32)], to=TensorProto.FLOAT8E4M3FN), None,
                         opsets={"ai.onnx": 19})
    assert float(y[0]) == 448.0                                       # saturated
    op_tester.run(one_op("CastLike", [x, np.zeros(1, np.float16)]), REF, opsets={"ai.onnx": 15})
    op_tester.run(one_op("EyeLike", [r(3, 4)], k=1), REF, opsets={"ai.onnx": 9})
    op_tester.run(one_op("EyeLike", [r(4, 3)], k=-1, dtype=TensorProto.INT32), REF,
                  opsets={"ai.onnx": 9})


def test_center_crop_pad(op_tester):
    x = r(5, 4, 3)
    c = {"s": np.array([3, 6], I64)}
    (y,) = op_tester.run(one_op("CenterCropPad", [x, Const(c["s"])], axes=[0, 1]), None,
                         opsets={"ai.onnx": 18})
    want = np.zeros((3, 6, 3), F32)
    want[:, 1:5] = x[1:4]
    np.testing.assert_array_equal(y, want)
    op_tester.run(one_op("CenterCropPad", [x, Const(np.array([2, 7, 3], I64))]), REF,
                  opsets={"ai.onnx": 18})


def test_sequences(op_tester):
    a, b = r(2, 3), r(1, 3)

    def init_builder(builder):
        ai, bi = builder.addInputTensor(a), builder.addInputTensor(b)
        s2 = builder.aiOnnx.sequenceinsert([builder.aiOnnx.sequenceconstruct([ai, bi]), ai])
        return [builder.aiOnnx.sequencelength([s2]),
                builder.aiOnnx.concatfromsequence([s2], axis=0),
                builder.aiOnnx.sequenceat([s2, builder.aiOnnx.constant(np.array(1, I64))])]

    op_tester.run(init_builder, lambda ref: [np.array(3, I64), np.concatenate([a, b, a]), b],
                  rtol=0, atol=0)


def test_onnxruntime_agrees_on_a_chain(op_tester):
    """A small shape-computing chain checked against onnxruntime."""
    x = r(2, 3, 4)

    def init_builder(builder):
        on, const = builder.aiOnnx, builder.aiOnnx.constant
        xi = builder.addInputTensor(x)
        d0 = on.gather([on.shape([xi]), const(np.array(0, I64))], axis=0)
        shape = on.concat([on.unsqueeze([d0, const(np.array([0], I64))]), const(np.array([-1], I64))],
                          axis=0)
        return [on.reducelogsumexp([on.reshape([xi, shape]), const(np.array([1], I64))], keepdims=0)]

    op_tester.run(init_builder, RefData.onnxruntime, opsets={"ai.onnx": 18}, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------
# Gradients: a TrainingSession vs central differences of its forward, in float64

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
def test_gradient_finite_difference(op_tester, op, spec, attrs, opset, const_idx):
    """The gradients of every floating-point input (all elements) against central differences
    of the session, with the loss on each floating-point output in turn."""
    vals = _grad_inputs(spec, op)
    inputs = [Const(v) if k in const_idx else v for k, v in enumerate(vals)]
    diff = [k for k, v in enumerate(vals) if v.dtype == np.float64 and k not in const_idx]
    n_out = {"TopK": 2, "Split": 2}.get(op, 1)

    def init_builder(loss_output):
        def init(builder):
            ids = one_op(op, inputs, grads=diff, num_outputs=n_out, **attrs)(builder)
            outs, grads = ids[:n_out], ids[n_out:]
            if op == "ArgMax":   # an integer output: the loss sees it as float; no gradient
                return [builder.aiOnnx.cast(outs, to="DOUBLE")] + grads
            return [outs[loss_output]] + grads
        return init

    for j in range(2 if op == "Split" else 1):
        grads = op_tester.run(init_builder(j), lambda ref: ref.numeric_grads(n=None),
                              step_type="train", opsets={"ai.onnx": opset}, rtol=1e-4, atol=1e-6)[1:]
    if op == "ArgMax":
        assert all(float(np.abs(g).max()) == 0 for g in grads)
