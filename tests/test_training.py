"""TrainingSession end to end against PyTorch and NumPy references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import popart
from popart import testing

CPU = popart.DeviceManager().createCpuDevice
G = popart.reservedGradientPrefix()
B, I, H, O = 4, 6, 5, 3


def mlp(batch: int = B, seed: int = 0, loss: str = "nll", reduction=None):
    """x -> matmul+bias -> relu -> matmul -> softmax -> nllloss. Returns ids and initial weights."""
    rs = np.random.RandomState(seed)
    w1, b1, w2 = (rs.randn(I, H).astype(np.float32) * 0.5, rs.randn(H).astype(np.float32) * 0.1,
                  rs.randn(H, O).astype(np.float32) * 0.5)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, I]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [batch]), "label")
    W1, B1, W2 = (b.addInitializedInputTensor(v, n) for v, n in ((w1, "w1"), (b1, "b1"), (w2, "w2")))
    h = b.aiOnnx.add([b.aiOnnx.matmul([x, W1]), B1])
    r = b.aiOnnx.relu([h])
    logits = b.aiOnnx.matmul([r, W2])
    p = b.aiOnnx.softmax([logits], axis=1)
    red = reduction if reduction is not None else popart.ReductionType.Mean
    nll = b.aiGraphcore.nllloss([p, lab], reduction=red)
    ids = dict(x=x, label=lab, w1=W1, b1=B1, w2=W2, h=h, logits=logits, loss=nll, p=p)
    return b, ids, dict(w1=w1, b1=b1, w2=w2)


def torch_mlp(w):
    return {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}


def torch_loss(t, x, lab):
    logits = torch.relu(torch.tensor(x) @ t["w1"] + t["b1"]) @ t["w2"]
    return torch.nn.functional.nll_loss(torch.log_softmax(logits, 1), torch.tensor(lab).long())


def data(bps, batch=B, seed=1, lead=()):
    rs = np.random.RandomState(seed)
    return (rs.randn(bps, *lead, batch, I).astype(np.float32),
            rs.randint(0, O, (bps, *lead, batch)).astype(np.int32))


def train(builder, ids, optimizer, bps, X, L, anchors=(), opts=None, device=None, art="ALL"):
    df = popart.DataFlow(bps, {a: popart.AnchorReturnType(art) for a in (ids["loss"], *anchors)})
    s = popart.TrainingSession(builder.getModelProto(), df, ids["loss"], optimizer, device or CPU(),
                               userOptions=opts or popart.SessionOptions())
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    return s, out


def read(s, ids, names=("w1", "b1", "w2")):
    s.weightsToHost()
    res = {n: np.zeros(s.getInfo(ids[n]).shape(), np.float32) for n in names}
    s.readWeights(popart.PyWeightsIO({ids[n]: res[n] for n in names}))
    return res


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adamw", "rmsprop", "adagrad"])
def test_optimizers_match_pytorch_over_steps(opt_name):
    b, ids, w0 = mlp()
    bps = 4
    X, L = data(bps)
    popart_opt, torch_opt = {
        "sgd_momentum": (popart.SGD({"defaultLearningRate": (0.05, False), "defaultMomentum": (0.9, False)}),
                         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        "adam": (popart.Adam({"defaultLearningRate": (0.01, False), "defaultEps": (1e-8, True),
                              "defaultWeightDecay": (0.01, True)}, mode=popart.AdamMode.Adam,
                             weight_decay_mode=popart.WeightDecayMode.L2Regularization),
                 lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-8, weight_decay=0.01)),
        "adamw": (popart.Adam({"defaultLearningRate": (0.01, False), "defaultEps": (1e-8, True),
                               "defaultWeightDecay": (0.1, True)}, mode=popart.AdamMode.Adam,
                              weight_decay_mode=popart.WeightDecayMode.Decay),
                  lambda p: torch.optim.AdamW(p, lr=0.01, eps=1e-8, weight_decay=0.1)),
        "rmsprop": (popart.Adaptive({"defaultLearningRate": (0.01, False), "defaultAlpha": (0.9, True),
                                     "defaultEps": (1e-6, True)}, mode=popart.AdaptiveMode.RMSProp),
                    lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-6)),
        "adagrad": (popart.Adaptive({"defaultLearningRate": (0.1, False), "defaultEps": (1e-10, True)},
                                    mode=popart.AdaptiveMode.AdaGrad),
                    lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
    }[opt_name]
    s, out = train(b, ids, popart_opt, bps, X, L)
    t = torch_mlp(w0)
    opt = torch_opt(list(t.values()))
    losses = []
    for i in range(bps):
        opt.zero_grad()
        loss = torch_loss(t, X[i], L[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.testing.assert_allclose(out[ids["loss"]], losses, rtol=1e-4, atol=1e-6)
    got = read(s, ids)
    for k in got:
        np.testing.assert_allclose(got[k], t[k].detach().numpy(), rtol=2e-4, atol=2e-5)


def test_sgd_dampening_velocity_scaling_follow_popart_formula():
    """PopART's velocity starts at zero and dampening applies from the first step (differs from torch)."""
    b, ids, w0 = mlp()
    bps, lr, mm, dm, wd, vs = 3, 0.1, 0.8, 0.3, 0.01, 2.0
    X, L = data(bps)
    opt = popart.SGD({"defaultLearningRate": (lr, True), "defaultMomentum": (mm, True),
                      "defaultDampening": (dm, True), "defaultWeightDecay": (wd, True),
                      "defaultVelocityScaling": (vs, True)})
    s, _ = train(b, ids, opt, bps, X, L)
    t = torch_mlp(w0)
    v = {k: np.zeros_like(x) for k, x in w0.items()}
    w = {k: x.copy() for k, x in w0.items()}
    for i in range(bps):
        t = torch_mlp(w)
        torch_loss(t, X[i], L[i]).backward()
        for k in w:
            g = t[k].grad.numpy()
            v[k] = v[k] * mm + (1 - dm) * (g + wd * w[k])
            w[k] = w[k] - lr * v[k]
    got = read(s, ids)
    for k in got:
        np.testing.assert_allclose(got[k], w[k], rtol=1e-4, atol=1e-6)


