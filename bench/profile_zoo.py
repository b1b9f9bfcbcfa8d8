"""Where a zoo model's step goes: XLA's CPU profile of ``bench/zoo.py``'s InferenceSession
(or, with ``--train``, its TrainingSession) on one exported model.

    python bench/profile_zoo.py gpt2 [--threads 1] [--train] [--onnx saved.onnx] [--hlo out.txt]

Prints the step time beside onnxruntime's (inference), the thread time of each kind of XLA
kernel per step, and each matmul with its shapes and GFLOP/s (``profile_step.py``'s tables);
``--hlo`` writes the compiled (optimized) HLO, ``--onnx`` reuses an export (or saves one).
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) if "=" in a else int(sys.argv[i + 2])
                for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
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
    t = {}
    for _ in range(3):
        for name, r in (("popart", runner),) + ((("ort", ort),) if not args.train else ()):
            t0 = time.perf_counter()
            r.loop()
            t.setdefault(name, []).append((time.perf_counter() - t0) / args.steps * 1e3)
    print("ms per step (min of 3):", {k: round(min(v), 2) for k, v in t.items()})
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            runner.loop()
        prof = _profile_data.ProfileData.from_file(
            glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    per_kernel: collections.Counter = collections.Counter()
    for plane in prof.planes:
        for line in plane.lines:
            if line.name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):
                for ev in line.events:
                    per_kernel[ev.name] += ev.duration_ns / args.steps / 1e3
    kinds: collections.Counter = collections.Counter()
    for name, us in per_kernel.items():
        if not name.startswith(profile_step._NOT_KERNELS):
            kinds[re.sub(r"\.\d+$", "", name)] += us
    print(f"\nthread time per step by kernel kind (us), total {sum(kinds.values()):.0f}:")
    for kind, us in kinds.most_common(25):
        print(f"{us:10.0f}  {kind}")
    hlo = popart.testing.compiled(runner.session).as_text()
    if args.hlo:
        Path(args.hlo).write_text(hlo)
    dots = profile_step._matmuls(hlo)
    print("\nmatmuls (us per step, GFLOP/s, lhs x rhs):")
    rows_ = sorted(((per_kernel[n], n, *d) for n, d in dots.items() if n in per_kernel),
                   reverse=True)
    for us, name, lhs, rhs, flops in rows_[:40]:
        print(f"{us:10.0f} {flops / max(us, 1e-9) / 1e3:7.1f}  {name:16s} {lhs} x {rhs}")
    total_us = sum(r[0] for r in rows_)
    total_flops = sum(r[4] for r in rows_)
    print(f"{total_us:10.0f} {total_flops / max(total_us, 1e-9) / 1e3:7.1f}  all matmuls "
          f"({total_flops / 1e9:.3f} GFLOP)")


if __name__ == "__main__":
    main()
