"""Automatic loss scaling on placed virtual graphs and pipelines (engine/pipeline.py): the
tracked gradients' histograms come from taps in the stages (``als.AlsPlan.tap``), and the
losses, weights, loss-scale factor and ALS anchors equal those of the whole model on one
device. Float16 layers, ConvAndMatmulGradients tracking, a loss scaling the factor both
halves and doubles from; runs on the suite's 4 host devices."""
from __future__ import annotations

import numpy as np
import pytest

import popart
from popart import testing
from test_automatic_loss_scaling import als_options
from test_model_parallel import assert_same

W, B = 8, 4
FACTOR = "lossScaleUpdateFactor"
ALS_ANCHORS = ["finalLossScale", FACTOR, "summedHistograms", "lossScaling_FLOAT16"]


def model(stages, master):
    """One tanh(matmul) float16 layer per pipeline stage, a skip connection from stage 0 to the
    last and the first layer's weight used again at the end (on two IPUs), an L1 loss. The
    weights are float16, or (``master``) float32 cast to float16 where read: with
    accumulation a placed program sums the micro-batches' gradients in another order (in the
    autodiff of its tick loop), which float16 weights show with or without ALS."""
    rs = np.random.RandomState(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [B, W]), "x")
    h, first, w0 = x, None, None
    for i, ipu in enumerate(stages):
        with b.virtualGraph(ipu), b.pipelineStage(i):
            w = b.addInitializedInputTensor(
                (rs.randn(W, W) * 0.5).astype(np.float32 if master else np.float16), f"w{i}")
            if master:
                w = b.aiOnnx.cast([w], "FLOAT16")
            w0 = w0 or w
            h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
            first = first or h
            if i == len(stages) - 1:
                h = b.aiOnnx.matmul([b.aiOnnx.add([h, first]), w0])
                loss = b.aiGraphcore.l1loss([h], 1.0, reduction=popart.ReductionType.Sum)
    return b, x, loss


def session(stages, placed, pipelined=False, master=True, A=1, R=1, bps=3, period=1,
            anchors=(), load=None):
    """A TrainingSession with ALS (loss scaling 2048), prepared (or ``load``-ed from a saved
    executable); returns (session, input id, device)."""
    b, x, loss = model(stages, master)
    o = als_options(accumulation=A, replication=R, updatePeriod=period)
    if placed:
        o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, pipelined
    dev = popart.DeviceManager().acquireAvailableDevice((max(stages) + 1 if placed else 1) * R)
    df = popart.DataFlow(bps, {a: popart.AnchorReturnType("ALL")
                               for a in [loss, *ALS_ANCHORS, *anchors]})
    opt = popart.SGD({"defaultLearningRate": (0.01, False), "lossScaling": (2048.0, False)})
    s = popart.TrainingSession(b.getModelProto(), df, loss, opt, dev, userOptions=o)
    if load:
        s.loadExecutable(load)
        s.weightsFromHost()
    else:
        s.prepareDevice()
        s.weightsFromHost()
    assert testing.is_placed(s) == placed
    return s, x, dev


def inputs(x, steps, bps=3, A=1, R=1, **_):
    """The feeds of ``steps`` runs."""
    rs = np.random.RandomState(1)
    lead = (bps,) + ((A,) if A > 1 else ()) + ((R,) if R > 1 else ())
    return [{x: rs.randn(*lead, B, W).astype(np.float16)} for _ in range(steps)]


def train(stages, placed, steps=2, save=None, **kw):
    """The anchors of ``steps`` runs, the final weights and factor (and the session); ``save``
    a path to save the executable to after the first run."""
    s, x, dev = session(stages, placed, **kw)
    out, runs = s.initAnchorArrays(), []
    for step, f in enumerate(inputs(x, steps, **kw)):
        s.run(popart.PyStepIO(f, out))
        runs.append({k: v.copy() for k, v in out.items()})
        if save and step == 0:
            s.saveExecutable(save)
    s.weightsToHost()
    state = {f"w{i}": np.zeros((W, W), np.float32 if kw.get("master", True) else np.float16)
             for i in range(len(stages))}
    state[FACTOR] = np.zeros((), np.float32)
    s.readWeights(popart.PyWeightsIO(state))
    dev.detach()
    return runs, state, s


def assert_factor_halves_and_doubles(runs):
    f = np.concatenate([r[FACTOR].ravel() for r in runs])
    steps = np.unique(f[1:] / f[:-1])
    assert 0.5 in steps and 2.0 in steps, f


CASES = {   # id: (stages, train's options, extra anchors)
    "sharded": ([0, 1, 2], dict(master=False), ["Gradient___w1_statistics"]),
    "pipelined": ([0, 1, 2], dict(pipelined=True, A=4), ["Accum___autoLossScaleStats"]),
    "replicated": ([0, 1], dict(pipelined=True, A=2, R=2, period=2), ["summedHistograms_reduced"]),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(one device, placed) runs of a case."""
    stages, kw, anchors = CASES[request.param]
    return (train(stages, False, anchors=anchors, **kw),
            train(stages, True, anchors=anchors, **kw))


def test_placed_als_equals_one_device(pair):
    """Sharded with float16 weights (the weights' own gradients tracked; the first one's read on
    two IPUs), pipelined, and 2 replicas x 2 IPUs with updatePeriod 2: the same losses,
    weights, factor and ALS anchors."""
    ref, got = pair
    assert_same(got, ref)
    assert_factor_halves_and_doubles(ref[0])
    np.testing.assert_array_equal(got[1][FACTOR], ref[1][FACTOR])
    assert np.all(ref[0][0]["summedHistograms"][0].sum(-1) > 0)   # the first batch updates


def test_factor_is_replicated_state_beside_the_slots(pair):
    """The factor (and the updatePeriod counter) belong to no IPU: one replicated scalar."""
    _, got = pair
    s = got[2]
    state = testing.device_values(s, "optimizer")
    key = testing.placed_plan(s).state_layout.globals[FACTOR]
    assert state[key].shape == () and state[key].sharding.is_fully_replicated
    assert len(state[key].addressable_shards) == len(testing.mesh_devices(s))
    period = testing.step_program(s).als.period
    assert set(testing.placed_plan(s).state_layout.globals) == (
        {FACTOR, "LossScaleUpdate_counter"} if period > 1 else {FACTOR})


def test_saved_placed_executable_resumes_training(tmp_path):
    """A placed ALS session saved after one run and loaded into a new one: its run gives the
    first session's second run (the factor among the saved state)."""
    path = str(tmp_path / "als.popef")
    kw = dict(pipelined=True, A=4)
    ref = train([0, 1, 2], True, save=path, **kw)
    assert ref[0][1]["finalLossScale"][0, 0] != 2048.0   # the factor saved is not 1
    s, x, dev = session([0, 1, 2], True, load=path, **kw)
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO(inputs(x, 2, **kw)[1], out))
    dev.detach()
    for k, v in ref[0][1].items():
        np.testing.assert_array_equal(out[k], v, err_msg=k)
