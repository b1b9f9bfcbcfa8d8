"""Model parallelism for popxl.Session: the main graph's ops on the devices of their IPUs.

A main graph with ops on several IPUs (``popxl.ipu(n)`` blocks; IPUs per replica as popxl
counts them: the largest IPU any op is on, plus one) runs *placed* when the session's device
has a distinct device for every IPU of every replica: a mesh (``REPLICA_AXIS``,
``IPU_AXIS``) inside one ``shard_map``. The main graph's ops are cut into stages, the runs
of consecutive ops on one IPU (``popart.engine.pipeline.plan_stages``; an op outside any
``ipu`` block is on the IPU of the ops of the graphs it calls, else IPU 0). The stages run
one after the other in program order, as popxl runs them (no implicit pipelining), each on
the devices of its IPU only (``lax.cond`` on the IPU axis index). A tensor read on another
IPU (after ``ops.ipu_copy``, or read directly) moves there with a collective permute right
after the stage computing it.

Each variable lives on one IPU, the IPU of the first op that reads it (popxl's rule; one
never read: the IPU it was created on, else 0), in the slots of
``popart.engine.pipeline.Layout``: arrays ``[replicas, ipus, *block]`` split over the mesh,
each device's blocks holding its IPU's variables only. Its new values (in-place ops,
``ops.var_updates``) computed on its IPU go into its block; one computed elsewhere moves
there at the end of the run.

What the placed program does not do runs unplaced, the whole main graph on one device per
replica, with a log line saying why: remote buffers and replica-sharded variables,
collectives across IPUs (``ops.collectives.all_reduce``), a called graph with ops on
another IPU than its call site (``ops.repeat`` of a graph spanning IPUs among them), several
instances, a device without a distinct device per IPU of each replica.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

import popart
from popart.engine.compiled import REPLICA_AXIS
from popart.engine.lower import CHECKS, RECORD, first_failure, trace
from popart.engine.pipeline import IPU_AXIS, Layout, StagePlan, plan_stages
from popart.ir.graph import VIRTUAL_GRAPH, Graph as IRGraph, Node
from popart.logging import getLogger

from .graph import _free_ids

if TYPE_CHECKING:
    from .ir import Ir
    from .session import Session

_logger = getLogger("session")
P = jax.sharding.PartitionSpec


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


def _node_ipu(node: Node) -> int:
    """The IPU an op runs on: its ``ipu`` block's, else that of the ops it calls, else 0."""
    if VIRTUAL_GRAPH in node.annotations:
        return int(node.annotations[VIRTUAL_GRAPH])
    inner = _ipus_of(_nested(node))
    return inner.pop() if len(inner) == 1 else 0


def _mesh_devices(device: Any, replicas: int, ipus: int) -> Optional[np.ndarray]:
    """[replicas, ipus] devices: replica r's IPUs are the device's IPUs r*n, r*n + 1, ...
    (n: the device's IPUs per replica); None unless all are distinct."""
    devs = list(device.jax_devices)
    n = len(devs) // replicas
    if n < ipus:
        return None
    grid = np.array(devs[:replicas * n], dtype=object).reshape(replicas, n)[:, :ipus]
    return grid if len(set(grid.flat)) == grid.size else None


def _why_not(session: "Session", ipus: int) -> Optional[str]:
    """Why the session's main graph cannot run placed on ``ipus`` IPUs per replica (None:
    it can)."""
    if any(s.kind != "variable" for s in session._slots):
        return "remote buffers or replica-sharded variables"
    if session._placement.across_processes:
        return "several instances"
    dev, r = session._device, session._r
    if _mesh_devices(dev, r, ipus) is None:
        return (f"a device of {dev.numIpus} IPU(s) on {len(set(dev.jax_devices))} device(s) for "
                f"{r} replica(s) of {ipus} IPUs")
    for top in session._main_ir.nodes:
        inner = list(_nested(top))
        if any(n.op_type == "AllReduce" for n in (top, *inner)):
            return "collectives across IPUs (ops.collectives.all_reduce)"
        if _ipus_of(inner) - {_node_ipu(top)}:
            return (f"ops on IPUs {sorted(_ipus_of(inner))} in the graphs {top.describe()} on "
                    f"IPU {_node_ipu(top)} calls")
    return None


