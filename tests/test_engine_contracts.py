"""Contract tests of the engine's shape (issue 35, item 7): what a module may import, compare or
hold, scanned from the sources."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

import popart


# ---------------------------------------------------------------------------------------
# Backends per platform (issue 35, item 4): no lowering tests the platform; an override
# registered for a platform is used only there.

def _platform_comparisons(path: Path) -> list:
    """``file:line`` of each comparison in ``path`` with a device platform on either side
    (``ctx.platform == "cpu"``, ``platform in (...)``; ``is None`` and the host's
    ``sys.platform`` aside)."""
    def names_platform(e: ast.AST) -> bool:
        host = isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "sys"
        return not host and ((isinstance(e, ast.Attribute) and e.attr == "platform")
                             or (isinstance(e, ast.Name) and e.id == "platform"))
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Compare)
            and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
            and any(names_platform(e) for e in [node.left, *node.comparators])]


def test_no_lowering_tests_the_platform(tmp_path):
    """No module of src/ compares the device platform, lowerings in src/popart/ops/ above all:
    a platform's own lowering is an override registered for it (``registry.register(...,
    platform=)``), the rest of its knowledge a row of ``engine/backends.py``."""
    src = Path(popart.__file__).parent.parent
    assert [hit for path in sorted(src.rglob("*.py")) for hit in _platform_comparisons(path)] == []
    probe = tmp_path / "probe.py"   # the scan finds the comparisons it forbids
    probe.write_text('import sys\ndef f(ctx, platform):\n    return ctx.platform == "cpu" or '
                     'platform in ("gpu",) or sys.platform == "linux"\n')
    assert _platform_comparisons(probe) == ["probe.py:3", "probe.py:3"]


def test_a_backend_override_is_chosen_by_platform():
    """A toy op with a generic lowering (x + 1) and an override for a fake platform (x + 2):
    the engine's trace uses the override on that platform only, and ``registry.lookup`` falls
    back to the generic lowering elsewhere and before the override's opset."""
    from popart._ir.graph import Graph, Node
    from popart.engine import backends
    from popart.engine.lower import trace
    from popart.ops import registry

    registry.add("ToyBump", lambda ctx, x: x + 1, domain="test.h15", since=1)
    registry.add("ToyBump", lambda ctx, x: x + 2, domain="test.h15", since=2, platform="fakeplat")
    try:
        g = Graph(nodes=[Node("ToyBump", ["x"], ["y"], domain="test.h15")], inputs=["x"],
                  outputs=["y"], opsets={"ai.onnx": 13, "test.h15": 2})
        x = np.arange(3, dtype=np.float32)
        on = {p: np.asarray(trace(g, {"x": x}, platform=p).env["y"]) for p in ("cpu", "fakeplat")}
        np.testing.assert_array_equal(on["cpu"], x + 1)
        np.testing.assert_array_equal(on["fakeplat"], x + 2)
        assert backends.backend("fakeplat").lookup("test.h15", "ToyBump", 1).lower(None, 1) == 2
        assert backends.backend("fakeplat").lookup("test.h15", "ToyBump", 2).lower(None, 1) == 3
        assert registry.lookup("test.h15", "ToyBump", 2, platform="gpu").lower(None, 1) == 2
        assert [o for o in registry.registered_ops() if o[1] == "ToyBump"] == \
            [("test.h15", "ToyBump", [1])]   # overrides are no ops of their own
    finally:
        registry._REGISTRY.pop(("test.h15", "ToyBump"))
        registry._OVERRIDES.pop(("fakeplat", "test.h15", "ToyBump"))


def test_the_cpu_backend_holds_onednn_and_the_conv_budget():
    """Conv's CPU override is the oneDNN / im2col dispatch and the generic Conv is XLA's; the
    vectorisation budget and the custom-call targets are the backends' facts."""
    from popart.engine import backends, onednn
    from popart.ops import nn, registry

    cpu, gpu = backends.backend("cpu"), backends.backend("cuda")
    assert cpu.lookup("ai.onnx", "Conv", 11).lower.__wrapped__ is nn.conv_cpu
    assert gpu.lookup("ai.onnx", "Conv", 11).lower.__wrapped__ is nn.conv
    assert registry.lookup("ai.onnx", "ConvTranspose", 11).lower.__wrapped__ is nn.conv_transpose
    assert cpu.vector_budget({"Conv", "Relu"}) == 1 and cpu.vector_budget({"MatMul"}) == 1 << 26
    assert gpu.vector_budget({"Conv"}) == 1 << 26
    assert onednn.TARGET in backends.custom_call_targets() and not gpu.custom_call_targets
    assert gpu.keeps_barriers and not cpu.keeps_barriers
    assert (cpu.remote_buffer_memory, gpu.remote_buffer_memory) == ("device", "pinned_host")


# ---------------------------------------------------------------------------------------
# Optimizers that chain (issue 35, item 5): the engine never branches on an optimizer's
# type name; a new optimizer is one class, written as a chain of parts.

