"""ai.onnx nn / rnn / image ops run by the op tester against onnxruntime and the ONNX reference
evaluator; their gradients (a TrainingSession, float64) against central differences of the
same session or PyTorch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto

import jax
import jax.numpy as jnp

import popart
from op_tester import Const, RefData, one_op

GRAD = popart.reservedGradientPrefix()
RNG = np.random.default_rng(0)
ORT, REF = RefData.onnxruntime, RefData.onnx_reference
NUMERIC = RefData.numeric_grads
FD = dict(rtol=5e-6, atol=5e-6)   # numeric gradients: within 1e-5 * max(1, |gradient|)


@pytest.fixture
def op_tester(op_tester):
    op_tester.opsets = {"ai.onnx": 18}
    op_tester.rtol, op_tester.atol = 1e-4, 1e-5
    return op_tester


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def f64(*arrays):
    return [np.asarray(a, np.float64) if a.dtype == np.float32 else a for a in arrays]


# ---------------------------------------------------------------------------------------
# Conv

@pytest.mark.parametrize("attrs,xs,ws", [
    ({}, (1, 2, 5, 5), (3, 2, 3, 3)),
    ({"pads": [1, 0, 2, 1], "strides": [2, 1]}, (2, 2, 6, 5), (4, 2, 3, 2)),
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (1, 2, 6, 7), (2, 2, 3, 3)),
    ({"auto_pad": "SAME_LOWER", "strides": [2, 1]}, (1, 2, 7, 6), (2, 2, 2, 3)),
    ({"dilations": [2, 1], "pads": [1, 2, 1, 0]}, (1, 2, 7, 6), (2, 2, 2, 3)),
    ({"auto_pad": "VALID", "group": 2}, (1, 4, 5, 5), (6, 2, 3, 3)),
    ({"pads": [1, 1]}, (2, 3, 7), (2, 3, 3)),
    ({"strides": [1, 2, 1]}, (1, 2, 4, 5, 4), (2, 2, 2, 2, 2)),
])
def test_conv(op_tester, attrs, xs, ws):
    x, w, b = rnd(*xs), rnd(*ws), rnd(ws[0])
    op_tester.run(one_op("Conv", [x, w, b], **attrs), ORT)
    op_tester.run(one_op("Conv", [x, w], **attrs), ORT, opsets={"ai.onnx": 11})


@pytest.mark.parametrize("attrs,xs,ws", [
    ({}, (1, 2, 4, 4), (2, 3, 3, 3)),
    ({"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 0]}, (1, 2, 3, 4), (2, 3, 3, 3)),
    ({"strides": [2, 3], "dilations": [2, 1]}, (2, 2, 3, 3), (2, 1, 2, 3)),
    ({"group": 2, "strides": [2, 1]}, (1, 4, 3, 3), (4, 3, 2, 2)),
    ({"strides": [2, 2], "output_shape": [9, 9]}, (1, 2, 4, 4), (2, 1, 3, 3)),
])   # PopART's own auto_pad / output_shape rule: tests/test_longtail_ops.py
def test_conv_transpose(op_tester, attrs, xs, ws):
    x, w = rnd(*xs), rnd(*ws)
    b = rnd(ws[1] * attrs.get("group", 1))
    op_tester.run(one_op("ConvTranspose", [x, w, b], **attrs), ORT)


def test_conv_grad(op_tester):
    x, w = f64(rnd(1, 2, 4, 4), rnd(3, 2, 2, 2))
    op_tester.run(one_op("Conv", [x, w], grads=True, pads=[1, 1, 0, 0], strides=[2, 1]), NUMERIC,
                  step_type="train", **FD)
    x, w = f64(rnd(1, 2, 3, 3), rnd(2, 2, 2, 2))
    op_tester.run(one_op("ConvTranspose", [x, w], grads=[1], strides=[2, 2]), NUMERIC,
                  step_type="train", **FD)


@pytest.mark.usefixtures("engine_scope")   # the lowering's own functions, in float64
@pytest.mark.parametrize("xs,ws,strides,pads,dil", [
    ((2, 3, 8, 8), (4, 3, 3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1)),
    ((2, 3, 9, 7), (5, 3, 3, 2), (2, 1), ((1, 0), (0, 2)), (1, 1)),
    ((2, 3, 11, 10), (4, 3, 3, 3), (2, 3), ((2, 1), (1, 1)), (2, 1)),
    ((2, 3, 10), (4, 3, 4), (3,), ((1, 2),), (1,)),
    ((1, 2, 5, 6, 6), (3, 2, 2, 3, 1), (1, 2, 1), ((0, 1), (1, 1), (0, 0)), (1, 1, 2)),
    ((2, 4, 6, 6), (3, 4, 1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1)),
])
def test_conv_patches_matches_xla_conv_and_its_vjp(xs, ws, strides, pads, dil):
    """The CPU's patches-matmul convolution and its hand-written gradient equal XLA's
    convolution and JAX's gradient of it (float64)."""
    from popart.ops.nn import conv_patches
    x, w = jnp.asarray(rnd(*xs, dtype=np.float64)), jnp.asarray(rnd(*ws, dtype=np.float64))

    def ref(x, w):
        return jax.lax.conv_general_dilated(x, w, strides, pads, rhs_dilation=dil,
                                            precision="highest")
    y, vjp = jax.vjp(lambda a, b: conv_patches(a, b, strides, pads, dil), x, w)
    y_ref, vjp_ref = jax.vjp(ref, x, w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = jnp.asarray(rnd(*y.shape, dtype=np.float64))
    for g, g_ref in zip(vjp(dy), vjp_ref(dy)):
        np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-12)


