"""The ``popart`` command: run an ONNX model, train the digits demo, list devices.

    popart run MODEL.onnx [--batches-per-step N] [--input NAME=FILE.npy ...]
                          [--device cpu|ipumodel:N|gpu] [--output DIR] [--runs N] [--verbose]
    popart demo [--epochs N] [--output DIR]
    popart devices
    popart launch -n N SCRIPT.py [ARGS ...]   (when one process fails, stops the others and
                                               exits with its status; SIGINT / SIGTERM stop
                                               them all: 130 / 143; see docs/multiprocess.md)

Errors print one line, ``popart: error: <message>``, and exit with status 1 (``--verbose``
shows the traceback instead).
"""
from __future__ import annotations

import argparse
import io
import os
import re
import sys
import time
import traceback
from typing import Optional, Sequence

import numpy as np

from .cli_inputs import CliError, device, feed, model_inputs, parse_inputs


def sanitize(name: str) -> str:
    """A tensor name as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "tensor"


def _preview(a: np.ndarray, n: int = 5) -> str:
    flat = np.asarray(a).reshape(-1)[:n]
    more = ", ..." if np.size(a) > n else ""
    return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v)
                           for v in flat.tolist()) + more + "]"


# --------------------------------------------------------------------------------- commands
def cmd_run(args: argparse.Namespace) -> int:
    import popart
    from popart._ir.onnx_import import load_model

    if args.batches_per_step < 1 or args.runs < 1:
        raise CliError("--batches-per-step and --runs must be >= 1")
    model, _ = load_model(args.model)
    inputs = model_inputs(model)
    given = parse_inputs(args.input or [])
    unknown = set(given) - set(inputs)
    if unknown:
        raise CliError(f"--input {sorted(unknown)}: not inputs of the model (its inputs are "
                       f"{sorted(inputs)})")
    bps = args.batches_per_step
    rng = np.random.default_rng(0)
    feeds = {n: feed(n, dt, sh, given.get(n), bps, rng) for n, (dt, sh) in inputs.items()}
    shape_info = popart.InputShapeInfo()
    for n, (dt, sh) in inputs.items():
        if -1 in sh:  # take unknown dims from the given data
            data_shape = list(feeds[n].shape[1:] if bps > 1 else feeds[n].shape)
            shape_info.add(n, popart.TensorInfo(dt, data_shape))
    outputs = [o.name for o in model.graph.output]
    if not outputs:
        raise CliError(f"Model '{args.model}' declares no outputs to anchor")
    flow = popart.DataFlow(bps, {o: popart.AnchorReturnType("ALL") for o in outputs})
    dev = device(args.device)
    session = popart.InferenceSession(args.model, flow, dev, inputShapeInfo=shape_info)
    t0 = time.perf_counter()
    session.prepareDevice()
    compile_s = time.perf_counter() - t0
    anchors = session.initAnchorArrays()
    stepio = popart.PyStepIO(feeds, anchors)
    session.run(stepio)  # the first run also moves the weights; it is not timed
    t0 = time.perf_counter()
    for _ in range(args.runs):
        session.run(stepio)
    run_s = (time.perf_counter() - t0) / args.runs

    print(f"model {args.model}: {len(inputs)} input(s), {len(outputs)} output(s); device "
          f"{dev.type.name} ({dev.numIpus} IPU); batchesPerStep {bps}")
    for n, a in feeds.items():
        print(f"  input  {n}: {a.dtype} {list(a.shape)}")
    for o in outputs:
        a = anchors[o]
        print(f"  output {o}: {a.dtype} {list(a.shape)} {_preview(a)}")
    first = next(iter(inputs), None)
    first_shape = session.getInfo(first).shape() if first else []
    batch = first_shape[0] if first_shape else 1
    print(f"compile time: {compile_s:.3f} s")
    print(f"run time: {1e3 * run_s:.3f} ms per run() of {bps} batch(es) (mean of {args.runs}); "
          f"{bps / run_s:.1f} batches/s, {bps * batch / run_s:.1f} samples/s "
          f"(batch size {batch}: the first input's first dimension)")
    if args.output:
        from popart.fileio import atomic_write
        os.makedirs(args.output, exist_ok=True)
        for o in outputs:
            path = os.path.join(args.output, sanitize(o) + ".npy")
            buf = io.BytesIO()
            np.save(buf, anchors[o])
            atomic_write(path, buf.getvalue())
            print(f"saved {o} to {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from popart.demo import run_demo
    if args.epochs < 1:
        raise CliError("--epochs must be >= 1")
    run_demo(args.epochs, args.output, device=device(args.device),
             progress=not args.no_progress)
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    import jax

    import popart
    dm = popart.DeviceManager()
    print(f"JAX {jax.__version__}, default backend '{jax.default_backend()}'")
    for d in jax.devices():
        print(f"  jax device {d.id}: {d.platform} {d.device_kind}")
    if jax.default_backend() != "cpu":
        print(f"  host CPU devices: {len(jax.devices('cpu'))}")
    print("DeviceManager().enumerateDevices():")
    total = len(jax.devices()) + (len(jax.devices("cpu")) if jax.default_backend() != "cpu" else 0)
    for n in range(1, total + 1):
        for info in dm.enumerateDevices(numIpus=n):
            ids = ", ".join(f"{d.platform}:{d.id}" for d in info.jax_devices)
            print(f"  id {info.id:3d}: {info.numIpus} IPU(s) -> {ids}")
    return 0


# --------------------------------------------------------------------------------- main
def cmd_launch(args: argparse.Namespace) -> int:
    from popart import distributed
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if not os.path.isfile(args.script):
        raise OSError(f"script '{args.script}' does not exist")
    return distributed.launch([args.script, *args.args], args.num_processes, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="popart", description="PopART on XLA: run ONNX models, "
                                "train a demo, list devices.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="compile and run inference on an ONNX model")
    r.add_argument("model", help="path to an .onnx file")
    r.add_argument("--batches-per-step", "-b", type=int, default=1, metavar="N")
    r.add_argument("--input", "-i", action="append", metavar="NAME=FILE.npy",
                   help="data for an input (shape = the tensor's, or [N, *tensor shape]); "
                        "random data for inputs not given")
    r.add_argument("--device", "-d", default="cpu", help="cpu (default), ipumodel:N or gpu")
    r.add_argument("--output", "-o", metavar="DIR", help="save every output as DIR/<name>.npy")
    r.add_argument("--runs", type=int, default=5, help="timed runs after the first (default 5)")
    r.set_defaults(func=cmd_run)

    d = sub.add_parser("demo", help="train a CNN on the 8x8 digits with a TrainingSession")
    d.add_argument("--epochs", "-e", type=int, default=8, help="training epochs (default 8)")
    d.add_argument("--output", "-o", default=".", metavar="DIR",
                   help="where to write digits.onnx (default: the current folder)")
    d.add_argument("--device", "-d", default="cpu", help="cpu (default), ipumodel:N or gpu")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_demo)

    v = sub.add_parser("devices", help="list the devices the DeviceManager sees")
    v.set_defaults(func=cmd_devices)

    la = sub.add_parser("launch", help="run a script as N processes of one distributed job "
                        "(global replication; PopRun-style); when one fails, all are stopped "
                        "and its exit status is returned; SIGINT / SIGTERM stop every process "
                        "(exit 130 / 143); output lines are prefixed by [rank I]")
    la.add_argument("--num-processes", "-n", type=int, required=True, metavar="N")
    la.add_argument("--port", type=int, default=12355, help="coordinator port on 127.0.0.1")
    la.add_argument("script", help="the Python script")
    la.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    la.set_defaults(func=cmd_launch)
    from .report.cli import add_profile_parser   # popart profile MODEL.onnx
    pr = add_profile_parser(sub)
    for s in (r, d, v, la, pr):
        s.add_argument("--verbose", "-v", action="store_true",
                       help="INFO logging and full tracebacks on errors")
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``popart`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed it)
        return int(e.code or 0)
    try:
        if args.verbose:
            import popart
            popart.getLogger().setLevel("INFO")
        return args.func(args)
    except KeyboardInterrupt:
        print("popart: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        popart = sys.modules.get("popart")
        known = (OSError, ValueError) + ((popart.popart_exception,) if popart else ())
        if args.verbose:
            traceback.print_exc()
        if isinstance(e, known):
            print(f"popart: error: {_one_line(e)}", file=sys.stderr)
            return 1
        print(f"popart: error: internal error: {type(e).__name__}: {_one_line(e)} (rerun with "
              f"--verbose for the traceback)", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