def _type_name_branches(path: Path) -> list:
    """``file:line`` of each place in ``path`` that branches on ``<x>.type_name()``: a
    comparison (``==``, ``!=``, ``in``) with it on either side, a subscript by it, or a
    ``.get(...)`` / ``.setdefault(...)`` lookup by it."""
    def calls_type_name(e: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                   and n.func.attr == "type_name" for n in ast.walk(e))
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            found = any(calls_type_name(e) for e in [node.left, *node.comparators])
        elif isinstance(node, ast.Subscript):
            found = calls_type_name(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "setdefault", "pop"):
            found = any(calls_type_name(a) for a in node.args[:1])
        else:
            found = False
        if found:
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_the_engine_never_branches_on_the_optimizers_type_name(tmp_path):
    """src/popart/engine/ asks the optimizer (its compound scalars, accumulator, state, the
    chain) and never compares ``type_name()``; keeping it as data (a cache key) is fine."""
    engine = Path(popart.__file__).parent / "engine"
    assert [hit for path in sorted(engine.rglob("*.py"))
            for hit in _type_name_branches(path)] == []
    probe = tmp_path / "probe.py"   # the scan finds each form it forbids, and only those
    probe.write_text('def f(opt, table):\n'
                     '    a = opt.type_name() == "SGD"\n'
                     '    b = opt.type_name() in ("Adam", "Adaptive")\n'
                     '    c = table[opt.type_name()]\n'
                     '    d = table.get(opt.type_name(), None)\n'
                     '    return {"type": opt.type_name()}, a, b, c, d\n')
    assert _type_name_branches(probe) == ["probe.py:2", "probe.py:3", "probe.py:4", "probe.py:5"]


class _SignSGD(popart.Optimizer):
    """A user's optimizer, one class written only as a chain of parts: the unscaled
    gradient's sign, then ``w - lr * sign(g)`` with the weight's learning rate."""
    _TYPE = "SignSGD"
    _UNSET = {"learningRate": 0.1}

    def transform(self):
        import jax.numpy as jnp
        from popart.optimizers import chain, map_grads, rule_part, unscale_part
        return chain(unscale_part(), map_grads(jnp.sign),
                     rule_part(self, lambda w, g, s, h, ls, sum_squares:
                               (w - h["learningRate"] * g, {})))


