"""Loss gradients are PopART's: Softmax + Nll differentiates as (p - onehot) * scale however
saturated the softmax is (SoftmaxGradDirect / NlllWithSoftmaxGradDirect), a lone Nll as NllGrad
(-1 / max(p, 1e-10)), L1 as lambda * sign(x). Expected values are those rules in NumPy."""
from __future__ import annotations

import numpy as np
import pytest

import popart

G = popart.reservedGradientPrefix()
N, C = 6, 5


def saturated(seed=0, dtype=np.float32):
    """Logits of magnitude ~200 whose labels sit on a class of probability ~0."""
    rs = np.random.RandomState(seed)
    z = (rs.randn(N, C) * 200).astype(dtype)
    lab = np.argmin(z, 1).astype(np.int32)
    return z, lab


def softmax(z):
    z = z.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def grads(loss_op, z, lab, dtype="FLOAT", loss_scaling=1.0, patterns=None, extra=None,
          anchors=("z",), opset=None):
    """Gradient anchors of one SGD step of ``loss_op(builder, z, lab)``
    where z = x + w (w a zero weight so the graph has something to train)."""
    b = popart.Builder(opsets={"ai.onnx": opset, "ai.graphcore": 1}) if opset else popart.Builder()
    x = b.addInputTensor(popart.TensorInfo(dtype, list(z.shape)), "x")
    lb = b.addInputTensor(popart.TensorInfo("INT32", list(lab.shape)), "lab")
    w = b.addInitializedInputTensor(np.zeros(z.shape, z.dtype), "w")
    zid = b.aiOnnx.add([x, w])
    ids = {"z": zid, "x": x, "lab": lb}
    loss = loss_op(b, zid, lb, ids)
    want = [G + ids[a] for a in anchors] + [loss] + [ids[e] for e in (extra or ())]
    df = popart.DataFlow(1, {a: popart.AnchorReturnType("ALL") for a in want})
    opt = popart.SGD({"defaultLearningRate": (1e-3, True), "lossScaling": (loss_scaling, True)})
    s = popart.TrainingSession(b.getModelProto(), df, loss, opt,
                               popart.DeviceManager().createCpuDevice(), patterns=patterns)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: z, lb: lab}, out))
    keys = ["d" + a for a in anchors] + ["loss"] + list(extra or ())
    return {k: out[v] for k, v in zip(keys, want)}


def softmax_nll(reduction, ignore=None, **kw):
    def op(b, z, lab, ids):
        p = b.aiOnnx.softmax([z], axis=1)
        ids["p"] = p
        return b.aiGraphcore.nllloss([p, lab], reduction=reduction, ignoreIndex=ignore, **kw)
    return op


def direct_rule(z, lab, reduction, ignore=None, scale=1.0):
    """PopART's SoftmaxGradDirect: (p - onehot) * gradIn, Mean dividing by the samples kept."""
    p = softmax(z)
    onehot = np.eye(z.shape[-1])[np.clip(lab, 0, z.shape[-1] - 1)]
    keep = np.ones(lab.shape) if ignore is None else (lab != ignore).astype(np.float64)
    g = (p - onehot) * keep[:, None] * scale
    if reduction == popart.ReductionType.Mean:
        g /= max(keep.sum(), 1)
    return g


@pytest.mark.parametrize("reduction", [popart.ReductionType.Sum, popart.ReductionType.Mean])
def test_saturated_softmax_nll_gives_p_minus_onehot(reduction):
    z, lab = saturated()
    out = grads(softmax_nll(reduction), z, lab)
    want = direct_rule(z, lab, reduction)
    assert np.abs(want).max() > 0.1      # autodiff through the clamp gives 0 here
    np.testing.assert_allclose(out["dz"], want, atol=1e-6)


def test_ignore_index_and_loss_scaling():
    z, lab = saturated(1)
    lab[:2] = 3
    out = grads(softmax_nll(popart.ReductionType.Mean, ignore=3), z, lab, loss_scaling=8.0)
    np.testing.assert_allclose(out["dz"], direct_rule(z, lab, popart.ReductionType.Mean, 3, 8.0),
                               atol=1e-5)
    p = softmax(z)[np.arange(N), lab]
    keep = lab != 3
    # NlllWithSoftmaxGradDirect's loss: -log(p + 1e-7) over the labels kept
    np.testing.assert_allclose(out["loss"], -np.sum(np.log(p[keep] + 1e-7)) / keep.sum(), rtol=1e-5)


