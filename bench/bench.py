"""Side-by-side benchmark: popart-xla vs onnxruntime (inference) and PyTorch eager (training).

    python bench/bench.py [--quick] [--models mlp,resnet18,bert | --all]

The default models are issue 28's (an MLP 784-512-512-10 at batch 128, ResNet-18 for CIFAR at
batch 16, a BERT-like 4 x 256 encoder at seq 128, batch 8); ``--all`` adds the older, smaller
``cnn`` and ``transformer``. Training: softmax + nllloss with ConstSGD(0.01) against PyTorch
eager's log_softmax + nll_loss with torch.optim.SGD(0.01).

Prints two markdown tables of samples/second (higher is better), each the median of a few
repeats after a warm-up, the runtimes compared taking turns within each repeat (so both see
the same load); compile time is reported separately, and the GFLOP/s of training steps beside
the machine's matmul roofline. On the CPU by default: JAX, PyTorch
and onnxruntime all use os.cpu_count() threads (``--threads N``: N threads each, the
process pinned to N cores; steadier figures on a busy machine). ``--gpu``: popart on JAX's
accelerator, PyTorch on CUDA, onnxruntime on its CUDA provider when it has one.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GPU = "--gpu" in sys.argv[1:]
if not GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compare like with like: all on the CPU


def _threads_from_argv(argv: list[str]) -> int:
    """--threads N, read before JAX starts (XLA's thread pool is sized at start-up)."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return os.cpu_count() or 1


THREADS = _threads_from_argv(sys.argv[1:])
if not GPU and THREADS < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
    # Pin the process to THREADS cores: XLA sizes its thread pool from the affinity mask.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:THREADS])

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import bench_models  # noqa: E402
import popart  # noqa: E402

LR = 0.01
# BENCH_CPU_TIME=1: time by the process's CPU time (with --threads 1, the time the process ran,
# which other jobs on a shared core do not inflate; spinning thread pools count against their runtime).
CLOCK = time.process_time if os.environ.get("BENCH_CPU_TIME", "0") not in ("0", "") else time.perf_counter
TORCH_DEVICE = "cuda" if GPU else "cpu"


ORT_PROVIDERS = (["CUDAExecutionProvider"] if GPU and "CUDAExecutionProvider" in
                 ort.get_available_providers() else []) + ["CPUExecutionProvider"]


def jax_backend() -> str:
    import jax
    return jax.default_backend()


def popart_device() -> popart.DeviceInfo:
    """The CPU, or with --gpu JAX's accelerator (an IPU-model device maps to it, shared)."""
    manager = popart.DeviceManager()
    return manager.createIpuModelDevice() if GPU else manager.createCpuDevice()


def torch_sync() -> None:
    """Wait for PyTorch's queued GPU work (a no-op on the CPU)."""
    if GPU:
        torch.cuda.synchronize()


@dataclass
class Config:
    infer_batches: int   # batches timed per repeat (inference)
    train_batches: int   # batches (optimizer steps) timed per repeat (training)
    repeats: int
    bps: int = 10


@dataclass
class Runner:
    """A warmed-up workload: ``loop()`` processes ``samples`` samples."""
    loop: Callable[[], None]
    samples: int
    session: object = None   # the popart session behind ``loop``, if any (for profiling)


def interleaved(runners: dict[str, Runner], repeats: int) -> dict[str, float]:
    """Samples/s of each runner, the median over ``repeats`` rounds in which every runner is
    timed once: the runtimes compared see the same load of a shared machine."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for k, r in runners.items():
            t0 = CLOCK()
            r.loop()
            times[k].append(CLOCK() - t0)
    return {k: runners[k].samples / statistics.median(v) for k, v in times.items()}


def _data(spec: bench_models.BenchModel, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, spec.vocab, spec.input_shape).astype(np.int64) if spec.vocab else
         rng.standard_normal(spec.input_shape).astype(np.float32))
    y = rng.integers(0, spec.classes, spec.batch).astype(np.int32)
    return x, y


def cpu_flags() -> str:
    """The vector extensions of this CPU that matter to GEMM and convolution kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
    have = [w for w in wanted if w in flags]
    return " ".join(have) or "none of AVX2 / AVX-512"


# --------------------------------------------------------------------------------- inference
def popart_inference(path: str, x: np.ndarray, bps: int,
                     cfg: Config) -> tuple[Runner, float, np.ndarray]:
    """(runner, compile seconds, output of the first batch)."""
    flow = popart.DataFlow(bps, {"logits": popart.AnchorReturnType("ALL")})
    session = popart.InferenceSession(path, flow, popart_device())
    t0 = time.perf_counter()
    session.prepareDevice()
    compile_s = time.perf_counter() - t0
    feed = np.broadcast_to(x, (bps, *x.shape)).copy() if bps > 1 else x
    anchors = session.initAnchorArrays()
    stepio = popart.PyStepIO({"x": feed}, anchors)
    session.run(stepio)  # warm-up
    first = anchors["logits"].reshape(-1, *anchors["logits"].shape[-2:])[0].copy()
    runs = max(1, cfg.infer_batches // bps)

    def loop() -> None:
        for _ in range(runs):
            session.run(stepio)
    return Runner(loop, runs * bps * x.shape[0], session), compile_s, first


def ort_inference(path: str, x: np.ndarray, cfg: Config) -> tuple[Runner, np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    sess = ort.InferenceSession(path, so, providers=ORT_PROVIDERS)
    out = sess.run(None, {"x": x})[0]  # warm-up
    for _ in range(3):
        sess.run(None, {"x": x})

    def loop() -> None:
        for _ in range(cfg.infer_batches):
            sess.run(None, {"x": x})
    return Runner(loop, cfg.infer_batches * x.shape[0]), out


# --------------------------------------------------------------------------------- training
def popart_training(path: str, x: np.ndarray, y: np.ndarray,
                    cfg: Config) -> tuple[Runner, float, float, float]:
    """(runner, compile seconds, loss of the first batch, FLOPs per micro-batch step)."""
    builder = popart.Builder(path)
    probs = builder.aiOnnx.softmax(["logits"], axis=1)
    label = builder.addInputTensor(popart.TensorInfo("INT32", [x.shape[0]]), "label")
    loss = builder.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Mean)
    bps = cfg.bps
    session = popart.TrainingSession(builder.getModelProto(),
                                     popart.DataFlow(bps, {loss: popart.AnchorReturnType("ALL")}),
                                     loss, popart.ConstSGD(LR),
                                     popart_device())
    t0 = time.perf_counter()
    session.prepareDevice()
    compile_s = time.perf_counter() - t0
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    stepio = popart.PyStepIO({"x": np.broadcast_to(x, (bps, *x.shape)).copy(),
                              label: np.broadcast_to(y, (bps, *y.shape)).copy()}, anchors)
    session.run(stepio)  # warm-up
    first_loss = float(anchors[loss][0])
    runs = max(1, cfg.train_batches // bps)

    def loop() -> None:
        for _ in range(runs):
            session.run(stepio)
    return (Runner(loop, runs * bps * x.shape[0], session), compile_s, first_loss,
            step_flops(session))


def step_flops(session: popart.TrainingSession) -> float:
    """XLA's FLOP count of one micro-batch step (its cost analysis counts a loop body once)."""
    try:
        cost = session._program.compiled.cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0))
    except Exception:  # cost analysis is best effort
        return 0.0


def matmul_peak(n: int = 1024, reps: int = 20) -> dict[str, float]:
    """GFLOP/s of an n x n float32 matmul in JAX and in PyTorch: the machine's roofline."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda u, v: u @ v)
    f(a, a).block_until_ready()

    def jax_run() -> None:
        r = a
        for _ in range(reps):
            r = f(a, a)
        r.block_until_ready()
    ta = torch.ones(n, n, device=TORCH_DEVICE)

    def torch_run() -> None:
        for _ in range(reps):
            ta @ ta
        torch_sync()
    torch_run()
    rates = interleaved({"jax": Runner(jax_run, reps), "torch": Runner(torch_run, reps)}, 5)
    return {k: v * 2.0 * n ** 3 / 1e9 for k, v in rates.items()}


def torch_training(spec: bench_models.BenchModel, x: np.ndarray, y: np.ndarray,
                   cfg: Config) -> tuple[Runner, float]:
    """(runner, loss of the first batch) of PyTorch eager with torch.optim.SGD."""
    model = bench_models.build(spec).train().to(TORCH_DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xt = torch.from_numpy(x).to(TORCH_DEVICE)
    yt = torch.from_numpy(y).long().to(TORCH_DEVICE)
    F = torch.nn.functional

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(model(xt), dim=1), yt)
        loss.backward()
        opt.step()
        return loss
    first_loss = step().item()  # warm-up
    for _ in range(3):
        step()
    torch_sync()

    def loop() -> None:
        for _ in range(cfg.train_batches):
            step()
        torch_sync()
    return Runner(loop, cfg.train_batches * x.shape[0]), first_loss


# --------------------------------------------------------------------------------- tables
def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    global THREADS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and repeats")
    p.add_argument("--models", default=bench_models.DEFAULT,
                   help=f"comma-separated, of {','.join(m.name for m in bench_models.MODELS)}")
    p.add_argument("--all", action="store_true", help="every model, the older ones too")
    p.add_argument("--threads", type=int, default=THREADS,
                   help="threads (and cores) for PyTorch, onnxruntime and XLA; default: all")
    p.add_argument("--gpu", action="store_true",
                   help="popart on JAX's accelerator and PyTorch on CUDA (read at start-up)")
    args = p.parse_args(argv)
    THREADS = args.threads
    if GPU and (not torch.cuda.is_available() or jax_backend() == "cpu"):
        print(f"--gpu: no GPU (torch.cuda.is_available() = {torch.cuda.is_available()}, JAX "
              f"backend '{jax_backend()}')", file=sys.stderr)
        return 2
    cfg = Config(20, 10, 3) if args.quick else Config(100, 50, 5)
    torch.set_num_threads(THREADS)
    import jax
    where = (f"GPU: {torch.cuda.get_device_name()}" if GPU else
             f"CPU: {platform.processor() or platform.machine()}, {THREADS} threads")
    print(f"{where}; jax {jax.__version__} ({jax.default_backend()}), onnxruntime "
          f"{ort.__version__} ({ORT_PROVIDERS[0]}), torch {torch.__version__} "
          f"({TORCH_DEVICE}); {'quick' if args.quick else 'full'} run: median of "
          f"{cfg.repeats} repeats", flush=True)
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} CPUs", flush=True)
    wanted = [m.name for m in bench_models.MODELS] if args.all else args.models.split(",")
    specs = [s for s in bench_models.MODELS if s.name in wanted]
    infer_rows, train_rows, failures = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for spec in specs:
            x, y = _data(spec)
            model = bench_models.build(spec)
            path = bench_models.export(spec, model, folder)
            ort_run, ref_out = ort_inference(path, x, cfg)
            try:
                run10, c10, out = popart_inference(path, x, cfg.bps, cfg)
                run1, c1, _ = popart_inference(path, x, 1, cfg)
                r = interleaved({"ort": ort_run, "pa10": run10, "pa1": run1}, cfg.repeats)
                ref, pa10, pa1 = r["ort"], r["pa10"], r["pa1"]
                diff = float(np.abs(out - ref_out).max())
                infer_rows.append([spec.name, str(spec.batch), f"{pa10:,.0f}", f"{pa1:,.0f}",
                                   f"{ref:,.0f}", f"{pa10 / ref:.2f}", f"{pa1 / ref:.2f}",
                                   f"{c10:.2f} / {c1:.2f}", f"{diff:.1e}"])
            except Exception as e:
                failures.append(f"inference {spec.name}: {type(e).__name__}: {_first_line(e)}")
                ref = interleaved({"ort": ort_run}, cfg.repeats)["ort"]
                infer_rows.append([spec.name, str(spec.batch), "failed", "failed", f"{ref:,.0f}",
                                   "-", "-", "-", "-"])
            print(f"inference {spec.name}: done", file=sys.stderr, flush=True)

            train_path = bench_models.export(spec, bench_models.build(spec), folder, training=True)
            torch_run, loss_t = torch_training(spec, x, y, cfg)
            try:
                pa_run, ct, loss_p, flops = popart_training(train_path, x, y, cfg)
                r = interleaved({"torch": torch_run, "popart": pa_run}, cfg.repeats)
                pt, tt = r["popart"], r["torch"]
                per_sample = flops / spec.batch / 1e9
                train_rows.append([spec.name, str(spec.batch), f"{pt:,.0f}", f"{tt:,.0f}",
                                   f"{pt / tt:.2f}", f"{pt * per_sample:.0f}",
                                   f"{1.5 * tt * per_sample:.0f}", f"{ct:.2f}",
                                   f"{abs(loss_p - loss_t):.1e}"])
            except Exception as e:  # report the failure in the table, go on with the others
                failures.append(f"training {spec.name}: {type(e).__name__}: {_first_line(e)}")
                tt = interleaved({"torch": torch_run}, cfg.repeats)["torch"]
                train_rows.append([spec.name, str(spec.batch), "failed", f"{tt:,.0f}",
                                   *["-"] * 5])
            print(f"training {spec.name}: done", file=sys.stderr, flush=True)

    print(f"\n### Inference, samples/s (popart InferenceSession vs onnxruntime "
          f"{ORT_PROVIDERS[0]}, "
          f"{cfg.infer_batches} batches per repeat)\n")
    print(table(["model", "batch", f"popart bps={cfg.bps}", "popart bps=1", "onnxruntime",
                 f"ratio bps={cfg.bps}", "ratio bps=1", "compile s (bps=10 / 1)",
                 "max abs diff"], infer_rows))
    print(f"\n### Training, samples/s (popart TrainingSession bps={cfg.bps}, ConstSGD, softmax + "
          f"nllloss vs PyTorch eager, {cfg.train_batches} steps per repeat)\n")
    print(table(["model", "batch", "popart", "pytorch", "ratio", "popart GFLOP/s",
                 "GFLOP/s for 1.5x", "compile s", "first-loss diff"], train_rows))
    peak = matmul_peak()
    print(f"\nRoofline: a 1024x1024 float32 matmul runs at {peak['jax']:.0f} GFLOP/s in JAX and "
          f"{peak['torch']:.0f} GFLOP/s in PyTorch on {where} (GFLOP/s of a "
          f"training step: XLA's FLOP count of the step x steps/s).")
    for f in failures:
        print(f"\nfailed: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
