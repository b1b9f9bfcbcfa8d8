"""The benchmark's models (bench/bench_models.py), at test sizes, exported to ONNX."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import bench_models  # noqa: E402


def make(name: str, batch: int, seed: int = 0) -> tuple[torch.nn.Module, bytes, np.ndarray]:
    """(torch model in eval mode, ONNX bytes with input 'x' and output 'y', example input)
    for 'mlp', 'cnn' (BatchNormalization kept as an op) or 'transformer'."""
    torch.manual_seed(seed)
    model, shape = {
        "mlp": lambda: (bench_models.mlp(64, 128), (batch, 64)),
        "cnn": lambda: (bench_models.cnn(8), (batch, 3, 16, 16)),
        "transformer": lambda: (bench_models.Transformer(64, 4, 128), (batch, 16, 64)),
    }[name]()
    if name == "cnn":  # non-trivial running statistics
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(*shape) * 2 + 0.5)
    proto = bench_models.to_onnx(model, shape, fold=False, output="y")
    return model.eval(), proto, torch.randn(*shape).numpy()
