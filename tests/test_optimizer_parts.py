"""The optimizer as a chain of parts (docs/optimizers.md): unscale, clip with the norms an
engine supplies, the per-weight rule; the user's optimizer object is never changed."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import popart
from popart.optimizers import (Context, GradientNorms, chain, clip_by_norm, clip_part,
                               local_sum_squares, rule_part, unscale, unscale_part,
                               whole_tensors)

RS = np.random.RandomState(3)
W = {k: RS.randn(*s).astype(np.float32) for k, s in (("a", (3, 4)), ("b", (5,)), ("c", (2, 2)))}
G = {k: RS.randn(*v.shape).astype(np.float32) * 40 for k, v in W.items()}
CLIPS = [popart.ClipNormSettings(["a", "b"], 0.5), popart.ClipNormSettings.clipAllWeights(1.5)]


def lamb() -> popart.Adam:
    return popart.Adam({"defaultLearningRate": (0.01, True), "lossScaling": (8.0, True)},
                       mode=popart.AdamMode.Lamb, clip_norm_settings=CLIPS)


def numpy_clip(g: dict, ls: float) -> dict:
    """PopART's clipping written out: unscale, then each group by maxNorm / max(norm, maxNorm)."""
    g = {k: v / ls for k, v in g.items()}
    for ids, max_norm in ((["a", "b"], 0.5), (list(g), 1.5)):
        norm = np.sqrt(sum(np.sum(g[i].astype(np.float64) ** 2) for i in ids))
        g.update({i: g[i] * (max_norm / max(norm, max_norm)) for i in ids})
    return g


def test_unscale_then_clip_matches_numpy():
    got = clip_by_norm(CLIPS, unscale(G, 8.0), list(W))
    want = numpy_clip(G, 8.0)
    for k in W:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5)


def test_apply_is_the_chain_of_its_parts():
    opt = lamb()
    state = {k: v for w in W for k, v in opt.init_state(w, W[w]).items()}
    new_w, new_s = opt.apply(W, G, state, {})
    g = clip_by_norm(opt.clip_norm_settings, unscale(G, 8.0), list(W))
    chain_w, chain_s = opt.update(W, g, state, {}, 8.0)
    for k in W:
        np.testing.assert_array_equal(np.asarray(new_w[k]), np.asarray(chain_w[k]))
    for k in new_s:
        np.testing.assert_array_equal(np.asarray(new_s[k]), np.asarray(chain_s[k]))


def test_chain_without_clip_is_the_update_of_the_unclipped_gradients():
    """The parts compose: a chain of unscale and the rule alone skips clipping only."""
    opt = lamb()
    state = {k: v for w in W for k, v in opt.init_state(w, W[w]).items()}
    ctx = Context(opt, {}, 8.0, GradientNorms(), whole_tensors, list(W))
    _, raw_w, _ = chain(unscale_part(), rule_part(opt)).update(dict(G), dict(W), state, ctx)
    ref_w, _ = opt.update(W, unscale(G, 8.0), state, {}, 8.0)
    clipped_w, _ = opt.apply(W, G, state, {})
    np.testing.assert_array_equal(np.asarray(raw_w["a"]), np.asarray(ref_w["a"]))
    assert not np.allclose(np.asarray(raw_w["a"]), np.asarray(clipped_w["a"]))


def test_engine_supplied_per_weight_runs_the_rule():
    """The engine's ``per_weight`` decides how the rule meets the stored form: here each
    weight apart, which for an elementwise rule (SGD) gives the same numbers."""
    opt = popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, True),
                      "lossScaling": (8.0, True)}, clip_norm_settings=CLIPS)
    state = {k: v for w in W for k, v in opt.init_state(w, W[w]).items()}
    calls = []

    def one_by_one(rule, w, g, s):
        out_w, out_s = {}, {}
        for k in w:
            calls.append(k)
            nw, ns = rule({k: w[k]}, {k: g[k]}, s, local_sum_squares)
            out_w.update(nw)
            out_s.update(ns)
        return out_w, out_s
    got_w, got_s = opt.apply(W, G, state, {}, per_weight=one_by_one)
    want_w, want_s = opt.apply(W, G, state, {})
    assert calls == list(W)
    for k in W:
        np.testing.assert_array_equal(np.asarray(got_w[k]), np.asarray(want_w[k]))
    assert set(got_s) == set(want_s) == {"Accl___" + k for k in W}


