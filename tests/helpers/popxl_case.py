"""What the popxl tests share (test_popxl_autodiff, test_popxl_fused_ops, test_popxl_mnist,
test_popxl_placement, step_facts_case): running an IR once for the tensors a test checks, the
user guide's linear layer, and a Gather on IPU 1 whose index can be out of range."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

import popxl
from popxl import ops


def gather_on_ipu1(placed: bool) -> tuple[popxl.Ir, Any, Any]:
    """(ir, index stream, output stream): a 1-element index loaded on IPU 0 gathers from a
    4-element table on IPU 1 (copied there when ``placed``, else both on IPU 0); index 7 fails
    the Gather's run-time check."""
    ir = popxl.Ir()
    with ir.main_graph:
        idx_s = popxl.h2d_stream((1,), popxl.int32, "idx")
        out_s = popxl.d2h_stream((1,), popxl.float32, "out")
        with popxl.ipu(0):
            i = ops.host_load(idx_s) + 0
        with popxl.ipu(1 if placed else 0):
            table = popxl.constant(np.arange(4, dtype=np.float32))
            j = ops.ipu_copy(i, 1, 0) if placed else i
            ops.host_store(out_s, ops.gather(table, j))
    return ir, idx_s, out_s


def store_and_run(ir: popxl.Ir, tensors: Mapping[str, popxl.Tensor],
                  inputs: Optional[Mapping[Any, np.ndarray]] = None) -> dict[str, np.ndarray]:
    """Store ``tensors`` (of ``ir``'s main graph) to the host and run once (feeding
    ``inputs``); returns each tensor's value by its key."""
    with ir.main_graph:
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in tensors.items()}
        for k, t in tensors.items():
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run(inputs)
    return {k: out[st] for k, st in streams.items()}


class Linear(popxl.Module):
    """The user guide's layer, ``activation(x @ W + b)``, with W and b graph inputs."""

    def __init__(self, activation: Callable[[popxl.Tensor], popxl.Tensor] = ops.relu) -> None:
        self.activation = activation
        self.W = self.b = None

    def build(self, x: popxl.Tensor, out_features: int) -> popxl.Tensor:
        self.W = popxl.graph_input((x.shape[-1], out_features), popxl.float32, "W")
        self.b = popxl.graph_input((out_features,), popxl.float32, "b")
        return self.activation(x @ self.W + self.b)
