"""Recomputation: PopART's annotations (autoRecomputation, recomputeOutput) and their
jax.checkpoint policy; the same numbers as without recomputation."""
import math

import numpy as np
import pytest

import popart
from popart.engine import program
from popart.ir.onnx_import import import_model
from popart.ir.recompute import CHECKPOINT, RECOMPUTE, annotate, decreasing_intervals

CPU = lambda: popart.DeviceManager().createCpuDevice()  # noqa: E731


def popart_intervals(n):
    """getDecreasingIntervals(N), transcribed from willow/src/intervals.cpp."""
    k = int(int(math.sqrt(2.0 * n) - 1) * 0.75) if n > 1 else 0
    if n == 1:
        return [(0, 1)]
    out, i0 = [], 0
    while k > 0 and i0 + k <= n:
        out.append((i0, i0 + k))
        i0, k = i0 + k, k - 1
    return out + [(i, i + 1) for i in range(i0, n)]


@pytest.mark.parametrize("n", [1, 2, 5, 10, 33, 100])
def test_decreasing_intervals_are_popart_s(n):
    got = decreasing_intervals(n)
    assert got == popart_intervals(n)
    assert got[0][0] == 0 and got[-1][1] == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))


def chain(layers=6, width=8, norm_at=None, annotate_at=None):
    """x -> (matmul -> tanh) x layers [-> BatchNormalization at norm_at] -> L1 loss."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, width]), "x")
    rs = np.random.RandomState(0)
    h, names = x, []
    for i in range(layers):
        w = b.addInitializedInputTensor((rs.randn(width, width) / 3).astype(np.float32), f"w{i}")
        m = b.aiOnnx.matmul([h, w])
        h = b.aiOnnx.tanh([m])
        names += [m, h]
        if annotate_at == i:
            b.recomputeOutputInBackwardPass(h, popart.RecomputeType.Checkpoint)
        if norm_at == i:
            scale = b.addInitializedInputTensor(np.ones(width, np.float32))
            bias = b.addInitializedInputTensor(np.zeros(width, np.float32))
            mean = b.addInitializedInputTensor(np.zeros(width, np.float32))
            var = b.addInitializedInputTensor(np.ones(width, np.float32))
            h = b.aiOnnx.batchnormalization([h, scale, bias, mean, var], 5)[0]
            names.append(h)
    loss = b.aiGraphcore.l1loss([h], 0.1, reduction=popart.ReductionType.Sum)
    return b, x, loss, names


def marks(b, loss, method):
    graph = import_model(b.getModelProto())[0]
    by_output = {n.outputs[0]: n for n in graph.nodes}
    got = annotate(graph, loss, method, {t: 128 for n in graph.nodes for t in n.outputs})
    return {t: got.get(id(n)) for t, n in by_output.items()}


def test_norm_only_recomputes_the_norms():
    b, x, loss, names = chain(layers=3, norm_at=1)
    m = marks(b, loss, "NormOnly")
    bn = [t for t in names if t.startswith("BatchNormalization")]
    assert bn and all(m[t] == RECOMPUTE for t in bn)
    assert all(m[t] == CHECKPOINT for t in names if t not in bn)


def test_recompute_all_keeps_what_follows_the_last_checkpoint():
    """RecomputeAll recomputes every op, then (allCheckpointAfterLastCheckpoint) keeps the ops
    between the last hand-made checkpoint and the loss."""
    b, x, loss, names = chain(layers=6, annotate_at=2)
    m = marks(b, loss, "RecomputeAll")
    checkpoint = names.index(names[5])        # tanh of layer 2, annotated Checkpoint
    assert m[names[checkpoint]] == CHECKPOINT
    assert all(m[t] == RECOMPUTE for t in names[:checkpoint])
    assert all(m[t] == CHECKPOINT for t in names[checkpoint + 1:])


def test_standard_keeps_the_smallest_live_sets_of_each_interval():
    b, x, loss, names = chain(layers=10)
    m = marks(b, loss, "Standard")
    ops = len(names) + 1                      # the chain and the loss op
    kept = {t for t in names if m[t] != RECOMPUTE}
    # a chain's live set at op i is {op i}; all sizes equal, so each interval keeps its first op
    expected = {names[a] for a, _ in popart_intervals(ops) if a < len(names)}
    assert kept == expected and 0 < len(kept) < len(names)


def train(method, monkeypatch=None, remat_on_cpu=False):
    if remat_on_cpu:
        monkeypatch.setattr(program, "REMAT_PLATFORMS", program.REMAT_PLATFORMS + ("cpu",))
    b, x, loss, _ = chain(layers=6, width=16)
    o = popart.SessionOptions()
    o.autoRecomputation = getattr(popart.RecomputationType, method)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, [loss]), loss,
                               popart.SGD({"defaultLearningRate": (0.05, False)}), CPU(), userOptions=o)
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.random.RandomState(1).randn(2, 4, 16).astype(np.float32)}, out))
    w = np.zeros((16, 16), np.float32)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({"w0": w}))
    return s, out[loss], w


def test_recomputed_training_has_the_same_numbers(monkeypatch):
    _, loss0, w0 = train("NoRecompute")
    s, loss1, w1 = train("Standard", monkeypatch, remat_on_cpu=True)
    assert s._program.saved is not None
    step = s._program.step
    lowered = step._jitted.lower(*step._specs).as_text()
    assert "optimization_barrier" in lowered           # jax.checkpoint's rematerialisation
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    np.testing.assert_allclose(w1, w0, rtol=1e-6)


def test_recomputation_is_not_applied_on_the_cpu():
    s, _, _ = train("Standard")
    assert s._program.saved is None   # XLA's CPU compiler would undo it (see the log line)