def test_conv_patches_only_where_patch_matrices_fit():
    """Patch matrices (the forward's, and the input gradient's: output gradient dilated by the
    strides) stay under PATCH_BYTES; grouped and transposed convolutions use XLA's."""
    from popart.ops import nn
    x = jax.ShapeDtypeStruct((32, 64, 56, 56), np.float32)                  # 25.7 MB
    w = jax.ShapeDtypeStruct((64, 64, 3, 3), np.float32)
    assert nn._use_patches(x, w, (1, 1), (1, 1), 1)                          # 231 MB
    assert not nn._use_patches(x, jax.ShapeDtypeStruct((128, 64, 3, 3), np.float32),
                               (2, 2), (1, 1), 1)                            # backward 1.8 GB
    assert not nn._use_patches(x, jax.ShapeDtypeStruct((64, 32, 3, 3), np.float32),
                               (1, 1), (1, 1), 2)
    assert not nn._use_patches(x, w, (1, 1), (2, 2), 1)


# ---------------------------------------------------------------------------------------
# Pooling

POOL_CASES = [
    {"kernel_shape": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
    {"kernel_shape": [2, 2], "strides": [1, 1], "auto_pad": "SAME_LOWER"},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 0], "ceil_mode": 1},
]


@pytest.mark.parametrize("attrs", POOL_CASES)
def test_max_pool(op_tester, attrs):
    x = rnd(2, 3, 7, 6)
    op_tester.run(one_op("MaxPool", [x], num_outputs=2, **attrs), ORT)
    op_tester.run(one_op("MaxPool", [x], num_outputs=2, storage_order=1, **attrs), ORT)


def test_max_pool_dilations_1d_3d(op_tester):
    x = rnd(1, 2, 9)
    op_tester.run(one_op("MaxPool", [x], kernel_shape=[2], dilations=[3], strides=[2]), ORT)
    x = rnd(1, 1, 4, 5, 4)
    op_tester.run(one_op("MaxPool", [x], num_outputs=2, kernel_shape=[2, 2, 2]), ORT)


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("cip", [0, 1])
def test_average_pool(op_tester, attrs, cip):
    x = rnd(2, 3, 7, 6)
    op_tester.run(one_op("AveragePool", [x], count_include_pad=cip, **attrs), ORT)


def test_lp_and_global_pools(op_tester):
    x = rnd(2, 3, 5, 4)
    op_tester.run(one_op("LpPool", [x], kernel_shape=[2, 2], p=3, strides=[1, 2]), REF)
    for op in ("GlobalAveragePool", "GlobalMaxPool"):
        op_tester.run(one_op(op, [x]), ORT)
    op_tester.run(one_op("GlobalLpPool", [x], p=2), ORT)


def test_pool_grads(op_tester):
    (x,) = f64(rnd(1, 2, 5, 5))
    op_tester.run(one_op("AveragePool", [x], grads=True, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                  NUMERIC, step_type="train", **FD)
    op_tester.run(one_op("MaxPool", [x], grads=True, kernel_shape=[2, 2]), NUMERIC,
                  step_type="train", **FD)


@pytest.mark.usefixtures("engine_scope")
@pytest.mark.parametrize("shape,k", [((2, 3, 8, 8), (2, 2)), ((2, 3, 9, 7), (2, 3)),
                                     ((2, 3, 10), (3,)), ((1, 2, 4, 6, 6), (2, 2, 3))])
def test_max_pool_tiles_gradient_to_first_maximum(shape, k):
    """Max pools whose windows tile the input avoid select-and-scatter; with ties (rounded
    inputs) the gradient still goes to each window's first maximum, as with XLA's."""
    from popart.ops.nn import max_blocks
    x = jnp.asarray(np.round(rnd(*shape), 1))
    win = (1, 1, *k)

    def ref(v):
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, win, win, "VALID")
    y, vjp = jax.vjp(lambda v: max_blocks(v, k), x)
    y_ref, vjp_ref = jax.vjp(ref, x)
    np.testing.assert_array_equal(y, y_ref)
    dy = jnp.asarray(rnd(*y.shape))
    np.testing.assert_array_equal(vjp(dy)[0], vjp_ref(dy)[0])


