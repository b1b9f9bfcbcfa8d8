"""Replicated tensor sharding (engine/rts.py): weights, optimizer state and gradient
accumulators stored 1/R per replica train exactly as unsharded ones do, and the host sees
whole tensors. Runs on tests/conftest.py's 4 host devices (one replica per device)."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import popart
from popart import testing
from test_training import I, data, mlp, read, train

R, A, BPS = 4, 2, 2
WEIGHTS, STATE, ACCUM = ("weightTensorLocationSettings", "optimizerStateTensorLocationSettings",
                         "accumulatorTensorLocationSettings")
MIN = 8   # w1 (30 elements) and w2 (15) shard, b1 (5) stays whole
OPTIMIZERS = {
    "sgd": lambda: popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True),
                               "defaultWeightDecay": (0.01, True)}),
    "adam": lambda: popart.Adam({"defaultLearningRate": (0.02, False),   # the clipping acts
                                 "defaultWeightDecay": (0.01, True)},
                                clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(0.05)]),
    "lamb": lambda: popart.Adam({"defaultLearningRate": (0.02, False),
                                 "defaultWeightDecay": (0.01, True)}, mode=popart.AdamMode.Lamb),
}
STATE_OF = {"sgd": "Accl___", "adam": "Accl1___", "lamb": "Accl2___"}   # one anchored
PREFIXES = {"sgd": ("Accl___",), "adam": ("Accl1___", "Accl2___"), "lamb": ("Accl1___", "Accl2___")}


def rts_location(min_elements: int = MIN) -> popart.TensorLocationSettings:
    on = popart.TensorLocation(popart.TensorStorage.OnChip, popart.ReplicatedTensorSharding.On)
    return popart.TensorLocationSettings(on, 0, min_elements)


def options(sharded=(), reduction="Mean", replicas=R, min_elements=MIN) -> popart.SessionOptions:
    o = popart.SessionOptions()
    o.enableReplicatedGraphs, o.replicatedGraphCount = replicas > 1, replicas
    o.enableGradientAccumulation, o.accumulationFactor = True, A
    o.accumulationAndReplicationReductionType = getattr(popart.ReductionType, reduction)
    for name in sharded:
        setattr(o, name, rts_location(min_elements))
    return o


@pytest.fixture(scope="module")
def device():
    d = popart.DeviceManager().acquireAvailableDevice(R)
    yield d
    d.detach()


_runs: dict = {}


def run(device, opt: str, sharded=(), reduction="Mean"):
    """(session, ids, anchors) of BPS batches (cached: tests share sessions)."""
    key = (opt, tuple(sharded), reduction)
    if key not in _runs:
        b, ids, _ = mlp()
        X, L = data(BPS, lead=(A, R))
        s, out = train(b, ids, OPTIMIZERS[opt](), BPS, X, L, anchors=[STATE_OF[opt] + ids["w1"]],
                       opts=options(sharded, reduction), device=device)
        _runs[key] = (s, ids, out)
    return _runs[key]


def read_all(s, ids) -> dict:
    """The weights and the optimizer state, read from the host."""
    weights = read(s, ids)   # weightsToHost, then readWeights
    state = {k: np.zeros_like(v) for k, v in testing.step_program(s).init_opt_state().items()}
    s.readWeights(popart.PyWeightsIO(state))
    return {**weights, **state}


def assert_same_training(a, b):
    (sa, ids, out_a), (sb, _, out_b) = a, b
    np.testing.assert_allclose(out_a[ids["loss"]], out_b[ids["loss"]], rtol=1e-5)
    want = read_all(sb, ids)
    for k, v in read_all(sa, ids).items():
        np.testing.assert_allclose(v, want[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("reduction", ["Mean", "Sum"])
@pytest.mark.parametrize("opt", ["sgd", "adam", "lamb"])
def test_sharded_optimizer_state_trains_as_unsharded(device, opt, reduction):
    # SGD's Accl___ is also its gradient accumulator: with accumulation, PopART places it by
    # accumulatorTensorLocationSettings
    sharded = (STATE, ACCUM) if opt == "sgd" else (STATE,)
    ref, rts = run(device, opt, (), reduction), run(device, opt, sharded, reduction)
    s, ids, out = rts
    assert testing.step_program(s).rts.stored == {p + w for p in PREFIXES[opt]
                                                  for w in (ids["w1"], ids["w2"])}
    assert_same_training(ref, rts)
    a = STATE_OF[opt] + ids["w1"]   # the optimizer-state anchor is the whole tensor
    np.testing.assert_allclose(out[a], ref[2][a], rtol=1e-5, atol=1e-7)
    assert out[a].shape == (BPS, A, R, I, 5)


@pytest.mark.parametrize("opt,reduction", [("lamb", "Mean"), ("sgd", "Sum")])
def test_sharded_weights_state_and_accumulators_train_as_unsharded(device, opt, reduction):
    rts = run(device, opt, (WEIGHTS, STATE, ACCUM), reduction)
    s, ids = rts[:2]
    assert {ids["w1"], ids["w2"]} <= testing.step_program(s).rts.stored
    assert testing.step_program(s).rts.scattered == {ids["w1"], ids["w2"], ids["b1"]}   # no minimum
    assert_same_training(run(device, opt, (), reduction), rts)


def test_each_replica_device_holds_one_shard(device):
    ref, rts = run(device, "adam", ()), run(device, "adam", (WEIGHTS, STATE, ACCUM))
    s, ids = rts[:2]
    weights, state = testing.device_values(s, "weights"), testing.device_values(s, "optimizer")
    devices = set(testing.mesh_devices(s))
    for k in ("Accl1___" + ids["w1"], "Accl2___" + ids["w1"], ids["w1"]):   # 30 -> 4 x 8
        arr = weights[k] if k in weights else state[k]
        assert [sh.data.shape for sh in arr.addressable_shards] == [(8,)] * R
        assert {sh.device for sh in arr.addressable_shards} == devices
    for k in ("Accl1___" + ids["w2"], ids["w2"]):                           # 15 -> 4 x 4
        arr = weights[k] if k in weights else state[k]
        assert [sh.data.shape for sh in arr.addressable_shards] == [(4,)] * R
    b1 = state["Accl1___" + ids["b1"]]                                     # below the minimum
    assert [sh.data.shape for sh in b1.addressable_shards] == [(5,)] * R
    before = testing.compiled(ref[0]).memory_analysis().argument_size_in_bytes
    after = testing.compiled(s).memory_analysis().argument_size_in_bytes
    # per device: Accl1, Accl2 and the weight of w1 and w2: 45 floats whole, 12 as shards
    assert before - after == 3 * (45 - 12) * 4


def test_the_update_is_a_reduce_scatter_and_an_all_gather(device):
    text = testing.compiled(run(device, "lamb", (STATE,))[0]).as_text()
    assert "reduce-scatter(" in text and "all-gather(" in text


def test_host_sees_whole_tensors(device, tmp_path):
    s, ids, _ = run(device, "adam", (WEIGHTS, STATE, ACCUM))
    ref = run(device, "adam", ())[0]
    s.modelToHost(str(tmp_path / "m.onnx"))
    ref.modelToHost(str(tmp_path / "ref.onnx"))
    saved = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "ref.onnx")).graph.initializer}
    assert set(saved) == set(want) and "Accl2___" + ids["w2"] in saved
    for k in want:
        np.testing.assert_allclose(saved[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # writeWeights goes through the shards and back
    new = {ids["w1"]: np.arange(30, dtype=np.float32).reshape(I, 5),
           "Accl1___" + ids["w2"]: np.full((5, 3), 0.5, np.float32)}
    s.writeWeights(popart.PyWeightsIO(new))
    s.weightsToHost()
    got = {k: np.zeros_like(v) for k, v in new.items()}
    s.readWeights(popart.PyWeightsIO(got))
    for k in new:
        np.testing.assert_array_equal(got[k], new[k])
    shards = testing.device_values(s, "weights")[ids["w1"]].addressable_shards
    np.testing.assert_array_equal(np.asarray(shards[3].data), [24, 25, 26, 27, 28, 29, 0, 0])
    _runs.pop(("adam", (WEIGHTS, STATE, ACCUM), "Mean"))   # its weights changed


def test_executable_round_trip(device, tmp_path):
    b, ids, _ = mlp()
    X, L = data(BPS, lead=(A, R))
    df = popart.DataFlow(BPS, {ids["loss"]: popart.AnchorReturnType("ALL")})

    def session():
        return popart.TrainingSession(b.getModelProto(), df, ids["loss"], OPTIMIZERS["lamb"](),
                                      device, userOptions=options((WEIGHTS, STATE)))
    s = session()
    s.compileAndExport(str(tmp_path / "e.popef"))
    loaded = session()
    loaded.loadExecutable(str(tmp_path / "e.popef"))
    loaded.weightsFromHost()
    out = loaded.initAnchorArrays()
    loaded.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    for k, v in read(loaded, ids).items():
        np.testing.assert_allclose(v, read(run(device, "lamb", ())[0], ids)[k], rtol=1e-5, atol=1e-7)


def test_replicas_on_one_device_keep_the_layout():
    """Replicas side by side on one device: the same shards, there (no memory saving)."""
    b, ids, _ = mlp()
    X, L = data(BPS, lead=(A, 2))
    res = []
    for sharded in ((), (WEIGHTS, STATE)):
        opts = options(sharded, replicas=2)
        s, _ = train(b, ids, OPTIMIZERS["lamb"](), BPS, X, L, opts=opts,
                     device=popart.DeviceManager().createCpuDevice())
        assert not testing.mesh_devices(s)
        res.append(read(s, ids))
    assert testing.device_values(s, "optimizer")["Accl1___" + ids["w1"]].shape == (30,)
    for k in res[0]:
        np.testing.assert_allclose(res[1][k], res[0][k], rtol=1e-5, atol=1e-7)


def test_inference_gathers_sharded_weights(device):
    b, ids, _ = mlp()
    X, L = data(BPS, lead=(R,))
    outs = []
    for sharded in ((), (WEIGHTS,)):
        o = options(sharded)
        o.enableGradientAccumulation, o.accumulationFactor = False, 1
        s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(BPS, [ids["p"]]), device,
                                    userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
        outs.append(out[ids["p"]])
    assert testing.step_program(s).rts.stored == {ids["w1"], ids["w2"]}
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6)


def test_replicas_in_two_processes(tmp_path):
    """Global replication: each process holds its replica's shards; the host sees whole
    tensors and the training equals local replicas'."""
    from popart.cli import main
    from test_distributed import HERE, assert_trains_like_local_replicas, free_port
    code = main(["launch", "-n", "2", "--port", str(free_port()),
                 os.path.join(HERE, "helpers", "dist_train.py"), str(tmp_path), "rts"])
    assert code == 0
    got = [np.load(tmp_path / f"{p}.npz") for p in range(2)]
    assert [tuple(g["shard"]) for g in got] == [(15,), (15,)]   # Accl___w1: 30 elements
    assert_trains_like_local_replicas(got, 2)