def test_a_user_defined_optimizer_trains_a_session_with_numpys_numbers():
    """Sign-SGD on ``sum((x @ w - t)^2)`` for three steps, a runtime learning rate changed
    by updateOptimizerFromHost before the third: the weights NumPy's rule gives."""
    rs = np.random.RandomState(5)
    x0, t0 = rs.randn(4, 3).astype(np.float32), rs.randn(4, 2).astype(np.float32)
    w0 = rs.randn(3, 2).astype(np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 3]), "x")
    t = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 2]), "t")
    w = b.addInitializedInputTensor(w0, "w")
    d = b.aiOnnx.sub([b.aiOnnx.matmul([x, w]), t])
    loss = b.aiOnnx.reducesum([b.aiOnnx.mul([d, d])], keepdims=False)
    opt = _SignSGD({"defaultLearningRate": (0.05, False), "lossScaling": (4.0, True)})
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss, opt,
                               popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    want = w0.astype(np.float64)
    for lr in (0.05, 0.05, 0.02):
        if lr != 0.05:
            s.updateOptimizerFromHost(_SignSGD({"defaultLearningRate": (lr, False),
                                                "lossScaling": (4.0, True)}))
        s.run(popart.PyStepIO({x: x0, t: t0}, s.initAnchorArrays()))
        want = want - lr * np.sign(2 * x0.T @ (x0 @ want - t0))
    got = {w: np.zeros_like(w0)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(got))
    np.testing.assert_allclose(got[w], want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# One device state (issue 35, item 2): one replicated-tensor-sharding rule, engine/state.py's
# ReplicaShards, for popart's sessions (placed or not) and popxl's replica-sharded variables.

def _shard_padding(path: Path) -> list:
    """``file:line`` of each padding call (``np.pad``, ``jnp.pad``, ``numpy.pad``) and each
    ceiling division written as ``-(-a // b)`` in ``path``: how a shard size or a padded
    stored form is computed."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        pad = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "pad" and isinstance(node.func.value, ast.Name) \
            and node.func.value.id in ("np", "jnp", "numpy")
        ceil = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
            and isinstance(node.operand, ast.BinOp) and isinstance(node.operand.op, ast.FloorDiv) \
            and isinstance(node.operand.left, ast.UnaryOp) and isinstance(node.operand.left.op, ast.USub)
        if pad or ceil:
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_one_rts_implementation(tmp_path):
    """Only engine/state.py pads or splits a tensor into replica shards: the engine's other
    modules (popart's RTS in rts.py, the placed program's slots) and popxl (its
    replica-sharded variables) use its ReplicaShards. The op lowerings of the collectives (src/popart/ops/collectives.py) are
    the ops' own semantics, not stored state, and are not scanned."""
    import popxl
    src = Path(popart.__file__).parent
    files = sorted((src / "engine").glob("*.py")) + sorted(Path(popxl.__file__).parent.rglob("*.py"))
    hits = [h for p in files if p.name != "state.py" for h in _shard_padding(p)]
    assert hits == []
    assert _shard_padding(src / "engine" / "state.py") != []   # the one place
    probe = tmp_path / "probe.py"   # the scan finds what it forbids
    probe.write_text("import numpy as np\nn = -(-7 // 2)\nx = np.pad(np.ones(3), (0, 1))\n")
    assert _shard_padding(probe) == ["probe.py:2", "probe.py:3"]


def _reference_shards(data: np.ndarray, assignment: list, shard_over: int) -> np.ndarray:
    """PopART's rule for a constant-stride replica grouping, written out: each group's value
    flattened and zero padded to a multiple of ``shard_over``; the k-th replica of a group
    (in replica order) holds shard k mod ``shard_over``."""
    groups = sorted(set(assignment))
    rows = data.reshape(len(groups), -1)
    size = -(-rows.shape[1] // shard_over)
    padded = np.zeros((len(groups), size * shard_over), data.dtype)
    padded[:, :rows.shape[1]] = rows
    out = []
    for r, g in enumerate(assignment):
        k = [q for q, h in enumerate(assignment) if h == g].index(r) % shard_over
        out.append(padded[groups.index(g), k * size:(k + 1) * size])
    return np.stack(out)


def test_replica_shards_follow_popart_rule_for_groupings():
    """engine/state.ReplicaShards, the one RTS rule: the shards popxl's replica groupings give
    (replicas, stride, group size, shards per group) are PopART's rule written out in NumPy;
    put together again they give each group's value; ``over_all`` is popart's sessions'
    form (replica r holds shard r of one group)."""
    from popart.engine.state import ReplicaShards
    from popxl import ReplicaGrouping
    rs = np.random.RandomState(0)
    for R, stride, size, k in [(8, 1, 8, 8), (8, 1, 8, 4), (8, 2, 4, 2), (8, 4, 2, 2),
                               (4, 1, 2, 1), (4, 2, 2, 2)]:
        g = ReplicaGrouping(R, stride, size)
        shards = ReplicaShards((3, 5), k, g.assignment)
        data = rs.randn(*((g.num_groups,) if g.num_groups > 1 else ()), 3, 5).astype(np.float32)
        got = shards.to_replicas(data)
        np.testing.assert_array_equal(got, _reference_shards(data, g.assignment, k))
        np.testing.assert_array_equal(shards.group_values(got), data.reshape(-1, 3, 5))
    whole = ReplicaShards.over_all((7,), 4)
    x = np.arange(7, dtype=np.float32)
    np.testing.assert_array_equal(whole.flat(x).reshape(4, 2), whole.to_replicas(x))
    np.testing.assert_array_equal(whole.whole(whole.flat(x)), x)


# ---------------------------------------------------------------------------------------
# Facts as values (issue 35, item 1): an abstract trace returns what it learns (checks,
# types, where outputs are) as a value, compiled.Facts, not by writing into closures.

def test_facts_come_back_as_values_through_vmap_and_shard_map():
    """A step's facts are its last output, a ``compiled.Facts``: ``plan_trace`` gets them
    from one ``jax.eval_shape`` through ``vmap`` over the replicas and through the placed
    programs' ``shard_map`` (``placed.run_on_mesh``), the other outputs as their types."""
    import jax
    import jax.numpy as jnp
    from popart.engine.compiled import REPLICA_AXIS, Facts, plan_trace
    from popart.engine.placed import run_on_mesh

    def replica(x):
        return x * 2, Facts(shape=x.shape, replica_axis=REPLICA_AXIS)

    spec = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    outs, facts = plan_trace(jax.vmap(replica, axis_name=REPLICA_AXIS, axis_size=4), spec)
    assert outs == (jax.ShapeDtypeStruct((4, 3), jnp.float32),)
    assert facts == {"shape": (3,), "replica_axis": REPLICA_AXIS}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), (REPLICA_AXIS,))
    P = jax.sharding.PartitionSpec
    sharded = jax.ShapeDtypeStruct((4, 3), jnp.float32,
                                   sharding=jax.sharding.NamedSharding(mesh, P(REPLICA_AXIS)))
    step = run_on_mesh(replica, mesh, P(REPLICA_AXIS), (P(REPLICA_AXIS), P()))
    outs, facts = plan_trace(step, sharded)
    assert outs[0].shape == (4, 3) and facts["shape"] == (2, 3)   # each device's block


# ---------------------------------------------------------------------------------------
# A shared engine (issue 35, items 3 and 7): the module graph of src/, scanned from the
# sources, counting imports at any depth of a file (function-local ones too).

SRC = Path(popart.__file__).parent.parent
# Front-end modules the engine may not import: each name covers its submodules and, for
# ``session`` and ``cli``, its ``session_*`` / ``cli_*`` siblings; the ``popart`` package
# itself (which imports every front-end) is matched alone.
FRONT_ENDS = ("popart.session", "popart.options", "popart.optimizers",
              "popart.dataflow", "popart.builder", "popart.report", "popart.distributed",
              "popart.writeback", "popart.run_plan", "popart.cli", "popart.horovod", "popxl")


