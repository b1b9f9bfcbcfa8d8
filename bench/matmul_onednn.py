"""GFLOP/s of the MLP's and BERT's weight matrix products per shape: XLA's dot, XLA's dot + bias
+ ReLU, onnxruntime's (MLAS) single-op models, PyTorch and the oneDNN matmul custom call
(``popart.engine.onednn.linear``), side by side in one process.

    python bench/matmul_onednn.py [--threads=N] [--reps 20] [--shapes 0,1]
    python bench/matmul_onednn.py --threads=1 --mlp [--repeats 7]

``--mlp``: the whole MLP of ``bench/bench.py`` (784-512-512-10, batch 128) instead, in one
process, samples/s: onnxruntime, popart's InferenceSession (batchesPerStep 1 and 10; XLA's
dots), and a raw ``jax.jit`` of the same forward (weights as
arguments; 10 batches by ``jax.vmap``, as batchesPerStep 10 compiles to) with XLA's dots and
with the oneDNN call (bias fused; ReLU by XLA or as oneDNN's post-op).

Every product is ``a [M, K] @ W^T`` with W [N, K] as PyTorch's Linear exports it (ONNX Gemm
transB=1). Columns:
- ``xla``: ``jax.jit(a @ W.T)``; ``xla+br``: ``jax.jit(relu(a @ W.T + b))``;
- ``ort``: onnxruntime, a MatMul model (W given as [K, N]); ``ort+br``: Gemm(transB=1) + Relu;
- ``torch``: ``torch.matmul(a, W.T)``; ``torch+br``: ``relu(addmm(b, a, W.T))``;
- ``dnnl``: the oneDNN matmul custom call; ``dnnl+br``: the same with oneDNN's bias and a ReLU
  post-op (one kernel).

``--threads=N`` pins the process to N cores and sets ``OMP_NUM_THREADS`` (oneDNN's and
PyTorch's OpenMP), XLA's pool (sized from the affinity mask) and onnxruntime's intra-op threads
to N alike. Each row's columns take turns within each repeat (the median of 5 repeats).
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")),
               os.cpu_count() or 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)   # before libgomp starts (oneDNN's and torch's)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if THREADS < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:THREADS])

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from popart.engine import onednn  # noqa: E402

# (label, M, K, N): the MLP (batch 128; 1280 = 10 micro-batches vectorised, batchesPerStep 10)
# and BERT's (batch 8 x seq 128 = 1024 rows) weight products.
SHAPES = [("mlp fc1", 128, 784, 512), ("mlp fc2", 128, 512, 512), ("mlp fc3", 128, 512, 10),
          ("mlp fc1 bps10", 1280, 784, 512), ("mlp fc2 bps10", 1280, 512, 512),
          ("mlp fc3 bps10", 1280, 512, 10),
          ("bert qkv/out", 1024, 256, 256), ("bert ff1", 1024, 256, 1024),
          ("bert ff2", 1024, 1024, 256)]
COLS = ["xla", "xla+br", "ort", "ort+br", "torch", "torch+br", "dnnl", "dnnl+br"]


def _ort_model(k: int, n: int, w: np.ndarray, b: np.ndarray, fused: bool) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])
    if fused:
        inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")]
        nodes = [helper.make_node("Gemm", ["x", "W", "B"], ["g"], transB=1),
                 helper.make_node("Relu", ["g"], ["y"])]
    else:
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")]
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"])]
    g = helper.make_graph(nodes, "g", [x], [y], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def runners(m: int, k: int, n: int) -> dict[str, Callable[[], None]]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    b = rng.standard_normal(n, dtype=np.float32)
    ja, jw, jb = jnp.asarray(a), jnp.asarray(w), jnp.asarray(b)
    jax_fns = {
        "xla": (lambda a, w, b: a @ w.T),
        "xla+br": (lambda a, w, b: jax.nn.relu(a @ w.T + b)),
        "dnnl": (lambda a, w, b: onednn.linear(a, w, None, True, False)),
        "dnnl+br": (lambda a, w, b: onednn.linear(a, w, b, True, True)),
    }
    runs: dict[str, Callable[[], None]] = {}
    for name, f in jax_fns.items():
        c = jax.jit(f).lower(ja, jw, jb).compile()
        runs[name] = lambda c=c: jax.block_until_ready(c(ja, jw, jb))
    for name, fused in (("ort", False), ("ort+br", True)):
        s = _ort_model(k, n, w, b, fused)
        runs[name] = lambda s=s: s.run(None, {"x": a})
    ta, tw, tb = torch.from_numpy(a), torch.from_numpy(w), torch.from_numpy(b)
    runs["torch"] = lambda: torch.matmul(ta, tw.T)
    runs["torch+br"] = lambda: torch.relu(torch.addmm(tb, ta, tw.T))
    ref = np.maximum(a @ w.T + b, 0)
    np.testing.assert_allclose(np.asarray(jax.jit(jax_fns["dnnl+br"])(ja, jw, jb)), ref,
                               rtol=1e-4, atol=1e-3)
    for r in runs.values():
        r()
    return runs


def timed(runs: dict[str, Callable[[], None]], reps: int, repeats: int = 5) -> dict[str, float]:
    """Seconds per call, the median over ``repeats`` rounds in which every runner takes a turn."""
    t: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, r in runs.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                r()
            t[k].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in t.items()}


def whole_mlp(repeats: int) -> None:
    """The MLP end to end: see the module's docstring (``--mlp``)."""
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench
    import bench_models

    bench.THREADS = THREADS
    spec = next(s for s in bench_models.MODELS if s.name == "mlp")
    x, _ = bench._data(spec)
    model = bench_models.build(spec)
    params = [(jnp.asarray(m.weight.detach().numpy()), jnp.asarray(m.bias.detach().numpy()))
              for m in model if hasattr(m, "weight")]
    bps, n = 10, 100
    cfg = bench.Config(n, n, repeats, bps=bps)
    xs = np.broadcast_to(x, (bps, *x.shape)).copy()

    def forward(linear: Callable) -> Callable:
        def f(p, h):
            for i, (w, b) in enumerate(p):
                h = linear(h, w, b, i < len(p) - 1)
            return h
        return f
    raws = {"xla": lambda h, w, b, r: jax.nn.relu(h @ w.T + b) if r else h @ w.T + b,
            "dnnl, XLA's relu": lambda h, w, b, r: (jax.nn.relu if r else (lambda v: v))(
                onednn.linear(h, w, b, True, False)),
            "dnnl, relu post-op": lambda h, w, b, r: onednn.linear(h, w, b, True, r)}
    runners: dict[str, bench.Runner] = {}
    for name, lin in raws.items():
        for k, feed in ((1, x), (bps, xs)):
            f = forward(lin) if k == 1 else jax.vmap(forward(lin), (None, 0))
            c = jax.jit(f).lower(params, feed).compile()

            def loop(c=c, feed=feed, k=k) -> None:
                for _ in range(n // k):
                    np.asarray(c(params, feed))
            loop()
            runners[f"raw jax.jit, {name}, {k} batch(es)"] = bench.Runner(loop, n * spec.batch)
    with tempfile.TemporaryDirectory() as folder:
        path = bench_models.export(spec, model, folder)
        runners["onnxruntime"] = bench.ort_inference(path, x, cfg)[0]
        for k in (1, bps):
            runners[f"popart bps={k}"] = bench.popart_inference(path, x, k, cfg)[0]
        rates = bench.interleaved(runners, repeats)
    ref = rates["onnxruntime"]
    print(f"\n| MLP inference, batch 128, {THREADS} thread(s) | samples/s | vs onnxruntime |")
    print("|---|---:|---:|")
    for k, v in rates.items():
        print(f"| {k} | {v:,.0f} | {v / ref:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="indices into SHAPES, e.g. 0,1 (default all)")
    ap.add_argument("--threads", type=int, default=THREADS, help="give it as --threads=N")
    ap.add_argument("--mlp", action="store_true", help="the whole MLP instead (see above)")
    ap.add_argument("--repeats", type=int, default=7, help="--mlp: rounds (the median)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not onednn.available():
        print("the oneDNN custom call is not available (see POPART_LOG_LEVEL=WARN)")
        return 1
    if args.mlp:
        whole_mlp(args.repeats)
        return 0
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    print(f"jax {jax.__version__}, onnxruntime {ort.__version__}, torch {torch.__version__}, "
          f"{args.threads} thread(s); GFLOP/s (2MKN / time per call), higher is better",
          flush=True)
    print("\n| shape | M x K x N | " + " | ".join(COLS) + " | dnnl+br / xla+br |")
    print("|---|---|" + "---:|" * (len(COLS) + 1))
    for label, m, k, n in shapes:
        sec = timed(runners(m, k, n), args.reps)
        f = 2.0 * m * k * n
        cells = [f"{f / sec[c] / 1e9:.0f}" for c in COLS]
        print(f"| {label} | {m}x{k}x{n} | " + " | ".join(cells) +
              f" | {sec['xla+br'] / sec['dnnl+br']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