def test_no_reduction_then_reduce():
    z, lab = saturated(2)

    def op(b, zid, lb, ids):
        p = b.aiOnnx.softmax([zid], axis=1)
        per = b.aiGraphcore.nllloss([p, lb], reduction=popart.ReductionType.NoReduction)
        weighted = b.aiOnnx.mul([per, b.aiOnnx.constant(np.arange(1, N + 1, dtype=np.float32))])
        return b.aiGraphcore.identityloss([weighted], reduction=popart.ReductionType.Sum)
    out = grads(op, z, lab)
    want = direct_rule(z, lab, popart.ReductionType.Sum) * np.arange(1, N + 1)[:, None]
    np.testing.assert_allclose(out["dz"], want, atol=1e-5)


def test_float16():
    z, lab = saturated(3, np.float16)
    z = (z / 20).astype(np.float16)   # ~10: p underflows in float16
    out = grads(softmax_nll(popart.ReductionType.Sum), z, lab, dtype="FLOAT16")
    assert out["dz"].dtype == np.float16
    np.testing.assert_allclose(out["dz"].astype(np.float32),
                               direct_rule(z.astype(np.float32), lab, popart.ReductionType.Sum),
                               atol=2e-3)


def nllgrad_rule(z, lab, gradin):
    """PopART's unfused chain: NllGrad (-1 / max(p, 1e-10) at the label, times gradIn), then
    SoftmaxGrad: p * (g - sum(g * p))."""
    p = softmax(z).astype(np.float32).astype(np.float64)
    onehot = np.eye(z.shape[-1])[lab]
    g = -onehot / np.maximum(p, 1e-10) * gradin
    return p * (g - np.sum(g * p, -1, keepdims=True))


def unfused_patterns() -> popart.Patterns:
    p = popart.Patterns(popart.PatternsLevel.Default)
    p.enablePattern("SoftmaxGradDirect", False)
    p.NlllWithSoftmaxGradDirect = False
    return p


def test_patterns_off_give_popart_unfused_grads():
    z = np.random.RandomState(4).randn(N, C).astype(np.float32) * 3
    z[0] = [-100, 0, 0, 0, 0]         # label 0 of sample 0 has p ~ 1e-44 < 1e-10
    lab = np.zeros(N, np.int32)
    out = grads(softmax_nll(popart.ReductionType.Sum), z, lab, patterns=unfused_patterns(),
                anchors=("z", "p"), extra=("p",))
    p = out["p"].astype(np.float64)
    np.testing.assert_allclose(out["p"], softmax(z), rtol=1e-5, atol=1e-30)
    # NllGrad: -1 / max(p, 1e-10) at the label (-1e10 where p underflowed), 0 elsewhere
    np.testing.assert_allclose(out["dp"], -np.eye(C)[lab] / np.maximum(p, 1e-10), rtol=1e-6)
    np.testing.assert_allclose(out["dz"][1:], nllgrad_rule(z, lab, 1.0)[1:], rtol=1e-4, atol=1e-6)
    # the saturated sample: the unfused chain gives p * (-1e10 + ...) ~ 0, not p - onehot
    assert abs(out["dz"][0, 0]) < 1e-6
    # the loss is Nll's own: -log(max(p, 1e-7))
    np.testing.assert_allclose(out["loss"], -np.sum(np.log(np.maximum(p[np.arange(N), lab], 1e-7))),
                               rtol=1e-5)


def test_lone_nll_grad_is_nllgrad():
    """Nll on probabilities that do not come from a Softmax: -1 / max(p, 1e-10) at the label."""
    rs = np.random.RandomState(5)
    probs = rs.rand(N, C).astype(np.float32)
    probs[0, 2] = 0.0                   # clamped in the forward pass, guarded in the grad
    probs[1, 1] = 1e-9
    lab = np.array([2, 1, 0, 3, 4, 0], np.int32)

    def op(b, zid, lb, ids):
        return b.aiGraphcore.nllloss([zid, lb], reduction=popart.ReductionType.Mean)
    out = grads(op, probs, lab, loss_scaling=4.0)
    onehot = np.eye(C)[lab]
    want = -onehot / np.maximum(probs.astype(np.float64), 1e-10) * 4.0 / N
    np.testing.assert_allclose(out["dz"], want, rtol=1e-5)
    np.testing.assert_allclose(
        out["loss"], -np.mean(np.log(np.maximum(probs[np.arange(N), lab], 1e-7))), rtol=1e-5)


