"""Virtual graphs and pipelining placed on devices (engine/pipeline.py): the same numbers as
the whole model on one device, each IPU's weights and optimizer state only on its device, and
PopART's pipeline schedule in the compiled program. Runs on the suite's 4 host devices."""
from __future__ import annotations

import re

import numpy as np
import pytest

import popart
from popart import testing

W, B = 32, 4   # layer width, batch


def model(stage_ipu, skip=True, tied=True):
    """One tanh(matmul) layer per pipeline stage on the given IPUs; optionally a skip
    connection from stage 0 to the last stage and the first weight used again at the end
    (tensors that cross more than one stage, a weight read on two IPUs)."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [B, W]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [B]), "label")
    h, first, w0 = x, None, None
    for i, ipu in enumerate(stage_ipu):
        with b.virtualGraph(ipu), b.pipelineStage(i):
            w = b.addInitializedInputTensor((rs.randn(W, W) * 0.3).astype(np.float32), f"w{i}")
            w0 = w0 or w
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
            first = first or h
            if i == len(stage_ipu) - 1:
                if skip:
                    h = b.aiOnnx.add([h, first])
                if tied:
                    h = b.aiOnnx.matmul([h, w0])
                p = b.aiOnnx.softmax([h], axis=1)
                loss = b.aiGraphcore.nllloss([p, lab], reduction=popart.ReductionType.Mean)
    return b, dict(x=x, label=lab, loss=loss, first=first, out=h)


def session(stage_ipu, mode="Off", pipelined=False, A=4, bps=2, R=1, optimizer=None,
            inference=False, configure=None, **kw):
    b, ids = model(stage_ipu, **kw)
    o = popart.SessionOptions()
    if configure is not None:
        configure(o)
    o.virtualGraphMode = getattr(popart.VirtualGraphMode, mode)
    o.enablePipelining = pipelined
    if A > 1:
        o.enableGradientAccumulation, o.accumulationFactor = True, A
    if R > 1:
        o.enableReplicatedGraphs, o.replicatedGraphCount = True, R
        o.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    ipus = (max(stage_ipu) + 1 if mode != "Off" else 1) * R
    dev = popart.DeviceManager().acquireAvailableDevice(ipus)
    anchors = [ids["loss"], ids["first"], ids["x"]] if not inference else [ids["out"], ids["x"]]
    df = popart.DataFlow(bps, {a: popart.AnchorReturnType("ALL") for a in anchors})
    if inference:
        s = popart.InferenceSession(b.getModelProto(), df, dev, userOptions=o)
    else:
        s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], optimizer or popart.Adam(
            {"defaultLearningRate": (0.01, False)}), dev, userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    return s, ids, dev


def feeds(ids, bps, A, R=1):
    rs = np.random.RandomState(1)
    lead = (bps,) + ((A,) if A > 1 else ()) + ((R,) if R > 1 else ())
    return {ids["x"]: rs.randn(*lead, B, W).astype(np.float32),
            ids["label"]: rs.randint(0, W, lead + (B,)).astype(np.int32)}


def train(stage_ipu, steps=2, **kw):
    """Anchors of ``steps`` runs and the final weights (and optimizer state)."""
    s, ids, dev = session(stage_ipu, **kw)
    out = s.initAnchorArrays()
    runs = []
    for _ in range(steps):
        s.run(popart.PyStepIO(feeds(ids, kw.get("bps", 2), kw.get("A", 4), kw.get("R", 1)), out))
        runs.append({k: v.copy() for k, v in out.items()})
    s.weightsToHost()
    state = {k: np.zeros(v.shape, v.dtype) for k, v in s._host_opt_state.items()}
    state.update({f"w{i}": np.zeros((W, W), np.float32) for i in range(len(stage_ipu))})
    s.readWeights(popart.PyWeightsIO(state))
    dev.detach()
    return runs, state, s


def assert_same(got, ref):
    for g, r in zip(got[0], ref[0]):
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert sorted(got[1]) == sorted(ref[1])
    for k in ref[1]:
        np.testing.assert_allclose(got[1][k], ref[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def two_ipu_session(model, loss, ipus, optimizer, bps=1):
    """A TrainingSession of a model annotated for two pipeline stages: on one device
    (``ipus`` 1, annotations off) or pipelined over two; accumulation 2."""
    o = popart.SessionOptions()
    o.enableGradientAccumulation, o.accumulationFactor = True, 2
    if ipus > 1:
        o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, True
    dev = popart.DeviceManager().acquireAvailableDevice(ipus)
    s = popart.TrainingSession(model, popart.DataFlow(bps, [loss]), loss, optimizer, dev, userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    assert testing.is_placed(s) == (ipus > 1)
    return s, dev


FOUR = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def one_device():
    return train(FOUR)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sharded", "pipelined"])
def test_placed_training_equals_one_device(one_device, pipelined):
    got = train(FOUR, mode="Manual", pipelined=pipelined)
    assert testing.is_placed(got[2])
    assert_same(got, one_device)


def test_each_ipu_holds_only_its_weights_and_optimizer_state(one_device):
    _, _, s = train(FOUR, steps=1, mode="Manual", pipelined=True)
    weights, state = testing.device_values(s, "weights"), testing.device_values(s, "optimizer")
    for bufs in (weights, state):
        for buf in bufs.values():   # [ipus, *block], one block per device
            assert buf.shape[0] == 4
            assert sorted(sh.device.id for sh in buf.addressable_shards) == \
                sorted(d.id for d in testing.mesh_devices(s))
            assert {sh.data.shape for sh in buf.addressable_shards} == {(1,) + buf.shape[1:]}
    # one layer's weight per device; Adam's two moments and step counter beside it
    slot = "weights/float32/r2/0"
    assert {k: v.shape[1:] for k, v in weights.items()} == {slot: (W, W)}
    assert {k: v.shape[1:] for k, v in state.items()} == {
        f"state/Accl1___/float32/{slot}": (W, W), f"state/Accl2___/float32/{slot}": (W, W),
        f"state/Step___/float32/{slot}": ()}
    # the compiled program's arguments on one device: about a quarter of the whole model's
    whole = testing.compiled(one_device[2]).memory_analysis().argument_size_in_bytes
    placed = testing.compiled(s).memory_analysis().argument_size_in_bytes
    assert placed < 0.35 * whole, (placed, whole)


def test_pipeline_schedule_in_the_compiled_program():
    """PopART's schedule: stage s works on micro-batch t - s in tick t, all stages at once in
    the main phase; the compiled step loops A + S - 1 ticks, each a collective permute of the
    stages' outputs to the next devices (a timing-free check of the overlap)."""
    _, _, s = train([0, 1, 2], steps=1, mode="Manual", pipelined=True, A=4)
    p = testing.step_program(s)
    assert testing.placed_plan(s).schedule == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1), (2, 0)],
                          [(0, 3), (1, 2), (2, 1)], [(1, 3), (2, 2)], [(2, 3)]]
    hlo = p.compiled.as_text()
    trips = {int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)}
    assert 4 + 3 - 1 in trips
    assert "collective-permute" in hlo


