"""Host overhead of one ``run()``: popart-xla's sessions beside onnxruntime and raw JAX.

    python bench/overhead.py [--calls 2000] [--repeats 15]

Tiny programs, so that what is timed is the host's work per call, not the computation:

* inference: one Relu on 4 floats (an ONNX model; batchesPerStep 1), run by
  ``popart.InferenceSession``, by onnxruntime (``InferenceSession.run``), and as raw JAX
  (``jax.jit(relu)`` called on a NumPy array, the result copied back with ``np.asarray``);
* training: ``loss = sum(|x @ W|)`` with W [4, 4], plain SGD (``ConstSGD``), run by
  ``popart.TrainingSession`` (the loss anchored), and as raw JAX (a jitted step donating W,
  returning the new W and the loss, the loss copied back);
* popxl: the Relu as a popxl program (host_load, relu, host_store) run by ``popxl.Session.run``,
  against the same raw JAX call.

Each figure is the median over ``--repeats`` timed blocks of ``--calls`` calls, per call, the
runtimes taking turns within each repeat (the machine may be busy: only ratios from one run
are comparable). *ratio* is the session's time over raw JAX's for the same program: the
target (issue 28) is at most 2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import popart  # noqa: E402
import popxl  # noqa: E402
import popxl.ops as ops  # noqa: E402

N = 4
LR = 0.01


def relu_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [N])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


def inference_runs() -> dict[str, Callable[[], object]]:
    model = relu_model()
    x = np.linspace(-1, 1, N, dtype=np.float32)
    dev = popart.DeviceManager().createCpuDevice()
    sess = popart.InferenceSession(model, popart.DataFlow(1, {"y": popart.AnchorReturnType("All")}), dev)
    sess.prepareDevice()
    anchors = sess.initAnchorArrays()
    stepio = popart.PyStepIO({"x": x}, anchors)
    ort_sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    relu = jax.jit(jax.nn.relu)
    sess.run(stepio)
    assert np.array_equal(anchors["y"], np.maximum(x, 0)), anchors["y"]
    assert np.array_equal(ort_sess.run(None, {"x": x})[0], anchors["y"])
    return {"popart.InferenceSession": lambda: sess.run(stepio),
            "onnxruntime": lambda: ort_sess.run(None, {"x": x}),
            "raw jax.jit": lambda: np.asarray(relu(x))}


def training_runs() -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((N, N)).astype(np.float32)
    x = rng.standard_normal((1, N)).astype(np.float32)
    b = popart.Builder()
    xi = b.addInputTensor(popart.TensorInfo("FLOAT", [1, N]), "x")
    w = b.addInitializedInputTensor(w0, "W")
    loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([xi, w])], 1.0, reduction=popart.ReductionType.Sum)
    sess = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
                                  loss, popart.ConstSGD(LR), popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    sess.weightsFromHost()
    anchors = sess.initAnchorArrays()
    stepio = popart.PyStepIO({xi: x}, anchors)

    def step(w, x):
        def f(w):
            return jnp.sum(jnp.abs(x @ w))
        l, g = jax.value_and_grad(f)(w)
        return w - LR * g, l
    jstep = jax.jit(step, donate_argnums=(0,))
    state = [jax.device_put(w0)]

    def raw():
        state[0], l = jstep(state[0], x)
        return np.asarray(l)
    sess.run(stepio)
    first = raw()
    assert np.allclose(anchors[loss], first, rtol=1e-5), (anchors[loss], first)
    return {"popart.TrainingSession": lambda: sess.run(stepio), "raw jax.jit (train)": raw}


def popxl_runs() -> dict[str, Callable[[], object]]:
    ir = popxl.Ir()
    with ir.main_graph:
        x_h2d = popxl.h2d_stream([N], popxl.float32, name="x")
        y = ops.relu(ops.host_load(x_h2d, "x"))
        y_d2h = popxl.d2h_stream(y.shape, y.dtype, name="y")
        ops.host_store(y_d2h, y)
    sess = popxl.Session(ir, "ipu_model")
    sess.__enter__()   # attached for the whole bench
    x = np.linspace(-1, 1, N, dtype=np.float32)
    feeds = {x_h2d: x}
    out = sess.run(feeds)[y_d2h]
    assert np.array_equal(out, np.maximum(x, 0)), out
    return {"popxl.Session": lambda: sess.run(feeds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed block")
    ap.add_argument("--repeats", type=int, default=15, help="timed blocks (the median is reported)")
    args = ap.parse_args()
    runs = {**inference_runs(), **training_runs(), **popxl_runs()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():   # warm-up
        for _ in range(max(args.calls // 10, 10)):
            fn()
    for _ in range(args.repeats):
        for name, fn in runs.items():   # taking turns: each block sees the same load
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls)
    us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    base = {"popart.InferenceSession": "raw jax.jit", "onnxruntime": "raw jax.jit",
            "popart.TrainingSession": "raw jax.jit (train)", "popxl.Session": "raw jax.jit"}
    print(f"jax {jax.__version__}, onnxruntime {ort.__version__}, {os.cpu_count()} CPUs, "
          f"median of {args.repeats} x {args.calls} calls")
    print("\n| runtime | program | us per call | ratio to raw jax.jit |\n| --- | --- | ---: | ---: |")
    program = {"popart.TrainingSession": "SGD step, x@W, L1 loss", "raw jax.jit (train)": "SGD step, x@W, L1 loss"}
    for k, t in us.items():
        ratio = f"{t / us[base[k]]:.2f}" if k in base else "1.00" if k.startswith("raw") else ""
        print(f"| {k} | {program.get(k, 'Relu on 4 floats')} | {t:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
