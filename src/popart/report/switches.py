"""PopART's switches for reports, read from a session's options and the environment.

- ``engineOptions`` / ``POPLAR_ENGINE_OPTIONS`` (JSON, which wins): ``autoReport.all`` (or any
  ``autoReport.output*``) "true" turns capture on into ``autoReport.directory`` (default ".");
  ``autoReport.executionProfileProgramRunCount`` runs are traced (Poplar's default, 2).
- ``SessionOptions.dotChecks`` / ``POPART_DOT_CHECKS`` ("FWD0:FINAL", "ALL"): DOT files of the
  IR at PopART's check points, ``<logDir>/<Check>_r.dot`` (``_all`` when
  ``separateCallOpPdfs`` is off), ops ``firstDotOp`` .. ``finalDotOp``.
- ``POPART_IR_DUMP=FILE``: ``_serializeIr``'s JSON, written when the session is built.
- ``compilationProgressLogger(progress, total)``: PopART's milestones (0 at construction, 3
  compile start, 4..6 planning, 7..40 lowering, 41.. the backend compile, total at the end).
- IPU-only instrumentation options log one warning each.

With none of them on, :func:`compiling` registers no hooks (``engine.hooks.current`` is None) and
the engine does nothing more."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator, Mapping, Optional

from ..errors import popart_exception
from .._ir.graph import Graph
from ..engine.hooks import compile_hooks
from ..logging import getLogger

_logger = getLogger("session")
CHECKS = ("Fwd0", "Fwd1", "Bwd0", "Final")   # PopART's check points that exist here
_TRUE = ("true", "1", "yes", "on")
_IPU_ONLY = {"instrumentWithHardwareCycleCounter": False}   # (hardwareInstrumentations only with it)
_warned: set = set()


def engine_options(options: Any) -> dict[str, str]:
    """The session's engineOptions with POPLAR_ENGINE_OPTIONS (a JSON object) over them."""
    opts = {str(k): str(v) for k, v in dict(getattr(options, "engineOptions", None) or {}).items()}
    env = os.environ.get("POPLAR_ENGINE_OPTIONS", "").strip()
    if env:
        try:
            extra = json.loads(env)
        except ValueError as e:
            raise popart_exception(f"POPLAR_ENGINE_OPTIONS is not a JSON object ({e}): {env!r}") from None
        if not isinstance(extra, dict):
            raise popart_exception(f"POPLAR_ENGINE_OPTIONS must be a JSON object, got {env!r}")
        opts.update({str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in extra.items()})
    return opts


def report_settings(options: Any) -> Optional[dict]:
    """{"directory", "window"} when a report is switched on, else None."""
    opts = engine_options(options)
    on = any(v.lower() in _TRUE for k, v in opts.items()
             if k == "autoReport.all" or k.startswith("autoReport.output"))
    if not on:
        return None
    try:
        window = int(opts.get("autoReport.executionProfileProgramRunCount", "2"))
    except ValueError:
        raise popart_exception("engine option autoReport.executionProfileProgramRunCount must be "
                               f"an integer, got {opts['autoReport.executionProfileProgramRunCount']!r}") from None
    return {"directory": opts.get("autoReport.directory") or ".", "window": window}


class Progress:
    """``compilationProgressLogger`` called at PopART's milestones, never decreasing."""

    def __init__(self, logger: Callable[[int, int], Any], total: int) -> None:
        self.logger, self.total, self.last = logger, max(int(total), 1), -1

    def at(self, value: int) -> None:
        v = min(int(value), self.total if value >= self.total else self.total - 1)
        if v > self.last:
            self.last = v
            self.logger(v, self.total)

    def complete(self) -> None:
        self.at(self.total)


def progress(options: Any) -> Optional[Progress]:
    cb = getattr(options, "compilationProgressLogger", None)
    return Progress(cb, getattr(options, "compilationProgressTotal", 100)) if callable(cb) else None


def warn_ipu_only(options: Any) -> None:
    """One warning per IPU-only instrumentation option that is set (per process)."""
    for k, default in _IPU_ONLY.items():
        if getattr(options, k, default) != default and k not in _warned:
            _warned.add(k)
            _logger.warn(f"SessionOptions.{k} instruments IPU hardware cycles; it does nothing "
                         f"on XLA devices (use autoReport.all for time per op)")


