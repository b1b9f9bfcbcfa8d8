"""GFLOP/s of convolutions per shape: XLA's, popart's lowering, the oneDNN custom call
(``popart.engine.onednn``) and PyTorch (oneDNN) side by side, in one process. ``--set resnet``:
ResNet-18's (CIFAR) convolutions; ``--set grouped``: the depthwise and grouped convolutions of
MobileNetV3-Small, EfficientNet-B0, ConvNeXt-T, RegNetY-400MF and ShuffleNetV2 (224x224 inputs).

    python bench/conv_onednn.py [--threads=N] [--batch 16] [--reps 10] [--grad] [--shapes 0,2]
                                [--set resnet|grouped]

Columns (forward; with ``--grad`` forward + both gradients, counted as 3x the forward's FLOPs):
- ``xla-nhwc``: ``lax.conv_general_dilated`` in NHWC / HWIO (``feature_group_count`` for
  groups), JAX's own gradients;
- ``popart``: popart's CPU lowering before oneDNN (``conv_nc`` with oneDNN off: im2col matmuls
  where the patches fit, else XLA's channels-last convolution with popart's gradients; NCHW in
  / out);
- ``dnnl-nhwc``: the oneDNN custom call on NHWC activations (OIHW weights), no transposes;
- ``dnnl-nchw``: the same on NCHW activations as given (oneDNN's own NCHW kernels);
- ``dnnl-t``: NCHW in / out, XLA transposes to and from NHWC around the NHWC call;
- ``popart+dnnl``: popart's CPU lowering as it is (``conv_nc``: the oneDNN call where
  ``onednn.prefers`` the shape, in the layout ``onednn.channels_last`` picks: ``dnnl-t`` or
  ``dnnl-nchw``);
- ``torch-nchw`` / ``torch-nhwc``: PyTorch eager (oneDNN) contiguous / channels_last.

``--threads=N`` pins the process to N cores and sets ``OMP_NUM_THREADS`` (oneDNN's OpenMP
threads and PyTorch's) and XLA's pool (sized from the affinity mask) to N alike. The columns of a
shape take turns within each repeat (the median of 5): compare within a row.
"""
from __future__ import annotations

import os
import sys

THREADS = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--threads=")),
               os.cpu_count() or 1)
os.environ["OMP_NUM_THREADS"] = str(THREADS)   # before libgomp starts (oneDNN's and torch's)

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conv_options as co  # noqa: E402  (pins the process to THREADS cores on import)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax import lax  # noqa: E402

from popart.engine import onednn  # noqa: E402
from popart.ops import nn  # noqa: E402

# (C_in, C_out, H=W of the input, stride, kernel, groups): ResNet-18 (CIFAR)'s convolutions, one
# per shape; the grouped set: depthwise (groups = C_in) and grouped ones of the zoo's models.
SETS = {"resnet": [(3, 64, 32, 1, 3, 1), (64, 64, 32, 1, 3, 1), (64, 128, 32, 2, 3, 1),
                   (128, 128, 16, 1, 3, 1), (128, 256, 16, 2, 3, 1), (256, 256, 8, 1, 3, 1),
                   (256, 512, 8, 2, 3, 1), (512, 512, 4, 1, 3, 1), (64, 128, 32, 2, 1, 1),
                   (128, 256, 16, 2, 1, 1), (256, 512, 8, 2, 1, 1)],
        "grouped": [(16, 16, 112, 2, 3, 16), (72, 72, 56, 2, 3, 72), (88, 88, 28, 1, 3, 88),
                    (96, 96, 28, 2, 5, 96), (240, 240, 14, 1, 5, 240), (576, 576, 7, 1, 5, 576),
                    (32, 32, 112, 1, 3, 32), (96, 96, 112, 2, 3, 96), (144, 144, 56, 2, 5, 144),
                    (480, 480, 14, 1, 3, 480), (1152, 1152, 7, 1, 5, 1152),
                    (96, 96, 56, 1, 7, 96), (384, 384, 14, 1, 7, 384), (768, 768, 7, 1, 7, 768),
                    (48, 48, 56, 2, 3, 6), (104, 104, 28, 1, 3, 13), (208, 208, 14, 1, 3, 26),
                    (440, 440, 7, 1, 3, 55), (116, 116, 28, 2, 3, 116), (232, 232, 7, 1, 3, 232)]}
COLS = ["xla-nhwc", "popart", "dnnl-nhwc", "dnnl-nchw", "dnnl-t", "popart+dnnl", "torch-nchw",
        "torch-nhwc"]


