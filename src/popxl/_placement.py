"""popxl.Session's main graph placed: its ops on the devices of their IPUs, run in program
order (repeat loops around their own stages), with the parts of ``popart.engine.placed``. The
specification (stages, variables' IPUs, calls, repeats, what falls back) is
docs/model_parallelism.md."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp

from popart.engine.compiled import REPLICA_AXIS, Facts
from popart.engine.lower import CHECKS, RECORD, first_failure
from popart.engine.step import GraphRun
from popart.engine.placed import (IPU_AXIS, Executor, ExecutorPlan, InOrder, IpuSlots, Unplaceable, copied,
                                  device_grid, per_ipu, placed_mesh, placed_or_none, plan_stages)
from popart.engine.graph_api import VIRTUAL_GRAPH, Graph as IRGraph, Node, outer_reads, reads
from popart.logging import getLogger


if TYPE_CHECKING:
    from popart.engine.compiled import Placement

    from ._step import Program
    from .ir import Ir

_logger = getLogger("session")


def _nested(node: Node) -> Iterator[Node]:
    """The nodes of the graphs ``node`` calls (and of the graphs those call)."""
    for v in node.attrs.values():
        if isinstance(v, IRGraph):
            for n in v.nodes:
                yield n
                yield from _nested(n)


def _ipus_of(nodes: Any) -> set[int]:
    return {int(n.annotations[VIRTUAL_GRAPH]) for n in nodes if VIRTUAL_GRAPH in n.annotations}


def ipus_per_replica(ir: "Ir") -> int:
    """popxl's IPUs per replica: the largest IPU an op of the Ir's graphs is on, plus one."""
    nodes = [n for g in ir._graphs for top in g._g.nodes for n in (top, *_nested(top))]
    return max(_ipus_of(nodes), default=0) + 1


def device_ipus(ir: "Ir", device_desc: Any, replicas: int) -> int:
    """The IPUs of the device a session makes for ``device_desc``: as popxl, the IPUs of all
    replicas rounded up to a power of two ("cpu": one per replica, its only choice)."""
    n = ipus_per_replica(ir)
    if n == 1 or device_desc == "cpu":
        return replicas
    return 2 ** math.ceil(math.log2(n * replicas))


def _node_ipu(node: Node, default: int = 0) -> int:
    """The IPU an op runs on: its ``ipu`` block's, else that of the ops it calls, else
    ``default``."""
    if VIRTUAL_GRAPH in node.annotations:
        return int(node.annotations[VIRTUAL_GRAPH])
    inner = _ipus_of(_nested(node))
    return inner.pop() if len(inner) == 1 else default


def _spanning_loop(node: Node) -> Optional[IRGraph]:
    """The graph an ``ops.repeat`` (a Loop whose body only calls it) repeats when its ops are on
    other IPUs than the repeat, each op's called graphs on that op's IPU; else None."""
    body = node.attrs.get("body")
    if node.op_type != "Loop" or len(body.nodes) != 1 or body.nodes[0].op_type != "Call":
        return None
    callee = body.nodes[0].attrs["callee"]
    inner = list(_nested(node))
    if not _ipus_of(inner) - {_node_ipu(node)} or any(n.op_type == "Loop" for n in inner):
        return None
    if any(_ipus_of(_nested(n)) - {_node_ipu(n)} or outer_reads(n) for n in callee.nodes):
        return None
    return callee


def _renamed(g: IRGraph, new_id: Callable[[str], str], ipu: Optional[int] = None) -> IRGraph:
    """A copy of ``g`` with its tensor ids renamed by ``new_id`` (the graphs its ops call
    unchanged); with ``ipu``, each op outside any ``ipu`` block on that IPU (or on the IPU of
    the ops it calls)."""
    ren = lambda t: new_id(t) if t else t   # noqa: E731
    where = (lambda n: n.annotations) if ipu is None else \
        (lambda n: {**n.annotations, VIRTUAL_GRAPH: _node_ipu(n, ipu)})   # noqa: E731
    return dataclasses.replace(
        g, inputs=[ren(t) for t in g.inputs], outputs=[ren(t) for t in g.outputs],
        nodes=[dataclasses.replace(n, inputs=[ren(t) for t in n.inputs], outputs=[ren(t) for t in n.outputs],
                                   annotations=where(n)) for n in g.nodes],
        initializers={ren(k): v for k, v in g.initializers.items()},
        tensor_info={ren(k): v for k, v in g.tensor_info.items()}, constants={ren(t) for t in g.constants})


def _inline_calls(ir: "Ir", main_ir: IRGraph) -> tuple[IRGraph, dict]:
    """``ir``'s main graph (``main_ir``, lowered) with each call of a graph whose ops span IPUs, in it or in a
    graph it repeats, replaced by that graph's ops (recursively; ids prefixed ``call<k>/``,
    its inputs and outputs the call's); and per id of that graph and of the graphs it
    repeats, each in-place result's first id (popxl's tensor versions) in it."""
    known = {id(g._g): g._versions for g in ir._graphs}
    out: dict[int, dict] = {}
    count = itertools.count()

    def inline(g: IRGraph, versions: dict) -> IRGraph:   # adds to ``versions``: g's
        nodes, inlined = [], []
        for n in g.nodes:
            body, callee, ipu = n.attrs.get("body"), n.attrs.get("callee"), _node_ipu(n)
            if n.op_type == "Loop" and len(body.nodes) == 1 and body.nodes[0].op_type == "Call":
                call, old = body.nodes[0], body.nodes[0].attrs["callee"]
                own = dict(known.get(id(old), {}))
                new = inline(old, own)
                out[id(new)] = own
                if new is not old:
                    call = dataclasses.replace(call, attrs={**call.attrs, "callee": new})
                    body = dataclasses.replace(body, nodes=[call])
                    n = dataclasses.replace(n, attrs={**n.attrs, "body": body})
            if n.op_type != "Call" or not _ipus_of(_nested(n)) - {ipu}:
                nodes.append(n)
                continue
            made = {t for m in callee.nodes for t in m.outputs}
            ids, copies = dict(zip(callee.inputs, n.inputs)), []
            prefix = f"call{next(count)}/"
            for o, y in zip(callee.outputs, n.outputs):   # an input, or an output twice: copied
                if o in made and o not in ids:
                    ids[o] = y
                else:
                    copies.append(Node("Identity", [ids.get(o, prefix + o)], [y],
                                       annotations={VIRTUAL_GRAPH: ipu}))
            new_id = lambda t, ids=ids, prefix=prefix: ids.get(t, prefix + t)   # noqa: E731
            own = {new_id(a): new_id(b) for a, b in known.get(id(callee), {}).items()}
            inlined.append(inline(_renamed(callee, new_id, ipu), own))
            versions.update({a: versions.get(b, b) for a, b in own.items()})
            nodes += inlined[-1].nodes + copies
        if len(nodes) == len(g.nodes) and all(a is b for a, b in zip(nodes, g.nodes)):
            return g
        gs = [g, *inlined]
        return dataclasses.replace(
            g, nodes=nodes, initializers={k: v for h in gs for k, v in h.initializers.items()},
            tensor_info={k: v for h in gs for k, v in h.tensor_info.items()},
            constants=set().union(*(h.constants for h in gs)))

    versions = dict(ir.main_graph._versions)
    main = inline(main_ir, versions)
    out[id(main)] = versions
    return main, out


class _Loop(NamedTuple):
    """A main-graph ``ops.repeat`` run placed: stages [first, end) repeated ``trips`` times."""
    first: int
    end: int
    trips: int
    ins: list      # (main input, callee input) pairs
    outs: list     # (main output, callee input, callee output carried into it or None)


def _created_ipu(slot: Any) -> int:
    """The IPU a slot's tensor was created on (a remote buffer: its state tensor's, else its
    first remote variable's), else 0."""
    made = [t for t in (slot.var, slot.graph_out, *slot.entries) if t is not None]
    return int(made[0]._placement[0] or 0) if made else 0


