"""ai.onnx transformer ops (RMSNormalization, RotaryEmbedding, SwiGLU, LinearAttention,
CausalConvWithState) built with popart.Builder and run through an InferenceSession, against
ONNX's reference evaluator; RMSNormalization's gradient against PyTorch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx.reference import ReferenceEvaluator

import jax
import jax.numpy as jnp

import popart
from popart.engine.lower import TraceState, execute
from popart.ir.onnx_import import import_model

from one_op import build, run_session

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

RNG = np.random.default_rng(7)


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def check(op, inputs, n_out=1, opset=28, rtol=1e-5, atol=1e-6, **attrs):
    proto, feeds, outs = build(op, inputs, n_out, opset, **attrs)
    got = run_session(proto, feeds, outs)
    exp = ReferenceEvaluator(proto).run(None, feeds)
    for g, e in zip(got, exp):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
        np.testing.assert_allclose(g.astype(np.float32), e.astype(np.float32), rtol=rtol,
                                   atol=atol)


@pytest.mark.parametrize("shape,axis", [((3, 8), -1), ((2, 3, 4), -2), ((2, 3, 2, 4), 1)])
def test_rms_normalization(shape, axis):
    x = rnd(*shape)
    check("RMSNormalization", [x, rnd(*shape[axis % len(shape):])], axis=axis, epsilon=1e-3)


def test_rms_normalization_float16_stashes_in_float32():
    x, scale = rnd(2, 16, dtype=np.float16), rnd(16, dtype=np.float16)
    check("RMSNormalization", [x, scale], rtol=1e-3, atol=1e-3)
    x = (1000 * x).astype(np.float16)    # x * x overflows float16
    (got,) = run_session(*build("RMSNormalization", [x, scale]))
    x32 = x.astype(np.float32)
    exp = (x32 / np.sqrt(np.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(np.float16) * scale
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, exp, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding_4d_with_position_ids(interleaved, rotary_dim):
    b, h, s, d = 2, 3, 5, 8
    half = (rotary_dim or d) // 2
    pos = RNG.integers(0, 10, (b, s)).astype(np.int64)
    check("RotaryEmbedding", [rnd(b, h, s, d), rnd(10, half), rnd(10, half), pos], opset=23,
          interleaved=interleaved, rotary_embedding_dim=rotary_dim)


def test_rotary_embedding_3d_without_position_ids():
    b, s, h, d = 2, 4, 2, 6
    check("RotaryEmbedding", [rnd(b, s, h * d), rnd(b, s, d // 2), rnd(b, s, d // 2), None],
          opset=23, num_heads=h)


@pytest.mark.parametrize("alpha", [1.0, 1.7])
def test_swiglu(alpha):
    check("SwiGLU", [rnd(3, 5), rnd(3, 5)], alpha=alpha)


@pytest.mark.parametrize("rule,decay_width,beta_width", [
    ("linear", None, None),
    ("gated", 6, None),         # per key dimension: kv_num_heads * d_k
    ("delta", None, 1),
    ("gated_delta", 2, 2),      # per head
])
def test_linear_attention(rule, decay_width, beta_width):
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 3, 2     # grouped-query: 2 query heads per KV head
    k = rnd(b, t, hkv, dk)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(b, t, hkv * dk)
    decay = None if decay_width is None else -np.abs(rnd(b, t, decay_width))
    beta = None if beta_width is None else RNG.uniform(0, 1, (b, t, beta_width)).astype(np.float32)
    check("LinearAttention",
          [rnd(b, t, hq * dk), k, rnd(b, t, hkv * dv), rnd(b, hkv, dk, dv), decay, beta],
          n_out=2, opset=27, q_num_heads=hq, kv_num_heads=hkv, update_rule=rule, rtol=1e-4,
          atol=1e-5)


@pytest.mark.parametrize("activation,with_state", [("none", False), ("silu", True)])
def test_causal_conv_with_state(activation, with_state):
    b, c, length, k = 2, 3, 5, 4
    check("CausalConvWithState",
          [rnd(b, c, length), rnd(c, 1, k), rnd(c), rnd(b, c, k - 1) if with_state else None],
          n_out=2, opset=27, activation=activation)


def test_rms_normalization_gradient_matches_torch():
    x, scale = rnd(2, 3, 4, dtype=np.float64), rnd(3, 4, dtype=np.float64)
    proto, feeds, (out,) = build("RMSNormalization", [x, scale], axis=-2, epsilon=1e-4)
    graph, _ = import_model(proto)
    ix, iscale = list(feeds)
    w = rnd(2, 3, 4, dtype=np.float64)

    def loss(xv, sv):
        return jnp.sum(execute(graph, {ix: xv, iscale: sv}, TraceState())[out] * w)
    gx, gs = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(scale))

    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
    (F.rms_norm(tx, (3, 4), ts, eps=1e-4) * torch.from_numpy(w)).sum().backward()
    np.testing.assert_allclose(np.asarray(gx), tx.grad.numpy(), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(gs), ts.grad.numpy(), rtol=1e-6, atol=1e-9)


def test_bad_attributes_raise_clear_errors():
    x = rnd(1, 2, 3)
    with pytest.raises(popart.popart_exception,
                       match="'update_rule' must be one of .*gated_delta, got 'fast'"):
        run_session(*build("LinearAttention", [x, x, x], n_out=2, opset=27, q_num_heads=1,
                           kv_num_heads=1, update_rule="fast"))
    with pytest.raises(popart.popart_exception, match="'num_heads'.*got 4"):
        run_session(*build("RotaryEmbedding", [x, rnd(1, 2, 1), rnd(1, 2, 1)], opset=23,
                           num_heads=4))
