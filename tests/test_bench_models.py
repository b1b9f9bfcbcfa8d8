"""The bench's issue-28 models (bench/bench_models.py: ResNet-18 for CIFAR, the BERT-like
encoder), at test sizes, run by popart as by their references: inference against onnxruntime,
and training (softmax + nllloss, ConstSGD) against PyTorch eager's log_softmax + nll_loss SGD
over several steps (each step's loss depends on the previous steps' updates)."""
from __future__ import annotations

import os
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

import popart

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import bench_models  # noqa: E402

BATCH, STEPS, LR = 4, 3, 0.05
CASES = {  # name -> (model maker, input shape, vocab)
    "resnet18": (lambda: bench_models.resnet18(width=8), (BATCH, 3, 16, 16), 0),
    "bert": (lambda: bench_models.Bert(vocab=50, seq=16, d_model=32, nhead=2, dim_ff=64,
                                       layers=2, classes=2), (BATCH, 16), 50),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]()


def _input(name: str) -> np.ndarray:
    _, shape, vocab = CASES[name]
    rng = np.random.default_rng(1)
    return (rng.integers(0, vocab, shape).astype(np.int64) if vocab else
            rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("name", list(CASES))
def test_inference_matches_onnxruntime(name):
    _, shape, vocab = CASES[name]
    proto = bench_models.to_onnx(_model(name), shape, vocab=vocab)
    x = _input(name)
    ref = ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    session = popart.InferenceSession(proto, popart.DataFlow(1, {"logits": popart.AnchorReturnType("ALL")}),
                                      popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO({"x": x}, anchors))
    np.testing.assert_allclose(anchors["logits"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_training_losses_match_pytorch(name):
    _, shape, vocab = CASES[name]
    x = _input(name)
    classes = 2 if vocab else bench_models.NUM_CLASSES
    y = np.random.default_rng(2).integers(0, classes, BATCH).astype(np.int32)

    model = _model(name).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    F = torch.nn.functional
    expected = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(model(torch.from_numpy(x)), 1), torch.from_numpy(y).long())
        loss.backward()
        opt.step()
        expected.append(loss.item())

    builder = popart.Builder(bench_models.to_onnx(_model(name), shape, training=True, fold=False,
                                                  vocab=vocab))
    probs = builder.aiOnnx.softmax(["logits"], axis=1)
    label = builder.addInputTensor(popart.TensorInfo("INT32", [BATCH]), "label")
    nll = builder.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Mean)
    session = popart.TrainingSession(builder.getModelProto(),
                                     popart.DataFlow(1, {nll: popart.AnchorReturnType("ALL")}),
                                     nll, popart.ConstSGD(LR), popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    session.weightsFromHost()
    anchors = session.initAnchorArrays()
    got = []
    for _ in range(STEPS):
        session.run(popart.PyStepIO({"x": x, label: y}, anchors))
        got.append(float(anchors[nll]))
    assert expected[0] != pytest.approx(expected[-1], abs=1e-4)   # the updates changed the loss
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
