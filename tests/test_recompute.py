"""Recomputation: PopART's annotations (autoRecomputation, recomputeOutput) and their
jax.checkpoint policy; the same numbers as without recomputation."""
import math

import numpy as np
import pytest

import popart
from popart import testing
from popart.engine import program
from popart._ir.onnx_import import import_model
from popart._ir.recompute import CHECKPOINT, RECOMPUTE, annotate, decreasing_intervals

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


def train(method, build=None, feeds=None, anchors=(), seed=None):
    """Two batches of SGD; returns (session, anchors, w0 after the step)."""
    b, x, loss, _ = chain(layers=6, width=16) if build is None else build()
    o = popart.SessionOptions()
    o.autoRecomputation = getattr(popart.RecomputationType, method)
    flow = popart.DataFlow(2, [loss, *anchors])
    s = popart.TrainingSession(b.getModelProto(), flow, loss,
                               popart.SGD({"defaultLearningRate": (0.05, False)}), CPU(), userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    if seed is not None:
        s.setRandomSeed(seed)
    out = s.initAnchorArrays()
    X = np.random.RandomState(1).randn(2, *s.getInfo(x).shape()).astype(np.float32)
    s.run(popart.PyStepIO({x: X, **(feeds or {})}, out))
    w = np.zeros(s.getInfo("w0").shape(), np.float32)
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO({"w0": w}))
    return s, out, w


@pytest.fixture(scope="module")
def plain():
    return train("NoRecompute")


def lowered(s):
    return testing.lowered_text(s)


@pytest.mark.parametrize("method", ["Standard", "RecomputeAll"])
def test_recomputed_training_has_the_same_numbers(plain, method):
    _, out0, w0 = plain
    s, out1, w1 = train(method)
    assert testing.step_program(s).segments
    assert "stablehlo.case" in lowered(s)   # each segment's recomputation, in a conditional
    for k in out0:
        np.testing.assert_array_equal(out1[k], out0[k])
    np.testing.assert_array_equal(w1, w0)


def test_behind_barriers_the_numbers_are_the_same(plain, monkeypatch):
    """The GPU / TPU form (optimisation barriers, no conditional) gives the same numbers."""
    import dataclasses
    from popart.engine import backends
    monkeypatch.setitem(backends.BACKENDS, "cpu",
                        dataclasses.replace(backends.BACKENDS["cpu"], keeps_barriers=True))
    s, out1, w1 = train("Standard")
    text = lowered(s)
    assert "optimization_barrier" in text and "stablehlo.case" not in text
    np.testing.assert_array_equal(out1[next(iter(out1))], plain[1][next(iter(out1))])
    np.testing.assert_array_equal(w1, plain[2])


def deep(manual, layers=8, width=64, batch=512):
    """A chain whose hand annotations checkpoint every 4th layer and recompute the rest."""
    def build():
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, width]), "x")
        rs, h = np.random.RandomState(0), x
        for i in range(layers):
            w = b.addInitializedInputTensor((rs.randn(width, width) / 8).astype(np.float32), f"w{i}")
            m = b.aiOnnx.matmul([h, w])
            h = b.aiOnnx.tanh([m])
            if manual:
                b.recomputeOutputInBackwardPass(m, popart.RecomputeType.Recompute)
                b.recomputeOutputInBackwardPass(
                    h, popart.RecomputeType.Checkpoint if i % 4 == 3 else popart.RecomputeType.Recompute)
        loss = b.aiGraphcore.l1loss([h], 0.1, reduction=popart.ReductionType.Sum)
        return b, x, loss, None
    return build


def test_recomputation_lowers_peak_temporary_memory():
    """Segments of 8 ops between hand-made checkpoints: the compiled step's temporaries fall
    (the backward pass holds one segment's activations at a time), the numbers stay."""
    runs = {m: train("NoRecompute", build=deep(m)) for m in (False, True)}
    temp = {m: testing.compiled(s).memory_analysis().temp_size_in_bytes for m, (s, _, _) in runs.items()}
    assert [len(g.nodes) for g in testing.step_program(runs[True][0]).segments] == [8, 8]
    assert temp[True] < 0.7 * temp[False], temp
    np.testing.assert_array_equal(runs[True][2], runs[False][2])


