"""Replicated tensor sharding on placed virtual graphs and pipelines (engine/pipeline.py with
engine/rts.py's choice of tensors): 2 replicas x 2 IPUs on the suite's 4 host devices. Sharded
weights, gradient accumulators and optimizer state (Lamb, per-weight values) train as the
unsharded model on one device per replica, and each device holds 1/R of its IPU's tensors."""
from __future__ import annotations

import numpy as np
import pytest

import popart
from popart import testing
from test_model_parallel import W, assert_same, feeds, session, train
from test_rts import ACCUM, STATE, WEIGHTS, rts_location

R, A = 2, 2
SHARD = (1, W * W // R)   # each device's part of its IPU's 32 x 32 weight (or state) slot
def adam():
    return popart.Adam({"defaultLearningRate": (0.01, False)})


def lamb():
    return popart.Adam({"defaultLearningRate": (0.02, False), "defaultWeightDecay": (0.01, True)},
                       mode=popart.AdamMode.Lamb)


def sgd_per_weight():
    """SGD with momentum and clipping (the norm of the shards summed over replicas and IPUs),
    and values of its own for w1 (the update goes weight by weight)."""
    o = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)},
                   clip_norm_settings=[popart.ClipNormSettings.clipAllWeights(0.01)])
    o.insertSpecific("w1", {"learningRate": (0.05, False), "weightDecay": (0.01, True)})
    return o


def sharded(*names):
    def configure(o):
        for name in names:
            setattr(o, name, rts_location())
    return configure


_runs: dict = {}


def run(*names, placed=True, pipelined=True, optimizer=adam):
    """``train`` of two layers on two IPUs (or unplaced), R replicas, the tensor location
    settings ``names`` sharded (cached: tests share sessions)."""
    key = (names, placed, pipelined, optimizer)
    if key not in _runs:
        kw = dict(mode="Manual", pipelined=pipelined) if placed else {}
        _runs[key] = train([0, 1], R=R, A=A, optimizer=optimizer(), configure=sharded(*names), **kw)
        assert testing.is_placed(_runs[key][2]) == placed
    return _runs[key]


def assert_one_shard_per_device(s, slots):
    """Each of the 4 devices holds 1/R of its IPU's block of these slots."""
    weights, state = testing.device_values(s, "weights"), testing.device_values(s, "optimizer")
    for k in slots:
        buf = {**weights, **state}[k]
        assert len(buf.addressable_shards) == 4, k
        assert {sh.data.shape for sh in buf.addressable_shards} == {SHARD}, k


def temp_bytes(s) -> int:
    return testing.compiled(s).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sharded"])
def test_sharded_weights_train_as_one_device(pipelined):
    got = run(WEIGHTS, STATE, pipelined=pipelined)
    p = testing.placed_plan(got[2])
    assert {k.split("/")[0] for k in p.rts_slots} == {"weights", "state"}
    assert_one_shard_per_device(got[2], p.rts_slots)
    assert_same(got, run(placed=False))


def test_sharded_weights_store_half_of_each_ipu():
    """Per device: its IPU's weight and Adam's two moments, 3 x 32 x 32 floats whole, half
    of them as shards (the step counter stays whole)."""
    whole, rts = run(), run(WEIGHTS, STATE)
    size = lambda s: testing.compiled(s).memory_analysis().argument_size_in_bytes  # noqa: E731
    assert size(whole[2]) - size(rts[2]) == 3 * W * W * 4 // R
    assert "all-gather(" in testing.compiled(rts[2]).as_text()
    assert "reduce-scatter(" in testing.compiled(rts[2]).as_text()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sharded"])
def test_sharded_accumulators_train_as_one_device(pipelined):
    ref = run(placed=False)
    for names in ((ACCUM,), (WEIGHTS, STATE, ACCUM)):
        got = run(*names, pipelined=pipelined)
        weights = testing.device_values(got[2], "weights")
        assert testing.placed_plan(got[2]).tick_slots == set(weights)   # the one weight slot
        assert_same(got, ref)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sharded"])
def test_sharded_accumulators_save_temporary_memory(pipelined):
    """With the weights sharded, sharding the accumulators too (each tick's gradient
    reduce-scattered into the shards) saves at least the (1 - 1/R) of a whole accumulator
    that the backward pass of the tick loop carried."""
    whole_acc = temp_bytes(run(WEIGHTS, STATE, pipelined=pipelined)[2])
    sharded_acc = temp_bytes(run(WEIGHTS, STATE, ACCUM, pipelined=pipelined)[2])
    assert whole_acc - sharded_acc >= W * W * 4 // R, (whole_acc, sharded_acc)