def placed_program(session: "Session") -> Optional["PlacedMain"]:
    """The placed program of ``session``'s main graph, or None (a log line says why when the
    graph has ops on several IPUs)."""
    ipus = ipus_per_replica(session._ir)
    if ipus < 2:
        return None
    why = _why_not(session, ipus)
    if why is not None:
        _logger.info(f"popxl.Session: {why} is not supported by the placed program; the main "
                     f"graph runs on one device per replica")
        return None
    placed = PlacedMain(session, ipus)
    if len(set(placed.stages.stage_ipu)) < 2:   # all ops on one IPU
        return None
    per_ipu = [list(placed.home.values()).count(i) for i in range(ipus)]
    _logger.info(f"popxl.Session: the main graph runs placed, {placed.stages.num_stages} "
                 f"stage(s) on the devices of {ipus} IPUs per replica; variables per IPU {per_ipu}")
    return placed


class PlacedMain:
    """A session's main graph as stages on the devices of their IPUs (module docstring)."""

    def __init__(self, session: "Session", ipus: int) -> None:
        self.session, self.ipus, self.replicas = session, ipus, session._r
        main = session._main_ir
        variables = {s.graph_in: jax.ShapeDtypeStruct(s.shape, s.dtype) for s in session._slots}
        # Planning copies of the nodes: their IPU as annotation, the tensors that the graphs
        # they call read from the main graph (If branches) as inputs.
        plan = [Node(n.op_type, list(n.inputs) + sorted(self._free(n)), list(n.outputs), {},
                     n.domain, annotations={VIRTUAL_GRAPH: _node_ipu(n)}) for n in main.nodes]
        original = {id(p): n for p, n in zip(plan, main.nodes)}
        options = popart.SessionOptions()
        options.virtualGraphMode = popart.VirtualGraphMode.Manual
        self.stages: StagePlan = plan_stages(IRGraph(nodes=plan), variables, options, ipus, {})
        st = self.stages
        self.reads = [{t for n in nodes for t in n.inputs if t} for nodes in st.nodes]
        self.nodes = [[original[id(n)] for n in nodes] for nodes in st.nodes]
        created = {s.graph_in: s.var._placement[0] for s in session._slots}
        read = {t for r in self.reads for t in r}
        self.home = {v: st.ipu_of(v) if v in read else int(created[v] or 0) for v in variables}
        self.layout = Layout("variables", variables, self.home.__getitem__, ipus)
        # A variable's block holds one version of it (at first its value before the run): a
        # stage on its IPU reads that version from the block and writes its last new version
        # there. The other tensors that later stages (or the end of the run) use, the stage
        # computing them sends on, moved to the IPUs that use them.
        versions = session._ir.main_graph._versions   # in-place results -> their first id
        var_of = {t: versions.get(t, t) for nodes in self.nodes for n in nodes for t in n.outputs}
        var_of = {t: v for t, v in var_of.items() if v in variables} | {v: v for v in variables}
        in_block = {v: v for v in variables}
        self.from_block: list[dict] = []   # per stage: version read from the block -> variable
        self.to_block: list[dict] = []     # per stage: variable -> version written to the block
        self.exports: list[set[str]] = [set() for _ in st.nodes]
        self.moves: dict[str, set[int]] = {}
        for s, nodes in enumerate(self.nodes):
            ipu = st.stage_ipu[s]
            self.from_block.append({t: var_of[t] for t in self.reads[s] if t in var_of and
                                    self.home[var_of[t]] == ipu and in_block[var_of[t]] == t})
            for t in self.reads[s] - set(self.from_block[s]):
                if st.produced_at.get(t, s) != s:
                    self._need(t, ipu)
            self.to_block.append({var_of[t]: t for n in nodes for t in n.outputs
                                  if t in var_of and self.home[var_of[t]] == ipu})
            in_block.update(self.to_block[s])
        # new values not in their blocks yet: written there at the end of the run
        self.finals = {s.graph_in: s.graph_out._ir_id for s in session._slots if s.graph_out is not None
                       and s.graph_out._ir_id != in_block[s.graph_in]}
        for v, out in self.finals.items():
            self._need(out, self.home[v])
        self.d2h = {t.id: session._d2h_final[s]._ir_id for s, t in session._d2h}
        for out in self.d2h.values():
            if out in st.produced_at:
                self._need(out, self.ipu_of(out))
        self.mesh = jax.sharding.Mesh(_mesh_devices(session._device, self.replicas, ipus),
                                      (REPLICA_AXIS, IPU_AXIS))

    @staticmethod
    def _free(node: Node) -> set[str]:
        return {t for v in node.attrs.values() if isinstance(v, IRGraph) for t in _free_ids(v)}

    def ipu_of(self, t: str) -> int:
        return self.stages.ipu_of(t)

    def _need(self, t: str, ipu: int) -> None:
        """Tensor ``t`` is used on ``ipu``: its stage sends it on, moved there if elsewhere."""
        s = self.stages.produced_at[t]
        self.exports[s].add(t)
        if self.stages.stage_ipu[s] != ipu:
            self.moves.setdefault(t, set()).add(ipu)

    # ------------------------------------------------------------------ device state
    def state_specs(self) -> dict:
        return {k: jax.ShapeDtypeStruct((self.replicas,) + s.shape, s.dtype)
                for k, s in self.layout.specs().items()}

    def state_shardings(self) -> dict:
        sharding = jax.sharding.NamedSharding(self.mesh, P(REPLICA_AXIS, IPU_AXIS))
        return {k: sharding for k in self.layout.specs()}

    @property
    def feed_sharding(self) -> jax.sharding.NamedSharding:
        """[replicas, ...] arrays: each replica's slice on all of its IPUs' devices."""
        return jax.sharding.NamedSharding(self.mesh, P(REPLICA_AXIS))

    def pack(self, values: dict) -> dict:
        """The slots [replicas, ipus, *block] from each variable's values [replicas, *shape]."""
        per = [self.layout.pack({k: v[r] for k, v in values.items()}) for r in range(self.replicas)]
        return {k: np.stack([p[k] for p in per]) for k in per[0]}

    def unpack(self, bufs: dict) -> dict:
        """Each variable's values [replicas, *shape] from the slots [replicas, ipus, *block]."""
        per = [self.layout.unpack({k: b[r] for k, b in bufs.items()}) for r in range(self.replicas)]
        return {k: np.stack([p[k] for p in per]) for k in per[0]}

    # ------------------------------------------------------------------ the program
    def _stage_fn(self, s: int, checks: list) -> Callable:
        """Stage s on its IPU's devices: (the device's blocks, received tensors, feeds) -> (the
        blocks with its variables' new versions, the tensors it sends on, the record of its
        first failed check, numbered after ``checks``, which it extends with its own)."""
        main, sess = self.session._main_ir, self.session
        ipu, exports = self.stages.stage_ipu[s], sorted(self.exports[s])
        sub = IRGraph(name=f"{main.name}/stage{s}", nodes=self.nodes[s], tensor_info=main.tensor_info,
                      initializers={k: v for k, v in main.initializers.items() if k not in self.home},
                      opsets=main.opsets, constants=main.constants)
        r = self.replicas

        def run(blocks: dict, received: dict, feeds: dict) -> tuple:
            mine = self.layout.unpack(blocks, ipu)
            weights = {t: mine[v] for t, v in self.from_block[s].items()}
            tr = trace(sub, {**feeds, **received}, key=jax.random.key(0), weights=weights,
                       platform=sess._placement.platform, replication_factor=r,
                       replica_axis=REPLICA_AXIS if r > 1 else None)
            record = tr.check_flags()
            record = jnp.zeros(RECORD, jnp.int64) if record is None else record.at[1].add(len(checks))
            checks.extend(tr.checks)
            blocks = self.layout.repack(blocks, ipu, {v: tr.env[t] for v, t in self.to_block[s].items()})
            return blocks, {t: jnp.asarray(tr.env[t]) for t in exports}, record
        return run

    def step(self) -> Callable:
        """The program: (slots [replicas, ipus, *block], stream inputs [replicas, N, ...]) ->
        (new slots, device-to-host values [replicas, N, ...] and run-time checks)."""
        st, sess, n = self.stages, self.session, self.session._n
        d2h_specs = {t.id: jax.ShapeDtypeStruct((n,) + s.shape, s.dtype.as_numpy()) for s, t in sess._d2h}

        def body(blocks: dict, feeds: dict) -> tuple:   # this device's [1, 1, *block], [1, N, ...]
            blocks, dev = {k: v[0, 0] for k, v in blocks.items()}, jax.lax.axis_index(IPU_AXIS)
            feeds = {k: v[0] for k, v in feeds.items()}
            feeds.update({k: jnp.zeros(s.shape, s.dtype) for k, s in d2h_specs.items()})
            env: dict = {}      # tensors sent on: their value on the devices holding them
            checks: list = []   # every stage's run-time checks
            records = []
            for s in range(st.num_stages):
                a = st.stage_ipu[s]
                received = {t: env[t] for t in self.reads[s] if t in env}
                run = self._stage_fn(s, checks)
                # the other IPUs' devices: zeros (stream buffers hold N elements, not popxl's 1)
                shapes = jax.eval_shape(self._stage_fn(s, []), blocks, received, feeds)[1:]
                zeros = lambda blocks, *_: (blocks, *jax.tree_util.tree_map(  # noqa: E731
                    lambda x: jnp.zeros(x.shape, x.dtype), shapes))
                blocks, out, record = jax.lax.cond(dev == a, run, zeros, blocks, received, feeds)
                records.append(record)
                for t, v in out.items():
                    for b in sorted(self.moves.get(t, ())):   # IpuCopy: to the IPUs that use it
                        v = jnp.where(dev == b, jax.lax.ppermute(v, IPU_AXIS, [(a, b)]), v)
                    env[t] = v
            sess._checks[:] = checks

            def write(d: int) -> Callable:   # device d's variables' new values into its blocks
                return lambda blocks, new: self.layout.repack(blocks, d, new)
            if self.finals:
                new = {v: env[out] for v, out in self.finals.items()}
                blocks = jax.lax.switch(dev, [write(d) for d in range(self.ipus)], blocks, new)
            outs = {t: env.get(out, feeds.get(out)) for t, out in self.d2h.items()}
            if checks:
                outs[CHECKS] = first_failure(jnp.stack(records))
            return ({k: v[None, None] for k, v in blocks.items()},
                    {k: v[None, None] for k, v in outs.items()})

        def program(state: dict, feeds: dict) -> tuple:
            spec = P(REPLICA_AXIS, IPU_AXIS)
            state, outs = jax.shard_map(body, mesh=self.mesh, in_specs=(spec, P(REPLICA_AXIS)),
                                        out_specs=(spec, spec), check_vma=False)(state, feeds)
            # each output from the devices of the IPU computing it; checks from every device
            return state, {t: v if t == CHECKS else v[:, self._out_ipu(t)] for t, v in outs.items()}
        return program

    def _out_ipu(self, t: str) -> int:
        out = self.d2h[t]
        return self.ipu_of(out) if out in self.stages.produced_at else 0
