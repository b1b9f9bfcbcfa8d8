"""Gradients of reductions, normalizations, ScatterReduce and CTC are PopART's grad ops' rules
(docs/_rows_nn.md): ReduceMax / Min and ScatterReduce Max / Min give every tie the whole
gradient, norms differentiate only their y output with the forward's 1/sqrt(var + eps)
(ai.graphcore BatchNormalization's rescaled by sqrt((n - 1) / n)), ScatterReduce None / Mul
follow ScatterReduceGradOp, Ctc is exp(lp) - occupancy. Expected values are those rules in
NumPy (float64, from the inputs rounded to the tested dtype); gradients come from the
registered lowerings under jax.vjp, plus one TrainingSession for ReduceMax."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import popart
from popart._ir.graphcore_schema import node_defaults
from popart.ops.registry import lookup

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

GC = "ai.graphcore"
DTYPES = [np.float32, np.float16]
RS = np.random.RandomState(0)


class Ctx:
    """The attributes of popart.ops.registry.LowerCtx that these lowerings read."""

    def __init__(self, version=1, training=True, num_outputs=1, input_ids=()):
        self.version, self.training, self.num_outputs = version, training, num_outputs
        self.output_ids = [f"y{i}" for i in range(num_outputs)]
        self.input_ids, self.assigned = list(input_ids), {}
        self.op_type, self.domain, self.name = "", "", "test"
        self.config = None   # no session: ONNX's rules and the defaults

    def error(self, msg):
        return ValueError(msg)

    def static(self, x, what):
        return np.asarray(x)

    def assign(self, tensor_id, value):
        self.assigned[tensor_id] = value

    def channels_last(self, x, transpose=False):
        return x.transpose(0, 2, 3, 1) if transpose else None


def lowering(domain, op, version):
    """The registered lowering; for ai.graphcore with the table's attribute defaults filled in,
    as the engine does."""
    lower = lookup(domain, op, version).lower
    if domain != GC:
        return lower
    return lambda ctx, *a, **kw: lower(ctx, *a, **{**node_defaults(op, kw, op), **kw})


def vjp(fn, primals, cts):
    """(outputs, input gradients) of ``fn(*primals)`` for output cotangents ``cts`` (one
    compiled program)."""
    def run(primals, cts):
        out, pull = jax.vjp(fn, *primals)
        cts = tuple(c.astype(o.dtype) for c, o in zip(cts, out)) if isinstance(out, tuple) \
            else cts.astype(out.dtype)
        return out, pull(cts)
    out, grads = jax.jit(run)([jnp.asarray(p) for p in primals], jax.tree.map(jnp.asarray, cts))
    return out, [np.asarray(g, np.float64) for g in grads]


def tol(dtype):
    return dict(rtol=2e-2, atol=2e-3) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)


def f64(x):
    return np.asarray(x, np.float64)


# ---------------------------------------------------------------------------------------
# ReduceMax / ReduceMin, ArgMax / ArgMin

@pytest.mark.parametrize("op,version,keepdims,dtype", [
    ("ReduceMax", 13, 0, np.float32), ("ReduceMax", 18, 1, np.float16),
    ("ReduceMin", 13, 1, np.float32), ("ReduceMin", 18, 0, np.float16)])
def test_reduce_max_min_ties_get_the_whole_gradient(op, version, keepdims, dtype):
    x = np.array([[[1, 3, 3, -2], [0, 0, 0, 0]], [[-1, 5, -1, 5], [2, -7, 2, -7]]], dtype)
    ax = lambda a: [a] if version < 18 else np.array([a], np.int64)
    red = lambda v, a=2: lowering("", op, version)(Ctx(version), v, axes=ax(a), keepdims=keepdims)
    ext = (np.max if op == "ReduceMax" else np.min)(x, axis=2, keepdims=True)
    g = RS.standard_normal(ext.shape if keepdims else ext.shape[:2]).astype(dtype)
    y, (dx,) = vjp(red, [x], g)
    np.testing.assert_array_equal(y, ext if keepdims else ext[..., 0])   # forward unchanged
    expect = (x == ext) * f64(g).reshape(ext.shape)   # (sign(+-(x - y)) + 1) * g
    np.testing.assert_allclose(dx, expect, **tol(dtype))
    # the same under jit, vmap and scan, and folded from NumPy constants
    grad1 = jax.grad(lambda v: jnp.sum(red(v, 1) * jnp.asarray(g[0], dtype)))
    gv = jax.jit(jax.vmap(grad1))(x)
    gs = jax.lax.scan(lambda c, v: (c, grad1(v)), 0, x)[1]
    np.testing.assert_allclose(f64(gv[0]), expect[0], **tol(dtype))
    np.testing.assert_allclose(f64(gs[0]), expect[0], **tol(dtype))
    np.testing.assert_array_equal(np.asarray(red(x)), y)


def test_argmax_argmin_have_no_gradient():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]], np.float32)
    for op in ("ArgMax", "ArgMin"):
        fn = lambda v: lowering("", op, 13)(Ctx(13), v, axis=1, keepdims=0)
        out, pull = jax.vjp(fn, jnp.asarray(x))
        (dx,) = pull(np.zeros(out.shape, jax.dtypes.float0))
        np.testing.assert_array_equal(dx, 0)


# ---------------------------------------------------------------------------------------
# LogSoftmax

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version", [11, 13])
def test_logsoftmax_grad_is_g_minus_softmax_times_sum_g(dtype, version):
    x = np.array([[[4, 4, -np.inf, 1], [30, 30, 30, 30]], [[-3, 0.5, 2, 2], [0, -60, 7, 7]]], dtype)
    g = RS.standard_normal(x.shape).astype(dtype)
    axis = 2 if version >= 13 else 1     # before 13, flattened to 2D at axis: [2, 8]
    fn = lambda v: lowering("", "LogSoftmax", version)(Ctx(version), v, axis=axis)
    _, (dx,) = vjp(fn, [x], g)
    shape = (2, -1) if version < 13 else x.shape
    x2, g2 = f64(x).reshape(shape), f64(g).reshape(shape)
    e = np.exp(x2 - x2.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    expect = (g2 - p * g2.sum(-1, keepdims=True)).reshape(x.shape)
    np.testing.assert_allclose(dx, expect, **tol(dtype))


# ---------------------------------------------------------------------------------------
# Normalizations: small variances, so that epsilon matters

def whiten_grad(x, dy, scale_b, axes, eps, rstd_scale=1.0):
    """The textbook (popnn norm) gradients of y = xhat * scale + b from dy alone:
    dx = rstd * (dy s - mean(dy s) - xhat mean(dy s xhat)) over ``axes``; xhat and rstd use
    rstd = rstd_scale / sqrt(var + eps). Returns (dx, xhat) in float64."""
    x, dy = f64(x), f64(dy)
    m = x.mean(axes, keepdims=True)
    rstd = rstd_scale / np.sqrt(x.var(axes, keepdims=True) + eps)
    xhat = (x - m) * rstd
    dys = dy * scale_b
    dx = rstd * (dys - dys.mean(axes, keepdims=True) - xhat * (dys * xhat).mean(axes, keepdims=True))
    return dx, xhat


def small_var(shape, dtype, spread):
    return (RS.standard_normal(shape) * spread).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_grad(dtype):
    x = small_var((3, 2, 8), dtype, 3e-3 if dtype == np.float16 else 1e-4)   # var << eps
    s, b = RS.standard_normal(8).astype(dtype), RS.standard_normal(8).astype(dtype)
    dy = RS.standard_normal(x.shape).astype(dtype)
    fn = lambda *a: lowering("", "LayerNormalization", 17)(Ctx(17, num_outputs=3), *a, epsilon=1e-5)[0]
    _, (dx, ds, db) = vjp(fn, [x, s, b], dy)
    exp_dx, xhat = whiten_grad(x, dy, f64(s), (2,), 1e-5)
    np.testing.assert_allclose(dx, exp_dx, rtol=tol(dtype)["rtol"], atol=tol(dtype)["rtol"] * np.abs(exp_dx).max())
    np.testing.assert_allclose(ds, (f64(dy) * xhat).sum((0, 1)), **tol(dtype))
    np.testing.assert_allclose(db, f64(dy).sum((0, 1)), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_grad_ignores_mean_and_inv_std_cotangents(dtype):
    N, C, G, HW = 2, 6, 3, 4
    x = small_var((N, C, HW), dtype, 2e-3 if dtype == np.float16 else 1e-4)
    s, b = RS.standard_normal(C).astype(dtype), RS.standard_normal(C).astype(dtype)
    cts = [RS.standard_normal(sh).astype(dtype) for sh in ((N, C, HW), (N * G,), (N * G,))]
    fn = lambda *a: lowering(GC, "GroupNormalization", 1)(Ctx(num_outputs=3), *a, num_groups=G, epsilon=1e-5)
    _, (dx, ds, db) = vjp(fn, [x, s, b], tuple(cts))
    grp = lambda t: t.reshape(N, G, -1)
    exp_dx, xhat = whiten_grad(grp(x), grp(f64(cts[0]) * f64(s)[:, None]), 1.0, (2,), 1e-5)
    np.testing.assert_allclose(dx, exp_dx.reshape(x.shape), rtol=tol(dtype)["rtol"],
                               atol=tol(dtype)["rtol"] * np.abs(exp_dx).max())
    np.testing.assert_allclose(ds, (f64(cts[0]) * xhat.reshape(x.shape)).sum((0, 2)), **tol(dtype))
    np.testing.assert_allclose(db, f64(cts[0]).sum((0, 2)), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("domain,version", [("", 9), ("", 15), (GC, 1)])
def test_batch_norm_training_grad(dtype, domain, version):
    """Only y passes a gradient (not the running / saved statistics outputs, nor to the mean
    and var inputs); ai.graphcore's takes 1/sqrt(var + eps) * sqrt((n - 1) / n)."""
    N, C, HW = 3, 2, 5
    x = small_var((N, C, HW), dtype, 2e-3 if dtype == np.float16 else 1e-4)
    p = [RS.standard_normal(C).astype(dtype) for _ in range(2)] + [np.zeros(C, dtype), np.ones(C, dtype)]
    n_out = 3 if version >= 14 else 5
    ctx = Ctx(version, num_outputs=n_out, input_ids=["x", "s", "b", "m", "v"])
    attrs = {"training_mode": 1} if version >= 14 else {}
    fn = lambda *a: lowering(domain, "BatchNormalization", version)(ctx, *a, epsilon=1e-5, **attrs)
    cts = [RS.standard_normal(x.shape).astype(dtype)] + [RS.standard_normal(C).astype(dtype)] * (n_out - 1)
    _, (dx, ds, db, dm, dv) = vjp(fn, [x] + p, tuple(cts))
    n = N * HW
    c = np.sqrt((n - 1) / n) if domain == GC else 1.0
    dy = f64(cts[0])
    exp_dx, xhat = whiten_grad(x, dy * f64(p[0])[:, None], 1.0, (0, 2), 1e-5, c)
    np.testing.assert_allclose(dx, exp_dx, rtol=tol(dtype)["rtol"], atol=tol(dtype)["rtol"] * np.abs(exp_dx).max())
    np.testing.assert_allclose(ds, (dy * xhat).sum((0, 2)), **tol(dtype))
    np.testing.assert_allclose(db, dy.sum((0, 2)), **tol(dtype))
    np.testing.assert_array_equal(dm, 0)
    np.testing.assert_array_equal(dv, 0)


