"""Run ONNX's node conformance cases through popart's ONNX backend and print pass counts.

    PYTHONPATH=src python tools/conformance.py [--filter SUBSTR] [--write-expected FILE] [-v]

Rows: the case model's ai.onnx opset range; "tensor, opset<=18" counts the cases whose graph
inputs and outputs are all tensors (no sequences / optionals) with opset <= 18.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from popart.onnx_backend import case_is_tensor_typed, case_opset, check_case, node_cases  # noqa: E402

RANGES = [("opset <= 11", 0, 11), ("opset 12-13", 12, 13), ("opset 14-18", 14, 18),
          ("opset >= 19", 19, 10 ** 9)]


def reason(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--filter", default="", help="only cases whose name contains this")
    ap.add_argument("--write-expected", metavar="FILE", help="write failing cases with reasons")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    ap.add_argument("--compare-onnxruntime", action="store_true",
                    help="also run every case through onnxruntime and print its counts")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cases = [c for c in node_cases() if args.filter in c.name]
    results, t0 = {}, time.time()
    for c in cases:
        try:
            check_case(c)
            results[c.name] = None
        except Exception as e:  # noqa: BLE001 - every failure is a result here
            results[c.name] = reason(e)
            if args.verbose:
                print(f"FAIL {c.name}: {results[c.name]}", flush=True)
    ort = {}
    if args.compare_onnxruntime:
        for c in cases:
            try:
                check_case(c, runtime="onnxruntime")
                ort[c.name] = True
            except Exception:  # noqa: BLE001
                ort[c.name] = False
    rows = [(label, [c for c in cases if lo <= case_opset(c) <= hi]) for label, lo, hi in RANGES]
    rows.append(("tensor, opset <= 18", [c for c in cases if case_opset(c) <= 18
                                          and case_is_tensor_typed(c)]))
    rows.append(("overall", cases))
    extra = f"{'onnxruntime':>13}" if ort else ""
    print(f"\n{'cases':<22}{'passed':>8}{'total':>8}{'rate':>8}{extra}")
    for label, cs in rows:
        ok = sum(results[c.name] is None for c in cs)
        col = f"{sum(ort[c.name] for c in cs):>13}" if ort else ""
        print(f"{label:<22}{ok:>8}{len(cs):>8}{(ok / len(cs) if cs else 0):>8.1%}{col}")
    print(f"({time.time() - t0:.0f} s)")
    if args.write_expected:
        kept = _by_design(args.write_expected)
        with open(args.write_expected, "w") as f:
            f.write("# ONNX node conformance cases this runtime does not pass yet: name | reason.\n"
                    "# Regenerate: PYTHONPATH=src python tools/conformance.py --write-expected "
                    "tests/onnx_node_expected_failures.txt\n")
            for name, r in sorted(results.items()):
                if r is not None:
                    f.write(f"{name} | {kept.get(name, r)}\n")
    return 0


def _by_design(path: str) -> dict:
    """Reasons written by hand ("by design: ...") in an existing list: a rewrite keeps them."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [line.split("|", 1) for line in f if "|" in line and not line.startswith("#")]
    return {n.strip(): r.strip() for n, r in rows if r.strip().startswith("by design")}


if __name__ == "__main__":
    sys.exit(main())