def test_softmax_output_also_in_another_loss_term_is_unfused():
    """When the probabilities get gradient from elsewhere too, PopART sums the gradients before
    SoftmaxGrad (no fusion): the Nll part then follows NllGrad."""
    z = np.random.RandomState(6).randn(N, C).astype(np.float32)
    lab = np.arange(N, dtype=np.int32) % C

    def op(b, zid, lb, ids):
        p = b.aiOnnx.softmax([zid], axis=1)
        nll = b.aiGraphcore.nllloss([p, lb], reduction=popart.ReductionType.Sum)
        l1 = b.aiGraphcore.l1loss([p], 0.5, reduction=popart.ReductionType.Sum)
        return b.aiOnnx.add([nll, l1])
    out = grads(op, z, lab)
    gp = -np.eye(C)[lab] / np.maximum(softmax(z), 1e-10) + 0.5
    p = softmax(z)
    np.testing.assert_allclose(out["dz"], p * (gp - np.sum(gp * p, -1, keepdims=True)),
                               rtol=1e-4, atol=1e-6)


def test_log_softmax_nll_and_softmax_cross_entropy_are_exact():
    z, lab = saturated(7)

    def onnx_nll(b, zid, lb, ids):
        lp = b.aiOnnx.logsoftmax([zid], axis=1)
        return b.aiOnnx.negativeloglikelihoodloss([lp, lb], reduction="sum")

    def sce(b, zid, lb, ids):
        return b.aiOnnx.softmaxcrossentropyloss([zid, lb], num_outputs=1, reduction="mean")[0]
    np.testing.assert_allclose(grads(onnx_nll, z, lab, opset=13)["dz"],
                               direct_rule(z, lab, popart.ReductionType.Sum), atol=1e-6)
    np.testing.assert_allclose(grads(sce, z, lab, opset=13)["dz"],
                               direct_rule(z, lab, popart.ReductionType.Mean), atol=1e-6)


def test_l1_grad_is_lambda_sign():
    x = np.array([[-2.0, 0.0, 3.0], [0.0, 1.0, -0.5]], np.float32)
    lab = np.zeros(2, np.int32)

    def op(b, zid, lb, ids):
        return b.aiGraphcore.l1loss([zid], 0.25, reduction=popart.ReductionType.Mean)
    out = grads(op, x, lab)
    np.testing.assert_array_equal(out["dz"], 0.25 * np.sign(x) / x.size)


def test_only_nlll_fusion_off_keeps_the_direct_grad_and_nll_loss():
    z, lab = saturated(8)
    pats = popart.Patterns()
    pats.NlllWithSoftmaxGradDirect = False
    out = grads(softmax_nll(popart.ReductionType.Sum), z, lab, patterns=pats)
    np.testing.assert_allclose(out["dz"], direct_rule(z, lab, popart.ReductionType.Sum), atol=1e-6)
    p = softmax(z)[np.arange(N), lab]
    np.testing.assert_allclose(out["loss"], -np.sum(np.log(np.maximum(p, 1e-7))), rtol=1e-5)


def test_popxl_nll_loss_with_softmax_grad_is_direct():
    import popxl
    from popxl import ops
    z, lab = saturated(9)
    ir = popxl.Ir()
    with ir.main_graph:
        zt, lt = popxl.variable(z, name="z"), popxl.constant(lab)
        loss, dx = ops.nll_loss_with_softmax_grad(ops.softmax(zt, -1), lt,
                                                  reduction=popart.ReductionType.Sum)
        s1, s2 = popxl.d2h_stream(loss.shape, loss.dtype), popxl.d2h_stream(dx.shape, dx.dtype)
        ops.host_store(s1, loss)
        ops.host_store(s2, dx)
    with popxl.Session(ir, "ipu_model") as sess:
        out = sess.run()
    np.testing.assert_allclose(out[s2], direct_rule(z, lab, popart.ReductionType.Sum), atol=1e-6)
    p = softmax(z)[np.arange(N), lab]
    np.testing.assert_allclose(out[s1], -np.sum(np.log(p + 1e-7)), rtol=1e-5)