# ---------------------------------------------------------------------------------------
# ScatterReduce, GroupedScatterReduce

def scatter_grad_ref(src, idx, init, out, g, red):
    """ScatterReduceGradOp along axis 1 of 2D src / index, in float64."""
    src, out, g = f64(src), f64(out), f64(g)
    A = out.shape[1]
    ds = np.zeros_like(src)
    touched = np.zeros(out.shape, bool)
    for r, j in np.ndindex(*src.shape):
        i = idx[r, j]
        if not 0 <= i < A:
            continue
        touched[r, i] = True
        ds[r, j] = g[r, i] * {"max": src[r, j] == out[r, i], "min": src[r, j] == out[r, i],
                              "mul": out[r, i] / src[r, j]}.get(red, 1.0)
    if init is None:
        return ds, None
    init = f64(init)
    dinit = {"sum": g, "none": np.where(touched, 0.0, g), "mul": g * out / init}.get(red, g * (out == init))
    return ds, dinit


@pytest.mark.parametrize("red", ["sum", "max", "min", "mul", "none"])
@pytest.mark.parametrize("with_init,dtype", [(False, np.float32), (True, np.float16)])
def test_scatter_reduce_grad(red, with_init, dtype):
    A = 4
    # repeated indices with tied values (columns 0 and 2 both write slot 1), an index
    # out of range (5), slot 3 never written
    idx = np.array([[1, 0, 1, 2, 5, 2], [0, 0, 2, 1, 1, 5]], np.int32)
    src = np.array([[2, -1, 2, 0.5, 9, -3], [1.5, 1.5, -2, 3, -4, 7]], dtype)
    init = np.array([[2, 0.25, -1, 1.5], [1.5, 1, -2, 0.5]], dtype) if with_init else None
    g = RS.standard_normal((2, A)).astype(dtype)
    lower = lowering(GC, "ScatterReduce", 1)
    fn = lambda s, *i: lower(Ctx(), s, idx, *i, axis_size=A, axis=1, reduction=red)
    out, grads = vjp(fn, [src] + ([init] if with_init else []), g)
    ds, dinit = scatter_grad_ref(src, idx, init, out, g, red)
    np.testing.assert_allclose(grads[0], ds, **tol(dtype))
    if with_init:
        np.testing.assert_allclose(grads[1], dinit, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_scatter_reduce_max_ties(dtype):
    idx = np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int32)
    src = np.array([[1, 4, 4, -1], [3, 3, 5, 2]], dtype)
    g = RS.standard_normal((2, 3)).astype(dtype)
    fn = lambda s: lowering(GC, "GroupedScatterReduce", 1)(Ctx(), s, idx, axis_size=3, axis=1,
                                                            group_size=2, reduction="Max")
    out, (ds,) = vjp(fn, [src], g)
    np.testing.assert_allclose(ds, scatter_grad_ref(src, idx, None, out, g, "max")[0], **tol(dtype))