def test_gradient_anchors_match_autograd():
    b, ids, w0 = mlp()
    X, L = data(1)
    anchors = [G + ids["w1"], G + ids["b1"], G + ids["x"], G + ids["h"], G + ids["logits"]]
    s, out = train(b, ids, popart.SGD({"defaultLearningRate": (0.0, False)}), 1, X, L, anchors)
    t = torch_mlp(w0)
    x = torch.tensor(X[0], requires_grad=True)
    h = x @ t["w1"] + t["b1"]
    h.retain_grad()
    logits = torch.relu(h) @ t["w2"]
    logits.retain_grad()
    loss = torch.nn.functional.nll_loss(torch.log_softmax(logits, 1), torch.tensor(L[0]).long())
    loss.backward()
    for anchor, ref in zip(anchors, [t["w1"].grad, t["b1"].grad, x.grad, h.grad, logits.grad]):
        np.testing.assert_allclose(out[anchor], ref.numpy(), rtol=1e-4, atol=1e-6, err_msg=anchor)


@pytest.mark.parametrize("mode", ["accumulation", "replication", "replication_one_device", "both"])
def test_accumulation_and_replication_equal_one_big_batch(mode):
    """Replicas on distinct devices (shard_map) or side by side on one device (vmap)."""
    k = 2 if mode != "both" else 4
    big_b, big_ids, w0 = mlp(batch=B * k)
    bps = 2
    Xb, Lb = data(bps, batch=B * k)
    opt = lambda: popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.5, True)})
    s_big, out_big = train(big_b, big_ids, opt(), bps, Xb, Lb)
    b, ids, _ = mlp(batch=B)
    opts = popart.SessionOptions()
    opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    lead, device = [], CPU()
    if mode in ("accumulation", "both"):
        opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
        lead.append(2)
    if mode in ("replication", "replication_one_device", "both"):
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
        lead.append(2)
        if mode != "replication_one_device":
            device = popart.DeviceManager().acquireAvailableDevice(2)
    X = Xb.reshape(bps, *lead, B, I)
    L = Lb.reshape(bps, *lead, B)
    s, out = train(b, ids, opt(), bps, X, L, opts=opts, device=device)
    assert len(testing.mesh_devices(s)) == (2 if mode in ("replication", "both") else 0)
    assert out[ids["loss"]].shape == (bps, *lead)
    np.testing.assert_allclose(out[ids["loss"]].reshape(bps, -1).mean(1), out_big[big_ids["loss"]], rtol=1e-5)
    a, c = read(s, ids), read(s_big, big_ids)
    for n in a:
        np.testing.assert_allclose(a[n], c[n], rtol=1e-5, atol=1e-6)
    device.detach()