def test_stages_sharing_ipus_and_replication(one_device):
    """Four stages on two IPUs (stages 0 and 2 on IPU 0), two replicas: a (replica, ipu)
    mesh of 4 devices; the same numbers as two replicas of the whole model."""
    ref = train([0, 1, 0, 1], R=2, A=4, optimizer=popart.SGD(
        {"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)}))
    for pipelined in (False, True):
        got = train([0, 1, 0, 1], mode="Manual", pipelined=pipelined, R=2, A=4, optimizer=popart.SGD(
            {"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)}))
        assert testing.mesh_shape(got[2]) == (2, 2)
        assert_same(got, ref)


def test_auto_mode_splits_by_cost():
    got = train(FOUR, mode="Auto", steps=1, skip=False, tied=False)
    assert testing.placed_plan(got[2]).stages.stage_ipu == [0, 1, 2, 3]
    assert_same(got, train(FOUR, steps=1, skip=False, tied=False))


def test_pipelined_inference_equals_one_device():
    def infer(**kw):
        s, ids, dev = session([0, 1, 2], inference=True, A=1, bps=4, **kw)
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO(feeds(ids, 4, 1), out))
        dev.detach()
        return s, out
    ref = infer()[1]
    s, got = infer(mode="Manual", pipelined=True)
    assert testing.is_placed(s) and testing.placed_plan(s).stages.pipelined
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_weights_written_to_a_placed_session_are_used():
    s, ids, dev = session(FOUR, mode="Manual", A=1)
    new = {f"w{i}": np.full((W, W), 0.01 * (i + 1), np.float32) for i in range(4)}
    s.writeWeights(popart.PyWeightsIO(new))
    s.weightsFromHost()
    back = {k: np.zeros_like(v) for k, v in new.items()}
    s.readWeights(popart.PyWeightsIO(back))
    for k in new:
        np.testing.assert_array_equal(back[k], new[k])
    out = s.initAnchorArrays()
    f = feeds(ids, 2, 1)
    s.run(popart.PyStepIO(f, out))
    dev.detach()
    h = np.tanh(f[ids["x"]][0] @ new["w0"])   # the first stage's output on the written weights
    np.testing.assert_allclose(out[ids["first"]][0], h, rtol=1e-5)


def test_ipus_sharing_devices_run_unplaced_with_a_log_line(caplog):
    """Eight IPUs on the suite's four devices: the whole model runs on one device, and the log
    says why."""
    b, ids = model(list(range(8)), skip=False, tied=False)
    o = popart.SessionOptions()
    o.virtualGraphMode = popart.VirtualGraphMode.Manual
    dev = popart.DeviceManager().createIpuModelDevice({"numIPUs": 8})
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                               popart.ConstSGD(0.1), dev, userOptions=o)
    logger = popart.getLogger("session")
    level = logger.getLevel()
    logger.setLevel("INFO")
    try:
        s.prepareDevice()
        s.weightsFromHost()
    finally:
        logger.setLevel(level)
    assert not testing.is_placed(s)
    assert any("IPUs share" in r.getMessage() for r in caplog.records)


def test_gradients_of_activations_as_anchors():
    """``Gradient___X`` of an activation (and of an input) per micro-batch, from a placed
    pipeline: those of one device."""
    def grads(**kw):
        b, ids = model([0, 1, 2])
        names = [popart.reservedGradientPrefix() + t for t in (ids["first"], ids["x"])]
        o = popart.SessionOptions()
        o.enableGradientAccumulation, o.accumulationFactor = True, 3
        if kw:
            o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, True
        dev = popart.DeviceManager().acquireAvailableDevice(3 if kw else 1)
        df = popart.DataFlow(1, {a: popart.AnchorReturnType("ALL") for a in names + [ids["loss"]]})
        s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], popart.ConstSGD(0.1), dev,
                                   userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO(feeds(ids, 1, 3), out))
        dev.detach()
        assert testing.is_placed(s) == bool(kw)
        return out
    ref, got = grads(), grads(placed=True)
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.abs(ref[k]).max() > 0
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_stashed_and_restored_activations_as_anchors():
    """A pipelined step's ``Stashed___X`` / ``Restored___X`` anchors give activation X of
    each micro-batch (what PopART stashes between X's forward and backward stages)."""
    b, ids = model([0, 1, 2])
    o = popart.SessionOptions()
    o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, True
    o.enableGradientAccumulation, o.accumulationFactor = True, 3
    first = ids["first"]
    names = [popart.reservedStashedPrefix() + first, popart.reservedRestoredPrefix() + first, first]
    df = popart.DataFlow(1, {a: popart.AnchorReturnType("ALL") for a in names})
    dev = popart.DeviceManager().acquireAvailableDevice(3)
    s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], popart.ConstSGD(0.1), dev, userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    f = feeds(ids, 1, 3)
    s.run(popart.PyStepIO(f, out))
    dev.detach()
    w0 = (np.random.RandomState(0).randn(W, W) * 0.3).astype(np.float32)   # model()'s first weight
    for a in names:
        np.testing.assert_allclose(out[a], np.tanh(f[ids["x"]][0] @ w0), rtol=1e-5, atol=1e-6)


def test_execution_phases_run_on_alternating_ipus():
    """VirtualGraphMode.ExecutionPhases: phase p on IPU p mod 2, in phase order; the same
    numbers as the whole model on one device."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [B, W]), "x")
    h = x
    for p in range(4):
        with b.executionPhase(p):
            w = b.addInitializedInputTensor((rs.randn(W, W) * 0.3).astype(np.float32), f"w{p}")
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
    with b.executionPhase(3):
        loss = b.aiGraphcore.l1loss([h], 0.1)
    runs = {}
    for mode in ("Off", "ExecutionPhases"):
        o = popart.SessionOptions()
        o.virtualGraphMode = getattr(popart.VirtualGraphMode, mode)
        if mode != "Off":
            o.executionPhaseSettings.phases = 4
        dev = popart.DeviceManager().acquireAvailableDevice(2 if mode != "Off" else 1)
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, [loss]), loss,
                                   popart.ConstSGD(0.1), dev, userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: np.random.RandomState(2).randn(2, B, W).astype(np.float32)}, out))
        weights = {f"w{p}": np.zeros((W, W), np.float32) for p in range(4)}
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO(weights))
        dev.detach()
        runs[mode] = (out[loss], weights, s)
    assert testing.placed_plan(runs["ExecutionPhases"][2]).stages.stage_ipu == [0, 1, 0, 1]
    np.testing.assert_allclose(runs["ExecutionPhases"][0], runs["Off"][0], rtol=1e-5)
    for k in runs["Off"][1]:
        np.testing.assert_allclose(runs["ExecutionPhases"][1][k], runs["Off"][1][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["Adam", "Lamb"])
def test_updates_of_several_weights_per_ipu(mode):
    """Two weights per IPU: Adam updates whole rows (its step counters per weight kept in
    step), Lamb weight by weight (its norms are per weight); both equal one device."""
    def opt():
        return popart.Adam({"defaultLearningRate": (0.02, False), "defaultWeightDecay": (0.01, True)},
                           mode=getattr(popart.AdamMode, mode))
    got = train([0, 1, 0, 1], mode="Manual", optimizer=opt(), steps=2)
    assert bool(testing.placed_plan(got[2]).row_weights) == (mode == "Adam")
    assert_same(got, train([0, 1, 0, 1], optimizer=opt(), steps=2))


def test_gather_index_checks_on_a_placed_pipeline():
    """An embedding (Gather) on IPU 0, a matmul on IPU 1: the placed pipeline trains as one
    device does, and an index out of range raises PopART's run-time error naming it."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    idx = b.addInputTensor(popart.TensorInfo("INT32", [B]), "idx")
    with b.virtualGraph(0), b.pipelineStage(0):
        emb = b.addInitializedInputTensor(rs.randn(10, W).astype(np.float32), "emb")
        h = b.aiOnnx.gather([emb, idx])
    with b.virtualGraph(1), b.pipelineStage(1):
        w = b.addInitializedInputTensor(rs.randn(W, 3).astype(np.float32), "w")
        loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([h, w])], 0.1)
    results = []
    for placed in (False, True):
        s, dev = two_ipu_session(b.getModelProto(), loss, 2 if placed else 1, popart.ConstSGD(0.1))
        out = s.initAnchorArrays()
        good = rs.randint(0, 10, (2, B)).astype(np.int32) if not results else results[0][2]
        s.run(popart.PyStepIO({idx: good}, out))
        weights = {"emb": np.zeros((10, W), np.float32), "w": np.zeros((W, 3), np.float32)}
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO(weights))
        if placed:
            bad = good.copy()
            bad[1, 2] = 12
            with pytest.raises(popart.popart_runtime_error, match="12"):
                s.run(popart.PyStepIO({idx: bad}, out))
        dev.detach()
        results.append((out[loss].copy(), weights, good))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for k in results[0][1]:
        np.testing.assert_allclose(results[1][1][k], results[0][1][k], rtol=1e-5, atol=1e-6)