# ---------------------------------------------------------------------------------------
# Ctc: d loss_n / d lp = g_n (exp(lp) - occupancy) for t < input length (PyTorch's gradient),
# g_n exp(lp) from the input length on; infinite losses: 0 with zeroInfinity, else g_n exp(lp)

@pytest.mark.parametrize("dtype,out_dt,reduction,zero_inf", [
    (np.float32, 0, "Sum", 0), (np.float32, 0, "NoReduction", 1),
    (np.float16, 1, "Mean", 0), (np.float16, 0, "Sum", 1)])   # out_dt 1: FLOAT
def test_ctc_grad(dtype, out_dt, reduction, zero_inf):
    Tn, N, C = 6, 4, 4
    lp = np.asarray(jax.nn.log_softmax(RS.standard_normal((Tn, N, C)), -1)).astype(dtype)
    targets = np.array([[1, 2, 2], [3, 1, 0], [1, 1, 1], [2, 0, 0]], np.uint32)
    il = np.array([6, 4, 4, 5], np.uint32)   # sample 2 needs 5 frames: infinite loss
    tl = np.array([3, 2, 3, 1], np.uint32)
    # output 1 (PopART's gradient of each loss, for a gradient of 1) comes along
    fn = lambda v: lowering(GC, "Ctc", 1)(Ctx(num_outputs=2), v, targets, il, tl, reduction=reduction,
                                          zeroInfinity=zero_inf, outDataType=out_dt)
    g = RS.uniform(0.5, 1.5, N if reduction == "NoReduction" else ()).astype(np.float32)
    (_, g1), (dlp,) = vjp(fn, [lp], (g, np.zeros(lp.shape, np.float32)))
    gn = {"Sum": np.full(N, f64(g)), "Mean": f64(g) / N / np.maximum(tl, 1),
          "NoReduction": f64(g)}[reduction]
    t = torch.tensor(f64(lp), requires_grad=True)
    per = F.ctc_loss(t, torch.tensor(targets.astype(np.int64)), torch.tensor(il.astype(np.int64)),
                     torch.tensor(tl.astype(np.int64)), reduction="none", zero_infinity=bool(zero_inf))
    per.backward(torch.tensor(gn))
    expect = t.grad.numpy().copy()
    past = np.arange(Tn)[:, None] >= il[None, :]
    expect[past] = (np.exp(f64(lp)) * gn[None, :, None])[past]
    expect[:, 2] = 0 if zero_inf else np.exp(f64(lp[:, 2])) * gn[2]
    assert not np.isnan(dlp).any()
    np.testing.assert_allclose(dlp, expect, rtol=2e-2 if dtype == np.float16 else 1e-5,
                               atol=3e-3 if dtype == np.float16 else 1e-6)
    assert g1.dtype == (np.float32 if out_dt == 1 else dtype)
    np.testing.assert_allclose(f64(g1) * gn[None, :, None], expect, rtol=2e-2 if dtype == np.float16 else 1e-5,
                               atol=3e-3 if dtype == np.float16 else 1e-6)


# ---------------------------------------------------------------------------------------
# End to end

def test_reduce_max_ties_in_a_training_session():
    G = popart.reservedGradientPrefix()
    data = np.array([[1, 3, 3, -2], [0, 0, 0, 0], [5, -1, 5, 5]], np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(data.shape)), "x")
    w = b.addInitializedInputTensor(np.zeros(data.shape, np.float32), "w")
    z = b.aiOnnx.add([x, w])
    y = b.aiOnnx.reducemax([z], axes=[1], keepdims=0)
    loss = b.aiGraphcore.identityloss([y], reduction=popart.ReductionType.Sum)
    df = popart.DataFlow(1, {a: popart.AnchorReturnType("ALL") for a in (loss, G + z)})
    s = popart.TrainingSession(b.getModelProto(), df, loss, popart.SGD({"defaultLearningRate": (0.0, False)}),
                               popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: data}, out))
    np.testing.assert_allclose(out[loss], data.max(1).sum())
    np.testing.assert_array_equal(out[G + z], (data == data.max(1, keepdims=True)).astype(np.float32))