def test_running_mean_strategy_equals_post():
    b, ids, _ = mlp()
    X, L = data(2, lead=(3,))
    res = []
    for strat in (popart.MeanReductionStrategy.Post, popart.MeanReductionStrategy.Running):
        opts = popart.SessionOptions()
        opts.enableGradientAccumulation, opts.accumulationFactor = True, 3
        opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
        opts.meanAccumulationAndReplicationReductionStrategy = strat
        s, _ = train(b, ids, popart.ConstSGD(0.1), 2, X, L, opts=opts)
        res.append(read(s, ids))
    for n in res[0]:
        np.testing.assert_allclose(res[0][n], res[1][n], rtol=1e-5, atol=1e-7)


def test_update_optimizer_from_host_without_recompiling(monkeypatch):
    b, ids, w0 = mlp()
    X, L = data(1)
    s, out = train(b, ids, popart.SGD({"defaultLearningRate": (0.1, False)}), 1, X, L)
    compiled = testing.compiled(s)
    before = read(s, ids)
    s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.0, False)}))
    s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    after = read(s, ids)
    assert testing.compiled(s) is compiled
    for n in before:
        np.testing.assert_array_equal(before[n], after[n])  # lr 0: no change
    s.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (0.5, False)}))
    s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    moved = read(s, ids)
    assert np.abs(moved["w2"] - after["w2"]).max() > 1e-4
    with pytest.raises(popart.popart_exception):
        s.updateOptimizerFromHost(popart.Adam({"defaultLearningRate": (0.1, False)}))


def test_const_value_change_is_an_error():
    b, ids, _ = mlp()
    X, L = data(1)
    s, _ = train(b, ids, popart.ConstSGD(0.1), 1, X, L)
    with pytest.raises(popart.popart_exception, match="(?i)const"):
        s.updateOptimizerFromHost(popart.ConstSGD(0.2))


def test_trained_model_reloads_into_inference_session(tmp_path):
    b, ids, _ = mlp()
    X, L = data(3)
    s, _ = train(b, ids, popart.SGD({"defaultLearningRate": (0.2, False)}), 3, X, L)
    path = str(tmp_path / "trained.onnx")
    s.modelToHost(path)
    w = read(s, ids)
    inf = popart.InferenceSession(path, popart.DataFlow(1, [ids["p"]]), CPU())
    inf.prepareDevice()
    out = inf.initAnchorArrays()
    inf.run(popart.PyStepIO({ids["x"]: X[0], ids["label"]: L[0]}, out))
    logits = np.maximum(X[0] @ w["w1"] + w["b1"], 0) @ w["w2"]
    ref = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(out[ids["p"]], ref / ref.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("red,expect", [
    (popart.ReductionType.Sum, lambda v: v.sum()), (popart.ReductionType.Mean, lambda v: v.mean())])
def test_l1loss_and_identityloss_reductions(red, expect):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3, 2]))
    w = b.addInitializedInputTensor(np.ones((3, 2), np.float32))
    y = b.aiOnnx.mul([x, w])
    l1 = b.aiGraphcore.l1loss([y], 0.5, reduction=red)
    data_ = np.array([[1, -2], [3, -4], [0.5, 1]], np.float32)
    df = popart.DataFlow(1, {l1: popart.AnchorReturnType("ALL"), G + w: popart.AnchorReturnType("ALL")})
    s = popart.TrainingSession(b.getModelProto(), df, l1, popart.SGD({"defaultLearningRate": (0.0, False)}), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: data_}, out))
    np.testing.assert_allclose(out[l1], expect(0.5 * np.abs(data_)), rtol=1e-6)
    scale = 1.0 if red == popart.ReductionType.Sum else 1.0 / data_.size
    np.testing.assert_allclose(out[G + w], 0.5 * np.sign(data_) * data_ * scale, rtol=1e-6)