# ---------------------------------------------------------------------------- DOT files
def dot_checks(options: Any) -> set[str]:
    checks = {str(c).upper() for c in (getattr(options, "dotChecks", None) or ())}
    checks |= {c.upper() for c in os.environ.get("POPART_DOT_CHECKS", "").split(":") if c}
    return checks


def _dot(graph: Graph, options: Any, backward_of: Optional[Graph] = None) -> str:
    nodes = list(graph.nodes)
    ops = [(n.op_type, list(n.inputs), list(n.outputs), n.name) for n in nodes]
    if backward_of is not None:   # the gradient of each op, as PopART's grad ops read them
        g = lambda t: f"Gradient___{t}" if t else ""
        ops += [(f"{t}Grad", [g(o) for o in outs if o] + [i for i in ins if i], [g(i) for i in ins if i], "")
                for t, ins, outs, _ in reversed(ops)]
    start = max(0, int(getattr(options, "firstDotOp", 0)))
    end = min(int(getattr(options, "finalDotOp", 10000)), len(ops))
    if not start < end and ops:
        raise popart_exception(f"Invalid dot range ({start}, {end}) with schedule of size {len(ops)}, "
                               f"as no Ops will be exported to the .dot file")
    colour = {**{t: "red" for t in graph.inputs}, **{t: "blue" for t in graph.initializers},
              **{t: "gold" for t in getattr(graph, "constants", ())}}
    lines, seen = ["digraph net {", 'size="6,6";'], set()
    names = bool(getattr(options, "dotOpNames", False))
    for i in range(start, end):
        op_type, ins, outs, name = ops[i]
        label = f"{i}. {op_type} ({i})" + (f" ({i}:{name})" if names and name else "")
        lines.append(f'"n_{i}" [shape= "box", label="{label}", color = black];')
        for t in ins + outs:
            if t and t not in seen:
                seen.add(t)
                lines.append(f'"{t}" [color={colour.get(t, "black")}];')
        lines += [f'"{t}" -> "n_{i}";' for t in ins if t]
        lines += [f'"n_{i}" -> "{t}";' for t in outs if t]
    return "\n".join(lines + ["}", ""])


def write_dots(options: Any, graph: Graph, checks: tuple, training: bool = False) -> list[str]:
    """Write the DOT files of ``checks`` that ``dotChecks`` / POPART_DOT_CHECKS ask for."""
    wanted = dot_checks(options)
    if not wanted:
        return []
    folder = getattr(options, "logDir", "") or "."
    suffix = "r" if getattr(options, "separateCallOpPdfs", True) else "all"
    os.makedirs(folder, exist_ok=True)
    written = []
    for check in checks:
        if "ALL" not in wanted and check.upper() not in wanted:
            continue
        if check == "Bwd0" and not training:
            continue
        path = os.path.join(folder, f"{check}_{suffix}.dot")
        with open(path, "w") as f:
            f.write(_dot(graph, options, backward_of=graph if check == "Bwd0" else None))
        _logger.info(f"Wrote dot file {path}")
        written.append(path)
    return written


def dump_ir(serialize: Callable[[], str]) -> Optional[str]:
    """POPART_IR_DUMP=FILE: write the IR's JSON there."""
    dest = os.environ.get("POPART_IR_DUMP")
    if not dest:
        return None
    _logger.info(f"Writing ir to {dest}")
    try:
        with open(dest, "w") as f:
            f.write(serialize())
    except OSError as e:
        _logger.error(f"Failed to open file {dest} to dump ir. ({e})")
        return None
    return dest


# ---------------------------------------------------------------------------- compile hooks
class CompileHooks:
    """The engine's compile hooks (``engine.hooks.CompileHooks``) of a :func:`compiling`
    block: the progress logger and the report's recorder (either may be None)."""
    _MILESTONES = {"start": 3, "plan": 4, "lower": 7, "compile": 41}

    def __init__(self, progress: Optional[Progress], recorder: Any) -> None:
        self.progress, self.recorder = progress, recorder

    def at(self, milestone: str) -> None:
        if self.progress is not None:
            self.progress.at(self._MILESTONES[milestone])

    def compiler_options(self) -> Optional[dict]:
        return self.recorder.compiler_options() if self.recorder is not None else None

    def compiled(self, step: Any) -> Any:
        """The step is compiled: record it; returns the recorder its runs go through."""
        if self.recorder is not None:
            for k, v in getattr(step, "compile_phases", {}).items():
                self.recorder.phase(k, v)
            self.recorder.compiled(step.compiled)
        if self.progress is not None:
            self.progress.at(40)
        return self.recorder