def _check_placeable(placement: "Placement", devices: list, ipus: int, main: IRGraph) -> None:
    """Unplaceable: why a main graph (``main``: with its calls inlined) cannot run placed on
    ``ipus`` IPUs per replica of ``placement``, on the session device's ``devices``."""
    if placement.across_processes:
        raise Unplaceable("several instances")
    device_grid(devices, placement.replication_factor, ipus)
    for top in main.nodes:
        inner = list(_nested(top))
        if _ipus_of(inner) - {_node_ipu(top)} and _spanning_loop(top) is None:
            raise Unplaceable(f"ops on IPUs {sorted(_ipus_of(inner))} in the graphs {top.describe()} "
                              f"on IPU {_node_ipu(top)} calls")


def placed_program(p: "Program", placement: "Placement", devices: list) -> Optional["MainPlan"]:
    """The placed program of ``p``'s main graph on ``placement`` (the session device's
    ``devices``), or None (``placed_or_none`` logs why when the graph has ops on several
    IPUs)."""
    ipus = ipus_per_replica(p.ir)
    return placed_or_none("popxl.Session", lambda: _placed(p, placement, devices, ipus)) \
        if ipus > 1 else None


def _placed(p: "Program", placement: "Placement", devices: list, ipus: int) -> Optional["MainPlan"]:
    main, versions = _inline_calls(p.ir, p.main_ir)
    _check_placeable(placement, devices, ipus, main)
    placed = plan_main(p, devices, ipus, main, versions)
    if len(set(placed.stages.stage_ipu)) < 2:   # all ops on one IPU
        return None
    counts = [list(placed.home.values()).count(i) for i in range(ipus)]
    _logger.info(f"popxl.Session: the main graph runs placed, {placed.stages.num_stages} "
                 f"stage(s) on the devices of {ipus} IPUs per replica; variables per IPU {counts}")
    return placed


