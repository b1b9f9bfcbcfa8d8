"""ai.graphcore ops run by the op tester against PyTorch / NumPy references written from the
API reference."""
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import popart

from op_tester import Const, one_op

GC = "ai.graphcore"
GRAD = popart.reservedGradientPrefix()
RNG = np.random.default_rng(0)


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


gc = functools.partial(one_op, domain=GC)   # customOp: attribute types from their values


T = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731


# ---------------------------------------------------------------------------------------
# Losses

@pytest.mark.parametrize("reduction", ["Sum", "Mean", "NoReduction"])
@pytest.mark.parametrize("ignore", [None, 2])
def test_nll_vs_torch(op_tester, reduction, ignore):
    logits = rnd(6, 5)
    label = np.array([0, 2, 4, 2, 1, 3], np.int32)
    lp = torch.log_softmax(T(logits), -1)
    tred = {"Sum": "sum", "Mean": "mean", "NoReduction": "none"}[reduction]
    exp = F.nll_loss(lp, T(label).long(), reduction=tred,
                     ignore_index=-100 if ignore is None else ignore).numpy()
    attrs = {} if ignore is None else {"ignoreIndex": ignore}
    probs = np.exp(lp.numpy())
    op_tester.run(gc("Nll", [probs, label], reduction=reduction, **attrs), lambda ref: [exp],
                  rtol=1e-5, atol=1e-6)
    op_tester.run(gc("Nll", [lp.numpy(), label], reduction=reduction, inputIsLogProbability=1,
                     **attrs), lambda ref: [exp], rtol=1e-5, atol=1e-6)


def test_nll_higher_rank_and_grad(op_tester):
    p = np.abs(rnd(2, 3, 4)) + 0.1
    p = p / p.sum(-1, keepdims=True)
    label = np.array([[0, 1, 3], [2, 2, 0]], np.int32)
    exp = -np.log(np.take_along_axis(p, label[..., None], -1)[..., 0])
    op_tester.run(gc("Nll", [p, label], reduction="NoReduction"), lambda ref: [exp], rtol=1e-5)
    p64 = p.astype(np.float64)
    # NllGradOpx's Mean divides the gradient by probs.shape[0] (2), not by the 6 labels
    op_tester.run(gc("Nll", [p64, label], grads=True, reduction="Mean"),
                  lambda ref: [np.mean(-np.log(np.take_along_axis(p64, label[..., None], -1))),
                               ref.numeric_grad(list(ref.inputs)[0]) * label.size / p.shape[0]],
                  step_type="train", rtol=1e-5, atol=1e-5)


def test_l1_and_identity_loss(op_tester):
    x = rnd(3, 4)
    for attrs, exp, rtol in [({"lambda": 0.5, "reduction": "Sum"}, 0.5 * np.abs(x).sum(), 1e-5),
                             ({"lambda": 2.0}, 2 * np.abs(x).mean(), 1e-5),
                             ({"lambda": 1.0, "reduction": "NoReduction"}, np.abs(x), 1e-7)]:
        op_tester.run(gc("L1", [x], **attrs), lambda ref: [exp], rtol=rtol, atol=0)
    op_tester.run(gc("IdentityLoss", [x]), lambda ref: [x.mean()], rtol=1e-5)
    op_tester.run(gc("IdentityLoss", [x], reduction="Sum"), lambda ref: [x.sum()], rtol=1e-5)


