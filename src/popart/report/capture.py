"""Capture: what a compiled step costs, where its memory and time go, per ONNX node.

A :class:`Recorder` exists only while a report is switched on (``autoReport.*``, see
``switches.report_settings``). At compile time it keeps XLA's cost and memory analysis (with
the peak), the compile phases and XLA's buffer assignment for this executable (dumped by
per-compile options into the report folder); at run time it takes ``jax.profiler`` traces of a
window of runs, one step annotation per run, and joins the trace's events to the instructions
that name the model's nodes. Nothing here runs when no report is on."""
from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Optional

import jax

from .._ir.graph import Graph
from ..logging import getLogger
from . import hlo

_logger = getLogger("session")
STEP_EVENT = "popart.run"       # the step annotation of one run() in the trace
SCHEMA = "popart-xla.report/1"
_current: contextvars.ContextVar = contextvars.ContextVar("popart_report", default=None)
_LOCK = threading.RLock()
_active: Optional["Recorder"] = None   # the recorder whose trace is running (one per process)
_used_dirs: set[str] = set()


def current() -> Optional["Recorder"]:
    """The recorder of the compile in progress (set by :func:`scope`), or None."""
    return _current.get()


@contextlib.contextmanager
def scope(recorder: Optional["Recorder"]) -> Iterator[Optional["Recorder"]]:
    """Make ``recorder`` the one that a compile in this block reports to."""
    token = _current.set(recorder)
    try:
        yield recorder
    finally:
        _current.reset(token)


