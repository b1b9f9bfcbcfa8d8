"""ai.onnx Attention run by the op tester against the ONNX reference evaluator and PyTorch's
scaled_dot_product_attention (the conformance cases in test_onnx_backend.py cover the rest,
FlexAttention included)."""
import numpy as np
import pytest
import torch

import popart

from op_tester import one_op

RNG = np.random.default_rng(0)
OPSETS = {"ai.onnx": 25}


def rnd(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_gqa_causal_past_3d_matches_reference(op_tester):
    """3-D inputs, 4 query heads sharing 2 K/V heads, a KV cache (causal offset 3), a short
    boolean mask with one fully masked query row, and every output (scores after softmax)."""
    b, sq, past, q_heads, kv_heads, size = 2, 3, 3, 4, 2, 4
    mask = RNG.random((sq, past + sq - 1)) > 0.3   # shorter than the 6 keys: the last is masked
    mask[0] = False
    inputs = [rnd(b, sq, q_heads * size), rnd(b, sq, kv_heads * size), rnd(b, sq, kv_heads * 3),
              mask, rnd(b, kv_heads, past, size), rnd(b, kv_heads, past, 3)]
    y, *_ = op_tester.run(one_op("Attention", inputs, num_outputs=4, is_causal=1,
                                 q_num_heads=q_heads, kv_num_heads=kv_heads,
                                 qk_matmul_output_mode=3),
                          lambda ref: ref.onnx_reference(), opsets=OPSETS, atol=1e-6)
    assert not np.any(y[:, 0])   # the fully masked row is zero, not NaN


def test_gradient_matches_torch_sdpa(op_tester):
    """Gradients w.r.t. Q, K and V of causal GQA attention with a float mask, softcap off."""
    q, k, v = rnd(2, 4, 5, 8), rnd(2, 2, 5, 8), rnd(2, 2, 5, 6)
    mask = rnd(5, 5)

    def reference(ref):
        tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
        bias = torch.tensor(mask, dtype=torch.float64).masked_fill(
            ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
        y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias,
                                                             scale=0.3, enable_gqa=True)
        y.backward(torch.tensor(ref.getOutputTensorGrad(0), dtype=torch.float64))
        return [t.detach().numpy().astype(np.float32) for t in (y, tq.grad, tk.grad, tv.grad)]

    op_tester.run(one_op("Attention", [q, k, v, mask], grads=[0, 1, 2], is_causal=1, scale=0.3),
                  reference, step_type="train", opsets=OPSETS, rtol=1e-4, atol=1e-5)


def test_gradient_of_fully_masked_row_is_zero_not_nan(op_tester):
    q, k, v = rnd(1, 1, 3, 4), rnd(1, 1, 3, 4), rnd(1, 1, 3, 4)
    mask = np.array([[True, False, True], [False, False, False], [True, True, True]])
    _, gq = op_tester.run(one_op("Attention", [q, k, v, mask], grads=[0]), None,
                          step_type="train", opsets=OPSETS)
    assert np.all(np.isfinite(gq)) and not np.any(gq[0, 0, 1]) and np.any(gq[0, 0, 0])


@pytest.mark.parametrize("attrs,match", [
    ({}, "3-D input Q .* needs attribute q_num_heads"),
    ({"q_num_heads": 3, "kv_num_heads": 1}, "q_num_heads=3 must be positive and divide"),
    ({"q_num_heads": 2, "kv_num_heads": 1, "qk_matmul_output_mode": 5},
     "qk_matmul_output_mode must be 0, 1, 2 or 3, got 5"),
])
def test_bad_attributes_are_clear_errors(op_tester, attrs, match):
    with pytest.raises(popart.UnsupportedOperatorError, match=match):
        op_tester.run(one_op("Attention", [rnd(1, 2, 8), rnd(1, 2, 4), rnd(1, 2, 4)], **attrs),
                      None, opsets=OPSETS)