def module_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``src`` it imports, anywhere in its file. A package is its
    ``__init__``. ``import a.b.c`` is an edge to ``a.b.c``; ``from m import y`` to ``m.y`` when
    that is a module, else to ``m`` (relative forms resolved against the file's package).
    Importing a submodule runs its parent packages' ``__init__`` first, but that is no edge:
    the submodule depends on none of the package's names, and a cycle would need the package
    to import back (which its re-exports, edges from the package, show). Imports under ``if
    TYPE_CHECKING:`` never run and are left out, as are modules outside ``src`` (the
    standard library, jax, ...)."""
    files = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        files[".".join(parts[:-1] if package else parts)] = (path, package)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, (path, package) in files.items():
        here = mod if package else mod.rpartition(".")[0]
        out = graph.setdefault(mod, set())
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                out.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    target = sub if sub in files else known(base)
                    if target:
                        out.add(target)
        out.discard(mod)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def test_the_module_graph_scan_sees_every_form(tmp_path):
    """The scan itself: absolute, relative, submodule-by-name and function-local imports, a
    package's re-exports, and a cycle they make."""
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("import pk.b\ndef f():\n    if True:\n        from .sub import c\n")
    (pkg / "b.py").write_text("from pk.sub.c import g\nimport json\nif TYPE_CHECKING:\n"
                              "    import pk\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom . import missing\n")
    graph = module_graph(tmp_path)
    assert graph == {"pk": {"pk.a"}, "pk.a": {"pk.b", "pk.sub.c"}, "pk.b": {"pk.sub.c"},
                     "pk.sub": set(), "pk.sub.c": {"pk.a", "pk.sub"}}
    assert import_cycles(graph) == [["pk.a", "pk.b", "pk.sub.c"]]


def _under(module: str, names: tuple) -> bool:
    return module == "popart" or any(module == n or module.startswith(n + ".") or
               (n in ("popart.session", "popart.cli") and module.startswith(n + "_"))
               for n in names)


def test_the_engine_imports_no_front_end_module():
    """src/popart/engine/ (and its subpackages) imports none of the front-ends' modules, at
    any depth of a file: option facts come as ``engine.config.EngineConfig``, the gradient
    norms protocol is ``engine.norms``, reports plug in through ``engine.hooks``."""
    graph = module_graph(SRC)
    engine = {m: sorted(t for t in ts if _under(t, FRONT_ENDS))
              for m, ts in graph.items() if m == "popart.engine" or m.startswith("popart.engine.")}
    assert len(engine) > 10 and {m: ts for m, ts in engine.items() if ts} == {}
    assert _under("popart.session_checks", FRONT_ENDS) and _under("popart.cli_inputs", FRONT_ENDS)
    assert not _under("popart.errors", FRONT_ENDS) and not _under("popart._ir.graph", FRONT_ENDS)


def test_no_import_cycle_among_src_modules():
    """No import cycle among src/'s modules, counting function-local imports: popxl's lower
    modules reach the ones above them only through what those register when imported (the
    ops ``popxl.tensor`` calls, the binding classes ``popxl.context`` uses), the ops'
    submodules import the ops from ``popxl.ops._core``, not through the package, and the
    ``popart`` package reaches no popxl module (popxl-addons' binding stand-ins set a meta
    shape through the binding handle's ``info``; ``popart._internal.ir`` imports popxl, and no
    popxl module imports it)."""
    graph = module_graph(SRC)
    assert len(graph) > 100 and import_cycles(graph) == []


def test_the_engine_config_is_frozen_and_read_from_the_options_in_one_place():
    """popart's options reach the engine only as ``session_config.engine_config``'s frozen
    ``EngineConfig``: the facts that shape the program are in it and in its cache key, where
    the engine cache lives is not in the key."""
    import dataclasses

    import pytest

    from popart.engine.config import WEIGHTS, EngineConfig
    from popart.session_config import engine_config

    o = popart.SessionOptions()
    base = engine_config(o)
    assert base == dataclasses.replace(EngineConfig(), locations=base.locations)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.pipelining = True
    o.enablePipelining, o.groupNormStridedChannelGrouping = True, True
    o.autoRecomputation = popart.RecomputationType.Standard
    o.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    o.weightTensorLocationSettings.location.replicatedTensorSharding = \
        popart.ReplicatedTensorSharding.On
    o.automaticLossScalingSettings.toTrackTensors = ["a", "b"]
    c = engine_config(o)
    assert (c.pipelining, c.group_norm_strided, c.recompute, c.mean_reduction, c.running_mean) \
        == (True, True, "Standard", True, False)
    assert c.locations.rules[WEIGHTS].location.sharded and c.als.toTrackTensors == ("a", "b")
    assert c.signature != base.signature and c.cache_path is None
    o.enableEngineCaching, o.cachePath = True, "/somewhere"
    cached = engine_config(o)
    assert cached.cache_path == "/somewhere" and cached.signature == c.signature


# ---------------------------------------------------------------------------------------
# One abstract trace (issue 35, item 1): a popart session traces its graph once, at
# construction, for both the TensorInfos (getInfo, the construction checks) and the step's
# facts (the plan); the compile traces the step it compiles.

def _count_graph_traces(monkeypatch) -> list:
    """Patch ``engine.lower.trace`` in every popart module that calls it; returns the list
    each call of it appends its graph to."""
    import sys

    from popart.engine import lower

    calls, real = [], lower.trace

    def counting(graph, *args, **kwargs):
        calls.append(graph)
        return real(graph, *args, **kwargs)
    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("popart") \
                and getattr(module, "trace", None) is real:
            monkeypatch.setattr(module, "trace", counting)
    return calls


def _one_layer(training: bool) -> tuple:
    """x [2, 3] @ w [3, 4] -> softmax -> (training) an Nll loss with labels [2]."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([x, w])], axis=1)
    if not training:
        return b.getModelProto(), probs, None
    label = b.addInputTensor(popart.TensorInfo("INT32", [2]), "label")
    loss = b.aiGraphcore.nllloss([probs, label], popart.ReductionType.Mean)
    return b.getModelProto(), probs, loss


def test_a_popart_session_traces_its_graph_once_before_compiling(monkeypatch):
    """Constructing a session and planning its step (``_plan``: anchors, trainable weights,
    checks) trace the model's graph once, abstractly (``program.trace_step``, at
    construction); ``prepareDevice``'s compile then traces the step it compiles, once more.
    Before issue 35 item 1: twice before the compile (shape inference, then the plan)."""
    calls = _count_graph_traces(monkeypatch)
    for training in (False, True):
        proto, probs, loss = _one_layer(training)
        dataflow = popart.DataFlow(1, {probs: popart.AnchorReturnType("All")})
        device = popart.DeviceManager().createCpuDevice()
        whole = lambda: sum(any(probs in n.outputs for n in g.nodes) for g in calls)
        del calls[:]
        if training:
            s = popart.TrainingSession(proto, dataflow, loss, popart.ConstSGD(0.1), device)
        else:
            s = popart.InferenceSession(proto, dataflow, device)
        assert whole() == 1 and s.getInfo(probs).shape() == [2, 4]
        s._plan()
        assert whole() == 1, f"training={training}: the plan traced the graph again"
        s.prepareDevice()
        assert whole() == 2   # the compile's trace of the step
        s.weightsFromHost()
        anchors = s.initAnchorArrays()
        feeds = {"x": np.ones((2, 3), np.float32)}
        if training:
            feeds["label"] = np.array([0, 3], np.int32)
        s.run(popart.PyStepIO(feeds, anchors))
        e = np.exp(np.ones((2, 3)) @ (np.arange(12).reshape(3, 4) / 10))
        assert np.allclose(anchors[probs], e / e.sum(1, keepdims=True), atol=1e-6)


def test_the_loss_shape_error_comes_at_construction_from_the_one_trace(monkeypatch):
    """A loss of more than one element: PopART's error (Ir::setFinalLoss) at construction,
    raised by the step's trace, which ran once."""
    import pytest

    calls = _count_graph_traces(monkeypatch)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 4), np.float32), "w")
    y = b.aiOnnx.matmul([x, w])
    with pytest.raises(popart.popart_exception, match=f"Loss tensor, '{y}', must be a scalar"):
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [y]), y,
                               popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice())
    assert sum(any(y in n.outputs for n in g.nodes) for g in calls) == 1


