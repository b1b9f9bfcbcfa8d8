"""Recomputation: which forward tensors the backward pass keeps, as PopART decides it.

:func:`annotate` marks the forward ops on the loss's path Checkpoint or Recompute (hand
annotations, completed by ``autoRecomputation`` as PopART's ``willow/src/recompute.cpp``);
:func:`segments` turns runs of Recompute ops into the segments the engine runs again in the
backward pass (``engine/lower.py: run_segment``). See docs/recompute.md."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from .graph import Graph, Node, reads
from .transforms import ancestors

RECOMPUTE_OUTPUT = "__recompute_output"   # the Builder's annotation (RecomputeType)
CHECKPOINT, RECOMPUTE = 1, 2              # RecomputeType values

# Ops PopART's ``isNorm()`` is true for.
NORM_OPS = frozenset({"BatchNormalization", "GroupNormalization", "InstanceNormalization",
                      "LayerNormalization", "LpNormalization"})
# Ops that cannot be recomputed (canRecompute() false: random, state, host and remote I/O).
NOT_RECOMPUTABLE = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike",
                              "RandomUniformLike", "Multinomial", "Bernoulli", "HostLoad",
                              "HostStore", "RemoteLoad", "RemoteStore", "Init"})


def decreasing_intervals(n: int) -> list[tuple[int, int]]:
    """PopART's ``getDecreasingIntervals(N)``: intervals of sizes K, K-1, ..., 1, then ones,
    K = floor((floor(sqrt(2N)) - 1) * 0.75)."""
    k = int((int(math.sqrt(2.0 * n)) - 1) * 0.75)
    if n == 1:
        return [(0, 1)]
    out, i0, size = [], 0, k
    while i0 + size <= n and size > 0:
        out.append((i0, i0 + size))
        i0 += size
        size -= 1
    while i0 < n:
        out.append((i0, i0 + 1))
        i0 += 1
    return out


def _path_to_loss(graph: Graph, loss: str) -> list[Node]:
    """The forward ops whose outputs reach the loss, in schedule (graph) order."""
    needed = ancestors(graph, loss)
    return [n for n in graph.nodes if any(o in needed for o in n.outputs if o)]


def _can_recompute(node: Node) -> bool:
    return node.op_type not in NOT_RECOMPUTABLE and node.domain != "ai.onnx.preview.training"


def _live_sets(ops: list[Node]) -> list[list[Node]]:
    """liveSets[i]: the ops whose outputs are still needed by a later op on the path just
    after ops[i] has run (ops[i] included), as PopART's ``Graph::getLiveSets``."""
    last_use: dict[int, int] = {}
    produced = {o: i for i, n in enumerate(ops) for o in n.outputs if o}
    for i, n in enumerate(ops):
        for t in n.inputs:
            if t in produced:
                last_use[produced[t]] = max(last_use.get(produced[t], -1), i)
    return [[ops[j] for j in range(i + 1) if j == i or last_use.get(j, -1) > i]
            for i in range(len(ops))]


def annotate(graph: Graph, loss: str, method: str, nbytes: Mapping[str, int]) -> dict[int, int]:
    """id(node) -> CHECKPOINT or RECOMPUTE for the forward ops on the loss's path: the hand
    annotations, completed by ``method`` ("NoRecompute", "Standard", "NormOnly",
    "RecomputeAll", "Pipeline"). ``nbytes``: each tensor's size, for Standard."""
    ops = _path_to_loss(graph, loss)
    marks = {id(n): int(n.annotations.get(RECOMPUTE_OUTPUT, 0) or 0) for n in ops}
    marks = {k: v for k, v in marks.items() if v in (CHECKPOINT, RECOMPUTE)}
    if method == "Standard":
        lives = _live_sets(ops)
        mem = [sum(nbytes.get(o, 0) for n in live for o in n.outputs if o) for live in lives]
        keep: set[int] = set()
        for begin, end in decreasing_intervals(len(ops)) if ops else []:
            best = min(range(begin, end), key=lambda i: mem[i])
            keep |= {id(n) for n in lives[best]}
        for n in ops:
            if id(n) not in keep and _can_recompute(n):
                marks.setdefault(id(n), RECOMPUTE)
    elif method == "NormOnly":
        for n in ops:
            marks[id(n)] = RECOMPUTE if n.op_type in NORM_OPS and _can_recompute(n) else CHECKPOINT
    elif method in ("RecomputeAll", "Pipeline"):
        for n in ops:
            if _can_recompute(n):
                marks.setdefault(id(n), RECOMPUTE)
        producer = {o: n for n in ops for o in n.outputs if o}
        loss_op = producer.get(loss)
        stack = [producer[i] for i in (loss_op.inputs if loss_op else []) if i in producer]
        while stack:   # allCheckpointAfterLastCheckpoint
            n = stack.pop()
            if marks.get(id(n)) == RECOMPUTE:
                marks[id(n)] = CHECKPOINT
                stack += [producer[i] for i in n.inputs if i in producer]
    return marks


@dataclass(frozen=True)
class Segment:
    """Forward ops recomputed together in the backward pass: ``nodes`` (indices into the
    graph's nodes; the segment runs at the last one), the tensors it ``reads`` from before
    it and those it ``gives`` to the rest of the graph."""
    nodes: tuple[int, ...]
    reads: tuple[str, ...]
    gives: tuple[str, ...]


def segments(graph: Graph, marks: Mapping[int, int], movable: Collection[int],
             static: Collection[int], keep: Collection[str]) -> list[Segment]:
    """The recompute segments of ``graph`` for ``annotate``'s ``marks`` (docs/recompute.md).
    ``movable``: indices of the nodes a segment may hold (no side effects: no
    random draws, variable updates or run-time checks; array outputs); ``static``: indices of
    the nodes computed at compile time (they run in place and never split a segment);
    ``keep``: tensors the step reads besides the graph's own outputs (loss, anchors)."""
    nodes, out, run = graph.nodes, [], []
    wanted = set(graph.outputs) | set(keep)
    node_reads = [reads(n) for n in nodes]
    readers: dict[str, set[int]] = {}
    for j, ids in enumerate(node_reads):
        for t in ids:
            readers.setdefault(t, set()).add(j)

    def close() -> None:
        if any(marks.get(id(nodes[i])) == RECOMPUTE for i in run):
            inside = set(run)
            made = {o for i in run for o in nodes[i].outputs if o}
            needed = {t for t in made if readers.get(t, set()) - inside}
            read = dict.fromkeys(t for i in run for t in node_reads[i] if t not in made)
            gives = [o for i in run for o in nodes[i].outputs if o and (o in needed or o in wanted)]
            out.append(Segment(tuple(run), tuple(read), tuple(gives)))
        run.clear()

    for i, n in enumerate(nodes):
        if i in static:
            continue
        if i not in movable:
            close()
            continue
        run.append(i)
        if marks.get(id(n)) != RECOMPUTE:   # a Checkpoint op (or one off the loss's path)
            close()
    close()
    return out


def method_name(value: Any) -> str:
    """A RecomputationType member's name ("NoRecompute" for None / 0)."""
    return getattr(value, "name", None) or "NoRecompute"
