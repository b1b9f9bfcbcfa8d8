"""Automatic loss scaling (ALS) against a NumPy transcription of PopART's algorithm
(willow/src/transforms/automaticlossscaling.cpp, willow/src/popx/op/lossscaleupdatex.cpp).

The statistics are recomputed from the tracked gradients themselves, anchored as
``Gradient___<id>`` (one value per micro-batch and replica): an independent check of the
histograms, their sums over micro-batches and replicas, the update rule, ``updatePeriod`` and
the anchors. Models are float16 (PopART tracks only float16 gradients) with a non-const loss
scaling, as PopART requires.
"""
from __future__ import annotations

import numpy as np
import pytest

import popart
from popart import testing

CPU = popart.DeviceManager().createCpuDevice
G = popart.reservedGradientPrefix()
B, I, H, O = 4, 6, 5, 3
ALS_TENSORS = ["finalLossScale", "lossScaleUpdateFactor", "summedHistograms",
               "summedCastedHistograms", "lossScaling_FLOAT16"]


def fp16_model(seed=0, scale=1.0):
    """x -> matmul(w1) + b1 -> relu -> matmul(w2) -> l1loss (Sum): all float16."""
    rs = np.random.RandomState(seed)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [B, I]), "x")
    w1 = b.addInitializedInputTensor((rs.randn(I, H) * scale).astype(np.float16), "w1")
    b1 = b.addInitializedInputTensor((rs.randn(H) * 0.1).astype(np.float16), "b1")
    w2 = b.addInitializedInputTensor((rs.randn(H, O) * scale).astype(np.float16), "w2")
    mm1 = b.aiOnnx.matmul([x, w1])
    h = b.aiOnnx.add([mm1, b1])
    r = b.aiOnnx.relu([h])
    y = b.aiOnnx.matmul([r, w2])
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    return b, dict(x=x, w1=w1, b1=b1, w2=w2, mm1=mm1, h=h, r=r, y=y, loss=loss)


# The gradients PopART's AllNonViewChangingGradientTensors tracks in this model: the MatMul
# grads (w1, r, w2), the ReluGrad (h) and b1's ReduceSum; not mm1 (Add's grad of a same-shape
# input is the output's gradient itself) nor y (L1Grad reads the loss-scaling tensor).
ALL_NON_VIEW = ("w1", "b1", "h", "r", "w2")
CONV_AND_MATMUL = ("w1", "r", "w2")


def als_options(*, accumulation=1, replication=1, **settings):
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.enabled = True
    for k, v in settings.items():
        setattr(opts.automaticLossScalingSettings, k, v)
    if accumulation > 1:
        opts.enableGradientAccumulation, opts.accumulationFactor = True, accumulation
    if replication > 1:
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, replication
    return opts


def session(b, ids, opts, anchors, bps, ls=64.0, lr=0.01, optimizer=None, device=None):
    opt = optimizer or popart.SGD({"defaultLearningRate": (lr, False), "lossScaling": (ls, False)})
    arts = {a: (art if isinstance(art, popart.AnchorReturnType) else popart.AnchorReturnType(art))
            for a, art in anchors.items()}
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(bps, arts), ids["loss"], opt,
                               device or CPU(), userOptions=opts)
    return s


def feeds(ids, bps, lead=(), seed=1, mult=1.0):
    rs = np.random.RandomState(seed)
    return {ids["x"]: (rs.randn(bps, *lead, B, I) * mult).astype(np.float16)}


def run(s, inputs):
    if not getattr(s, "weights_written", False):   # PopART: weightsFromHost before run
        s.prepareDevice()
        s.weightsFromHost()
        s.weights_written = True
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO(inputs, out))
    return out


def read_weight(s, tid, dtype=np.float16):
    s.weightsToHost()
    v = np.zeros(s.getInfo(tid).shape() if tid != "lossScaleUpdateFactor" else (), dtype)
    s.readWeights(popart.PyWeightsIO({tid: v}))
    return v


