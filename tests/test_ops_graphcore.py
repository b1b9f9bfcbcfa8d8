"""ai.graphcore ops against PyTorch / NumPy references written from the API reference."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jax
import jax.numpy as jnp

from popart.engine.lower import TraceState, execute
from popart.ir.onnx_import import import_model
from test_ops_nn import fd_grad_check, one_node, ours, rnd

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

GC = "ai.graphcore"


def gc(op, inputs, n_out=1, **attrs):
    return one_node(op, inputs, n_out=n_out, domain=GC, **attrs)


def run(op, inputs, n_out=1, training=False, **attrs):
    out = ours(gc(op, inputs, n_out=n_out, **attrs), inputs, training=training)
    return out if n_out > 1 else out[0]


T = lambda a: torch.from_numpy(np.asarray(a))


# ---------------------------------------------------------------------------------------
# Losses

@pytest.mark.parametrize("reduction", ["Sum", "Mean", "NoReduction"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_nll_vs_torch(reduction, ignore):
    logits = rnd(6, 5)
    label = np.array([0, 2, 4, 2, 1, 3], np.int32)
    lp = torch.log_softmax(T(logits), -1)
    tred = {"Sum": "sum", "Mean": "mean", "NoReduction": "none"}[reduction]
    exp = F.nll_loss(lp, T(label).long(), reduction=tred,
                     ignore_index=-100 if ignore is None else ignore).numpy()
    attrs = {} if ignore is None else {"ignoreIndex": ignore}
    probs = np.exp(lp.numpy())
    got = run("Nll", {"p": probs, "l": label}, reduction=reduction, **attrs)
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    got = run("Nll", {"p": lp.numpy(), "l": label}, reduction=reduction, inputIsLogProbability=1, **attrs)
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


def test_nll_higher_rank_and_grad():
    p = np.abs(rnd(2, 3, 4)) + 0.1
    p = p / p.sum(-1, keepdims=True)
    label = np.array([[0, 1, 3], [2, 2, 0]], np.int32)
    got = run("Nll", {"p": p, "l": label}, reduction="NoReduction")
    exp = -np.log(np.take_along_axis(p, label[..., None], -1)[..., 0])
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, exp, rtol=1e-5)
    fd_grad_check(gc("Nll", {"p": p, "l": label}, reduction="Mean"), {"p": p, "l": label}, "p")


def test_l1_and_identity_loss():
    x = rnd(3, 4)
    np.testing.assert_allclose(run("L1", {"x": x}, **{"lambda": 0.5}, reduction="Sum"),
                               0.5 * np.abs(x).sum(), rtol=1e-5)
    np.testing.assert_allclose(run("L1", {"x": x}, **{"lambda": 2.0}), 2 * np.abs(x).mean(), rtol=1e-5)
    np.testing.assert_allclose(run("L1", {"x": x}, **{"lambda": 1.0}, reduction="NoReduction"), np.abs(x))
    np.testing.assert_allclose(run("IdentityLoss", {"x": x}), x.mean(), rtol=1e-5)
    np.testing.assert_allclose(run("IdentityLoss", {"x": x}, reduction="Sum"), x.sum(), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["Sum", "Mean", "NoReduction"])
def test_ctc_vs_torch(reduction):
    Tn, N, C, S = 8, 3, 5, 3
    lp = torch.log_softmax(T(rnd(Tn, N, C)), -1)
    targets = np.array([[1, 2, 2], [3, 1, 0], [4, 4, 4]], np.uint32)
    il = np.array([8, 6, 7], np.uint32)
    tl = np.array([3, 2, 1], np.uint32)
    tred = {"Sum": "sum", "Mean": "mean", "NoReduction": "none"}[reduction]
    exp = F.ctc_loss(lp, T(targets.astype(np.int64)), T(il.astype(np.int64)), T(tl.astype(np.int64)),
                     reduction=tred)
    feeds = {"lp": lp.numpy(), "t": targets, "il": il, "tl": tl}
    loss, grad = run("Ctc", feeds, n_out=2, reduction=reduction)
    np.testing.assert_allclose(loss, exp.numpy(), rtol=1e-5, atol=1e-5)
    # output 1 is d(sum of losses)/d(log_probs); through log_softmax it is torch's logit gradient
    logits = lp.clone().requires_grad_(True)
    tsum = F.ctc_loss(torch.log_softmax(logits, -1), T(targets.astype(np.int64)),
                      T(il.astype(np.int64)), T(tl.astype(np.int64)), reduction="sum")
    g_logits = torch.autograd.grad(tsum, logits)[0].numpy()
    sm = np.exp(lp.numpy())
    np.testing.assert_allclose(grad - sm * grad.sum(-1, keepdims=True), g_logits, rtol=1e-4, atol=1e-5)


def test_ctc_grad_and_zero_infinity():
    lp = np.log(np.full((3, 1, 3), 1 / 3))
    feeds = {"lp": lp, "t": np.array([[1, 1, 1]], np.uint32), "il": np.array([3], np.uint32),
             "tl": np.array([3], np.uint32)}  # needs 5 frames: impossible -> inf
    assert np.isinf(run("Ctc", feeds, reduction="Sum"))
    assert run("Ctc", feeds, reduction="Sum", zeroInfinity=1) == 0
    # the gradient is PopART's CtcGradOp rule (exp(lp) - occupancy), not the loss's
    # derivative: tests/test_grad_rules_nn.py checks it


def test_ctc_beam_search_decoder():
    probs = np.full((4, 1, 3), 0.05, np.float32)
    for t, c in enumerate([1, 0, 2, 2]):
        probs[t, 0, c] = 0.9
    lp, lens = np.log(probs), np.array([4], np.uint32)
    p, ln, lab = run("CtcBeamSearchDecoder", {"lp": lp, "l": lens}, n_out=3, beam_width=5, top_paths=2)
    assert p.shape == (1, 2) and lab.shape == (1, 2, 4)
    assert ln[0, 0] == 2 and list(lab[0, 0, :2]) == [1, 2] and p[0, 0] > p[0, 1]


# ---------------------------------------------------------------------------------------
# Elementwise

def test_elementwise_rows():
    x, y = rnd(3, 4), rnd(3, 4)
    np.testing.assert_allclose(run("Gelu", {"x": x}), F.gelu(T(x), approximate="tanh").numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run("GeluErf", {"x": x}), F.gelu(T(x)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run("Swish", {"x": x}), F.silu(T(x)).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run("Expm1", {"x": x}), np.expm1(x), rtol=1e-5)
    np.testing.assert_allclose(run("Log1p", {"x": np.abs(x)}), np.log1p(np.abs(x)), rtol=1e-5)
    np.testing.assert_allclose(run("Atan2", {"y": y, "x": x}), np.arctan2(y, x), rtol=1e-5)
    np.testing.assert_allclose(run("Square", {"x": x}), x * x, rtol=1e-6)
    r = np.array([0.5, 1.5, 2.5, -0.5, 2.4], np.float32)
    np.testing.assert_array_equal(run("Round", {"x": r}), [0, 2, 2, -0, 2])
    np.testing.assert_array_equal(run("NearbyInt", {"x": r}), [0, 2, 2, -0, 2])
    a, b = np.array([7, -7, 7, -7], np.int32), np.array([3, 3, -3, -3], np.int32)
    np.testing.assert_array_equal(run("Remainder", {"a": a, "b": b}), a % b)
    np.testing.assert_array_equal(run("Fmod", {"a": a, "b": b}), np.fmod(a, b))
    np.testing.assert_allclose(run("Fmod", {"a": x, "b": np.float32(0.7) + 0 * y}), np.fmod(x, 0.7), rtol=1e-5)
    assert run("Scale", {"x": x}, scale=2.5).dtype == np.float32
    np.testing.assert_allclose(run("Scale", {"x": x}, scale=2.5), 2.5 * x, rtol=1e-6)
    np.testing.assert_allclose(run("ScaledAdd", {"a": x, "b": y}, scale0=2.0, scale1=-1.0), 2 * x - y, rtol=1e-6)
    s = {"a": x, "b": y, "s0": np.array(3.0, np.float32), "s1": np.array(0.5, np.float32)}
    np.testing.assert_allclose(run("ScaledAdd", s), 3 * x + 0.5 * y, rtol=1e-6)
    np.testing.assert_allclose(run("IncrementMod", {"x": np.array([1., 4., 8.], np.float32)},
                                   increment=3.0, modulus=5.0), [4, 2, 1])


def test_bitwise():
    a, b = np.array([12, 5, -3], np.int32), np.array([10, 3, 7], np.int32)
    for op, fn in [("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or), ("BitwiseXor", np.bitwise_xor),
                   ("BitwiseXnor", lambda p, q: ~(p ^ q))]:
        np.testing.assert_array_equal(run(op, {"a": a, "b": b}), fn(a, b))
    np.testing.assert_array_equal(run("BitwiseNot", {"a": a}), ~a)
    with pytest.raises(Exception, match="integer"):
        run("BitwiseAnd", {"a": rnd(2), "b": rnd(2)})


def test_detach_and_unary_zero_grad_block_gradients():
    x = rnd(3).astype(np.float64)
    for op in ("Detach", "UnaryZeroGrad"):
        graph, _ = import_model(gc(op, {"x": x}))
        g = jax.grad(lambda v: jnp.sum(execute(graph, {"x": v}, TraceState())["y0"] * v))(jnp.asarray(x))
        np.testing.assert_allclose(g, x)  # only the direct path contributes


def test_bucketize_histogram():
    x = np.array([[0.5, 1.0, 2.5], [3.0, -1.0, 9.0]], np.float32)
    bnd = np.array([1.0, 2.0, 3.0], np.float32)
    for right in (0, 1):
        exp = torch.bucketize(T(x), T(bnd), right=bool(right)).numpy()
        np.testing.assert_array_equal(run("Bucketize", {"x": x, "b": bnd}, right=right), exp)
    h = run("Histogram", {"x": x}, levels=[0.0, 2.0, 5.0])
    np.testing.assert_array_equal(h, [1, 2, 2, 1])
    np.testing.assert_array_equal(run("Histogram", {"x": x}, levels=[0.0, 2.0, 5.0], absoluteOfInput=1), [0, 3, 2, 1])


# ---------------------------------------------------------------------------------------
# Shape-like and dynamic ops

def test_shape_like_ops():
    x = rnd(2, 8, 3, 2)
    np.testing.assert_array_equal(run("Reshape", {"x": x}, shape=[4, -1]), x.reshape(4, -1))
    np.testing.assert_array_equal(run("Reverse", {"x": x}, dimensions=[1, 3]), x[:, ::-1, :, ::-1])
    np.testing.assert_array_equal(run("Slice", {"x": x}, starts=[1, 0], ends=[6, 2], axes=[1, 2]), x[:, 1:6, 0:2])
    np.testing.assert_array_equal(run("Subsample", {"x": x}, strides=[1, 3, 2, 1]), x[:, ::3, ::2, :])
    for mode in ("DCR", "CRD"):
        onnx_y = ours(one_node("DepthToSpace", {"x": x}, blocksize=2, mode=mode, opset=13), {"x": x})[0]
        np.testing.assert_array_equal(run("DepthToSpace", {"x": x}, blocksize=2, mode=mode), onnx_y)
    z = run("Zeros", {}, shape=[2, 3], dtype=7)
    assert z.dtype == np.int64 and z.shape == (2, 3) and not z.any()
    i = run("Init", {}, shape=[4], data_type=1, tensor_type=0, init_type=1)
    assert i.dtype == np.float32 and i.shape == (4,) and not i.any()
    zl = run("ZerosLike", {"x": x})
    assert zl.shape == x.shape and not zl.any()


def test_dynamic_ops():
    x = rnd(5, 6)
    off = np.array([1, 2], np.uint32)
    s = run("DynamicSlice", {"x": x, "o": off}, axes=[0, 1], sizes=[2, 3])
    np.testing.assert_array_equal(s, x[1:3, 2:5])
    upd = rnd(2, 3)
    exp = x.copy(); exp[1:3, 2:5] = upd
    np.testing.assert_array_equal(run("DynamicUpdate", {"x": x, "o": off, "u": upd}, axes=[0, 1], sizes=[2, 3]), exp)
    exp = x.copy(); exp[1:3, 2:5] += upd
    np.testing.assert_allclose(run("DynamicAdd", {"x": x, "o": off, "u": upd}, axes=[0, 1], sizes=[2, 3]), exp)
    exp = x.copy(); exp[:, 3:5] = 0
    np.testing.assert_array_equal(run("DynamicZero", {"x": x, "o": np.array([3], np.int32)}, axes=[1], sizes=[2]), exp)
    feeds = {"x": x, "o": np.array([2], np.int32)}
    fd_grad_check(gc("DynamicSlice", feeds, axes=[0], sizes=[2]), feeds, "x")


def test_sequence_slice():
    src, dst = rnd(6, 2), rnd(5, 2)
    n, so, do = (np.array(v, np.uint32) for v in ([2, 1, 0], [0, 4, 1], [1, 4, 0]))
    feeds = {"s": src, "d": dst, "n": n, "so": so, "do": do}
    exp = dst.copy(); exp[1:3] = src[0:2]; exp[4] = src[4]
    np.testing.assert_array_equal(run("SequenceSlice", feeds), exp)
    exp0 = np.zeros_like(dst); exp0[1:3] = src[0:2]; exp0[4] = src[4]
    np.testing.assert_array_equal(run("SequenceSlice", feeds, zeroUnused=1), exp0)


def test_sort_topk_median():
    x = rnd(3, 7)
    v, i = run("Sort", {"x": x}, n_out=2, axis=1, descending=1)
    np.testing.assert_array_equal(v, -np.sort(-x, 1))
    np.testing.assert_array_equal(np.take_along_axis(x, i, 1), v)
    v, i = run("TopK", {"x": x}, n_out=2, axis=-1, consts={"k": np.array([3], np.int64)})
    tv, ti = torch.topk(T(x), 3)
    np.testing.assert_array_equal(v, tv.numpy()); np.testing.assert_array_equal(i, ti.numpy())
    x = rnd(4, 6)
    v, i = run("ReduceMedian", {"x": x}, n_out=2, axes=[1], keepdims=0)
    tv, ti = torch.median(T(x), 1)
    np.testing.assert_array_equal(v, tv.numpy()); np.testing.assert_array_equal(i, ti.numpy())
    v, i = run("ReduceMedian", {"x": x}, n_out=2)
    assert v.shape == (1, 1) and v[0, 0] == np.sort(x.ravel())[11] and x.ravel()[i[0, 0]] == v[0, 0]


@pytest.mark.parametrize("red,tred", [("Sum", "sum"), ("Max", "amax"), ("Min", "amin"), ("Mul", "prod")])
def test_scatter_reduce_vs_torch(red, tred):
    src = rnd(3, 6)
    idx = np.array([0, 2, 0, 3, 3, 0], np.int32)
    got = run("ScatterReduce", {"s": src, "i": idx}, axis_size=5, axis=1, reduction=red)
    out = torch.zeros(3, 5).scatter_reduce(1, T(idx).long().expand(3, 6), T(src), tred, include_self=False)
    np.testing.assert_allclose(got, out.numpy(), rtol=1e-6)
    init = rnd(3, 5)
    got = run("ScatterReduce", {"s": src, "i": idx, "init": init}, axis_size=5, axis=1, reduction=red)
    out = T(init).scatter_reduce(1, T(idx).long().expand(3, 6), T(src), tred, include_self=True)
    np.testing.assert_allclose(got, out.numpy(), rtol=1e-6)


def test_grouped_gather_and_scatter():
    d = rnd(2, 5, 3)
    i = np.array([[0, 4], [2, 2]], np.int32)
    got = run("GroupedGather", {"d": d, "i": i}, axis=1, group_size=2)
    np.testing.assert_array_equal(got, np.stack([d[0][[0, 4]], d[1][[2, 2]]]))
    src = rnd(2, 4)
    idx = np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int32)
    got = run("GroupedScatterReduce", {"s": src, "i": idx}, axis_size=3, axis=1, group_size=2)
    exp = np.zeros((2, 3), np.float32)
    for g in range(2):
        np.add.at(exp[g], idx[g], src[g])
    np.testing.assert_allclose(got, exp, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Normalization, conv, LSTM

def test_group_norm_vs_torch():
    x, s, b = rnd(2, 6, 3, 2), rnd(6), rnd(6)
    y, m, inv = run("GroupNormalization", {"x": x, "s": s, "b": b}, n_out=3, num_groups=3, epsilon=1e-5)
    np.testing.assert_allclose(y, F.group_norm(T(x), 3, T(s), T(b), 1e-5).numpy(), rtol=1e-4, atol=1e-5)
    g = x.reshape(2, 3, -1)
    np.testing.assert_allclose(m, g.mean(-1).ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, 1 / np.sqrt(g.var(-1).ravel() + 1e-5), rtol=1e-4)
    fd_grad_check(gc("GroupNormalization", {"x": x, "s": s, "b": b}, n_out=3, num_groups=2),
                  {"x": x, "s": s, "b": b}, "x")


def test_popart_batchnorm_running_var_unbiased():
    x = rnd(4, 3, 2).astype(np.float64)
    model = gc("BatchNormalization", {"x": x}, n_out=5, momentum=0.9,
               consts={"s": np.ones(3), "b": np.zeros(3), "m": np.zeros(3), "v": np.ones(3)})
    graph, _ = import_model(model)
    st = TraceState(training=True)
    env = execute(graph, {"x": x}, st)
    bn = torch.nn.BatchNorm1d(3, momentum=0.1).double()
    ty = bn(T(x))
    np.testing.assert_allclose(env["y0"], ty.detach().numpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(st.assignments["v"], bn.running_var.numpy(), rtol=1e-6)
    np.testing.assert_allclose(env["y2"], bn.running_var.numpy(), rtol=1e-6)
    y = run("BatchNormalization", {"x": x.astype(np.float32)}, consts={"s": np.ones(3, np.float32),
            "b": np.zeros(3, np.float32), "m": np.zeros(3, np.float32), "v": np.ones(3, np.float32)})
    np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-5), rtol=1e-5)  # inference: running stats


def test_multiconv():
    x0, w0, b0 = rnd(1, 2, 5, 5), rnd(3, 2, 3, 3), rnd(3)
    x1, w1, b1 = rnd(1, 4, 4, 4), rnd(2, 2, 2, 2), rnd(2)
    y0, y1 = run("MultiConv", {"x0": x0, "w0": w0, "b0": b0, "x1": x1, "w1": w1, "b1": b1}, n_out=2,
                 pads=[1, 1, 1, 1, 0, 0, 0, 0], strides=[1, 1, 2, 2])
    np.testing.assert_allclose(y0, F.conv2d(T(x0), T(w0), T(b0), padding=1).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y1, F.conv2d(T(x1), T(w1), T(b1), stride=2, groups=2).numpy(), rtol=1e-4, atol=1e-5)


def test_popart_lstm_vs_torch():
    Tn, B, I, H = 4, 2, 3, 5
    lstm = torch.nn.LSTM(I, H)
    p = lambda t: t.detach().numpy()
    ifgo = lambda a: a.reshape(4, H, *a.shape[1:])
    wi, wh = ifgo(p(lstm.weight_ih_l0)), ifgo(p(lstm.weight_hh_l0))
    b = ifgo(p(lstm.bias_ih_l0) + p(lstm.bias_hh_l0))
    order = [1, 0, 2, 3]  # poplibs: forget, input, candidate, output
    weights = np.concatenate([wi[order].transpose(0, 2, 1), wh[order].transpose(0, 2, 1)], 1)
    x, h0, c0 = rnd(Tn, B, I), rnd(1, B, H), rnd(1, B, H)
    ty, (th, tc) = lstm(T(x), (T(h0), T(c0)))
    feeds = {"x": x, "w": weights, "b": b[order], "s": np.concatenate([h0, c0])}
    y, c = run("LSTM", feeds, n_out=2)
    np.testing.assert_allclose(y, p(ty), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(c, p(tc[0]), rtol=1e-4, atol=1e-5)
    y, c = run("LSTM", feeds, n_out=2, outputFullSequence=0)
    np.testing.assert_allclose(y, p(th[0]), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Random, side effects, collectives

def test_shaped_dropout():
    x = np.ones((40, 30), np.float32)
    np.testing.assert_array_equal(run("ShapedDropout", {"x": x}, shape=[40, 1], ratio=0.5), x)
    y = run("ShapedDropout", {"x": x}, training=True, shape=[40, 1], ratio=0.5)
    rows = y[:, 0]
    assert set(np.unique(y)) <= {0.0, 2.0} and (y == rows[:, None]).all() and 5 < (rows == 0).sum() < 35


def test_print_tensor_copy_var_update_nop(capfd):
    x = rnd(3)
    np.testing.assert_array_equal(run("PrintTensor", {"x": x}, title="hello"), x)
    jax.effects_barrier()
    assert "hello" in capfd.readouterr().out
    np.testing.assert_array_equal(run("Nop", {"x": x}), x)
    model = gc("CopyVarUpdate", {"u": x}, _order=["v", "u"], consts={"v": np.zeros(3, np.float32)})
    graph, _ = import_model(model)
    st = TraceState(training=True)
    env = execute(graph, {"u": x}, st)
    np.testing.assert_array_equal(st.assignments["v"], x)
    np.testing.assert_array_equal(env["y0"], x)


def test_abort_raises_only_when_true():
    graph, _ = import_model(gc("Abort", {"c": np.array(False)}, n_out=0))
    fn = jax.jit(lambda c: (execute(graph, {"c": c}, TraceState()), jnp.zeros(()))[1])
    jax.block_until_ready(fn(jnp.asarray(False)))
    jax.effects_barrier()
    with pytest.raises(Exception, match="Abort"):
        jax.block_until_ready(fn(jnp.asarray(True)))
        jax.effects_barrier()


def test_collectives():
    x = rnd(2, 3)
    for op in ("ReplicatedAllReduce", "ReplicatedAllGather"):
        np.testing.assert_array_equal(run(op, {"x": x}), x)
    np.testing.assert_array_equal(run("ReplicatedReduceScatter", {"x": x}), x.ravel())
    graphs = {op: import_model(gc(op, {"x": x}))[0] for op in
              ("ReplicatedAllReduce", "ReplicatedReduceScatter", "ReplicatedAllGather")}
    xs = rnd(4, 2, 3)
    st = lambda: TraceState(replica_axis="r", replication_factor=4)
    f = lambda op: jax.vmap(lambda v: execute(graphs[op], {"x": v}, st())["y0"], axis_name="r")(xs)
    np.testing.assert_allclose(f("ReplicatedAllReduce"), np.broadcast_to(xs.sum(0), xs.shape), rtol=1e-5)
    rs = f("ReplicatedReduceScatter")
    flat = np.pad(xs.sum(0).ravel(), (0, 2))
    np.testing.assert_allclose(rs, flat.reshape(4, 2), rtol=1e-5)
    np.testing.assert_allclose(f("ReplicatedAllGather")[1], xs.reshape(-1), rtol=1e-6)


def test_spline_basis_and_weighting():
    pseudo = np.array([[0.2, 0.7], [0.9, 0.1]], np.float32)
    ks, op = np.array([3, 4], np.int32), np.array([1, 1], np.uint8)
    basis, wi = run("SplineBasis", {"p": pseudo, "k": ks, "o": op}, n_out=2, degree=1)
    assert basis.shape == (2, 4) and wi.shape == (2, 4)
    np.testing.assert_allclose(basis.sum(1), 1, rtol=1e-6)
    v = pseudo[0] * (ks - 1)  # open spline, degree 1: positions 0.4 and 2.1
    np.testing.assert_allclose(basis[0], [(1 - .4) * (1 - .1), .4 * (1 - .1), (1 - .4) * .1, .4 * .1], rtol=1e-5)
    np.testing.assert_array_equal(wi[0], [0 + 2 * 3, 1 + 2 * 3, 0 + 3 * 3, 1 + 3 * 3])
    x, w = rnd(2, 3), rnd(12, 3, 2)
    out = run("SplineWeighting", {"x": x, "w": w, "b": basis, "i": wi})
    exp = np.stack([sum(basis[e, s] * x[e] @ w[wi[e, s]] for s in range(4)) for e in range(2)])
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6)
    assert v[1] == pytest.approx(2.1)
