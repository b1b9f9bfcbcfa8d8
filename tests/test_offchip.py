"""OffChip tensor locations: weights and optimizer state kept in host memory (the devices'
``pinned_host`` memory kind), moved to the device for each step and back; the numbers of
resident training."""
from __future__ import annotations

import numpy as np
import pytest

import popart
from popart import testing

from test_training import data, mlp, read, train

ADAM = {"defaultLearningRate": (0.01, False)}


def off_chip(min_elements=2, rts=False):
    loc = popart.TensorLocation(popart.TensorStorage.OffChip,
                                popart.ReplicatedTensorSharding.On if rts else popart.ReplicatedTensorSharding.Off)
    return popart.TensorLocationSettings(loc, min_elements, 8)


def run(opts, replicas=1, steps=2):
    b, ids, _ = mlp()
    X, L = data(2, lead=(replicas,) if replicas > 1 else ())
    if replicas > 1:
        opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, replicas
    dev = popart.DeviceManager().acquireAvailableDevice(replicas) if replicas > 1 else None
    s, out = train(b, ids, popart.Adam(ADAM), 2, X, L, opts=opts, device=dev)
    losses = [out[ids["loss"]].copy()]
    for _ in range(steps - 1):
        s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
        losses.append(out[ids["loss"]].copy())
    return s, ids, losses, read(s, ids)


@pytest.fixture(scope="module")
def resident():
    return run(popart.SessionOptions())


def test_off_chip_weights_and_state_live_in_host_memory(resident):
    o = popart.SessionOptions()
    o.weightTensorLocationSettings = off_chip(min_elements=8)       # b1 (5 elements) stays
    o.optimizerStateTensorLocationSettings = off_chip()
    s, ids, losses, weights = run(o)
    kinds = {k: v.sharding.memory_kind for k, v in testing.device_values(s, "weights").items()}
    assert kinds == {ids["w1"]: "pinned_host", ids["w2"]: "pinned_host", ids["b1"]: "device"}
    # the optimizer state too, but Adam's step counters (1 element < minElementsForOffChip)
    state = testing.device_values(s, "optimizer")
    assert {k: v.sharding.memory_kind for k, v in state.items()} == {
        k: "device" if k.startswith("Step___") else "pinned_host" for k in state}
    for g, r in zip(losses, resident[2]):
        np.testing.assert_array_equal(g, r)
    for k in weights:
        np.testing.assert_array_equal(weights[k], resident[3][k])


def test_off_chip_override_and_executable_round_trip(tmp_path, resident):
    """``tensorLocationSettingsOverride`` puts one tensor off chip; a saved executable of the
    session loads and resumes with it there."""
    o = popart.SessionOptions()
    b, ids, _ = mlp()
    o.tensorLocationSettingsOverride = {"Accl1___" + ids["w1"]: popart.TensorLocation(popart.TensorStorage.OffChip)}
    s, ids, losses, _ = run(o, steps=1)
    state = testing.device_values(s, "optimizer")
    assert [k for k, v in state.items() if v.sharding.memory_kind == "pinned_host"] == \
        ["Accl1___" + ids["w1"]]
    path = str(tmp_path / "exe.popef")
    s.saveExecutable(path)
    X, L = data(2)
    df = popart.DataFlow(2, {ids["loss"]: popart.AnchorReturnType("ALL")})
    again = popart.TrainingSession(b.getModelProto(), df, ids["loss"], popart.Adam(ADAM),
                                   popart.DeviceManager().createCpuDevice(), userOptions=o)
    again.loadExecutable(path)
    again.weightsFromHost()
    out = again.initAnchorArrays()
    again.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
    np.testing.assert_allclose(out[ids["loss"]], resident[2][1], rtol=1e-6)


def test_off_chip_with_replicated_tensor_sharding():
    """Sharded and off chip: each replica's shard in its device's host memory."""
    ref = run(popart.SessionOptions(), replicas=2)
    o = popart.SessionOptions()
    o.optimizerStateTensorLocationSettings = off_chip(rts=True)
    s, ids, losses, weights = run(o, replicas=2)
    accl = testing.device_values(s, "optimizer")["Accl1___" + ids["w1"]]
    assert accl.sharding.memory_kind == "pinned_host"
    assert {sh.data.shape for sh in accl.addressable_shards} == {(accl.shape[0] // 2,)}
    for g, r in zip(losses, ref[2]):
        np.testing.assert_allclose(g, r, rtol=1e-5)
    for k in weights:
        np.testing.assert_allclose(weights[k], ref[3][k], rtol=1e-5, atol=1e-7)


def test_off_chip_weights_of_execution_phases():
    """VirtualGraphMode.ExecutionPhases with OffChip weights and optimizer state: the placed
    program keeps their slots in host memory between steps; the numbers of resident
    training."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 16]), "x")
    h = x
    for p in range(4):
        with b.executionPhase(p):
            w = b.addInitializedInputTensor((rs.randn(16, 16) * 0.3).astype(np.float32), f"w{p}")
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
    with b.executionPhase(3):
        loss = b.aiGraphcore.l1loss([h], 0.1)
    feed = rs.randn(2, 4, 16).astype(np.float32)
    results = []
    for off in (False, True):
        o = popart.SessionOptions()
        o.virtualGraphMode = popart.VirtualGraphMode.ExecutionPhases
        o.executionPhaseSettings.phases = 4
        if off:
            o.weightTensorLocationSettings = off_chip()
            o.optimizerStateTensorLocationSettings = off_chip()
        dev = popart.DeviceManager().acquireAvailableDevice(2)
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, [loss]), loss,
                                   popart.Adam(ADAM), dev, userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        for _ in range(2):
            s.run(popart.PyStepIO({x: feed}, out))
        weights = {f"w{p}": np.zeros((16, 16), np.float32) for p in range(4)}
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO(weights))
        dev.detach()
        assert testing.is_placed(s)
        kinds = {v.sharding.memory_kind for k, v in testing.device_values(s).items()
                 if "Step___" not in k}
        assert kinds == ({"pinned_host"} if off else {"device"})
        results.append((out[loss].copy(), weights))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    for k in results[0][1]:
        np.testing.assert_allclose(results[1][1][k], results[0][1][k], rtol=1e-6)