def test_max_roi_pool_and_unpool(op_tester):
    x = rnd(1, 2, 6, 6)
    rois = np.array([[0, 0, 0, 3, 3], [0, 1, 2, 5, 4]], np.float32)
    op_tester.run(one_op("MaxRoiPool", [x, rois], pooled_shape=[2, 2]), ORT)
    y, i = op_tester.run(one_op("MaxPool", [x], num_outputs=2, kernel_shape=[2, 2], strides=[2, 2]),
                         ORT)
    op_tester.run(one_op("MaxUnpool", [y, i], kernel_shape=[2, 2], strides=[2, 2]), ORT)


# ---------------------------------------------------------------------------------------
# Normalization

def test_batchnorm_inference_versions(op_tester):
    x = rnd(2, 3, 4, 5)
    s, b, m, v = rnd(3), rnd(3), rnd(3), np.abs(rnd(3)) + 0.5
    for opset in (7, 9, 15):
        op_tester.run(one_op("BatchNormalization", [x, s, b, m, v], epsilon=1e-3), ORT,
                      opsets={"ai.onnx": opset})


def test_batchnorm_training_mode(op_tester):
    x = rnd(4, 3, 2, 2)
    s, b, m, v = rnd(3), rnd(3), rnd(3), np.abs(rnd(3)) + 0.5
    _, running_mean, _ = op_tester.run(
        one_op("BatchNormalization", [x, s, b, m, v], num_outputs=3, training_mode=1, momentum=0.8),
        REF, opsets={"ai.onnx": 15})
    bm = x.mean((0, 2, 3))
    np.testing.assert_allclose(running_mean, m * 0.8 + bm * 0.2, rtol=1e-5)


@pytest.mark.usefixtures("engine_scope")
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_batchnorm_training_vjp(dtype):
    """Training batch norm's hand-written gradient (output, batch mean and variance
    cotangents) equals JAX's gradient of the textbook formula; dtypes are kept."""
    from popart.ops.nn import batch_norm_train
    x, s, b = rnd(4, 3, 5, 6, dtype=dtype), rnd(3, dtype=dtype), rnd(3, dtype=dtype)

    def ref(x, s, b):
        m, v = x.mean((0, 2, 3)), x.var((0, 2, 3))
        y = (x - m[:, None, None]) / jnp.sqrt(v[:, None, None] + 1e-5) * s[:, None, None]
        return y + b[:, None, None], m, v
    outs, vjp = jax.vjp(lambda *a: batch_norm_train(*a, 1e-5), x, s, b)
    refs, vjp_ref = jax.vjp(ref, *(jnp.asarray(a, np.float64) for a in (x, s, b)))
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}[dtype]
    for o, r in zip(outs, refs):
        assert o.dtype == dtype
        np.testing.assert_allclose(np.asarray(o, np.float64), r, rtol=tol, atol=tol)
    cts = tuple(rnd(*o.shape, dtype=dtype) for o in outs)
    for g, r in zip(vjp(cts), vjp_ref(tuple(np.asarray(c, np.float64) for c in cts))):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), r, rtol=10 * tol, atol=10 * tol)


def test_batchnorm_training_session_assigns_running_stats(op_tester):
    """Opset-9 BatchNormalization with all 5 outputs in a TrainingSession: batch statistics
    normalise (and are differentiated through), the running ones are assigned."""
    x = rnd(4, 3, 2, 2).astype(np.float64)
    bm, bv = x.mean((0, 2, 3)), x.var((0, 2, 3))

    def init_builder(builder):
        xi = builder.addInputTensor(x)
        s, b = builder.aiOnnx.constant(np.ones(3)), builder.aiOnnx.constant(np.zeros(3))
        m = builder.addInitializedInputTensor(np.zeros(3))
        v = builder.addInitializedInputTensor(np.ones(3))
        y = builder.aiOnnx.batchnormalization([xi, s, b, m, v], num_outputs=5, momentum=0.9)[0]
        return [y, m, v, GRAD + xi]

    def reference(ref):
        y = (x - bm[:, None, None]) / np.sqrt(bv[:, None, None] + 1e-5)
        return [y, 0.1 * bm, 0.9 + 0.1 * bv, ref.numeric_grad(list(ref.inputs)[0])]

    op_tester.run(init_builder, reference, step_type="train", opsets={"ai.onnx": 9},
                  rtol=1e-6, atol=1e-8)