def plan_main(p: "Program", devices: list, ipus: int, main: IRGraph, graph_versions: dict
              ) -> "MainPlan":
    """The plan of ``p``'s main graph (``main``: with its calls inlined; ``graph_versions``:
    the tensor versions of it and of the graphs it repeats, ``_inline_calls``) on ``ipus``
    IPUs per replica of the session device's ``devices``: stages, variables' IPUs, repeats."""
    variables = {s.graph_in: jax.ShapeDtypeStruct(s.shape, s.dtype) for s in p.slots}
    # The ops in program order, a spanning repeat's graph's ops in its place.
    flat: list = []
    repeats: list = []
    for n in main.nodes:
        callee = _spanning_loop(n)
        if callee is None:
            flat.append((n, 2 * len(repeats)))
        else:
            repeats.append((n, callee, _renamed(callee, f"repeat{len(repeats)}/".__add__)))
            callee = repeats[-1][2]
            flat += [(m, 2 * len(repeats) - 1) for m in callee.nodes]
    graphs = [main] + [c for *_, c in repeats]
    # Planning copies of the nodes, the tensors that the graphs they call read from the
    # main graph (If branches) as inputs; segment k (the runs of ops between and inside
    # repeats) is their group, so that no stage crosses a repeat's bounds.
    plan = [Node(n.op_type, reads(n), list(n.outputs), {}, n.domain) for n, _ in flat]
    original = {id(p): n for p, (n, _) in zip(plan, flat)}
    where = {id(p): (_node_ipu(n), k) for p, (n, k) in zip(plan, flat)}
    st = plan_stages(plan, lambda p: where[id(p)][0], group_of=lambda p: where[id(p)][1])
    segment = st.group
    stage_reads = [st.reads(s) for s in range(st.num_stages)]
    stage_nodes = [[original[id(n)] for n in nodes] for nodes in st.nodes]
    # variables: a version's variable, each callee input a repeat takes a variable's
    # version by reference (or only reads) standing for that variable
    versions = dict(graph_versions[id(main)])   # in-place results -> their first id
    loops: list[_Loop] = []
    alias = {v: v for v in variables}
    for k, (n, original_callee, callee) in enumerate(repeats):
        versions.update({f"repeat{k}/{a}": f"repeat{k}/{b}"
                         for a, b in graph_versions[id(original_callee)].items()})
        in_loop = [s for s, seg in enumerate(segment) if seg == 2 * k + 1]
        trips, cond = (main.initializers.get(t) for t in n.inputs[:2])
        body = n.attrs["body"]
        results = list(body.nodes[0].outputs)
        if trips is None or cond is None or not bool(cond) or len(callee.inputs) != len(n.inputs) - 2:
            raise Unplaceable(f"{n.describe()} without a trip count known at compile time")
        outs = [(y, c, callee.outputs[results.index(o)] if o in results else None)
                for y, c, o in zip(n.outputs, callee.inputs, body.outputs[1:])]
        for x, (_, c, o) in zip(n.inputs[2:], outs):
            v = alias.get(versions.get(x, x))
            if v is not None and (o is not None or c not in versions.values()):
                alias[c] = v
            elif v is not None:
                raise Unplaceable(f"a repeated graph changing variable '{v}' passed by value")
        ins = list(zip(n.inputs[2:], callee.inputs))
        loops.append(_Loop(in_loop[0], in_loop[-1] + 1, int(trips), ins, outs))
    var_of = {t: alias.get(versions.get(t, t)) for nodes in stage_nodes for n in nodes
              for t in [*n.inputs, *n.outputs]} | {v: v for v in variables}
    var_of = {t: v for t, v in var_of.items() if v is not None}
    created = {s.graph_in: _created_ipu(s) for s in p.slots}
    home = {}
    for s, r in enumerate(stage_reads):   # a variable's IPU: that of its first reader
        for v in sorted({var_of[t] for t in r if t in var_of}):
            home.setdefault(v, st.stage_ipu[s])
    home = {v: home.get(v, created[v]) for v in variables}
    # remote buffers kept in host memory between runs: in slots of their own (tagged),
    # whose sharding carries the memory kind
    # (a replica-sharded variable's slot holds each replica's own shard, packed per replica)
    homes = {s.graph_in: dataclasses.replace(s.home, ipu=home[s.graph_in], shards=None)
             for s in p.slots}
    layout = IpuSlots("variables", variables, homes, ipus,
                      {t: "host" for t, h in homes.items() if h.memory_kind}, p.r)
    # A variable's block holds one version of it (at first its value before the run): a
    # stage on its IPU reads that version from the block and writes its last new version
    # there. The other tensors that later stages (or the end of the run) use, the stage
    # computing them sends on; they move to the IPUs using them (step).
    in_block = {v: v for v in variables}
    from_block: list[dict] = []   # per stage: version read from the block -> variable
    to_block: list[dict] = []     # per stage: variable -> version written to the block
    for s, nodes in enumerate(stage_nodes):
        ipu = st.stage_ipu[s]
        for loop in loops:
            for (x, c), (y, _, o) in zip(loop.ins, loop.outs):
                if c in var_of and s == loop.first:
                    if in_block[var_of[c]] != x:
                        raise Unplaceable(f"a repeat of an older version of '{x}'")
                    in_block[var_of[c]] = c
        from_block.append({t: var_of[t] for t in stage_reads[s] if t in var_of and
                           home[var_of[t]] == ipu and in_block[var_of[t]] == t})
        to_block.append({var_of[t]: t for n in nodes for t in n.outputs
                         if t in var_of and home[var_of[t]] == ipu})
        in_block.update(to_block[s])
        for loop in loops:
            for (x, c), (y, _, o) in zip(loop.ins, loop.outs):
                if c in var_of and s == loop.end - 1:
                    if in_block[var_of[c]] != (o or c):
                        raise Unplaceable(f"a repeated graph updating '{x}' off its IPU")
                    in_block[var_of[c]] = y
    # new values not in their blocks yet: written there at the end of the run
    finals = {s.graph_in: s.graph_out._ir_id for s in p.slots if s.graph_out is not None
              and s.graph_out._ir_id != in_block[s.graph_in]}
    d2h = {t.id: p.d2h_final[s]._ir_id for s, t in p.d2h}
    used = {*finals.values(), *d2h.values()}
    for s, nodes in enumerate(stage_nodes):
        used |= stage_reads[s] - set(from_block[s]) - {t for n in nodes for t in n.outputs}
    for loop in loops:
        used |= {x for x, _ in loop.ins} | {o for *_, o in loop.outs if o}
        if any(c in var_of and y in used for y, c, _ in loop.outs):
            raise Unplaceable("a variable a repeat updates read off its IPU after the repeat")
    exports = [{t for n in nodes for t in n.outputs if t in used} | (set(from_block[s]) & used)
               for s, nodes in enumerate(stage_nodes)]
    executor = Executor(st, placed_mesh(devices, p.r, ipus), copied(st, exports))
    return MainPlan(executor, main, graphs, stage_nodes, loops, home, var_of, from_block,
                    to_block, exports, finals, d2h, layout)



