"""examples/mnist_saturated.py replicated in PyTorch with exact gradients, and compared.

    python bench/saturated_replica.py                    # 2 models x seeds 0..4, 5 epochs
    python bench/saturated_replica.py --clamped          # PyTorch through log(max(p, 1e-7))
    python bench/saturated_replica.py --models linear --seeds 0,1 --epochs 2
    python bench/saturated_replica.py --steps 5          # first steps' losses side by side

The replica takes the example's initial weights, data and batch order
(``initial_weights``, ``load_data``, ``epoch_order``) and trains with
``nll_loss(log_softmax(logits), reduction="sum")`` and ``torch.optim.SGD(lr=0.01)``, one
update per batch of 32, as popart's ConstSGD does. Its gradient is (p - onehot) summed over
the batch, the rule popart's SoftmaxGradDirect gives. ``--clamped`` differentiates
``-log(max(softmax, 1e-7))`` instead (autodiff through nllloss's probability clamp, how
popart-xla differentiated it before the fused rule): samples whose p[label] is below 1e-7
give no gradient at all, which is how the original report's 74% (linear) was reproduced.

Models: ``linear`` and ``conv`` (every weight N(0, 1): the softmax starts saturated) and
``conv-scaled`` (the conv net with smaller conv1 and matmul weights, which trains; a control).
The table gives each model's and seed's test accuracy, popart and PyTorch, and the difference
(popart - PyTorch, in points); the target is popart no more than 2 points below on every row.
Where the two differ by more than 2 points, the replica is run again in float64 (the same
training without float32 rounding) and shown: a run that sits on a knife edge (a loss plateau
it escapes slowly) can move by a few points with one ulp's change to a weight, in PyTorch as
in popart; popart within 2 points of the float64 run says the gap is rounding, not gradients.
``--steps N`` prints the first N batches' losses of both (popart's loss is reported as
-log(p + 1e-7), the fused op's; the replica's column ``torch (same)`` computes that from its
own p, beside its exact loss).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
_spec = importlib.util.spec_from_file_location("mnist_saturated",
                                               ROOT / "examples" / "mnist_saturated.py")
ex = importlib.util.module_from_spec(_spec)
sys.modules["mnist_saturated"] = ex
_spec.loader.exec_module(ex)

CLAMP = 1e-7


def forward(model: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The example's network in PyTorch (same weight layout): logits."""
    h = x
    if model != "linear":
        for i in range(2):
            h = F.conv2d(h, w[f"conv{i}/weight"], w[f"conv{i}/bias"], padding=1)
            h = F.max_pool2d(F.relu(h), 2)
        h = h.reshape(len(h), -1)
    return h @ w["fc/weight"] + w["fc/bias"]


def batch_loss(logits: torch.Tensor, y: torch.Tensor, clamped: bool) -> torch.Tensor:
    """The summed loss whose gradient trains the replica: exact, or through the clamp."""
    if clamped:
        p = torch.softmax(logits, 1).gather(1, y[:, None])[:, 0]
        return -torch.log(torch.clamp(p, min=CLAMP)).sum()
    return F.nll_loss(F.log_softmax(logits, 1), y, reduction="sum")


def popart_style_loss(logits: torch.Tensor, y: torch.Tensor) -> float:
    """The loss as popart reports it: sum of -log(p[label] + 1e-7)."""
    p = torch.softmax(logits.detach(), 1).gather(1, y[:, None])[:, 0]
    return float(-torch.log(p + CLAMP).sum())