def test_norms(op_tester):
    x = rnd(2, 4, 3, 3)
    op_tester.run(one_op("InstanceNormalization", [x, rnd(4), rnd(4)], epsilon=1e-3), ORT)
    op_tester.run(one_op("LayerNormalization", [x, rnd(3, 3), rnd(3, 3)], num_outputs=3, axis=-2),
                  ORT, opsets={"ai.onnx": 17})
    op_tester.run(one_op("GroupNormalization", [x, rnd(2), rnd(2)], num_groups=2, epsilon=1e-3),
                  REF)
    op_tester.run(one_op("GroupNormalization", [x, rnd(4), rnd(4)], num_groups=2), ORT,
                  opsets={"ai.onnx": 21})
    op_tester.run(one_op("LRN", [x], size=3, alpha=0.01, beta=0.5, bias=2.0), ORT)
    op_tester.run(one_op("MeanVarianceNormalization", [x]), ORT)
    op_tester.run(one_op("MeanVarianceNormalization", [x], axes=[1, 3]), ORT)
    for p in (1, 2):
        op_tester.run(one_op("LpNormalization", [x], axis=1, p=p), ORT)


def test_norm_grads(op_tester):
    x, s, b = f64(rnd(2, 4, 3), rnd(3), rnd(3))
    op_tester.run(one_op("LayerNormalization", [x, s, b], grads=[0]), NUMERIC, step_type="train",
                  opsets={"ai.onnx": 17}, **FD)
    s, b = f64(rnd(4), rnd(4))
    op_tester.run(one_op("InstanceNormalization", [x, s, b], grads=[0]), NUMERIC,
                  step_type="train", **FD)


# ---------------------------------------------------------------------------------------
# Dropout, softmax

@pytest.mark.parametrize("opset", [7, 10, 13])
def test_dropout_inactive_in_inference(op_tester, opset):
    x = rnd(50, 40)
    _, mask = op_tester.run(one_op("Dropout", [x], num_outputs=2,
                                   **({"ratio": 0.3} if opset < 12 else {})),
                            lambda ref: [x, None], opsets={"ai.onnx": opset}, rtol=0, atol=0)
    assert mask.all() and (mask.dtype == np.bool_) == (opset >= 10)


@pytest.mark.parametrize("opset", [7, 10, 13])
def test_dropout_active_in_training(op_tester, opset):
    x = np.ones((100, 100), np.float32)
    if opset >= 12:
        init_builder = one_op("Dropout", [x, Const(np.array(0.3, np.float32))], num_outputs=2)
    else:
        init_builder = one_op("Dropout", [x], num_outputs=2, ratio=0.3)
    y, mask = op_tester.run(init_builder, None, step_type="train", opsets={"ai.onnx": opset})
    keep = mask.astype(bool)
    assert abs(keep.mean() - 0.7) < 0.03
    np.testing.assert_allclose(y[keep], 1 / 0.7, rtol=1e-6)
    assert (y[~keep] == 0).all() and y.dtype == np.float32


def test_dropout_training_mode_input(op_tester):
    x = np.ones((64, 64), np.float32)
    y, mask = op_tester.run(one_op("Dropout", [x, Const(np.array(0.5, np.float32)),
                                               Const(np.array(True))], num_outputs=2),
                            None, opsets={"ai.onnx": 13})
    assert abs(mask.mean() - 0.5) < 0.05 and set(np.unique(y)) <= {0.0, 2.0}


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset,axis", [(11, None), (11, 2), (11, 0), (13, None), (13, 1)])
def test_softmax_family(op_tester, op, opset, axis):
    x = rnd(2, 3, 4)
    attrs = {} if axis is None else {"axis": axis}
    op_tester.run(one_op(op, [x], **attrs), ORT, opsets={"ai.onnx": opset})


def test_softmax_grad(op_tester):
    (x,) = f64(rnd(2, 5))
    op_tester.run(one_op("LogSoftmax", [x], grads=True), NUMERIC, step_type="train",
                  opsets={"ai.onnx": 13}, **FD)


# ---------------------------------------------------------------------------------------
# Recurrent