@pytest.mark.parametrize("reduction", ["Sum", "Mean", "NoReduction"])
def test_ctc_vs_torch(op_tester, reduction):
    Tn, N, C, S = 8, 3, 5, 3
    lp = torch.log_softmax(T(rnd(Tn, N, C)), -1)
    targets = np.array([[1, 2, 2], [3, 1, 0], [4, 4, 4]], np.uint32)
    il = np.array([8, 6, 7], np.uint32)
    tl = np.array([3, 2, 1], np.uint32)
    tred = {"Sum": "sum", "Mean": "mean", "NoReduction": "none"}[reduction]
    exp = F.ctc_loss(lp, T(targets.astype(np.int64)), T(il.astype(np.int64)), T(tl.astype(np.int64)),
                     reduction=tred)
    # output 1 is d(sum of losses)/d(log_probs); through log_softmax it is torch's logit gradient
    logits = lp.clone().requires_grad_(True)
    tsum = F.ctc_loss(torch.log_softmax(logits, -1), T(targets.astype(np.int64)),
                      T(il.astype(np.int64)), T(tl.astype(np.int64)), reduction="sum")
    g_logits = torch.autograd.grad(tsum, logits)[0].numpy()
    sm = np.exp(lp.numpy())
    loss, grad = op_tester.run(gc("Ctc", [lp.numpy(), targets, il, tl], num_outputs=2,
                                  reduction=reduction),
                               lambda ref: [exp.numpy(), None], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad - sm * grad.sum(-1, keepdims=True), g_logits, rtol=1e-4, atol=1e-5)


def test_ctc_grad_and_zero_infinity(op_tester):
    lp = np.log(np.full((3, 1, 3), 1 / 3))
    feeds = [lp, np.array([[1, 1, 1]], np.uint32), np.array([3], np.uint32),
             np.array([3], np.uint32)]  # needs 5 frames: impossible -> inf
    op_tester.run(gc("Ctc", feeds, reduction="Sum"), lambda ref: [np.array(np.inf)])
    op_tester.run(gc("Ctc", feeds, reduction="Sum", zeroInfinity=1), lambda ref: [np.array(0.0)])
    # the gradient is PopART's CtcGradOp rule (exp(lp) - occupancy), not the loss's
    # derivative: tests/test_grad_rules_nn.py checks it


def _decoder_case():
    probs = np.full((4, 1, 3), 0.05, np.float32)
    for t, c in enumerate([1, 0, 2, 2]):
        probs[t, 0, c] = 0.9
    return np.log(probs), np.array([4], np.uint32)


def _check_decoded(p, ln, lab):
    assert p.shape == (1, 2) and lab.shape == (1, 2, 4)
    assert ln[0, 0] == 2 and list(lab[0, 0, :2]) == [1, 2] and p[0, 0] > p[0, 1]


def test_ctc_beam_search_decoder(op_tester):
    _check_decoded(*op_tester.run(gc("CtcBeamSearchDecoder", list(_decoder_case()),
                                     num_outputs=3, beam_width=5, top_paths=2), None))


def test_ctc_beam_search_decoder_onnx_backend():
    """The decoder through the ONNX backend (no session)."""
    from popart import onnx_backend
    b = popart.Builder(opsets={"ai.onnx": 11, GC: 1})
    lp, lens = _decoder_case()
    ids = [b.addInputTensor(popart.TensorInfo(v)) for v in (lp, lens)]
    for o in b.customOp("CtcBeamSearchDecoder", 1, GC, ids, {"beam_width": 5, "top_paths": 2}, 3):
        b.addOutputTensor(o)
    _check_decoded(*onnx_backend.prepare(b.getModelProto()).run([lp, lens]))


# ---------------------------------------------------------------------------------------
# Elementwise

