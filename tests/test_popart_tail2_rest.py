"""PopART's tail, second round (issue 37), the numeric leftovers: DynamicSlice's noOverlap
gradient (overwrite), ALS with a float16 loss past float16's range, popxl's float8 host
dtype. Each test names the PopART source it follows; references are NumPy transcriptions."""
from __future__ import annotations

import numpy as np
import pytest

import popart

F32 = np.float32
GRAD = popart.reservedGradientPrefix()


def CPU():
    return popart.DeviceManager().createCpuDevice()


# ---------------------------------------------------------------- DynamicSlice noOverlap
def _slice_grads(offsets, no_overlap, gs, w):
    """x [6, 2] read by DynamicSlices of 2 rows at ``offsets`` (each times its constant ``gs``)
    and by Mul(x, w): the gradient of x from a TrainingSession."""
    xv = np.arange(12, dtype=F32).reshape(6, 2)
    b = popart.Builder()
    x = b.addInitializedInputTensor(xv, "x")
    terms = [b.aiOnnx.reducesum([b.aiOnnx.mul([x, b.aiOnnx.constant(w)])], keepdims=0)]
    for o, n, g in zip(offsets, no_overlap, gs):
        sl = b.aiGraphcore.dynamicslice([x, b.aiOnnx.constant(np.array([o], np.uint32))],
                                        axes=[0], sizes=[2], noOverlap=n)
        terms.append(b.aiOnnx.reducesum([b.aiOnnx.mul([sl, b.aiOnnx.constant(g)])], keepdims=0))
    loss = b.aiGraphcore.identityloss([b.aiOnnx.sum(terms)])
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [GRAD + x]), loss,
                               popart.ConstSGD(1e-9), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, a))
    return a[GRAD + x]


def _popart_rule(offsets, no_overlap, gs, w):
    """dynamicoptransform.cpp, gradSumToGradChain: the other consumers' gradient sum, then each
    slice's gradient DynamicUpdate-d (noOverlap) or DynamicAdd-ed into it, the slices in the
    backward order (the forward pass's last slice first)."""
    grad = np.broadcast_to(w, (6, 2)).astype(F32).copy()
    for o, n, g in reversed(list(zip(offsets, no_overlap, gs))):
        grad[o:o + 2] = g if n else grad[o:o + 2] + g
    return grad


@pytest.mark.parametrize("offsets,no_overlap", [
    ((0, 3), (1, 1)),      # disjoint noOverlap slices: the Mul's gradient overwritten there
    ((1, 2), (1, 1)),      # overlapping noOverlap slices: the first slice's gradient wins
    ((1, 2), (1, 0)),      # a DynamicAdd after the DynamicUpdate
    ((0, 3), (0, 0)),      # accumulation, as without noOverlap
])
def test_no_overlap_gradient_overwrites(offsets, no_overlap):
    w = np.array([0.5, -1.0], F32)
    gs = [np.array([[1, 2], [3, 4]], F32), np.array([[10, 20], [30, 40]], F32)]
    got = _slice_grads(offsets, no_overlap, gs, w)
    np.testing.assert_array_equal(got, _popart_rule(offsets, no_overlap, gs, w))


# ---------------------------------------------------------------- popxl float8 host dtype
@pytest.mark.parametrize("name,bits", [("float8_143", 0x48), ("float8_152", 0x44)])
def test_popxl_float8_as_numpy_is_popxl_record_and_round_trips(name, bits):
    """popxl/python_files/dtypes.py: float8_143 / float8_152's as_numpy() is the uint8 record
    np.dtype([(name, "u1")]) (PopXL has no NumPy float8); a float8 variable made from float32
    data holds PopXL's record bytes, and get_tensor_data / write_variable_data keep that form.
    2.0's bits: float8_143 (bias 8) 0 1001 000 = 0x48, float8_152 (bias 16) 0 10001 00 = 0x44."""
    import popxl
    dt = getattr(popxl, name)
    record = np.dtype([(name, "u1")])
    assert dt.as_numpy() == record
    assert popxl.dtype.as_dtype(record) is dt
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.array([2.0, -2.0], F32), dt, name="v")
        d = popxl.d2h_stream((2,), dt, "d")
        popxl.ops.host_store(d, v)
    with popxl.Session(ir, "cpu") as s:
        held = s.get_tensor_data(v)
        assert held.dtype == record
        np.testing.assert_array_equal(held.view(np.uint8), [bits, bits | 0x80])
        out = s.run()[d]
        assert out.dtype == record
        np.testing.assert_array_equal(out.view(np.uint8), [bits, bits | 0x80])
        new = np.array([(bits | 0x80,), (bits,)], record)
        s.write_variable_data(v, new)
        np.testing.assert_array_equal(s.get_tensor_data(v).view(np.uint8), [bits | 0x80, bits])


# ---------------------------------------------------------------- ALS past float16's maximum
def test_als_float16_reduce_loss_scaled_past_float16_range():
    """A float16 loss from ReduceSum (not Nll / L1) with ALS and a loss scale of 2**17:
    EnsureFp32LossScale (ensurefp32lossscale.cpp) makes the loss scale float32, the
    single-input grad ops from it (IdentityLoss, ReduceSum: pass-through) give float32, and
    the first other grad op (the last MatMul's) computes from its float16 inputs cast up and
    casts its gradients down to float16. So dW2 = fp16(r32^T @ full(2**17)) (finite), and the
    weights train as with a scale of 1024 (scaling by powers of two is exact)."""
    from popart import testing
    batch, I, H, O = 16, 4, 5, 3
    rs = np.random.RandomState(3)
    xv = (rs.randn(batch, I) * 0.01).astype(np.float16)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [batch, I]), "x")
    w1 = b.addInitializedInputTensor((rs.randn(I, H) * 0.5).astype(np.float16), "w1")
    w2 = b.addInitializedInputTensor((rs.randn(H, O) * 0.05).astype(np.float16), "w2")
    r = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    y = b.aiOnnx.matmul([r, w2])
    loss = b.aiGraphcore.identityloss([b.aiOnnx.reducesum([y], keepdims=0)])
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.enabled = True
    anchors = {t: popart.AnchorReturnType("ALL") for t in ("finalLossScale", r, GRAD + w2)}
    trained = {}
    for ls in (1024.0, 2.0 ** 17):
        s = popart.TrainingSession(
            b.getModelProto(), popart.DataFlow(1, anchors), loss,
            popart.SGD({"defaultLearningRate": (0.1, False), "lossScaling": (ls, False)}),
            CPU(), userOptions=opts)
        s.prepareDevice()
        s.weightsFromHost()
        a = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: xv}, a))
        assert a["finalLossScale"] == ls
        want = (a[r].astype(F32).T @ np.full((batch, O), ls, F32)).astype(np.float16)
        np.testing.assert_array_equal(a[GRAD + w2], want)
        trained[ls] = []
        for w in (w1, w2):
            s.weightsToHost()
            wv = np.zeros(s.getInfo(w).shape(), np.float16)
            s.readWeights(popart.PyWeightsIO({w: wv}))
            trained[ls].append(wv)
    program = testing.step_program(s)
    assert program.float32_loss == loss and y in program.float32_region
    for got, want in zip(trained[2.0 ** 17], trained[1024.0]):
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)
