"""Optimizers: construction, engine interface, and updates against PyTorch and NumPy references.

The NumPy references below transcribe the API reference's formulas (section 13.4) in float64,
independently of the implementation (unscaled velocity, no loss scaling inside).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from popart.errors import OptimizerError, popart_exception
from popart.optimizers import (Adam, AdamMode, Adaptive, AdaptiveMode, ClipNormSettings,
                               ConstSGD, OptimizerValue, OptimizerValueMap, SGD,
                               SGDAccumulatorAndMomentum, WeightDecayMode)
from popart.tensorinfo import DataType

W0 = np.array([[0.5, -1.2, 2.0], [0.3, 0.0, -0.7]], np.float32)
TARGET = np.array([[1.0, 0.5, -0.5], [0.2, 0.4, 0.1]], np.float32)
FIXED = np.random.default_rng(0).normal(size=(6,) + W0.shape).astype(np.float32)
STEPS = 6


def quad(w: np.ndarray, i: int) -> np.ndarray:
    """Gradient of sum((w - TARGET)^2)."""
    return (2 * (w - TARGET)).astype(np.float32)


def fixed(w: np.ndarray, i: int) -> np.ndarray:
    return FIXED[i]


GRADS = [quad, fixed]


def run(opt, grad_fn, steps=STEPS, ls=1.0, w0=W0, wid="w"):
    """Jitted `apply` steps on one weight; returns the weight after each step."""
    w, state, hyper = w0, opt.init_state(wid, w0), opt.non_const_feed([wid])
    step = jax.jit(opt.apply)
    out = []
    for i in range(steps):
        g = (grad_fn(np.asarray(w, np.float32), i) * ls).astype(w0.dtype)
        new_w, state = step({wid: w}, {wid: g}, state, hyper)
        w = new_w[wid]
        out.append(np.asarray(w))
    return out


def run_torch(make, grad_fn, steps=STEPS):
    p = torch.nn.Parameter(torch.tensor(W0))
    opt = make([p])
    out = []
    for i in range(steps):
        p.grad = torch.tensor(grad_fn(p.detach().numpy().copy(), i))
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def run_ref(update, grad_fn, steps=STEPS, clip=None):
    """NumPy reference loop; `update(w, g, state) -> w`, state a dict mutated in place."""
    w, state, out = W0.astype(np.float64), {}, []
    for i in range(steps):
        g = grad_fn(w.astype(np.float32), i).astype(np.float64)
        if clip is not None:
            g = g * min(1.0, clip / np.linalg.norm(g))
        w = update(w, g, state)
        out.append(w)
    return out


def assert_close(a, b, rtol=2e-5, atol=2e-6):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"step {i + 1}")


# ---------------------------------------------------------------- NumPy transcriptions
def ref_sgd(lr, mm=0.0, dm=0.0, wd=0.0, nesterov=False):
    def update(w, g, s):
        v = mm * s.get("v", 0.0) + (1 - dm) * (g + wd * w)
        s["v"] = v
        return w - lr * (g + wd * w + mm * v) if nesterov else w - lr * v
    return update


def ref_adam(mode, wdmode, lr, b1, b2, eps, wd, mwn=10.0):
    M = AdamMode

    def update(w, g, s):
        gt = g + wd * w if wdmode == WeightDecayMode.L2Regularization else g
        t = s["t"] = s.get("t", 0) + 1
        m = s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * gt
        if mode == M.AdaMax:
            v = s["v"] = np.maximum(b2 * s.get("v", 0.0), np.abs(gt))
        else:
            v = s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * gt ** 2
        mt = m if mode in (M.AdamNoBias, M.LambNoBias) else m / (1 - b1 ** t)
        if mode == M.AdaMax:  # PopART's AdamUpdater: no sqrt, no bias correction of v
            u = mt / (v + eps)
        else:
            vt = v if mode in (M.AdamNoBias, M.LambNoBias) else v / (1 - b2 ** t)
            u = mt / (np.sqrt(vt) + eps)
        if wdmode == WeightDecayMode.Decay:
            u = u + wd * w
        if mode in (M.Lamb, M.LambNoBias):
            r1, r2 = min(np.linalg.norm(w), mwn), np.linalg.norm(u)
            return w - (r1 / r2 if r1 > 0 and r2 > 0 else 1.0) * lr * u
        return w - lr * u
    return update


def ref_adaptive(mode, wdmode, lr, alpha, eps, wd=0.0, mm=0.0, tf=False, use_momentum=False):
    A = AdaptiveMode

    def update(w, g, s):
        gt = g + wd * w if wdmode == WeightDecayMode.L2Regularization else g
        v1 = s.get("v1", 1.0 if tf else 0.0)
        v1 = s["v1"] = v1 + gt ** 2 if mode == A.AdaGrad else alpha * v1 + (1 - alpha) * gt ** 2
        if mode == A.AdaDelta:
            v2 = s.get("v2", 0.0)
            x = gt * np.sqrt(v2 + eps) / np.sqrt(v1 + eps)
            s["v2"] = alpha * v2 + (1 - alpha) * x ** 2
        else:
            d = v1
            if mode == A.CenteredRMSProp:
                v2 = s["v2"] = alpha * s.get("v2", 0.0) + (1 - alpha) * gt
                d = v1 - v2 ** 2
            x = gt / np.sqrt(d + eps) if tf else gt / (np.sqrt(d) + eps)
        dwd = wd if wdmode == WeightDecayMode.Decay else 0.0
        if not use_momentum:
            return w - lr * (x + dwd * w)
        if tf:
            v3 = s["v3"] = mm * s.get("v3", 0.0) + lr * x
            return w * (1 - dwd) - v3
        v3 = s["v3"] = mm * s.get("v3", 0.0) + x
        return w - lr * (v3 + dwd * w)
    return update


# ---------------------------------------------------------------- SGD
@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("mm,wd,nesterov", [(0.0, 0.0, False), (0.0, 0.05, False),
                                            (0.9, 0.01, False), (0.9, 0.01, True)])
def test_sgd_matches_torch(grad_fn, mm, wd, nesterov):
    # With dampening 0, PopART's velocity from zero equals torch's buf = g on the first step.
    opt = SGD({"defaultLearningRate": (0.05, False), "defaultMomentum": (mm, True),
               "defaultWeightDecay": (wd, True), "nesterov": (nesterov, True)})
    want = run_torch(lambda p: torch.optim.SGD(p, lr=0.05, momentum=mm, weight_decay=wd,
                                               nesterov=nesterov), grad_fn)
    assert_close(run(opt, grad_fn), want)


@pytest.mark.parametrize("grad_fn", GRADS)
def test_sgd_velocity_and_loss_scaling_are_transparent_vs_torch(grad_fn):
    opt = SGD({"defaultLearningRate": (0.05, True), "defaultMomentum": (0.9, True),
               "defaultVelocityScaling": (8.0, True), "lossScaling": (256.0, False)})
    want = run_torch(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), grad_fn)
    assert_close(run(opt, grad_fn, ls=256.0), want)


@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("kw", [
    dict(mm=0.9, dm=0.3, wd=0.02),                   # dampening from the first step (not torch)
    dict(mm=0.8, dm=0.5, wd=0.0, nesterov=True),
    dict(mm=0.0, dm=0.25, wd=0.1),                   # no momentum state, dampening still applies
    dict(mm=0.7, dm=0.1, wd=0.01, vs=0.125, ls=64.0),
])
def test_sgd_matches_reference_formula(grad_fn, kw):
    kw = dict(kw)
    vs, ls = kw.pop("vs", 1.0), kw.pop("ls", 1.0)
    opt = SGD({"defaultLearningRate": (0.04, False), "defaultMomentum": (kw["mm"], False),
               "defaultDampening": (kw["dm"], True), "defaultWeightDecay": (kw["wd"], False),
               "defaultVelocityScaling": (vs, True), "lossScaling": (ls, True),
               "nesterov": (kw.get("nesterov", False), True)})
    assert_close(run(opt, grad_fn, ls=ls), run_ref(ref_sgd(0.04, **kw), grad_fn))


def test_sgd_dampening_differs_from_torch_on_first_step():
    opt = SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, True),
               "defaultDampening": (0.5, True)})
    ours = run(opt, fixed, steps=1)[0]
    np.testing.assert_allclose(ours, W0 - 0.1 * 0.5 * FIXED[0], rtol=1e-6)
    torch_first = run_torch(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
                            fixed, steps=1)[0]
    assert not np.allclose(ours, torch_first)


def test_sgd_velocity_state_is_scaled_by_velocity_scaling():
    opt = SGD({"defaultMomentum": (0.9, True), "defaultVelocityScaling": (4.0, True)})
    st = opt.init_state("w", W0)
    _, st = opt.apply({"w": W0}, {"w": FIXED[0]}, st, {})
    np.testing.assert_allclose(np.asarray(st["Accl___w"]), 4.0 * FIXED[0], rtol=1e-6)


# ---------------------------------------------------------------- Adam family
def _adam_l2(wd: float) -> tuple:
    return ({"defaultLearningRate": (0.01, False), "defaultWeightDecay": (wd, True),
             "defaultBeta1": (0.8, True), "defaultBeta2": (0.95, False), "defaultEps": (1e-6, True)},
            AdamMode.Adam, WeightDecayMode.L2Regularization,
            lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd))


# name -> (PopART's Adam: values, mode, weight decay mode; the same optimizer made in PyTorch)
ADAM_AS_TORCH = {
    "adam_l2_wd0": _adam_l2(0.0),
    "adam_l2_wd0.1": _adam_l2(0.1),
    "adam_decay_is_adamw": (
        {"defaultLearningRate": (0.01, True), "defaultWeightDecay": (0.2, False),
         "defaultEps": (1e-6, True)}, AdamMode.Adam, WeightDecayMode.Decay,
        lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.2)),
    # torch: u = max(b2*u, |g| + eps); PopART: max(b2*v, |g|) + eps. Equal when eps is negligible.
    "adamax": (
        {"defaultLearningRate": (0.02, True), "defaultWeightDecay": (0.05, True),
         "defaultEps": (1e-30, True)}, AdamMode.AdaMax, WeightDecayMode.L2Regularization,
        lambda p: torch.optim.Adamax(p, lr=0.02, betas=(0.9, 0.999), eps=1e-30, weight_decay=0.05)),
}


@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("case", ADAM_AS_TORCH)
def test_adam_family_matches_torch(case, grad_fn):
    values, mode, wdmode, make_torch = ADAM_AS_TORCH[case]
    opt = Adam(values, mode=mode, weight_decay_mode=wdmode)
    assert_close(run(opt, grad_fn), run_torch(make_torch, grad_fn))


@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("mode", list(AdamMode))
@pytest.mark.parametrize("wdmode", list(WeightDecayMode))
def test_adam_modes_match_reference_formula(grad_fn, mode, wdmode):
    hp = dict(lr=0.03, b1=0.85, b2=0.99, eps=1e-5, wd=0.05, mwn=1.5)
    opt = Adam({"defaultLearningRate": (hp["lr"], False), "defaultBeta1": (hp["b1"], True),
                "defaultBeta2": (hp["b2"], False), "defaultEps": (hp["eps"], True),
                "defaultWeightDecay": (hp["wd"], False), "maxWeightNorm": (hp["mwn"], True),
                "lossScaling": (32.0, False)}, mode=mode, weight_decay_mode=wdmode)
    assert_close(run(opt, grad_fn, ls=32.0), run_ref(ref_adam(mode, wdmode, **hp), grad_fn))


def test_lamb_trust_ratio_is_one_when_weight_is_zero():
    opt = Adam({"defaultLearningRate": (0.1, True)}, mode=AdamMode.Lamb)
    zero = np.zeros(3, np.float32)
    new, _ = opt.apply({"w": zero}, {"w": np.ones(3, np.float32)}, opt.init_state("w", zero), {})
    # m_hat / (sqrt(v_hat) + eps) = 1 / (1 + 1e-6) on step 1; ratio 1 since ||w|| = 0.
    np.testing.assert_allclose(np.asarray(new["w"]), -0.1 / (1 + 1e-6) * np.ones(3), rtol=2e-5)


def test_lamb_trust_ratio_uses_max_weight_norm():
    opt = Adam({"defaultLearningRate": (0.1, True), "maxWeightNorm": (0.5, True)},
               mode=AdamMode.LambNoBias)
    w = np.array([3.0, 4.0], np.float32)   # ||w|| = 5, clipped to 0.5
    new, _ = opt.apply({"w": w}, {"w": np.array([1.0, 0.0], np.float32)},
                       opt.init_state("w", w), {})
    u = np.array([0.1 / (np.sqrt(0.001) + 1e-6), 0.0])
    np.testing.assert_allclose(np.asarray(new["w"]), w - 0.5 / np.linalg.norm(u) * 0.1 * u,
                               rtol=1e-5)


@pytest.mark.parametrize("mode", [AdamMode.Adam, AdamMode.AdaMax, AdamMode.Lamb])
def test_adam_scaled_optimizer_state_keeps_update_and_scales_state(mode):
    kw = dict(mode=mode, weight_decay_mode=WeightDecayMode.L2Regularization)
    hp = {"defaultLearningRate": (0.01, True), "defaultWeightDecay": (0.01, True),
          "lossScaling": (64.0, True)}
    plain, scaled = Adam(hp, **kw), Adam(hp, scaled_optimizer_state=True, **kw)
    assert_close(run(scaled, quad, ls=64.0), run(plain, quad, ls=64.0), rtol=1e-5)
    g = {"w": FIXED[0] * 64}
    _, s_plain = plain.apply({"w": W0}, g, plain.init_state("w", W0), {})
    _, s_scaled = scaled.apply({"w": W0}, g, scaled.init_state("w", W0), {})
    np.testing.assert_allclose(s_scaled["Accl1___w"], 64 * np.asarray(s_plain["Accl1___w"]),
                               rtol=1e-5)
    v_scale = 64 if mode == AdamMode.AdaMax else 64 ** 2
    np.testing.assert_allclose(s_scaled["Accl2___w"], v_scale * np.asarray(s_plain["Accl2___w"]),
                               rtol=1e-5)


# ---------------------------------------------------------------- Adaptive family
@pytest.mark.parametrize("grad_fn", GRADS)
def test_adagrad_matches_torch(grad_fn):
    opt = Adaptive({"defaultLearningRate": (0.1, False), "defaultEps": (1e-6, True),
                    "defaultWeightDecay": (0.05, True)}, mode=AdaptiveMode.AdaGrad,
                   weight_decay_mode=WeightDecayMode.L2Regularization)
    want = run_torch(lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-6, weight_decay=0.05),
                     grad_fn)
    assert_close(run(opt, grad_fn), want)


@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("mm", [0.0, 0.9])
def test_rmsprop_matches_torch(grad_fn, centered, mm):
    mode = AdaptiveMode.CenteredRMSProp if centered else AdaptiveMode.RMSProp
    opt = Adaptive({"defaultLearningRate": (0.01, True), "defaultAlpha": (0.9, False),
                    "defaultEps": (1e-6, True), "defaultMomentum": (mm, True),
                    "defaultWeightDecay": (0.02, True)}, mode=mode,
                   weight_decay_mode=WeightDecayMode.L2Regularization)
    want = run_torch(lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-6,
                                                   weight_decay=0.02, momentum=mm,
                                                   centered=centered), grad_fn)
    assert_close(run(opt, grad_fn), want, rtol=5e-5)


@pytest.mark.parametrize("grad_fn", GRADS)
def test_adadelta_matches_torch(grad_fn):
    opt = Adaptive({"defaultLearningRate": (1.0, True), "defaultAlpha": (0.9, True),
                    "defaultEps": (1e-6, False), "defaultWeightDecay": (0.01, True)},
                   mode=AdaptiveMode.AdaDelta, weight_decay_mode=WeightDecayMode.L2Regularization)
    want = run_torch(lambda p: torch.optim.Adadelta(p, lr=1.0, rho=0.9, eps=1e-6,
                                                    weight_decay=0.01), grad_fn)
    assert_close(run(opt, grad_fn), want, rtol=5e-5)


@pytest.mark.parametrize("grad_fn", GRADS)
@pytest.mark.parametrize("mode", list(AdaptiveMode))
@pytest.mark.parametrize("wdmode", list(WeightDecayMode))
@pytest.mark.parametrize("tf", [False, True])
@pytest.mark.parametrize("mm", [(0.0, True), (0.0, False), (0.7, False)])
def test_adaptive_modes_match_reference_formula(grad_fn, mode, wdmode, mm, tf):
    # A momentum buffer exists when momentum is non-const or > 0 (PopART's rule).
    hp = dict(lr=0.02, alpha=0.9, eps=0.05, wd=0.03, mm=mm[0], use_momentum=not mm[1])
    opt = Adaptive({"defaultLearningRate": (hp["lr"], False), "defaultAlpha": (hp["alpha"], True),
                    "defaultEps": (hp["eps"], True), "defaultWeightDecay": (hp["wd"], False),
                    "defaultMomentum": mm, "lossScaling": (4.0, True)},
                   mode=mode, weight_decay_mode=wdmode, rmsprop_tf_variant=tf)
    want = run_ref(ref_adaptive(mode, wdmode, tf=tf, **hp), grad_fn)
    assert_close(run(opt, grad_fn, ls=4.0), want, rtol=5e-5, atol=5e-6)


# ---------------------------------------------------------------- clip norms
def test_clip_all_weights_uses_global_norm_of_unscaled_gradients():
    opt = SGD({"defaultLearningRate": (0.1, True), "lossScaling": (16.0, True)},
              clip_norm_settings=[ClipNormSettings.clipAllWeights(0.5)])
    w = {"a": W0, "b": W0[0]}
    g = {"a": FIXED[0], "b": FIXED[1][0]}
    norm = np.sqrt(np.sum(g["a"] ** 2) + np.sum(g["b"] ** 2))
    assert norm > 0.5
    new, _ = jax.jit(opt.apply)(w, {k: v * 16 for k, v in g.items()}, {}, {})
    for k in w:
        np.testing.assert_allclose(new[k], w[k] - 0.1 * g[k] * 0.5 / norm, rtol=1e-5)


def test_clip_weights_only_touches_its_group_and_not_below_max_norm():
    opt = SGD({"defaultLearningRate": (0.1, True)},
              clip_norm_settings=[ClipNormSettings.clipWeights(["a"], 0.5),
                                  ClipNormSettings.clipWeights(["b"], 1e6)])
    w, g = {"a": W0, "b": W0}, {"a": FIXED[0], "b": FIXED[1]}
    new, _ = opt.apply(w, g, {}, {})
    np.testing.assert_allclose(new["a"], W0 - 0.1 * g["a"] * 0.5 / np.linalg.norm(g["a"]),
                               rtol=1e-5)
    np.testing.assert_allclose(new["b"], W0 - 0.1 * g["b"], rtol=1e-6)


@pytest.mark.parametrize("grad_fn", GRADS)
def test_adam_with_clipping_matches_reference(grad_fn):
    opt = Adam({"defaultLearningRate": (0.01, True)}, mode=AdamMode.Adam,
               clip_norm_settings=[ClipNormSettings.clipAllWeights(0.3)])
    ref = ref_adam(AdamMode.Adam, WeightDecayMode.Decay, 0.01, 0.9, 0.999, 1e-6, 0.0)
    assert_close(run(opt, grad_fn), run_ref(ref, grad_fn, clip=0.3))


def test_clip_unknown_weight_raises():
    opt = SGD(0.1, clip_norm_settings=[ClipNormSettings.clipWeights(["nope"], 1.0)])
    with pytest.raises(OptimizerError, match="nope"):
        opt.apply({"w": W0}, {"w": W0}, {}, opt.non_const_feed(["w"]))


# ---------------------------------------------------------------- construction and getters
def test_optimizer_value_forms():
    assert OptimizerValue().val() == 0.0 and OptimizerValue().isConst()
    assert OptimizerValue(0.5).isConst()
    ov = OptimizerValue((0.25, False))
    assert (ov.val(), ov.isConst()) == (0.25, False)
    assert OptimizerValue(ov) == ov and OptimizerValue(0.25, False) == ov
    with pytest.raises(OptimizerError):
        OptimizerValue("fast")
    assert issubclass(OptimizerError, popart_exception)


def test_sgd_construction_forms_and_defaults():
    d = SGD()
    assert (d.learningRates().getDefault(), d.momentums().getDefault()) == (
        OptimizerValue(0.1, True), OptimizerValue(0.0, True))
    assert d.velocityScalings().getDefault() == OptimizerValue(1.0, True)
    assert d.nesterov().getDefault().val() == 0.0 and d.getLossScalingVal() == 1.0
    step_lr = SGD(0.05)      # popart.SGD(stepLr): a changeable learning rate
    assert step_lr.learningRates().getDefault() == OptimizerValue(0.05, False)
    kw = SGD(learning_rate=0.01, momentum=(0.9, False), defaultWeightDecay=0.001)
    assert kw.learningRates().getDefault() == OptimizerValue(0.01, True)
    assert kw.momentums().getDefault() == OptimizerValue(0.9, False)
    assert kw.weightDecays().getDefault().val() == pytest.approx(0.001)
    sgd = SGD({"defaultLearningRate": (0.1, False), "lossScaling": (8.0, True),
               "nesterov": (True, True)},
              accumulatorAndMomentum=SGDAccumulatorAndMomentum.Separate)
    assert sgd.getLossScalingVal() == 8.0 and sgd.nesterov().getDefault().val() == 1.0
    assert sgd.accumulatorAndMomentum == SGDAccumulatorAndMomentum.Separate
    assert sgd.type_name() == "SGD"
    assert sgd.hyper_names() == ["learningRate", "weightDecay", "momentum", "dampening",
                                 "velocityScaling", "nesterov"]


def test_const_sgd_is_all_const():
    c = ConstSGD(0.001, weight_decay=0.1, loss_scaling=4.0)
    assert isinstance(c, SGD) and c.type_name() == "SGD"
    assert c.learningRates().getDefault() == OptimizerValue(0.001, True)
    assert c.weightDecays().getDefault() == OptimizerValue(0.1, True)
    assert c.loss_scaling() == OptimizerValue(4.0, True)
    assert c.non_const_feed(["w"]) == {}


def test_unknown_key_names_key_and_lists_valid_ones():
    with pytest.raises(OptimizerError, match=r"defaultLearningRat'.*defaultLearningRate"):
        SGD({"defaultLearningRat": (0.1, True)})
    with pytest.raises(OptimizerError, match="defaultMomentum"):
        Adam({"defaultMomentum": (0.9, True)})
    with pytest.raises(OptimizerError, match="beta1"):
        Adaptive(beta1=0.9)


@pytest.mark.parametrize("bad,match", [({"defaultLearningRate": (-0.1, False)}, "learning rate"),
                                       ({"defaultLearningRate": (0.0, True)}, "zero learning rate"),
                                       ({"defaultVelocityScaling": (0.0, True)}, "velocity"),
                                       ({"defaultMomentum": -0.5}, r"Negative momentum \(-0.5\) in SGD")])
def test_invalid_values_raise(bad, match):
    with pytest.raises(OptimizerError, match=match):
        SGD(bad)


def test_adam_and_adaptive_defaults_and_getters():
    a = Adam({"defaultLearningRate": (0.02, False)})
    assert a.type_name() == "Adam" and a.mode == AdamMode.Adam
    assert a.weight_decay_mode == WeightDecayMode.Decay
    assert [m.getDefault().val() for m in (a.beta1s(), a.beta2s(), a.epss(), a.maxWeightNorms())
            ] == pytest.approx([0.9, 0.999, 1e-6, 10.0])
    assert a.learningRates().getDefault() == OptimizerValue(0.02, False)
    assert Adam(maxWeightNorm=(3.0, True)).maxWeightNorms().getDefault().val() == 3.0
    r = Adaptive({"defaultAlpha": (0.95, False)}, mode=AdaptiveMode.AdaDelta)
    assert r.type_name() == "Adaptive" and r.mode == AdaptiveMode.AdaDelta
    assert r.alphas().getDefault() == OptimizerValue(0.95, False)
    assert [m.getDefault().val() for m in (r.learningRates(), r.momentums(), r.epss(),
                                           r.weightDecays())] == pytest.approx([0.01, 0, 1e-6, 0])
    assert r.hyper_names() == ["learningRate", "weightDecay", "alpha", "momentum", "eps"]


def test_insert_specific():
    sgd = SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.7, True)})
    sgd.insertSpecific("w1", {"learningRate": (0.5, True)})
    lrs = sgd.learningRates()
    assert isinstance(lrs, OptimizerValueMap)
    assert lrs.get("w1") == OptimizerValue(0.5, True) and lrs["w0"] == lrs.getDefault()
    assert lrs.keys() == ["w1"] and lrs.hasSpecific("w1") and not lrs.hasSpecific("w0")
    assert sgd.momentums().get("w1") == OptimizerValue(0.7, True)   # current default
    assert sgd.hyper_value("w1", "learningRate").val() == 0.5
    assert sgd.hyper_value("w0", "learningRate") == OptimizerValue(0.1, False)
    with pytest.raises(OptimizerError, match="defaultMomentum.*learningRate"):
        sgd.insertSpecific("w1", {"defaultMomentum": (0.1, True)})


def test_insert_specific_drives_the_update_per_weight():
    sgd = SGD({"defaultLearningRate": (0.1, False)})
    sgd.insertSpecific("b", {"learningRate": (0.3, False), "momentum": (0.5, True)})
    w, g = {"a": W0, "b": W0}, {"a": FIXED[0], "b": FIXED[0]}
    state = {**sgd.init_state("a", W0), **sgd.init_state("b", W0)}
    assert set(state) == {"Accl___b"}
    new, state = jax.jit(sgd.apply)(w, g, state, sgd.non_const_feed(["a", "b"]))
    np.testing.assert_allclose(new["a"], W0 - 0.1 * FIXED[0], rtol=1e-6)
    np.testing.assert_allclose(new["b"], W0 - 0.3 * FIXED[0], rtol=1e-6)
    np.testing.assert_allclose(state["Accl___b"], FIXED[0], rtol=1e-6)


# ---------------------------------------------------------------- engine interface
def test_non_const_feed_keys_and_values():
    sgd = SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True),
               "lossScaling": (128.0, False)})
    sgd.insertSpecific("w1", {"momentum": (0.5, False)})
    feed = sgd.non_const_feed(["w0", "w1"])
    assert feed == {"learningRate/w0": np.float32(0.1), "learningRate/w1": np.float32(0.1),
                    "momentum/w1": np.float32(0.5), "lossScaling": np.float32(128.0)}
    assert all(isinstance(v, np.float32) for v in feed.values())
    adam = Adam({"defaultBeta2": (0.99, False)})
    assert set(adam.non_const_feed(["x"])) == {"beta2/x"}


def test_non_const_values_change_at_runtime_without_retracing():
    sgd = SGD({"defaultLearningRate": (0.1, False), "lossScaling": (2.0, False)})
    traces = []

    def f(*args):
        traces.append(1)
        return sgd.apply(*args)

    step = jax.jit(f)
    w, g = {"w": W0}, {"w": FIXED[0]}
    first, _ = step(w, g, {}, sgd.non_const_feed(["w"]))
    newer = SGD({"defaultLearningRate": (0.3, False), "lossScaling": (4.0, False)})
    sgd.check_compatible(newer, ["w"])
    second, _ = step(w, g, {}, newer.non_const_feed(["w"]))
    assert len(traces) == 1
    np.testing.assert_allclose(first["w"], W0 - 0.1 * FIXED[0] / 2, rtol=1e-6)
    np.testing.assert_allclose(second["w"], W0 - 0.3 * FIXED[0] / 4, rtol=1e-6)


def test_apply_without_a_non_const_value_raises():
    sgd = SGD({"defaultLearningRate": (0.1, False)})
    with pytest.raises(OptimizerError, match="learningRate/w"):
        sgd.apply({"w": W0}, {"w": W0}, {}, {})


def test_check_compatible_accepts_non_const_changes():
    old = Adam({"defaultLearningRate": (0.1, False), "defaultBeta1": (0.9, True)})
    new = Adam({"defaultLearningRate": (0.01, False), "defaultBeta1": (0.9, True)})
    assert old.check_compatible(new, ["w"]) is None


@pytest.mark.parametrize("old,new,match", [
    (SGD(0.1), Adam(0.1), "SGD.*Adam"),
    (Adam(0.1), Adam(0.1, mode=AdamMode.Lamb), "mode"),
    (Adaptive(0.1), Adaptive(0.1, weight_decay_mode=WeightDecayMode.L2Regularization),
     "weight_decay_mode"),
    (SGD({"defaultMomentum": (0.9, True)}), SGD({"defaultMomentum": (0.8, True)}),
     r"momentum of weight 'w'.*0\.9.*0\.8"),
    (SGD({"defaultMomentum": (0.9, True)}), SGD({"defaultMomentum": (0.9, False)}),
     "momentum of weight 'w'.*isConst"),
    (SGD(0.1), SGD({"defaultLearningRate": (0.1, True)}), "learningRate.*isConst"),
    (SGD({"lossScaling": (4.0, True)}), SGD({"lossScaling": (8.0, True)}), "lossScaling"),
    (SGD(0.1), SGD(0.1, clip_norm_settings=[ClipNormSettings.clipAllWeights(1.0)]),
     "clip_norm_settings"),
])
def test_check_compatible_errors(old, new, match):
    with pytest.raises(OptimizerError, match=match):
        old.check_compatible(new, ["w"])


def test_check_compatible_names_the_weight_with_a_changed_specific():
    old, new = SGD(0.1), SGD(0.1)
    new.insertSpecific("w2", {"weightDecay": (0.5, True)})
    old.check_compatible(new, ["w1"])
    with pytest.raises(OptimizerError, match="weightDecay of weight 'w2'"):
        old.check_compatible(new, ["w1", "w2"])


def test_init_state_sgd():
    assert SGD(0.1).init_state("w", W0) == {}
    assert set(SGD({"defaultMomentum": (0.0, False)}).init_state("w", W0)) == {"Accl___w"}
    st = SGD({"defaultMomentum": (0.9, True)}, accl1Type=DataType.FLOAT16).init_state("w", W0)
    assert st["Accl___w"].dtype == np.float16 and st["Accl___w"].shape == W0.shape
    w16 = W0.astype(np.float16)
    assert SGD(momentum=0.9).init_state("w", w16)["Accl___w"].dtype == np.float16


def test_init_state_adam():
    st = Adam(0.1, accl1_type="FLOAT16").init_state("w", W0)
    assert set(st) == {"Accl1___w", "Accl2___w", "Step___w"}
    assert st["Accl1___w"].dtype == np.float16 and st["Accl2___w"].dtype == np.float32
    assert st["Step___w"].shape == () and st["Step___w"].dtype == np.float32
    assert not st["Accl1___w"].any() and st["Accl2___w"].shape == W0.shape


@pytest.mark.parametrize("mode,momentum,names", [
    (AdaptiveMode.AdaGrad, 0.0, {"Accl1___w"}),
    (AdaptiveMode.RMSProp, 0.5, {"Accl1___w", "Accl3___w"}),
    (AdaptiveMode.CenteredRMSProp, 0.0, {"Accl1___w", "Accl2___w"}),
    (AdaptiveMode.AdaDelta, (0.0, False), {"Accl1___w", "Accl2___w", "Accl3___w"}),
])
def test_init_state_adaptive(mode, momentum, names):
    st = Adaptive({"defaultMomentum": momentum}, mode=mode).init_state("w", W0.astype(np.float16))
    assert set(st) == names
    assert st["Accl1___w"].dtype == np.float32           # accl1 FLOAT by default
    if "Accl3___w" in st:
        assert st["Accl3___w"].dtype == np.float16       # accl3 follows the weight by default
    tf = Adaptive(mode=mode, rmsprop_tf_variant=True).init_state("w", W0)
    assert (tf["Accl1___w"] == 1).all() and not st["Accl1___w"].any()


def test_apply_keeps_dtypes():
    w16 = W0.astype(np.float16)
    opt = Adam(0.01, accl2_type=DataType.FLOAT16)
    st, feed = opt.init_state("w", w16), opt.non_const_feed(["w"])
    new, st2 = jax.jit(opt.apply)({"w": w16}, {"w": FIXED[0].astype(np.float16)}, st, feed)
    assert new["w"].dtype == np.float16
    assert {k: v.dtype for k, v in st2.items()} == {k: v.dtype for k, v in st.items()}
    assert not np.allclose(np.asarray(new["w"], np.float32), W0, atol=1e-3)
