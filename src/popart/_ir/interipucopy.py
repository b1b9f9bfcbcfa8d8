"""PopART's InterIpuCopy transform (transforms/interipucopy.cpp) on a staged graph: the
``IpuCopy`` nodes that move tensors between the IPUs of a graph's stages, inserted into it,
and the stages' ops rewired to read the copies.

PopART's facts: a copy is an ``ai.graphcore`` ``IpuCopy`` op (attributes ``sourceIpu`` /
``destIpu``, on the destination IPU), unnamed; its output is ``<t>_c<destIpu>``
(``generateCopiedTensorId``); every consumer of ``t`` on one IPU reads one copy; a pipeline
chains the copies stage to stage (a tensor needed two stages on passes through the stage
between, ``<t>_c1_c2``). Both placed schedules run the copies of a stage before its ops:
popart's pipeline ticks (``engine/placed.pipeline_ticks``, chained) and popxl's in-order
run (``engine/placed.InOrder``, straight from the IPU making the tensor to each IPU reading
it); ``ir_json`` writes them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .graph import VIRTUAL_GRAPH, Node, reads

IPU_COPY = "IpuCopy"
# A rewired node's copies -> the tensors they copy (NodeCtx.check names the tensors the user
# knows, so a run-time check of a placed stage is the plan's, with the plan's text)
COPIED_FROM = "__copiedFrom"


def copied_id(t: str, dst: int) -> str:
    """PopART's id of ``t`` copied to IPU ``dst`` (``InterIpuCopy::generateCopiedTensorId``)."""
    return f"{t}_c{dst}"


def ipu_copy_node(t: str, src: int, dst: int) -> Node:
    """PopART's IpuCopy of ``t`` from IPU ``src`` to ``dst`` (unnamed; output
    :func:`copied_id`)."""
    return Node(IPU_COPY, [t], [copied_id(t, dst)], {"sourceIpu": src, "destIpu": dst},
                "ai.graphcore", annotations={VIRTUAL_GRAPH: dst})


@dataclass(frozen=True)
class CopiedStages:
    """A staged graph after InterIpuCopy: per stage, the ``IpuCopy`` nodes that run before
    its ops (``copies``), its ops reading the copies (``ops``), and the id each tensor made
    by an earlier stage has there (``names``: only those that differ, i.e. copied)."""
    copies: tuple
    ops: tuple
    names: tuple

    def nodes(self, s: int) -> list[Node]:
        """Stage ``s``'s nodes: its copies, then its ops."""
        return [*self.copies[s], *self.ops[s]]

    def local(self, s: int, t: str) -> str:
        """The id stage ``s`` reads tensor ``t`` by."""
        return self.names[s].get(t, t)

    def rewired(self, s: int, nodes: Iterable[Node]) -> list[Node]:
        """``nodes`` of stage ``s`` reading the copies (:func:`rewire`)."""
        return rewire(nodes, self.names[s])

    @property
    def source(self) -> dict[str, str]:
        """Copy output -> the tensor it is a copy of (through chained copies)."""
        out: dict[str, str] = {}
        for cs in self.copies:
            for c in cs:
                out[c.outputs[0]] = out.get(c.inputs[0], c.inputs[0])
        return out


def rewire(nodes: Iterable[Node], names: Mapping[str, str]) -> list[Node]:
    """``nodes`` reading each input ``t`` as ``names[t]`` (its copy); the graphs they call
    read the outer ids unchanged."""
    return [n if not names.keys() & set(n.inputs) else
            dataclasses.replace(n, inputs=[names.get(t, t) if t else t for t in n.inputs],
                                annotations={**n.annotations, COPIED_FROM: {
                                    names[t]: t for t in n.inputs if t in names}})
            for n in nodes]


def inter_ipu_copy(stage_nodes: Sequence[Sequence[Node]], stage_ipu: Sequence[int],
                   sends: Sequence[Iterable[str]], chained: bool) -> CopiedStages:
    """InterIpuCopy on stages (``stage_nodes``, in the order they run, stage s on IPU
    ``stage_ipu[s]``). ``chained`` (a pipeline): ``sends[s]`` the tensors crossing from stage
    s to s + 1, each copied there when the IPUs differ (from its id on stage s). Else (an
    in-order run): ``sends[s]`` the tensors stage s makes for later stages, each copied from
    its IPU to every other IPU with a stage reading it, once, before the first such stage."""
    S = len(stage_nodes)
    copies: list[list[Node]] = [[] for _ in range(S)]
    names: list[dict] = [{} for _ in range(S)]
    if chained:
        name: dict[str, str] = {}
        for s, crossing in enumerate(list(sends)[:S - 1]):
            src, dst = stage_ipu[s], stage_ipu[s + 1]
            if src != dst:
                for t in crossing:
                    copies[s + 1].append(ipu_copy_node(name.get(t, t), src, dst))
                    name[t] = copies[s + 1][-1].outputs[0]
            names[s + 1] = dict(name)
    else:
        held: dict[str, dict[int, str]] = {}   # tensor -> IPU -> its id there
        made: dict[str, int] = {}
        for s, ipu in enumerate(stage_ipu):
            for t in sorted({t for n in stage_nodes[s] for t in reads(n) if t}):
                if t in held and ipu not in held[t]:
                    copies[s].append(ipu_copy_node(t, made[t], ipu))
                    held[t][ipu] = copies[s][-1].outputs[0]
                if t in held and held[t].get(ipu, t) != t:
                    names[s][t] = held[t][ipu]
            for t in sends[s]:
                held[t], made[t] = {ipu: t}, ipu
    ops = tuple(tuple(rewire(stage_nodes[s], names[s])) for s in range(S))
    return CopiedStages(tuple(map(tuple, copies)), ops, tuple(names))