def test_elementwise_rows(op_tester):
    x, y = rnd(3, 4), rnd(3, 4)
    r = np.array([0.5, 1.5, 2.5, -0.5, 2.4], np.float32)
    a, b = np.array([7, -7, 7, -7], np.int32), np.array([3, 3, -3, -3], np.int32)
    s0, s1 = np.array(3.0, np.float32), np.array(0.5, np.float32)
    for op, inputs, attrs, exp, rtol, atol in [
        ("Gelu", [x], {}, F.gelu(T(x), approximate="tanh").numpy(), 1e-5, 1e-6),
        ("GeluErf", [x], {}, F.gelu(T(x)).numpy(), 1e-5, 1e-6),
        ("Swish", [x], {}, F.silu(T(x)).numpy(), 1e-5, 1e-6),
        ("Expm1", [x], {}, np.expm1(x), 1e-5, 0),
        ("Log1p", [np.abs(x)], {}, np.log1p(np.abs(x)), 1e-5, 0),
        ("Atan2", [y, x], {}, np.arctan2(y, x), 1e-5, 0),
        ("Square", [x], {}, x * x, 1e-6, 0),
        ("Round", [r], {}, np.array([0, 2, 2, -0, 2], np.float32), 0, 0),
        ("NearbyInt", [r], {}, np.array([0, 2, 2, -0, 2], np.float32), 0, 0),
        ("Remainder", [a, b], {}, a % b, 0, 0),
        ("Fmod", [a, b], {}, np.fmod(a, b), 0, 0),
        ("Fmod", [x, np.float32(0.7) + 0 * y], {}, np.fmod(x, np.float32(0.7)), 1e-5, 0),
        ("Scale", [x], {"scale": 2.5}, 2.5 * x, 1e-6, 0),
        ("ScaledAdd", [x, y], {"scale0": 2.0, "scale1": -1.0}, 2 * x - y, 1e-6, 0),
        ("ScaledAdd", [x, y, s0, s1], {}, 3 * x + 0.5 * y, 1e-6, 0),
        ("IncrementMod", [np.array([1., 4., 8.], np.float32)], {"increment": 3.0, "modulus": 5.0},
         np.array([4, 2, 1], np.float32), 1e-7, 0),
    ]:
        op_tester.run(gc(op, inputs, **attrs), lambda ref: [exp], rtol=rtol, atol=atol)