# ---------------------------------------------------------------------- NumPy reference
def reference(grads, *, period=1, edge=0.125, threshold=1e-7, factor=1.0, counter=-1):
    """PopART's ALS over a step. ``grads``: per tracked tensor an array [batches, A, R, ...]
    of float16 gradients. Returns per batch: the factor used, the factor after the update,
    whether it updated, the summed statistics per micro-batch and replica [A, R, 2] (uint32)
    and the reduced accumulated statistics [2] (float32); and the final (factor, counter)."""
    level = np.float16(np.float32(65504.0) * np.float32(edge))     # HistogramOp levels (fp16)
    t = np.float32(threshold)
    f = t / (np.float32(1) - t)                                        # LossScaleUpdateOpx
    factor = np.float32(factor)
    rows = []
    for k in range(next(iter(grads.values())).shape[0]):
        if period > 1:                                                 # executeOpNTimesEveryMTimes
            counter = (counter + 1) % period
            on = counter < 1
        else:
            on = True
        lead = next(iter(grads.values())).shape[1:3]
        summed = np.zeros(lead + (2,), np.uint32)
        if on:
            for g in grads.values():
                flat = np.abs(g[k].reshape(lead + (-1,)))
                lower = np.sum(flat < level, axis=-1)
                summed += np.stack([lower, flat.shape[-1] - lower], -1).astype(np.uint32)
        total = summed.astype(np.float32).sum(axis=(0, 1))             # accumulate, all-reduce
        before = factor
        if on:
            factor = np.float32(factor * 0.5) if total[1] > total[0] * f else np.float32(factor * 2)
        rows.append(dict(factor=before, updated=factor, on=on, summed=summed, total=total))
    return rows, (factor, counter)


# ---------------------------------------------------------------------- the scale sequence
@pytest.fixture(scope="module")
def accum_replicated():
    """A = 2, R = 2, updatePeriod 2, non-default edge and threshold; two runs of 6 batches."""
    b, ids = fp16_model(seed=3, scale=1.0)
    settings = dict(updatePeriod=2, binEdgeLocation=0.01, thresholdUpperCountProportion=0.05)
    opts = als_options(accumulation=2, replication=2, **settings)
    anchors = {a: "ALL" for a in ALS_TENSORS + ["Accum___autoLossScaleStats",
                                                "summedHistograms_reduced"]}
    anchors.update({G + ids[t]: "ALL" for t in ALL_NON_VIEW})
    anchors.update({G + ids[t] + "_statistics": "ALL" for t in ALL_NON_VIEW})
    anchors[ids["loss"]] = "ALL"
    s = session(b, ids, opts, anchors, bps=6, ls=4.0, device=popart.DeviceManager().acquireAvailableDevice(2))
    s.prepareDevice()
    s.weightsFromHost()
    first = run(s, feeds(ids, 6, (2, 2), seed=5, mult=4.0))
    second = run(s, feeds(ids, 6, (2, 2), seed=6, mult=4.0))
    return s, ids, settings, first, second


def test_scale_sequence_with_accumulation_replication_and_update_period(accum_replicated):
    s, ids, settings, first, second = accum_replicated
    state = (np.float32(1.0), -1)
    seen = []
    for out in (first, second):
        grads = {t: out[G + ids[t]] for t in ALL_NON_VIEW}
        assert grads["w1"].shape == (6, 2, 2, I, H) and grads["w1"].dtype == np.float16
        rows, state = reference(grads, period=2, edge=settings["binEdgeLocation"],
                                threshold=settings["thresholdUpperCountProportion"],
                                factor=state[0], counter=state[1])
        for k, row in enumerate(rows):
            np.testing.assert_array_equal(out["finalLossScale"][k], np.full((2, 2), 4.0 * row["factor"]))
            np.testing.assert_array_equal(out["lossScaleUpdateFactor"][k], np.full((2, 2), row["updated"]))
            np.testing.assert_array_equal(out["lossScaling_FLOAT16"][k], np.full((2, 2), 4.0))
            np.testing.assert_array_equal(out["summedHistograms"][k], row["summed"])
            np.testing.assert_array_equal(out["summedCastedHistograms"][k], row["summed"].astype(np.float32))
            np.testing.assert_array_equal(out["Accum___autoLossScaleStats"][k],
                                          np.cumsum(row["summed"].astype(np.float32), axis=0))
            np.testing.assert_array_equal(out["summedHistograms_reduced"][k],
                                          np.broadcast_to(row["total"], (2, 2, 2)))
            assert row["on"] == (k % 2 == 0)   # the first batch of every updatePeriod
            if row["on"]:
                seen.append((row["total"][1] / row["total"].sum(), row["updated"] / row["factor"]))
        # the histograms run only in the updating batches
        assert not out["summedHistograms"][1::2].any()
    # the threshold at work: overflowing elements below the proportion still double the scale
    assert any(0 < p <= 0.05 and step == 2 for p, step in seen), seen
    assert any(p > 0.05 and step == 0.5 for p, step in seen), seen
    factors = np.concatenate([first["finalLossScale"][:, 0, 0], second["finalLossScale"][:, 0, 0]])
    steps = factors[1:] / factors[:-1]
    assert (steps == 2).any() and (steps == 0.5).any() and (steps == 1).any(), factors
    assert state[0] == read_weight(s, "lossScaleUpdateFactor", np.float32)
    # per-tensor statistics (each tracked gradient's Histogram output)
    level = np.float16(np.float32(65504) * np.float32(0.01))
    for t in ALL_NON_VIEW:
        g = np.abs(first[G + ids[t]].reshape(6, 2, 2, -1))
        lower = (g < level).sum(-1)
        want = np.stack([lower, g.shape[-1] - lower], -1) * (np.arange(6) % 2 == 0)[:, None, None, None]
        np.testing.assert_array_equal(first[G + ids[t] + "_statistics"], want)


