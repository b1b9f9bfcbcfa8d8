"""The CPU's MatMul and Gemm: in an inference step whose weight-only work is hoisted
(``engine/hoist.py``), a product by a 2-D float32 weight is oneDNN's matmul reading the weight
packed once into its blocked layout (``engine/onednn`` ``pack``, hoisted out of the step with
the weight's Transpose): 252-267 GFLOP/s on the zoo transformers' shapes against XLA's dot at
223-256 and onnxruntime's at 241-261 (``python bench/matmul_shapes.py --threads=1``,
docs/performance.md). Elsewhere (training, a step not hoisted, other dtypes) the generic
lowering's dot."""
from __future__ import annotations

import jax.numpy as jnp

from ..engine import onednn
from . import math
from .registry import LowerCtx, register


def _product(a, b):
    """``a @ b``: oneDNN on ``b`` packed where :func:`onednn.packs_weights` says so, else the
    generic lowering's product."""
    if jnp.ndim(a) >= 2 and jnp.result_type(a) == jnp.float32 and onednn.packs_weights(b):
        return onednn.matmul(a, onednn.pack(b), b.shape[1], packed=True)
    return math._product(a, b)


@register("MatMul", platform="cpu")
def matmul_cpu(ctx: LowerCtx, a, b, **attrs):
    """MatMul on the CPU (:func:`_product`)."""
    return math.matmul(ctx, a, b, **attrs, product=_product)


@register("Gemm", platform="cpu")
def gemm_cpu(ctx: LowerCtx, *inputs, **attrs):
    """Gemm on the CPU (:func:`_product`; a transposed weight is packed from its transpose,
    which the hoisting computes once too)."""
    return math.gemm(ctx, *inputs, **attrs, product=_product)
