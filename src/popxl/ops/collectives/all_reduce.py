"""Reduce tensors across the IPUs of one replica (ai.graphcore AllReduce)."""
from __future__ import annotations

from typing import Any, List, Optional

from ...errors import UndefinedValue
from ...tensor import Tensor
from .._base import GC, node
from .collectives import _collective_op


def _all_reduce(ts: List[Tensor], ipus: Optional[List[int]], op: Any, identical_inputs: bool = False,
                identical_grad_inputs: bool = False) -> List[Tensor]:
    ts = list(ts)
    if not ts:
        raise ValueError("all_reduce needs at least one tensor")
    if ipus is None:
        try:
            ipus = [t.ipu for t in ts]
        except UndefinedValue as e:
            raise ValueError("Could not automatically infer the IPU of all input Tensors `ts`. "
                             "Please specify the IPUs via the `ipus` parameter.") from e
    ipus = [int(i) for i in ipus]
    if len(ts) != len(ipus):
        raise ValueError(f"Number of specified tensor does not equal number of specified IPUs. "
                         f"{len(ts)} != {len(ipus)}")
    return node("AllReduce", ts, {"collectiveOperator": _collective_op(op, allow_local=True),
                                  "ipus": ipus, "identicalInputs": int(identical_inputs),
                                  "identicalGradInputs": int(identical_grad_inputs)},
                GC, len(ts), name="all_reduce_out")


def all_reduce(ts: List[Tensor], ipus: Optional[List[int]] = None, op: Any = "add") -> List[Tensor]:
    """Reduce the tensors ``ts``, held on the IPUs ``ipus`` (default: each tensor's IPU) of
    one replica; returns one result per IPU."""
    return _all_reduce(ts, ipus, op)


def all_reduce_identical_inputs(ts: List[Tensor], ipus: Optional[List[int]] = None,
                                op: Any = "add") -> List[Tensor]:
    """:func:`all_reduce` of tensors known to be equal: the outputs are the inputs and the
    gradient is the all-reduce (add) of the output gradients."""
    return _all_reduce(ts, ipus, op, identical_inputs=True)


def all_reduce_identical_grad_inputs(ts: List[Tensor], ipus: Optional[List[int]] = None,
                                     op: Any = "add") -> List[Tensor]:
    """:func:`all_reduce` whose output gradients are known to be equal: the outputs are the
    reduction and each input's gradient is its output's gradient."""
    return _all_reduce(ts, ipus, op, identical_grad_inputs=True)
