"""The compiled program's instructions and the ONNX nodes they come from.

Every lowering runs under ``jax.named_scope`` of its node (``engine.lower.node_scope_name``), so
an instruction's ``op_name`` metadata names the node: ``jit(step)/while/body/layer1/MatMul/
dot_general`` in the forward pass, ``.../transpose(jvp(layer1/MatMul))/dot_general`` in the
backward pass. A fusion's nodes are those of the instructions it calls. Profiler events carry
the instruction's name (``args.hlo_op``), which joins them to these facts."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, Mapping, Optional

from .._ir.graph import Graph

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
CONTROL = frozenset({"while", "conditional", "call", "async-start", "async-done", "parameter",
                     "get-tuple-element", "tuple", "constant", "bitcast"})


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    op_name: str = ""
    calls: tuple = ()


def parse_hlo(text: str) -> tuple[str, dict[str, Instruction], dict[str, list[str]]]:
    """(module name, instructions by name, computation -> its instructions' names) of an
    HLO module's text (``compiled.as_text()``)."""
    module, instrs, comps, current = "", {}, {}, None
    for line in text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            name, _, opcode, rest = m.groups()
            op = _OP_NAME.search(rest)
            instrs[name] = Instruction(name, opcode, op.group(1).replace("\\'", "'") if op else "",
                                       tuple(_CALLS.findall(rest)) if opcode == "fusion" else ())
            comps[current].append(name)
            continue
        c = _COMP.match(line)
        if c:
            current = c.group(1)
            comps[current] = []
    return module, instrs, comps


def graph_nodes(graph: Graph) -> dict[str, str]:
    """Scope name -> op type of every node of ``graph`` and its subgraphs (the names the
    compiled program carries, ``node_scope_name``)."""
    from ..engine.lower import node_scope_name
    out: dict[str, str] = {}
    seen: set[int] = set()

    def walk(g: Graph) -> None:
        if id(g) in seen:
            return
        seen.add(id(g))
        names: dict = {}
        for n in g.nodes:
            out.setdefault(node_scope_name(n, g, names), n.op_type)
            for v in n.attrs.values():
                for sub in (v if isinstance(v, list) else [v]):
                    if isinstance(sub, Graph):
                        walk(sub)
    walk(graph)
    return out


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[/()]", name) if t]


class NodeMap:
    """Which ONNX node (and pass) an ``op_name`` belongs to."""

    def __init__(self, nodes: Mapping[str, str]) -> None:
        self.nodes = dict(nodes)
        # names as op_name's path tokens ("/0/Conv" -> "0/Conv"): the key the lookup builds
        self._keys = {"/".join(_tokens(n)): n for n in self.nodes}
        self._longest = max((len(_tokens(n)) for n in self.nodes), default=1)
        self._cache: dict[str, tuple] = {}

    def node(self, op_name: str) -> tuple[Optional[str], str]:
        """(node name or None, "forward" | "backward") of an instruction's op_name: the
        innermost node scope it names."""
        hit = self._cache.get(op_name)
        if hit is None:
            tokens = _tokens(op_name)
            found = None
            for j in range(len(tokens), 0, -1):   # innermost end first, then the longest name
                for i in range(max(0, j - self._longest), j):
                    cand = self._keys.get("/".join(tokens[i:j]))
                    if cand is not None:
                        found = cand
                        break
                if found:
                    break
            hit = self._cache[op_name] = (found, "backward" if "transpose(" in op_name else "forward")
        return hit


def instruction_nodes(instrs: Mapping[str, Instruction], comps: Mapping[str, list[str]],
                      nodes: NodeMap) -> dict[str, tuple[tuple[str, ...], str, str]]:
    """Instruction name -> (its nodes, sorted; pass; op_name) for every instruction: a
    fusion's nodes are those of every instruction it calls (and its own)."""
    out: dict[str, tuple] = {}

    def of(name: str, depth: int = 0) -> set:
        ins = instrs.get(name)
        if ins is None:
            return set()
        found = set()
        n, _ = nodes.node(ins.op_name) if ins.op_name else (None, "")
        if n:
            found.add(n)
        if depth < 8:
            for c in ins.calls:
                for member in comps.get(c, ()):
                    found |= of(member, depth + 1)
        return found

    for name, ins in instrs.items():
        nd = of(name)
        direction = "backward" if "transpose(" in ins.op_name else "forward"
        out[name] = (tuple(sorted(nd)), direction, ins.op_name)
    return out


_PEAK = re.compile(r"^\s*([\w.\-]+)\{[\d,]*\}: (\d+) bytes")


def live_at_peak(live_range_text: str) -> list[tuple[str, int]]:
    """(instruction, bytes) of the buffers live at the peak, from XLA's live-range dump
    (``*-live-range.txt``, its ``Live ranges at N (peak):`` section)."""
    out, inside = [], False
    for line in live_range_text.splitlines():
        if "(peak):" in line:
            inside = True
            continue
        if inside:
            m = _PEAK.match(line)
            if not m:
                break
            out.append((m.group(1), int(m.group(2))))
    return out


def event_rows(events: Iterable[Mapping[str, Any]], module: str) -> Iterable[tuple[str, float]]:
    """(instruction, microseconds) of the trace events of ``module``'s instructions."""
    for e in events:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if op and e.get("ph") == "X" and args.get("hlo_module", module) == module:
            yield op, float(e.get("dur", 0.0))
