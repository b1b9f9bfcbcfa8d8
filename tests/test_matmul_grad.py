"""MatMul / Gemm with a weight matrix: the gradients (a custom VJP written as one dot per
input, ops/math.py ``_matmul_weight``) against PopART's grad ops in NumPy: MatMulLhsGradOp
``dY @ B^T`` and MatMulRhsGradOp ``A^T @ dY`` summed over A's leading dimensions; Gemm's as
its decomposition (transposes, alpha / beta scaling) gives them; under ``vmap`` (micro-batches
and replicas sharing the weight) too."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from popart.ops.registry import lookup

pytestmark = pytest.mark.usefixtures("engine_scope")


class Ctx:
    input_ids = ("a", "b")

    def error(self, msg: str) -> Exception:
        return ValueError(msg)


def vjp(op, xs, g, **attrs):
    lower = lookup("ai.onnx", op, 20).lower

    def run(*d):
        out, pull = jax.vjp(lambda *v: lower(Ctx(), *v, **attrs), *d)
        return out, pull(g)
    out, grads = jax.jit(run)(*xs)
    return np.asarray(out), [np.asarray(t) for t in grads]


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + len(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("lead", [(), (5,), (2, 3)], ids=["2d", "3d", "4d"])
def test_matmul_weight_grads(lead):
    a, w = _rand(*lead, 7, 6), _rand(6, 4, seed=1)
    g = _rand(*lead, 7, 4, seed=2)
    y, (da, dw) = vjp("MatMul", [a, w], g)
    np.testing.assert_allclose(y, a @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(da, g @ w.T, rtol=1e-5, atol=1e-5)          # MatMulLhsGradOp
    ref_dw = (a.reshape(-1, 6).T @ g.reshape(-1, 4))                        # MatMulRhsGradOp
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-4)
    assert da.shape == a.shape and dw.shape == w.shape


@pytest.mark.parametrize("transA,transB", [(0, 0), (0, 1), (1, 0)])
def test_gemm_weight_grads(transA, transB):
    a, b, c = _rand(5, 3), _rand(3, 4, seed=1), _rand(4, seed=2)
    a_in, b_in = (a.T.copy() if transA else a), (b.T.copy() if transB else b)
    g = _rand(5, 4, seed=3)
    y, (da, db, dc) = vjp("Gemm", [a_in, b_in, c], g, alpha=0.5, beta=2.0, transA=transA,
                          transB=transB)
    np.testing.assert_allclose(y, 0.5 * a @ b + 2.0 * c, rtol=1e-5, atol=1e-5)
    ref_da, ref_db = 0.5 * g @ b.T, 0.5 * a.T @ g
    np.testing.assert_allclose(da, ref_da.T if transA else ref_da, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, ref_db.T if transB else ref_db, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dc, 2.0 * g.sum(0), rtol=1e-5, atol=1e-5)


def test_matmul_weight_grads_under_vmap():
    """Micro-batches vectorised over a shared weight: its gradient sums over them."""
    lower = lookup("ai.onnx", "MatMul", 20).lower
    a, w, g = _rand(3, 4, 7, 6), _rand(6, 5, seed=1), _rand(3, 4, 7, 5, seed=2)

    def loss(w_):
        return (jax.vmap(lambda x: lower(Ctx(), x, w_))(a) * g).sum()
    dw = np.asarray(jax.jit(jax.grad(loss))(w))
    np.testing.assert_allclose(dw, a.reshape(-1, 6).T @ g.reshape(-1, 5), rtol=1e-4, atol=1e-4)
    da = np.asarray(jax.jit(jax.vmap(lambda x, gg: jax.vjp(lambda v: lower(Ctx(), v, w), x)[1](gg)[0]))(a, g))
    np.testing.assert_allclose(da, g @ w.T, rtol=1e-5, atol=1e-5)
