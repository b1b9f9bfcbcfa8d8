"""Smoke test of an installation: import popart, run a small inference and a small training
session, save and reload the executable, train with two replicas on two devices and with two
pipeline stages on two devices. CI runs it in
an environment holding the declared minimum versions of the dependencies (see .ci/run). Exits 0
and prints "smoke: ok"."""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np


def main() -> int:
    os.environ.setdefault("POPART_HOST_DEVICES", "2")   # two host devices for the replicas
    import jax
    import ml_dtypes
    import onnx

    import popart
    print(f"popart {popart.__version__}: jax {jax.__version__}, onnx {onnx.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    rng = np.random.default_rng(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]), "x")
    label = b.addInputTensor(popart.TensorInfo("INT32", [4]), "label")
    w = b.addInitializedInputTensor(rng.standard_normal((3, 2)).astype(np.float32), "w")
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([x, w])], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label])
    b.addOutputTensor(probs)
    model = b.getModelProto()
    X = rng.standard_normal((4, 3)).astype(np.float32)
    L = np.array([0, 1, 0, 1], np.int32)
    cpu = popart.DeviceManager().createCpuDevice

    infer = popart.InferenceSession(model, popart.DataFlow(1, [probs]), cpu())
    infer.prepareDevice()
    out = infer.initAnchorArrays()
    infer.run(popart.PyStepIO({x: X, label: L}, out))
    logits = X @ np.asarray(onnx.numpy_helper.to_array(onnx.load_from_string(model).graph.initializer[0]))
    expected = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.testing.assert_allclose(out[probs], expected, rtol=1e-5)

    train = popart.TrainingSession(model, popart.DataFlow(1, [loss]), loss,
                                   popart.ConstSGD(0.5), cpu())
    train.prepareDevice()
    train.weightsFromHost()
    out = train.initAnchorArrays()
    losses = []
    for _ in range(5):
        train.run(popart.PyStepIO({x: X, label: L}, out))
        losses.append(float(out[loss]))
    assert losses[-1] < losses[0], losses
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train.popef")
        train.saveExecutable(path)
        again = popart.TrainingSession(model, popart.DataFlow(1, [loss]), loss,
                                       popart.ConstSGD(0.5), cpu())
        again.loadExecutable(path)
        again.prepareDevice()
        again.weightsFromHost()
        out2 = again.initAnchorArrays()
        again.run(popart.PyStepIO({x: X, label: L}, out2))
        train.run(popart.PyStepIO({x: X, label: L}, out))
        np.testing.assert_allclose(out2[loss], out[loss], rtol=1e-6)

    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 2
    replicated = popart.TrainingSession(model, popart.DataFlow(1, [loss]), loss, popart.ConstSGD(0.5),
                                        popart.DeviceManager().acquireAvailableDevice(2),
                                        userOptions=opts)
    replicated.prepareDevice()
    replicated.weightsFromHost()
    out = replicated.initAnchorArrays()
    replicated.run(popart.PyStepIO({x: np.stack([X, X]), label: np.stack([L, L])}, out))
    np.testing.assert_allclose(out[loss], [losses[0]] * 2, rtol=1e-5)

    b = popart.Builder()   # the same model pipelined over two IPUs (two devices)
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]), "x")
    label = b.addInputTensor(popart.TensorInfo("INT32", [4]), "label")
    with b.virtualGraph(0), b.pipelineStage(0):
        w = b.addInitializedInputTensor(onnx.numpy_helper.to_array(
            onnx.load_from_string(model).graph.initializer[0]).copy(), "w")
        logits = b.aiOnnx.matmul([x, w])
    with b.virtualGraph(1), b.pipelineStage(1):
        loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([logits], axis=1), label])
    opts = popart.SessionOptions()
    opts.virtualGraphMode, opts.enablePipelining = popart.VirtualGraphMode.Manual, True
    opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
    piped = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                   popart.ConstSGD(0.5), popart.DeviceManager().acquireAvailableDevice(2),
                                   userOptions=opts)
    piped.prepareDevice()
    piped.weightsFromHost()
    out = piped.initAnchorArrays()
    piped.run(popart.PyStepIO({x: np.stack([X, X]), label: np.stack([L, L])}, out))
    assert piped._program.placed
    np.testing.assert_allclose(out[loss], [losses[0]] * 2, rtol=1e-5)
    print(f"smoke: ok (training loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