def _prepare(opts, optimizer, device=None):
    b, ids, _ = mlp()
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                               optimizer, device or popart.DeviceManager().createCpuDevice(),
                               userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    return s, ids


def test_sharded_weights_need_sharded_optimizer_state():
    """PopART: "modifies a sharded tensor, but not all required sharded inputs could be
    connected"; a stateless optimizer needs nothing more."""
    with pytest.raises(popart.OptionError, match=r"Accl1___w1.*optimizerStateTensorLocationSettings"):
        _prepare(options((WEIGHTS,), replicas=2), OPTIMIZERS["adam"]())
    opts = options((WEIGHTS, STATE), replicas=2)
    opts.optimizerStateTensorLocationSettings.minElementsForReplicatedTensorSharding = 20
    with pytest.raises(popart.OptionError, match="w2"):   # w2's 15 elements: state whole
        _prepare(opts, OPTIMIZERS["adam"]())
    s, ids = _prepare(options((WEIGHTS,), replicas=2), popart.SGD({"defaultLearningRate": (0.1, True)}))
    assert testing.step_program(s).rts.stored == {ids["w1"], ids["w2"]}


def test_bad_settings_name_the_option():
    opts = options((STATE,), replicas=2)
    opts.optimizerStateTensorLocationSettings.minElementsForReplicatedTensorSharding = -1
    with pytest.raises(popart.OptionError, match="optimizerStateTensorLocationSettings."
                       "minElementsForReplicatedTensorSharding: expected an int >= 0, got -1"):
        _prepare(opts, OPTIMIZERS["adam"]())
    opts = options((STATE,), replicas=2)
    opts.optimizerStateTensorLocationSettings.location.shardingDomain = popart.CommGroup(
        popart.CommGroupType.Consecutive, 1)
    with pytest.raises(popart.OptionError, match="shardingDomain"):
        _prepare(opts, OPTIMIZERS["adam"]())
    opts = options(replicas=2)
    opts.tensorLocationSettingsOverride = {"Accl1___w1": "OnChip"}
    with pytest.raises(popart.OptionError, match=r"tensorLocationSettingsOverride\['Accl1___w1'\]"):
        _prepare(opts, OPTIMIZERS["adam"]())