@dataclasses.dataclass
class MainPlan(ExecutorPlan):
    """A session's main graph planned on the devices of its IPUs (:func:`plan_main`): data
    for the executor (its stage plan, copies and state layout) and for the stage functions
    and the schedule of :func:`main_step` (docs/model_parallelism.md)."""
    main: IRGraph                 # the main graph, its calls inlined
    graphs: list                  # it and the graphs its placed repeats run
    nodes: list                   # per stage: its (original) nodes
    loops: list                   # the placed repeats (_Loop)
    home: dict                    # variable -> its IPU
    var_of: dict                  # tensor -> the variable it is a version of
    from_block: list              # per stage: version read from the block -> variable
    to_block: list                # per stage: variable -> version written to the block
    exports: list                 # per stage: the tensors it sends on
    finals: dict                  # variable -> its last version, written back at the end
    d2h: dict                     # device-to-host stream -> the tensor it gives
    layout: IpuSlots              # the variables' slots, [replicas, ipus, *block] (per replica)
    per_replica: ClassVar[bool] = True

    # the step's state packing (as popxl._step.ReplicaSlots): ExecutorPlan's, of its slots
    def layout_for(self, names: Any) -> IpuSlots:
        return self.layout

    def state_specs(self) -> dict:
        return self.slot_specs(self.layout)

    def state_shardings(self) -> dict:
        return self.slot_shardings(self.layout, lambda k: (REPLICA_AXIS, IPU_AXIS))

    @property
    def feed_sharding(self) -> Any:
        """[replicas, ...] arrays: each replica's slice on all of its IPUs' devices."""
        return self.executor.sharding(REPLICA_AXIS)

    @property
    def host_keys(self) -> list:
        """The slots kept in host memory between runs."""
        return sorted(self.host_slots(self.layout))

    def schedule(self, program: "Program") -> Callable:
        """The schedule (``step.state_step``): :func:`main_step`."""
        return lambda run, planned: main_step(self, program, planned, run)