def test_gradients_are_scaled_by_final_loss_scale(accum_replicated):
    """The anchored gradients are those of loss * finalLossScale (float32 NumPy reference)."""
    s, ids, _, first, _ = accum_replicated
    rs = np.random.RandomState(3)
    w1, b1, w2 = ((rs.randn(I, H)).astype(np.float16), (rs.randn(H) * 0.1).astype(np.float16),
                  (rs.randn(H, O)).astype(np.float16))
    X = feeds(ids, 6, (2, 2), seed=5, mult=4.0)[ids["x"]]
    # batch 0 runs with the initial weights
    x = X[0].astype(np.float32)                                         # [A, R, B, I]
    h = x @ w1.astype(np.float32) + b1.astype(np.float32)
    r = np.maximum(h, 0)
    y = r @ w2.astype(np.float32)
    ls = first["finalLossScale"][0, 0, 0]
    dy = np.sign(y) * ls
    dw2 = np.swapaxes(r, -1, -2) @ dy
    np.testing.assert_allclose(first[G + ids["w2"]][0].astype(np.float32), dw2, rtol=2e-2, atol=ls * 2e-2)


def test_replication_without_accumulation():
    """R = 2, A = 1: the statistics are all-reduced every batch (summedHistograms_reduced)."""
    b, ids = fp16_model(seed=5)
    anchors = {a: "ALL" for a in ("summedHistograms_reduced", "summedHistograms", "finalLossScale")}
    anchors.update({G + ids[t]: "ALL" for t in ALL_NON_VIEW})
    s = session(b, ids, als_options(replication=2), anchors, bps=4, ls=1024.0,
                device=popart.DeviceManager().acquireAvailableDevice(2))
    out = run(s, feeds(ids, 4, (2,), seed=2, mult=3.0))
    rows, _ = reference({t: out[G + ids[t]][:, None] for t in ALL_NON_VIEW})
    for k, row in enumerate(rows):
        np.testing.assert_array_equal(out["finalLossScale"][k], [1024.0 * row["factor"]] * 2)
        np.testing.assert_array_equal(out["summedHistograms"][k], row["summed"][0])
        np.testing.assert_array_equal(out["summedHistograms_reduced"][k],
                                      np.broadcast_to(row["total"], (2, 2)))
    assert {r["updated"] / r["factor"] for r in rows} == {0.5, 2.0}, [r["factor"] for r in rows]


@pytest.fixture(scope="module")
def plain_pair():
    """The same training with and without ALS (A = 2, R = 2): nothing overflows."""
    b, ids = fp16_model(seed=4, scale=0.5)
    weights = []
    outs = []
    X = feeds(ids, 4, (2, 2), seed=7)
    for als in (True, False):
        opts = als_options(accumulation=2, replication=2) if als else popart.SessionOptions()
        if not als:
            opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
            opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
        anchors = {ids["loss"]: "ALL"}
        if als:
            anchors.update({"finalLossScale": "ALL", "lossScaleUpdateFactor": "ALL"})
        opt = popart.SGD({"defaultLearningRate": (0.05, False), "defaultMomentum": (0.5, False),
                          "lossScaling": (2.0, False)})
        s = session(b, ids, opts, anchors, bps=4, optimizer=opt)
        outs.append(run(s, X))
        weights.append({t: read_weight(s, ids[t]) for t in ("w1", "b1", "w2")})
    return ids, weights, outs