def _mem_dict(mem: Any) -> dict:
    if mem is None:
        return {}
    get = lambda k: int(getattr(mem, k, 0) or 0)
    d = {k: get(f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias", "generated_code")}
    peak = getattr(mem, "peak_memory_in_bytes", None)   # jax >= 0.7; before: XLA's own sum
    d["peak"] = int(peak) if peak is not None else d["argument"] + d["output"] + d["temp"] - d["alias"]
    return {f"{k}_bytes": v for k, v in d.items()}


def _cost_dict(compiled: Any) -> dict:
    try:
        cost = compiled.cost_analysis() or {}
    except Exception:   # a backend without cost analysis
        cost = {}
    cost = cost[0] if isinstance(cost, list) and cost else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def memory_summary(compiled: Any) -> dict:
    """XLA's memory analysis of ``compiled`` in bytes: peak, argument, output, temp, alias,
    generated code."""
    try:
        return _mem_dict(compiled.memory_analysis())
    except Exception:
        return {}


class Recorder:
    """The report of one session's compiled step, written into ``directory``."""

    def __init__(self, directory: str, session: str, graph: Optional[Graph], window: int = 2,
                 samples_per_run: int = 1, kind: str = "") -> None:
        self.directory = _own_directory(os.path.abspath(directory or "."), session)
        self.session, self.kind, self.window = session, kind, max(int(window), 0)
        self.samples_per_run = max(int(samples_per_run), 1)
        self.nodes = hlo.graph_nodes(graph) if graph is not None else {}
        self.node_map = hlo.NodeMap(self.nodes)
        self.phases: dict[str, float] = {}
        self.program: dict = {}
        self.memory: dict = {}
        self.time: dict = {}
        self.runs: collections.deque = collections.deque(maxlen=1000)
        self.n_runs = 0
        self._instr: dict = {}
        self._params: set = set()
        self._dump = ""
        self._module = ""
        self._events: list = []
        self._trace_dir: Optional[str] = None
        self._tracing = False
        self._progress: Optional[Callable[[str], None]] = None
        os.makedirs(self.directory, exist_ok=True)

    # ------------------------------------------------------------------ compile
    def compiler_options(self) -> dict:
        """Per-compile XLA options: dump this executable's buffer assignment (live ranges)
        into ``<directory>/xla`` (no process-wide flag is set)."""
        self._dump = os.path.join(self.directory, "xla_buffer_assignment")
        for f in glob.glob(os.path.join(self._dump, "module_*")):   # an earlier compile's
            with contextlib.suppress(OSError):
                os.remove(f)
        return {"xla_dump_to": self._dump, "xla_dump_hlo_as_text": True,
                "xla_dump_hlo_pass_re": "", "xla_dump_hlo_module_re": ""}

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + float(seconds)

    def compiled(self, compiled: Any, source: str = "") -> None:
        """Record what XLA says of the compiled executable and write the report."""
        text = compiled.as_text() or ""
        self._module, instrs, comps = hlo.parse_hlo(text)
        self._instr = hlo.instruction_nodes(instrs, comps, self.node_map)
        self._params = {k for k, v in instrs.items() if v.opcode == "parameter"}
        dev = getattr(compiled, "input_shardings", None)
        try:
            devices = sorted({str(d) for d in jax.tree_util.tree_leaves(
                [getattr(s, "device_set", set()) for s in jax.tree_util.tree_leaves(dev)])})
        except Exception:
            devices = []
        self.program = {"session": self.session, "kind": self.kind, "module": self._module,
                        "platform": jax.default_backend(), "devices": devices,
                        "nodes": len(self.nodes), "instructions": len(instrs),
                        "samples_per_run": self.samples_per_run, **_cost_dict(compiled)}
        self.memory = memory_summary(compiled)
        self.memory["live_at_peak"] = live = self._live_at_peak()
        # the buffer assignment's own peak (its heap simulation): XLA's CPU client reports a
        # peak_memory_in_bytes that leaves temporaries out
        self.memory["live_peak_bytes"] = sum(b["bytes"] for b in live) if live else None
        for f in glob.glob(os.path.join(self._dump, "module_*")) if self._dump else ():   # keep the buffer assignment
            if not f.endswith(("live-range.txt", "buffer-assignment.txt", "memory-usage-report.txt",
                               "after_optimizations.txt")):
                with contextlib.suppress(OSError):
                    os.remove(f)
        by_node: dict[str, int] = collections.Counter()
        for b in self.memory["live_at_peak"]:
            by_node[b["node"]] += b["bytes"]
        self.memory["by_node"] = [{"node": k, "bytes": v} for k, v in by_node.most_common()]
        self.write()

    def _live_at_peak(self) -> list[dict]:
        files = sorted(glob.glob(os.path.join(self._dump, "module_*live-range.txt")) if self._dump else [],
                       key=os.path.getmtime)
        if not files:
            return []
        with open(files[-1]) as f:
            rows = hlo.live_at_peak(f.read())
        out = []
        for name, size in rows:
            nodes, direction, op_name = self._instr.get(name, ((), "", ""))
            label = " + ".join(nodes) if nodes else (f"(argument {op_name})" if name in self._params
                                                     else "(other)")
            out.append({"buffer": name, "bytes": size, "node": label, "pass": direction,
                        "op_type": self.nodes.get(nodes[0], "") if len(nodes) == 1 else "",
                        "op_name": op_name})
        return out

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable, *args: Any) -> Any:
        """One run of the step under the profiler (the first ``window`` runs are traced)."""
        if self.n_runs == 0 and self.window:
            self._start_trace()
        t0 = time.perf_counter()
        with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=self.n_runs):
            out = fn(*args)
            with jax.profiler.TraceAnnotation("popart.wait"):
                jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        self.n_runs += 1
        self.runs.append({"run": self.n_runs, "seconds": dt, "samples": self.samples_per_run,
                          "samples_per_second": self.samples_per_run / dt if dt > 0 else 0.0,
                          "traced": self._tracing})
        if self.n_runs == self.window:
            self.finish()
        return out

    def _start_trace(self) -> None:
        global _active
        with _LOCK:
            if _active is not None and _active is not self:
                _active.finish()   # one trace at a time: an earlier session's window ends here
        self._trace_dir = tempfile.mkdtemp(prefix="popart-trace-")
        kw = {}
        opts_cls = getattr(jax.profiler, "ProfileOptions", None)
        if opts_cls is not None:   # no Python call tracing: the step's own events only
            opts = opts_cls()
            opts.python_tracer_level = 0
            kw["profiler_options"] = opts
        try:
            jax.profiler.start_trace(self._trace_dir, **kw)
            self._tracing = True
            _active = self
        except Exception as e:   # e.g. a trace started by the user
            _logger.warn(f"Report of '{self.session}': cannot start a profiler trace ({e})")

    def finish(self) -> None:
        """Stop the trace (if one is running), join it and write the report."""
        if not self._tracing:
            if self.n_runs:
                self.write()
            return
        global _active
        self._tracing = False
        with _LOCK:
            _active = None
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(self._trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
        events = []
        if files:
            with gzip.open(files[0]) as f:
                events = json.load(f).get("traceEvents", [])
        shutil.rmtree(self._trace_dir, ignore_errors=True)
        self._events = self._clean_events(events)
        self.time = self._join(self._events)
        self.write()

    def _clean_events(self, events: list) -> list:
        """The trace in Chrome's format with node names: every event has ph, ts, pid, tid;
        an instruction's event is named after its node(s), with the instruction in args."""
        out = []
        for e in events:
            ph = e.get("ph")
            name = e.get("name", "")
            if not ph or name.startswith(("end: ", "ThreadpoolListener::")):
                continue
            e = {"ts": 0, "pid": 0, "tid": 0, **e}
            args = e.get("args") or {}
            op = args.get("hlo_op")
            if op in self._instr:
                nodes, direction, op_name = self._instr[op]
                if nodes:
                    e["name"] = " + ".join(nodes) + (" (backward)" if direction == "backward" else "")
                    e["args"] = {**args, "nodes": list(nodes), "pass": direction, "op_name": op_name}
            out.append(e)
        return out

    def _join(self, events: list) -> dict:
        """Time per node, per op type and per multi-node fusion, from the trace's events."""
        per_node: dict = {n: {"node": n, "op_type": t, "us": 0.0, "forward_us": 0.0,
                              "backward_us": 0.0, "fused_us": 0.0, "events": 0}
                    for n, t in self.nodes.items()}
        groups: dict = {}
        other = collections.Counter()
        total = 0.0
        for op, dur in hlo.event_rows(events, self._module):
            if op not in self._instr:
                continue
            if any(op.startswith(c) for c in ("while", "conditional", "call")) and \
                    not self._instr[op][0]:
                continue   # control flow: its body's instructions are counted
            nodes, direction, op_name = self._instr[op]
            total += dur
            if len(nodes) == 1:
                row = per_node[nodes[0]]
                row["us"] += dur
                row[f"{direction}_us"] += dur
                row["events"] += 1
            elif nodes:
                g = groups.setdefault(" + ".join(nodes), {"nodes": list(nodes), "instructions": set(),
                                                          "us": 0.0, "events": 0})
                g["instructions"].add(op)
                for n in nodes:   # shown beside each of its nodes, counted once (in the group)
                    per_node[n]["fused_us"] += dur
                g["us"] += dur
                g["events"] += 1
            else:
                other[op_name.rsplit("/", 1)[-1] or op] += dur
        runs = sum(1 for e in events if e.get("name") == STEP_EVENT) or 1
        by_type: dict = {}
        for row in per_node.values():
            t = by_type.setdefault(row["op_type"], {"op_type": row["op_type"], "us": 0.0, "nodes": 0})
            t["us"] += row["us"]
            t["nodes"] += 1
        fusions = [{**g, "instructions": sorted(g["instructions"])} for g in groups.values()]
        for rows in (per_node.values(), by_type.values(), fusions):
            for r in rows:
                r["us_per_run"] = r["us"] / runs
                r["share"] = r["us"] / total if total else 0.0
        key = lambda r: -r["us"]
        return {"runs_traced": runs, "total_us": total,
                "per_node": sorted(per_node.values(), key=key),
                "per_op_type": sorted(by_type.values(), key=key),
                "fusions": sorted(fusions, key=key),
                "unattributed": [{"op": k, "us": v} for k, v in other.most_common()]}

    # ------------------------------------------------------------------ outputs
    def data(self) -> dict:
        """The report as JSON-able data (``report.json``'s contents)."""
        recent = list(self.runs)[-10:]
        secs = sum(r["seconds"] for r in recent)
        return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "program": self.program,
                "compile": {"phases": dict(self.phases), "total_seconds": sum(self.phases.values())},
                "memory": self.memory, "time": self.time,
                "runs": list(self.runs),
                "throughput": {"runs": len(recent), "seconds": secs,
                               "samples_per_second": sum(r["samples"] for r in recent) / secs if secs else 0.0}}

    def write(self) -> None:
        from .html import render
        data = self.data()
        with open(os.path.join(self.directory, "report.json"), "w") as f:
            json.dump(data, f, indent=1)
        if self._events:
            with gzip.open(os.path.join(self.directory, "trace.json.gz"), "wt") as f:
                json.dump({"displayTimeUnit": "ns", "traceEvents": self._events}, f)
        with open(os.path.join(self.directory, "report.html"), "w") as f:
            f.write(render(data))

    def summary_lines(self) -> list[str]:
        """getSummaryReport's lines: memory, compile phases, throughput, top ops."""
        d = self.data()
        m = d["memory"]
        lines = [f"  report: {self.directory}"]
        if m:
            lines.append("  memory (bytes): " + ", ".join(
                f"{k[:-6]}={m[k]}" for k in ("peak_bytes", "live_peak_bytes", "argument_bytes",
                                             "output_bytes", "temp_bytes") if m.get(k) is not None))
        if d["compile"]["phases"]:
            lines.append("  compile phases (s): " + ", ".join(f"{k}={v:.3f}" for k, v in d["compile"]["phases"].items()))
        if d["runs"]:
            t = d["throughput"]
            lines.append(f"  recent throughput: {t['samples_per_second']:.1f} samples/s over {t['runs']} run(s)")
        top = [r for r in (d["time"] or {}).get("per_node", []) if r["us"] > 0][:5]
        if top:
            lines.append("  top ops (us per run): " + ", ".join(
                f"{r['node']} [{r['op_type']}] {r['us_per_run']:.1f}" for r in top))
        return lines


def _own_directory(directory: str, session: str) -> str:
    """``directory``, or for a later session of this process that names the same folder,
    ``directory/<session>`` (``-2``, ``-3``, ... if needed), so that reports do not overwrite
    each other."""
    with _LOCK:
        out, n = directory, 1
        while out in _used_dirs:
            n += 1
            base = re.sub(r"[^A-Za-z0-9_.-]", "_", session).strip(".") or "session"
            out = os.path.join(directory, base if n == 2 else f"{base}-{n - 1}")
        if out != directory:
            _logger.info(f"Report of '{session}': '{directory}' holds another session's report; "
                         f"writing into '{out}'")
        _used_dirs.add(out)
        return out


@atexit.register
def _finish_active() -> None:
    """A session whose window of runs was not complete: its trace ends at exit."""
    if _active is not None:
        with contextlib.suppress(Exception):
            _active.finish()
