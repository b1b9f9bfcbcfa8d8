"""Is a gap to the peer popart's or XLA's? The MLP (784-512-512-10, batch 128) as a raw
``jax.jit`` of the same computation beside popart's sessions, onnxruntime and PyTorch.

    python bench/raw_jax.py [--threads=1] [--batches 100] [--repeats 5]

Inference: onnxruntime vs popart InferenceSession (batchesPerStep 1 and 10) vs ``jax.jit`` of
x @ W1 + b1 -> ReLU -> ... called once per batch, and once per 10 batches (``lax.map`` over a
[10, 128, 784] block: what batchesPerStep 10 compiles to). Training: PyTorch eager SGD vs
popart TrainingSession (bps 10) vs a raw ``jax.jit`` SGD step (log_softmax + NLL, donated
weights) and a raw ``lax.scan`` over 10 steps. Samples/s, everything taking turns within each
repeat (the median), so the ratios within one run are what to compare.
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")),
               os.cpu_count() or 1)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if THREADS < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:THREADS])

import argparse  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the bench's runners: same sessions, same timing)
import bench_models  # noqa: E402

BPS = 10


def mlp_forward(params, x):
    h = x
    for i, (w, b) in enumerate(params):
        h = jnp.dot(h, w) + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h


def sgd_step(params, x, y):
    def loss(p):
        logp = jax.nn.log_softmax(mlp_forward(p, x))
        return -jnp.take_along_axis(logp, y[:, None], 1).mean()
    val, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - bench.LR * b, params, g), val


def report(title: str, ref: str, runners: dict[str, bench.Runner], repeats: int) -> None:
    """Time ``runners`` in turns and print their samples/s as a table, each against ``ref``."""
    rates = bench.interleaved(runners, repeats)
    print(f"\n| {title} | samples/s | vs {ref} |\n|---|---:|---:|")
    for k, v in rates.items():
        print(f"| {k} | {v:,.0f} | {v / rates[ref]:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=THREADS, help="give it as --threads=N")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    bench.THREADS = args.threads
    bench.torch.set_num_threads(args.threads)
    spec = next(s for s in bench_models.MODELS if s.name == "mlp")
    x, y = bench._data(spec)
    model = bench_models.build(spec)
    params = [(jnp.asarray(m.weight.detach().numpy().T), jnp.asarray(m.bias.detach().numpy()))
              for m in model if hasattr(m, "weight")]
    n = args.batches
    cfg = bench.Config(n, n, args.repeats, bps=BPS)
    print(f"jax {jax.__version__}, {args.threads} threads; MLP batch {spec.batch}; samples/s, "
          f"median of {args.repeats}", flush=True)

    fwd = jax.jit(mlp_forward)
    fwd_block = jax.jit(lambda p, xs: lax.map(lambda xb: mlp_forward(p, xb), xs))
    xj, xs = jnp.asarray(x), jnp.asarray(np.broadcast_to(x, (BPS, *x.shape)).copy())

    def raw1() -> None:
        for _ in range(n):
            np.asarray(fwd(params, xj))

    def raw10() -> None:
        for _ in range(n // BPS):
            np.asarray(fwd_block(params, xs))
    raw1(), raw10()
    with tempfile.TemporaryDirectory() as folder:
        path = bench_models.export(spec, model, folder)
        runners = {"onnxruntime": bench.ort_inference(path, x, cfg)[0],
                   "popart bps=1": bench.popart_inference(path, x, 1, cfg)[0],
                   f"popart bps={BPS}": bench.popart_inference(path, x, BPS, cfg)[0],
                   "jax.jit per batch": bench.Runner(raw1, n * spec.batch),
                   f"jax.jit lax.map {BPS}": bench.Runner(raw10, n * spec.batch)}
        report("MLP inference", "onnxruntime", runners, args.repeats)

        step = jax.jit(sgd_step, donate_argnums=(0,))
        scan = jax.jit(lambda p, xs, ys: lax.scan(lambda c, b: sgd_step(c, *b), p, (xs, ys)),
                       donate_argnums=(0,))
        yj = jnp.asarray(y)
        ys = jnp.asarray(np.broadcast_to(y, (BPS, *y.shape)).copy())
        state = {"p": jax.tree.map(jnp.copy, params)}

        def rawstep() -> None:
            for _ in range(n):
                state["p"], loss = step(state["p"], xj, yj)
            loss.block_until_ready()

        def rawscan() -> None:
            for _ in range(n // BPS):
                state["p"], losses = scan(state["p"], xs, ys)
            np.asarray(losses)
        rawstep(), rawscan()
        train_path = bench_models.export(spec, bench_models.build(spec), folder, training=True)
        runners = {"pytorch": bench.torch_training(spec, x, y, cfg)[0],
                   f"popart bps={BPS}": bench.popart_training(train_path, x, y, cfg)[0],
                   "jax.jit step": bench.Runner(rawstep, n * spec.batch),
                   f"jax.jit lax.scan {BPS}": bench.Runner(rawscan, n * spec.batch)}
        report("MLP training (SGD)", "pytorch", runners, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