def mixed():
    """Recomputed ops around ones a segment cannot hold: Dropout (random), BatchNormalization
    in training (updates its statistics), an anchored activation gradient (a probe), a
    compile-time tensor (Shape) made and read inside a segment, and an integer tensor (ArgMax,
    a hand-made checkpoint) one segment gives the next."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 8]), "x")
    rs, h, ids = np.random.RandomState(0), x, {}
    for i in range(3):
        w = b.addInitializedInputTensor((rs.randn(8, 8) / 3).astype(np.float32), f"w{i}")
        h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, w])])
        shape = b.aiOnnx.shape([h])
        h = b.aiOnnx.reshape([b.aiOnnx.sigmoid([h]), shape])
        top = b.aiOnnx.argmax([h], axis=1, keepdims=1)   # an integer tensor a segment gives
        b.recomputeOutputInBackwardPass(top, popart.RecomputeType.Checkpoint)
        h = b.aiOnnx.add([h, b.aiOnnx.cast([top], "FLOAT")])
        if i == 0:
            h = b.aiOnnx.dropout([h], 1, 0.3)[0]
        if i == 1:
            ones, zeros = np.ones(8, np.float32), np.zeros(8, np.float32)
            h = b.aiOnnx.batchnormalization([h] + [b.addInitializedInputTensor(v) for v in
                                                   (ones, zeros, zeros, ones)], 5)[0]
            ids["probe"] = h
    loss = b.aiGraphcore.l1loss([h], 0.1, reduction=popart.ReductionType.Sum)
    return b, x, loss, ids


def test_segments_leave_out_ops_with_side_effects():
    ids = mixed()[3]
    anchors = [popart.reservedGradientPrefix() + ids["probe"]]
    runs = {m: train(m, build=mixed, anchors=anchors, seed=7) for m in ("NoRecompute", "RecomputeAll")}
    s = runs["RecomputeAll"][0]
    program = testing.step_program(s)
    assert program.segments
    held = {program.graph.nodes[i].op_type for g in program.segments for i in g.nodes}
    assert {"Shape", "ArgMax", "Cast"} <= held and not held & {"Dropout", "BatchNormalization"}
    assert any(program.graph.nodes[g.nodes[-1]].op_type == "ArgMax" for g in program.segments)
    for k, v in runs["NoRecompute"][1].items():
        np.testing.assert_allclose(runs["RecomputeAll"][1][k], v, rtol=1e-6)
    np.testing.assert_allclose(runs["RecomputeAll"][2], runs["NoRecompute"][2], rtol=1e-6)


@pytest.mark.parametrize("devices", [2, 1])
def test_replicated_recomputation_has_the_same_numbers(devices):
    """Two replicas on their own devices (shard_map) or sharing one (vmap), accumulation 2."""
    def run(manual):
        b, x, loss, _ = deep(manual, layers=4, width=16, batch=8)()
        o = popart.SessionOptions()
        o.enableReplicatedGraphs, o.replicatedGraphCount = True, 2
        o.enableGradientAccumulation, o.accumulationFactor = True, 2
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, [loss]), loss,
                                   popart.SGD({"defaultLearningRate": (0.05, False)}),
                                   popart.DeviceManager().acquireAvailableDevice(devices), userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: np.random.RandomState(1).randn(2, 2, 2, 8, 16).astype(np.float32)}, out))
        w = np.zeros((16, 16), np.float32)
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO({"w0": w}))
        return s, out[loss], w
    (_, l0, w0), (s, l1, w1) = run(False), run(True)
    assert testing.step_program(s).segments
    np.testing.assert_array_equal(l1, l0)
    np.testing.assert_array_equal(w1, w0)
