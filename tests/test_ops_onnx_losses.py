"""ai.onnx losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss) against PyTorch, with a
finite-difference gradient check; NonMaxSuppression against a NumPy reference; quantized
convolutions and TfIdfVectorizer against onnxruntime."""
import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from popart import onnx_backend
from popart.errors import popart_exception
from test_ops_nn import check, fd_grad_check, one_node, ours, rnd

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

RNG = np.random.default_rng(3)

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
    feeds = {"x": x, "t": t} | ({"w": w} if weighted else {})
    attrs = {} if ii is None else {"ignore_index": ii}
    return x, t, w, feeds, attrs


def _torch_kw(w, ii, reduction):
    return dict(weight=None if w is None else torch.from_numpy(w),
                ignore_index=-100 if ii is None else ii, reduction=reduction)


@pytest.mark.parametrize("shape,reduction,weighted,ii", LOSS_CASES)
def test_nll_loss(shape, reduction, weighted, ii):
    x, t, w, feeds, attrs = _loss_case(shape, weighted, ii)
    model = one_node("NegativeLogLikelihoodLoss", feeds, reduction=reduction, opset=13, **attrs)
    (got,) = ours(model, feeds)
    exp = F.nll_loss(torch.from_numpy(x), torch.from_numpy(t), **_torch_kw(w, ii, reduction))
    assert got.dtype == np.float32 and got.shape == tuple(exp.shape)
    np.testing.assert_allclose(got, exp.numpy(), rtol=1e-5, atol=1e-6)
    check(model, feeds)


@pytest.mark.parametrize("shape,reduction,weighted,ii", LOSS_CASES)
def test_softmax_cross_entropy_loss(shape, reduction, weighted, ii):
    x, t, w, feeds, attrs = _loss_case(shape, weighted, ii)
    model = one_node("SoftmaxCrossEntropyLoss", feeds, n_out=2, reduction=reduction, opset=13,
                     **attrs)
    loss, logp = ours(model, feeds)
    exp = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(t), **_torch_kw(w, ii, reduction))
    assert loss.dtype == np.float32 and loss.shape == tuple(exp.shape)
    np.testing.assert_allclose(loss, exp.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logp, F.log_softmax(torch.from_numpy(x), 1).numpy(), rtol=1e-5,
                               atol=1e-6)
    check(model, feeds)


def test_loss_keeps_float64_and_rejects_bad_reduction():
    x, t = rnd(4, 3, dtype=np.float64), np.array([0, 2, 1, 2], np.int64)
    (got,) = ours(one_node("SoftmaxCrossEntropyLoss", {"x": x, "t": t}, opset=13), {"x": x, "t": t})
    assert got.dtype == np.float64
    with pytest.raises(popart_exception, match="reduction 'avg'"):
        ours(one_node("NegativeLogLikelihoodLoss", {"x": x, "t": t}, reduction="avg", opset=13),
             {"x": x, "t": t})


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_gradient(op, reduction):
    x, t, w, feeds, attrs = _loss_case((3, 4, 2), True, 1)
    fd_grad_check(one_node(op, feeds, reduction=reduction, opset=13, **attrs), feeds, "x")


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
def test_non_max_suppression(center, max_out, iou, score):
    B, C, N = 2, 3, 12
    corner = RNG.uniform(0, 10, (B, N, 2))
    size = RNG.uniform(1, 4, (B, N, 2))
    boxes = (np.concatenate([corner + size / 2, size], 2) if center else
             np.concatenate([corner, corner + size], 2)).astype(np.float32)
    scores = RNG.uniform(0, 1, (B, C, N)).astype(np.float32)
    feeds = {"boxes": boxes, "scores": scores}
    consts = {"m": np.array([max_out], np.int64), "iou": np.array([iou], np.float32),
              "st": np.array([score], np.float32)}
    model = one_node("NonMaxSuppression", feeds, consts=consts, center_point_box=center, opset=11)
    exp = nms_reference(boxes, scores, max_out, iou, score, center)
    assert len(exp)
    # inputs known when compiling (here: folded as initializers)
    (got,) = ours(one_node("NonMaxSuppression", {}, consts=feeds | consts,
                           center_point_box=center, opset=11), {})
    np.testing.assert_array_equal(got, exp)
    # graph inputs: the ONNX backend specializes on boxes and scores
    (got,) = onnx_backend.prepare(model).run(feeds)
    np.testing.assert_array_equal(got, exp)
    (ref,) = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(got, ref)


def test_non_max_suppression_runtime_boxes_error():
    boxes, scores = rnd(1, 4, 4), rnd(1, 1, 4)
    feeds = {"boxes": boxes, "scores": scores}
    model = one_node("NonMaxSuppression", feeds, consts={"m": np.array([2], np.int64)}, opset=11)
    with pytest.raises(popart_exception, match="depends on their values"):
        ours(model, feeds)


# ---------------------------------------------------------------------------------------
# ConvInteger, QLinearConv, TfIdfVectorizer (against onnxruntime)

@pytest.mark.parametrize("attrs", [{}, {"pads": [1, 1, 1, 1], "strides": [2, 1]}, {"group": 2}])
def test_conv_integer(attrs):
    x = RNG.integers(0, 255, (1, 4, 6, 5)).astype(np.uint8)
    w = RNG.integers(0, 255, (4, 4 // attrs.get("group", 1), 3, 3)).astype(np.uint8)
    feeds = {"x": x, "w": w, "xz": np.array(3, np.uint8), "wz": np.array(120, np.uint8)}
    got = check(one_node("ConvInteger", feeds, opset=10, **attrs), feeds)
    assert got[0].dtype == np.int32


def test_qlinear_conv_per_channel():
    x = RNG.integers(0, 255, (1, 2, 5, 5)).astype(np.uint8)
    w = RNG.integers(-100, 100, (3, 2, 3, 3)).astype(np.int8)
    feeds = {"x": x, "xs": np.array(0.02, np.float32), "xz": np.array(128, np.uint8), "w": w,
             "ws": np.array([0.01, 0.02, 0.015], np.float32), "wz": np.zeros(3, np.int8),
             "ys": np.array(0.5, np.float32), "yz": np.array(100, np.uint8),
             "b": RNG.integers(-500, 500, 3).astype(np.int32)}
    check(one_node("QLinearConv", feeds, opset=10, pads=[1, 1, 1, 1]), feeds, atol=1)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf_vectorizer(mode):
    x = RNG.integers(0, 6, (3, 9)).astype(np.int64)
    attrs = dict(mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=2,
                 ngram_counts=[0, 4], ngram_indexes=[0, 1, 2, 3, 4, 5, 6],
                 pool_int64s=[1, 2, 3, 5, 1, 2, 3, 3, 0, 4], weights=[1, .5, 2, 1, 3, .2, 1])
    check(one_node("TfIdfVectorizer", {"x": x}, opset=9, **attrs), {"x": x})
