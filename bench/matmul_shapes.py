"""GFLOP/s of the zoo transformers' matrix products per shape, side by side in one process:
XLA's dot (``jax.jit``, operands as arguments) with the weight as ONNX MatMul gives it ([K, N])
and transposed ([N, K], as a tied embedding's Transpose -> MatMul or Gemm transB=1 reach it),
onnxruntime's (MLAS) one-node models, and PyTorch.

    python bench/matmul_shapes.py [--threads=1] [--reps 5] [--shapes gpt2]

Columns: ``xla`` a @ W; ``xla-t`` a @ W^T (W [N, K]); ``ort`` MatMul with W an initializer;
``ort-t`` Transpose(W) -> MatMul (onnxruntime folds the Transpose once); ``torch`` a @ W
(``torch.matmul``); ``dnnl`` oneDNN's matmul as popart's custom call (``engine/onednn``
``matmul``: W reordered into its blocked layout on each call), ``dnnl-p`` the same call reading W
packed once (``onednn.pack``, as a hoisted step runs it: the pack outside the timing). Batched rows (attention: ``b``) are [B, M, K] x [B, K, N] with both
operands inputs. Each row's columns take turns within each repeat; the median of the repeats.
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")), 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:THREADS])

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from popart.engine import onednn  # noqa: E402

# (label, B, M, K, N): B = 0 for a weight product, else a batched product of two activations.
SHAPES = {
    "gpt2": [("lm head", 0, 256, 768, 50257), ("qkv", 0, 256, 768, 2304), ("proj", 0, 256, 768, 768),
             ("fc", 0, 256, 768, 3072), ("fc2", 0, 256, 3072, 768), ("qk", 24, 128, 64, 128),
             ("pv", 24, 128, 128, 64)],
    "llama": [("lm head", 0, 256, 512, 32000), ("q/o", 0, 256, 512, 512), ("k/v", 0, 256, 512, 256),
              ("up", 0, 256, 512, 1376), ("down", 0, 256, 1376, 512), ("qk", 16, 128, 64, 128),
              ("pv", 16, 128, 128, 64)],
    "vit": [("qkv", 0, 788, 384, 1152), ("proj", 0, 788, 384, 384), ("fc", 0, 788, 384, 1536),
            ("fc2", 0, 788, 1536, 384), ("qk", 24, 197, 64, 197), ("pv", 24, 197, 197, 64)],
    "swin": [("qkv s1", 0, 6272, 96, 288), ("fc s1", 0, 6272, 96, 384), ("fc2 s1", 0, 6272, 384, 96),
             ("qkv s3", 0, 392, 384, 1152), ("qk s1", 768, 49, 32, 49), ("pv s1", 768, 49, 49, 32)],
}
COLS = ["xla", "xla-t", "ort", "ort-t", "torch", "dnnl", "dnnl-p"]


def _ort(k: int, n: int, w: np.ndarray, transposed: bool) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = ([helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
              helper.make_node("MatMul", ["x", "Wt"], ["y"])] if transposed else
             [helper.make_node("MatMul", ["x", "W"], ["y"])])
    init = numpy_helper.from_array(np.ascontiguousarray(w.T) if transposed else w, "W")
    m = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [init]),
                          opset_imports=[helper.make_opsetid("", 13)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _ort_batched() -> ort.InferenceSession:
    a, b = (helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "ab")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])],
                                            "g", [a, b], [y]),
                          opset_imports=[helper.make_opsetid("", 13)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def runners(b: int, m: int, k: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    if b:
        x, w = (rng.standard_normal(s, dtype=np.float32) for s in ((b, m, k), (b, k, n)))
        j = jax.jit(jnp.matmul)
        jx, jw = jnp.asarray(x), jnp.asarray(w)
        s = _ort_batched()
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        return {"xla": lambda: j(jx, jw).block_until_ready(),
                "ort": lambda: s.run(None, {"a": x, "b": w}),
                "torch": lambda: torch.matmul(tx, tw)}
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    jx, jw, jwt = jnp.asarray(x), jnp.asarray(w), jnp.asarray(np.ascontiguousarray(w.T))
    nn, nt = jax.jit(jnp.matmul), jax.jit(lambda a, wt: a @ wt.T)
    s, st = _ort(k, n, w, False), _ort(k, n, w, True)
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    dnnl = {}
    if onednn.available():
        d = jax.jit(lambda a, w: onednn.matmul(a, w, n))
        dp = jax.jit(lambda a, p: onednn.matmul(a, p, n, packed=True))
        jp = jax.jit(onednn.pack)(jw).block_until_ready()
        dnnl = {"dnnl": lambda: d(jx, jw).block_until_ready(),
                "dnnl-p": lambda: dp(jx, jp).block_until_ready()}
    return {**dnnl,"xla": lambda: nn(jx, jw).block_until_ready(),
            "xla-t": lambda: nt(jx, jwt).block_until_ready(),
            "ort": lambda: s.run(None, {"x": x}), "ort-t": lambda: st.run(None, {"x": x}),
            "torch": lambda: torch.matmul(tx, tw)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=THREADS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    print(f"{THREADS} thread(s), GFLOP/s (median of {args.reps})\n")
    print("| model | product | B x M x K x N | " + " | ".join(COLS) + " |")
    print("|---|---|---|" + "---:|" * len(COLS))
    for model in args.shapes.split(","):
        for label, b, m, k, n in SHAPES[model]:
            fns = runners(b, m, k, n)
            flops = 2.0 * max(b, 1) * m * k * n
            calls = max(1, int(2e9 / flops))       # about 10 ms per timing at 200 GFLOP/s
            times: dict = {c: [] for c in fns}
            for f in fns.values():
                f()
            for _ in range(args.reps):
                for c, f in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f()
                    times[c].append((time.perf_counter() - t0) / calls)
            cells = [f"{flops / statistics.median(times[c]) / 1e9:.0f}" if c in times else ""
                     for c in COLS]
            print(f"| {model} | {label} | {b or ''} x {m} x {k} x {n} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