# ---------------------------------------------------------------------------------------
# Stages (issue 35, items 1-3): a frozen StepPlan made once by StepProgram.plan, one step
# builder (engine/step.py) for the unplaced and the placed schedules, one state packing.

def _self_assignments(path: Path, cls: str) -> dict[str, set]:
    """Per method of class ``cls`` in ``path``, the attributes of ``self`` it assigns."""
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: dict[str, set] = {}
    for fn in [n for n in klass.body if isinstance(n, ast.FunctionDef)]:
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) \
                            and e.value.id == "self":
                        out.setdefault(fn.name, set()).add(e.attr)
    return out


def _program_attribute_writes(path: Path) -> list:
    """``file:line`` of each assignment to an attribute of a step program held in a name
    (``program.uses_rng = True``, ``prog.placed = ...``)."""
    names = {"program", "prog", "train", "_program"}
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and (
                        (isinstance(e.value, ast.Name) and e.value.id in names) or
                        (isinstance(e.value, ast.Attribute) and e.value.attr in names)):
                    hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_no_step_program_attribute_is_assigned_after_planning(tmp_path):
    """StepProgram assigns its attributes in ``__init__`` and ``plan`` only (``compile``: the
    compiled step, nothing else), and no module assigns a program's attribute from outside
    (what changed after planning before, ``keyless``, ``uses_rng``, ``_key_spec``, ``placed``,
    are facts of the plan, its parts or the packing)."""
    engine = Path(popart.__file__).parent / "engine"
    writes = _self_assignments(engine / "program.py", "StepProgram")
    assert set(writes) == {"__init__", "plan", "compile"}, writes
    assert writes["compile"] == {"step"}
    assert writes["plan"] == {"facts", "parts", "placed", "packing"}
    src = Path(popart.__file__).parent.parent
    assert [hit for p in sorted(src.rglob("*.py")) for hit in _program_attribute_writes(p)] == []
    probe = tmp_path / "probe.py"   # the scans find what they forbid
    probe.write_text("class StepProgram:\n    def __init__(self):\n        self.a = 1\n"
                     "    def run(self):\n        self.b, self.c = 1, 2\n"
                     "def f(program, s):\n    program.uses_rng = True\n    s._program.placed = 1\n")
    assert _self_assignments(probe, "StepProgram") == {"__init__": {"a"}, "run": {"b", "c"}}
    assert _program_attribute_writes(probe) == ["probe.py:7", "probe.py:8"]