def test_weights_equal_a_run_without_als(plain_pair):
    ids, (w_als, w_ref), (out, _) = plain_pair
    np.testing.assert_array_equal(out["finalLossScale"][:, 0, 0], 2.0 * 2.0 ** np.arange(4))
    np.testing.assert_array_equal(out["lossScaleUpdateFactor"][:, 0, 0], 2.0 ** np.arange(1, 5))
    for t in w_als:
        np.testing.assert_array_equal(w_als[t], w_ref[t])
    rs = np.random.RandomState(4)
    w1 = (rs.randn(I, H) * 0.5).astype(np.float16)
    assert np.abs(w_als["w1"].astype(np.float32) - w1).max() > 1e-3


@pytest.mark.parametrize("make", [
    lambda: popart.Adam({"lossScaling": (10.0, False), "defaultLearningRate": (0.05, False),
                         "defaultWeightDecay": (0.01, False), "defaultBeta1": (0.5, False),
                         "defaultBeta2": (0.5, False), "defaultEps": (0.5, False)}),
    lambda: popart.Adaptive({"lossScaling": (10.0, False), "defaultLearningRate": (0.05, False)}),
], ids=["Adam", "Adaptive"])
def test_weights_equal_a_run_without_als_other_optimizers(make):
    """PopART's identical-weight-updates tests also use Adam (and its optimizers all divide by
    the final loss scale)."""
    weights = []
    for opts in (als_options(), popart.SessionOptions()):
        b, ids = fp16_model(seed=4, scale=0.5)
        s = session(b, ids, opts, {ids["loss"]: "ALL"}, bps=3, optimizer=make())
        run(s, feeds(ids, 3, seed=7))
        weights.append([read_weight(s, ids[t]) for t in ("w1", "b1", "w2")])
    for a, c in zip(*weights):
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------------- anchors, periods
@pytest.fixture(scope="module")
def return_types():
    """A = 1, R = 1, updatePeriod 3; gradients grow until they cross the edge; ALS tensors
    anchored with EveryN / Final / Sum. Runs twice, and updates the optimizer in between."""
    b, ids = fp16_model(seed=2, scale=1.0)
    opts = als_options(updatePeriod=3)
    anchors = {"finalLossScale": popart.AnchorReturnType("EVERYN", 2),
               "lossScaleUpdateFactor": "FINAL", "summedHistograms": "SUM",
               "lossScaling_FLOAT16": "ALL", "summedCastedHistograms": "ALL"}
    anchors.update({G + ids[t]: "ALL" for t in ALL_NON_VIEW})
    s = session(b, ids, opts, anchors, bps=8, ls=512.0)
    s.prepareDevice()
    s.weightsFromHost()
    first = run(s, feeds(ids, 8, seed=3, mult=2.0))
    s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.0, False),
                                          "lossScaling": (256.0, False)}))
    second = run(s, feeds(ids, 8, seed=4, mult=2.0))
    return s, ids, first, second


def test_anchor_return_types_and_update_period(return_types):
    s, ids, first, second = return_types
    state = (np.float32(1.0), -1)
    updates = []
    for out, ls in ((first, 512.0), (second, 256.0)):
        grads = {t: out[G + ids[t]][:, None, None] for t in ALL_NON_VIEW}
        rows, state = reference(grads, period=3, factor=state[0], counter=state[1])
        final = np.array([ls * r["factor"] for r in rows], np.float32)
        np.testing.assert_array_equal(out["finalLossScale"], final[1::2])
        np.testing.assert_array_equal(out["lossScaleUpdateFactor"], rows[-1]["updated"])
        np.testing.assert_array_equal(out["summedHistograms"], sum(r["summed"][0, 0] for r in rows))
        np.testing.assert_array_equal(out["lossScaling_FLOAT16"], np.full(8, ls, np.float32))
        ons = np.array([r["on"] for r in rows])
        np.testing.assert_array_equal(out["summedCastedHistograms"][~ons], 0)
        updates.append([r["updated"] / r["factor"] for r in rows if r["on"]])
    assert out["summedHistograms"].dtype == np.uint32
    assert 0.5 in sum(updates, []) and 2.0 in sum(updates, []), updates   # both directions
    assert state[0] == read_weight(s, "lossScaleUpdateFactor", np.float32)


def test_update_period_counts_across_runs(return_types):
    """8 batches with updatePeriod 3: the second run starts at counter 8 mod 3 = 2, so its
    updates fall in its batches 1, 4 and 7."""
    s, ids, first, second = return_types
    for out, want in ((first, [0, 3, 6]), (second, [1, 4, 7])):
        on = np.flatnonzero(out["summedCastedHistograms"].sum(-1) > 0)
        np.testing.assert_array_equal(on, want)


