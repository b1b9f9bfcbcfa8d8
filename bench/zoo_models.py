"""The zoo's models (bench/zoo.py): PyTorch modules with random weights, each wrapped to take
one input ``x`` and return 2-D ``logits`` (rows x classes) for a softmax + nll loss.

Vision models from transformers' model classes (ResNet-50, EfficientNet-B0, ConvNeXt-T,
RegNetY-400MF, SegFormer-B0, ViT-S/16, Swin-T); MobileNetV3-Small and ShuffleNetV2 x1.0 are
defined here from their papers' tables (torchvision, which has them, does not import beside
torch 2.13 from PyPI, and timm needs torchvision); text models from transformers (BERT, GPT-2,
a LLaMA-style decoder with grouped-query attention). No weights are downloaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Zoo:
    make: Callable[[], nn.Module]
    batch: int
    shape: tuple          # per sample: (3, H, W) images, or (seq,) token ids
    vocab: int = 0        # token ids in [0, vocab) when > 0


def _bn_act(c: int, act: nn.Module | None) -> list:
    return [nn.BatchNorm2d(c)] + ([act] if act is not None else [])


def conv_bn(cin: int, cout: int, k: int, s: int = 1, groups: int = 1,
            act: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False),
                         *_bn_act(cout, act))


def _div8(v: float) -> int:
    return max(8, int(v + 4) // 8 * 8)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, _div8(c / 4), 1), nn.Conv2d(_div8(c / 4), c, 1)

    def forward(self, x):
        s = torch.nn.functional.adaptive_avg_pool2d(x, 1)
        return x * torch.nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's bottleneck: 1x1 expand, k x k depthwise, optional SE, 1x1 project."""

    def __init__(self, cin: int, k: int, exp: int, cout: int, se: bool, hs: bool, s: int) -> None:
        super().__init__()
        act = nn.Hardswish if hs else nn.ReLU
        layers = [] if exp == cin else [conv_bn(cin, exp, 1, act=act())]
        layers += [conv_bn(exp, exp, k, s, groups=exp, act=act())]
        layers += [SqueezeExcite(exp)] if se else []
        layers += [conv_bn(exp, cout, 1)]
        self.body, self.residual = nn.Sequential(*layers), s == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


# MobileNetV3-Small (Howard et al. 2019, table 2): kernel, expansion, out, SE, hard-swish, stride
MBV3_SMALL = [(3, 16, 16, 1, 0, 2), (3, 72, 24, 0, 0, 2), (3, 88, 24, 0, 0, 1),
              (5, 96, 40, 1, 1, 2), (5, 240, 40, 1, 1, 1), (5, 240, 40, 1, 1, 1),
              (5, 120, 48, 1, 1, 1), (5, 144, 48, 1, 1, 1), (5, 288, 96, 1, 1, 2),
              (5, 576, 96, 1, 1, 1), (5, 576, 96, 1, 1, 1)]


def mobilenetv3_small(classes: int = 1000) -> nn.Module:
    layers, c = [conv_bn(3, 16, 3, 2, act=nn.Hardswish())], 16
    for k, exp, out, se, hs, s in MBV3_SMALL:
        layers.append(InvertedResidual(c, k, exp, out, bool(se), bool(hs), s))
        c = out
    layers += [conv_bn(c, 576, 1, act=nn.Hardswish()), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, classes)]
    return nn.Sequential(*layers)


def channel_shuffle(x, groups: int = 2):
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit (Ma et al. 2018, fig. 3 c/d)."""

    def __init__(self, cin: int, cout: int, s: int) -> None:
        super().__init__()
        half = cout // 2
        self.s = s
        if s == 2:
            self.branch1 = nn.Sequential(conv_bn(cin, cin, 3, 2, groups=cin),
                                         conv_bn(cin, half, 1, act=nn.ReLU()))
        c2 = cin if s == 2 else half
        self.branch2 = nn.Sequential(conv_bn(c2, half, 1, act=nn.ReLU()),
                                     conv_bn(half, half, 3, s, groups=half),
                                     conv_bn(half, half, 1, act=nn.ReLU()))

    def forward(self, x):
        if self.s == 1:
            a, b = x.chunk(2, dim=1)
            out = torch.cat([a, self.branch2(b)], 1)
        else:
            out = torch.cat([self.branch1(x), self.branch2(x)], 1)
        return channel_shuffle(out)


def shufflenetv2(classes: int = 1000) -> nn.Module:
    layers, c = [conv_bn(3, 24, 3, 2, act=nn.ReLU()), nn.MaxPool2d(3, 2, 1)], 24
    for repeats, out in ((4, 116), (8, 232), (4, 464)):
        for i in range(repeats):
            layers.append(ShuffleUnit(c, out, 2 if i == 0 else 1))
            c = out
    layers += [conv_bn(c, 1024, 1, act=nn.ReLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(1024, classes)]
    return nn.Sequential(*layers)


class Logits(nn.Module):
    """A transformers model's logits as rows x classes: images' (N, classes); a segmentation
    map's mean over its pixels (N, classes); a language model's every token (N * seq, vocab)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        y = self.model(x).logits
        if y.ndim == 4:
            return y.mean((2, 3))
        return y.reshape(-1, y.shape[-1])


def _hf(name: str, **config) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers as tf
        cfg = getattr(tf, name.replace("ForImageClassification", "Config").replace(
            "ForSemanticSegmentation", "Config").replace("ForSequenceClassification", "Config")
            .replace("LMHeadModel", "Config").replace("ForCausalLM", "Config"))(**config)
        torch.manual_seed(0)
        return Logits(getattr(tf, name)(cfg))
    return make


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return fn()
    return make


IMG = (3, 224, 224)
MODELS: dict[str, Zoo] = {
    "resnet50": Zoo(_hf("ResNetForImageClassification"), 4, IMG),
    "mobilenetv3": Zoo(_seeded(mobilenetv3_small), 8, IMG),
    "efficientnet_b0": Zoo(_hf("EfficientNetForImageClassification", width_coefficient=1.0,
                               depth_coefficient=1.0, image_size=224, hidden_dim=1280), 8, IMG),
    "convnext_t": Zoo(_hf("ConvNextForImageClassification"), 4, IMG),
    "regnety_400mf": Zoo(_hf("RegNetForImageClassification", layer_type="y", embedding_size=32,
                             hidden_sizes=[48, 104, 208, 440], depths=[1, 3, 6, 6],
                             groups_width=8), 8, IMG),
    "shufflenetv2": Zoo(_seeded(shufflenetv2), 8, IMG),
    "segformer_b0": Zoo(_hf("SegformerForSemanticSegmentation"), 2, (3, 256, 256)),
    "vit_s16": Zoo(_hf("ViTForImageClassification", hidden_size=384, num_attention_heads=6,
                       intermediate_size=1536), 4, IMG),
    "swin_t": Zoo(_hf("SwinForImageClassification"), 2, IMG),
    "bert": Zoo(_hf("BertForSequenceClassification", num_hidden_layers=6), 4, (128,), 30522),
    "gpt2": Zoo(_hf("GPT2LMHeadModel", n_layer=6), 2, (128,), 50257),
    "llama": Zoo(_hf("LlamaForCausalLM", hidden_size=512, intermediate_size=1376,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     vocab_size=32000), 2, (128,), 32000),
}
