"""The benchmark models, built in PyTorch and exported to ONNX (opset 11, TorchScript
exporter): an MLP, a small CNN with BatchNorm and a small transformer encoder.

Each model maps an input ``x`` to class logits ``logits`` [batch, 10].
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

NUM_CLASSES = 10


@dataclass
class BenchModel:
    name: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]   # including the batch dimension

    @property
    def batch(self) -> int:
        return self.input_shape[0]


def mlp(inputs: int = 784, hidden: int = 512) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, NUM_CLASSES))


def cnn(width: int = 32) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*block(3, width), nn.MaxPool2d(2), *block(width, 2 * width), nn.MaxPool2d(2),
                         *block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4 * width, NUM_CLASSES))


class EncoderLayer(nn.Module):
    """nn.TransformerEncoderLayer's computation (post-norm, ReLU feed-forward, no dropout),
    written out: torch's own layer exports ops that need opset 13-14 (unflatten,
    scaled_dot_product_attention)."""

    def __init__(self, d_model: int, nhead: int, dim_ff: int) -> None:
        super().__init__()
        self.nhead = nhead
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, dim_ff), nn.ReLU(), nn.Linear(dim_ff, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, dh = self.nhead, d // self.nhead
        q, k, v = (z.reshape(b, t, h, dh).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = torch.softmax(q @ k.transpose(-2, -1) / dh ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = self.norm1(x + self.proj(y))
        return self.norm2(x + self.ff(x))


class Transformer(nn.Module):
    """2 encoder layers (d_model 128, 4 heads, feed-forward 256), mean pooling, a linear head."""

    def __init__(self, d_model: int = 128, nhead: int = 4, dim_ff: int = 256,
                 layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Sequential(*[EncoderLayer(d_model, nhead, dim_ff) for _ in range(layers)])
        self.head = nn.Linear(d_model, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


MODELS = [
    BenchModel("mlp", mlp, (64, 784)),
    BenchModel("cnn", cnn, (32, 3, 32, 32)),
    BenchModel("transformer", Transformer, (16, 32, 128)),
]


def build(spec: BenchModel, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return spec.make()


def export(spec: BenchModel, model: nn.Module, folder: str, training: bool = False) -> str:
    """Write ``model`` to ``folder/<name>[-train].onnx``. ``training`` keeps BatchNormalization
    in training mode (an inference export folds it into the convolutions)."""
    path = os.path.join(folder, f"{spec.name}{'-train' if training else ''}.onnx")
    with open(path, "wb") as f:
        f.write(to_onnx(model, spec.input_shape, training=training, fold=not training))
    return path


def to_onnx(model: nn.Module, input_shape: tuple, training: bool = False, fold: bool = True,
            output: str = "logits") -> bytes:
    """ONNX bytes of ``model`` (opset 11, TorchScript exporter, input 'x'). ``fold=False``
    keeps BatchNormalization as an op in an inference export."""
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    model.train(training)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, torch.randn(*input_shape), f, input_names=["x"],
                          output_names=[output], opset_version=11, dynamo=False,
                          training=mode, do_constant_folding=fold)
    return f.getvalue()


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for spec in MODELS:
            m = build(spec)
            for t in (False, True):
                p = export(spec, m, d, t)
                print(p, os.path.getsize(p))
