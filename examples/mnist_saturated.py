"""Training from a saturated softmax: the PopART MNIST program that showed the softmax + nll
gradient bug, on the package's 8x8 digits upscaled to 28x28.

    python examples/mnist_saturated.py [--model linear|conv|conv-scaled] [--seed 0] [--epochs 5]

Two models starting with a softmax so saturated that many labels have a probability far below
nllloss's 1e-7 clamp, and a control:

* ``--model linear``: 784 -> 10, W ~ N(0, 1) (seeded), zero bias. At the start the logits'
  standard deviation is 10 to 21 (seeds 0..4) and 33% to 78% of the training samples have
  p[label] < 1e-7.
* ``--model conv``: conv 3x3 (1 -> 8, pad 1) -> relu -> maxpool 2 -> conv 3x3 (8 -> 16, pad 1)
  -> relu -> maxpool 2 -> flatten (16 x 7 x 7 = 784) -> matmul 784 -> 10 (+ bias). Every
  weight N(0, 1) (no fan-in scaling), every bias zero: the logits' standard deviation is 80
  to 220 and 84% to 95% of the samples have p[label] < 1e-7. At lr 0.01 with Sum reduction
  this net does not train even with exact gradients (PyTorch's too): the first steps' large
  (p - onehot) gradients kill its ReLUs and it ends predicting one class (7% to 8%).
* ``--model conv-scaled``: the same net with conv1's weights scaled by sqrt(2 / 72) (He) and
  the matmul's by 0.1 (standard deviations 0.167 and 0.1): not saturated at the start
  (logits' std 1.4 to 3.6); it trains (91% to 98%).

Softmax (``aiOnnx.softmax``) then ``aiGraphcore.nllloss`` with Sum reduction, ``ConstSGD(0.01)``,
batches of 32, ``batchesPerStep`` 5 (the shuffled training set is trimmed to whole steps: 1440
of 1500 samples, 9 steps an epoch). Training differentiates softmax + nll as PopART's
SoftmaxGradDirect pattern does, (p - onehot(label)) * scale, which is exact however saturated
the softmax is; differentiating ``log(max(p, 1e-7))`` instead leaves every sample whose
p[label] is under 1e-7 without a gradient (``bench/saturated_replica.py --clamped`` shows
what that costs). The test accuracy comes from an InferenceSession over the 297 test samples
in one batch, given the trained weights.

``train(model, seed, epochs)`` returns (mean loss per sample of each epoch, test accuracy);
``bench/saturated_replica.py`` runs the same programs in PyTorch and compares.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import resources
from typing import Callable, Optional

import numpy as np

import popart

BATCH = 32
BATCHES_PER_STEP = 5
LEARNING_RATE = 0.01
EPOCHS = 5
SIZE = 28
MODELS = ("linear", "conv", "conv-scaled")
SMALL = os.environ.get("POPART_EXAMPLE_SMALL") == "1"  # tests/test_examples.py


# --------------------------------------------------------------------------------- data
def upscale_matrix(n_in: int = 8, n_out: int = SIZE) -> np.ndarray:
    """[n_out, n_in] bilinear interpolation weights (pixel centres aligned, edges clamped, as
    PIL / torch's ``interpolate(mode="bilinear", align_corners=False)`` without antialias)."""
    src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
    lo = np.floor(src).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = src - lo
    m = np.zeros((n_out, n_in))
    m[np.arange(n_out), lo] += 1 - frac
    m[np.arange(n_out), hi] += frac
    return m


def load_data() -> dict[str, np.ndarray]:
    """The digits of ``popart/data/digits.npz`` (1500 train / 297 test, as ``popart demo``
    splits them), scaled to [0, 1] and upscaled bilinearly to 28x28: x_* float32
    [N, 1, 28, 28], y_* int32 [N]."""
    with resources.files("popart").joinpath("data/digits.npz").open("rb") as f:
        d = np.load(f)
        arrays = {k: d[k] for k in d.files}
    m = upscale_matrix()
    out = {}
    for split in ("train", "test"):
        img = arrays[f"x_{split}"].astype(np.float64) / 16.0
        big = np.einsum("ij,njk,lk->nil", m, img, m)   # m @ img @ m.T per image
        out[f"x_{split}"] = np.clip(big, 0, 1).astype(np.float32)[:, None]
        out[f"y_{split}"] = arrays[f"y_{split}"].astype(np.int32)
    return out


def epoch_order(seed: int, epoch: int, n: int, samples_per_step: int) -> np.ndarray:
    """The training samples of ``epoch``, in order: a permutation (seeded by seed and epoch)
    trimmed to whole steps. PyTorch's replica feeds the same order."""
    perm = np.random.default_rng([seed, 1, epoch]).permutation(n)
    return perm[:len(perm) // samples_per_step * samples_per_step]


def initial_weights(model: str, seed: int) -> dict[str, np.ndarray]:
    """The model's initial weights by name, drawn from ``seed``: N(0, 1) for every weight of
    ``linear`` and ``conv``; ``conv-scaled`` multiplies conv1's by sqrt(2 / 72) (He) and
    the matmul's by 0.1 (the same draws, scaled). Biases are 0."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    if model == "linear":
        return {"fc/weight": normal(SIZE * SIZE, 10), "fc/bias": np.zeros(10, np.float32)}
    if model in ("conv", "conv-scaled"):
        w = {"conv0/weight": normal(8, 1, 3, 3), "conv0/bias": np.zeros(8, np.float32),
             "conv1/weight": normal(16, 8, 3, 3), "conv1/bias": np.zeros(16, np.float32),
             "fc/weight": normal(16 * 7 * 7, 10), "fc/bias": np.zeros(10, np.float32)}
        if model == "conv-scaled":
            w["conv1/weight"] *= np.float32(np.sqrt(2 / 72))
            w["fc/weight"] *= np.float32(0.1)
        return w
    raise ValueError(f"unknown model {model!r} (expected one of {MODELS})")


# -------------------------------------------------------------------------------- model
def build(model: str, batch: int, seed: int = 0):
    """The model as a PopART user writes it: (builder, image, label, probs, loss)."""
    w0 = initial_weights(model, seed)
    b = popart.Builder()
    if model == "linear":
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, SIZE * SIZE]), "image")
        h = x
    else:
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, 1, SIZE, SIZE]), "image")
        h = x
        for i in range(2):   # 28x28 -> 14x14 -> 7x7
            w = b.addInitializedInputTensor(w0[f"conv{i}/weight"], f"conv{i}/weight")
            bias = b.addInitializedInputTensor(w0[f"conv{i}/bias"], f"conv{i}/bias")
            h = b.aiOnnx.conv([h, w, bias], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
            h = b.aiOnnx.relu([h])
            h = b.aiOnnx.maxpool([h], num_outputs=1, kernel_shape=[2, 2], strides=[2, 2])[0]
        h = b.reshape_const(b.aiOnnx, [h], [batch, 16 * 7 * 7])
    label = b.addInputTensor(popart.TensorInfo("INT32", [batch]), "label")
    w = b.addInitializedInputTensor(w0["fc/weight"], "fc/weight")
    bias = b.addInitializedInputTensor(w0["fc/bias"], "fc/bias")
    logits = b.aiOnnx.add([b.aiOnnx.matmul([h, w]), bias])
    probs = b.aiOnnx.softmax([logits], axis=1, debugContext="probs")
    loss = b.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Sum,
                                 debugContext="loss")
    b.addOutputTensor(probs)
    return b, x, label, probs, loss


class Sessions:
    """A model's compiled training session (ConstSGD(0.01), ``bps`` batches of 32 a step) and
    inference session (the test set in one batch). Training another seed writes that seed's
    initial weights into the same sessions: ConstSGD keeps no state, so this is the same as
    building new ones, without compiling again."""

    def __init__(self, model: str, bps: int, n_test: int,
                 device: Optional[popart.DeviceInfo] = None) -> None:
        device = device or popart.DeviceManager().createCpuDevice()
        self.model, self.bps, self.n_test = model, bps, n_test
        builder, self.image, self.label, self.probs, self.loss = build(model, BATCH)
        flow = popart.DataFlow(bps, {self.loss: popart.AnchorReturnType("ALL")})
        t0 = time.perf_counter()
        self.train = popart.TrainingSession(builder.getModelProto(), flow, self.loss,
                                            popart.ConstSGD(LEARNING_RATE), device,
                                            name=f"{model}-train")
        self.train.prepareDevice()
        self.anchors = self.train.initAnchorArrays()
        ib, ix, il, iprobs, _ = build(model, n_test)
        assert (ix, il, iprobs) == (self.image, self.label, self.probs)
        writable = popart.SessionOptions()
        writable.constantWeights = False   # the trained weights are written in (writeWeights)
        self.infer = popart.InferenceSession(
            ib.getModelProto(), popart.DataFlow(1, {iprobs: popart.AnchorReturnType("ALL")}),
            device, userOptions=writable, name=f"{model}-test")
        self.infer.prepareDevice()
        self.compile_seconds = time.perf_counter() - t0

    def reset(self, seed: int, model: Optional[str] = None) -> None:
        """Start again from ``seed``'s initial weights (``model``'s: conv-scaled's in conv's
        sessions)."""
        w0 = initial_weights(model or self.model, seed)
        self.train.writeWeights(popart.PyWeightsIO(w0))
        self.train.weightsFromHost()

    def step(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """One ``run()``: ``bps`` SGD steps on x [bps, 32, ...], y [bps, 32]; the summed loss
        of each batch [bps]."""
        self.train.run(popart.PyStepIO({self.image: x, self.label: y}, self.anchors))
        return self.anchors[self.loss].reshape(-1).copy()

    def weights(self) -> dict[str, np.ndarray]:
        self.train.weightsToHost()
        w = {t: np.zeros_like(v) for t, v in initial_weights(self.model, 0).items()}
        self.train.readWeights(popart.PyWeightsIO(w))
        return w

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """Test accuracy of the trained weights (the inference session gets a copy)."""
        self.infer.writeWeights(popart.PyWeightsIO(self.weights()))
        self.infer.weightsFromHost()
        out = self.infer.initAnchorArrays()
        self.infer.run(popart.PyStepIO({self.image: x, self.label: y}, out))
        return float((out[self.probs].reshape(len(y), 10).argmax(1) == y).mean())


_DATA: dict[str, np.ndarray] = {}
_SESSIONS: dict[tuple[str, int], Sessions] = {}


def data() -> dict[str, np.ndarray]:
    if not _DATA:
        _DATA.update(load_data())
    return _DATA


def model_input(model: str, x: np.ndarray) -> np.ndarray:
    """Images [N, 1, 28, 28] as the model takes them (flattened for the linear model)."""
    return x.reshape(len(x), -1) if model == "linear" else x


def sessions(model: str, bps: int = BATCHES_PER_STEP) -> Sessions:
    """The model's sessions, compiled once per process (conv-scaled shares conv's)."""
    arch = "linear" if model == "linear" else "conv"   # conv-scaled: conv's sessions
    if (arch, bps) not in _SESSIONS:
        _SESSIONS[arch, bps] = Sessions(arch, bps, len(data()["y_test"]))
    return _SESSIONS[arch, bps]


def train(model: str = "linear", seed: int = 0, epochs: float = EPOCHS, *,
          bps: int = BATCHES_PER_STEP, n_train: Optional[int] = None,
          step_losses: Optional[list] = None,
          log: Callable[[str], None] = lambda s: None) -> tuple[list[float], float]:
    """Train ``model`` from ``seed``'s weights for ``epochs`` epochs: (mean loss per sample of
    each epoch, test accuracy). ``n_train``: train on the first n_train training samples only;
    ``step_losses``: a list that gets each run()'s summed loss per batch ([bps] arrays).
    Epochs may be fractional (0.5: the first half of an epoch's steps)."""
    d, s = data(), sessions(model, bps)
    x_all = model_input(model, d["x_train"][:n_train])
    y_all = d["y_train"][:n_train]
    per_step = BATCH * bps
    s.reset(seed, model)
    epoch_losses = []
    for epoch in range(int(np.ceil(epochs))):
        order = epoch_order(seed, epoch, len(y_all), per_step)
        steps = len(order) // per_step
        if epochs - epoch < 1:
            steps = max(1, int(round(steps * (epochs - epoch))))
        losses = []
        for i in range(steps):
            idx = order[i * per_step:(i + 1) * per_step]
            xb = x_all[idx].reshape(bps, BATCH, *x_all.shape[1:])
            yb = y_all[idx].reshape(bps, BATCH)
            losses.append(s.step(xb, yb))
            if step_losses is not None:
                step_losses.append(losses[-1])
        epoch_losses.append(float(np.mean(losses)) / BATCH)
        log(f"epoch {epoch + 1}: mean training loss {epoch_losses[-1]:.4f} per sample")
    acc = s.accuracy(model_input(model, d["x_test"]), d["y_test"])
    log(f"test accuracy: {100 * acc:.2f}%")
    return epoch_losses, acc


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="linear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=float, default=1 if SMALL else EPOCHS)
    p.add_argument("--bps", type=int, default=BATCHES_PER_STEP, help="batches per step")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    s = sessions(args.model, args.bps)
    n = len(data()["y_train"]) // (BATCH * args.bps) * BATCH * args.bps
    print(f"{args.model} model, seed {args.seed}: {n} of {len(data()['y_train'])} training "
          f"samples per epoch in steps of {args.bps} x {BATCH}, ConstSGD({LEARNING_RATE}), "
          f"nllloss Sum; compiled in {s.compile_seconds:.1f} s")
    losses, acc = train(args.model, args.seed, args.epochs, bps=args.bps, log=print)
    print(f"{args.model}: final test accuracy {100 * acc:.2f}% "
          f"({time.perf_counter() - t0:.1f} s)")
    assert np.all(np.isfinite(losses)), losses
    print("mnist_saturated: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
