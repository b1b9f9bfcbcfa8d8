"""Small PyTorch models exported to ONNX (opset 11, TorchScript exporter) for tests and bench."""
from __future__ import annotations

import io
import math

import numpy as np
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, i: int = 64, h: int = 128, o: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, c: int = 3, classes: int = 10, width: int = 16):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
        self.features = nn.Sequential(block(c, width), nn.MaxPool2d(2), block(width, 2 * width),
                                      nn.MaxPool2d(2), block(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(x.mean(dim=(2, 3)))


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer written out (exports to opset 11)."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, s, 3, self.h, self.dk).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.dk), dim=-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.ff(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, ff: int = 128, layers: int = 2, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(*[EncoderLayer(d, heads, ff) for _ in range(layers)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.layers(x).mean(dim=1))


def export(model: nn.Module, example: torch.Tensor) -> bytes:
    """ONNX bytes of ``model`` (eval mode, opset 11, input 'x', output 'y')."""
    f = io.BytesIO()
    # No constant folding: keeps BatchNormalization as an op instead of fusing it into Conv.
    torch.onnx.export(model.eval(), example, f, opset_version=11, dynamo=False,
                      input_names=["x"], output_names=["y"], do_constant_folding=False)
    return f.getvalue()


def make(name: str, batch: int, seed: int = 0) -> tuple[nn.Module, bytes, np.ndarray]:
    """(torch model, ONNX bytes, example input) for 'mlp', 'cnn' or 'transformer'."""
    torch.manual_seed(seed)
    if name == "mlp":
        model, shape = MLP(), (batch, 64)
    elif name == "cnn":
        model, shape = CNN(), (batch, 3, 16, 16)
    else:
        model, shape = Transformer(), (batch, 16, 64)
    x = torch.randn(*shape)
    if name == "cnn":  # non-trivial running statistics
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(*shape) * 2 + 0.5)
    return model, export(model, x), x.numpy()
