"""Data-dependent output shapes: what a host segment costs, against onnxruntime and against a
bounded padded form in one program (docs/data_dependent_shapes.md).

Two graphs, each run through popart.onnx_backend (compiled segments, NonZero / NMS on the
host between them) and onnxruntime, plus the padded form written directly in JAX (one jitted
program: ``jnp.nonzero(size=n)`` with a count, the consumers masked):
  masked  x [R, C] -> Greater -> NonZero -> Transpose -> GatherND -> ReduceSum (torch's x[m].sum())
  detect  scores [N] > t -> NonZero -> Gather boxes / scores -> NonMaxSuppression -> Gather

    python bench/data_dependent.py [--repeat 50]
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

from popart import onnx_backend
from popart.engine import x64


def _model(nodes, inputs, outputs, inits=()):
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info(*i) for i in inputs],
                     [h.make_tensor_value_info(*o) for o in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 13)])


def _c(name, v):
    return onnx.numpy_helper.from_array(np.asarray(v), name)


def masked(rows: int, cols: int):
    m = _model([h.make_node("Greater", ["x", "t"], ["m"]), h.make_node("NonZero", ["m"], ["nz"]),
                h.make_node("Transpose", ["nz"], ["i"], perm=[1, 0]),
                h.make_node("GatherND", ["x", "i"], ["g"]),
                h.make_node("ReduceSum", ["g"], ["y"], keepdims=0)],
               [("x", T.FLOAT, [rows, cols])], [("y", T.FLOAT, [])], [_c("t", np.float32(0.5))])
    x = np.random.default_rng(0).random((rows, cols), dtype=np.float32)

    @jax.jit
    def padded(x):   # the bounded form: every element a slot, a count, consumers masked
        m = x > 0.5
        r, c = jnp.nonzero(m, size=m.size, fill_value=0)
        valid = jnp.arange(m.size) < jnp.sum(m)
        return jnp.sum(jnp.where(valid, x[r, c], 0))
    return m, {"x": x}, lambda: padded(x)


def detect(n: int):
    m = _model([h.make_node("Greater", ["s", "t"], ["k"]), h.make_node("NonZero", ["k"], ["nz"]),
                h.make_node("Squeeze", ["nz", "a0"], ["i"]),
                h.make_node("Gather", ["b", "i"], ["kb"], axis=0),
                h.make_node("Gather", ["s", "i"], ["ks"], axis=0),
                h.make_node("Unsqueeze", ["kb", "a0"], ["b3"]),
                h.make_node("Unsqueeze", ["ks", "a01"], ["s3"]),
                h.make_node("NonMaxSuppression", ["b3", "s3", "mo", "iou", "st"], ["sel"]),
                h.make_node("Gather", ["sel", "two"], ["col"], axis=1),
                h.make_node("Gather", ["kb", "col"], ["ob"], axis=0)],
               [("b", T.FLOAT, [n, 4]), ("s", T.FLOAT, [n])], [("ob", T.FLOAT, None)],
               [_c("t", np.float32(0.9)), _c("a0", np.array([0], np.int64)),
                _c("a01", np.array([0, 1], np.int64)), _c("mo", np.array([100], np.int64)),
                _c("iou", np.array([0.5], np.float32)), _c("st", np.array([0.0], np.float32)),
                _c("two", np.int64(2))])
    rng = np.random.default_rng(0)
    corner = rng.random((n, 2), dtype=np.float32) * 20
    boxes = np.concatenate([corner, corner + 1 + rng.random((n, 2), dtype=np.float32)], 1)
    return m, {"b": boxes, "s": rng.random(n, dtype=np.float32)}, None


def _ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    print("| graph | popart segments (ms) | onnxruntime (ms) | padded, one JAX program (ms) |")
    print("| --- | ---: | ---: | ---: |")
    for name, (model, feeds, padded) in {"masked 64x64": masked(64, 64),
                                          "masked 1024x1024": masked(1024, 1024),
                                          "detect 3000 boxes": detect(3000)}.items():
        rep = onnx_backend.prepare(model)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ours = _ms(lambda: rep.run(feeds), args.repeat)
        theirs = _ms(lambda: sess.run(None, feeds), args.repeat)
        with x64():
            pad = _ms(lambda: jax.block_until_ready(padded()), args.repeat) if padded else None
        print(f"| {name} | {ours:.3f} | {theirs:.3f} | {'' if pad is None else f'{pad:.3f}'} |")
    # a new count of boxes over the threshold every run: the tail compiles every run
    model, feeds, _ = detect(3000)
    rep = onnx_backend.prepare(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    runs = [{**feeds, "s": rng.random(3000, dtype=np.float32)} for _ in range(args.repeat)]
    ours = _ms(lambda: rep.run(runs.pop()), args.repeat - 2)
    runs = [{**feeds, "s": rng.random(3000, dtype=np.float32)} for _ in range(args.repeat)]
    theirs = _ms(lambda: sess.run(None, runs.pop()), args.repeat - 2)
    print(f"| detect 3000 boxes, a new count each run | {ours:.3f} | {theirs:.3f} | |")


if __name__ == "__main__":
    main()
