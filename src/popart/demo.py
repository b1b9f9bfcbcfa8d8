"""``popart demo``: train a small CNN, written with the popart Builder, on 8x8 hand-written digits.

The data (scikit-learn's copy of the UCI digits, see ``data/LICENSE-digits.txt``) ships with
the package. The network is conv -> relu -> maxpool -> conv -> relu -> maxpool -> matmul ->
softmax, trained with nllloss and SGD (momentum) in a TrainingSession that runs
``batchesPerStep`` batches per ``run()``. The trained model is saved with ``modelToHost``,
reloaded into an InferenceSession and evaluated again.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Optional, TextIO

import numpy as np

import popart

BATCH = 50            # micro-batch size
BATCHES_PER_STEP = 10  # batches per session.run()
EVAL_BATCHES_PER_STEP = 3
LEARNING_RATE = 0.05
MOMENTUM = 0.9


@dataclass
class Digits:
    x_train: np.ndarray  # float32 [N, 1, 8, 8], values in [0, 1]
    y_train: np.ndarray  # int32 [N]
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits() -> Digits:
    """The digits shipped in ``popart/data/digits.npz`` (1500 train / 297 test samples)."""
    with resources.files("popart").joinpath("data/digits.npz").open("rb") as f:
        d = np.load(f)
        arrays = {k: d[k] for k in d.files}
    img = lambda a: (a.astype(np.float32) / 16.0)[:, None, :, :]
    return Digits(img(arrays["x_train"]), arrays["y_train"].astype(np.int32),
                  img(arrays["x_test"]), arrays["y_test"].astype(np.int32))


class ProgressBar:
    """A minimal progress bar on a text stream (stderr by default)."""

    def __init__(self, total: int, label: str = "", width: int = 30,
                 stream: Optional[TextIO] = None) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.count, self.start = 0, time.perf_counter()

    def update(self, n: int = 1, suffix: str = "") -> None:
        self.count = min(self.count + n, self.total)
        filled = self.width * self.count // self.total
        rate = self.count / max(time.perf_counter() - self.start, 1e-9)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.count}/{self.total} {rate:.1f}/s {suffix}")
        if self.count >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def build_model(batch: int, seed: int = 0) -> tuple[popart.Builder, str, str, str, str]:
    """The CNN with nllloss appended: (builder, image input, label input, probs, loss)."""
    rng = np.random.default_rng(seed)

    def he(*shape: int) -> np.ndarray:
        fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[0]
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, 1, 8, 8]), "image")
    labels = b.addInputTensor(popart.TensorInfo("INT32", [batch]), "label")
    h = x
    for i, (cin, cout) in enumerate([(1, 16), (16, 32)]):  # 8x8 -> 4x4 -> 2x2
        w = b.addInitializedInputTensor(he(cout, cin, 3, 3), f"conv{i}/weight")
        bias = b.addInitializedInputTensor(np.zeros(cout, np.float32), f"conv{i}/bias")
        h = b.aiOnnx.conv([h, w, bias], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        h = b.aiOnnx.relu([h])
        h = b.aiOnnx.maxpool([h], num_outputs=1, kernel_shape=[2, 2], strides=[2, 2])[0]
    h = b.reshape_const(b.aiOnnx, [h], [batch, 32 * 2 * 2])
    w = b.addInitializedInputTensor(he(128, 10), "fc/weight")
    bias = b.addInitializedInputTensor(np.zeros(10, np.float32), "fc/bias")
    logits = b.aiOnnx.add([b.aiOnnx.matmul([h, w]), bias])
    probs = b.aiOnnx.softmax([logits], axis=1, debugContext="probs")
    loss = b.aiGraphcore.nllloss([probs, labels], reduction=popart.ReductionType.Mean,
                                 debugContext="loss")
    b.addOutputTensor(probs)
    return b, x, labels, probs, loss


def _steps(x: np.ndarray, y: np.ndarray, batch: int, bps: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad x, y (repeating the first samples) to whole steps, shaped [steps, bps, batch, ...]."""
    per_step = batch * bps
    n = -(-len(x) // per_step) * per_step
    idx = np.arange(n) % len(x)
    return (x[idx].reshape(-1, bps, batch, *x.shape[1:]), y[idx].reshape(-1, bps, batch))


def evaluate(session: popart.InferenceSession, image: str, label: str, probs: str, loss: str,
             x: np.ndarray, y: np.ndarray, batch: int, bps: int) -> tuple[float, float]:
    """(accuracy, mean loss) of ``session`` on ``x, y`` (padding is excluded)."""
    xs, ys = _steps(x, y, batch, bps)
    anchors = session.initAnchorArrays()
    preds, losses = [], []
    for xb, yb in zip(xs, ys):
        session.run(popart.PyStepIO({image: xb, label: yb}, anchors))
        preds.append(anchors[probs].reshape(-1, 10).argmax(1))
        losses.append(np.asarray(anchors[loss]).reshape(-1))
    pred = np.concatenate(preds)[:len(y)]
    per_batch = np.concatenate(losses)
    return float((pred == y).mean()), float(per_batch.mean())


def _eval_session(model: str | bytes, probs: str, loss: str, device: popart.DeviceInfo,
                  name: str, writable: bool = False) -> popart.InferenceSession:
    """An evaluation session; ``writable``: its weights may be written (constantWeights off)."""
    flow = popart.DataFlow(EVAL_BATCHES_PER_STEP, {probs: popart.AnchorReturnType("ALL"),
                                                   loss: popart.AnchorReturnType("ALL")})
    opts = popart.SessionOptions()
    opts.constantWeights = not writable
    session = popart.InferenceSession(model, flow, device, name=name, userOptions=opts)
    session.prepareDevice()
    return session


def run_demo(epochs: int = 10, output: str = ".", device: Optional[popart.DeviceInfo] = None,
             log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Train, save ``output/digits.onnx``, reload it for inference; returns the results."""
    data = load_digits()
    batch, bps = BATCH, BATCHES_PER_STEP
    builder, image, label, probs, loss = build_model(batch)
    proto = builder.getModelProto()
    device = device or popart.DeviceManager().createCpuDevice()
    steps_per_epoch = len(data.x_train) // (batch * bps)
    log(f"digits: {len(data.x_train)} train / {len(data.x_test)} test samples; CNN, batch "
        f"{batch}, {bps} batches per step, {steps_per_epoch} steps per epoch, SGD lr "
        f"{LEARNING_RATE} (linear decay) momentum {MOMENTUM}; device {device.type.name}")

    opt = popart.SGD({"defaultLearningRate": (LEARNING_RATE, False),
                      "defaultMomentum": (MOMENTUM, True)})
    flow = popart.DataFlow(bps, {loss: popart.AnchorReturnType("ALL")})
    train = popart.TrainingSession(proto, flow, loss, opt, device, name="digits-train")
    t0 = time.perf_counter()
    train.prepareDevice()
    train.weightsFromHost()
    infer = _eval_session(proto, probs, loss, device, "digits-eval", writable=True)
    log(f"compiled the training and evaluation programs in {time.perf_counter() - t0:.2f} s")
    weights = {w: np.zeros(builder.getTensorShape(w), np.float32)
               for w in builder.getTrainableTensorIds()}

    def test_accuracy(session: popart.InferenceSession) -> tuple[float, float]:
        return evaluate(session, image, label, probs, loss, data.x_test, data.y_test, batch,
                        EVAL_BATCHES_PER_STEP)

    anchors = train.initAnchorArrays()
    rng = np.random.default_rng(1)
    bar = ProgressBar(epochs * steps_per_epoch, "train") if progress else None
    train_seconds, epoch_losses, acc = 0.0, [], 0.0
    for epoch in range(epochs):
        perm = rng.permutation(len(data.x_train))[:steps_per_epoch * batch * bps]
        xs, ys = _steps(data.x_train[perm], data.y_train[perm], batch, bps)
        losses = []
        if epoch:  # linear decay; the learning rate is non-const, so no recompilation
            lr = LEARNING_RATE * (1 - epoch / epochs)
            train.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (lr, False),
                                                      "defaultMomentum": (MOMENTUM, True)}))
        t0 = time.perf_counter()
        for xb, yb in zip(xs, ys):
            train.run(popart.PyStepIO({image: xb, label: yb}, anchors))
            losses.append(anchors[loss].copy())
            if bar:
                bar.update(1, f"loss {losses[-1].mean():.4f}")
        train_seconds += time.perf_counter() - t0
        train.weightsToHost()
        train.readWeights(popart.PyWeightsIO(weights))
        infer.writeWeights(popart.PyWeightsIO(weights))
        acc, _ = test_accuracy(infer)
        epoch_losses.append(float(np.mean(losses)))
        log(f"epoch {epoch + 1}/{epochs}: train loss {epoch_losses[-1]:.4f}, "
            f"test accuracy {100 * acc:.2f}%")
    samples = epochs * steps_per_epoch * bps * batch
    log(f"trained on {samples} samples in {train_seconds:.2f} s "
        f"({samples / max(train_seconds, 1e-9):.0f} samples/s)")

    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, "digits.onnx")
    train.modelToHost(path)
    log(f"saved the trained model to {path}")
    reloaded = _eval_session(path, probs, loss, device, "digits-reloaded")
    acc2, test_loss = test_accuracy(reloaded)
    log(f"test accuracy: {100 * acc2:.2f}% (test loss {test_loss:.4f}) from {path} reloaded "
        f"into an InferenceSession")
    if abs(acc2 - acc) > 1e-9:
        log(f"warning: the reloaded model's accuracy differs from the trained session's "
            f"({100 * acc:.2f}%)")
    return {"loss": epoch_losses, "accuracy": acc2, "test_loss": test_loss, "model": path,
            "train_seconds": train_seconds}