@contextlib.contextmanager
def compiling(options: Any, name: str, graph: Optional[Graph], samples_per_run: int = 1,
              kind: str = "") -> Iterator[Optional[CompileHooks]]:
    """The block in which a session compiles its step, with its switches applied."""
    settings = report_settings(options)
    prog = progress(options)
    if settings is None and prog is None:
        yield None
        return
    recorder = None
    if settings is not None:
        from .capture import Recorder
        recorder = Recorder(settings["directory"], name, graph, window=settings["window"],
                            samples_per_run=samples_per_run, kind=kind)
    hooks = CompileHooks(prog, recorder)
    hooks.at("start")
    with compile_hooks(hooks):   # registered with the engine for the block
        yield hooks
    if prog is not None:
        prog.complete()


def recorder_of(step: Any) -> Any:
    return getattr(step, "recorder", None)


# ---------------------------------------------------------------------------- session hooks
def samples_per_run(input_infos: Mapping[str, Any], factors: tuple[int, ...]) -> int:
    """The samples a run of a popart session takes: its first input's batch dimension times
    its (batchesPerStep, accumulationFactor, replicationFactor)."""
    infos = list(input_infos.values())
    micro = infos[0].shape()[0] if infos and infos[0].shape() else 1
    n = max(micro, 1)
    for f in factors:
        n *= int(f)
    return int(n)


def built(options: Any, graph: Graph, checks: tuple,
          serialize: Callable[[], str]) -> Optional[Progress]:
    """A session is built: progress 0, warnings, the IR's DOT files at ``checks`` and
    POPART_IR_DUMP's JSON (``serialize``)."""
    prog = progress(options)
    if prog is not None:
        prog.at(0)
    warn_ipu_only(options)
    write_dots(options, graph, checks)
    if os.environ.get("POPART_IR_DUMP"):
        dump_ir(serialize)
    return prog


def session_built(options: Any, graph: Graph, serialize: Callable[[], str]) -> None:
    """A popart session is constructed with ``options`` and IR ``graph``."""
    built(options, graph, ("Fwd0", "Fwd1"), serialize)


def session_compiling(options: Any, graph: Graph, training: bool, name: str, kind: str,
                      samples: int) -> contextlib.AbstractContextManager:
    """popart InferenceSession / TrainingSession.prepareDevice's compile block (session
    ``name`` of class ``kind``, ``samples`` per run)."""
    write_dots(options, graph, ("Bwd0", "Final"), training=bool(training))
    return compiling(options, name, graph, samples, kind)


def popxl_compiling(options: Any, graph: Graph, name: str, samples: int,
                    serialize: Callable[[], str]) -> contextlib.AbstractContextManager:
    """popxl.Session's compile block: its Ir's ``options``, main ``graph``, ``samples`` per
    run (replicas x host transfers); PopART's first progress call, then compiling()'s from 3."""
    built(options, graph, CHECKS, serialize)
    return compiling(options, name, graph, samples, "popxl.Session")


def summary_lines(step: Any) -> list[str]:
    """getSummaryReport's lines for the compiled step: memory and compile phases always; throughput
    and top ops when a report was on."""
    rec = recorder_of(step)
    if rec is not None:
        return rec.summary_lines()
    lines = []
    compiled = getattr(step, "compiled", None)
    if compiled is not None:
        from .capture import memory_summary
        m = memory_summary(compiled)
        if m:
            lines.append("  memory (bytes): " + ", ".join(f"{k[:-6]}={m[k]}" for k in
                         ("peak_bytes", "argument_bytes", "output_bytes", "temp_bytes")))
        phases = getattr(step, "compile_phases", {})
        if phases:
            lines.append("  compile phases (s): " + ", ".join(f"{k}={v:.3f}" for k, v in phases.items()))
    return lines + ["Execution profiling not enabled"]