def flops(cin: int, cout: int, hw: int, stride: int, k: int, g: int, batch: int) -> float:
    out = (hw + 2 * (k // 2) - k) // stride + 1
    return 2.0 * batch * cout * out * out * cin // g * k * k


def runners(cin: int, cout: int, hw: int, s: int, k: int, g: int, batch: int,
            grad: bool) -> dict[str, Callable[[], None]]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, cin, hw, hw), dtype=np.float32)
    w = rng.standard_normal((cout, cin // g, k, k), dtype=np.float32) * 0.05
    p = k // 2
    st, pad, ones = (s, s), ((p, p), (p, p)), (1, 1)
    xc, wc, xh = jnp.asarray(x), jnp.asarray(w), jnp.asarray(x.transpose(0, 2, 3, 1))
    wrap = co.with_grad if grad else (lambda f: f)

    class Ctx:   # the LowerCtx services conv_nc reads (no layout pass: NCHW in and out)
        platform = "cpu"
        training = grad   # the layout a training step's convolution takes (1x1: NCHW)

        def channels_last(self, x, transpose=False):
            return x.transpose(0, 2, 3, 1) if transpose else None

        def keep_channels_last(self, y_nhwc):
            return y_nhwc.transpose(0, 3, 1, 2)

    def popart(x, w):
        with nn.onednn_off():
            return nn.conv_nc(Ctx(), x, w, st, pad, groups=g)

    def popart_dnnl(x, w):
        return nn.conv_nc(Ctx(), x, w, st, pad, groups=g)

    fns: dict[str, tuple[Callable, tuple]] = {
        "xla-nhwc": (lambda x, w: lax.conv_general_dilated(
            x, w, st, pad, dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=g,
            precision=lax.Precision.HIGHEST), (xh, jnp.asarray(w.transpose(2, 3, 1, 0)))),
        "popart": (popart, (xc, wc)),
        "popart+dnnl": (popart_dnnl, (xc, wc)),
        "dnnl-nhwc": (lambda x, w: onednn.conv2d(x, w, st, pad, ones, True, g), (xh, wc)),
        "dnnl-nchw": (lambda x, w: onednn.conv2d(x, w, st, pad, ones, False, g), (xc, wc)),
        "dnnl-t": (lambda x, w: onednn.conv2d(x.transpose(0, 2, 3, 1), w, st, pad, ones,
                                              True, g).transpose(0, 3, 1, 2), (xc, wc)),
    }
    runs = {name: co.compiled(wrap(f), args, None)[0] for name, (f, args) in fns.items()}
    for fmt in ("nchw", "nhwc"):
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        if fmt == "nhwc":
            tx, tw = (t.to(memory_format=torch.channels_last) for t in (tx, tw))
        tx, tw = tx.requires_grad_(grad), tw.requires_grad_(grad)

        def trun(tx=tx, tw=tw) -> None:
            y = torch.nn.functional.conv2d(tx, tw, stride=s, padding=p, groups=g)
            if grad:
                y.backward(torch.ones_like(y))
        trun()
        runs[f"torch-{fmt}"] = trun
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--grad", action="store_true", help="forward + gradients")
    ap.add_argument("--set", default="resnet", choices=sorted(SETS), help="which shapes")
    ap.add_argument("--shapes", default="", help="indices into the set, e.g. 1,3,5 (default all)")
    ap.add_argument("--threads", type=int, default=THREADS, help="give it as --threads=N")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not onednn.available():
        print("the oneDNN custom call is not available (see POPART_LOG_LEVEL=WARN)")
        return 1
    shapes = SETS[args.set]
    shapes = [shapes[int(i)] for i in args.shapes.split(",")] if args.shapes else shapes
    print(f"jax {jax.__version__}, torch {torch.__version__}, {args.threads} thread(s), "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; batch {args.batch}; "
          f"{'forward + gradients' if args.grad else 'forward'}; GFLOP/s, higher is better",
          flush=True)
    print(f"\n| shape (batch {args.batch}) | " + " | ".join(COLS) + " | popart+dnnl / popart |")
    print("|---|" + "---:|" * (len(COLS) + 1))
    for cin, cout, hw, s, k, g in shapes:
        sec = co.timed(runners(cin, cout, hw, s, k, g, args.batch, args.grad), args.reps)
        f = flops(cin, cout, hw, s, k, g, args.batch) * (3 if args.grad else 1)
        cells = [f"{f / sec[c] / 1e9:.1f}" for c in COLS]
        kind = "" if g == 1 else " dw" if g == cin else f" g{g}"
        print(f"| {cin}->{cout} {hw}x{hw} {k}x{k} s{s}{kind} | " + " | ".join(cells) +
              f" | {sec['popart'] / sec['popart+dnnl']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
