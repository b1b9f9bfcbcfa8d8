"""Only what changed crosses between host and device (issue 35, item 6), counted with
``popart.testing.count_transfers``: writeWeights sends the written tensors only (the optimizer
state stays on the device); a run is followed by no copy until the host asks; a recompile
whose layout is unchanged keeps the device state; popxl copies back only the variables a run
writes, and only those asked for. The values are checked against NumPy."""
from __future__ import annotations

import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from popart import testing
from popart.testing import count_transfers

SHAPES = {"w1": (8, 16), "w2": (16, 4)}
X = np.linspace(-1, 1, 4 * 8, dtype=np.float32).reshape(4, 8)


def _nbytes(arrays) -> int:
    return sum(np.asarray(a).nbytes for a in arrays)


@pytest.fixture(scope="module")
def adam():
    """A prepared TrainingSession with Adam: two weights, four optimizer-state tensors each
    (Accl1, Accl2, Step, and the weight's own) plus the step counter."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 8]), "x")
    rng = np.random.default_rng(0)
    ids = {k: b.addInitializedInputTensor(rng.standard_normal(s).astype(np.float32), k)
           for k, s in SHAPES.items()}
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, ids["w1"]])])
    loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([h, ids["w2"]])], 0.1)
    s = popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [loss]),
                               deviceInfo=popart.DeviceManager().createCpuDevice(), loss=loss,
                               optimizer=popart.Adam({"defaultLearningRate": (0.01, False)}))
    s.prepareDevice()
    s.weightsFromHost()
    return s, ids, x, loss


def _run(s, x):
    s.run(popart.PyStepIO({x: X}, s.initAnchorArrays()))


def test_write_weights_sends_only_the_written_weight(adam):
    s, ids, x, _ = adam
    state = testing.device_values(s, "optimizer")
    new = np.full(SHAPES["w1"], 0.25, np.float32)
    with count_transfers() as c:
        s.writeWeights(popart.PyWeightsIO({ids["w1"]: new}))
    assert (c.to_device, c.to_device_bytes, c.to_host) == (1, new.nbytes, 0), c.log
    after = testing.device_values(s, "optimizer")
    assert all(after[k] is state[k] for k in state)   # the optimizer state never moved
    np.testing.assert_array_equal(np.asarray(testing.device_values(s, "weights")[ids["w1"]]), new)


def test_run_then_read_weights_moves_nothing_until_weights_to_host(adam):
    s, ids, x, _ = adam
    _run(s, x)
    with count_transfers() as c:   # readWeights reads the host copy (PopART's Devicex::readWeights)
        got = {k: np.zeros(v, np.float32) for k, v in SHAPES.items()}
        s.readWeights(popart.PyWeightsIO({ids[k]: got[k] for k in SHAPES}))
    assert (c.to_device, c.to_host) == (0, 0), c.log
    weights, state = testing.device_values(s, "weights"), testing.device_values(s, "optimizer")
    with count_transfers() as c:
        s.weightsToHost()
        s.weightsToHost()   # in sync now: nothing crosses again
    assert c.to_device == 0 and c.to_host == len(weights) + len(state), c.log
    assert c.to_host_bytes == _nbytes(list(weights.values()) + list(state.values()))
    s.readWeights(popart.PyWeightsIO({ids[k]: got[k] for k in SHAPES}))
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], np.asarray(weights[ids[k]]))


def test_recompile_keeps_the_device_state(adam):
    s, ids, x, _ = adam
    before = testing.device_values(s)
    with count_transfers() as c:
        s._recompile()
    assert (c.to_device, c.to_host) == (0, 0), c.log
    after = testing.device_values(s)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    _run(s, x)   # the new program runs on the kept buffers


def _three_variables():
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((64,), popxl.float32, "x")
        a = popxl.variable(np.zeros(64, np.float32), name="a")
        b = popxl.variable(np.arange(32, dtype=np.float32), name="b")
        c = popxl.variable(np.ones((4, 4), np.float32), name="c")
        out = popxl.d2h_stream((64,), popxl.float32, "out")
        ops.var_updates.accumulate_(a, ops.host_load(xs))
        ops.host_store(out, a + ops.sum(b) + ops.sum(c))
    return ir, xs, (a, b, c)


def test_popxl_copies_back_only_what_a_run_wrote():
    ir, xs, (a, b, c) = _three_variables()
    s = popxl.Session(ir, "cpu")
    x = np.linspace(0, 1, 64, dtype=np.float32)
    with s:
        s.run({xs: x})
        assert not a.in_sync_with_ipu   # PopXL: every variable is out of sync after a run
        with count_transfers() as n:
            got = [s.get_tensor_data(v) for v in (a, b, c)]
            s.get_tensor_data(a)   # fetched already
        assert (n.to_device, n.to_host, n.to_host_bytes) == (0, 1, x.nbytes), n.log
        np.testing.assert_array_equal(got[0], x)
        np.testing.assert_array_equal(got[1], np.arange(32, dtype=np.float32))
        np.testing.assert_array_equal(got[2], np.ones((4, 4), np.float32))
        with count_transfers() as n:
            s.write_variable_data(b, np.full(32, 2.0, np.float32))
        assert (n.to_device, n.to_device_bytes, n.to_host) == (1, 128, 0), n.log
    with count_transfers() as n:
        with s:   # entering: the 3 variables to the device; leaving: the one a run wrote back
            s.run({xs: x})   # (and its stream's output, [replicas, transfers, 64])
    assert (n.to_device, n.to_host, n.to_host_bytes) == (3, 2, 2 * x.nbytes), n.log
    assert [e[1] for e in n.log if e[0] == "to_host"] == [(1, 1, 64), (1, 64)]
    np.testing.assert_array_equal(s.get_tensor_data(a), 2 * x)
    np.testing.assert_array_equal(s.get_tensor_data(b), np.full(32, 2.0, np.float32))


def test_replica_sharded_weight_is_written_as_its_shards_and_kept_by_a_recompile():
    """Replicated tensor sharding: the written weight crosses once, in its stored (padded,
    flat) form; the optimizer state stays; a recompile keeps every buffer."""
    from test_rts import OPTIMIZERS, R, STATE, WEIGHTS, options
    from test_training import I, data, mlp, train
    device = popart.DeviceManager().acquireAvailableDevice(R)
    try:
        b, ids, _ = mlp()
        X, L = data(1, lead=(2, R))
        s, _ = train(b, ids, OPTIMIZERS["adam"](), 1, X, L, opts=options((WEIGHTS, STATE)),
                     device=device)
        w1 = ids["w1"]
        stored = testing.device_values(s, "weights")[w1]
        state = testing.device_values(s, "optimizer")
        new = np.arange(I * 5, dtype=np.float32).reshape(I, 5)
        assert stored.shape == (-(-new.size // R) * R,)   # flat, padded to the replicas: sharded
        with count_transfers() as c:
            s.writeWeights(popart.PyWeightsIO({w1: new}))
        assert (c.to_device, c.to_device_bytes, c.to_host) == (1, stored.nbytes, 0), c.log
        assert all(testing.device_values(s, "optimizer")[k] is state[k] for k in state)
        flat = np.asarray(testing.device_values(s, "weights")[w1])
        np.testing.assert_array_equal(flat[:new.size], new.reshape(-1))
        before = testing.device_values(s)
        with count_transfers() as c:
            s._recompile()
        assert (c.to_device, c.to_host) == (0, 0), c.log
        assert all(testing.device_values(s)[k] is before[k] for k in before)
    finally:
        device.detach()
