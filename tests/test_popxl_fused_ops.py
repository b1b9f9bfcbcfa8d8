"""popxl ops whose numbers are not autodiff of a plain formula, each against NumPy written
from PopART's C++ definition (docs/popxl_ops.md names the file and line of each):
nll_loss_with_softmax_grad (NlllWithSoftmaxGradDirectOpx), nll_loss's gradient (NllGradOpx),
the pow2-scaled float8 casts and matmul, interpolate's modes and its nearest gradient
(ResizeOpx / ResizeGradOpx), subsample, concat's type rule, increment_mod, histogram,
scaled_add, lamb_square and in-place variants.

One session runs every forward check (``outs``); errors are checked while building."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import popart
import popxl
from popxl import ops, transforms

from helpers.popxl_case import store_and_run

RNG = np.random.default_rng(24)
F8 = {"143": ml_dtypes.float8_e4m3fnuz, "152": ml_dtypes.float8_e5m2fnuz}


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _grad(ir: popxl.Ir, fn, x: popxl.Tensor, dy) -> popxl.Tensor:
    """d fn(x) / dx (times ``dy``) by popxl's autodiff of the graph of ``fn``, called as the
    user guide calls grad graphs."""
    graph = ir.create_graph(fn, x)
    info = ops.call_with_info(graph, x)
    bwd = transforms.autodiff(graph)
    dy = dy if isinstance(dy, popxl.Tensor) else popxl.constant(dy, x.dtype)
    return ops.call(bwd.graph, dy, inputs_dict=bwd.inputs_dict(info))[0]


# ---------------------------------------------------------------------------------------
# NumPy references, written from PopART's C++

def nll_direct_ref(p, lab, g, reduction, ignore=None):
    """NlllWithSoftmaxGradDirectOpx::grow with NllOpx's helpers (nllx.cpp): loss
    -log(p[label] + 1e-7) masked and reduced; grad (p - onehot) masked, times g (Mean:
    g / non-ignored count (at least 1), or g / probs.shape[0] without ignore_index)."""
    p2, l1 = p.reshape(-1, p.shape[-1]).astype(np.float64), lab.reshape(-1)
    onehot = (l1[:, None] == np.arange(p.shape[-1])).astype(np.float64)
    mask = np.ones(len(l1)) if ignore is None else (l1 != ignore).astype(np.float64)
    logp = np.log((p2 * onehot).sum(1) + 1e-7) * mask
    n_kept = max(mask.sum(), 1)
    if reduction == "none":
        loss = -logp.reshape(lab.shape)
    elif reduction == "sum":
        loss = -logp.sum()
    else:
        loss = -(logp / n_kept).sum() if ignore is not None else -logp.sum() / len(l1)
    g = np.asarray(g, np.float64)
    g = g.reshape(g.shape + (1,) * (p.ndim - g.ndim))
    d = ((p2 - onehot) * mask[:, None]).reshape(p.shape)
    if reduction == "mean":
        g = g / (n_kept if ignore is not None else p.shape[0])
    return loss, d * g


def nll_grad_ref(p, lab, g, ignore=None, log_prob=False):
    """NllGradOpx (Mean): -1 / max(p, 1e-10) (or -1 with log_prob) at the label, 0
    elsewhere, masked, times g / (non-ignored count, or probs.shape[0])."""
    onehot = (lab[..., None] == np.arange(p.shape[-1])).astype(np.float64)
    mask = np.ones(lab.shape) if ignore is None else (lab != ignore).astype(np.float64)
    d = -onehot if log_prob else -onehot / np.maximum(p, 1e-10)
    n = max(mask.sum(), 1) if ignore is not None else p.shape[0]
    return d * mask[..., None] * g / n


def _coord(i, mode, scale, n_in):
    """resizex.cpp coordinateTransformation, in float32."""
    i, s = np.float32(i), np.float32(scale)
    size = np.float32(n_in) * s
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and size > 1):
        return (i + np.float32(0.5)) / s - np.float32(0.5)
    if mode == "pytorch_half_pixel":
        return np.float32(0)
    if mode == "asymmetric":
        return i / s
    return np.float32(0) if size == 1 else i * np.float32(n_in - 1) / (size - np.float32(1))


def _nearest(v, mode):
    """applyNearestMode."""
    if mode == "round_prefer_floor":
        return np.floor(v) if v - np.floor(v) <= 0.5 else np.ceil(v)
    if mode == "round_prefer_ceil":
        return np.sign(v) * np.floor(abs(v) + 0.5)   # std::round: half away from zero
    return np.floor(v) if mode == "floor" else np.ceil(v)


def _cubic_coeffs(r, a=-0.75):
    """ResizeCubicHelper::cubicCoeffs for offsets -1, 0, 1, 2."""
    return [((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
            ((a + 2) * r - (a + 3)) * r * r + 1,
            ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
            ((a * ((1 - r) + 1) - 5 * a) * ((1 - r) + 1) + 8 * a) * ((1 - r) + 1) - 4 * a]


def resize_ref(x, scales, mode, nearest_mode, coord):
    """ResizeOpx: axis by axis (skipping scale 1), output size floor(n * scale)."""
    y = x.astype(np.float64)
    for ax, s in enumerate(scales):
        if s == 1:
            continue
        n_in = y.shape[ax]
        n_out = int(np.floor(np.float32(n_in) * np.float32(s)))
        clamp = lambda k: int(min(max(k, 0), n_in - 1))
        rows = []
        for i in range(n_out):
            c = _coord(i, coord, s, n_in)
            w = np.zeros(n_in)
            if mode == "nearest":
                w[clamp(_nearest(c, nearest_mode))] = 1
            elif mode == "linear":
                f = max(c, 0) - np.floor(max(c, 0))
                w[clamp(np.floor(c))] += 1 - f
                w[clamp(np.ceil(c))] += f
            else:
                base = int(np.floor(c))
                for k, cf in zip(range(-1, 3), _cubic_coeffs(c - base)):
                    w[clamp(base + k)] += cf
            rows.append(w)
        y = np.moveaxis(np.tensordot(np.array(rows), np.moveaxis(y, ax, 0), 1), 0, ax)
    return y


def resize_nearest_grad_ref(g, in_shape, scales):
    """ResizeGradOpx::resizeNearestGrad: per axis, output gradient i goes to input position
    floor(i * (1 / scale)): summed when upsampled (reduceDimension), the last one kept when
    downsampled (padDimension)."""
    for ax, n_in in enumerate(in_shape):
        n_out = g.shape[ax]
        if n_out == n_in:
            continue
        r = np.float32(1) / np.float32(scales[ax])
        gm, out = np.moveaxis(g, ax, 0), np.zeros((n_in,) + np.moveaxis(g, ax, 0).shape[1:])
        for i in range(n_out):
            j = int(np.floor(np.float32(i) * r))
            if n_out > n_in:
                out[j] += gm[i]
            else:
                out[j] = gm[i]
        g = np.moveaxis(out, 0, ax)
    return g


# ---------------------------------------------------------------------------------------
# One session for every forward and gradient check

P2 = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], np.float32)
L2 = np.array([0, 2], np.int32)
P3 = _softmax(RNG.normal(size=(2, 3, 5)) * 2).astype(np.float32)
L3 = np.array([[1, 4, 0], [2, 2, 3]], np.int32)
G3 = RNG.uniform(0.5, 2, size=(2, 3)).astype(np.float32)
X8 = np.array([0.3, -1.7, 5.0, 100.0, -0.004, 0.0], np.float32)
XR = RNG.normal(size=(2, 3, 5)).astype(np.float32)
SCALES = (1.0, 2.5, 0.6)
RESIZES = ([("nearest", nm, "half_pixel") for nm in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")]
           + [(m, "round_prefer_floor", c) for m in ("nearest", "linear", "cubic")
              for c in ("pytorch_half_pixel", "align_corners", "asymmetric")]
           + [("linear", "round_prefer_floor", "half_pixel"), ("cubic", "round_prefer_floor", "half_pixel")])
RESIZE_GRADS = (("round_prefer_ceil", "half_pixel"), ("floor", "align_corners"))
XS = np.array([-3.0, -1.5, 0.0, 2.0, 7.5, 4.0], np.float32)
LOG2 = (3, -2)


@pytest.fixture(scope="module")
def outs():
    ir = popxl.Ir()
    t = {}
    with ir.main_graph:
        # nll_loss_with_softmax_grad
        p2, l2 = popxl.constant(P2), popxl.constant(L2)
        t["nll2_loss"], t["nll2_dx"] = ops.nll_loss_with_softmax_grad(p2, l2)
        p3, l3 = popxl.constant(P3), popxl.constant(L3)
        for red in ("mean", "sum"):
            for ig in (None, 4):
                g = popxl.constant(np.float32(3.0))
                t[f"nll3_{red}_{ig}_loss"], t[f"nll3_{red}_{ig}_dx"] = ops.nll_loss_with_softmax_grad(
                    p3, l3, g, ignore_index=ig, reduction=red)
        t["nll3_none_loss"], t["nll3_none_dx"] = ops.nll_loss_with_softmax_grad(
            p3, l3, popxl.constant(G3), ignore_index=2, reduction="none")
        t["nll_allign_loss"], t["nll_allign_dx"] = ops.nll_loss_with_softmax_grad(
            p2, popxl.constant(np.array([1, 1], np.int32)), ignore_index=1)
        t["nll16_loss"], t["nll16_dx"] = ops.nll_loss_with_softmax_grad(
            popxl.constant(P3.astype(np.float16)), l3, popxl.constant(np.float32(4096.0)))
        # nll_loss differentiated by autodiff (NllGrad's rule)
        v3 = popxl.variable(P3, name="p3")
        t["nllgrad"] = _grad(ir, lambda p: ops.nll_loss(p, popxl.constant(L3), ignore_index=0), v3, 2.0)
        t["nllgrad_log"] = _grad(ir, lambda p: ops.nll_loss(p, popxl.constant(L3), log_prob=True),
                                 v3, 1.0)
        # float8
        x8 = popxl.constant(X8)
        for i, s in enumerate(LOG2):
            sc = popxl.variable(np.int32(s), popxl.int32, name=f"log2_{i}")
            for f, dt in (("143", popxl.float8_143), ("152", popxl.float8_152)):
                q = ops.pow2scale_cast_to_fp8(x8, sc, dt)
                t[f"to{f}_{i}"] = ops.pow2scale_cast_from_fp8(q, popxl.constant(np.int32(0)), popxl.float32)
                t[f"back{f}_{i}"] = ops.pow2scale_cast_from_fp8(q, sc, popxl.float16)
        a8 = popxl.variable(ml_dtypes_cast(A8, "143"), popxl.float8_143, name="a8")
        b8 = popxl.variable(ml_dtypes_cast(B8, "152"), popxl.float8_152, name="b8")
        t["mm8"] = ops.matmul_pow2scaled(a8, b8, popxl.constant(np.int32(-3)))
        # interpolate
        xr = popxl.variable(XR, name="xr")
        for k, (m, nm, c) in enumerate(RESIZES):
            t[f"rs{k}"] = ops.interpolate(xr, SCALES, m, nm, c)
        for k, (nm, c) in enumerate(RESIZE_GRADS):
            dy = popxl.constant(GY)
            t[f"rsg{k}"] = _grad(ir, lambda v, nm=nm, c=c: ops.interpolate(v, SCALES, "nearest", nm, c), xr, dy)
        t["rsg_cubic"] = _grad(ir, lambda v: ops.interpolate(v, SCALES, "cubic"), xr, popxl.constant(GY))
        # the rest
        t["sub_int"] = ops.subsample(popxl.constant(XR), 2)
        t["sub_list"] = ops.subsample(popxl.constant(XR), [1, 2])
        xs = popxl.constant(XS)
        t["incmod"] = ops.increment_mod(xs, 1.0, 3.0)
        vs = popxl.variable(XS, name="vs")
        ops.increment_mod_(vs, 0.5, 2.0)
        t["incmod_"] = vs * 1.0
        t["hist"] = ops.histogram(xs, [-1.5, 0.5, 4.0], absolute_of_input=False)
        t["hist_abs"] = ops.histogram(xs, [-1.5, 0.5, 4.0], absolute_of_input=True)
        t["sadd_tt"] = ops.scaled_add(xs, xs * 2.0, popxl.constant(np.float32(0.5)),
                                      popxl.constant(np.float32(-1.5)))
        t["sadd_1t"] = ops.scaled_add(xs, xs * 2.0, 1.0, popxl.constant(np.float32(0.25)))
        t["sadd_cc"] = ops.scaled_add(xs, xs * 2.0, 2.0, 3.0)
        vi = popxl.variable(XS, name="vi")
        ops.add_(vi, 1.0)
        ops.mul_(vi, vi)
        ops.relu_(ops.sub_(vi, 10.0))
        t["inplace"] = vi + 0.0
        t["lamb16"] = ops.lamb_square(popxl.constant(XR.astype(np.float16) * 100))
        t["ln3"] = ops.layer_norm(xr, popxl.constant(LN_W), popxl.constant(LN_B), eps=1e-3)
    return store_and_run(ir, t)


A8 = RNG.uniform(-4, 4, size=(3, 4)).astype(np.float32)
B8 = RNG.uniform(-4, 4, size=(4, 2)).astype(np.float32)
GY = RNG.normal(size=(2, 7, 3)).astype(np.float32)
LN_W, LN_B = np.array([1.5, -0.5, 2.0], np.float32), np.array([0.1, 0.2, -0.3], np.float32)


def ml_dtypes_cast(x, fmt):
    return x.astype(F8[fmt])


# ---------------------------------------------------------------------------------------
# nll_loss_with_softmax_grad


def test_nll_loss_with_softmax_grad_takes_probabilities(outs):
    """The issue's example: PopXL's numbers (the package gave 0.7288 when it applied softmax
    again)."""
    np.testing.assert_allclose(outs["nll2_loss"], 0.28990912, rtol=1e-6)
    np.testing.assert_allclose(outs["nll2_dx"], [[-0.15, 0.1, 0.05], [0.05, 0.05, -0.1]], atol=1e-7)
    loss, dx = nll_direct_ref(P2, L2, 1.0, "mean")
    np.testing.assert_allclose(outs["nll2_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(outs["nll2_dx"], dx, atol=1e-7)


@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("ig", [None, 4])
def test_nll_loss_with_softmax_grad_reductions_and_ignore_index(outs, red, ig):
    loss, dx = nll_direct_ref(P3, L3, 3.0, red, ig)
    np.testing.assert_allclose(outs[f"nll3_{red}_{ig}_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(outs[f"nll3_{red}_{ig}_dx"], dx, rtol=1e-6, atol=1e-7)
    assert outs[f"nll3_{red}_{ig}_dx"].shape == P3.shape


def test_nll_loss_with_softmax_grad_mean_divides_the_grad_by_the_first_dimension(outs):
    """Without ignore_index, PopART's Mean scales the loss by the number of labels (6) but
    the gradient by probs.shape[0] (2): applyScalingInPlaceForMeanReduction reads dim(0) of
    the gradient reshaped to probs' shape."""
    _, dx_sum = nll_direct_ref(P3, L3, 3.0, "sum")
    np.testing.assert_allclose(outs["nll3_mean_None_dx"], dx_sum / 2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(outs["nll3_mean_None_loss"] * 6, outs["nll3_sum_None_loss"], rtol=1e-6)


def test_nll_loss_with_softmax_grad_no_reduction_takes_per_sample_loss_grad(outs):
    loss, dx = nll_direct_ref(P3, L3, G3, "none", 2)
    assert outs["nll3_none_loss"].shape == L3.shape
    np.testing.assert_allclose(outs["nll3_none_loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(outs["nll3_none_dx"], dx, rtol=1e-6, atol=1e-7)
    assert np.all(outs["nll3_none_dx"][L3 == 2] == 0)


def test_nll_loss_with_softmax_grad_every_label_ignored_is_zero(outs):
    """The count of non-ignored labels is at least 1: loss 0 and gradient 0, not NaN."""
    assert outs["nll_allign_loss"] == 0
    assert np.all(outs["nll_allign_dx"] == 0)


def test_nll_loss_with_softmax_grad_float16_with_float32_loss_scale(outs):
    """float16 probabilities, a float32 loss_grad: both outputs float16, the scale applied
    to the float16 gradient (4096 / 2 per row)."""
    p16 = P3.astype(np.float16)
    loss, dx = nll_direct_ref(p16.astype(np.float32), L3, 4096.0, "mean")
    assert outs["nll16_loss"].dtype == np.float16 and outs["nll16_dx"].dtype == np.float16
    np.testing.assert_allclose(outs["nll16_loss"], loss, rtol=2e-3)
    np.testing.assert_allclose(outs["nll16_dx"], dx, rtol=2e-3, atol=0.5)


def test_nll_loss_gradient_is_nllgrads(outs):
    np.testing.assert_allclose(outs["nllgrad"], nll_grad_ref(P3, L3, 2.0, ignore=0), rtol=1e-6)
    np.testing.assert_allclose(outs["nllgrad_log"], nll_grad_ref(P3, L3, 1.0, log_prob=True), rtol=1e-6)


def test_nll_reduction_names():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="Not a valid reduction: avg. Must choose from: mean, sum, none"):
            ops.nll_loss_with_softmax_grad(popxl.constant(P2), popxl.constant(L2), reduction="avg")
        with pytest.raises(ValueError, match="Not a valid reduction"):
            ops.nll_loss(popxl.constant(P2), popxl.constant(L2), reduction="Mean")


# ---------------------------------------------------------------------------------------
# float8


@pytest.mark.parametrize("fmt", ["143", "152"])
@pytest.mark.parametrize("i", [0, 1])
def test_pow2scale_casts(outs, fmt, i):
    """Pow2ScaleThenCastOpx: cast(x * 2**s) to float8 (NaN beyond its range, as
    ml_dtypes' fnuz formats); CastThenPow2ScaleOpx: cast(q) * 2**s."""
    s = LOG2[i]
    q = (X8.astype(np.float64) * 2.0 ** s).astype(np.float32).astype(F8[fmt])
    np.testing.assert_array_equal(outs[f"to{fmt}_{i}"], q.astype(np.float32))
    back = (q.astype(np.float32) * np.float32(2.0 ** s)).astype(np.float16)
    np.testing.assert_array_equal(outs[f"back{fmt}_{i}"], back)
    if fmt == "143" and s == 3:
        assert np.isnan(outs[f"to{fmt}_{i}"][3])          # 800 > 240


def test_matmul_pow2scaled(outs):
    """MatMulOpx: lhs read with log2 scale s, rhs with 0: (a @ b) * 2**s in float16."""
    a, b = ml_dtypes_cast(A8, "143").astype(np.float32), ml_dtypes_cast(B8, "152").astype(np.float32)
    assert outs["mm8"].dtype == np.float16
    np.testing.assert_allclose(outs["mm8"], ((a @ b) * 2.0 ** -3).astype(np.float16), rtol=1e-3)


def test_log2_scale_out_of_range_fails_the_run():
    """createAssertLog2ScaleInRangeProg: a log2 scale outside [-32, 32) stops the run."""
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.variable(np.int32(32), popxl.int32, name="s")
        y = ops.pow2scale_cast_to_fp8(popxl.constant(X8), s, popxl.float8_143)
        y = ops.pow2scale_cast_from_fp8(y, popxl.constant(np.int32(0)), popxl.float32)
    with pytest.raises(popart.popart_exception, match=r"Log2 scale is not in the range \[-32, 32\)"):
        store_and_run(ir, {"y": y})


def test_concat_of_two_float8_formats_is_a_type_error():
    ir = popxl.Ir()
    with ir.main_graph:
        s = popxl.constant(np.int32(0))
        a = ops.pow2scale_cast_to_fp8(popxl.constant(X8), s, popxl.float8_143)
        b = ops.pow2scale_cast_to_fp8(popxl.constant(X8), s, popxl.float8_152)
        with pytest.raises(TypeError, match="All inputs to a concat operation must have the same type"):
            ops.concat([a, b])
        with pytest.raises(TypeError, match="same type"):
            ops.concat_([a, b])
        assert ops.concat([a, a]).dtype == popxl.float8_143


# ---------------------------------------------------------------------------------------
# interpolate


@pytest.mark.parametrize("k", range(len(RESIZES)))
def test_interpolate_modes(outs, k):
    m, nm, c = RESIZES[k]
    ref = resize_ref(XR, SCALES, m, nm, c)
    assert outs[f"rs{k}"].shape == ref.shape == (2, 7, 3)
    np.testing.assert_allclose(outs[f"rs{k}"], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", range(len(RESIZE_GRADS)))
def test_interpolate_nearest_gradient_is_resizegrads(outs, k):
    """PopART's nearest gradient ignores the nearest and coordinate modes: it is the
    transpose of floor(i / scale), not of the forward's index map."""
    ref = resize_nearest_grad_ref(GY.astype(np.float64), XR.shape, SCALES)
    np.testing.assert_allclose(outs[f"rsg{k}"], ref, rtol=1e-6, atol=1e-6)


def test_interpolate_cubic_gradient_is_the_transpose(outs):
    eye = np.eye(XR.size).reshape((-1,) + XR.shape)
    jac = np.stack([resize_ref(e, SCALES, "cubic", "round_prefer_floor", "half_pixel").ravel() for e in eye])
    np.testing.assert_allclose(outs["rsg_cubic"].ravel(), jac @ GY.ravel().astype(np.float64), rtol=1e-5,
                               atol=1e-5)


def test_interpolate_errors():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(XR)
        with pytest.raises(ValueError, match="interpolate type area is not valid, must be nearest, "
                                             "linear or cubic."):
            ops.interpolate(x, SCALES, "area")
        with pytest.raises(ValueError, match="must be round_prefer_floor, round_prefer_ceil, floor or ceil"):
            ops.interpolate(x, SCALES, nearest_mode="round")
        with pytest.raises(popart.popart_exception, match="Unsupported coordinate transformation mode"):
            ops.interpolate(x, SCALES, coordinate_transformation_mode="tf_crop_and_resize")
        with pytest.raises(popart.popart_exception, match=r"scales \(2\) must match .* input \(3\)"):
            ops.interpolate(x, (2.0, 2.0))


def test_interpolate_linear_has_no_gradient():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(XR)
        with pytest.raises(popart.popart_exception, match="Resize mode 'linear' is not supported when training"):
            g = _grad(ir, lambda v: ops.interpolate(v, SCALES, "linear"), x, popxl.constant(GY))
            store_and_run(ir, {"g": g})


# ---------------------------------------------------------------------------------------
# subsample, increment_mod, histogram, scaled_add, in-place, lamb_square


def test_subsample(outs):
    """SubsampleOp: an int is the first dimension's stride, missing strides are 1; sizes
    round up."""
    np.testing.assert_array_equal(outs["sub_int"], XR[::2])
    np.testing.assert_array_equal(outs["sub_list"], XR[:, ::2])
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="must not be greater than the rank"):
            ops.subsample(popxl.constant(XR), [1, 1, 1, 1])
        with pytest.raises(popart.popart_exception, match="Strides invalid. 0 stride at index 1"):
            ops.subsample(popxl.constant(XR), [1, 0])


def test_increment_mod_keeps_the_dividends_sign(outs):
    """popops Rem: fmod, so -2 rem 3 is -2 (Python's modulo gives 1)."""
    np.testing.assert_array_equal(outs["incmod"], np.fmod(XS + 1, 3))
    np.testing.assert_array_equal(outs["incmod_"], np.fmod(XS + 0.5, 2))


def test_histogram(outs):
    """popops::histogram: counts in (-inf, l0), [l0, l1), ..., [l_last, inf)."""
    for key, v in (("hist", XS), ("hist_abs", np.abs(XS))):
        edges = [-np.inf, -1.5, 0.5, 4.0, np.inf]
        ref = [np.sum((v >= lo) & (v < hi)) for lo, hi in zip(edges, edges[1:])]
        np.testing.assert_array_equal(outs[key], ref)
        assert outs[key].dtype == np.uint32
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="not a monotonically increasing list"):
            ops.histogram(popxl.constant(XS), [1.0, 1.0])


def test_scaled_add(outs):
    np.testing.assert_allclose(outs["sadd_tt"], 0.5 * XS - 1.5 * 2 * XS)
    np.testing.assert_allclose(outs["sadd_1t"], XS + 0.25 * 2 * XS)
    np.testing.assert_allclose(outs["sadd_cc"], 2 * XS + 3 * 2 * XS)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(XS)
        with pytest.raises(popart.popart_exception, match="Unsupported tensor scale0 with non-tensor scale1."):
            ops.scaled_add(x, x, popxl.constant(np.float32(2)), 1.0)
        with pytest.raises(popart.popart_exception, match="Unsupported scale0 2.0 with tensor scale1."):
            ops.scaled_add(x, x, 2.0, popxl.constant(np.float32(2)))


def test_inplace_variants_update_the_tensor(outs):
    np.testing.assert_allclose(outs["inplace"], np.maximum((XS + 1) ** 2 - 10, 0))


def test_lamb_square_sums_in_float32(outs):
    """LambSquareOp: float32 output, squares summed in float32 (float16 would overflow)."""
    x = (XR.astype(np.float16) * np.float16(100)).astype(np.float32)
    assert outs["lamb16"].dtype == np.float32
    np.testing.assert_allclose(outs["lamb16"], np.sum(x.astype(np.float64) ** 2), rtol=1e-5)


def test_view_ops_alias_their_input():
    """PopXL's reshape_ / transpose_ (Tensor.T_) / slice_ / concat_ return aliases: an
    in-place op on the view changes the input (a variable keeps the change), and one on the
    input changes the view."""
    x0 = np.arange(12, dtype=np.float32).reshape(3, 4)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(x0, name="x")
        ops.add_(ops.slice_(x, [0, 1], [3, 4], [2, 2]), 100.0)     # rows 0, 2; columns 1, 3
        r = x.reshape_((4, 3))
        ops.mul_(x, 2.0)                                            # seen through r
        ops.scaled_add_(x.T_, popxl.constant(np.ones((4, 3), np.float32)), 1.0, 0.5)
        a = popxl.variable(np.zeros(2, np.float32), name="a")
        b = popxl.variable(np.ones(3, np.float32), name="b")
        c = ops.concat_([a, b])
        ops.add_(c, 5.0)
        ops.add_(a, 1.0)
        plain = ops.reshape(x, (12,))
        ops.add_(plain, 1000.0)                                     # not a view: x unchanged
        got = store_and_run(ir, {"r": r + 0.0, "c": c + 0.0, "x": x + 0.0, "a": a + 0.0, "b": b + 0.0})
    want = x0.copy()
    want[::2, 1::2] += 100
    want = want * 2 + 0.5
    np.testing.assert_array_equal(got["x"], want)
    np.testing.assert_array_equal(got["r"], want.reshape(4, 3))   # r follows every update of x
    np.testing.assert_array_equal(got["c"], [6.0] * 5)
    np.testing.assert_array_equal(got["a"], [6.0, 6.0])
    np.testing.assert_array_equal(got["b"], [6.0, 6.0, 6.0])


@pytest.mark.parametrize("what,msg", [
    ("cast", "Floating point 8 is not supported for training"),
    ("matmul", "Using a scaled matmul in a backwards pass is currently not supported.")])
def test_float8_ops_have_no_gradient(what, msg):
    """PopART's float8 ops throw from getGradOps (op/pow2scalethencast.cpp, op/matmul.cpp)."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(A8, name="x")

        def fn(v):
            s = popxl.constant(np.int32(0))
            q = ops.pow2scale_cast_to_fp8(v, s, popxl.float8_143)
            if what == "matmul":
                return ops.matmul_pow2scaled(q, popxl.constant(ml_dtypes_cast(B8, "143")), s)
            return ops.pow2scale_cast_from_fp8(q, s, popxl.float32)
        with pytest.raises(popart.popart_exception, match=msg):
            out = _grad(ir, fn, x, popxl.constant(np.ones((3, 2) if what == "matmul" else (3, 4),
                                                          np.float16 if what == "matmul" else np.float32)))
            store_and_run(ir, {"g": out})


def test_pow2scale_cast_from_fp8_needs_float8_input():
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(popart.popart_exception, match="Casting from FLOAT8 is only supported for "
                                                          "FLOAT8_143 and FLOAT8_152 input types"):
            ops.pow2scale_cast_from_fp8(popxl.constant(X8), popxl.constant(np.int32(0)), popxl.float16)


def test_layer_norm_is_group_norm_with_one_group(outs):
    """group_norm.py: layer_norm = group_norm(num_groups=1): [N, C, ...] normalised per sample
    over C and the rest, weight and bias per channel C (GroupNormOp)."""
    x = XR.astype(np.float64)
    m = x.mean((1, 2), keepdims=True)
    v = x.var((1, 2), keepdims=True)
    ref = (x - m) / np.sqrt(v + 1e-3) * LN_W[:, None] + LN_B[:, None]
    np.testing.assert_allclose(outs["ln3"], ref, rtol=1e-5, atol=1e-5)
