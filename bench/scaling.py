"""How cost grows: compile time and step time of the BERT-like encoder's TrainingSession
against depth, and samples/s against batchesPerStep.

    python bench/scaling.py [--depths 2,4,8,16,24] [--bps 1,10,100] [--bps-depth 4] [--steps 20]

Part 1 (depth): for each depth, the ONNX export of ``bench_models.Bert(layers=depth)`` (d 256,
4 heads, ff 1024, vocab 8000, seq 128, batch 8) + softmax + nllloss, ConstSGD(0.01),
batchesPerStep 10: ``prepareDevice()`` seconds (trace + XLA compile; the engine cache is off)
and seconds per optimizer step. Compile time per layer is printed so that linear growth reads
as a flat column. Part 2 (batchesPerStep): one depth, samples/s for each batchesPerStep, the
same number of samples per timed repeat, the settings taking turns within each repeat.

The machine's load varies: compare within one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import bench_models  # noqa: E402
import popart  # noqa: E402

BATCH = 8


def session(path: str, bps: int) -> tuple[popart.TrainingSession, popart.PyStepIO, float]:
    """(prepared session, its step io, prepareDevice seconds)."""
    builder = popart.Builder(path)
    probs = builder.aiOnnx.softmax(["logits"], axis=1)
    label = builder.addInputTensor(popart.TensorInfo("INT32", [BATCH]), "label")
    loss = builder.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Mean)
    opts = popart.SessionOptions()
    opts.enableEngineCaching = False
    sess = popart.TrainingSession(builder.getModelProto(),
                                  popart.DataFlow(bps, {loss: popart.AnchorReturnType("FINAL")}),
                                  loss, popart.ConstSGD(0.01),
                                  popart.DeviceManager().createCpuDevice(), userOptions=opts)
    t0 = time.perf_counter()
    sess.prepareDevice()
    compile_s = time.perf_counter() - t0
    sess.weightsFromHost()
    rng = np.random.default_rng(0)
    x = rng.integers(0, bench_models.VOCAB, (bps, BATCH, bench_models.SEQ)).astype(np.int64)
    y = rng.integers(0, 2, (bps, BATCH)).astype(np.int32)
    if bps == 1:
        x, y = x[0], y[0]
    stepio = popart.PyStepIO({"x": x, label: y}, sess.initAnchorArrays())
    sess.run(stepio)   # warm-up
    return sess, stepio, compile_s


def export(folder: str, depth: int) -> str:
    path = os.path.join(folder, f"bert{depth}.onnx")
    import torch
    torch.manual_seed(0)
    with open(path, "wb") as f:
        f.write(bench_models.to_onnx(bench_models.bert(depth), (BATCH, bench_models.SEQ),
                                     training=True, fold=False, vocab=bench_models.VOCAB))
    return path


def step_seconds(sess, stepio, runs: int) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        sess.run(stepio)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="2,4,8,16,24")
    p.add_argument("--bps", default="1,10,100")
    p.add_argument("--bps-depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps timed per repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import jax
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; BERT-like d 256, seq 128, batch "
          f"{BATCH}; median of {args.repeats} repeats", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        session(export(folder, 1), 1)   # warm-up: JAX's and popart's first-use costs untimed
        rows = []
        for depth in [int(d) for d in args.depths.split(",") if d]:
            sess, stepio, c = session(export(folder, depth), 10)
            runs = max(1, args.steps // 10)
            t = statistics.median(step_seconds(sess, stepio, runs) for _ in range(args.repeats))
            per_step = t / (runs * 10)
            rows.append((depth, c, per_step))
            print(f"  depth {depth}: compile {c:.1f} s, {per_step * 1e3:.1f} ms/step",
                  file=sys.stderr, flush=True)
            del sess
        print("\n| layers | compile s | compile s per layer | step ms | step ms per layer | "
              "samples/s |\n|---:|---:|---:|---:|---:|---:|")
        for depth, c, s in rows:
            print(f"| {depth} | {c:.1f} | {c / depth:.2f} | {s * 1e3:.1f} | "
                  f"{s * 1e3 / depth:.1f} | {BATCH / s:.0f} |")

        bps_list = [int(b) for b in args.bps.split(",") if b]
        path = export(folder, args.bps_depth)
        runners, compiles = {}, {}
        samples = max(bps_list) * BATCH
        for bps in bps_list:
            sess, stepio, compiles[bps] = session(path, bps)
            runners[bps] = (sess, stepio, max(1, max(bps_list) // bps))
        times: dict[int, list[float]] = {b: [] for b in bps_list}
        for _ in range(args.repeats):
            for b, (sess, stepio, runs) in runners.items():
                times[b].append(step_seconds(sess, stepio, runs))
        base = samples / statistics.median(times[bps_list[0]])
        print(f"\n| batchesPerStep (depth {args.bps_depth}) | compile s | run() calls per "
              f"repeat | samples/s | vs bps={bps_list[0]} |\n|---:|---:|---:|---:|---:|")
        for b in bps_list:
            sps = samples / statistics.median(times[b])
            print(f"| {b} | {compiles[b]:.1f} | {runners[b][2]} | {sps:.0f} | {sps / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
