"""Contract tests of the engine's shape (issue 35, item 7): what a module may import, compare or
hold, scanned from the sources."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

import popart


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
