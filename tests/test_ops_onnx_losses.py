"""ai.onnx losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss) run by the op tester
against PyTorch and onnxruntime, with a finite-difference gradient check (a TrainingSession);
NonMaxSuppression against a NumPy reference; quantized convolutions and TfIdfVectorizer against
onnxruntime."""
import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import popart
from popart import onnx_backend
from popart.errors import popart_exception

from op_tester import Const, RefData, one_op

RNG = np.random.default_rng(3)
ORT = RefData.onnxruntime
OPSETS = {"ai.onnx": 13}


@pytest.fixture
def op_tester(op_tester):
    op_tester.rtol, op_tester.atol = 1e-4, 1e-5
    return op_tester


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)

# (input shape, reduction, weighted, ignore_index)
LOSS_CASES = [
    ((5, 4), "mean", False, None),
    ((5, 4), "sum", True, None),
    ((3, 5, 2), "none", True, 1),
    ((3, 5, 2), "mean", True, 2),
    ((2, 3, 4, 2), "mean", False, 0),
    ((2, 3, 4, 2), "mean", True, -1),
    ((4, 6), "none", False, None),
]


def _loss_case(shape, weighted, ii):
    x = rnd(*shape)
    t = RNG.integers(0, shape[1], (shape[0],) + shape[2:]).astype(np.int64)
    if ii is not None:
        t.reshape(-1)[::3] = ii   # some targets ignored (ii may lie outside [0, C))
    w = RNG.uniform(0.5, 2.0, shape[1]).astype(np.float32) if weighted else None
    inputs = [x, t] + ([w] if weighted else [])
    attrs = {} if ii is None else {"ignore_index": ii}
    return x, t, w, inputs, attrs


def _torch_kw(w, ii, reduction):
    return dict(weight=None if w is None else torch.from_numpy(w),
                ignore_index=-100 if ii is None else ii, reduction=reduction)


def agrees_with_onnxruntime(ref, rtol=1e-4, atol=1e-5):
    """In a reference: the session's outputs are also onnxruntime's."""
    for k, exp in enumerate(ref.onnxruntime()):
        got = ref.getOutputTensor(k)
        assert got.dtype == exp.dtype and got.shape == exp.shape
        np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol)


# op -> (PyTorch's loss, the Builder's other arguments)
LOSSES = {"NegativeLogLikelihoodLoss": (F.nll_loss, {}),
          "SoftmaxCrossEntropyLoss": (F.cross_entropy, {"num_outputs": 2})}


@pytest.mark.parametrize("shape,reduction,weighted,ii", LOSS_CASES)
@pytest.mark.parametrize("op", LOSSES)
def test_loss(op_tester, op, shape, reduction, weighted, ii):
    x, t, w, inputs, attrs = _loss_case(shape, weighted, ii)
    torch_loss, args = LOSSES[op]
    exp = [torch_loss(torch.from_numpy(x), torch.from_numpy(t), **_torch_kw(w, ii, reduction))]
    if op == "SoftmaxCrossEntropyLoss":   # its second output, log_prob
        exp.append(F.log_softmax(torch.from_numpy(x), 1))

    def reference(ref):
        agrees_with_onnxruntime(ref)
        return exp

    op_tester.run(one_op(op, inputs, reduction=reduction, **args, **attrs), reference,
                  opsets=OPSETS, rtol=1e-5, atol=1e-6)


def test_loss_keeps_float64_and_rejects_bad_reduction(op_tester):
    x, t = rnd(4, 3, dtype=np.float64), np.array([0, 2, 1, 2], np.int64)
    exp = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(t))
    op_tester.run(one_op("SoftmaxCrossEntropyLoss", [x, t]), lambda ref: [exp], opsets=OPSETS,
                  rtol=1e-12, atol=0)
    with pytest.raises(popart_exception, match="reduction 'avg'"):
        op_tester.run(one_op("NegativeLogLikelihoodLoss", [x, t], reduction="avg"), None,
                      opsets=OPSETS)


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_gradient(op_tester, op, reduction):
    """Central differences of the session (float64), within 1e-5 * max(1, |gradient|)."""
    x, t, w, inputs, attrs = _loss_case((3, 4, 2), True, 1)
    inputs = [v.astype(np.float64) if v.dtype == np.float32 else v for v in inputs]
    op_tester.run(one_op(op, inputs, grads=[0], reduction=reduction, **attrs),
                  RefData.numeric_grads, step_type="train", opsets=OPSETS, rtol=5e-6, atol=5e-6)


# ---------------------------------------------------------------------------------------
# NonMaxSuppression

