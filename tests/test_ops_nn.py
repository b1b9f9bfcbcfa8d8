"""ai.onnx nn / rnn / image ops against onnxruntime and the ONNX reference evaluator."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import jax
import jax.numpy as jnp

from popart.engine.lower import TraceState, execute
from popart.engine.shapes import run_model
from popart.ir.onnx_import import import_model

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def one_node(op, inputs, n_out=1, opset=18, domain="", consts=None, **attrs):
    """A one-node model; ``inputs`` maps name -> array ('' skips an optional input);
    ``consts`` become initializers."""
    consts = consts or {}
    names = list(inputs) + list(consts)
    order = attrs.pop("_order", None) or names
    node = helper.make_node(op, order, [f"y{i}" for i in range(n_out)], domain=domain, **attrs)
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in inputs.items() if k],
        [onnx.ValueInfoProto(name=f"y{i}") for i in range(n_out)],
        [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def ours(model, feeds, training=False):
    out = run_model(model, {k: v for k, v in feeds.items() if k}, training=training)
    return [out[o.name] for o in model.graph.output]


def check(model, feeds, ref="ort", rtol=1e-4, atol=1e-5, n=None):
    feeds = {k: v for k, v in feeds.items() if k}
    got = ours(model, feeds)
    if ref == "ort":
        exp = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, feeds)
    else:
        exp = ReferenceEvaluator(model).run(None, feeds)
    for g, e in list(zip(got, exp))[:n]:
        assert g.shape == np.shape(e) and g.dtype == np.asarray(e).dtype, (g.shape, np.shape(e), g.dtype)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    return got


def fd_grad_check(model, feeds, wrt, eps=1e-6, tol=1e-5):
    """Central-difference gradient of sum(output0 * w) vs jax.grad, in float64."""
    graph, _ = import_model(model)
    feeds = {k: np.asarray(v, np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    out0 = model.graph.output[0].name
    x0 = feeds[wrt]
    w = np.random.default_rng(1).standard_normal(
        np.shape(execute(graph, feeds, TraceState())[out0]))

    @jax.jit
    def f(x):
        env = execute(graph, {**feeds, wrt: x}, TraceState(rng_key=jax.random.key(0)))
        return jnp.sum(env[out0] * w)
    g = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(x0)))
    flat = x0.reshape(-1)
    for i in np.random.default_rng(2).choice(flat.size, min(flat.size, 6), replace=False):
        d = np.zeros_like(flat); d[i] = eps
        num = (float(f(jnp.asarray((flat + d).reshape(x0.shape)))) -
               float(f(jnp.asarray((flat - d).reshape(x0.shape))))) / (2 * eps)
        assert abs(num - g.reshape(-1)[i]) < tol * max(1, abs(num)), (i, num, g.reshape(-1)[i])


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
def test_conv(attrs, xs, ws):
    x, w, b = rnd(*xs), rnd(*ws), rnd(ws[0])
    check(one_node("Conv", {"x": x, "w": w, "b": b}, **attrs), {"x": x, "w": w, "b": b})
    check(one_node("Conv", {"x": x, "w": w}, opset=11, **attrs), {"x": x, "w": w})


@pytest.mark.parametrize("attrs,xs,ws", [
    ({}, (1, 2, 4, 4), (2, 3, 3, 3)),
    ({"strides": [2, 2], "pads": [1, 0, 1, 1], "output_padding": [1, 0]}, (1, 2, 3, 4), (2, 3, 3, 3)),
    ({"strides": [2, 3], "dilations": [2, 1]}, (2, 2, 3, 3), (2, 1, 2, 3)),
    ({"group": 2, "strides": [2, 1]}, (1, 4, 3, 3), (4, 3, 2, 2)),
    ({"strides": [2, 2], "output_shape": [9, 8]}, (1, 2, 4, 4), (2, 1, 3, 3)),
    ({"strides": [2], "auto_pad": "SAME_UPPER"}, (1, 2, 5), (2, 2, 3)),
])
def test_conv_transpose(attrs, xs, ws):
    x, w = rnd(*xs), rnd(*ws)
    b = rnd(ws[1] * attrs.get("group", 1))
    check(one_node("ConvTranspose", {"x": x, "w": w, "b": b}, **attrs), {"x": x, "w": w, "b": b})


def test_conv_grad():
    x, w = rnd(1, 2, 4, 4), rnd(3, 2, 2, 2)
    m = one_node("Conv", {"x": x, "w": w}, pads=[1, 1, 0, 0], strides=[2, 1])
    fd_grad_check(m, {"x": x, "w": w}, "x")
    fd_grad_check(m, {"x": x, "w": w}, "w")
    x, w = rnd(1, 2, 3, 3), rnd(2, 2, 2, 2)
    fd_grad_check(one_node("ConvTranspose", {"x": x, "w": w}, strides=[2, 2]), {"x": x, "w": w}, "w")


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
def test_max_pool(attrs):
    x = rnd(2, 3, 7, 6)
    check(one_node("MaxPool", {"x": x}, n_out=2, **attrs), {"x": x})
    check(one_node("MaxPool", {"x": x}, n_out=2, storage_order=1, **attrs), {"x": x})


def test_max_pool_dilations_1d_3d():
    x = rnd(1, 2, 9)
    check(one_node("MaxPool", {"x": x}, kernel_shape=[2], dilations=[3], strides=[2]), {"x": x})
    x = rnd(1, 1, 4, 5, 4)
    check(one_node("MaxPool", {"x": x}, n_out=2, kernel_shape=[2, 2, 2]), {"x": x})


@pytest.mark.parametrize("attrs", POOL_CASES)
@pytest.mark.parametrize("cip", [0, 1])
def test_average_pool(attrs, cip):
    x = rnd(2, 3, 7, 6)
    check(one_node("AveragePool", {"x": x}, count_include_pad=cip, **attrs), {"x": x})


def test_lp_and_global_pools():
    x = rnd(2, 3, 5, 4)
    check(one_node("LpPool", {"x": x}, kernel_shape=[2, 2], p=3, strides=[1, 2]), {"x": x}, ref="ref")
    for op in ("GlobalAveragePool", "GlobalMaxPool"):
        check(one_node(op, {"x": x}), {"x": x})
    check(one_node("GlobalLpPool", {"x": x}, p=2), {"x": x})


def test_pool_grads():
    x = rnd(1, 2, 5, 5)
    fd_grad_check(one_node("AveragePool", {"x": x}, kernel_shape=[3, 3], pads=[1, 1, 1, 1]), {"x": x}, "x")
    fd_grad_check(one_node("MaxPool", {"x": x}, kernel_shape=[2, 2]), {"x": x}, "x")


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


def test_max_roi_pool_and_unpool():
    x = rnd(1, 2, 6, 6)
    rois = np.array([[0, 0, 0, 3, 3], [0, 1, 2, 5, 4]], np.float32)
    check(one_node("MaxRoiPool", {"x": x, "rois": rois}, pooled_shape=[2, 2]), {"x": x, "rois": rois})
    y, i = ours(one_node("MaxPool", {"x": x}, n_out=2, kernel_shape=[2, 2], strides=[2, 2]), {"x": x})
    m = one_node("MaxUnpool", {"y": y, "i": i}, kernel_shape=[2, 2], strides=[2, 2])
    check(m, {"y": y, "i": i})


# ---------------------------------------------------------------------------------------
# Normalization

def test_batchnorm_inference_versions():
    x = rnd(2, 3, 4, 5)
    s, b, m, v = rnd(3), rnd(3), rnd(3), np.abs(rnd(3)) + 0.5
    for opset in (7, 9, 15):
        check(one_node("BatchNormalization", {"x": x, "s": s, "b": b, "m": m, "v": v},
                       opset=opset, epsilon=1e-3), {"x": x, "s": s, "b": b, "m": m, "v": v})


def test_batchnorm_training_mode():
    x = rnd(4, 3, 2, 2)
    s, b, m, v = rnd(3), rnd(3), rnd(3), np.abs(rnd(3)) + 0.5
    feeds = {"x": x, "s": s, "b": b, "m": m, "v": v}
    model = one_node("BatchNormalization", feeds, n_out=3, opset=15, training_mode=1, momentum=0.8)
    got = check(model, feeds, ref="ref")
    bm = x.mean((0, 2, 3))
    np.testing.assert_allclose(got[1], m * 0.8 + bm * 0.2, rtol=1e-5)


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


def test_batchnorm_training_session_assigns_running_stats():
    x = rnd(4, 3, 2, 2).astype(np.float64)
    s, b, m, v = np.ones(3), np.zeros(3), np.zeros(3), np.ones(3)
    model = one_node("BatchNormalization", {"x": x}, n_out=5, opset=9, momentum=0.9,
                     consts={"s": s, "b": b, "m": m, "v": v})
    graph, _ = import_model(model)
    st = TraceState(training=True)
    env = execute(graph, {"x": x}, st)
    bm, bv = x.mean((0, 2, 3)), x.var((0, 2, 3))
    np.testing.assert_allclose(env["y0"], (x - bm[:, None, None]) / np.sqrt(bv[:, None, None] + 1e-5),
                               rtol=1e-6)
    np.testing.assert_allclose(st.assignments["m"], 0.1 * bm, rtol=1e-6)
    np.testing.assert_allclose(st.assignments["v"], 0.9 + 0.1 * bv, rtol=1e-6)
    assert env["y0"].dtype == np.float64
    fd_grad_check(model, {"x": x}, "x")  # batch statistics are differentiated through


def test_norms():
    x = rnd(2, 4, 3, 3)
    s, b = rnd(4), rnd(4)
    check(one_node("InstanceNormalization", {"x": x, "s": s, "b": b}, epsilon=1e-3), {"x": x, "s": s, "b": b})
    g = {"x": x, "s": rnd(3, 3), "b": rnd(3, 3)}
    check(one_node("LayerNormalization", g, n_out=3, opset=17, axis=-2), g)
    g = {"x": x, "s": rnd(2), "b": rnd(2)}
    check(one_node("GroupNormalization", g, opset=18, num_groups=2, epsilon=1e-3), g, ref="ref")
    g = {"x": x, "s": rnd(4), "b": rnd(4)}
    check(one_node("GroupNormalization", g, opset=21, num_groups=2), g)
    check(one_node("LRN", {"x": x}, size=3, alpha=0.01, beta=0.5, bias=2.0), {"x": x})
    check(one_node("MeanVarianceNormalization", {"x": x}), {"x": x})
    check(one_node("MeanVarianceNormalization", {"x": x}, axes=[1, 3]), {"x": x})
    for p in (1, 2):
        check(one_node("LpNormalization", {"x": x}, axis=1, p=p), {"x": x})


def test_norm_grads():
    x = rnd(2, 4, 3)
    s, b = rnd(3), rnd(3)
    fd_grad_check(one_node("LayerNormalization", {"x": x, "s": s, "b": b}, opset=17), {"x": x, "s": s, "b": b}, "x")
    fd_grad_check(one_node("InstanceNormalization", {"x": x, "s": rnd(4), "b": rnd(4)}),
                  {"x": x, "s": rnd(4), "b": rnd(4)}, "x")


# ---------------------------------------------------------------------------------------
# Dropout, softmax

@pytest.mark.parametrize("opset", [7, 10, 13])
def test_dropout_inactive_in_inference(opset):
    x = rnd(50, 40)
    model = one_node("Dropout", {"x": x}, n_out=2, opset=opset, **({"ratio": 0.3} if opset < 12 else {}))
    y, mask = ours(model, {"x": x})
    np.testing.assert_array_equal(y, x)
    assert mask.all() and (mask.dtype == np.bool_) == (opset >= 10)


@pytest.mark.parametrize("opset", [7, 10, 13])
def test_dropout_active_in_training(opset):
    x = np.ones((100, 100), np.float32)
    if opset >= 12:
        model = one_node("Dropout", {"x": x}, n_out=2, opset=opset,
                         consts={"r": np.array(0.3, np.float32)})
    else:
        model = one_node("Dropout", {"x": x}, n_out=2, opset=opset, ratio=0.3)
    y, mask = ours(model, {"x": x}, training=True)
    keep = mask.astype(bool)
    assert abs(keep.mean() - 0.7) < 0.03
    np.testing.assert_allclose(y[keep], 1 / 0.7, rtol=1e-6)
    assert (y[~keep] == 0).all() and y.dtype == np.float32


def test_dropout_training_mode_input():
    x = np.ones((64, 64), np.float32)
    model = one_node("Dropout", {"x": x}, n_out=2, opset=13,
                     consts={"r": np.array(0.5, np.float32), "t": np.array(True)})
    y, mask = ours(model, {"x": x})
    assert abs(mask.mean() - 0.5) < 0.05 and set(np.unique(y)) <= {0.0, 2.0}


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset,axis", [(11, None), (11, 2), (11, 0), (13, None), (13, 1)])
def test_softmax_family(op, opset, axis):
    x = rnd(2, 3, 4)
    attrs = {} if axis is None else {"axis": axis}
    check(one_node(op, {"x": x}, opset=opset, **attrs), {"x": x})


def test_softmax_grad():
    x = rnd(2, 5)
    fd_grad_check(one_node("LogSoftmax", {"x": x}, opset=13), {"x": x}, "x")


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
def test_rnn_vs_ort(kind, direction):
    nd = 2 if direction == "bidirectional" else 1
    f = _rnn_inputs(kind, nd=nd, lens=[4, 2, 3], peep=True)
    extra = {"linear_before_reset": 1} if kind == "GRU" else {}
    n_out = 3 if kind == "LSTM" else 2
    check(one_node(kind, f, n_out=n_out, direction=direction, hidden_size=3, opset=14, **extra), f)


def test_lstm_options():
    f = _rnn_inputs("LSTM")
    check(one_node("LSTM", f, n_out=3, hidden_size=3, clip=0.5, input_forget=1), f)
    fx = dict(f, x=f["x"].swapaxes(0, 1).copy(), h0=f["h0"].swapaxes(0, 1).copy(),
              c0=f["c0"].swapaxes(0, 1).copy())
    y, yh, yc = ours(one_node("LSTM", fx, n_out=3, hidden_size=3, layout=1, opset=14), fx)
    y0, yh0, yc0 = ours(one_node("LSTM", f, n_out=3, hidden_size=3, opset=14), f)
    np.testing.assert_allclose(y, y0.transpose(2, 0, 1, 3), rtol=1e-6)
    np.testing.assert_allclose(yc, yc0.swapaxes(0, 1), rtol=1e-6)
    g = _rnn_inputs("GRU")
    check(one_node("GRU", g, n_out=2, hidden_size=3,
                   activations=["HardSigmoid", "LeakyRelu"], activation_alpha=[0.3, 0.1],
                   activation_beta=[0.4]), g)


def test_lstm_vs_torch_and_grad():
    T, B, I, H = 5, 2, 3, 4
    x = rnd(T, B, I)
    lstm = torch.nn.LSTM(I, H)
    wi, wh = lstm.weight_ih_l0.detach().numpy(), lstm.weight_hh_l0.detach().numpy()
    bi, bh = lstm.bias_ih_l0.detach().numpy(), lstm.bias_hh_l0.detach().numpy()
    reorder = lambda a: np.concatenate([a[0:H], a[3 * H:4 * H], a[H:2 * H], a[2 * H:3 * H]])  # ifgo -> iofc
    f = {"x": x, "w": reorder(wi)[None], "r": reorder(wh)[None],
         "b": np.concatenate([reorder(bi), reorder(bh)])[None]}
    y, yh, yc = ours(one_node("LSTM", f, n_out=3, hidden_size=H), f)
    ty, (th, tc) = lstm(torch.from_numpy(x))
    np.testing.assert_allclose(y[:, 0], ty.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(yc[0], tc[0].detach().numpy(), rtol=1e-4, atol=1e-5)
    fd_grad_check(one_node("LSTM", f, n_out=3, hidden_size=H), f, "r")
    g = _rnn_inputs("GRU")
    fd_grad_check(one_node("GRU", g, n_out=2, hidden_size=3), g, "x")


def test_gru_vs_torch():
    T, B, I, H = 4, 2, 3, 2
    x = rnd(T, B, I)
    gru = torch.nn.GRU(I, H)
    p = lambda t: t.detach().numpy()
    reorder = lambda a: np.concatenate([a[H:2 * H], a[0:H], a[2 * H:]])  # rzn -> zrh
    f = {"x": x, "w": reorder(p(gru.weight_ih_l0))[None], "r": reorder(p(gru.weight_hh_l0))[None],
         "b": np.concatenate([reorder(p(gru.bias_ih_l0)), reorder(p(gru.bias_hh_l0))])[None]}
    y, yh = ours(one_node("GRU", f, n_out=2, hidden_size=H, linear_before_reset=1), f)
    np.testing.assert_allclose(y[:, 0], p(gru(torch.from_numpy(x))[0]), rtol=1e-4, atol=1e-5)


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
def test_resize(attrs, scales, sizes, opset):
    if opset < 18 and attrs.get("coordinate_transformation_mode") == "half_pixel_symmetric":
        pytest.skip("half_pixel_symmetric is opset 18+")
    x = rnd(2, 3, 5, 4)
    consts = {"roi": np.zeros(0, np.float32),
              "scales": np.array(scales or [], np.float32)}
    if sizes:
        consts["sizes"] = np.array(sizes, np.int64)
    m = one_node("Resize", {"x": x}, opset=opset, consts=consts, **attrs)
    check(m, {"x": x}, ref="ref", rtol=1e-4, atol=1e-5)


def test_resize_18_axes_antialias_aspect():
    x = rnd(1, 2, 8, 6)
    m = one_node("Resize", {"x": x}, opset=18, mode="linear", antialias=1, axes=[2, 3],
                 consts={"roi": np.zeros(0, np.float32), "scales": np.array([0.5, 0.6], np.float32)})
    check(m, {"x": x}, ref="ref")
    m = one_node("Resize", {"x": x}, opset=18, mode="cubic", antialias=1,
                 consts={"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 0.4, 0.5], np.float32)})
    check(m, {"x": x}, ref="ref")
    m = one_node("Resize", {"x": x}, opset=18, mode="nearest", axes=[2, 3],
                 keep_aspect_ratio_policy="not_larger",
                 consts={"roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32),
                         "sizes": np.array([5, 5], np.int64)})
    check(m, {"x": x}, ref="ref")
    roi = np.array([0, 0, 0.1, 0.2, 1, 1, 0.9, 1.1], np.float32)
    m = one_node("Resize", {"x": x}, opset=13, mode="linear", extrapolation_value=-3.0,
                 coordinate_transformation_mode="tf_crop_and_resize",
                 consts={"roi": roi, "scales": np.zeros(0, np.float32), "sizes": np.array([1, 2, 5, 7], np.int64)})
    check(m, {"x": x}, ref="ref")


def test_resize_uint8_nearest_and_grad():
    x = (np.arange(24).reshape(1, 1, 4, 6) * 10).astype(np.uint8)
    m = one_node("Resize", {"x": x}, opset=13, mode="nearest",
                 consts={"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 0.5], np.float32)})
    check(m, {"x": x})
    x = rnd(1, 1, 3, 3)
    fd_grad_check(one_node("Resize", {"x": x}, opset=13, mode="cubic",
                           consts={"roi": np.zeros(0, np.float32),
                                   "scales": np.array([1, 1, 1.5, 2], np.float32)}), {"x": x}, "x")


def test_upsample_and_resize10():
    x = rnd(1, 2, 3, 4)
    sc = np.array([1, 1, 2, 1.5], np.float32)
    check(one_node("Upsample", {"x": x}, opset=9, mode="nearest", consts={"s": sc}), {"x": x})
    check(one_node("Upsample", {"x": x}, opset=9, mode="linear", consts={"s": sc}), {"x": x})
    check(one_node("Upsample", {"x": x}, opset=7, mode="nearest", scales=[1.0, 1.0, 2.0, 3.0]), {"x": x})
    check(one_node("Resize", {"x": x}, opset=10, mode="nearest", consts={"s": sc}), {"x": x})
    check(one_node("Resize", {"x": x}, opset=10, mode="linear", consts={"s": sc}), {"x": x})


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample(mode, padding_mode, align):
    x = rnd(2, 2, 4, 5)
    grid = (RNG.uniform(-1.3, 1.3, (2, 3, 4, 2))).astype(np.float32)
    check(one_node("GridSample", {"x": x, "g": grid}, opset=20, mode=mode, padding_mode=padding_mode,
                   align_corners=align), {"x": x, "g": grid}, ref="ref", rtol=1e-4, atol=1e-4)


def test_affine_grid_and_roi_align():
    theta = rnd(2, 2, 3)
    for align in (0, 1):
        check(one_node("AffineGrid", {"t": theta}, opset=20, align_corners=align,
                       consts={"size": np.array([2, 3, 4, 5], np.int64)}), {"t": theta}, ref="ref")
    x = rnd(2, 2, 8, 8)
    rois = np.array([[0, 0, 4, 4], [1, 2, 7, 6], [0.5, 0.5, 3.2, 6.1]], np.float32)
    bi = np.array([0, 1, 1], np.int64)
    for attrs in ({}, {"sampling_ratio": 2, "mode": "avg"}, {"coordinate_transformation_mode": "output_half_pixel"},
                  {"spatial_scale": 0.5, "output_height": 3, "output_width": 2}):
        check(one_node("RoiAlign", {"x": x, "rois": rois, "bi": bi}, **attrs), {"x": x, "rois": rois, "bi": bi})


# ---------------------------------------------------------------------------------------
# Random

def test_random_ops_dtype_shape_and_moments():
    n = one_node("RandomNormal", {}, shape=[200, 50], mean=2.0, scale=0.5, dtype=TensorProto.DOUBLE)
    y = ours(n, {})[0]
    assert y.dtype == np.float64 and y.shape == (200, 50)
    assert abs(y.mean() - 2) < 0.03 and abs(y.std() - 0.5) < 0.03
    u = ours(one_node("RandomUniform", {}, shape=[10000], low=-1.0, high=3.0), {})[0]
    assert u.dtype == np.float32 and u.min() >= -1 and u.max() < 3 and abs(u.mean() - 1) < 0.05
    x = np.zeros((100, 100), np.float16)
    y = ours(one_node("RandomUniformLike", {"x": x}), {"x": x})[0]
    assert y.dtype == np.float16 and 0.45 < y.mean() < 0.55
    y = ours(one_node("RandomNormalLike", {"x": x}, dtype=TensorProto.FLOAT), {"x": x})[0]
    assert y.dtype == np.float32 and abs(y.mean()) < 0.05
    p = np.full((100, 100), 0.3, np.float32)
    b = ours(one_node("Bernoulli", {"p": p}), {"p": p})[0]
    assert b.dtype == np.float32 and abs(b.mean() - 0.3) < 0.03 and set(np.unique(b)) <= {0, 1}
    logits = np.log(np.array([[0.1, 0.9], [0.8, 0.2]], np.float32))
    s = ours(one_node("Multinomial", {"l": logits}, sample_size=2000), {"l": logits})[0]
    assert s.shape == (2, 2000) and s.dtype == np.int32
    np.testing.assert_allclose(s.mean(1), [0.9, 0.2], atol=0.04)


def test_random_seed_attribute_is_deterministic():
    m = one_node("RandomUniform", {}, shape=[5], seed=3.0)
    a = run_model(m, {}, seed=0)["y0"]
    np.testing.assert_array_equal(a, run_model(m, {}, seed=0)["y0"])
    assert not np.array_equal(a, run_model(one_node("RandomUniform", {}, shape=[5], seed=4.0), {}, seed=0)["y0"])


# ---------------------------------------------------------------------------------------
# Volumetric GridSample, LpNormalization of zero slices, MaxUnpool with output_shape

def _grads(model, feeds, w):
    """Our gradients of sum(output0 * w) w.r.t. every input (float64 where float32)."""
    graph, _ = import_model(model)
    vals = [np.asarray(v, np.float64) if v.dtype == np.float32 else v for v in feeds.values()]

    def f(*args):
        return jnp.sum(execute(graph, dict(zip(feeds, args)), TraceState())["y0"] * w)
    return [np.asarray(g) for g in jax.grad(f, tuple(range(len(vals))))(*vals)]


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_volumetric_session(mode, padding_mode, align):
    """5-D GridSample (x, y, z grid coordinates) in a Builder model run by an
    InferenceSession, against ONNX's reference evaluator."""
    from one_op import build, run_session
    x, grid = rnd(2, 2, 3, 4, 5), RNG.uniform(-1.3, 1.3, (2, 2, 3, 4, 3)).astype(np.float32)
    proto, feeds, outs = build("GridSample", [x, grid], opset=22, mode=mode,
                               padding_mode=padding_mode, align_corners=align)
    (got,) = run_session(proto, feeds, outs)
    (exp,) = ReferenceEvaluator(proto).run(None, feeds)
    assert got.shape == (2, 2, 2, 3, 4) and got.dtype == np.float32
    np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [0, 1])