def _rnn_inputs(kind, T=4, B=3, I=2, H=3, nd=1, lens=None, peep=False):
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    f = {"x": rnd(T, B, I), "w": rnd(nd, g * H, I), "r": rnd(nd, g * H, H), "b": rnd(nd, 2 * g * H),
         "lens": np.array(lens if lens else [T] * B, np.int32), "h0": rnd(nd, B, H)}
    if kind == "LSTM":
        f["c0"] = rnd(nd, B, H)
        if peep:
            f["p"] = rnd(nd, 3 * H)
    return f


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_rnn_vs_ort(op_tester, kind, direction):
    nd = 2 if direction == "bidirectional" else 1
    f = _rnn_inputs(kind, nd=nd, lens=[4, 2, 3], peep=True)
    extra = {"linear_before_reset": 1} if kind == "GRU" else {}
    n_out = 3 if kind == "LSTM" else 2
    op_tester.run(one_op(kind, list(f.values()), num_outputs=n_out, direction=direction,
                         hidden_size=3, **extra), ORT, opsets={"ai.onnx": 14})


def test_lstm_options(op_tester):
    f = _rnn_inputs("LSTM")
    op_tester.run(one_op("LSTM", list(f.values()), num_outputs=3, hidden_size=3, clip=0.5,
                         input_forget=1), ORT)
    fx = dict(f, x=f["x"].swapaxes(0, 1).copy(), h0=f["h0"].swapaxes(0, 1).copy(),
              c0=f["c0"].swapaxes(0, 1).copy())
    y0, _, yc0 = op_tester.run(one_op("LSTM", list(f.values()), num_outputs=3, hidden_size=3), None,
                               opsets={"ai.onnx": 14})
    op_tester.run(one_op("LSTM", list(fx.values()), num_outputs=3, hidden_size=3, layout=1),
                  lambda ref: [y0.transpose(2, 0, 1, 3), None, yc0.swapaxes(0, 1)],
                  opsets={"ai.onnx": 14}, rtol=1e-6, atol=0)
    g = _rnn_inputs("GRU")
    op_tester.run(one_op("GRU", list(g.values()), num_outputs=2, hidden_size=3,
                         activations=["HardSigmoid", "LeakyRelu"], activation_alpha=[0.3, 0.1],
                         activation_beta=[0.4]), ORT)


def test_lstm_vs_torch_and_grad(op_tester):
    T, B, I, H = 5, 2, 3, 4
    x = rnd(T, B, I)
    lstm = torch.nn.LSTM(I, H)
    wi, wh = lstm.weight_ih_l0.detach().numpy(), lstm.weight_hh_l0.detach().numpy()
    bi, bh = lstm.bias_ih_l0.detach().numpy(), lstm.bias_hh_l0.detach().numpy()
    # ifgo -> iofc
    reorder = lambda a: np.concatenate([a[0:H], a[3 * H:4 * H], a[H:2 * H], a[2 * H:3 * H]])  # noqa: E731
    f = [x, reorder(wi)[None], reorder(wh)[None], np.concatenate([reorder(bi), reorder(bh)])[None]]
    ty, (th, tc) = lstm(torch.from_numpy(x))
    op_tester.run(one_op("LSTM", f, num_outputs=3, hidden_size=H),
                  lambda ref: [ty.detach().numpy()[:, None], None, tc.detach().numpy()])
    op_tester.run(one_op("LSTM", f64(*f), grads=[2], num_outputs=3, hidden_size=H), NUMERIC,
                  step_type="train", **FD)
    g = _rnn_inputs("GRU")
    op_tester.run(one_op("GRU", f64(*g.values()), grads=[0], num_outputs=2, hidden_size=3),
                  NUMERIC, step_type="train", **FD)


def test_gru_vs_torch(op_tester):
    T, B, I, H = 4, 2, 3, 2
    x = rnd(T, B, I)
    gru = torch.nn.GRU(I, H)
    p = lambda t: t.detach().numpy()  # noqa: E731
    reorder = lambda a: np.concatenate([a[H:2 * H], a[0:H], a[2 * H:]])  # noqa: E731 (rzn -> zrh)
    f = [x, reorder(p(gru.weight_ih_l0))[None], reorder(p(gru.weight_hh_l0))[None],
         np.concatenate([reorder(p(gru.bias_ih_l0)), reorder(p(gru.bias_hh_l0))])[None]]
    op_tester.run(one_op("GRU", f, num_outputs=2, hidden_size=H, linear_before_reset=1),
                  lambda ref: [p(gru(torch.from_numpy(x))[0])[:, None], None])


