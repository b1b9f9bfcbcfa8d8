"""Model parallelism: one MLP trained on 1, 2 and 4 IPUs (virtual graphs, sharded or
pipelined), each IPU a device; memory per device and samples/s, beside PyTorch training the
same model on one device.

    python bench/model_parallel.py [--width 1024] [--layers 16] [--limit-mib 160] [--gpu]

Memory per device is XLA's compiled memory analysis of the step (arguments: the device's
weights and Adam state and the step's inputs; temporaries: activations and stashes). XLA's
CPU backend enforces no memory limit, so ``--limit-mib`` is a per-device budget the table
checks each configuration's total against. On a CPU the "devices" are
``POPART_HOST_DEVICES`` views of the same cores, so samples/s show the schedule's cost, not a
speed-up; ``--gpu`` runs on the machine's accelerators.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

GPU = "--gpu" in sys.argv[1:]
if not GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("POPART_HOST_DEVICES", "4")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import popart  # noqa: E402

BATCH, ACCUM, BPS, LR = 16, 8, 2, 1e-3


def build(width: int, layers: int, ipus: int):
    rs = np.random.RandomState(0)
    weights = [(rs.randn(width, width) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [BATCH, width]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [BATCH]), "label")
    h = x
    for i, w in enumerate(weights):
        stage = i * ipus // layers
        with b.virtualGraph(stage), b.pipelineStage(stage):
            h = b.aiOnnx.relu([b.aiOnnx.matmul([h, b.addInitializedInputTensor(w, f"w{i}")])])
            if i == layers - 1:
                loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([h], axis=1), lab],
                                             reduction=popart.ReductionType.Mean)
    return b, x, lab, loss, weights


def popart_run(width: int, layers: int, ipus: int, pipelined: bool, repeats: int) -> dict:
    b, x, lab, loss, _ = build(width, layers, ipus)
    o = popart.SessionOptions()
    o.enableGradientAccumulation, o.accumulationFactor = True, ACCUM
    if ipus > 1:
        o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, pipelined
    dev = popart.DeviceManager().acquireAvailableDevice(ipus)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(BPS, [loss]), loss,
                               popart.Adam({"defaultLearningRate": (LR, True)}), dev, userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    rs = np.random.RandomState(1)
    feeds = {x: rs.randn(BPS, ACCUM, BATCH, width).astype(np.float32),
             lab: rs.randint(0, width, (BPS, ACCUM, BATCH)).astype(np.int32)}
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO(feeds, out))   # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s.run(popart.PyStepIO(feeds, out))
        times.append(time.perf_counter() - t0)
    ma = s._program.compiled.memory_analysis()
    dev.detach()
    return {"args": ma.argument_size_in_bytes, "temp": ma.temp_size_in_bytes,
            "sps": BPS * ACCUM * BATCH / float(np.median(times)),
            "placed": getattr(s._program, "placed", False)}


def torch_run(width: int, layers: int, repeats: int) -> float:
    _, _, _, _, weights = build(width, layers, 1)
    device = "cuda" if GPU else "cpu"
    ws = [torch.tensor(w, device=device, requires_grad=True) for w in weights]
    opt = torch.optim.Adam(ws, lr=LR)
    rs = np.random.RandomState(1)
    X = torch.tensor(rs.randn(BPS, ACCUM, BATCH, width).astype(np.float32), device=device)
    L = torch.tensor(rs.randint(0, width, (BPS, ACCUM, BATCH)), device=device)

    def step():
        for bi in range(BPS):
            opt.zero_grad()
            for a in range(ACCUM):
                h = X[bi, a]
                for w in ws:
                    h = torch.relu(h @ w)
                (torch.nn.functional.cross_entropy(h, L[bi, a]) / ACCUM).backward()
            opt.step()
        if GPU:
            torch.cuda.synchronize()
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return BPS * ACCUM * BATCH / float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--limit-mib", type=float, default=160.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gpu", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ref = torch_run(a.width, a.layers, a.repeats)
    mib = 1 << 20
    print(f"MLP {a.layers} x [{a.width}x{a.width}] float32, Adam, batch {BATCH}, accumulation "
          f"{ACCUM}, {BPS} batches per step; per-device budget {a.limit_mib:.0f} MiB; PyTorch "
          f"(one device) {ref:.0f} samples/s\n")
    print("| IPUs (devices) | schedule | weights+state+inputs per device (MiB) | temporaries "
          "per device (MiB) | total per device (MiB) | within the budget | samples/s | vs PyTorch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for ipus, pipelined in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        r = popart_run(a.width, a.layers, ipus, pipelined, a.repeats)
        total = (r["args"] + r["temp"]) / mib
        sched = "one device" if ipus == 1 else "pipelined" if pipelined else "sharded"
        print(f"| {ipus} | {sched} | {r['args'] / mib:.1f} | {r['temp'] / mib:.1f} | {total:.1f} | "
              f"{'yes' if total <= a.limit_mib else 'no'} | {r['sps']:.0f} | {r['sps'] / ref:.2f} |")


if __name__ == "__main__":
    main()
