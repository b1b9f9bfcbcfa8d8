"""ai.onnx transformer ops (RMSNormalization, RotaryEmbedding, SwiGLU, LinearAttention,
CausalConvWithState) run by the op tester, against ONNX's reference evaluator;
RMSNormalization's gradients (a TrainingSession) against PyTorch."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import popart

from op_tester import RefData, one_op

RNG = np.random.default_rng(7)
onnx_reference = RefData.onnx_reference


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape,axis", [((3, 8), -1), ((2, 3, 4), -2), ((2, 3, 2, 4), 1)])
def test_rms_normalization(op_tester, shape, axis):
    x = rnd(*shape)
    op_tester.run(one_op("RMSNormalization", [x, rnd(*shape[axis % len(shape):])], axis=axis,
                         epsilon=1e-3), onnx_reference, opsets={"ai.onnx": 28}, atol=1e-6)


def test_rms_normalization_float16_stashes_in_float32(op_tester):
    x, scale = rnd(2, 16, dtype=np.float16), rnd(16, dtype=np.float16)
    op_tester.run(one_op("RMSNormalization", [x, scale]), onnx_reference,
                  opsets={"ai.onnx": 28}, rtol=1e-3, atol=1e-3)
    x = (1000 * x).astype(np.float16)    # x * x overflows float16
    x32 = x.astype(np.float32)
    exp = (x32 / np.sqrt(np.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(np.float16) * scale
    op_tester.run(one_op("RMSNormalization", [x, scale]), lambda ref: [exp],
                  opsets={"ai.onnx": 28}, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding_4d_with_position_ids(op_tester, interleaved, rotary_dim):
    b, h, s, d = 2, 3, 5, 8
    half = (rotary_dim or d) // 2
    pos = RNG.integers(0, 10, (b, s)).astype(np.int64)
    op_tester.run(one_op("RotaryEmbedding", [rnd(b, h, s, d), rnd(10, half), rnd(10, half), pos],
                         interleaved=interleaved, rotary_embedding_dim=rotary_dim),
                  onnx_reference, opsets={"ai.onnx": 23}, atol=1e-6)


def test_rotary_embedding_3d_without_position_ids(op_tester):
    b, s, h, d = 2, 4, 2, 6
    op_tester.run(one_op("RotaryEmbedding", [rnd(b, s, h * d), rnd(b, s, d // 2),
                                             rnd(b, s, d // 2), None], num_heads=h),
                  onnx_reference, opsets={"ai.onnx": 23}, atol=1e-6)


@pytest.mark.parametrize("alpha", [1.0, 1.7])
def test_swiglu(op_tester, alpha):
    op_tester.run(one_op("SwiGLU", [rnd(3, 5), rnd(3, 5)], alpha=alpha), onnx_reference,
                  opsets={"ai.onnx": 28}, atol=1e-6)


@pytest.mark.parametrize("rule,decay_width,beta_width", [
    ("linear", None, None),
    ("gated", 6, None),         # per key dimension: kv_num_heads * d_k
    ("delta", None, 1),
    ("gated_delta", 2, 2),      # per head
])
def test_linear_attention(op_tester, rule, decay_width, beta_width):
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 3, 2     # grouped-query: 2 query heads per KV head
    k = rnd(b, t, hkv, dk)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(b, t, hkv * dk)
    decay = None if decay_width is None else -np.abs(rnd(b, t, decay_width))
    beta = None if beta_width is None else RNG.uniform(0, 1, (b, t, beta_width)).astype(np.float32)
    op_tester.run(one_op("LinearAttention", [rnd(b, t, hq * dk), k, rnd(b, t, hkv * dv),
                                             rnd(b, hkv, dk, dv), decay, beta],
                         q_num_heads=hq, kv_num_heads=hkv, update_rule=rule),
                  onnx_reference, opsets={"ai.onnx": 27}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation,with_state", [("none", False), ("silu", True)])
def test_causal_conv_with_state(op_tester, activation, with_state):
    b, c, length, k = 2, 3, 5, 4
    op_tester.run(one_op("CausalConvWithState", [rnd(b, c, length), rnd(c, 1, k), rnd(c),
                                                 rnd(b, c, k - 1) if with_state else None],
                         activation=activation),
                  onnx_reference, opsets={"ai.onnx": 27}, atol=1e-6)


def test_rms_normalization_gradient_matches_torch(op_tester):
    x, scale = rnd(2, 3, 4, dtype=np.float64), rnd(3, 4, dtype=np.float64)

    def reference(ref):
        tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(scale, requires_grad=True)
        y = F.rms_norm(tx, (3, 4), ts, eps=1e-4)
        y.backward(torch.from_numpy(ref.getOutputTensorGrad(0)))
        return [y, tx.grad, ts.grad]

    op_tester.run(one_op("RMSNormalization", [x, scale], grads=True, axis=-2, epsilon=1e-4),
                  reference, step_type="train", opsets={"ai.onnx": 28}, rtol=1e-6, atol=1e-9)


def test_bad_attributes_raise_clear_errors(op_tester):
    x = rnd(1, 2, 3)
    with pytest.raises(popart.popart_exception,
                       match="'update_rule' must be one of .*gated_delta, got 'fast'"):
        op_tester.run(one_op("LinearAttention", [x, x, x], q_num_heads=1, kv_num_heads=1,
                             update_rule="fast"), None, opsets={"ai.onnx": 27})
    with pytest.raises(popart.popart_exception, match="'num_heads'.*got 4"):
        op_tester.run(one_op("RotaryEmbedding", [x, rnd(1, 2, 1), rnd(1, 2, 1)], num_heads=4),
                      None, opsets={"ai.onnx": 23})