def test_sharded_lamb_state_and_weights_train_as_one_device():
    """Lamb's norms of weight and update: partial sums of squares psummed over the replicas."""
    got = run(WEIGHTS, STATE, optimizer=lamb)
    p = testing.placed_plan(got[2])
    assert not p.row_weights   # weight by weight
    assert_one_shard_per_device(got[2], p.rts_slots)
    assert_same(got, run(placed=False, optimizer=lamb))


def test_sharded_state_with_per_weight_values_trains_as_one_device():
    """SGD's Accl___ with accumulation is placed by the accumulator settings; the weights
    stay whole, updated on shards."""
    got = run(STATE, ACCUM, pipelined=False, optimizer=sgd_per_weight)
    p = testing.placed_plan(got[2])
    assert not p.row_weights and p.update_slots
    assert_one_shard_per_device(got[2], [k for k in p.rts_slots if k.startswith("state/Accl___")])
    assert_same(got, run(placed=False, optimizer=sgd_per_weight))


def test_inference_gathers_sharded_weights():
    def infer(**kw):
        s, ids, dev = session([0, 1], R=R, A=1, bps=2, inference=True,
                              configure=sharded(WEIGHTS), **kw)
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO(feeds(ids, 2, 1, R), out))
        dev.detach()
        return s, out
    ref = infer()[1]
    s, got = infer(mode="Manual", pipelined=True)
    assert testing.is_placed(s) and testing.placed_plan(s).rts_slots == {"weights/float32/r2fs/0"}
    assert_one_shard_per_device(s, testing.placed_plan(s).rts_slots)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_forward_only_program_runs_on_the_sharded_weights():
    """run("implicitPipeliningFwdOnly") of a pipelined session with sharded weights: the
    forward pass on the trained weights, all-gathered from the training program's shards."""
    def configure(o):
        sharded(WEIGHTS, STATE)(o)
        o.createImplicitPipeliningFwdOnlyProgram = True
    s, ids, dev = session([0, 1], mode="Manual", pipelined=True, R=R, A=A, bps=1, configure=configure)
    out, f = s.initAnchorArrays(), feeds(ids, 1, A, R)
    s.run(popart.PyStepIO(f, out))   # one training step
    w0 = np.zeros((W, W), np.float32)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({"w0": w0}))
    s.run("implicitPipeliningFwdOnly", popart.PyStepIO(f, out))
    dev.detach()
    fwd = testing.placed_plan(s, fwd_only=True)
    assert fwd is not None and fwd.rts_slots == {"weights/float32/r2s/0"}
    np.testing.assert_allclose(out[ids["first"]], np.tanh(f[ids["x"]][0] @ w0), rtol=1e-5, atol=1e-6)


def test_forward_only_program_runs_on_off_chip_weights():
    """The forward-only program takes the training program's off-chip slots too (host memory
    between runs); training goes on after it."""
    def configure(o):
        o.weightTensorLocationSettings = popart.TensorLocationSettings(
            popart.TensorLocation(popart.TensorStorage.OffChip), 0, 0)
        o.createImplicitPipeliningFwdOnlyProgram = True
    s, ids, dev = session([0, 1], mode="Manual", pipelined=True, R=1, A=A, bps=1, configure=configure)
    out, f = s.initAnchorArrays(), feeds(ids, 1, A, 1)
    s.run(popart.PyStepIO(f, out))
    w0 = np.zeros((W, W), np.float32)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({"w0": w0}))
    s.run("implicitPipeliningFwdOnly", popart.PyStepIO(f, out))
    np.testing.assert_allclose(out[ids["first"]], np.tanh(f[ids["x"]][0] @ w0), rtol=1e-5, atol=1e-6)
    s.run(popart.PyStepIO(f, out))
    dev.detach()
    fwd_off_chip = testing.placed_plan(s, fwd_only=True).off_chip
    assert fwd_off_chip == testing.placed_plan(s).off_chip != frozenset()
    weights = testing.device_values(s, "weights")
    assert {v.sharding.memory_kind for v in weights.values()} == {"pinned_host"}