def test_engine_supplied_norms_are_used():
    class Doubled(GradientNorms):   # an engine whose other half holds the same gradients
        def sum_squares(self, ids, g):
            return 2 * super().sum_squares(ids, g)

    settings = [popart.ClipNormSettings.clipAllWeights(1.0)]
    g = unscale(G, 1.0)
    plain = clip_by_norm(settings, g, list(W))
    doubled = clip_by_norm(settings, g, list(W), Doubled())
    np.testing.assert_allclose(np.asarray(doubled["a"]), np.asarray(plain["a"]) / np.sqrt(2),
                               rtol=1e-5)


def test_clip_names_weights_that_are_not_trainable():
    with pytest.raises(popart.OptimizerError, match=r"\['nope'\] are not trainable"):
        clip_by_norm([popart.ClipNormSettings(["a", "nope"], 1.0)], G, list(W))


def _manual_two_ipu_session(b, loss, opt):
    """A prepared TrainingSession of ``b``'s model on two IPUs (manual virtual graphs), its
    weights written."""
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Manual
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss, opt,
                               popart.DeviceManager().acquireAvailableDevice(2), userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    return s


def test_placed_training_leaves_the_users_optimizer_unchanged():
    """Two virtual graphs (placed when the suite's host devices allow it), Lamb with clipping
    over weights on both IPUs: the optimizer object the user passed is not copied or patched."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 8]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [4]), "label")
    h = x
    for i in range(2):
        with b.virtualGraph(i):
            w = b.addInitializedInputTensor((rs.randn(8, 8) * 0.3).astype(np.float32), f"w{i}")
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
    with b.virtualGraph(1):
        loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([h], axis=1), lab])
    opt = popart.Adam({"defaultLearningRate": (0.05, False)}, mode=popart.AdamMode.Lamb,
                      clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(0.1)])
    before = copy.deepcopy(opt.__dict__)
    s = _manual_two_ipu_session(b, loss, opt)
    s.run(popart.PyStepIO({x: rs.randn(4, 8).astype(np.float32),
                           lab: rs.randint(0, 8, 4).astype(np.int32)}, s.initAnchorArrays()))
    assert type(opt).__dict__.get("norm_axis") is None and "norm_axis" not in opt.__dict__
    assert opt.__dict__.keys() == before.keys()
    assert opt.clip_norm_settings == before["clip_norm_settings"]
    assert opt.clip_norm_settings[0].maxNorm == 0.1


class _ClippedDescent(popart.Optimizer):
    """A user's optimizer written only as parts: unscale, clip, ``w - lr * g``."""
    _TYPE = "ClippedDescent"
    _UNSET = {"learningRate": 0.1}

    def transform(self):
        return chain(unscale_part(), clip_part(self.clip_norm_settings),
                     rule_part(self, lambda w, g, s, h, ls, sum_squares:
                               (w - h["learningRate"] * g, {})))


def test_a_chained_user_optimizer_runs_placed_with_block_norms():
    """Two IPUs placed on their own devices: the same chain, with the placed step's norms
    over both IPUs' blocks, gives NumPy's clipped descent on ``sum((x @ w0 @ w1 - t)^2)``."""
    from popart import testing
    rs = np.random.RandomState(1)
    x0, t0 = rs.randn(4, 3).astype(np.float32), rs.randn(4, 2).astype(np.float32)
    w0, w1 = rs.randn(3, 5).astype(np.float32), rs.randn(5, 2).astype(np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]), "x")
    t = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 2]), "t")
    with b.virtualGraph(0):
        a = b.addInitializedInputTensor(w0, "w0")
        h = b.aiOnnx.matmul([x, a])
    with b.virtualGraph(1):
        c = b.addInitializedInputTensor(w1, "w1")
        d = b.aiOnnx.sub([b.aiOnnx.matmul([h, c]), t])
        loss = b.aiOnnx.reducesum([b.aiOnnx.mul([d, d])], keepdims=False)
    opt = _ClippedDescent({"defaultLearningRate": (0.01, True), "lossScaling": (16.0, True)},
                          clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(1.0)])
    s = _manual_two_ipu_session(b, loss, opt)
    assert testing.is_placed(s)
    v0, v1 = w0.astype(np.float64), w1.astype(np.float64)
    for _ in range(2):
        s.run(popart.PyStepIO({x: x0, t: t0}, s.initAnchorArrays()))
        dd = 2 * (x0 @ v0 @ v1 - t0)
        g0, g1 = x0.T @ dd @ v1.T, (x0 @ v0).T @ dd
        f = 1.0 / max(np.sqrt(np.sum(g0 ** 2) + np.sum(g1 ** 2)), 1.0)
        v0, v1 = v0 - 0.01 * f * g0, v1 - 0.01 * f * g1
    got = {a: np.zeros_like(w0), c: np.zeros_like(w1)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(got))
    np.testing.assert_allclose(got[a], v0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[c], v1, rtol=1e-5, atol=1e-6)