# ---------------------------------------------------------------------- tracking methods
@pytest.mark.parametrize("method,toTrack,tracked", [
    ("AllNonViewChangingGradientTensors", None, ALL_NON_VIEW),
    ("ConvAndMatmulGradients", None, CONV_AND_MATMUL),
    ("GradientsOfUserSpecifiedTensors", ["mm1", "y"], ("mm1", "y")),
])
def test_tracking_methods_select_different_tensors(method, toTrack, tracked):
    b, ids = fp16_model(seed=1)
    kw = dict(gradientTensorTrackingMethod=getattr(popart.GradientTensorTrackingMethod, method))
    if toTrack is not None:
        kw["toTrackTensors"] = [ids[t] for t in toTrack]
    opts = als_options(**kw)
    anchors = {"summedHistograms": "ALL"}
    anchors.update({G + ids[t]: "ALL" for t in tracked})
    anchors.update({G + ids[t] + "_statistics": "ALL" for t in tracked})
    s = session(b, ids, opts, anchors, bps=2)
    out = run(s, feeds(ids, 2, seed=9))
    size = sum(out[G + ids[t]][0].size for t in tracked)
    assert out["summedHistograms"].sum(-1).tolist() == [size, size]
    level = np.float16(65504 * 0.125)
    for t in tracked:
        g = np.abs(out[G + ids[t]].reshape(2, -1))
        lower = (g < level).sum(-1)
        np.testing.assert_array_equal(out[G + ids[t] + "_statistics"],
                                      np.stack([lower, g.shape[1] - lower], -1))
    untracked = sorted(set(ids) - set(tracked) - {"x", "loss"})
    for t in untracked:   # an untracked gradient has no Histogram
        bad = session(b, ids, opts, {G + ids[t] + "_statistics": "ALL"}, bps=1)
        with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):
            bad.initAnchorArrays()


def popart_test_model():
    """PopART's own ALS test model (tests/integration/loss_scaling_util_test.py):
    in0 - MatMul(w0) - Relu - BatchNormalization - Conv(w1) - Reshape - Softmax - Nll."""
    b = popart.Builder()
    shape = [2, 4, 2, 2]
    t0 = b.addInputTensor("FLOAT16", shape)
    data = np.random.RandomState(0).rand(*shape).astype(np.float16)
    t1, t2 = b.addInitializedInputTensor(data), b.addInitializedInputTensor(data)
    mm = b.aiOnnx.matmul([t0, t1])
    r = b.aiOnnx.relu([mm])
    bn_data = np.random.RandomState(1).rand(4).astype(np.float16)
    bn_in = [b.addInitializedInputTensor(bn_data) for _ in range(4)]
    bn = b.aiOnnx.batchnormalization([r, bn_in[1], bn_in[0], bn_in[2], bn_in[3]], 5, 1e-05, 0.1)[0]
    conv = b.aiOnnx.conv([bn, t2])
    rs = b.reshape_const(b.aiOnnx, [conv], [2, 2])
    labels = b.addInputTensor("INT32", [2])
    loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([rs]), labels], ignoreIndex=1)
    return b, dict(t1=t1, t2=t2, mm=mm, r=r, bn=bn, conv=conv, rs=rs, scale=bn_in[1],
                   bias=bn_in[0], loss=loss)


@pytest.mark.parametrize("method,tracked", [
    # MatMul (t1), ReluGrad (mm), ConvDataGrad -> Conv (bn), ConvWeightsGrad (t2); not the
    # BatchNormGradOp's outputs (it reads the scale, a Variable), not the fused
    # NllWithSoftmaxGradDirect's (it reads the loss scaling), not ReshapeGrad's (a view)
    ("AllNonViewChangingGradientTensors", ("t1", "mm", "bn", "t2")),
    ("ConvAndMatmulGradients", ("t1", "bn", "t2")),
])
def test_tracked_gradients_of_popart_s_test_model(method, tracked):
    b, ids = popart_test_model()
    opts = als_options(gradientTensorTrackingMethod=getattr(popart.GradientTensorTrackingMethod, method))
    for t in ids:
        if t == "loss":
            continue
        s = session(b, ids, opts, {G + ids[t] + "_statistics": "ALL"}, bps=1)
        if t in tracked:
            assert s.initAnchorArrays()[G + ids[t] + "_statistics"].shape == (2,)
        else:
            with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):
                s.initAnchorArrays()