def nms_reference(boxes, scores, max_out, iou_thr, score_thr, center):
    out = []
    for b in range(scores.shape[0]):
        bx = boxes[b]
        if center:
            bx = np.stack([bx[:, 1] - bx[:, 3] / 2, bx[:, 0] - bx[:, 2] / 2,
                           bx[:, 1] + bx[:, 3] / 2, bx[:, 0] + bx[:, 2] / 2], 1)
        y0, y1 = np.minimum(bx[:, 0], bx[:, 2]), np.maximum(bx[:, 0], bx[:, 2])
        x0, x1 = np.minimum(bx[:, 1], bx[:, 3]), np.maximum(bx[:, 1], bx[:, 3])
        area = (y1 - y0) * (x1 - x0)
        for c in range(scores.shape[1]):
            s, kept = scores[b, c], []
            for i in sorted(range(len(s)), key=lambda i: (-s[i], i)):
                if len(kept) >= max_out or s[i] <= score_thr:
                    continue
                ih = np.minimum(y1[i], y1[kept]) - np.maximum(y0[i], y0[kept])
                iw = np.minimum(x1[i], x1[kept]) - np.maximum(x0[i], x0[kept])
                inter = np.clip(ih, 0, None) * np.clip(iw, 0, None)
                if not np.any(inter / (area[i] + area[kept] - inter) > iou_thr):
                    kept.append(i)
                    out.append([b, c, i])
    return np.array(out, np.int64).reshape(-1, 3)


@pytest.mark.parametrize("center", [0, 1])
@pytest.mark.parametrize("max_out,iou,score", [(3, 0.5, 0.0), (10, 0.3, 0.4), (2, 0.7, -1.0)])
def test_non_max_suppression(op_tester, center, max_out, iou, score):
    B, C, N = 2, 3, 12
    corner = RNG.uniform(0, 10, (B, N, 2))
    size = RNG.uniform(1, 4, (B, N, 2))
    boxes = (np.concatenate([corner + size / 2, size], 2) if center else
             np.concatenate([corner, corner + size], 2)).astype(np.float32)
    scores = RNG.uniform(0, 1, (B, C, N)).astype(np.float32)
    consts = [np.array([max_out], np.int64), np.array([iou], np.float32),
              np.array([score], np.float32)]
    exp = nms_reference(boxes, scores, max_out, iou, score, center)
    assert len(exp)
    # inputs known when compiling (here: Constant nodes)
    op_tester.run(one_op("NonMaxSuppression", [Const(v) for v in [boxes, scores] + consts],
                         center_point_box=center), lambda ref: [exp], opsets={"ai.onnx": 11})
    # graph inputs: the ONNX backend specializes on boxes and scores
    b = popart.Builder(opsets={"ai.onnx": 11})
    ids = [b.addInputTensor(popart.TensorInfo(v)) for v in (boxes, scores)]
    y = b.aiOnnx.nonmaxsuppression(ids + [b.aiOnnx.constant(v) for v in consts],
                                   center_point_box=center)
    b.addOutputTensor(y)
    model = b.getModelProto()
    (got,) = onnx_backend.prepare(model).run([boxes, scores])
    np.testing.assert_array_equal(got, exp)
    (ref,) = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(
        None, dict(zip(ids, (boxes, scores))))
    np.testing.assert_array_equal(got, ref)


def test_non_max_suppression_runtime_boxes(op_tester):
    """Boxes and scores of run-time data: NMS runs on the host after the compiled program."""
    boxes, scores = rnd(1, 4, 4), rnd(1, 1, 4)
    op_tester.run(one_op("NonMaxSuppression", [boxes, scores, Const(np.array([2], np.int64))]),
                  lambda ref: [nms_reference(boxes, scores, 2, 0.0, -np.inf, 0)],
                  opsets={"ai.onnx": 11})


# ---------------------------------------------------------------------------------------
# ConvInteger, QLinearConv, TfIdfVectorizer (against onnxruntime)

@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 1, 1, 1], "strides": [2, 1]}, {"group": 2}])
def test_conv_integer(op_tester, attrs):
    x = RNG.integers(0, 255, (1, 4, 6, 5)).astype(np.uint8)
    w = RNG.integers(0, 255, (4, 4 // attrs.get("group", 1), 3, 3)).astype(np.uint8)
    (got,) = op_tester.run(one_op("ConvInteger", [x, w, np.array(3, np.uint8),
                                                  np.array(120, np.uint8)], **attrs),
                           ORT, opsets={"ai.onnx": 10})
    assert got.dtype == np.int32


def test_qlinear_conv_per_channel(op_tester):
    x = RNG.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    w = RNG.integers(-100, 100, (3, 2, 3, 3)).astype(np.int8)
    inputs = [x, np.array(0.02, np.float32), np.array(128, np.uint8), w,
              np.array([0.01, 0.02, 0.015], np.float32), np.zeros(3, np.int8),
              np.array(0.5, np.float32), np.array(100, np.uint8),
              RNG.integers(-500, 500, 3).astype(np.int32)]
    op_tester.run(one_op("QLinearConv", inputs, pads=[1, 1, 1, 1]), ORT, opsets={"ai.onnx": 10},
                  atol=1)   # integers: off by one at most (rounding)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf_vectorizer(op_tester, mode):
    x = RNG.integers(0, 6, (3, 9)).astype(np.int64)
    attrs = dict(mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=2,
                 ngram_counts=[0, 4], ngram_indexes=[0, 1, 2, 3, 4, 5, 6],
                 pool_int64s=[1, 2, 3, 5, 1, 2, 3, 3, 0, 4], weights=[1, .5, 2, 1, 3, .2, 1])
    op_tester.run(one_op("TfIdfVectorizer", [x], **attrs), ORT, opsets={"ai.onnx": 9})