def _stage_fn(p: MainPlan, s: int, run: GraphRun) -> Callable:
    """Stage s on its IPU's devices, run by ``run`` (``step.GraphRun``: its checks the
    program's registry so far, the plan's when it is the step that is compiled): (the
    device's blocks, received tensors, feeds) -> (the blocks with its variables' new
    versions, the tensors it sends on, the record of its first failed check; planning: the
    registry with the checks it adds, as ``Facts``)."""
    main, gs, layout, names = p.main, p.graphs, p.layout, p.executor.graph.names[s]
    ipu, exports = p.stages.stage_ipu[s], sorted(p.exports[s])
    # its ops read the tensors of other IPUs' stages by their IpuCopy's output ids; the
    # graphs they call by the tensors' ids
    outer = {t: names[t] for n in p.nodes[s] for t in outer_reads(n) if t in names}
    sub = IRGraph(name=f"{main.name}/stage{s}", nodes=p.executor.graph.rewired(s, p.nodes[s]),
                  tensor_info={k: v for g in gs for k, v in g.tensor_info.items()},
                  initializers={k: v for g in gs for k, v in g.initializers.items()
                                if k not in p.home},
                  opsets=main.opsets, constants=set().union(*(g.constants for g in gs)))

    def stage(blocks: dict, received: dict, feeds: dict) -> tuple:
        mine = layout.read(blocks, ipu)
        received = {**received, **{t: received[x] for t, x in outer.items() if x in received}}
        weights = {t: mine[v] for t, v in p.from_block[s].items()}
        tr = run(sub, {**feeds, **received}, weights)
        blocks = layout.repack(blocks, ipu, {v: tr.env[t] for v, t in p.to_block[s].items()})
        return run.result(tr, blocks, {t: jnp.asarray(tr.env[t]) for t in exports}, run.record(tr))
    return stage