# ---------------------------------------------------------------------------------------
# Image

RESIZE_CASES = [
    ({"mode": "nearest"}, [1, 1, 2, 1.5], None),
    ({"mode": "nearest", "nearest_mode": "floor", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 0.6, 2], None),
    ({"mode": "nearest", "nearest_mode": "round_prefer_ceil", "coordinate_transformation_mode": "align_corners"}, None, [2, 3, 7, 3]),
    ({"mode": "linear"}, [1, 1, 1.7, 0.5], None),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [2, 3, 8, 2]),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, None, [2, 3, 1, 9]),
    ({"mode": "cubic"}, [1, 1, 2, 0.75], None),
    ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, [1, 1, 1.5, 2.5], None),
    ({"mode": "cubic", "coordinate_transformation_mode": "asymmetric"}, None, [2, 3, 3, 6]),
    ({"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, [1, 1, 1.6, 0.7], None),
]


@pytest.mark.parametrize("attrs,scales,sizes", RESIZE_CASES)
@pytest.mark.parametrize("opset", [13, 19])
def test_resize(op_tester, attrs, scales, sizes, opset):
    if opset < 18 and attrs.get("coordinate_transformation_mode") == "half_pixel_symmetric":
        pytest.skip("half_pixel_symmetric is opset 18+")
    x = rnd(2, 3, 5, 4)
    consts = [Const(np.zeros(0, np.float32)), Const(np.array(scales or [], np.float32))]
    if sizes:
        consts.append(Const(np.array(sizes, np.int64)))
    op_tester.run(one_op("Resize", [x] + consts, **attrs), REF, opsets={"ai.onnx": opset})


def test_resize_18_axes_antialias_aspect(op_tester):
    x = rnd(1, 2, 8, 6)
    no_roi, no_scales = Const(np.zeros(0, np.float32)), Const(np.zeros(0, np.float32))
    for inputs, attrs in [
        ([x, no_roi, Const(np.array([0.5, 0.6], np.float32))],
         dict(mode="linear", antialias=1, axes=[2, 3])),
        ([x, no_roi, Const(np.array([1, 1, 0.4, 0.5], np.float32))], dict(mode="cubic", antialias=1)),
        ([x, no_roi, no_scales, Const(np.array([5, 5], np.int64))],
         dict(mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_larger")),
    ]:
        op_tester.run(one_op("Resize", inputs, **attrs), REF)
    roi = np.array([0, 0, 0.1, 0.2, 1, 1, 0.9, 1.1], np.float32)
    op_tester.run(one_op("Resize", [x, Const(roi), no_scales, Const(np.array([1, 2, 5, 7], np.int64))],
                         mode="linear", extrapolation_value=-3.0,
                         coordinate_transformation_mode="tf_crop_and_resize"),
                  REF, opsets={"ai.onnx": 13})


def test_resize_uint8_nearest_and_grad(op_tester):
    x = (np.arange(24).reshape(1, 1, 4, 6) * 10).astype(np.uint8)
    no_roi = Const(np.zeros(0, np.float32))
    op_tester.run(one_op("Resize", [x, no_roi, Const(np.array([1, 1, 2, 0.5], np.float32))],
                         mode="nearest"), ORT, opsets={"ai.onnx": 13})
    (x,) = f64(rnd(1, 1, 3, 3))
    op_tester.run(one_op("Resize", [x, no_roi, Const(np.array([1, 1, 1.5, 2], np.float32))],
                         grads=True, mode="cubic"), NUMERIC, step_type="train",
                  opsets={"ai.onnx": 13}, **FD)


def test_upsample_and_resize10(op_tester):
    x = rnd(1, 2, 3, 4)
    sc = Const(np.array([1, 1, 2, 1.5], np.float32))
    op_tester.run(one_op("Upsample", [x, sc], mode="nearest"), ORT, opsets={"ai.onnx": 9})
    op_tester.run(one_op("Upsample", [x, sc], mode="linear"), ORT, opsets={"ai.onnx": 9})
    op_tester.run(one_op("Upsample", [x], mode="nearest", scales=[1.0, 1.0, 2.0, 3.0]), ORT,
                  opsets={"ai.onnx": 7})
    op_tester.run(one_op("Resize", [x, sc], mode="nearest"), ORT, opsets={"ai.onnx": 10})
    # PopART's Resize-10 linear: half_pixel coordinates (its default), as PyTorch's bilinear
    op_tester.run(one_op("Resize", [x, sc], mode="linear"), lambda ref: [F.interpolate(
        torch.from_numpy(x), scale_factor=(2, 1.5), mode="bilinear", align_corners=False)],
        opsets={"ai.onnx": 10}, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample(op_tester, mode, padding_mode, align):
    x = rnd(2, 2, 4, 5)
    grid = (RNG.uniform(-1.3, 1.3, (2, 3, 4, 2))).astype(np.float32)
    op_tester.run(one_op("GridSample", [x, grid], mode=mode, padding_mode=padding_mode,
                         align_corners=align), REF, opsets={"ai.onnx": 20}, rtol=1e-4, atol=1e-4)


def test_affine_grid_and_roi_align(op_tester):
    theta = rnd(2, 2, 3)
    for align in (0, 1):
        op_tester.run(one_op("AffineGrid", [theta, Const(np.array([2, 3, 4, 5], np.int64))],
                             align_corners=align), REF, opsets={"ai.onnx": 20})
    x = rnd(2, 2, 8, 8)
    rois = np.array([[0, 0, 4, 4], [1, 2, 7, 6], [0.5, 0.5, 3.2, 6.1]], np.float32)
    bi = np.array([0, 1, 1], np.int64)
    for attrs in ({}, {"sampling_ratio": 2, "mode": "avg"}, {"coordinate_transformation_mode": "output_half_pixel"},
                  {"spatial_scale": 0.5, "output_height": 3, "output_width": 2}):
        op_tester.run(one_op("RoiAlign", [x, rois, bi], **attrs), ORT)


# ---------------------------------------------------------------------------------------
# Random

def test_random_ops_dtype_shape_and_moments(op_tester):
    (y,) = op_tester.run(one_op("RandomNormal", [], shape=[200, 50], mean=2.0, scale=0.5,
                                dtype=TensorProto.DOUBLE), None)
    assert y.dtype == np.float64 and y.shape == (200, 50)
    assert abs(y.mean() - 2) < 0.03 and abs(y.std() - 0.5) < 0.03
    (u,) = op_tester.run(one_op("RandomUniform", [], shape=[10000], low=-1.0, high=3.0), None)
    assert u.dtype == np.float32 and u.min() >= -1 and u.max() < 3 and abs(u.mean() - 1) < 0.05
    x = np.zeros((100, 100), np.float16)
    (y,) = op_tester.run(one_op("RandomUniformLike", [x]), None)
    assert y.dtype == np.float16 and 0.45 < y.mean() < 0.55
    (y,) = op_tester.run(one_op("RandomNormalLike", [x], dtype=TensorProto.FLOAT), None)
    assert y.dtype == np.float32 and abs(y.mean()) < 0.05
    p = np.full((100, 100), 0.3, np.float32)
    (b,) = op_tester.run(one_op("Bernoulli", [p]), None)
    assert b.dtype == np.float32 and abs(b.mean() - 0.3) < 0.03 and set(np.unique(b)) <= {0, 1}
    logits = np.log(np.array([[0.1, 0.9], [0.8, 0.2]], np.float32))
    (s,) = op_tester.run(one_op("Multinomial", [logits], sample_size=2000), None)
    assert s.shape == (2, 2000) and s.dtype == np.int32
    np.testing.assert_allclose(s.mean(1), [0.9, 0.2], atol=0.04)


def test_random_seed_attribute_is_deterministic():
    """PopART's sessions refuse an ONNX seed attribute (RandomBaseOp::errorIfSeedIsSet); the
    ONNX backend (ONNX's conformance cases) takes it, the same seed giving the same values."""
    import onnx
    from popart import onnx_backend

    def model(seed):
        g = onnx.helper.make_graph(
            [onnx.helper.make_node("RandomUniform", [], ["r"], shape=[5], seed=seed)], "g", [],
            [onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [5])])
        return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 11)])

    def draw(seed):
        return onnx_backend.prepare(model(seed)).run([])[0]
    with pytest.raises(popart.popart_exception, match="Optional seed attribute is not supported"):
        popart.InferenceSession(model(3.0).SerializeToString(), popart.DataFlow(1, ["r"]),
                                popart.DeviceManager().createCpuDevice())
    a = draw(3.0)
    np.testing.assert_array_equal(a, draw(3.0))
    assert not np.array_equal(a, draw(4.0))