def test_tracking_method_values_are_popart_s():
    m = popart.GradientTensorTrackingMethod
    assert (int(m.AllNonViewChangingGradientTensors), int(m.ConvAndMatmulGradients),
            int(m.GradientsOfUserSpecifiedTensors)) == (0, 1, 2)
    s = popart.AutomaticLossScalingSettings(True, ["a"], 0.5, 0.2, 3, m.GradientsOfUserSpecifiedTensors)
    assert (s.enabled, s.toTrackTensors, s.binEdgeLocation, s.thresholdUpperCountProportion,
            s.updatePeriod) == (True, ["a"], 0.5, 0.2, 3)


# ---------------------------------------------------------------------- errors
def plan_error(opts=None, *, model=None, optimizer=None, inference=False, anchors=None):
    """The error PopART gives: at construction (the checks made when the IR is built, as
    PopART's) or at prepareDevice. Returns (the session or None, the message)."""
    b, ids = model or fp16_model()
    opts = opts or als_options()
    df = popart.DataFlow(1, anchors or [ids["loss"]])
    s = None
    with pytest.raises(popart.popart_exception) as e:
        if inference:
            s = popart.InferenceSession(b.getModelProto(), df, CPU(), userOptions=opts)
        else:
            s = popart.TrainingSession(b.getModelProto(), df, ids["loss"],
                                       optimizer or popart.SGD({"lossScaling": (2.0, False)}),
                                       CPU(), userOptions=opts)
        s.prepareDevice()
        s.weightsFromHost()
    if s is not None:
        s.test_ids = ids
    return s, str(e.value)


def test_error_inference_session():
    s, msg = plan_error(inference=True)
    assert s is None   # raised by the constructor, as PopART's
    assert msg == "[AutomaticLossScale transform] Only compatible when doing training"


def test_error_const_loss_scaling():
    _, msg = plan_error(optimizer=popart.SGD({"lossScaling": (2.0, True)}))
    assert msg.endswith("The optimizer must have non-const loss scaling")
    _, msg = plan_error(optimizer=popart.ConstSGD(0.1))
    assert msg.endswith("The optimizer must have non-const loss scaling")


def test_error_pipelining_without_accumulation():
    opts = als_options()
    opts.enablePipelining = True
    _, msg = plan_error(opts)
    assert msg.endswith(
        "Automatic loss scaling is not currently supported when the 'enablePipelining' "
        "SessionOption is set to 'true', but the 'enableGradientAccumulation' SessionOption "
        "is set to 'false'")


def fp32_model():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]))
    w = b.addInitializedInputTensor(np.ones((2, 2), np.float32))
    y = b.aiOnnx.matmul([x, w])
    return b, dict(x=x, w=w, y=y, loss=b.aiGraphcore.identityloss([y]))


def test_error_no_fp16_tracked_gradients():
    _, msg = plan_error(model=fp32_model())
    assert msg == "[AutomaticLossScale transform] No tracked gradient tensors of type fp16 were found."


def test_error_to_track_tensors_and_method_go_together():
    m = popart.GradientTensorTrackingMethod
    _, msg = plan_error(als_options(toTrackTensors=["w1"]))
    assert msg.endswith("toTrackTensors has been set, but gradientTensorTrackingMethod has not been "
                        "set to 'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors'.")
    _, msg = plan_error(als_options(gradientTensorTrackingMethod=m.GradientsOfUserSpecifiedTensors))
    assert msg.endswith("gradientTensorTrackingMethod set to "
                        "'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors' but "
                        "'toTrackTensors' has not been set")


def test_error_to_track_tensors_names():
    m = popart.GradientTensorTrackingMethod.GradientsOfUserSpecifiedTensors
    _, msg = plan_error(als_options(gradientTensorTrackingMethod=m, toTrackTensors=[]))
    assert msg.startswith("[PreAutomaticLossScale] An empty list was set as the value of "
                          "'toTrackTensors'.")
    _, msg = plan_error(als_options(gradientTensorTrackingMethod=m,
                                    toTrackTensors=["w1", "nope", "also_not"]))
    assert msg.startswith("[PreAutomaticLossScale] Some of the tensors in the "
                          "'automaticLossScalingSettings.toTrackTensors' list do not exist in the "
                          "model.")
    assert "'nope'" in msg and "'also_not'" in msg and "'w1'" not in msg
    # checked before the training check, as PopART's PreAutomaticLossScale runs first
    _, msg = plan_error(als_options(gradientTensorTrackingMethod=m, toTrackTensors=["nope"]),
                        inference=True)
    assert "'nope'" in msg


