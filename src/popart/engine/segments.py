"""Graphs whose output shapes depend on run-time values: compiled segments, with the
data-dependent nodes run on the host between them.

An XLA program has static shapes. A node whose output shape depends on some of its input
values (registered with ``data_dependent``: NonZero, Unique, Compress, NonMaxSuppression)
folds into the program where those inputs are known at compile time, as any node. Where one
is a run-time value, the node *cuts* the graph: the compiled segment before the cut computes
what the nodes after it read, the cut nodes run on the host on NumPy values (their own
lowerings, folded), and the nodes after them are planned again for the concrete shapes the
host produced: the next segment, compiled once per shape signature and kept in a bounded
cache (:class:`Segmented`). A graph without such a cut never comes here: a run of it is one
call into one compiled program. See docs/data_dependent_shapes.md."""
from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from ..errors import UnsupportedOperatorError, popart_exception
from .._ir.graph import Graph, Node, reads
from ..logging import getLogger
from ..ops import registry
from ..ops.registry import is_static
from .compiled import graph_function
from .config import EngineConfig
from .lower import NOT_STATIC, trace, trace_node

_logger = getLogger("session")

CACHE_SIZE = 16   # planned (and compiled) segments a Segmented keeps, least recently used out


def shape_deciding_inputs(graph: Graph, node: Node) -> tuple:
    """The ids of ``node``'s inputs whose values decide its output shape (the registry's
    ``data_dependent``); () for other nodes."""
    try:
        opdef = registry.lookup(node.domain, node.op_type, graph.opsets.get(node.domain, 1))
    except UnsupportedOperatorError:
        return ()
    return tuple(node.inputs[i] for i in opdef.data_dependent
                 if i < len(node.inputs) and node.inputs[i])


def has_data_dependent(graph: Graph) -> bool:
    """Whether a node of ``graph`` (not of its subgraphs) has a data-dependent output shape."""
    return any(shape_deciding_inputs(graph, n) for n in graph.nodes)


def _after(nodes: Sequence[Node], cut: set) -> set:
    """Positions in ``nodes`` of the nodes reading, through any chain, an output of the
    nodes at positions ``cut`` (those excluded)."""
    made: set = set()
    out = set()
    for i, n in enumerate(nodes):
        if i in cut or made.intersection(reads(n)):
            made.update(o for o in n.outputs if o)
            if i not in cut:
                out.add(i)
    return out


def _spec(v: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(v), v.dtype)


def _signature(env: Mapping[str, Any], ids: Sequence[str]) -> tuple:
    """What a plan depends on: the shapes and dtypes of run-time values, static values whole."""
    sig = []
    for t in ids:
        v = env[t]
        sig.append((t, tuple(v.shape), str(v.dtype)) if isinstance(v, jax.ShapeDtypeStruct)
                   else (t, tuple(v.shape), str(v.dtype), str(v.tolist()) if v.dtype.kind == "O"
                         else v.tobytes()))
    return tuple(sig)


def _probes(spec: jax.ShapeDtypeStruct) -> tuple:
    """Two host values of a run-time tensor whose data-dependent results differ in size:
    zeros, and 1..7 repeating (all true, all distinct up to 7)."""
    count = (np.arange(int(np.prod(spec.shape))) % 7 + 1).reshape(spec.shape)
    return np.zeros(spec.shape, spec.dtype), count.astype(spec.dtype)


@dataclass(frozen=True)
class Varying:
    """The spec of a tensor after a cut: -1 for each dimension that depends on the data."""
    shape: tuple
    dtype: Any


def _merge(a: dict, b: dict) -> dict:
    """The specs of two probes' tensors: dimensions that differ become -1 (``Varying``)."""
    out = dict(a)
    for k, w in a.items():
        sw, sv = np.shape(w), np.shape(b.get(k, w))
        if sw != sv:   # another rank: every dimension varies
            same = len(sw) == len(sv)
            out[k] = Varying(tuple(x if same and x == y else -1
                                   for x, y in zip(sw, sv if same else sw)), w.dtype)
    return out