def test_grid_sample_volumetric_grads_vs_torch(mode, padding_mode, align):
    """Values and gradients (w.r.t. the input and the grid) of 5-D GridSample equal PyTorch's."""
    x, grid = rnd(2, 2, 3, 4, 5), RNG.uniform(-1.3, 1.3, (2, 2, 3, 4, 3)).astype(np.float32)
    model = one_node("GridSample", {"x": x, "g": grid}, opset=20, mode=mode,
                     padding_mode=padding_mode, align_corners=align)
    w = rnd(2, 2, 2, 3, 4)
    xt, gt = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x, grid))
    yt = F.grid_sample(xt, gt, mode="bilinear" if mode == "linear" else mode,
                       padding_mode=padding_mode, align_corners=bool(align))
    (yt * torch.tensor(w, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(ours(model, {"x": x, "g": grid})[0], yt.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    for g, t in zip(_grads(model, {"x": x, "g": grid}, w), (xt.grad, gt.grad)):
        np.testing.assert_allclose(g, t.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_grid_sample_volumetric_cubic_grads(padding_mode):
    x, grid = rnd(1, 2, 3, 4, 4), RNG.uniform(-1.2, 1.2, (1, 2, 2, 3, 3)).astype(np.float32)
    model = one_node("GridSample", {"x": x, "g": grid}, opset=20, mode="cubic", padding_mode=padding_mode)
    for wrt in ("x", "g"):
        fd_grad_check(model, {"x": x, "g": grid}, wrt)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference's 0 / 0
@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_zero_slice(p):
    """Slices of norm 0 give 0 (as ONNX's reference) with a finite gradient; the others the
    plain x / |x|_p and its gradient."""
    x = rnd(3, 4)
    x[1] = 0
    model = one_node("LpNormalization", {"x": x}, axis=1, p=p)
    nrm = np.linalg.norm(x, ord=p, axis=1, keepdims=True)
    (y,) = check(model, {"x": x}, ref="ref") if p == 2 else ours(model, {"x": x})
    np.testing.assert_allclose(y, np.divide(x, nrm, out=np.zeros_like(x), where=nrm > 0), rtol=1e-6)
    w = rnd(3, 4).astype(np.float64)
    (g,) = _grads(model, {"x": x}, w)
    rows = [0, 2]
    exp = jax.grad(lambda v: jnp.sum(v / jnp.linalg.norm(v, ord=p, axis=1, keepdims=True) * w[rows]))(
        jnp.asarray(x[rows], jnp.float64))
    assert np.isfinite(g).all() and not g[1].any()
    np.testing.assert_allclose(g[rows], exp, rtol=1e-10)


def test_max_unpool_output_shape():
    """MaxPool of an odd-sized input, then MaxUnpool to its shape: the indices address
    output_shape (onnxruntime and PyTorch), so every maximum goes back in place."""
    x = rnd(2, 3, 5, 7)
    y, i = ours(one_node("MaxPool", {"x": x}, n_out=2, kernel_shape=[2, 2], strides=[2, 2]), {"x": x})
    m = one_node("MaxUnpool", {"y": y, "i": i}, kernel_shape=[2, 2], strides=[2, 2],
                 consts={"s": np.array(x.shape, np.int64)})
    (got,) = check(m, {"y": y, "i": i}, ref="ort", rtol=0, atol=0)
    pooled = torch.nn.functional.max_pool2d(torch.tensor(x), 2, 2, return_indices=True)
    exp = torch.nn.functional.max_unpool2d(*pooled, 2, 2, output_size=x.shape[2:]).numpy()
    np.testing.assert_array_equal(got, exp)
    assert np.count_nonzero(got) == y.size and set(got[got != 0]) == set(y.ravel())
    m = one_node("MaxUnpool", {"y": y, "i": i}, kernel_shape=[2, 2], strides=[2, 2],
                 consts={"s": np.array([2, 4, 5, 7], np.int64)})
    with pytest.raises(Exception, match=r"output_shape must be \(N, C, \*spatial\) with N, C = "
                                        r"\(2, 3\) of input 'X', got \(2, 4, 5, 7\)"):
        ours(m, {"y": y, "i": i})