def test_error_to_track_tensor_not_float16():
    """A user-specified tensor with a float32 gradient (a mixed-precision model)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]))
    w = b.addInitializedInputTensor(np.ones((2, 2), np.float32))
    mm = b.aiOnnx.matmul([x, w])
    c = b.aiOnnx.cast([mm], "FLOAT16")
    w2 = b.addInitializedInputTensor(np.ones((2, 2), np.float16))
    y = b.aiOnnx.matmul([c, w2])
    loss = b.aiGraphcore.l1loss([y], 1.0)
    model = (b, dict(x=x, loss=loss))
    # the default method tracks the float16 gradients (c's, w2's) only: no error
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [G + c + "_statistics"]), loss,
                               popart.SGD({"lossScaling": (2.0, False)}), CPU(), userOptions=als_options())
    assert s.initAnchorArrays()[G + c + "_statistics"].shape == (2,)
    m = popart.GradientTensorTrackingMethod.GradientsOfUserSpecifiedTensors
    _, msg = plan_error(als_options(gradientTensorTrackingMethod=m, toTrackTensors=[mm]), model=model)
    assert msg == (f"[AutomaticLossScale transform] Unsupported data type FLOAT for to-track "
                   f"tensor '{G + mm}'")


def test_mixed_precision_trackable_tensors():
    """PopART's test_auto_loss_scaling_with_mixed_precision_trackable_tensors model compiles:
    float32 and float16 parts, an IdentityLoss (so EnsureFp32LossScale makes the first
    gradients float32); the grad sum of mm1's two partial gradients and t2's are tracked."""
    b = popart.Builder()
    t0 = b.addInputTensor("FLOAT", [2, 2])
    t1 = b.addInitializedInputTensor(np.random.RandomState(0).rand(2, 2).astype(np.float32))
    t2 = b.aiOnnx.cast([b.aiOnnx.matmul([t0, t1])], "FLOAT16")
    t3 = b.addInputTensor("FLOAT16", [2, 2])
    mm1 = b.aiOnnx.matmul([t2, t3])
    loss = b.aiGraphcore.identityloss([b.aiOnnx.matmul([mm1, mm1])])
    ids = dict(loss=loss)
    for t in (mm1, t2):
        s = session(b, ids, als_options(), {G + t + "_statistics": "ALL"}, bps=1)
        assert s.initAnchorArrays()[G + t + "_statistics"].shape == (2,)


@pytest.mark.parametrize("method,tracked", [
    ("AllNonViewChangingGradientTensors", ("w1", "b1", "h")),
    ("ConvAndMatmulGradients", ("w1",)),
])
def test_identity_loss_leaves_float32_gradients_untracked(method, tracked):
    """With a float16 IdentityLoss, EnsureFp32LossScale makes y's gradient float32 and the
    second MatMul's grads float32 with a down-cast: r and w2 are not tracked."""
    b, ids = fp16_model()
    loss = b.aiGraphcore.identityloss([ids["y"]])
    ids = {**ids, "loss": loss}
    opts = als_options(gradientTensorTrackingMethod=getattr(popart.GradientTensorTrackingMethod, method))
    for t in ("w1", "b1", "w2", "mm1", "h", "r", "y"):
        s = session(b, ids, opts, {G + ids[t] + "_statistics": "ALL"}, bps=1)
        if t in tracked:
            s.initAnchorArrays()
        else:
            with pytest.raises(popart.popart_exception, match="not in Ir Tensors"):
                s.initAnchorArrays()


@pytest.mark.parametrize("value", [-0.1, 1.1])
def test_error_bin_edge_location_range(value):
    _, msg = plan_error(als_options(binEdgeLocation=value))
    assert msg.startswith("[AutomaticLossScale transform] Out of range value for 'binEdgeLocation'. "
                          f"The current value is {value}, but it should be in the range [0, 1].")


@pytest.mark.parametrize("value", [-0.1, 1.1])
def test_error_threshold_range(value):
    _, msg = plan_error(als_options(thresholdUpperCountProportion=value))
    assert msg.startswith("Out of range value for 'thresholdUpperCountProportion'. The current "
                          f"value is {value}, but it should be in the range [0, 1].")


@pytest.mark.parametrize("edge,threshold", [(0.0, 0.0), (1.0, 1.0)])
def test_range_ends_are_accepted(edge, threshold):
    b, ids = fp16_model()
    s = session(b, ids, als_options(binEdgeLocation=edge, thresholdUpperCountProportion=threshold),
                {"finalLossScale": "ALL"}, bps=1)
    assert s.initAnchorArrays()["finalLossScale"].shape == ()   # bps 1: no batch dimension