def train_torch(model: str, seed: int, epochs: float, *, bps: int = ex.BATCHES_PER_STEP,
                n_train=None, clamped: bool = False, batch_losses: list | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[list[float], float]:
    """The replica of ``ex.train``: (mean loss per sample of each epoch, test accuracy).
    The epoch losses are popart-style (-log(p + 1e-7)) so that both columns compare;
    ``batch_losses`` gets (exact, popart-style) summed loss of every batch. ``dtype``
    float64: the same training with the weights, data and arithmetic in float64."""
    d = ex.data()
    x_all = torch.from_numpy(ex.model_input(model, d["x_train"][:n_train])).to(dtype)
    y_all = torch.from_numpy(d["y_train"][:n_train]).long()
    w = {k: torch.tensor(v, dtype=dtype, requires_grad=True)
         for k, v in ex.initial_weights(model, seed).items()}
    opt = torch.optim.SGD(list(w.values()), lr=ex.LEARNING_RATE)
    per_step = ex.BATCH * bps
    epoch_losses = []
    for epoch in range(int(np.ceil(epochs))):
        order = ex.epoch_order(seed, epoch, len(y_all), per_step)
        steps = len(order) // per_step
        if epochs - epoch < 1:
            steps = max(1, int(round(steps * (epochs - epoch))))
        losses = []
        for i in range(steps * bps):   # one SGD update per batch, as in popart's step
            idx = torch.from_numpy(order[i * ex.BATCH:(i + 1) * ex.BATCH])
            xb, yb = x_all[idx], y_all[idx]
            opt.zero_grad()
            logits = forward(model, w, xb)
            loss = batch_loss(logits, yb, clamped)
            loss.backward()
            opt.step()
            reported = popart_style_loss(logits, yb)
            losses.append(reported)
            if batch_losses is not None:
                exact = float(F.nll_loss(F.log_softmax(logits.detach(), 1), yb, reduction="sum"))
                batch_losses.append((exact, reported))
        epoch_losses.append(float(np.mean(losses)) / ex.BATCH)
    with torch.no_grad():
        xt = torch.from_numpy(ex.model_input(model, d["x_test"])).to(dtype)
        pred = forward(model, w, xt).argmax(1).numpy()
    return epoch_losses, float((pred == d["y_test"]).mean())


def first_steps(model: str, seed: int, n: int, clamped: bool) -> None:
    """The first ``n`` batches' summed losses: popart, the replica's (popart-style), exact."""
    bps = ex.BATCHES_PER_STEP
    steps = -(-n // bps)
    pl: list = []
    ex.train(model, seed, steps / (len(ex.data()["y_train"]) // (ex.BATCH * bps)),
             step_losses=pl)
    tl: list = []
    train_torch(model, seed, steps / (len(ex.data()["y_train"]) // (ex.BATCH * bps)),
                clamped=clamped, batch_losses=tl)
    pop = np.concatenate(pl)[:n]
    print(f"\n{model}, seed {seed}: summed loss of the first {n} batches of 32")
    print("| batch | popart | torch (same) | rel. diff | torch exact |")
    print("|---:|---:|---:|---:|---:|")
    for i, (p, (exact, same)) in enumerate(zip(pop, tl[:n])):
        print(f"| {i} | {p:.4f} | {same:.4f} | {abs(p - same) / max(abs(same), 1e-12):.1e} "
              f"| {exact:.4f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="linear,conv,conv-scaled")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--epochs", type=float, default=ex.EPOCHS)
    ap.add_argument("--clamped", action="store_true",
                    help="PyTorch differentiates -log(max(softmax, 1e-7)) (the old failure)")
    ap.add_argument("--steps", type=int, default=0,
                    help="print the first N batches' losses of both, then stop")
    ap.add_argument("--threads", type=int, default=1,
                    help="PyTorch threads (1: steadiest beside XLA's own threads)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps:
        for m in models:
            for s in seeds:
                first_steps(m, s, args.steps, args.clamped)
        return 0

    replica = "PyTorch (clamped)" if args.clamped else "PyTorch"
    print(f"{args.epochs:g} epochs, batch {ex.BATCH}, batchesPerStep {ex.BATCHES_PER_STEP}, "
          f"lr {ex.LEARNING_RATE}; replica: {replica}")
    rows, noise, worst, times = [], [], 0.0, {"popart": 0.0, "torch": 0.0, "compile": 0.0}
    for m in models:
        t0 = time.perf_counter()
        ex.sessions(m)
        times["compile"] += time.perf_counter() - t0
        for s in seeds:
            t0 = time.perf_counter()
            pl, pa = ex.train(m, s, args.epochs)
            t1 = time.perf_counter()
            tl, ta = train_torch(m, s, args.epochs, clamped=args.clamped)
            t2 = time.perf_counter()
            times["popart"] += t1 - t0
            times["torch"] += t2 - t1
            diff = 100 * (pa - ta)
            worst = min(worst, diff)
            # A miss: is it rounding? The float64 replica is the same training, done exactly.
            t64 = (train_torch(m, s, args.epochs, clamped=args.clamped, dtype=torch.float64)[1]
                   if abs(diff) > 2 and not args.clamped else None)
            if t64 is not None and abs(100 * (pa - t64)) <= 2:
                noise.append(f"{m} seed {s}")
            rows.append((m, s, pa, ta, diff, t64, pl[-1], tl[-1], t1 - t0, t2 - t1))
            print(f"  {m} seed {s}: popart {100 * pa:.2f}%  {replica} {100 * ta:.2f}%"
                  + (f" (float64: {100 * t64:.2f}%)" if t64 is not None else ""), flush=True)
    print(f"\n| model | seed | popart acc | {replica} acc | diff (points) | float64 replica "
          f"acc | popart last-epoch loss | {replica} last-epoch loss | popart s | torch s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m, s, pa, ta, diff, t64, plast, tlast, tp, tt in rows:
        f64 = "" if t64 is None else f"{100 * t64:.2f}"
        print(f"| {m} | {s} | {100 * pa:.2f} | {100 * ta:.2f} | {diff:+.2f} | {f64} | "
              f"{plast:.4f} | {tlast:.4f} | {tp:.1f} | {tt:.1f} |")
    for m in models:
        mine = [r for r in rows if r[0] == m]
        print(f"{m}: mean popart {100 * np.mean([r[2] for r in mine]):.2f}%, mean {replica} "
              f"{100 * np.mean([r[3] for r in mine]):.2f}%")
    if noise:
        print(f"rounding, not gradients: popart is within 2 points of the float64 replica on "
              f"{', '.join(noise)}, where float32 PyTorch differs by more (float32 rounding, "
              f"amplified by training, moves these runs' accuracy by a few points)")
    print(f"\ntimes: popart compile {times['compile']:.1f} s, popart training + test "
          f"{times['popart']:.1f} s, PyTorch {times['torch']:.1f} s")
    misses = [f"{r[0]} seed {r[1]}" for r in rows if r[4] < -2]
    print(f"popart within 2 points of {replica} on every row: {'yes' if not misses else 'NO'} "
          f"(worst popart - {replica}: {worst:+.2f} points)")
    ok = set(misses) <= set(noise)
    if misses and not args.clamped:
        print(f"short by more than 2 points: {', '.join(misses)}; within 2 points of the "
              f"float64 replica there: {'yes' if ok else 'NO'}")
    return 0 if ok or args.clamped else 1


if __name__ == "__main__":
    sys.exit(main())