def test_non_scalar_loss_is_an_error():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]))
    w = b.addInitializedInputTensor(np.ones(3, np.float32))
    y = b.aiOnnx.mul([x, w])
    loss = b.aiGraphcore.identityloss([y], reduction=popart.ReductionType.NoReduction)
    with pytest.raises(popart.popart_exception, match="scalar"):   # in the constructor, as PopART
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss, popart.ConstSGD(0.1), CPU())


def test_dropout_seeded_training_and_inactive_in_inference():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [64]))
    w = b.addInitializedInputTensor(np.ones(64, np.float32))
    d = b.aiOnnx.dropout([b.aiOnnx.mul([x, w])], 1, 0.5)[0]
    loss = b.aiGraphcore.identityloss([d], reduction=popart.ReductionType.Sum)
    proto = b.getModelProto()

    def run(seed):
        s = popart.TrainingSession(proto, popart.DataFlow(2, [d]), loss, popart.SGD({"defaultLearningRate": (0.0, False)}), CPU())
        s.prepareDevice()
        s.weightsFromHost()
        s.setRandomSeed(seed)   # PopART: once the executable exists
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: np.ones((2, 64), np.float32)}, out))
        return out[d]

    a, a2, c = run(7), run(7), run(8)
    np.testing.assert_array_equal(a, a2)
    assert not np.array_equal(a, c)
    assert set(np.unique(a)) <= {0.0, 2.0} and 0.2 < (a == 0).mean() < 0.8
    assert not np.array_equal(a[0], a[1])  # a fresh mask per batch
    inf = popart.InferenceSession(proto, popart.DataFlow(1, [d]), CPU())
    inf.prepareDevice()
    out = inf.initAnchorArrays()
    inf.run(popart.PyStepIO({x: np.ones(64, np.float32)}, out))
    np.testing.assert_array_equal(out[d], np.ones(64))


def test_float16_training_with_loss_scaling():
    rs = np.random.RandomState(0)
    w0 = rs.randn(4, 3).astype(np.float16)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [2, 4]))
    w = b.addInitializedInputTensor(w0)
    y = b.aiOnnx.matmul([x, w])
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    opt = popart.SGD({"defaultLearningRate": (0.01, True), "lossScaling": (128.0, True)})
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss, G + w]), loss, opt, CPU())
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    X = rs.randn(2, 4).astype(np.float16)
    s.run(popart.PyStepIO({x: X}, out))
    s.weightsToHost()
    got = np.zeros_like(w0)
    s.readWeights(popart.PyWeightsIO({w: got}))
    g = X.astype(np.float32).T @ np.sign(X.astype(np.float32) @ w0.astype(np.float32))
    np.testing.assert_allclose(got.astype(np.float32), w0.astype(np.float32) - 0.01 * g, rtol=2e-3, atol=2e-3)
    assert got.dtype == np.float16