def test_als_tensors_that_do_not_exist_are_not_anchors():
    """Without accumulation there is no statistics accumulator; without replication no
    all-reduced statistics; without ALS none of them."""
    for name in ("Accum___autoLossScaleStats", "summedHistograms_reduced"):
        _, msg = plan_error(anchors=[name])
        assert f"Anchor tensor `{name}' not in Ir Tensors" in msg
    _, msg = plan_error(popart.SessionOptions(), anchors=["finalLossScale"])
    assert "Anchor tensor `finalLossScale' not in Ir Tensors" in msg


def test_error_leaves_the_session_usable_after_the_fix():
    """thresholdUpperCountProportion is checked at prepareDevice (LossScaleUpdateOpx), so
    the session stays; binEdgeLocation at construction (the transform, in Ir::prepare)."""
    s, msg = plan_error(als_options(binEdgeLocation=2.0), anchors=["finalLossScale"])
    assert s is None and "binEdgeLocation" in msg
    s, msg = plan_error(als_options(thresholdUpperCountProportion=2.0), anchors=["finalLossScale"])
    assert "thresholdUpperCountProportion" in msg
    s.options.automaticLossScalingSettings.thresholdUpperCountProportion = 0.05
    s.prepareDevice()
    s.weightsFromHost()
    out = run(s, feeds(s.test_ids, 1))
    assert out["finalLossScale"] == 2.0


@pytest.mark.parametrize("recompute", [False, True])
def test_loss_scale_past_float16_range(recompute):
    """A float16 Nll loss scaled by 2**17 (finalLossScale past float16's 65504): the loss's
    gradient runs in float32 (PopART's mixed-precision loss-grad ops under
    EnsureFp32LossScale), so the float16 gradients stay finite and the step trains as with a
    small loss scale (without it the loss's gradient is inf and the weights NaN); also when
    the ops before the loss are recomputed."""
    batch, rs = 64, np.random.RandomState(1)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [batch, I]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [batch]), "label")
    w = b.addInitializedInputTensor(np.random.RandomState(0).randn(I, O).astype(np.float16), "w")
    logits = b.aiOnnx.matmul([x, w])
    if recompute:   # a recompute segment just before the loss
        b.recomputeOutputInBackwardPass(logits, popart.RecomputeType.Recompute)
    probs = b.aiOnnx.softmax([logits], axis=1)
    if recompute:   # ... which would close with the loss op (kept out: it runs in float32)
        b.recomputeOutputInBackwardPass(probs, popart.RecomputeType.Recompute)
    loss = b.aiGraphcore.nllloss([probs, lab], reduction=popart.ReductionType.Mean)
    inputs = {x: (rs.randn(batch, I) * 0.05).astype(np.float16),
              lab: rs.randint(0, O, batch).astype(np.int32)}
    trained = {}
    for ls in (1024.0, 2.0 ** 17):
        s = session(b, dict(loss=loss), als_options(), {loss: "ALL", "finalLossScale": "ALL"}, 1, ls=ls, lr=0.1)
        s.prepareDevice()
        s.weightsFromHost()
        out = run(s, inputs)
        assert out["finalLossScale"] == ls
        trained[ls] = read_weight(s, w)
    assert np.isfinite(trained[2.0 ** 17]).all()
    program = testing.step_program(s)
    assert program.float32_loss == loss and bool(program.segments) == recompute
    np.testing.assert_array_equal(trained[2.0 ** 17], trained[1024.0])


def test_tap_counts_are_exact_past_float32_integers():
    """A tap's histogram of a gradient with more than 2**24 elements (float32's exact
    integers) is exact: its counts travel as two base-4096 digits."""
    import jax
    import jax.numpy as jnp
    from popart.engine import als
    plan = als.AlsPlan(tracked=[], specs={}, level=np.float16(8188.0), f=np.float32(1e-7),
                       period=1, loss_scaling_id="lossScaling_FLOAT16")
    n = 2 ** 24 + 2 ** 20 + 3
    scale = jnp.where(jnp.arange(n) % 1001 == 0, jnp.float16(10000.0), jnp.float16(1.0))   # upper: 1 in 1001
    stat = jax.grad(lambda s: jnp.sum((plan.tap(jnp.ones(n, jnp.float16), s) * scale).astype(jnp.float32)))(
        jnp.zeros(als.STAT_SHAPE, jnp.float32))
    upper = (n + 1000) // 1001
    assert (n - upper) % 2 == 1 and n - upper > 2 ** 24   # not a float32
    np.testing.assert_array_equal(np.asarray(plan.counts(stat)), [n - upper, upper])
