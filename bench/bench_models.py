"""The benchmark models, built in PyTorch and exported to ONNX (opset 11, TorchScript
exporter), so that every runtime runs the same network.

Issue 28's models (the default set): an MLP 784-512-512-10 (batch 128), ResNet-18 for CIFAR
(batch 16) and a BERT-like encoder (4 x 256, seq 128, batch 8, token ids in). The older, smaller
ones (a width-32 CNN, a d=128 transformer) stay as ``cnn`` and ``transformer``.

Each model maps an input ``x`` to class logits ``logits`` [batch, classes].
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
    classes: int = NUM_CLASSES
    vocab: int = 0                 # > 0: x holds token ids in [0, vocab) (int64), else floats

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


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BatchNorm, ReLU, identity or 1x1-conv shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


def resnet18(classes: int = NUM_CLASSES, width: int = 64) -> nn.Module:
    """ResNet-18 for CIFAR: 3x3 stem of ``width`` channels, four stages of two basic blocks
    (width x 1, 2, 4, 8; stride 2 from the second stage), global average pool, linear."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU()]
    cin = width
    for stage in range(4):
        cout = width << stage
        for block in range(2):
            layers.append(BasicBlock(cin, cout, 2 if stage and not block else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class Bert(nn.Module):
    """BERT-like encoder: token + learned position embeddings, LayerNorm, ``layers`` post-norm
    encoder layers, mean pool, a linear head."""

    def __init__(self, vocab: int = 8000, seq: int = 128, d_model: int = 256, nhead: int = 4,
                 dim_ff: int = 1024, layers: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.norm = nn.LayerNorm(d_model)
        self.encoder = nn.Sequential(*[EncoderLayer(d_model, nhead, dim_ff) for _ in range(layers)])
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.norm(self.tok(x) + self.pos)).mean(dim=1))


def bert(layers: int = 4) -> nn.Module:
    return Bert(layers=layers)


VOCAB, SEQ = 8000, 128

MODELS = [
    BenchModel("mlp", mlp, (128, 784)),
    BenchModel("resnet18", resnet18, (16, 3, 32, 32)),
    BenchModel("bert", bert, (8, SEQ), classes=2, vocab=VOCAB),
    BenchModel("cnn", cnn, (32, 3, 32, 32)),
    BenchModel("transformer", Transformer, (16, 32, 128)),
]
DEFAULT = "mlp,resnet18,bert"


def build(spec: BenchModel, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return spec.make()


def export(spec: BenchModel, model: nn.Module, folder: str, training: bool = False) -> str:
    """Write ``model`` to ``folder/<name>[-train].onnx``. ``training`` keeps BatchNormalization
    in training mode (an inference export folds it into the convolutions)."""
    path = os.path.join(folder, f"{spec.name}{'-train' if training else ''}.onnx")
    with open(path, "wb") as f:
        f.write(to_onnx(model, spec.input_shape, training=training, fold=not training,
                        vocab=spec.vocab))
    return path


def to_onnx(model: nn.Module, input_shape: tuple, training: bool = False, fold: bool = True,
            output: str = "logits", vocab: int = 0) -> bytes:
    """ONNX bytes of ``model`` (opset 11, TorchScript exporter, input 'x'; int64 token ids
    when ``vocab``). ``fold=False`` keeps BatchNormalization as an op in an inference export."""
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    model.train(training)
    example = torch.randint(0, vocab, input_shape) if vocab else torch.randn(*input_shape)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, f, input_names=["x"],
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
