"""Recomputation: one MLP trained with PopART's recomputation settings; the compiled step's
temporary memory and samples/s, beside PyTorch training the same model without and with
activation checkpointing (``torch.utils.checkpoint.checkpoint_sequential``).

    python bench/recompute.py [--width 512] [--layers 16] [--batch 1024] [--every 4] [--steps 5]

Rows: no recomputation; ``autoRecomputation = Standard`` (PopART's choice of checkpoints);
hand annotations (``recomputeOutputInBackwardPass``) that checkpoint every ``--every``-th
layer's output and recompute the rest, the same segments ``checkpoint_sequential`` keeps.
Temporary memory is XLA's compiled memory analysis of the step (activations and the backward
pass's buffers; weights and optimizer state are arguments). The "vs PyTorch" ratio is
samples/s over PyTorch's samples/s for the same recomputation (none, or checkpointed
segments); above 1 is faster.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint_sequential  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import popart  # noqa: E402

LR = 1e-3


def weights(width: int, layers: int) -> list[np.ndarray]:
    rs = np.random.RandomState(0)
    return [(rs.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]


def popart_session(ws: list, batch: int, mode: str, every: int):
    """(session, input id, loss id) of tanh(x @ w) layers with an L1 loss."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, ws[0].shape[0]]), "x")
    h = x
    for i, w in enumerate(ws):
        m = b.aiOnnx.matmul([h, b.addInitializedInputTensor(w, f"w{i}")])
        h = b.aiOnnx.tanh([m])
        if mode == "hand":
            b.recomputeOutputInBackwardPass(m, popart.RecomputeType.Recompute)
            b.recomputeOutputInBackwardPass(h, popart.RecomputeType.Checkpoint if (i + 1) % every == 0
                                            else popart.RecomputeType.Recompute)
    loss = b.aiGraphcore.l1loss([h], 1.0 / batch, reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    if mode == "standard":
        o.autoRecomputation = popart.RecomputationType.Standard
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.SGD({"defaultLearningRate": (LR, True)}),
                               popart.DeviceManager().createCpuDevice(), userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    return s, x, loss


def time_popart(s, x: str, loss: str, X: np.ndarray, steps: int) -> tuple[float, float]:
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, out))   # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        s.run(popart.PyStepIO({x: X}, out))
    return (time.perf_counter() - t0) / steps, float(out[loss])


def time_torch(ws: list, X: np.ndarray, steps: int, segments: int) -> float:
    layers = [torch.nn.Linear(w.shape[0], w.shape[1], bias=False) for w in ws]
    for lin, w in zip(layers, ws):
        lin.weight.data = torch.from_numpy(w.T.copy())
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x = torch.from_numpy(X)

    def step() -> None:
        opt.zero_grad()
        h = checkpoint_sequential(model, segments, x, use_reentrant=False) if segments else model(x)
        h.abs().mean(0).sum().backward()
        opt.step()

    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ws = weights(a.width, a.layers)
    X = np.random.RandomState(1).randn(a.batch, a.width).astype(np.float32)
    print(f"MLP {a.layers} x {a.width}^2, batch {a.batch}, SGD; {a.threads} threads")
    print("| recomputation | segments | temporaries (MiB) | samples/s | PyTorch samples/s | vs PyTorch |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    losses = []
    for mode, segments in (("none", 0), ("standard", None), ("hand", a.layers // a.every)):
        s, x, loss = popart_session(ws, a.batch, mode, a.every)
        temp = s._program.step.compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
        secs, value = time_popart(s, x, loss, X, a.steps)
        losses.append(value)
        torch_secs = time_torch(ws, X, a.steps, segments) if segments is not None else None
        ref = f"{a.batch / torch_secs:.0f}" if torch_secs else "-"
        ratio = f"{torch_secs / secs:.2f}" if torch_secs else "-"
        label = {"none": "none", "standard": "Standard", "hand": f"every {a.every}th layer kept"}[mode]
        print(f"| {label} | {len(s._program.segments)} | {temp:.1f} | {a.batch / secs:.0f} | {ref} | {ratio} |")
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), f"the losses differ: {losses}"


if __name__ == "__main__":
    main()
