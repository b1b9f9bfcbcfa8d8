"""Host <-> device traffic of weight I/O (issue 35 item 6): bytes moved and time of
``writeWeights`` of one weight of an Adam-trained model with ~10 MB of weights, of
``weightsToHost`` after a run, of a recompile, and of popxl's ``get_tensor_data`` of one
variable after a run that changes one of five.

    python bench/transfers.py                         # this checkout
    PYTHONPATH=<other checkout>/src python bench/transfers.py   # another one, to compare

The counter is this script's own (it wraps ``jax.device_put``, ``jax.make_array_from_callback``,
``engine.compiled.fetch`` and ``distributed.global_value``), so it measures checkouts that
have no ``popart.testing.count_transfers``."""
from __future__ import annotations

import contextlib
import time

import jax
import numpy as np

import popart
import popxl
import popxl.ops as ops
from popart import distributed
from popart.engine import compiled

N, ROWS, COLS = 5, 512, 1024   # five 2 MiB float32 weights: 10 MiB


@contextlib.contextmanager
def traffic():
    """{"h2d": bytes, "d2h": bytes} moved inside the block."""
    out = {"h2d": 0, "d2h": 0}
    inside = [False]
    put, cb, fetch, gv = jax.device_put, jax.make_array_from_callback, compiled.fetch, distributed.global_value

    def device_put(x, *a, **k):
        out["h2d"] += sum(np.asarray(v).nbytes for v in jax.tree_util.tree_leaves(x)
                          if isinstance(v, np.ndarray))
        return put(x, *a, **k)

    def from_callback(shape, sharding, f, *a, **k):
        arr = cb(shape, sharding, f, *a, **k)
        out["h2d"] += arr.nbytes
        return arr

    def counted_fetch(values, *a, **k):
        out["d2h"] += sum(v.nbytes for v in values if isinstance(v, jax.Array))
        inside[0] = True
        try:
            return fetch(values, *a, **k)
        finally:
            inside[0] = False

    def global_value(x):
        if not inside[0] and isinstance(x, jax.Array):
            out["d2h"] += x.nbytes
        return gv(x)

    jax.device_put, jax.make_array_from_callback = device_put, from_callback
    compiled.fetch, distributed.global_value = counted_fetch, global_value
    try:
        yield out
    finally:
        jax.device_put, jax.make_array_from_callback = put, cb
        compiled.fetch, distributed.global_value = fetch, gv


def timed(label, fn, repeat=5):
    fn()   # warm
    with traffic() as t:
        fn()
    best = min(_seconds(fn) for _ in range(repeat))
    print(f"{label:48s} h2d {t['h2d'] / 2**20:7.2f} MiB  d2h {t['d2h'] / 2**20:7.2f} MiB  "
          f"{best * 1e3:8.2f} ms")


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def popart_case():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, ROWS]), "x")
    rng = np.random.default_rng(0)
    ws = [b.addInitializedInputTensor(rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.01,
                                      f"w{i}") for i in range(N)]
    y = b.aiOnnx.add([b.aiOnnx.matmul([x, w]) for w in ws[:2]])
    for w in ws[2:]:
        y = b.aiOnnx.add([y, b.aiOnnx.reducesum([w], keepdims=0)])
    loss = b.aiGraphcore.l1loss([y], 0.1)
    s = popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [loss]),
                               deviceInfo=popart.DeviceManager().createCpuDevice(), loss=loss,
                               optimizer=popart.Adam({"defaultLearningRate": (0.01, False)}))
    s.prepareDevice()
    s.weightsFromHost()
    io = popart.PyWeightsIO({ws[0]: np.zeros((ROWS, COLS), np.float32)})
    feed = {x: np.ones((4, ROWS), np.float32)}

    timed("popart writeWeights (1 of 5 weights, Adam)", lambda: s.writeWeights(io))
    for _ in range(2):   # the run's traffic is not counted
        s.run(popart.PyStepIO(feed, s.initAnchorArrays()))
        for label in ("popart weightsToHost after a run", "popart weightsToHost again"):
            with traffic() as t:
                seconds = _seconds(s.weightsToHost)
            print(f"{label:48s} h2d {t['h2d'] / 2**20:7.2f} MiB  d2h {t['d2h'] / 2**20:7.2f} MiB  "
                  f"{seconds * 1e3:8.2f} ms")
    timed("popart _recompile (same options)", s._recompile, repeat=1)


def popxl_case():
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((ROWS, COLS), popxl.float32, "x")
        vs = [popxl.variable(np.zeros((ROWS, COLS), np.float32), name=f"v{i}") for i in range(N)]
        ops.var_updates.accumulate_(vs[0], ops.host_load(xs))
    s = popxl.Session(ir, "cpu")
    feed = {xs: np.ones((ROWS, COLS), np.float32)}
    with s:
        def run_then_get():
            s.run(feed)
            for v in vs:
                s.get_tensor_data(v)
        s.run(feed)
        with traffic() as t:
            [s.get_tensor_data(v) for v in vs]
        print(f"{'popxl get_tensor_data x5 after a run (1 written)':48s} h2d {t['h2d'] / 2**20:7.2f} MiB  "
              f"d2h {t['d2h'] / 2**20:7.2f} MiB")
        timed("popxl run + get_tensor_data of each", run_then_get)


if __name__ == "__main__":
    print(f"popart from {popart.__file__}")
    popart_case()
    popxl_case()