def test_the_plan_is_frozen_and_a_run_changes_no_program_attribute():
    """A training session's program, planned: its StepPlan cannot be assigned to, and
    compiling and running the step leave every attribute of the program the same object
    but the compiled step; the numbers are NumPy's SGD step on the model."""
    import dataclasses

    import pytest

    proto, probs, loss = _one_layer(True)
    s = popart.TrainingSession(proto, popart.DataFlow(1, {probs: popart.AnchorReturnType("All")}),
                               loss, popart.ConstSGD(0.5), popart.DeviceManager().createCpuDevice())
    s._plan()
    program = s._program
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.facts.trainable = []
    before = dict(vars(program))
    s.prepareDevice()
    s.weightsFromHost()
    x, label = np.ones((2, 3), np.float32), np.array([0, 3], np.int32)
    s.run(popart.PyStepIO({"x": x, "label": label}, s.initAnchorArrays()))
    after = dict(vars(program))
    assert set(after) == set(before)
    assert [k for k in before if after[k] is not before[k]] == ["step"]
    w = np.arange(12, dtype=np.float64).reshape(3, 4) / 10   # NumPy: one SGD step
    e = np.exp(x @ w)
    p = e / e.sum(1, keepdims=True)
    onehot = np.eye(4)[label]
    w_new = w - 0.5 * x.T @ ((p - onehot) / 2)
    out = {"w": np.empty((3, 4), np.float32)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(out))
    np.testing.assert_allclose(out["w"], w_new, atol=1e-6)


def test_placed_step_is_built_from_the_step_builder_without_the_program():
    """engine/pipeline.py names StepProgram only where it makes one (``plan_program``): the
    placed step, its schedule and stages read the plan through ``step.StepParts``; the
    accumulation, its mean reduction and the update's anchors are defined once
    (``step.StepParts``), the running mean's formula and the Mean division nowhere else in
    the engine."""
    engine = Path(popart.__file__).parent / "engine"
    tree = ast.parse((engine / "pipeline.py").read_text())
    users = {fn.name for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.ClassDef))
             for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == "StepProgram"}
    assert users <= {"plan_program"}, users
    private = [f"pipeline.py:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
               and isinstance(n.value, ast.Name) and n.value.id in ("prog", "parts", "program")
               and n.attr.startswith("_")]
    assert private == []
    for path in sorted(engine.glob("*.py")):
        text = path.read_text()
        if path.name != "step.py":
            assert "running_mean" not in text or path.name in ("config.py", "step_plan.py"), path
            assert "(count / n)" not in text and "/ (A * R)" not in text, path


def test_both_schedules_build_from_the_same_parts(monkeypatch):
    """Compiling an unplaced and a placed (pipelined, two IPUs) training step: each calls the
    step builder's accumulation, mean reduction and anchor reduction; the two give the same
    losses (the unplaced step's NumPy references: tests/test_training.py,
    tests/test_model_parallel.py)."""
    from popart.engine import step as _step

    calls: dict = {}
    for name in ("accumulate", "mean_reduce", "after_update", "reduce_anchors"):
        real = getattr(_step.StepParts, name)

        def counting(self, *a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *a, **k)
        monkeypatch.setattr(_step.StepParts, name, counting)

    def train(placed: bool) -> np.ndarray:
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
        lab = b.addInputTensor(popart.TensorInfo("INT32", [2]), "label")
        rs = np.random.RandomState(0)
        h = x
        for i in range(2):
            with b.virtualGraph(i), b.pipelineStage(i):
                w = b.addInitializedInputTensor(rs.randn(3, 3).astype(np.float32), f"w{i}")
                h = b.aiOnnx.matmul([h, w])
        with b.virtualGraph(1), b.pipelineStage(1):
            loss = b.aiGraphcore.nllloss([b.aiOnnx.softmax([h], axis=1), lab],
                                         popart.ReductionType.Mean)
        o = popart.SessionOptions()
        o.enableGradientAccumulation, o.accumulationFactor = True, 2
        if placed:
            o.virtualGraphMode, o.enablePipelining = popart.VirtualGraphMode.Manual, True
        dev = popart.DeviceManager().acquireAvailableDevice(2 if placed else 1)
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, {loss: popart.AnchorReturnType("All")}),
                                   loss, popart.SGD({"defaultLearningRate": (0.1, False),
                                                     "defaultMomentum": (0.9, False)}), dev,
                                   userOptions=o)
        s.prepareDevice()
        assert (s._program.placed is not None) == placed
        s.weightsFromHost()
        anchors = s.initAnchorArrays()
        feeds = {"x": np.random.RandomState(1).randn(2, 2, 2, 3).astype(np.float32),
                 "label": np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32).reshape(2, 2, 2)}
        s.run(popart.PyStepIO(feeds, anchors))
        return anchors[loss]

    plain = train(False)
    assert {k: v > 0 for k, v in calls.items()} == dict.fromkeys(
        ("accumulate", "mean_reduce", "reduce_anchors"), True)
    calls.clear()
    placed = train(True)
    assert {k: v > 0 for k, v in calls.items()} == dict.fromkeys(
        ("accumulate", "mean_reduce", "reduce_anchors"), True)
    np.testing.assert_allclose(placed, plain, rtol=1e-5, atol=1e-6)


