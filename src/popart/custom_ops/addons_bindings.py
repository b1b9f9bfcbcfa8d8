"""The cppimport binding modules of popxl-addons 3.4's custom ops, each resolved to Python
stand-ins of its pybind11 classes (parameters in the binding's order)."""
from __future__ import annotations

from typing import Any

from .bindings import binding_op, params_class, register_binding

_GROUP_FLAGS = ("op", "group", "identicalInputs", "identicalGradInputs")


def _rts_output(op: Any, attrs: dict) -> None:
    """ReplicatedReduceScatterStridedOp::setup: configured for replicated tensor sharding, the
    output's meta-shape is the input's shape (set through the handle's ``info``, as the C++
    op sets its ``outInfo``)."""
    if attrs.get("configureOutputForReplicatedTensorSharding"):
        out = op.outTensor(0)
        info = out.info
        info.set(info.dataType(), info.shape(), op.inTensor(0).info.shape())
        out.info = info

_STRIDED = ("stride", "groupSize")

register_binding("replicated_all_reduce_TP_binding", ReplicatedAllReduceTPOp=binding_op(
    "ReplicatedAllReduceTP", _GROUP_FLAGS))
register_binding("replicated_all_reduce_strided_binding", ReplicatedAllReduceStridedOp=binding_op(
    "ReplicatedAllReduceStrided", ("op", *_STRIDED, "identicalInputs", "identicalGradInputs")))
register_binding("replicated_all_gather_strided_binding", ReplicatedAllGatherStridedOp=binding_op(
    "ReplicatedAllGatherStrided", _STRIDED))
register_binding("replicated_reduce_scatter_strided_binding",
                 ReplicatedReduceScatterStridedOp=binding_op(
                     "ReplicatedReduceScatterStrided",
                     ("op", *_STRIDED, "configureOutputForReplicatedTensorSharding"),
                     created=_rts_output))
register_binding("layer_norm_distributed_binding", LayerNormDistributedOp=binding_op(
    "LayerNormDistributed", ("epsilon", "group")))
register_binding("rotary_pos_embed_binding", RotaryPosEmbedOp=binding_op(
    "RotaryPosEmbed", ("rotary_dim",)))
register_binding("crossentropysharded_binding", CrossEntropyShardedOp=binding_op(
    "CrossEntropySharded", ("group", "availableMemoryProportion")))
register_binding("crossentropysharded_wr_binding", CrossEntropyShardedOp=binding_op(
    "CrossEntropyShardedWR", ("ipus",), name="CrossEntropyShardedWROp"))
register_binding("group_quantize_decompress_binding", GroupQuantizeDecompressOp=binding_op(
    "GroupQuantizeDecompress"))
register_binding("grad_reduce_square_add_binding", GradReduceSquareAddOp=binding_op(
    "GradReduceSquareAdd"))
register_binding("fp8_mse_scale_impl", Fp8FindBestScaleOp=binding_op("Fp8Scale"),
                 Fp8ScalingBiasParams=params_class("Fp8ScalingBiasParams", "min_fp32_exp_index",
                                                   "format_span", "quantisation_error"))
register_binding("linear_layout_impl", LinearLayoutOp=binding_op("LinearLayout"),
                 LinearLayoutParams=params_class("LinearLayoutParams", "bs"))
register_binding("dense_sparse_matmul_impl", DenseSparseMatMulOp=binding_op("SparseMatmul"),
                 DenseSparseMatMulParams=params_class("DenseSparseMatMulParams", "nz", "cols",
                                                      "rows", "output_cols"))