def test_gradient_norm_clipping_spans_ipus():
    """ClipNormSettings over weights on different IPUs: one norm over all of them (a sum
    across the devices), as on one device; with Adam's whole-row update."""
    def opt():
        return popart.Adam({"defaultLearningRate": (0.05, False)}, clip_norm_settings=[
            popart.ClipNormSettings(["w0", "w2"], 0.05), popart.ClipNormSettings.clipAllWeights(0.5)])
    got = train(FOUR, mode="Manual", pipelined=True, optimizer=opt())
    assert testing.is_placed(got[2]) and testing.placed_plan(got[2]).row_weights
    assert_same(got, train(FOUR, optimizer=opt()))


def test_batch_normalization_statistics_on_a_placed_pipeline():
    """BatchNormalization on IPU 0 writes its running mean and variance (variables an op
    assigns): the placed pipeline keeps them on their device with the values of one device
    (the last micro-batch's statistics, as the unplaced step)."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [B, 3, 4, 4]), "x")
    with b.virtualGraph(0), b.pipelineStage(0):
        params = [b.addInitializedInputTensor(v, n) for v, n in (
            (rs.rand(3).astype(np.float32) + 0.5, "scale"), (rs.randn(3).astype(np.float32), "bias"),
            (np.zeros(3, np.float32), "mean"), (np.ones(3, np.float32), "var"))]
        y = b.aiOnnx.batchnormalization([x] + params, 5)[0]
    with b.virtualGraph(1), b.pipelineStage(1):
        w = b.addInitializedInputTensor(rs.randn(48, 2).astype(np.float32), "w")
        loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([b.aiOnnx.reshape([y, b.aiOnnx.constant(
            np.array([B, 48], np.int64))]), w])], 0.1)
    feed = rs.randn(2, 2, B, 3, 4, 4).astype(np.float32)
    results = []
    for placed in (False, True):
        s, dev = two_ipu_session(b.getModelProto(), loss, 2 if placed else 1,
                                 popart.SGD({"defaultLearningRate": (0.1, False)}), bps=2)
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: feed}, out))
        weights = {n: np.zeros(s.getInfo(n).shape(), np.float32) for n in ("scale", "bias", "mean", "var", "w")}
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO(weights))
        dev.detach()
        results.append((out[loss].copy(), weights))
    assert not np.allclose(results[1][1]["mean"], 0)   # the statistics moved
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for k in results[0][1]:
        np.testing.assert_allclose(results[1][1][k], results[0][1][k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_tensors_read_inside_subgraphs_cross_stages():
    """An If on IPU 1 whose branches read stage 0's activation and a graph input from the
    enclosing graph: the activation is sent to IPU 1, the input fed there, and the numbers
    are those of one device."""
    from onnx import TensorProto, helper, numpy_helper
    rs = np.random.RandomState(0)

    def placed(node, ipu):
        node.attribute.extend([helper.make_attribute("__ipu_number", ipu),
                               helper.make_attribute("__pipeline_stage", ipu)])
        return node

    def branch(op, out, inputs=("h",)):
        return helper.make_graph([helper.make_node(op, list(inputs), [out])], op, [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, [B, W])])
    loss = helper.make_node("L1", ["z"], ["loss"], domain="ai.graphcore", reduction=0)
    loss.attribute.extend([helper.make_attribute("lambda", 0.1)])
    nodes = [placed(helper.make_node("MatMul", ["x", "w0"], ["m"]), 0),
             placed(helper.make_node("Tanh", ["m"], ["h"]), 0),
             placed(helper.make_node("If", ["c"], ["y"], then_branch=branch("Relu", "t"),
                                     else_branch=branch("Sub", "e", ("h", "x"))), 1),
             placed(helper.make_node("MatMul", ["y", "w1"], ["z"]), 1), placed(loss, 1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, W]),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array((rs.randn(W, W) * 0.3).astype(np.float32), "w0"),
         numpy_helper.from_array(rs.randn(W, 2).astype(np.float32), "w1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11),
                                                    helper.make_opsetid("ai.graphcore", 1)])
    feeds = {"x": rs.randn(2, B, W).astype(np.float32), "c": np.array([True, False])}
    losses = []
    for ipus in (1, 2):
        s, dev = two_ipu_session(model.SerializeToString(), "loss", ipus, popart.ConstSGD(0.1))
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO(feeds, out))
        dev.detach()
        losses.append(out["loss"].copy())
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_replica_sharded_optimizer_state_on_a_placed_pipeline():
    """Two replicas x two IPUs with the optimizer state sharded over the replicas: each
    device holds half of its IPU's Adam moments; the numbers of the unsharded run."""
    def opts_rts(o):
        on = popart.TensorLocation(popart.TensorStorage.OnChip, popart.ReplicatedTensorSharding.On)
        o.optimizerStateTensorLocationSettings = popart.TensorLocationSettings(on, 0, 8)
    ref = train([0, 1], R=2, A=2)
    got = train([0, 1], mode="Manual", pipelined=True, R=2, A=2, configure=opts_rts)
    p = testing.placed_plan(got[2])
    assert p is not None and p.rts_slots
    for k in p.rts_slots:
        buf = testing.device_values(got[2], "optimizer")[k]
        assert {sh.data.shape for sh in buf.addressable_shards} == {(1, buf.shape[1] // 2)}
        assert len(buf.addressable_shards) == 4
    assert_same(got, ref)
