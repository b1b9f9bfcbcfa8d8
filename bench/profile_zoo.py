"""Where a zoo model's step goes: XLA's CPU profile of ``bench/zoo.py``'s InferenceSession
(or, with ``--train``, its TrainingSession) on one exported model.

    python bench/profile_zoo.py gpt2 [--threads 1] [--train] [--onnx saved.onnx] [--hlo out.txt]
    python bench/profile_zoo.py efficientnet_b0 --fastest [--convs 20] [--kernels 12]

Prints the step time beside onnxruntime's (inference), the thread time of each kind of XLA
kernel per step, each matmul with its shapes and GFLOP/s, and each oneDNN convolution call
with its shape, post-ops and GFLOP/s, with ``--kernels`` the slowest XLA kernels and their
fusion's root (``profile_step.py``'s tables); ``--fastest`` takes each
kernel's fastest run (a busy machine's preemptions left out), ``--hlo`` writes the compiled
(optimized) HLO, ``--onnx`` reuses an export (or saves one).
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) if "=" in a else int(sys.argv[i + 2])
                for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"

import argparse  # noqa: E402
import glob  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (pins the process, JAX on the CPU)
import profile_step  # noqa: E402
import zoo  # noqa: E402
import zoo_models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=list(zoo_models.MODELS))
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--onnx", default="", help="an exported model to reuse (saved there if absent)")
    ap.add_argument("--hlo", default="", help="write the compiled HLO text here")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fastest", action="store_true", help="each kernel's fastest run")
    ap.add_argument("--convs", type=int, default=15, help="oneDNN convolution calls listed")
    ap.add_argument("--kernels", type=int, default=0, help="slowest XLA kernels listed")
    args = ap.parse_args()
    import jax
    import popart.testing
    from jax._src.lib import _profile_data

    z = zoo_models.MODELS[args.model]
    folder = tempfile.mkdtemp()
    path = args.onnx or os.path.join(folder, f"{args.model}.onnx")
    if not os.path.exists(path):
        zoo.export(z, z.make(), path)
    import onnx
    out_shape = onnx.load(path, load_external_data=False).graph.output[0].type.tensor_type.shape
    rows, classes = (d.dim_value for d in out_shape.dim)
    x, y = zoo.data(z, rows, classes)
    cfg = bench.Config(args.steps, args.steps, 1, bps=1)
    if args.train:
        runner, compile_s, _ = zoo.popart_training(path, x, y, args.steps)
    else:
        runner, compile_s, _ = bench.popart_inference(path, x, 1, cfg)
        ort, _ = bench.ort_inference(path, x, cfg)
    print(f"compile {compile_s:.1f} s")
    runner.loop()
    peers = {"popart": runner} if args.train else {"popart": runner, "onnxruntime": ort}
    rates = bench.interleaved(peers, 3)   # samples/s (bench.CLOCK: BENCH_CPU_TIME=1)
    print("ms per step:", {k: round(x.shape[0] / v * 1e3, 1) for k, v in rates.items()})
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            runner.loop()
        prof = _profile_data.ProfileData.from_file(
            glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    hlo = popart.testing.compiled(runner.session).as_text()
    if args.hlo:
        Path(args.hlo).write_text(hlo)
    profile_step.report(prof, args.steps, hlo, top=25, fastest=args.fastest, convs=args.convs,
                         kernels=args.kernels)


if __name__ == "__main__":
    main()
