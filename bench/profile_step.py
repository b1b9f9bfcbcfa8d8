"""Where a training step's time goes: XLA's CPU profile of one bench model's TrainingSession
(or, with ``--inference``, its InferenceSession). A zoo model's: ``bench/profile_zoo.py``.

    python bench/profile_step.py transformer [--threads 2] [--inference]

Prints the step time, the thread time of each kind of XLA kernel per step, and each matmul
(YNNPACK fusion) with its shape and GFLOP/s; where the program calls oneDNN, each convolution
call (``ffi_call``) with its shape, post-ops and GFLOP/s, and their time by kind (1x1,
depthwise, grouped, k x k). Thread time counts every thread: when two kernels run side by side
each gets one core, and their GFLOP/s halve.
"""
from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


_DOT = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]\S* dot\((%[\w.\-]+), (%[\w.\-]+)\), "
                  r"lhs_contracting_dims=\{([\d,]*)\}")


def _matmuls(hlo: str) -> dict[str, tuple[list[int], list[int], float]]:
    """Kernel name -> (lhs shape, rhs shape, FLOPs) from the compiled HLO text, for the plain
    dots (Eigen) and the YNNPACK fusions around a dot."""
    shapes = {n: [int(v) for v in s.split(",") if v]
              for n, s in re.findall(r"(%[\w.\-]+) = \w+\[([\d,]*)\]", hlo)}

    def matmul(dot: re.Match) -> tuple[list[int], list[int], float]:
        lhs, rhs = shapes[dot.group(3)], shapes[dot.group(4)]
        out_elems = math.prod(int(v) for v in dot.group(2).split(",") if v)
        k = math.prod(lhs[int(i)] for i in dot.group(5).split(","))
        return lhs, rhs, 2.0 * out_elems * k
    out = {dot.group(1): matmul(dot) for dot in _DOT.finditer(hlo)}
    bodies = dict(re.findall(r"^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S | re.M))
    for name, body in re.findall(r"%(ynn_fusion[\w.]*) = \S+ fusion\([^)]*\).*?calls=(%[\w.\-]+)", hlo):
        dot = _DOT.search(bodies.get(body, ""))
        if dot:
            out[name] = matmul(dot)
    return out


# Events that are not a kernel's own time: the executor, loops around kernels, waits, copies.
_NOT_KERNELS = ("ThunkExecutor", "end:", "while", "SlinkyThreadPool", "H2D", "D2H")


_CONV = re.compile(r"%(ffi_call[\w.]*) = f32\[([\d,]*)\]\S* custom-call\(.*?"
                   r"custom_call_target=\"popart_onednn_conv\", operand_layout_constraints="
                   r"\{f32\[([\d,]*)\]\S*, f32\[([\d,]*)\]\S*(?:, f32\[([\d,]*)\]\S*)*\}.*?"
                   r"geom = dense<\[([\d, -]*)\]>")


def _convs(hlo: str) -> dict[str, tuple[str, str, float]]:
    """Kernel name -> (kind, description, FLOPs) of each oneDNN convolution call in the
    compiled HLO text (forward calls: activations first, OIHW weights second)."""
    out = {}
    for m in _CONV.finditer(hlo):
        name, y, x, w = m.group(1), *(
            [int(v) for v in g.split(",") if v] for g in m.group(2, 3, 4))
        geom = [int(v) for v in m.group(6).split(",")]
        groups = geom[10]
        if len(w) < 4:   # weights packed by popart_onednn_conv_pack (a hoisted inference step)
            post = f" post {geom[11:]}" if len(geom) > 11 else ""
            out[name] = ("packed", f"{x[-4:]} -> {y[-4:]} s{geom[2]} g{groups}{post}", 0.0)
            continue
        o, cg, kh, kw = w[-4:]
        kind = ("depthwise" if groups > 1 and cg == 1 else "grouped" if groups > 1
                else "1x1" if (kh, kw) == (1, 1) else f"{kh}x{kw}")
        post = f" post {geom[11:]}" if len(geom) > 11 else ""
        desc = (f"{x[-4:]} -> {y[-4:]} k{kh}x{kw} s{geom[2]} g{groups}"
                f"{' nhwc' if geom[1] else ' nchw'}{post}")
        out[name] = (kind, desc, 2.0 * math.prod(y) * cg * kh * kw)
    return out


def _kernel_times(prof, steps: float, fastest: bool = False) -> collections.Counter:
    """Kernel name -> us per step: its mean, or with ``fastest`` its fastest run times its
    runs per step (on a machine shared with other jobs a kernel's slow runs are the ones
    another process preempted)."""
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for plane in prof.planes:
        for line in plane.lines:
            if line.name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):  # pool, caller
                for ev in line.events:
                    runs[ev.name].append(ev.duration_ns / 1e3)
    return collections.Counter({
        name: (min(us) * len(us) if fastest else sum(us)) / steps for name, us in runs.items()})


def _print_kinds(per_kernel: collections.Counter, top: int = 12) -> None:
    kinds: collections.Counter = collections.Counter()
    for name, us in per_kernel.items():
        if not name.startswith(_NOT_KERNELS):
            kinds[re.sub(r"\.\d+$", "", name)] += us
    print(f"\nthread time per step by kernel kind (us; {sum(kinds.values()):,.0f} in all):")
    for kind, us in kinds.most_common(top):
        print(f"{us:10.0f}  {kind}")


def convolutions(per_kernel: collections.Counter, hlo: str, show: int = 15) -> None:
    """Print the oneDNN convolution calls of the program whose compiled HLO is ``hlo``: their
    time by kind, then the ``show`` slowest calls, each with its GFLOP/s (nothing without any)."""
    convs = _convs(hlo)
    if not convs:
        return
    by_kind: collections.Counter = collections.Counter()
    flops_kind: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for n, (kind, _, flops) in convs.items():
        by_kind[kind] += per_kernel[n]
        flops_kind[kind] += flops
        calls[kind] += 1
    total = sum(by_kind.values())
    print(f"\noneDNN convolutions by kind (us per step, GFLOP/s, calls; {total:,.0f} us in all):")
    for kind, us in by_kind.most_common():
        print(f"{us:10.0f} {flops_kind[kind] / max(us, 1e-9) / 1e3:7.1f}  {kind} x{calls[kind]}")
    print(f"\nthe {show} slowest oneDNN convolution calls (us, GFLOP/s):")
    rows = sorted(((per_kernel[n], n, d, f) for n, (_, d, f) in convs.items()), reverse=True)
    for us, n, desc, flops in rows[:show]:
        print(f"{us:10.0f} {flops / max(us, 1e-9) / 1e3:7.1f}  {n:14s} {desc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["mlp", "resnet18", "bert", "cnn", "transformer"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bps", type=int, default=10)
    ap.add_argument("--inference", action="store_true", help="the InferenceSession's step")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench  # noqa: E402  (the bench's TrainingSession set-up, shared)
    import bench_models  # noqa: E402
    import jax  # noqa: E402
    import popart.testing  # noqa: E402
    from jax._src.lib import _profile_data  # noqa: E402

    spec = next(s for s in bench_models.MODELS if s.name == args.model)
    x, y = bench._data(spec)
    with tempfile.TemporaryDirectory() as folder:
        path = bench_models.export(spec, bench_models.build(spec), folder,
                                   training=not args.inference)
        cfg = bench.Config(10 * args.bps, 10 * args.bps, 1, bps=args.bps)
        runner, *_ = (bench.popart_inference(path, x, args.bps, cfg) if args.inference
                      else bench.popart_training(path, x, y, cfg))
        session = runner.session
        runner.loop()
        t0 = time.perf_counter()
        runner.loop()
        step_s = (time.perf_counter() - t0) / (runner.samples / spec.batch)
        print(f"{args.model}: {step_s * 1e3:.2f} ms per step, {spec.batch / step_s:,.0f} samples/s")
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                runner.loop()
            prof = _profile_data.ProfileData.from_file(
                glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    # A step is a micro-batch; the inference program runs a call's batchesPerStep batches as
    # one (vectorised), so its matmuls' shapes, and FLOPs, are per call: per step, 1 / bps.
    report(prof, runner.samples / spec.batch, popart.testing.compiled(session).as_text(),
           1 / args.bps if args.inference else 1.0)


def report(prof, steps: float, hlo: str, flops_per_step: float = 1.0, top: int = 12,
           fastest: bool = False, convs: int = 15, kernels: int = 0) -> None:
    """Print the thread time per step of each kind of kernel in ``prof`` (a ProfileData of
    ``steps`` steps of the program whose compiled HLO is ``hlo``; ``fastest``: see
    ``_kernel_times``), then the ``kernels`` slowest XLA kernels with their fusion's root
    instruction, then each matmul's, then the ``convs`` slowest oneDNN convolutions."""
    per_kernel = _kernel_times(prof, steps, fastest)
    _print_kinds(per_kernel, top)
    if kernels:
        print(f"\nthe {kernels} slowest XLA kernels (us per step, the fusion's root):")
        xla = [(us, n) for n, us in per_kernel.items()
               if not n.startswith(_NOT_KERNELS) and not n.startswith("ffi_call")]
        for us, name in sorted(xla, reverse=True)[:kernels]:
            call = re.search(rf"%{re.escape(name)} = [^\n]*?calls=%?([\w.]+)", hlo)
            m = call and re.search(rf"^%?{re.escape(call.group(1))} .*?ROOT ([^\n]*)", hlo,
                                   re.M | re.S)
            print(f"{us:10.0f}  {name:28s} {m.group(1)[:150] if m else ''}")
    dots = {n: (lhs, rhs, f * flops_per_step) for n, (lhs, rhs, f) in _matmuls(hlo).items()}
    print("\nmatmuls (us per step, GFLOP/s, lhs x rhs):")
    rows = sorted(((per_kernel[n], n, *d) for n, d in dots.items() if n in per_kernel),
                  reverse=True)
    for us, name, lhs, rhs, flops in rows:
        print(f"{us:10.0f} {flops / max(us, 1e-9) / 1e3:7.1f}  {name:16s} {lhs} x {rhs}")
    total_us = sum(r[0] for r in rows)
    total_flops = sum(r[4] for r in rows)
    print(f"{total_us:10.0f} {total_flops / max(total_us, 1e-9) / 1e3:7.1f}  all matmuls "
          f"({total_flops / 1e9:.3f} GFLOP)")
    convolutions(per_kernel, hlo, convs)


if __name__ == "__main__":
    main()
