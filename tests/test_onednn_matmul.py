"""The oneDNN matmul custom call (popart.engine.onednn.linear, the kernel bench/matmul_onednn.py
measures beside XLA's dot) against NumPy, its gradients against XLA's, and its errors."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from popart.engine import onednn

needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="the oneDNN custom call cannot be built or loaded here "
                                         "(onednn-cpu-gomp / onednn-devel-cpu-gomp, g++)")
RNG = np.random.default_rng(0)


def _ref(a, w, bias, trans_b, relu):
    y = a.astype(np.float64) @ (w.T if trans_b else w).astype(np.float64)
    y = y if bias is None else y + bias
    return np.maximum(y, 0) if relu else y


@needs_onednn
@pytest.mark.parametrize("trans_b", [True, False], ids=["transB", "plain"])
@pytest.mark.parametrize("bias, relu", [(False, False), (True, False), (True, True),
                                        (False, True)], ids=["mm", "bias", "bias-relu", "relu"])
def test_linear_matches_numpy(trans_b, bias, relu):
    a = RNG.standard_normal((5, 7), dtype=np.float32)
    w = RNG.standard_normal((3, 7) if trans_b else (7, 3), dtype=np.float32)
    b = RNG.standard_normal(3, dtype=np.float32) if bias else None
    y = jax.jit(lambda a, w, b: onednn.linear(a, w, b, trans_b, relu))(a, w, b)
    assert y.shape == (5, 3)
    np.testing.assert_allclose(y, _ref(a, w, b, trans_b, relu), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_leading_dims_vmap_and_empty_operands():
    a = RNG.standard_normal((2, 4, 6), dtype=np.float32)        # leading dims fold into M
    w = RNG.standard_normal((6, 5), dtype=np.float32)
    b = RNG.standard_normal(5, dtype=np.float32)
    np.testing.assert_allclose(onednn.linear(a, w, b, False, True), _ref(a, w, b, False, True),
                               rtol=1e-5, atol=1e-5)
    ws = RNG.standard_normal((3, 6, 5), dtype=np.float32)        # batched weights: a loop
    ys = jax.vmap(lambda a, w: onednn.linear(a, w, b, False, False))(a[:1].repeat(3, 0), ws)
    np.testing.assert_allclose(ys, [_ref(a[0], wi, b, False, False) for wi in ws],
                               rtol=1e-5, atol=1e-5)
    empty_k = onednn.linear(np.zeros((3, 0), np.float32), np.zeros((0, 2), np.float32),
                            np.array([1, -1], np.float32), False, True)
    np.testing.assert_array_equal(empty_k, [[1, 0]] * 3)
    assert onednn.linear(np.zeros((0, 4), np.float32), w[:4], None, False, False).shape == (0, 5)


@needs_onednn
def test_gradients_are_xlas_dots():
    a = RNG.standard_normal((2, 4, 6), dtype=np.float32)
    w = RNG.standard_normal((5, 6), dtype=np.float32)
    b = RNG.standard_normal(5, dtype=np.float32)

    def loss(f):
        return lambda a, w, b: (f(a, w, b) ** 2).sum()
    ours = jax.grad(loss(lambda a, w, b: onednn.linear(a, w, b, True, True)), (0, 1, 2))(a, w, b)
    xla = jax.grad(loss(lambda a, w, b: jax.nn.relu(a @ w.T + b)), (0, 1, 2))(a, w, b)
    for g, r in zip(ours, xla):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_mismatched_shapes_are_xlas_error():
    with pytest.raises(Exception, match="do not match"):
        jax.jit(lambda a, w: onednn.linear(a, w, None, False, False))(
            np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))
