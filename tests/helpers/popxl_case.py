"""What the popxl tests share (test_popxl_autodiff, test_popxl_fused_ops, test_popxl_mnist):
running an IR once for the tensors a test checks, and the user guide's linear layer."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

import popxl
from popxl import ops


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