# ---------------------------------------------------------------------------------------
# Volumetric GridSample, LpNormalization of zero slices, MaxUnpool with output_shape

@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_volumetric_session(op_tester, mode, padding_mode, align):
    """5-D GridSample (x, y, z grid coordinates) against ONNX's reference evaluator."""
    x, grid = rnd(2, 2, 3, 4, 5), RNG.uniform(-1.3, 1.3, (2, 2, 3, 4, 3)).astype(np.float32)
    (got,) = op_tester.run(one_op("GridSample", [x, grid], mode=mode, padding_mode=padding_mode,
                                  align_corners=align), REF, opsets={"ai.onnx": 22},
                           rtol=1e-4, atol=1e-4)
    assert got.shape == (2, 2, 2, 3, 4) and got.dtype == np.float32


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_volumetric_grads_vs_torch(op_tester, mode, padding_mode, align):
    """Values and gradients (w.r.t. the input and the grid) of 5-D GridSample equal PyTorch's."""
    x, grid = rnd(2, 2, 3, 4, 5), RNG.uniform(-1.3, 1.3, (2, 2, 3, 4, 3)).astype(np.float32)

    def reference(ref):
        xt, gt = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, grid))
        yt = F.grid_sample(xt, gt, mode="bilinear" if mode == "linear" else mode,
                           padding_mode=padding_mode, align_corners=bool(align))
        yt.backward(torch.from_numpy(ref.getOutputTensorGrad(0)))
        return [yt, xt.grad, gt.grad]

    op_tester.run(one_op("GridSample", f64(x, grid), grads=True, mode=mode,
                         padding_mode=padding_mode, align_corners=align),
                  reference, step_type="train", opsets={"ai.onnx": 20}, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample_volumetric_cubic_grads(op_tester, padding_mode):
    x, grid = rnd(1, 2, 3, 4, 4), RNG.uniform(-1.2, 1.2, (1, 2, 2, 3, 3)).astype(np.float32)
    op_tester.run(one_op("GridSample", f64(x, grid), grads=True, mode="cubic",
                         padding_mode=padding_mode), NUMERIC, step_type="train",
                  opsets={"ai.onnx": 20}, **FD)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference's 0 / 0
@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_zero_slice(op_tester, p):
    """Slices of norm 0 give 0 (as ONNX's reference) with a finite gradient; the others the
    plain x / |x|_p and its gradient."""
    x = rnd(3, 4)
    x[1] = 0
    nrm = np.linalg.norm(x, ord=p, axis=1, keepdims=True)
    exp = np.divide(x, nrm, out=np.zeros_like(x), where=nrm > 0)
    op_tester.run(one_op("LpNormalization", [x], axis=1, p=p),
                  (lambda ref: [exp]) if p == 1 else REF, rtol=1e-6, atol=0)
    rows = [0, 2]

    def reference(ref):
        xt = torch.tensor(x[rows], dtype=torch.float64, requires_grad=True)
        yt = xt / torch.linalg.vector_norm(xt, ord=p, dim=1, keepdim=True)
        yt.backward(torch.from_numpy(ref.getOutputTensorGrad(0)[rows]))
        y, g = np.zeros((3, 4)), np.zeros((3, 4))
        y[rows], g[rows] = yt.detach().numpy(), xt.grad.numpy()
        return [y, g]

    _, g = op_tester.run(one_op("LpNormalization", f64(x), grads=True, axis=1, p=p), reference,
                         step_type="train", rtol=1e-10, atol=0)
    assert np.isfinite(g).all() and not g[1].any()


def test_max_unpool_output_shape(op_tester):
    """MaxPool of an odd-sized input, then MaxUnpool to its shape: the indices address
    output_shape (onnxruntime and PyTorch), so every maximum goes back in place."""
    x = rnd(2, 3, 5, 7)
    y, i = op_tester.run(one_op("MaxPool", [x], num_outputs=2, kernel_shape=[2, 2], strides=[2, 2]),
                         ORT)
    pooled = torch.nn.functional.max_pool2d(torch.tensor(x), 2, 2, return_indices=True)
    exp = torch.nn.functional.max_unpool2d(*pooled, 2, 2, output_size=x.shape[2:]).numpy()
    (got,) = op_tester.run(one_op("MaxUnpool", [y, i, Const(np.array(x.shape, np.int64))],
                                  kernel_shape=[2, 2], strides=[2, 2]), ORT, rtol=0, atol=0)
    np.testing.assert_array_equal(got, exp)
    assert np.count_nonzero(got) == y.size and set(got[got != 0]) == set(y.ravel())
    with pytest.raises(Exception, match=r"output_shape must be \(N, C, \*spatial\) with N, C = "
                                        r"\(2, 3\) of input 'X', got \(2, 4, 5, 7\)"):
        op_tester.run(one_op("MaxUnpool", [y, i, Const(np.array([2, 4, 5, 7], np.int64))],
                             kernel_shape=[2, 2], strides=[2, 2]), None)
