"""``popart._internal.ir.op``: PopART's op classes. A handle's class is chosen from its node's
op type (``popxl._pb.OP_CLASS_NAMES``, else "<op type>Op"), so ``isinstance(op, MatMulOp)``
holds for a MatMul node; any ``<Name>Op`` attribute is that class (made on first use)."""
from __future__ import annotations

from typing import Any

from popxl._pb import CallOp, LoopOp, Op, SubgraphOp, op_class

from . import exchange

AddOp, GatherOp, GeluOp, GroupNormOp, InitOp, IpuCopyOp, MatMulOp, MulOp, ReshapeOp, SplitOp, \
    SubtractOp, TransposeOp, IfOp = (op_class(n) for n in (
        "AddOp GatherOp GeluOp GroupNormOp InitOp IpuCopyOp MatMulOp MulOp ReshapeOp SplitOp "
        "SubtractOp TransposeOp IfOp").split())


def __getattr__(name: str) -> Any:
    """``op.<Name>Op``: PopART's op class of that name."""
    if name.endswith("Op") and name[:1].isupper():
        return op_class(name)
    raise AttributeError(f"module 'popart._internal.ir.op' has no attribute '{name}'")