def _placement_switches(path: Path, names: set) -> list:
    """``function:line`` of each ``if`` (statement or expression) on one of ``names``
    (``if self.placed is not None``, ``x if placed else y``) in ``path``."""
    hits = []
    for fn in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]:
        for node in ast.walk(fn):
            if isinstance(node, (ast.If, ast.IfExp)) and any(
                    (isinstance(e, ast.Name) and e.id in names) or
                    (isinstance(e, ast.Attribute) and e.attr in names) for e in ast.walk(node.test)):
                hits.append(f"{fn.name}:{node.lineno}")
    return hits


def test_the_state_packing_is_chosen_once_with_the_placement(tmp_path):
    """StepProgram (popart) and popxl's step ask their packing (``engine/packing.py``,
    ``popxl/_step.py packing``) instead of switching on the placement: the only test of
    ``placed`` is where the packing is chosen."""
    src = Path(popart.__file__).parent.parent
    assert [h for h in _placement_switches(src / "popart/engine/program.py", {"placed"})
            if not h.startswith("plan:")] == []
    assert [h for h in _placement_switches(src / "popxl/_step.py", {"placed"})
            if not h.startswith("packing:")] == []
    probe = tmp_path / "probe.py"
    probe.write_text("def put(self, x):\n    if self.placed is not None:\n        return 1\n"
                     "    return 2 if placed else 3\n")
    assert _placement_switches(probe, {"placed"}) == ["put:2", "put:4"]


# ---------------------------------------------------------------------------------------
# IpuCopy ops are nodes of the graph (issue 35, item 2): PopART's InterIpuCopy inserts them
# (``_ir/interipucopy.py``); both placed schedules and the IR JSON read them there, and no
# stage plan holds copy data.

def _copies_reads(path: Path) -> list:
    """``file:line`` of each ``<x>.copies`` in ``path`` whose ``<x>`` is not a graph after
    InterIpuCopy (a name or attribute ``graph``)."""
    def graph(e: ast.AST) -> bool:
        return (isinstance(e, ast.Name) and e.id == "graph") or \
            (isinstance(e, ast.Attribute) and e.attr == "graph")
    return [f"{path.name}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr == "copies" and not graph(n.value)]


def test_the_schedules_read_the_graphs_ipu_copy_nodes_not_stage_plan_data(tmp_path):
    """The stage plan and the executor hold no copy lists; popart's pipeline ticks, popxl's
    in-order run and ir_json read ``.copies`` only of the graph after InterIpuCopy; the
    in-order run gives a stage its tensor by the id of the graph's IpuCopy node (a node
    named here, not PopART's: whatever the graph says)."""
    import dataclasses

    from popart._ir.graph import Node
    from popart._ir.interipucopy import CopiedStages
    from popart.engine import placed
    assert not hasattr(placed.StagePlan, "copies")
    assert "copies" not in {f.name for f in dataclasses.fields(placed.Executor)}
    assert not {"in_order_copies", "inter_ipu_copies", "ipu_copy_node"} & set(vars(placed))
    src = Path(popart.__file__).parent.parent
    for f in ("popart/engine/placed.py", "popart/engine/pipeline.py", "popxl/_placement.py",
              "popart/ir_json.py"):
        assert _copies_reads(src / f) == [], f
    probe = tmp_path / "probe.py"
    probe.write_text("a = plan.copies\nb = self.graph.copies\nc = graph.copies\n")
    assert _copies_reads(probe) == ["probe.py:1"]

    plan = placed.plan_stages([Node("Relu", ["x"], ["a"]), Node("Neg", ["a"], ["b"])],
                              lambda n: 0 if n.outputs == ["a"] else 1)
    node = Node("IpuCopy", ["a"], ["moved"], {"sourceIpu": 0, "destIpu": 1}, "ai.graphcore")
    graph = CopiedStages(((), (node,)), ((), ()), ({}, {"a": "moved"}))
    run, got = placed.InOrder(plan, 2, graph, lambda t: None), {}
    run.run(0, lambda st, received: (st, {"a": np.float32(3)}), None, {})
    run.at["a"].add(1)   # already on IPU 1 (as a repeat's input moves it): no device copy

    def stage1(st, received):
        got.update(received)
        return st, {"b": -received["moved"]}
    run.run(1, stage1, None, {})
    assert got == {"moved": np.float32(3)} and run.where("moved") == {1}


def test_one_placed_packing_serves_both_front_ends():
    """popart's ``PlacedPlan`` and popxl's ``MainPlan`` pack, unpack, spec and shard their IPU
    slots with ``placed.ExecutorPlan``'s methods (none overridden; the executor packs
    nothing): popxl's per-replica packing is the shared one stacked over the replicas."""
    import dataclasses

    import jax

    from popart.engine import pipeline, placed
    from popart.engine.state import Home
    from popxl._placement import MainPlan
    shared = ("pack", "unpack", "slot_specs", "slot_shardings", "host_slots")
    for cls in (pipeline.PlacedPlan, MainPlan):
        assert issubclass(cls, placed.ExecutorPlan)
        assert not set(shared) & set(vars(cls)), cls
    assert not {"pack", "unpack", "state_specs", "state_shardings", "layout"} & \
        {*vars(placed.Executor), *(f.name for f in dataclasses.fields(placed.Executor))}

    specs = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((3,), np.float32)}
    layout = placed.IpuSlots("variables", specs, {"a": Home(0), "b": Home(1)}, 2)
    st = placed.plan_stages([], lambda n: 0)
    ex = placed.Executor(st, placed.placed_mesh(jax.devices(), 1, 2), placed.copied(st))

    class One(placed.ExecutorPlan):
        def layout_for(self, names):
            return layout

    class PerReplica(One):
        per_replica = True
    rs = np.random.RandomState(0)
    named = [{k: rs.randn(*v.shape).astype(np.float32) for k, v in specs.items()} for _ in range(2)]
    one, per = One(ex), PerReplica(ex)
    packed = one.pack(named[0])
    assert set(packed) == set(one.slot_specs(layout)) and packed[layout.slots["a"][1]].shape[0] == 2
    np.testing.assert_array_equal(packed[layout.slots["b"][1]][1, :3], named[0]["b"])   # IPU 1's block
    stacked = per.pack(named)
    for k, v in packed.items():
        np.testing.assert_array_equal(stacked[k][0], v)
        assert per.slot_specs(layout)[k].shape == (1,) + one.slot_specs(layout)[k].shape
    assert {k: v.tolist() for k, v in one.unpack(packed).items()} == \
        {k: v.tolist() for k, v in named[0].items()}


