"""A popart session's reports: getReport's JSON (what XLA knows of the compiled program)
and getSummaryReport's text."""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from . import report


def xla_report(name: str, program: Any, source: Optional[str], replicas: int) -> str:
    """getReport: per device the compiled program's FLOPs, bytes accessed, argument /
    output / temporary / code sizes, and the compile time, as JSON."""
    compiled = program.compiled
    try:
        cost = compiled.cost_analysis() or {}
    except Exception:   # a backend without cost analysis
        cost = {}
    cost = cost[0] if isinstance(cost, list) and cost else cost
    mem = compiled.memory_analysis()
    sizes = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in
             ("argument", "output", "temp", "alias", "generated_code")} if mem is not None else {}
    devices = program.placement.devices or [program.placement.device]
    per_device = {"flops": float(cost.get("flops", 0.0)),
                  "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                  **{f"{k}_bytes": v for k, v in sizes.items()}}
    return json.dumps({"session": name, "compile_seconds": program.compile_seconds,
                       "executable_source": source, "replication_factor": replicas,
                       "devices": [{"device": str(d), "platform": d.platform, **per_device}
                                   for d in devices]})


def summary_report(title: str, device: Any, factors: tuple[int, int, int], ops: int,
                   variables: int, summary: Mapping[str, Any], options: Any,
                   program: Optional[Any]) -> str:
    """getSummaryReport: the session (``title``), its device, (batchesPerStep,
    accumulationFactor, replicationFactor), sizes, timings (``summary``), the options that
    differ from the defaults and what the report switches recorded."""
    bps, A, R = factors
    lines = [title, f"  device: {device!r}",
             f"  batchesPerStep={bps} accumulationFactor={A} replicationFactor={R}",
             f"  ops: {ops}  variables: {variables}"]
    for k, v in summary.items():
        lines.append(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    options_summary = getattr(options, "summary", None)
    if callable(options_summary):
        lines.append(f"  options differing from default: {options_summary()}")
    lines += report.summary_lines(program.step if program else None)
    return "\n".join(lines)