@dataclass
class Stage:
    """One compiled segment and the host nodes after it."""
    segment: list                 # the nodes compiled together, in graph order
    reads: list                   # the run-time tensors it takes (graph inputs, earlier results)
    gives: list                   # the tensors it returns: read later on, or wanted
    cuts: list                    # the nodes run on the host after it
    rest: tuple                   # the nodes after the cuts (planned again per shape)
    known: dict                   # every tensor of the segment: NumPy, or its spec
    fn: Optional[Callable] = None   # the compiled segment (graph_function), made on first run


@dataclass
class Segmented:
    """``graph`` run as compiled segments and host nodes (see the module docstring):
    ``seg(feeds, key) -> [value of each of outputs]``, as ``graph_function``'s runs.
    ``static_feeds`` are compiled in; ``config`` a session's EngineConfig (PopART's op
    semantics), None for ONNX's. A training trace cannot be cut (its gradient would cross the
    host): planning one that needs a cut raises, naming the node."""
    graph: Graph = field(repr=False)
    outputs: list
    static_feeds: dict = field(default_factory=dict, repr=False)
    config: Optional[EngineConfig] = None
    training: bool = False
    cache_size: int = CACHE_SIZE
    fold_first: bool = True       # a new signature after a cut runs folded once, compiled when seen again
    compiled: int = 0             # segments planned and compiled so far (cache misses)
    reused: int = 0               # cache hits
    folded: int = 0               # runs of the nodes after a cut folded on the host
    _stages: collections.OrderedDict = field(default_factory=collections.OrderedDict, repr=False)
    _reads: dict = field(default_factory=dict, repr=False)   # what each node list reads
    _seen: collections.OrderedDict = field(default_factory=collections.OrderedDict, repr=False)
    _fold_only: dict = field(default_factory=dict, repr=False)   # signatures that cannot compile

    # ------------------------------------------------------------------ planning
    def _abstract(self, nodes: list, env: Mapping[str, Any]) -> dict:
        """Every tensor ``nodes`` see, traced abstractly on ``env`` (NumPy values known at
        compile time, ShapeDtypeStructs of run-time ones): NumPy where it folds, else its
        ShapeDtypeStruct."""
        sub = dataclasses.replace(self.graph, nodes=list(nodes))
        dyn = {k: v for k, v in env.items() if isinstance(v, jax.ShapeDtypeStruct)}
        fixed = {k: v for k, v in env.items() if k not in dyn}
        folded: dict = {}
        skip = set(self.graph.initializers) - set(env)   # always there: not part of a plan

        def fn(feeds: dict) -> dict:
            e = trace(sub, {**feeds, **fixed}, config=self.config, training=self.training).env
            e = {k: v for k, v in e.items() if k not in skip and v is not None
                 and not isinstance(v, list)}   # sequences: not planned on
            folded.update((k, np.asarray(v)) for k, v in e.items() if is_static(v))
            return {k: v for k, v in e.items() if k not in folded}
        return {**jax.eval_shape(fn, dyn), **folded}

    def _plan(self, nodes: tuple, env: Mapping[str, Any]) -> Stage:
        """Cut ``nodes`` at their first data-dependent nodes whose shape-deciding inputs are
        run-time values (given ``env``): one abstract trace per round of such nodes met."""
        deciding = {i: ids for i, n in enumerate(nodes)
                    if (ids := shape_deciding_inputs(self.graph, n))}
        cuts: set = set()
        folds: set = set()
        while True:
            gone = _after(nodes, cuts)
            undecided = [i for i in deciding if i not in cuts | folds and i not in gone]
            stop = set(undecided) | cuts
            later = _after(nodes, stop) | stop
            segment = [n for i, n in enumerate(nodes) if i not in later]
            known = self._abstract(segment, env)
            if not undecided:
                break
            for i in undecided:
                vals = [known.get(t, self.graph.initializers.get(t)) for t in deciding[i]]
                if any(v is None for v in vals):
                    continue   # after another undecided node: the next round
                (cuts if any(isinstance(v, jax.ShapeDtypeStruct) for v in vals) else folds).add(i)
            if not cuts.union(folds).intersection(undecided):   # cannot happen (graph order)
                raise popart_exception(f"Data-dependent shapes: cannot order "
                                       f"{[nodes[i].describe() for i in undecided]}")
        cut_nodes = [nodes[i] for i in sorted(cuts)]
        if cut_nodes and self.training:
            n = cut_nodes[0]
            raise UnsupportedOperatorError(
                f"{n.describe()}: its output shape depends on the values of run-time tensors "
                f"{list(shape_deciding_inputs(self.graph, n))}, which a training step (one "
                f"compiled program, differentiated whole) cannot have; an InferenceSession "
                f"and the ONNX backend run such a node on the host between compiled segments "
                f"(docs/data_dependent_shapes.md)")
        rest = tuple(nodes[i] for i in sorted(_after(nodes, cuts)))
        read_later = {t for n in (*cut_nodes, *rest) for t in reads(n)} | set(self.outputs)
        made = dict.fromkeys(o for n in segment for o in n.outputs if o)
        gives = [t for t in made if t in read_later]
        taken = dict.fromkeys(t for n in segment for t in reads(n))
        return Stage(segment, [t for t in taken if isinstance(env.get(t), jax.ShapeDtypeStruct)],
                     gives, cut_nodes, rest, known)

    def _key(self, nodes: tuple, env: Mapping[str, Any]) -> tuple:
        """What the plan of ``nodes`` depends on: which nodes, and ``env``'s signature."""
        which = tuple(map(id, nodes))
        if which not in self._reads:
            self._reads[which] = list(dict.fromkeys(t for n in nodes for t in reads(n)))
        return which, _signature(env, [t for t in self._reads[which] if t in env])

    def _stage(self, nodes: tuple, env: Mapping[str, Any], depth: int,
               key: Optional[tuple] = None) -> Stage:
        """The plan of ``nodes`` for ``env``'s shapes, from the cache or planned now."""
        key = key or self._key(nodes, env)
        stage = self._stages.get(key)
        if stage is not None:
            self._stages.move_to_end(key)
            self.reused += 1
            return stage
        stage = self._stages[key] = self._plan(nodes, env)
        self.compiled += 1
        if len(self._stages) > self.cache_size:
            self._stages.popitem(last=False)
        if depth or stage.cuts:
            shapes = ", ".join(f"{t}{list(env[t].shape)}" for t in stage.reads)
            host = ", ".join(n.describe() for n in stage.cuts) or "none"
            _logger.info(f"Data-dependent shapes: planned segment {depth} ({len(stage.segment)} "
                         f"ops) for {shapes or 'no run-time inputs'}, then on the host: {host}; "
                         f"{len(self._stages)}/{self.cache_size} segments cached "
                         f"({self.compiled} compiled, {self.reused} reused)")
        return stage

    def has_cuts(self, specs: Mapping[str, Any]) -> bool:
        """Whether the graph is cut for inputs of ``specs`` (ShapeDtypeStructs)."""
        return bool(self._stage(tuple(self.graph.nodes), {**self.static_feeds, **specs}, 0).cuts)

    # ------------------------------------------------------------------ shapes
    def infer(self, specs: Mapping[str, Any]) -> dict:
        """Every tensor's spec for inputs of ``specs`` (ShapeDtypeStructs); a tensor after a
        cut has -1 where its dimension varied between two probes of the host nodes (zeros,
        and small counting values)."""
        return self._infer(tuple(self.graph.nodes), {**self.static_feeds, **specs}, 0)

    def _infer(self, nodes: tuple, env: dict, depth: int) -> dict:
        stage = self._plan(nodes, env)
        if not stage.cuts:
            return stage.known
        found, failure = [], None
        for k in range(2):
            host = dict(stage.known)
            for node in stage.cuts:
                vals = {t: _probes(v)[k] if isinstance(v, jax.ShapeDtypeStruct) else v
                        for t in reads(node) for v in [self._value(host, t)]}
                outs = trace_node(node, self.graph, vals)
                host.update((t, jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype))
                            for t, v in zip(node.outputs, outs) if t and v is not None)
            try:
                found.append(self._infer(stage.rest, host, depth + 1))
            except popart_exception as e:   # a probe the rest cannot take (a Reshape, ...)
                failure = e
        if not found:
            raise failure
        return found[0] if len(found) == 1 else _merge(*found)

    # ------------------------------------------------------------------ running
    def __call__(self, feeds: Mapping[str, Any], key: Any = None) -> list:
        """One run: the outputs' values (NumPy, or device arrays) in the order of ``outputs``."""
        env: dict = {**self.static_feeds, **feeds}
        static = set(self.static_feeds) - set(feeds)   # values known at compile time
        key = jax.random.key(0) if key is None else key
        nodes = tuple(self.graph.nodes)
        for depth in itertools.count():
            planning = {t: v if t in static else _spec(v) for t, v in env.items()}
            which = self._key(nodes, planning)
            if depth and (which in self._fold_only or self.fold_first and
                          which not in self._stages and which not in self._seen):
                env.update(self._fold(nodes, env, jax.random.fold_in(key, depth), which))
                break
            try:
                stage = self._stage(nodes, planning, depth, which)
            except UnsupportedOperatorError as e:   # a value it needs when compiling, which
                if not depth or NOT_STATIC not in " ".join((str(e), *getattr(e, "__notes__", ()))):
                    raise                               # folding has: fold it from now on
                _logger.info(f"Data-dependent shapes: the nodes after a cut stay folded on the "
                             f"host ({e})")
                self._fold_only[which] = None
                continue
            if stage.fn is None:
                fixed = {t: env[t] for n in stage.segment for t in reads(n)
                         if t in static}
                stage.fn = graph_function(dataclasses.replace(self.graph, nodes=stage.segment),
                                          stage.gives, fixed, self.training, self.config)
            outs = stage.fn({t: env[t] for t in stage.reads}, jax.random.fold_in(key, depth))
            env.update(zip(stage.gives, outs))
            static.update(t for t, v in zip(stage.gives, outs) if isinstance(v, np.ndarray))
            if not stage.cuts:
                break
            for node in stage.cuts:   # on the host: the lowering folds on NumPy values
                vals = trace_node(node, self.graph,
                                  {t: np.asarray(self._value(env, t)) for t in reads(node)})
                env.update((t, v) for t, v in zip(node.outputs, vals) if t and v is not None)
            nodes = stage.rest
        return [self._value(env, o) for o in self.outputs]

    def _fold(self, nodes: tuple, env: Mapping[str, Any], key: Any, which: tuple) -> dict:
        """Run ``nodes`` on the host, each lowering on the values (folded, as constants are:
        no compile), for a shape signature seen for the first time; the values they make."""
        self._seen[which] = None
        if len(self._seen) > self.cache_size:
            self._seen.popitem(last=False)
        self.folded += 1
        sub = dataclasses.replace(self.graph, nodes=list(nodes))
        with jax.ensure_compile_time_eval():
            return trace(sub, {t: np.asarray(v) for t, v in env.items()}, key=key,
                         config=self.config, training=self.training).env

    def _value(self, env: Mapping[str, Any], tid: str) -> Any:
        return env[tid] if tid in env else self.graph.initializers[tid]


def graph_runner(graph: Graph, outputs: Sequence[str], static_feeds: Optional[Mapping[str, Any]] = None,
                 training: bool = False, config: Optional[EngineConfig] = None) -> Callable:
    """``graph_function``'s one-shot run, as :class:`Segmented` where the graph has nodes of
    data-dependent output shape (compiled segments only where such a node meets run-time
    values)."""
    if has_data_dependent(graph):
        return Segmented(graph, list(outputs), dict(static_feeds or {}), config, training)
    return graph_function(graph, outputs, static_feeds, training, config)