# ---------------------------------------------------------------------------------------
# popxl's step from the same builder (issue 35, item 1): one replica's graph run
# (``step.GraphRun``) serves popart's micro-batch and popxl's replica and placed stages;
# popxl's schedules (replicated, in order over IPUs) are arguments of ``step.state_step``.

def _lower_trace_uses(path: Path) -> list:
    """``file:line`` of each import of ``trace`` from ``engine.lower`` and each ``lower.trace``
    in ``path``."""
    hits = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("lower") and \
                any(a.name == "trace" for a in n.names):
            hits.append(f"{path.name}:{n.lineno}")
        elif isinstance(n, ast.Attribute) and n.attr == "trace" and \
                isinstance(n.value, ast.Name) and n.value.id == "lower":
            hits.append(f"{path.name}:{n.lineno}")
    return hits


def test_popxl_traces_its_step_only_through_the_step_builders_part(tmp_path):
    """No popxl module imports or calls ``engine.lower.trace``: its replica and its placed
    stages run their graphs with ``step.GraphRun``, whose module is the one step module that
    traces."""
    src = Path(popart.__file__).parent.parent
    assert [h for p in sorted((src / "popxl").rglob("*.py")) for h in _lower_trace_uses(p)] == []
    assert _lower_trace_uses(src / "popart/engine/step.py") != []
    probe = tmp_path / "probe.py"
    probe.write_text("from popart.engine.lower import CHECKS, trace\nfrom popart.engine import lower\n"
                     "t = lower.trace(g, {})\nu = self.trace\n")
    assert _lower_trace_uses(probe) == ["probe.py:1", "probe.py:3"]


def test_popart_and_popxl_steps_build_from_the_same_graph_run(monkeypatch):
    """Compiling a popart InferenceSession, a replicated popxl.Session and a placed one (a
    Gather on IPU 1) each runs its graph through ``step.GraphRun`` (popxl's schedules passed
    to ``step.state_step``); the programs give NumPy's numbers."""
    import popxl
    import popxl.ops as ops
    from helpers.popxl_case import gather_on_ipu1
    from popart.engine import step as _step

    calls: dict = {"run": 0, "state_step": 0}
    real_call, real_state_step = _step.GraphRun.__call__, _step.state_step

    def counting_call(self, *a, **k):
        calls["run"] += 1
        return real_call(self, *a, **k)

    def counting_state_step(*a, **k):
        calls["state_step"] += 1
        return real_state_step(*a, **k)
    monkeypatch.setattr(_step.GraphRun, "__call__", counting_call)
    monkeypatch.setattr(_step, "state_step", counting_state_step)
    monkeypatch.setattr("popxl._step.state_step", counting_state_step)

    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    y = b.aiOnnx.tanh([b.aiOnnx.matmul([x, b.addInitializedInputTensor(w)])])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, {y: popart.AnchorReturnType("All")}),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    assert calls["run"] > 0 and calls["state_step"] == 0
    anchors, xv = s.initAnchorArrays(), np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    s.run(popart.PyStepIO({x: xv}, anchors))
    np.testing.assert_allclose(anchors[y], np.tanh(xv @ w), rtol=1e-6)

    ir = popxl.Ir(replication=2)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        ys = popxl.d2h_stream((3,), popxl.float32, "y")
        v = popxl.variable(np.ones(3, np.float32), name="v")
        ops.host_store(ys, ops.collectives.replicated_all_reduce(ops.host_load(xs) * v))
    calls.update(run=0, state_step=0)
    xr = np.arange(6, dtype=np.float32).reshape(2, 3)
    with popxl.Session(ir, "ipu_model") as sx:
        assert calls["run"] > 0 and calls["state_step"] == 2   # the plan's and the compiled step
        np.testing.assert_allclose(sx.run({xs: xr})[ys], np.broadcast_to(xr.sum(0), (2, 3)))

    ir, idx_s, out_s = gather_on_ipu1(placed=True)
    calls.update(run=0, state_step=0)
    with popxl.Session(ir, "ipu_model") as sx:
        from popart import testing
        assert testing.is_placed(sx) and calls["run"] > 0 and calls["state_step"] == 2
        assert sx.run({idx_s: np.array([3], np.int32)})[out_s] == 3.0
