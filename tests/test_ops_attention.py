"""ai.onnx Attention against the ONNX reference evaluator and PyTorch's scaled_dot_product_attention
(the conformance cases in test_onnx_backend.py cover the rest, FlexAttention included)."""
import numpy as np
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import jax
import jax.numpy as jnp

import popart
from popart.engine.lower import TraceState, execute
from popart.ir.onnx_import import import_model

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

RNG = np.random.default_rng(0)


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def attention_model(inputs: dict, num_outputs: int = 1, opset: int = 25, **attrs):
    """A one-Attention model built with popart.Builder; ``inputs`` maps name -> array, in
    the op's input order (None skips an optional input). Returns (proto, output ids)."""
    b = popart.Builder(opsets={"ai.onnx": opset, "ai.graphcore": 1})
    ids = [b.addInputTensor(popart.TensorInfo(v), name) if v is not None else ""
           for name, v in inputs.items()]
    outs = b.aiOnnx.attention(ids, num_outputs, **attrs)
    outs = [outs] if isinstance(outs, str) else outs
    for o in outs:
        b.addOutputTensor(o)
    return b.getModelProto(), outs


def test_gqa_causal_past_3d_matches_reference():
    """3-D inputs, 4 query heads sharing 2 K/V heads, a KV cache (causal offset 3), a short
    boolean mask with one fully masked query row, and every output (scores after softmax)."""
    b, sq, past, q_heads, kv_heads, size = 2, 3, 3, 4, 2, 4
    mask = RNG.random((sq, past + sq - 1)) > 0.3   # shorter than the 6 keys: the last is masked
    mask[0] = False
    feeds = {"Q": rnd(b, sq, q_heads * size), "K": rnd(b, sq, kv_heads * size),
             "V": rnd(b, sq, kv_heads * 3), "attn_mask": mask,
             "past_key": rnd(b, kv_heads, past, size), "past_value": rnd(b, kv_heads, past, 3)}
    proto, outs = attention_model(feeds, 4, is_causal=1, q_num_heads=q_heads,
                                  kv_num_heads=kv_heads, qk_matmul_output_mode=3)
    df = popart.DataFlow(1, {o: popart.AnchorReturnType("ALL") for o in outs})
    sess = popart.InferenceSession(proto, df, popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    got = sess.initAnchorArrays()
    sess.run(popart.PyStepIO(feeds, got))
    exp = ReferenceEvaluator(proto).run(None, feeds)
    for o, e in zip(outs, exp):
        assert got[o].shape == e.shape and got[o].dtype == e.dtype, (o, got[o].shape, e.shape)
        np.testing.assert_allclose(got[o], e, rtol=1e-5, atol=1e-6)
    assert not np.any(got[outs[0]][:, 0])   # the fully masked row is zero, not NaN


def _grads(proto, y, feeds, wrt, weight):
    """jax.grad of sum(y * weight) with respect to the inputs ``wrt``, through the lowering."""
    graph, _ = import_model(proto)

    def f(*xs):
        return jnp.sum(execute(graph, {**feeds, **dict(zip(wrt, xs))}, TraceState())[y] * weight)
    return jax.jit(jax.grad(f, argnums=tuple(range(len(wrt)))))(*(feeds[n] for n in wrt))


def test_gradient_matches_torch_sdpa():
    """Gradients w.r.t. Q, K and V of causal GQA attention with a float mask, softcap off."""
    q, k, v = rnd(2, 4, 5, 8), rnd(2, 2, 5, 8), rnd(2, 2, 5, 6)
    mask = rnd(5, 5)
    w = rnd(2, 4, 5, 6)
    feeds = {"Q": q, "K": k, "V": v, "attn_mask": mask}
    proto, (y,) = attention_model(feeds, is_causal=1, scale=0.3)
    got = _grads(proto, y, feeds, ["Q", "K", "V"], w)

    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    bias = torch.tensor(mask, dtype=torch.float64).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias, scale=0.3,
                                                         enable_gqa=True)
    (y * torch.tensor(w, dtype=torch.float64)).sum().backward()
    for g, t in zip(got, (tq, tk, tv)):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_gradient_of_fully_masked_row_is_zero_not_nan():
    q, k, v = rnd(1, 1, 3, 4), rnd(1, 1, 3, 4), rnd(1, 1, 3, 4)
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    feeds = {"Q": q, "K": k, "V": v, "attn_mask": mask}
    proto, (y,) = attention_model(feeds)
    gq, = _grads(proto, y, feeds, ["Q"], rnd(1, 1, 3, 4))
    gq = np.asarray(gq)
    assert np.all(np.isfinite(gq)) and not np.any(gq[0, 0, 1]) and np.any(gq[0, 0, 0])


@pytest.mark.parametrize("attrs,match", [
    ({}, "3-D input Q .* needs attribute q_num_heads"),
    ({"q_num_heads": 3, "kv_num_heads": 1}, "q_num_heads=3 must be positive and divide"),
    ({"q_num_heads": 2, "kv_num_heads": 1, "qk_matmul_output_mode": 5},
     "qk_matmul_output_mode must be 0, 1, 2 or 3, got 5"),
])
def test_bad_attributes_are_clear_errors(attrs, match):
    feeds = {"Q": rnd(1, 2, 8), "K": rnd(1, 2, 4), "V": rnd(1, 2, 4)}
    proto, outs = attention_model(feeds, **attrs)
    df = popart.DataFlow(1, {outs[0]: popart.AnchorReturnType("ALL")})
    with pytest.raises(popart.UnsupportedOperatorError, match=match):
        popart.InferenceSession(proto, df, popart.DeviceManager().createCpuDevice()).prepareDevice()