def test_automatic_loss_scaling_adjusts_the_scale():
    """A float16 model (PopART tracks float16 gradients only) and a non-const loss scaling:
    with small gradients the scale doubles every update, with gradients at or above
    binEdgeLocation * 65504 (8188) it halves; weights follow the unscaled gradients either
    way (equal to a run without automatic scaling). tests/test_automatic_loss_scaling.py
    checks the statistics and the sequences against PopART's algorithm in NumPy."""
    rs = np.random.RandomState(0)
    w0 = rs.randn(4, 3).astype(np.float16)
    X = (rs.uniform(1.0, 1.5, (3, 1, 4)) * rs.choice([-1, 1], (3, 1, 4))).astype(np.float16)
    # |Gradient___w| = |x| * finalLossScale: below 8188 from 8, at or above it from 16384
    # until the scale is 4096
    for ls, finals in ((8.0, [8.0, 16.0, 32.0]), (16384.0, [16384.0, 8192.0, 4096.0])):
        weights = []
        for als in (True, False):
            b = popart.Builder()
            x = b.addInputTensor(popart.TensorInfo("FLOAT16", [1, 4]))
            w = b.addInitializedInputTensor(w0)
            loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([x, w])], 1.0, reduction=popart.ReductionType.Sum)
            opts = popart.SessionOptions()
            opts.automaticLossScalingSettings.enabled = als
            opt = popart.SGD({"defaultLearningRate": (1e-3, True), "lossScaling": (ls, False)})
            anchors = {loss: popart.AnchorReturnType("ALL")}
            if als:
                anchors["finalLossScale"] = anchors["lossScaleUpdateFactor"] = popart.AnchorReturnType("ALL")
            s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(3, anchors), loss, opt, CPU(), userOptions=opts)
            s.prepareDevice()
            s.weightsFromHost()
            out = s.initAnchorArrays()
            s.run(popart.PyStepIO({x: X}, out))
            if als:
                np.testing.assert_array_equal(out["finalLossScale"], finals)
                after = {8.0: [2.0, 4.0, 8.0], 16384.0: [0.5, 0.25, 0.5]}[ls]
                np.testing.assert_array_equal(out["lossScaleUpdateFactor"], after)
            weights.append(read_one(s, w))
        np.testing.assert_array_equal(weights[0], weights[1])
        assert np.abs(weights[0] - w0).max() > 1e-3


def read_one(s, tid):
    s.weightsToHost()
    v = np.zeros(s.getInfo(tid).shape(), np.float32)
    s.readWeights(popart.PyWeightsIO({tid: v}))
    return v


def test_save_and_load_executable_resumes_training(tmp_path):
    b, ids, _ = mlp()
    X, L = data(2)
    opt = lambda: popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)})
    s, out = train(b, ids, opt(), 2, X, L)
    path = str(tmp_path / "exe.popef")
    s.saveExecutable(path)
    df = popart.DataFlow(2, {ids["loss"]: popart.AnchorReturnType("ALL")})
    s2 = popart.TrainingSession(b.getModelProto(), df, ids["loss"], opt(), CPU())
    s2.loadExecutable(path)
    s2.weightsFromHost()
    out2 = s2.initAnchorArrays()
    s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    s2.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out2))
    np.testing.assert_allclose(out2[ids["loss"]], out[ids["loss"]], rtol=1e-6)
    a, c = read(s, ids), read(s2, ids)
    for n in a:
        np.testing.assert_allclose(a[n], c[n], rtol=1e-6)
    b3, ids3, _ = mlp(seed=5)
    b3.aiOnnx.relu([ids3["p"]])  # a different model
    s3 = popart.TrainingSession(b3.getModelProto(), popart.DataFlow(2, [ids3["loss"]]), ids3["loss"], opt(), CPU())
    with pytest.raises(popart.popart_exception, match="model_sha256"):
        s3.loadExecutable(path)
        s3.weightsFromHost()


def test_stream_callback_gets_one_replica_and_broadcast_weights_keeps_one_instance():
    """connectStreamToCallback(anchor, cb, index) hands cb replica ``index``'s values after
    each run; broadcastWeights with one instance leaves the weights as they are."""
    b, ids, _ = mlp()
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
    df = popart.DataFlow(3, {ids["loss"]: popart.AnchorReturnType("ALL")})
    s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], popart.ConstSGD(0.1), CPU(),
                               userOptions=opts)
    seen = []
    s.connectStreamToCallback(ids["loss"], lambda a: seen.append(a.copy()), 1)
    with pytest.raises(popart.popart_exception, match="replica index 2 for"):
        s.connectStreamToCallback(ids["loss"], print, 2)
    with pytest.raises(popart.popart_exception, match="'w1' is not an anchor"):
        s.connectStreamToCallback("w1", print)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    X, L = data(3, lead=(2,))
    s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    assert len(seen) == 1 and seen[0].shape == (3,)
    np.testing.assert_array_equal(seen[0], out[ids["loss"]][:, 1])
    before = read(s, ids)
    s.broadcastWeights(0)
    after = read(s, ids)
    for n in before:
        np.testing.assert_array_equal(before[n], after[n])
    with pytest.raises(popart.popart_exception, match="rootRank 1 does not exist"):
        s.broadcastWeights(1)
