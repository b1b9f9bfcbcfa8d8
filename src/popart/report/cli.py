"""``popart profile MODEL.onnx [--runs N] [--out DIR]``: compile an ONNX model for inference,
run it N times under the profiler (random data for inputs not given) and write report.json,
trace.json.gz and report.html into DIR."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_profile_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``profile`` on the ``popart`` command's subparsers."""
    p = sub.add_parser("profile", help="profile an ONNX model: time and memory per node "
                       "(report.json, trace.json.gz, report.html)")
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--runs", type=int, default=5, help="traced runs (default 5)")
    p.add_argument("--out", "-o", default="popart_report", metavar="DIR",
                   help="where to write the report (default ./popart_report)")
    p.add_argument("--input", "-i", action="append", metavar="NAME=FILE.npy",
                   help="data for an input; random data for inputs not given")
    p.add_argument("--device", "-d", default="cpu", help="cpu (default), ipumodel:N or gpu")
    p.add_argument("--top", type=int, default=10, help="nodes listed (default 10)")
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    import numpy as np
    import onnx

    import popart
    from popart.cli_inputs import CliError, device, feed, model_inputs, parse_inputs

    if args.runs < 1:
        raise CliError(f"--runs must be at least 1, got {args.runs}")
    if not os.path.exists(args.model):
        raise CliError(f"model file '{args.model}' does not exist")
    model = onnx.load(args.model, load_external_data=False)
    given = parse_inputs(args.input or [])
    rng = np.random.default_rng(0)
    feeds = {n: feed(n, dt, shape, given.get(n), 1, rng) for n, (dt, shape) in model_inputs(model).items()}
    outputs = [o.name for o in model.graph.output]
    if not outputs:
        raise CliError(f"'{args.model}' has no graph outputs to anchor")
    opts = popart.SessionOptions()
    opts.engineOptions = {"autoReport.all": "true", "autoReport.directory": args.out,
                          "autoReport.executionProfileProgramRunCount": str(args.runs)}
    session = popart.InferenceSession(args.model, popart.DataFlow(1, outputs), device(args.device),
                                      userOptions=opts)
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    for _ in range(args.runs):
        session.run(popart.PyStepIO(feeds, anchors))
    with open(os.path.join(args.out, "report.json")) as f:
        data = json.load(f)
    t, m = data["time"], data["memory"]
    runs = max(t.get("runs_traced", 1), 1)
    print(f"{args.model}: {data['program']['nodes']} nodes, peak memory {m.get('peak_bytes', 0)} bytes, "
          f"{t.get('total_us', 0.0) / runs:.1f} us per run traced over {runs} run(s)")
    print(f"{'node':40s} {'op type':16s} {'us/run':>10s} {'share':>7s}")
    for r in [r for r in t.get("per_node", []) if r["us"] > 0][:args.top]:
        print(f"{r['node'][:40]:40s} {r['op_type'][:16]:16s} {r['us_per_run']:10.2f} {100 * r['share']:6.1f}%")
    for g in t.get("fusions", [])[:args.top]:
        print(f"{' + '.join(g['nodes'])[:40]:40s} {'(fusion)':16s} {g['us_per_run']:10.2f} {100 * g['share']:6.1f}%")
    print("wrote " + ", ".join(os.path.join(args.out, f) for f in ("report.json", "trace.json.gz", "report.html")))
    return 0