def test_bitwise(op_tester):
    a, b = np.array([12, 5, -3], np.int32), np.array([10, 3, 7], np.int32)
    for op, fn in [("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or), ("BitwiseXor", np.bitwise_xor),
                   ("BitwiseXnor", lambda p, q: ~(p ^ q))]:
        op_tester.run(gc(op, [a, b]), lambda ref: [fn(a, b)])
    op_tester.run(gc("BitwiseNot", [a]), lambda ref: [~a])
    with pytest.raises(Exception, match="integer"):
        op_tester.run(gc("BitwiseAnd", [rnd(2), rnd(2)]), None)


def test_detach_and_unary_zero_grad_block_gradients(op_tester):
    """x * op(x): only the direct path of x contributes to x's gradient."""
    x = rnd(3).astype(np.float64)
    for op in ("Detach", "UnaryZeroGrad"):
        def init_builder(builder):
            xi = builder.addInputTensor(x)
            blocked = builder.customOp(op, 1, GC, [xi], {}, 1)[0]
            return [builder.aiOnnx.mul([blocked, xi]), GRAD + xi]
        op_tester.run(init_builder, lambda ref: [x * x, ref.getOutputTensorGrad(0) * x],
                      step_type="train")


def test_bucketize_histogram(op_tester):
    x = np.array([[0.5, 1.0, 2.5], [3.0, -1.0, 9.0]], np.float32)
    bnd = np.array([1.0, 2.0, 3.0], np.float32)
    for right in (0, 1):
        exp = torch.bucketize(T(x), T(bnd), right=bool(right)).numpy()
        op_tester.check_dtypes = False   # the op's index dtype, not torch's int64
        op_tester.run(gc("Bucketize", [x, bnd], right=right), lambda ref: [exp])
    op_tester.check_dtypes = True
    (h,) = op_tester.run(gc("Histogram", [x], levels=[0.0, 2.0, 5.0]), None)
    np.testing.assert_array_equal(h, [1, 2, 2, 1])
    (h,) = op_tester.run(gc("Histogram", [x], levels=[0.0, 2.0, 5.0], absoluteOfInput=1), None)
    np.testing.assert_array_equal(h, [0, 3, 2, 1])


# ---------------------------------------------------------------------------------------
# Shape-like and dynamic ops

def test_shape_like_ops(op_tester):
    x = rnd(2, 8, 3, 2)
    for op, attrs, exp in [("Reshape", {"shape": [4, -1]}, x.reshape(4, -1)),
                           ("Reverse", {"dimensions": [1, 3]}, x[:, ::-1, :, ::-1]),
                           ("Slice", {"starts": [1, 0], "ends": [6, 2], "axes": [1, 2]}, x[:, 1:6, 0:2]),
                           ("Subsample", {"strides": [1, 3, 2, 1]}, x[:, ::3, ::2, :])]:
        op_tester.run(gc(op, [x], **attrs), lambda ref: [exp])
    for mode in ("DCR", "CRD"):   # as ai.onnx's DepthToSpace (onnxruntime)
        op_tester.run(gc("DepthToSpace", [x], blocksize=2, mode=mode),
                      lambda ref: [np.asarray(onnx_depth_to_space(x, mode))])
    (z,) = op_tester.run(gc("Zeros", [], shape=[2, 3], dtype=7), None)
    assert z.dtype == np.int64 and z.shape == (2, 3) and not z.any()
    (i,) = op_tester.run(gc("Init", [], shape=[4], data_type=1, tensor_type=0, init_type=1), None)
    assert i.dtype == np.float32 and i.shape == (4,) and not i.any()
    op_tester.run(gc("ZerosLike", [x]), lambda ref: [np.zeros_like(x)])


def onnx_depth_to_space(x, mode):
    import onnxruntime as ort
    from onnx import helper, TensorProto
    node = helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


def test_dynamic_ops(op_tester):
    x = rnd(5, 6)
    off = np.array([1, 2], np.uint32)
    attrs = dict(axes=[0, 1], sizes=[2, 3])
    op_tester.run(gc("DynamicSlice", [x, off], **attrs), lambda ref: [x[1:3, 2:5]])
    upd = rnd(2, 3)
    exp = x.copy(); exp[1:3, 2:5] = upd
    op_tester.run(gc("DynamicUpdate", [x, off, upd], **attrs), lambda ref: [exp])
    exp_add = x.copy(); exp_add[1:3, 2:5] += upd
    op_tester.run(gc("DynamicAdd", [x, off, upd], **attrs), lambda ref: [exp_add])
    exp_zero = x.copy(); exp_zero[:, 3:5] = 0
    op_tester.run(gc("DynamicZero", [x, np.array([3], np.int32)], axes=[1], sizes=[2]),
                  lambda ref: [exp_zero])
    x64 = x.astype(np.float64)
    op_tester.run(gc("DynamicSlice", [x64, np.array([2], np.int32)], grads=True, axes=[0], sizes=[2]),
                  lambda ref: [x64[2:4], ref.numeric_grad(list(ref.inputs)[0])],
                  step_type="train", rtol=1e-5, atol=1e-5)


def test_sequence_slice(op_tester):
    src, dst = rnd(6, 2), rnd(5, 2)
    n, so, do = (np.array(v, np.uint32) for v in ([2, 1, 0], [0, 4, 1], [1, 4, 0]))
    exp = dst.copy(); exp[1:3] = src[0:2]; exp[4] = src[4]
    op_tester.run(gc("SequenceSlice", [src, dst, n, so, do]), lambda ref: [exp])
    exp0 = np.zeros_like(dst); exp0[1:3] = src[0:2]; exp0[4] = src[4]
    op_tester.run(gc("SequenceSlice", [src, dst, n, so, do], zeroUnused=1), lambda ref: [exp0])


def test_sort_topk_median(op_tester):
    x = rnd(3, 7)
    v, i = op_tester.run(gc("Sort", [x], num_outputs=2, axis=1, descending=1),
                         lambda ref: [-np.sort(-x, 1), None])
    np.testing.assert_array_equal(np.take_along_axis(x, i, 1), v)
    tv, ti = torch.topk(T(x), 3)
    op_tester.check_dtypes = False   # indices: the op's dtype, not torch's int64
    op_tester.run(gc("TopK", [x, Const(np.array([3], np.int64))], num_outputs=2, axis=-1),
                  lambda ref: [tv, ti])
    x = rnd(4, 6)
    tv, ti = torch.median(T(x), 1)
    op_tester.run(gc("ReduceMedian", [x], num_outputs=2, axes=[1], keepdims=0), lambda ref: [tv, ti])
    op_tester.check_dtypes = True
    v, i = op_tester.run(gc("ReduceMedian", [x], num_outputs=2), None)
    assert v.shape == (1, 1) and v[0, 0] == np.sort(x.ravel())[11] and x.ravel()[i[0, 0]] == v[0, 0]


@pytest.mark.parametrize("red,tred", [("Sum", "sum"), ("Max", "amax"), ("Min", "amin"), ("Mul", "prod")])
def test_scatter_reduce_vs_torch(op_tester, red, tred):
    src = rnd(3, 6)
    idx = np.array([0, 2, 0, 3, 3, 0], np.int32)
    out = torch.zeros(3, 5).scatter_reduce(1, T(idx).long().expand(3, 6), T(src), tred, include_self=False)
    op_tester.run(gc("ScatterReduce", [src, idx], axis_size=5, axis=1, reduction=red),
                  lambda ref: [out], rtol=1e-6)
    init = rnd(3, 5)
    out = T(init).scatter_reduce(1, T(idx).long().expand(3, 6), T(src), tred, include_self=True)
    op_tester.run(gc("ScatterReduce", [src, idx, init], axis_size=5, axis=1, reduction=red),
                  lambda ref: [out], rtol=1e-6)


def test_grouped_gather_and_scatter(op_tester):
    d = rnd(2, 5, 3)
    i = np.array([[0, 4], [2, 2]], np.int32)
    op_tester.run(gc("GroupedGather", [d, i], axis=1, group_size=2),
                  lambda ref: [np.stack([d[0][[0, 4]], d[1][[2, 2]]])])
    src = rnd(2, 4)
    idx = np.array([[0, 1, 1, 2], [2, 2, 0, 0]], np.int32)
    exp = np.zeros((2, 3), np.float32)
    for g in range(2):
        np.add.at(exp[g], idx[g], src[g])
    op_tester.run(gc("GroupedScatterReduce", [src, idx], axis_size=3, axis=1, group_size=2),
                  lambda ref: [exp], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Normalization, conv, LSTM

def test_group_norm_vs_torch(op_tester):
    x, s, b = rnd(2, 6, 3, 2), rnd(6), rnd(6)
    _, m, inv = op_tester.run(gc("GroupNormalization", [x, s, b], num_outputs=3, num_groups=3,
                                 epsilon=1e-5),
                              lambda ref: [F.group_norm(T(x), 3, T(s), T(b), 1e-5), None, None],
                              rtol=1e-4, atol=1e-5)
    g = x.reshape(2, 3, -1)
    np.testing.assert_allclose(m, g.mean(-1).ravel(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, 1 / np.sqrt(g.var(-1).ravel() + 1e-5), rtol=1e-4)
    x64, s64, b64 = (v.astype(np.float64) for v in (x, s, b))
    op_tester.run(gc("GroupNormalization", [x64, s64, b64], grads=[0], num_outputs=3, num_groups=2),
                  lambda ref: [None, None, None, ref.numeric_grad(list(ref.inputs)[0])],
                  step_type="train", rtol=1e-5, atol=1e-5)


def test_popart_batchnorm_running_var_unbiased(op_tester):
    """Training: batch statistics, and the running variance assigned (unbiased, as PyTorch);
    inference: the running statistics."""
    x = rnd(4, 3, 2).astype(np.float64)
    bn = torch.nn.BatchNorm1d(3, momentum=0.1).double()
    ty = bn(T(x))

    def init_builder(builder):
        xi = builder.addInputTensor(x)
        s, b, m, v = (builder.addInitializedInputTensor(a) for a in
                      (np.ones(3), np.zeros(3), np.zeros(3), np.ones(3)))
        y = builder.customOp("BatchNormalization", 1, GC, [xi, s, b, m, v], {"momentum": 0.9}, 5)
        return [y[0], y[2], v]

    op_tester.run(init_builder, lambda ref: [ty, bn.running_var, bn.running_var],
                  step_type="train", rtol=1e-6, atol=1e-8)
    consts = [Const(np.ones(3, np.float32)), Const(np.zeros(3, np.float32)),
              Const(np.zeros(3, np.float32)), Const(np.ones(3, np.float32))]
    op_tester.run(gc("BatchNormalization", [x.astype(np.float32)] + consts),
                  lambda ref: [(x / np.sqrt(1 + 1e-5)).astype(np.float32)], rtol=1e-5)


def test_multiconv(op_tester):
    x0, w0, b0 = rnd(1, 2, 5, 5), rnd(3, 2, 3, 3), rnd(3)
    x1, w1, b1 = rnd(1, 4, 4, 4), rnd(2, 2, 2, 2), rnd(2)
    op_tester.run(gc("MultiConv", [x0, w0, b0, x1, w1, b1], num_outputs=2,
                     pads=[1, 1, 1, 1, 0, 0, 0, 0], strides=[1, 1, 2, 2]),
                  lambda ref: [F.conv2d(T(x0), T(w0), T(b0), padding=1),
                               F.conv2d(T(x1), T(w1), T(b1), stride=2, groups=2)],
                  rtol=1e-4, atol=1e-5)


def test_popart_lstm_vs_torch(op_tester):
    Tn, B, I, H = 4, 2, 3, 5
    lstm = torch.nn.LSTM(I, H)
    p = lambda t: t.detach().numpy()  # noqa: E731
    ifgo = lambda a: a.reshape(4, H, *a.shape[1:])  # noqa: E731
    wi, wh = ifgo(p(lstm.weight_ih_l0)), ifgo(p(lstm.weight_hh_l0))
    b = ifgo(p(lstm.bias_ih_l0) + p(lstm.bias_hh_l0))
    order = [1, 0, 2, 3]  # poplibs: forget, input, candidate, output
    weights = np.concatenate([wi[order].transpose(0, 2, 1), wh[order].transpose(0, 2, 1)], 1)
    x, h0, c0 = rnd(Tn, B, I), rnd(1, B, H), rnd(1, B, H)
    ty, (th, tc) = lstm(T(x), (T(h0), T(c0)))
    inputs = [x, weights, b[order], np.concatenate([h0, c0])]
    op_tester.run(gc("LSTM", inputs, num_outputs=2), lambda ref: [ty, tc[0]], rtol=1e-4, atol=1e-5)
    op_tester.run(gc("LSTM", inputs, num_outputs=2, outputFullSequence=0),
                  lambda ref: [th[0], None], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Random, side effects, collectives

def test_shaped_dropout(op_tester):
    x = np.ones((40, 30), np.float32)
    op_tester.run(gc("ShapedDropout", [x], shape=[40, 1], ratio=0.5), lambda ref: [x])
    (y, _) = op_tester.run(gc("ShapedDropout", [x], grads=True, shape=[40, 1], ratio=0.5),
                           lambda ref: [None, ref.getOutputTensorGrad(0) * ref.getOutputTensor(0)],
                           step_type="train")   # the gradient goes through the kept rows, x 2
    rows = y[:, 0]
    assert set(np.unique(y)) <= {0.0, 2.0} and (y == rows[:, None]).all() and 5 < (rows == 0).sum() < 35


def test_print_tensor_copy_var_update_nop(op_tester, capfd):
    import jax
    x = rnd(3)
    op_tester.run(gc("PrintTensor", [x], title="hello"), lambda ref: [x])
    jax.effects_barrier()
    assert "hello" in capfd.readouterr().err   # PopART prints to stderr
    op_tester.run(gc("Nop", [x]), lambda ref: [x])

    def init_builder(builder):
        v = builder.addInitializedInputTensor(np.zeros(3, np.float32))
        y = builder.customOp("CopyVarUpdate", 1, GC, [v, builder.addInputTensor(x)], {}, 1)[0]
        return [y, v]
    op_tester.run(init_builder, lambda ref: [x, x], step_type="train")


def test_abort_raises_only_when_true(op_tester):
    def init_builder(condition):
        def init(builder):
            c = builder.addInputTensor(np.array(condition))
            builder.customOp("Abort", 1, GC, [c], {}, 0)
            return [builder.aiOnnx.identity([c])]
        return init
    op_tester.run(init_builder(False), lambda ref: [np.array(False)])
    with pytest.raises(popart.poplar_runtime_error, match="Abort"):   # as poplar's AbortOnCondition
        op_tester.run(init_builder(True), None)


def test_collectives(op_tester):
    """One replica: the identity (reduce-scatter flattens); four replicas: below."""
    x = rnd(2, 3)
    op_tester.run(gc("ReplicatedAllReduce", [x]), lambda ref: [x])
    for op in ("ReplicatedAllGather", "ReplicatedReduceScatter"):   # flat, as PopART's
        op_tester.run(gc(op, [x]), lambda ref: [x.ravel()])


def test_collectives_in_a_replicated_session(op_tester):
    x = rnd(2, 3)
    op_tester.options = popart.SessionOptions()   # 4 replicas: replica r gets x + r
    op_tester.options.enableReplicatedGraphs, op_tester.options.replicatedGraphCount = True, 4
    xs = np.stack([x + r for r in range(4)])
    op_tester.run(gc("ReplicatedAllReduce", [x]), lambda ref: [np.broadcast_to(xs.sum(0), xs.shape)],
                  rtol=1e-5)
    flat = np.pad(xs.sum(0).ravel(), (0, 2))
    op_tester.run(gc("ReplicatedReduceScatter", [x]), lambda ref: [flat.reshape(4, 2)], rtol=1e-5)
    op_tester.run(gc("ReplicatedAllGather", [x]),
                  lambda ref: [np.broadcast_to(xs.reshape(-1), (4, xs.size))], rtol=1e-6)


def test_spline_basis_and_weighting(op_tester):
    pseudo = np.array([[0.2, 0.7], [0.9, 0.1]], np.float32)
    ks, op = np.array([3, 4], np.int32), np.array([1, 1], np.uint8)
    basis, wi = op_tester.run(gc("SplineBasis", [pseudo, ks, op], num_outputs=2, degree=1), None)
    assert basis.shape == (2, 4) and wi.shape == (2, 4)
    np.testing.assert_allclose(basis.sum(1), 1, rtol=1e-6)
    v = pseudo[0] * (ks - 1)  # open spline, degree 1: positions 0.4 and 2.1
    np.testing.assert_allclose(basis[0], [(1 - .4) * (1 - .1), .4 * (1 - .1), (1 - .4) * .1, .4 * .1], rtol=1e-5)
    np.testing.assert_array_equal(wi[0], [0 + 2 * 3, 1 + 2 * 3, 0 + 3 * 3, 1 + 3 * 3])
    x, w = rnd(2, 3), rnd(12, 3, 2)
    exp = np.stack([sum(basis[e, s] * x[e] @ w[wi[e, s]] for s in range(4)) for e in range(2)])
    op_tester.run(gc("SplineWeighting", [x, w, basis, wi]), lambda ref: [exp], rtol=1e-5, atol=1e-6)
    assert v[1] == pytest.approx(2.1)
