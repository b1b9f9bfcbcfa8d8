"""A model zoo, side by side: popart's InferenceSession against onnxruntime and its
TrainingSession against PyTorch eager, on public architectures with random weights.

    python bench/zoo.py [--threads N] [--models mobilenetv3,efficientnet_b0] [--reps 3]
                        [--infer-batches 10] [--train-batches 4] [--no-train] [--grouped-on-xla]
                        [--cpu-time] [--no-hoist]

The models (``bench/zoo_models.py``): ResNet-50, MobileNetV3-Small, EfficientNet-B0, ConvNeXt-T,
RegNetY-400MF, ShuffleNetV2 x1.0, SegFormer-B0 (segmentation; its map's mean over pixels as
the logits), ViT-S/16, Swin-T, a 6-layer BERT (seq 128), a 6-layer GPT-2 (seq 128, logits of
every token) and a 4-layer LLaMA-style decoder (grouped-query attention, RMSNorm, SwiGLU, rotary
embeddings). Each is exported once with torch's default exporter (``torch.onnx.export(...,
dynamo=True)``, which needs ``onnxscript``; the TorchScript exporter where it fails), in eval
mode: the default exporter folds BatchNormalization into the convolutions, so PyTorch's
training keeps its BatchNorm layers in eval mode (an affine per channel) and dropout and
stochastic depth off, to train the same function.

Inference: samples/s of popart (batchesPerStep 1) over onnxruntime's CPU provider, outputs
checked against each other. Training: softmax + nllloss with ConstSGD(0.01) (one step per run)
over ``torch.optim.SGD(lr=0.01)`` on log_softmax + nll_loss, the first losses printed side by
side (they differ where a random-weight model gives a label a probability under 1e-7: PopART's
nllloss takes -log(max(p, 1e-7)), at most 16.1 per sample). Compile seconds are popart's
``prepareDevice()`` (the engine cache off). The runtimes take turns within each repeat; the
median of ``--reps`` repeats (``--cpu-time``: of the process's CPU time, every thread's,
instead of the wall clock: on a machine shared with other jobs it counts the work, not the
waits for a core). ``--threads N`` pins the process to N cores and gives every
runtime N threads (oneDNN's OpenMP ones too). ``--grouped-on-xla`` keeps grouped and depthwise
convolutions on XLA (``onednn._XLA_SHAPES``), as before issue 36; ``--no-hoist`` runs inference
without weight hoisting (``engine/hoist.py``: ``POPART_HOIST=0``), as before it.
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) if "=" in a else int(sys.argv[i + 2])
                for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), os.cpu_count() or 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)   # before libgomp starts (oneDNN's, PyTorch's)

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (pins the process to THREADS cores, JAX on the CPU)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import zoo_models  # noqa: E402

import popart  # noqa: E402
from popart.engine import onednn  # noqa: E402

LR = 0.01


def export(z: zoo_models.Zoo, model: torch.nn.Module, path: str) -> str:
    """Export ``model`` (eval mode) to ``path`` with torch's default exporter, or where that
    fails (Swin-T: a view of a permuted tensor in transformers' code) with the TorchScript
    one (opset 17); returns "" or a note saying so."""
    x = (torch.randint(0, z.vocab, (z.batch, *z.shape)) if z.vocab else
         torch.randn(z.batch, *z.shape))
    kw = dict(input_names=["x"], output_names=["logits"], verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model.eval(), (x,), **kw, dynamo=True).save(path)
            return ""
        except Exception as e:  # noqa: BLE001 - torch.export's failures vary
            torch.onnx.export(model.eval(), (x,), path, **kw, dynamo=False, opset_version=17)
            return f" (TorchScript export: {type(e).__name__})"


def data(z: zoo_models.Zoo, rows: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.integers(0, z.vocab, (z.batch, *z.shape)).astype(np.int64) if z.vocab else
         rng.standard_normal((z.batch, *z.shape)).astype(np.float32))
    return x, rng.integers(0, classes, rows).astype(np.int32)


def popart_training(path: str, x: np.ndarray, y: np.ndarray, batches: int):
    """(runner, compile seconds, first loss) of a TrainingSession: softmax + nllloss, SGD."""
    b = popart.Builder(path)
    probs = b.aiOnnx.softmax(["logits"], axis=1)
    label = b.addInputTensor(popart.TensorInfo("INT32", list(y.shape)), "label")
    loss = b.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Mean)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(LR), popart.DeviceManager().createCpuDevice())
    t0 = time.perf_counter()
    s.prepareDevice()
    compile_s = time.perf_counter() - t0
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    stepio = popart.PyStepIO({"x": x, label: y}, anchors)
    s.run(stepio)
    first = float(anchors[loss])

    def loop() -> None:
        for _ in range(batches):
            s.run(stepio)
    return bench.Runner(loop, batches * x.shape[0], s), compile_s, first


def torch_training(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batches: int):
    """(runner, first loss) of PyTorch eager, BatchNorm in eval mode and dropout and
    stochastic depth off (as the exported function), torch.optim.SGD."""
    model.train()
    for m in model.modules():   # (transformers' attention reads its Dropout's p when training)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for k, v in vars(m).items():
            if ("dropout" in k or k.startswith("drop")) and isinstance(v, float):  # drop_prob
                setattr(m, k, 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    F = torch.nn.functional

    def step() -> float:
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(model(xt), 1), yt)
        loss.backward()
        opt.step()
        return loss.item()
    first = step()

    def loop() -> None:
        for _ in range(batches):
            step()
    return bench.Runner(loop, batches * x.shape[0]), first


def timed(runners: dict[str, bench.Runner], args) -> dict[str, float]:
    """Samples/s of each runner, taking turns (``bench.interleaved``); with ``--cpu-time`` by
    the process's CPU time (every thread's) instead of the wall clock (``bench.CLOCK``, as
    ``BENCH_CPU_TIME=1`` sets it)."""
    if args.cpu_time:
        bench.CLOCK = time.process_time
    return bench.interleaved(runners, args.reps)


def run_model(name: str, args, tmp: str) -> str:
    z = zoo_models.MODELS[name]
    model = z.make()
    path = os.path.join(tmp, f"{name}.onnx")
    note = export(z, model, path)
    with torch.no_grad():
        probe = model.eval()(torch.from_numpy(data(z, 1, 1)[0]))
    x, y = data(z, probe.shape[0], probe.shape[1])
    cfg = bench.Config(args.infer_batches, args.train_batches, args.reps, bps=1)
    pop_i, compile_i, out = bench.popart_inference(path, x, 1, cfg)
    ort_i, ort_out = bench.ort_inference(path, x, cfg)
    err = float(np.max(np.abs(out - ort_out[: len(out)])) / (np.max(np.abs(ort_out)) + 1e-12))
    inf = timed({"popart": pop_i, "ort": ort_i}, args)
    row = (f"| {name}{note} | {z.batch} | {inf['popart']:.1f} | {inf['ort']:.1f} | "
           f"**{inf['popart'] / inf['ort']:.2f}** | {compile_i:.1f} | {err:.0e} |")
    if args.no_train:
        return row + " | | | | | |"
    pop_t, compile_t, loss = popart_training(path, x, y, args.train_batches)
    torch_t, tloss = torch_training(model, x, y, args.train_batches)
    tr = timed({"popart": pop_t, "torch": torch_t}, args)
    return row + (f" {tr['popart']:.2f} | {tr['torch']:.2f} | **{tr['popart'] / tr['torch']:.2f}** |"
                  f" {compile_t:.1f} | {loss:.4f} / {tloss:.4f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo_models.MODELS),
                    help="comma-separated, from: " + ", ".join(zoo_models.MODELS))
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--infer-batches", type=int, default=10)
    ap.add_argument("--train-batches", type=int, default=4)
    ap.add_argument("--no-train", action="store_true", help="inference only")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time, not the wall clock (a busy machine)")
    ap.add_argument("--grouped-on-xla", action="store_true",
                    help="grouped / depthwise convolutions on XLA, as before issue 36")
    ap.add_argument("--no-hoist", action="store_true",
                    help="inference steps not hoisted (POPART_HOIST=0: weights repacked every run)")
    args = ap.parse_args(argv)
    if args.no_hoist:
        os.environ["POPART_HOIST"] = "0"
    if args.grouped_on_xla:
        onednn._XLA_SHAPES.append(lambda x, w, strides, dilation, groups: groups > 1)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("POPART_LOG_LEVEL", "ERR")
    print(f"jax {bench.jax_backend()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"CPU {bench.cpu_flags()}; samples/s (higher is better), compile s", flush=True)
    print("\n| model | batch | popart infer | onnxruntime | ratio | compile s | max rel diff |"
          " popart train | torch train | ratio | compile s | first loss popart / torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            try:
                print(run_model(name, args, tmp), flush=True)
            except Exception as e:   # one model's failure must not end the run
                print(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
