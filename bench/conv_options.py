"""GFLOP/s of ResNet-18's 3x3 convolutions (CIFAR, batch 16) on the CPU, per shape, for each
way of running them that this JAX / XLA offers, beside PyTorch (oneDNN) as the reference.

    python bench/conv_options.py [--batch 16] [--reps 10] [--grad] [--options no-ynn,onednn,...]
                                 [--threads=N] [--resnet]

Columns (forward; with ``--grad`` forward + both gradients, 3x the forward's FLOPs):
- ``xla-nchw``: ``lax.conv_general_dilated`` in NCHW / OIHW (XLA's layout pass picks the
  physical layout and adds the copies);
- ``xla-nhwc``: the same convolution in NHWC / HWIO (no layout copies);
- ``popart``: popart's own CPU lowering with oneDNN off (``popart.ops.nn.conv_nc``: im2col
  matmuls where the patches fit, else channels-last XLA convolutions between explicit
  transposes), NCHW in/out (the oneDNN custom call: ``bench/conv_onednn.py``);
- ``popart-noim2col``: ``conv_nc`` with im2col off (XLA's channels-last convolution between
  explicit transposes, popart's own gradients);
- ``popart-nhwc``: popart's ``conv_last`` on NHWC / HWIO operands, no transposes: what a
  channels-last graph would run;
- ``nhwc+<option>``: ``xla-nhwc`` compiled with one of XLA's CPU options passed per compile
  (``jax.jit(f).lower(...).compile(compiler_options=...)``; no process-wide flag); an option
  this XLA rejects is reported as such, and below the table each option's compiled HLO is
  named by the library fusion / custom call it holds (``ynn``: YNNPACK, XLA's default for
  NHWC convolutions here; ``xnn``, ``onednn``) and compared with the default's;
- ``torch-nchw`` / ``torch-nhwc``: PyTorch eager (oneDNN), contiguous and channels_last.

Every column is timed in the same process, the columns of a shape taking turns within each
repeat (the median of 5), so a busy machine's load hits all of them alike: compare within a
row, not across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
THREADS = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")),
               os.cpu_count() or 1)
if THREADS < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
    # Pin the process to THREADS cores before XLA sizes its thread pool from the mask.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:THREADS])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# (C_in, C_out, H=W of the input, stride): ResNet-18 (CIFAR)'s 3x3 convolutions, one per shape.
SHAPES = [(3, 64, 32, 1), (64, 64, 32, 1), (64, 128, 32, 2), (128, 128, 16, 1),
          (128, 256, 16, 2), (256, 256, 8, 1), (256, 512, 8, 2), (512, 512, 4, 1)]

# Per-compile XLA CPU options tried on the NHWC convolution (name -> compiler_options).
CONV = "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
XLA_OPTIONS: dict[str, dict[str, object]] = {
    "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": f"-{CONV}"},   # Eigen's convolution
    "onednn": {"xla_cpu_use_onednn": True},
    "onednn-cc": {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_custom_call": True},
    "onednn-conv": {"xla_cpu_experimental_onednn_fusion_type": CONV},
    "xnn-conv": {"xla_cpu_experimental_xnn_fusion_type": CONV},
    "fast-math": {"xla_cpu_enable_fast_math": True},
    "thunks-off": {"xla_cpu_use_thunk_runtime": False},
}


def _hlo_key(hlo: str) -> str:
    """The compiled HLO without metadata and source locations: equal keys mean an option
    changed nothing."""
    hlo = re.split(r"\n(?:FileNames|FunctionNames|FileLocations|StackFrames)\b", hlo)[0]
    return re.sub(r", metadata=\{[^}]*\}|, backend_config=.*|, stack_frame_id=\d+", "", hlo)


def library(hlo: str) -> str:
    """The library fusions / custom calls in compiled HLO (ynn_fusion, xnn_fusion, onednn...)."""
    found = set(re.findall(r"%((?:ynn|xnn|onednn)\w*?)_?fusion", hlo))
    found |= set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    return "+".join(sorted(found)) or "none (XLA's own kernel)"


def conv_flops(cin: int, cout: int, hw: int, stride: int, batch: int) -> float:
    out = (hw + 2 - 3) // stride + 1
    return 2.0 * batch * cout * out * out * cin * 9


def xla_conv(layout: str, stride: int) -> Callable:
    dn = ("NCHW", "OIHW", "NCHW") if layout == "nchw" else ("NHWC", "HWIO", "NHWC")
    return lambda x, w: lax.conv_general_dilated(x, w, (stride, stride), ((1, 1), (1, 1)),
                                                 dimension_numbers=dn,
                                                 precision=lax.Precision.HIGHEST)


def popart_conv(stride: int, layout: str = "nchw", patches: bool = True) -> Callable:
    """popart's lowering: ``conv_nc`` (NCHW in / out; im2col where it fits unless not
    ``patches``), or with ``layout`` 'nhwc' its channels-last ``conv_last`` (NHWC / HWIO, its
    own gradient) with no transposes around it."""
    from popart.ops import nn

    class Ctx:   # the one LowerCtx service conv_nc reads
        platform = "cpu"
    s, pad, ones = (stride, stride), ((1, 1), (1, 1)), (1, 1)
    if layout == "nhwc":
        return lambda x, w: nn.conv_last(x, w, s, pad, ones, ones, 1)

    def f(x, w):
        saved = nn.PATCH_BYTES
        nn.PATCH_BYTES = saved if patches else -1
        try:
            with nn.onednn_off():   # XLA's lowering (bench/conv_onednn.py has oneDNN's)
                return nn.conv_nc(Ctx(), x, w, s, pad)
        finally:
            nn.PATCH_BYTES = saved
    return f


def with_grad(f: Callable) -> Callable:
    """Forward + the gradients of x and w (the cotangent all ones)."""
    def g(x, w):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(jnp.ones_like(y)))
    return g


def compiled(f: Callable, args: tuple, options: dict | None) -> tuple[Callable, str]:
    """(callable that blocks until done, compiled HLO text)."""
    c = jax.jit(f).lower(*args).compile(compiler_options=options or None)
    hlo = c.as_text() or ""

    def run() -> None:
        jax.block_until_ready(c(*args))
    run()
    return run, hlo


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


# ------------------------------------------------------------------ whole ResNet-18, raw JAX
def resnet18_step(layout: str, conv: str, batch: int) -> tuple[Callable, tuple]:
    """A raw-JAX ResNet-18 (CIFAR) SGD step (BatchNorm on batch statistics, softmax + NLL):
    ``layout`` 'nchw' (activations channels-first, as the ONNX graph) or 'nhwc' (channels-last
    end to end, one transpose of the input at the edge); ``conv`` 'popart' (popart's
    ``conv_nc`` with oneDNN off: im2col where it fits), 'xla' (``conv_nc`` with im2col off: XLA's
    channels-last convolution between transposes), 'native' (lax.conv in the activations' own
    layout) or 'onednn' (``conv_nc`` as it lowers: the oneDNN custom call)."""
    from popart.ops import nn

    class Ctx:
        platform = "cpu"
    ch = -1 if layout == "nhwc" else 1
    red = (0, 1, 2) if layout == "nhwc" else (0, 2, 3)

    def conv2d(x, w, s):   # w: O,I,kh,kw as in the ONNX file
        k = w.shape[-1]
        pad = ((k // 2, k // 2),) * 2
        if conv == "native":
            dn = ("NHWC", "OIHW", "NHWC") if layout == "nhwc" else ("NCHW", "OIHW", "NCHW")
            return lax.conv_general_dilated(x, w, (s, s), pad, dimension_numbers=dn,
                                            precision=lax.Precision.HIGHEST)
        if conv == "onednn":
            return nn.conv_nc(Ctx(), x, w, (s, s), pad)
        saved = nn.PATCH_BYTES
        nn.PATCH_BYTES = saved if conv == "popart" else -1
        try:
            with nn.onednn_off():
                return nn.conv_nc(Ctx(), x, w, (s, s), pad)
        finally:
            nn.PATCH_BYTES = saved

    def bn(x, g, b):
        m = x.mean(red, keepdims=True)
        v = ((x - m) ** 2).mean(red, keepdims=True)
        shape = [1, 1, 1, 1]
        shape[ch] = -1
        return (x - m) * lax.rsqrt(v + 1e-5) * g.reshape(shape) + b.reshape(shape)

    rng = np.random.default_rng(0)
    params: list = []

    def add(*shape):
        params.append(jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.05))
        return len(params) - 1
    plan = [("stem", add(64, 3, 3, 3), add(64), add(64))]
    cin = 64
    for stage in range(4):
        cout = 64 << stage
        for blk in range(2):
            s = 2 if stage and not blk else 1
            short = (add(cout, cin, 1, 1), add(cout), add(cout)) if s != 1 or cin != cout else None
            plan.append(("block", s, add(cout, cin, 3, 3), add(cout), add(cout),
                         add(cout, cout, 3, 3), add(cout), add(cout), short))
            cin = cout
    fc, fcb = add(cin, 10), add(10)

    def forward(p, x):
        if layout == "nhwc":
            x = x.transpose(0, 2, 3, 1)
        for item in plan:
            if item[0] == "stem":
                x = jax.nn.relu(bn(conv2d(x, p[item[1]], 1), p[item[2]], p[item[3]]))
                continue
            _, s, w1, g1, b1, w2, g2, b2, short = item
            y = jax.nn.relu(bn(conv2d(x, p[w1], s), p[g1], p[b1]))
            y = bn(conv2d(y, p[w2], 1), p[g2], p[b2])
            if short:
                x = bn(conv2d(x, p[short[0]], s), p[short[1]], p[short[2]])
            x = jax.nn.relu(y + x)
        return x.mean(red[1:]) @ p[fc] + p[fcb]

    def step(p, x, y):
        def loss(p):
            logp = jax.nn.log_softmax(forward(p, x))
            return -jnp.take_along_axis(logp, y[:, None], 1).mean()
        val, g = jax.value_and_grad(loss)(p)
        return [a - 0.01 * b for a, b in zip(p, g)], val
    x = jnp.asarray(rng.standard_normal((batch, 3, 32, 32), dtype=np.float32))
    y = jnp.asarray(rng.integers(0, 10, batch).astype(np.int32))
    return step, (params, x, y)


def resnet_main(batch: int, reps: int) -> int:
    """Samples/s of raw-JAX ResNet-18 training steps, layouts and convolutions side by side,
    beside PyTorch eager (contiguous and channels_last)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_models
    runs: dict[str, Callable[[], None]] = {}
    for layout, conv in (("nchw", "popart"), ("nchw", "xla"), ("nchw", "native"),
                         ("nhwc", "native"), ("nchw", "onednn")):
        step, args = resnet18_step(layout, conv, batch)
        c = jax.jit(step, donate_argnums=(0,)).lower(*args).compile()
        state = {"p": args[0]}

        def run(c=c, state=state, args=args) -> None:
            state["p"], loss = c(state["p"], *args[1:])
            loss.block_until_ready()
        run()
        runs[f"jax {layout} conv={conv}"] = run
    import bench
    from popart.ops import nn
    spec = next(m for m in bench_models.MODELS if m.name == "resnet18")
    spec = bench_models.BenchModel(spec.name, spec.make, (batch, 3, 32, 32))
    xs, ys = bench._data(spec)
    with tempfile.TemporaryDirectory() as folder:
        path = bench_models.export(spec, bench_models.build(spec), folder, training=True)
        saved = nn.PATCH_BYTES
        for label, limit, dnnl in (("im2col", saved, False), ("no im2col", -1, False),
                                   ("oneDNN", saved, True)):
            nn.PATCH_BYTES = limit   # read when prepareDevice traces the step
            try:
                with contextlib.nullcontext() if dnnl else nn.onednn_off():
                    cfg = bench.Config(0, 10, 1, bps=10)
                    r = bench.popart_training(path, xs, ys, cfg)[0]
            finally:
                nn.PATCH_BYTES = saved
            runs[f"popart TrainingSession bps=10, {label}"] = r.loop   # 10 steps a call
    for fmt in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        model = bench_models.resnet18().train().to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xt = torch.randn(batch, 3, 32, 32).to(memory_format=fmt)
        yt = torch.randint(0, 10, (batch,))

        def trun(model=model, opt=opt, xt=xt, yt=yt) -> None:
            opt.zero_grad()
            F = torch.nn.functional
            F.nll_loss(F.log_softmax(model(xt), 1), yt).backward()
            opt.step()
        trun()
        runs["torch " + ("nhwc" if fmt == torch.channels_last else "nchw")] = trun
    sec = timed(runs, reps)
    steps = {k: 10 if k.startswith("popart") else 1 for k in runs}   # steps per call
    ref = batch / sec["torch nchw"]
    print(f"\n| ResNet-18 training step, batch {batch} | samples/s | vs torch nchw |\n|---|---:|---:|")
    for k, v in sec.items():
        print(f"| {k} | {batch * steps[k] / v:.1f} | {batch * steps[k] / v / ref:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--grad", action="store_true", help="forward + gradients")
    p.add_argument("--options", default=",".join(XLA_OPTIONS),
                   help="XLA options to try on the NHWC convolution ('' for none)")
    p.add_argument("--shapes", default="", help="indices into SHAPES, e.g. 1,3,5 (default all)")
    p.add_argument("--threads", type=int, default=THREADS,
                   help="cores (and PyTorch threads); give it as --threads=N")
    p.add_argument("--resnet", action="store_true",
                   help="whole ResNet-18 training steps in raw JAX, per layout, vs PyTorch")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.resnet:
        return resnet_main(args.batch, max(1, args.reps // 5))
    options = [o for o in args.options.split(",") if o]
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    print(f"jax {jax.__version__}, torch {torch.__version__} (oneDNN "
          f"{torch.backends.mkldnn.is_available()}), {args.threads} threads; batch {args.batch}; "
          f"{'forward + gradients' if args.grad else 'forward'}; GFLOP/s, higher is better",
          flush=True)
    libs: dict[str, set[str]] = {o: set() for o in options + ["default"]}
    rejected: dict[str, str] = {}
    cols = ["xla-nchw", "xla-nhwc", "popart", "popart-noim2col", "popart-nhwc", *[f"nhwc+{o}" for o in options],
            "torch-nchw", "torch-nhwc"]
    rows = []
    for cin, cout, hw, s in shapes:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.batch, cin, hw, hw), dtype=np.float32)
        w = rng.standard_normal((cout, cin, 3, 3), dtype=np.float32) * 0.05
        xh, wh = jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(w.transpose(2, 3, 1, 0))
        xc, wc = jnp.asarray(x), jnp.asarray(w)
        wrap = with_grad if args.grad else (lambda f: f)
        runs: dict[str, Callable[[], None]] = {
            "xla-nchw": compiled(wrap(xla_conv("nchw", s)), (xc, wc), None)[0]}
        runs["xla-nhwc"], base = compiled(wrap(xla_conv("nhwc", s)), (xh, wh), None)
        libs["default"].add(library(base))
        runs["popart"] = compiled(wrap(popart_conv(s)), (xc, wc), None)[0]
        runs["popart-noim2col"] = compiled(wrap(popart_conv(s, patches=False)), (xc, wc),
                                           None)[0]
        runs["popart-nhwc"] = compiled(wrap(popart_conv(s, "nhwc")), (xh, wh), None)[0]
        for o in options:
            if o in rejected:
                continue
            try:
                runs[f"nhwc+{o}"], hlo = compiled(wrap(xla_conv("nhwc", s)), (xh, wh),
                                                  XLA_OPTIONS[o])
                libs[o].add(library(hlo) + ("" if _hlo_key(hlo) != _hlo_key(base) else
                                            " (HLO identical to the default's)"))
            except Exception as e:  # an option this XLA does not know or cannot apply
                rejected[o] = (str(e).strip().splitlines() or [""])[0][:160]
        for fmt in ("nchw", "nhwc"):
            tx = torch.from_numpy(x).requires_grad_(args.grad)
            tw = torch.from_numpy(w).requires_grad_(args.grad)
            if fmt == "nhwc":
                tx = tx.detach().to(memory_format=torch.channels_last).requires_grad_(args.grad)
                tw = tw.detach().to(memory_format=torch.channels_last).requires_grad_(args.grad)

            def trun(tx=tx, tw=tw) -> None:
                y = torch.nn.functional.conv2d(tx, tw, stride=s, padding=1)
                if args.grad:
                    y.backward(torch.ones_like(y))
            trun()
            runs[f"torch-{fmt}"] = trun
        sec = timed(runs, args.reps)
        flops = conv_flops(cin, cout, hw, s, args.batch) * (3 if args.grad else 1)
        rows.append([f"{cin}->{cout} {hw}x{hw} s{s}"] +
                    [f"{flops / sec[c] / 1e9:.0f}" if c in sec else "-" for c in cols])
        print(f"  {rows[-1][0]} done", file=sys.stderr, flush=True)
    keep = [0] + [i + 1 for i, c in enumerate(cols) if c.split("+")[-1] not in rejected]
    print("\n| shape (3x3, batch %d) | " % args.batch +
          " | ".join(cols[i - 1] for i in keep[1:]) + " |")
    print("|---|" + "---:|" * (len(keep) - 1))
    for r in rows:
        print("| " + " | ".join(r[i] for i in keep) + " |")
    print()
    print(f"- xla-nhwc (default options): {', '.join(sorted(libs['default']))}")
    for o in options:
        state = (f"rejected: {rejected[o]}" if o in rejected else
                 f"accepted; {', '.join(sorted(libs[o]))}")
        print(f"- nhwc+{o} = {XLA_OPTIONS[o]}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
