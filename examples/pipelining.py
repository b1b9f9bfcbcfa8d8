"""User guide section 6.1 (Pipelined execution) and the talk's pipelining slide.

A three-layer network is split into two pipeline stages on two IPUs, with
``builder.virtualGraph`` and ``builder.pipelineStage`` (both the context-manager and the
per-op forms), ``enablePipelining`` and gradient accumulation (so the pipeline is flushed
before each weight update: no stale weights). The losses and trained weights must equal those
of the same model without annotations and without pipelining.
"""
from contextlib import ExitStack

import numpy as np

import popart

MICRO, ACCUM, BPS, IN, HID, OUT = 2, 4, 3, 12, 16, 4
rng = np.random.default_rng(0)
W = [rng.standard_normal(s).astype(np.float32) * 0.4 for s in [(IN, HID), (HID, HID), (HID, OUT)]]


def build(annotate: bool):
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO, IN]), "x")
    label = builder.addInputTensor(popart.TensorInfo("INT32", [MICRO]), "label")
    ws = [builder.addInitializedInputTensor(w, f"w{i}") for i, w in enumerate(W)]

    def stage(i):  # a context placing ops on IPU i, pipeline stage i (or nothing)
        stack = ExitStack()
        if annotate:
            stack.enter_context(builder.virtualGraph(i))
            stack.enter_context(builder.pipelineStage(i))
        return stack

    with stage(0):
        h = builder.aiOnnx.relu([builder.aiOnnx.matmul([x, ws[0]])])
    h = builder.aiOnnx.matmul([h, ws[1]])
    if annotate:  # the per-op form
        builder.virtualGraph(h, 1)
        builder.pipelineStage(h, 1)
    with stage(1):
        h = builder.aiOnnx.relu([h])
        probs = builder.aiOnnx.softmax([builder.aiOnnx.matmul([h, ws[2]])], axis=1)
        loss = builder.aiGraphcore.nllloss([probs, label])
    return builder.getModelProto(), x, label, ws, loss


data = rng.standard_normal((BPS, ACCUM, MICRO, IN)).astype(np.float32)
labels = rng.integers(0, OUT, (BPS, ACCUM, MICRO)).astype(np.int32)


def train(pipelined: bool):
    proto, x, label, ws, loss = build(annotate=pipelined)
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation = True
    opts.accumulationFactor = ACCUM
    if pipelined:
        opts.virtualGraphMode = popart.VirtualGraphMode.Manual
        opts.enablePipelining = True
        device = popart.DeviceManager().acquireAvailableDevice(2)
    else:
        device = popart.DeviceManager().createCpuDevice()
    flow = popart.DataFlow(BPS, {loss: popart.AnchorReturnType("ALL")})
    sgd = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)})
    session = popart.TrainingSession(proto, flow, loss, sgd, device, userOptions=opts)
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    for _ in range(3):
        session.run(popart.PyStepIO({x: data, label: labels}, anchors))
    session.weightsToHost()
    out = {w: np.zeros_like(v) for w, v in zip(ws, W)}
    session.readWeights(popart.PyWeightsIO(out))
    if pipelined:
        device.detach()
    return anchors[loss].copy(), [out[w] for w in ws]


pipe_loss, pipe_w = train(True)
plain_loss, plain_w = train(False)
print(f"loss anchor shape {list(pipe_loss.shape)} (batchesPerStep, accumulationFactor)")
print("pipelined losses:", np.round(pipe_loss.ravel(), 4))
err = max(np.abs(a - b).max() for a, b in zip(pipe_w, plain_w))
print(f"max |pipelined - plain| weights: {err:.2e}")
assert np.allclose(pipe_loss, plain_loss, atol=1e-5) and err < 1e-5
print("pipelining: OK")