def main_step(p: MainPlan, program: "Program", planned: dict, graph_run: GraphRun) -> Callable:
    """The program (``Executor.in_order_program``): (slots [replicas, ipus, *block], stream
    inputs [replicas, N, ...]) -> (new slots, device-to-host values [replicas, N, ...] and
    run-time checks), from the facts of its plan (``planned``: its run-time checks,
    numbered; each stage's output shapes); each stage run by ``graph_run`` (planning: those
    facts follow, as ``Facts``).
    The schedule: the stages in program order, a repeat's in a fori_loop."""
    known, planning = planned.get("shapes", {}), graph_run.planning
    st, ex, n = p.stages, p.executor, program.n
    d2h_specs = {t.id: jax.ShapeDtypeStruct((n,) + s.shape, s.dtype.as_device_numpy()) for s, t in program.d2h}

    def schedule(blocks: dict, feeds: dict) -> tuple:   # this device's blocks, [N, ...] feeds
        feeds = {**feeds, **{k: jnp.zeros(s.shape, s.dtype) for k, s in d2h_specs.items()}}
        run = ex.in_order(lambda t: feeds.get(t, p.main.initializers.get(t)))
        checks: list = list(planned.get("checks", ()))   # every stage's run-time checks
        shapes: dict = {}   # per stage, its outputs' shapes (the others' zeros)

        def stage(s: int, blocks: dict, run: InOrder, records: list) -> dict:
            nonlocal checks   # planning: each stage's trace gives the registry with its checks
            # the other IPUs' devices: zeros (stream buffers hold N elements, not popxl's 1)
            planned_shapes = None if planning else known[s]   # None: planning
            stage_run = dataclasses.replace(graph_run, checks=tuple(checks))
            blocks, record, *found, shapes[s] = run.run(s, _stage_fn(p, s, stage_run),
                                                        planned_shapes, blocks, feeds)
            if found:
                checks = found[0]["checks"]
            records.append(record)
            return blocks

        def repeat(loop: _Loop, blocks: dict, records: list) -> dict:
            """The repeat's stages in a fori_loop: a carried value on the IPUs reading it
            and the one computing it, an input on the IPUs reading it."""
            carried = {c: o for _, c, o in loop.outs if o and c not in p.var_of}
            where = {c: {st.stage_ipu[s] for s in range(loop.first, loop.end)
                         if c in st.reads(s) and c not in p.from_block[s]}
                     | ({st.ipu_of(carried[c])} if c in carried else set()) for _, c in loop.ins}
            for x, c in loop.ins:
                if c not in p.var_of:
                    run.set(c, run.read(x, where[c]), where[c] if c in carried else run.where(x))

            def iteration(_: Any, carry: tuple) -> tuple:
                blocks, vals, failed = carry
                inner, recs = run.fork(), []
                inner.env.update(vals)
                for s in range(loop.first, loop.end):
                    blocks = stage(s, blocks, inner, recs)
                new = {c: inner.read(o, where[c]) for c, o in carried.items()}
                return blocks, new, jnp.where(failed[0] != 0, failed, first_failure(jnp.stack(recs)))
            blocks, vals, failed = jax.lax.fori_loop(0, loop.trips, iteration, (
                blocks, {c: run.env[c] for c in carried}, jnp.zeros(RECORD, jnp.int64)))
            records.append(failed)
            for y, c, _ in loop.outs:
                if c not in p.var_of:
                    run.set(y, vals.get(c, run.env[c]), run.where(c))
            return blocks

        records: list = []
        starts = {loop.first: loop for loop in p.loops}
        s = 0
        while s < st.num_stages:
            if s in starts:
                blocks, s = repeat(starts[s], blocks, records), starts[s].end
            else:
                blocks, s = stage(s, blocks, run, records), s + 1

        def write(d: int) -> Callable:   # device d's variables' new values into its blocks
            return lambda blocks, new: p.layout.repack(blocks, d, new)
        if p.finals:
            new = {v: run.read(out, [p.home[v]]) for v, out in p.finals.items()}
            blocks = per_ipu([write(d) for d in range(ex.ipus)], blocks, new)
        outs = {t: run.env.get(out, feeds.get(out)) for t, out in p.d2h.items()}
        out_ipu = {t: min(run.where(out, {0})) for t, out in p.d2h.items()}
        if checks:
            outs[CHECKS] = first_failure(jnp.stack(records))
        return blocks, outs, Facts(checks=list(checks), out_ipu=out_ipu, shapes=shapes)
    return ex.in_order_program(schedule, list(p.d2h), planning)