def test_sgd_accl_follows_the_accumulator_settings_when_accumulating():
    """PopART's Accl___ is SGD's momentum and its gradient accumulator."""
    sgd = OPTIMIZERS["sgd"]
    s, _ = _prepare(options((STATE,), replicas=2), sgd())
    assert not testing.step_program(s).rts.stored
    s, _ = _prepare(options((ACCUM,), replicas=2), sgd())   # the minimum: optimizer state's
    rts = testing.step_program(s).rts
    assert rts.stored == set() and rts.scattered == {"w1", "b1", "w2"}
    opts = options((ACCUM,), replicas=2)
    opts.optimizerStateTensorLocationSettings.minElementsForReplicatedTensorSharding = MIN
    s, _ = _prepare(opts, sgd())
    assert testing.step_program(s).rts.stored == {"Accl___w1", "Accl___w2"}
    opts = options((STATE,), replicas=2)
    opts.enableGradientAccumulation, opts.accumulationFactor = False, 1
    s, _ = _prepare(opts, sgd())
    assert testing.step_program(s).rts.stored == {"Accl___w1", "Accl___w2"}


def test_override_and_no_replication():
    opts = options(replicas=2)
    opts.tensorLocationSettingsOverride = {"Accl2___w2": rts_location().location}
    opts.optimizerStateTensorLocationSettings.minElementsForReplicatedTensorSharding = 0
    s, _ = _prepare(opts, OPTIMIZERS["adam"]())
    assert testing.step_program(s).rts.stored == {"Accl2___w2"}
    s, _ = _prepare(options((STATE,), replicas=1), OPTIMIZERS["adam"]())   # PopART: a warning
    assert not testing.step_program(s).rts.stored
