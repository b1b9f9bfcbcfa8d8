"""ai.onnx nn / rnn / image ops against onnxruntime and the ONNX reference evaluator."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import jax
import jax.numpy as jnp

from popart.engine.lower import TraceState, execute
from popart.engine.shapes import run_model
from popart.ir.onnx_import import import_model

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
    w = None

    def f(x):
        env = execute(graph, {**feeds, wrt: x}, TraceState(rng_key=jax.random.key(0)))
        return jnp.sum(env[out0] * w)
    x0 = feeds[wrt]
    w = np.random.default_rng(1).standard_normal(
        np.shape(execute(graph, feeds, TraceState())[out0]))
    g = np.asarray(jax.grad(f)(jnp.asarray(x0)))
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
    fd_grad_check(model, {"x": x}, "x") if False else None


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
