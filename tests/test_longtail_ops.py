"""PopART's own op semantics, the mixed types its ops accept and the checks its ops make
(issue 25, items 6-8), each against NumPy / PyTorch written from PopART's definition
(willow/src/op/*.cpp setup(), willow/src/popx/op/*x.cpp grow()). Few sessions, shared by
module-scoped fixtures: one inference model holds most ops, one training model the rest."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import popart

GRAD = popart.reservedGradientPrefix()
RNG = np.random.default_rng(25)


def run_session(builder, feeds, outputs, train=False, loss=None, anchors=()):
    """Build, compile and run ``builder``'s model once; returns (session, anchors)."""
    for o in outputs:
        builder.addOutputTensor(o)
    flow = popart.DataFlow(1, {a: popart.AnchorReturnType("All") for a in list(outputs) + list(anchors)})
    dev = popart.DeviceManager().createCpuDevice()
    if train:
        s = popart.TrainingSession(fnModel=builder.getModelProto(), dataFlow=flow, loss=loss,
                                   optimizer=popart.ConstSGD(1e-9), deviceInfo=dev)
    else:
        s = popart.InferenceSession(fnModel=builder.getModelProto(), dataFlow=flow, deviceInfo=dev)
    s.prepareDevice()
    if train:
        s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO(feeds, out))
    return s, out


def feeder(builder):
    """(inp, feeds): ``inp(name, value)`` adds an input of ``value``'s type to ``builder`` and
    records ``value`` in ``feeds`` to feed it."""
    feeds = {}

    def inp(name, value):
        t = builder.addInputTensor(popart.TensorInfo(value), name)
        feeds[t] = value
        return t
    return inp, feeds


# ---------------------------------------------------------------------------------------
# One inference model (opset 11): PopART's semantics and mixed types

X4 = RNG.standard_normal((2, 3)).astype(np.float32)
XS = RNG.standard_normal((4, 2, 3)).astype(np.float32)      # Scan over axis 0
CT_X = RNG.standard_normal((1, 2, 4, 4)).astype(np.float32)
CT_W = RNG.standard_normal((2, 3, 3, 3)).astype(np.float32)
MC = [RNG.standard_normal(s).astype(np.float32) for s in [(1, 2, 7), (3, 2, 3), (1, 2, 5, 5), (2, 2, 3, 3)]]


@pytest.fixture(scope="module")
def infer():
    b = popart.Builder()
    o, g = b.aiOnnxOpset11, b.aiGraphcore
    inp, f = feeder(b)
    x = inp("x", X4)
    c = lambda v: o.constant(np.asarray(v))   # noqa: E731
    img = inp("r", np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3))
    ctx_ = inp("ctx", CT_X)
    out = {
        "reducesum": o.reducesum([x], axes=[], keepdims=0),
        "reducel2": o.reducel2([x], axes=[], keepdims=1),
        "reducemax_all": o.reducemax([x], keepdims=0),
        "argmax": o.argmax([x], axis=1, keepdims=0),
        "argmin": o.argmin([x], axis=0, keepdims=1),
        "incrementmod": g.incrementmod([inp("im", np.array([-3.5, -1, 0.7, 2.5, 6], np.float32))],
                                       1.5, 2.0),
        "mul16": o.mul([inp("h", np.array([1.5, -2, 3e3], np.float16)), c(np.float32(0.1))]),
        "mul16_lhs": o.mul([c(np.array([2.0], np.float32)), inp("h2", np.array([1, 2], np.float16))]),
        "expand32": o.expand([x, c(np.array([2, 2, 3], np.int32))]),
        "constantofshape32": o.constantofshape([c(np.array([2, 1], np.int32))], np.array([7], np.int32)),
        "clip16": o.clip([inp("ch", np.array([-2, 0.25, 9], np.float16)), c(np.float32(-1)),
                          c(np.float64(1.5))]),
        "gather_u32": o.gather([x, inp("gi", np.array([[1], [0]], np.uint32))], axis=0),
        "resize_empty_roi": o.resize([img, "", c(np.array([1, 1, 2, 0.5], np.float32))]),
        "resize_empty_scales": o.resize([img, c(np.zeros(0, np.float32)), "",
                                         c(np.array([1, 1, 3, 6], np.int64))]),
        "convt_same_upper": o.convtranspose([ctx_, c(CT_W)], strides=[2, 2],
                                            output_shape=[8, 8], auto_pad="SAME_UPPER"),
        "convt_notset": o.convtranspose([ctx_, c(CT_W)], strides=[2, 2], output_shape=[8, 7]),
        "convt_same_no_shape": o.convtranspose([ctx_, c(CT_W)], strides=[2, 2], auto_pad="SAME_LOWER"),
    }
    # If with an int32 condition: non-zero is true
    then_b, else_b = b.createSubgraphBuilder(), b.createSubgraphBuilder()
    then_b.addOutputTensor(then_b.aiOnnxOpset11.neg([x]))
    else_b.addOutputTensor(else_b.aiOnnxOpset11.identity([x]))
    out["if_int"] = o.logical_if([inp("cond", np.array([3], np.int32))], 1, else_b, then_b)[0]
    # Scan: body (s, x_t [2, 3]) -> (s + x_t, 2 x_t), scan output axis 1
    body = b.createSubgraphBuilder()
    s_in, x_in = body.addInputTensor(popart.TensorInfo("FLOAT", [2, 3])), \
        body.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    body.addOutputTensor(body.aiOnnxOpset11.add([s_in, x_in]))
    body.addOutputTensor(body.aiOnnxOpset11.add([x_in, x_in]))
    s0 = inp("s0", np.zeros((2, 3), np.float32))
    out["scan_state"], out["scan_out"] = o.scan([s0, inp("xs", XS)], 2, body, num_scan_inputs=1,
                                                scan_output_axes=[1])
    # MultiConv of a 1-D and a 2-D convolution, per-convolution lists
    ids = [inp(f"mc{i}", v) for i, v in enumerate(MC)]
    out["mc0"], out["mc1"] = g.multiconv([ids[:2], ids[2:]], dilations=[[1], [2, 1]],
                                         pads=[[1, 0], [0, 1, 1, 0]], strides=[[2], [1, 2]])
    names = list(out)
    sess, anchors = run_session(b, f, [out[k] for k in names])
    return {k: anchors[out[k]] for k in names}, sess, f, out


def test_reduce_with_empty_axes_reduces_nothing(infer):
    """ReduceOp::setup: an 'axes' attribute that is there but empty reduces no axis."""
    r, *_ = infer
    np.testing.assert_array_equal(r["reducesum"], X4)
    np.testing.assert_allclose(r["reducel2"], np.abs(X4), rtol=1e-6)
    assert r["reducemax_all"].shape == () and r["reducemax_all"] == X4.max()


def test_argmax_argmin_are_int32(infer):
    r, *_ = infer
    assert r["argmax"].dtype == np.int32 and r["argmin"].dtype == np.int32
    np.testing.assert_array_equal(r["argmax"], X4.argmax(1))
    np.testing.assert_array_equal(r["argmin"], X4.argmin(0)[None])


def test_increment_mod_is_c_fmod(infer):
    r, *_ = infer
    np.testing.assert_allclose(r["incrementmod"],
                               np.fmod(np.array([-3.5, -1, 0.7, 2.5, 6], np.float32) + 1.5, 2),
                               rtol=1e-6)


def test_mul_of_float16_and_float32_scalar_is_float16(infer):
    r, *_ = infer
    assert r["mul16"].dtype == np.float16 and r["mul16_lhs"].dtype == np.float16
    np.testing.assert_allclose(r["mul16"], np.array([1.5, -2, 3e3], np.float16) * np.float16(0.1),
                               rtol=1e-3)
    np.testing.assert_array_equal(r["mul16_lhs"], [2, 4])


def test_int32_shapes_clip_bounds_if_condition_uint32_indices(infer):
    r, *_ = infer
    np.testing.assert_array_equal(r["expand32"], np.broadcast_to(X4, (2, 2, 3)))
    np.testing.assert_array_equal(r["constantofshape32"], np.full((2, 1), 7, np.int32))
    assert r["clip16"].dtype == np.float16
    np.testing.assert_array_equal(r["clip16"], np.array([-1, 0.25, 1.5], np.float16))
    np.testing.assert_array_equal(r["gather_u32"], X4[[[1], [0]]])
    np.testing.assert_array_equal(r["if_int"], -X4)


def test_uint32_index_out_of_range_is_reported_with_its_value(infer):
    """The run-time index check of unsigned indices: only the upper bound (-size wraps)."""
    _, sess, feeds, out = infer
    anchors = sess.initAnchorArrays()
    bad = dict(feeds)
    bad["gi"] = np.array([[1], [7]], np.uint32)
    with pytest.raises(popart.popart_runtime_error, match="index 7 in 'gi' is out of range"):
        sess.run(popart.PyStepIO(bad, anchors))


def test_resize_with_empty_optional_inputs(infer):
    """'' for Resize-11's roi or scales (PopART's OpCreatorInfo::hasInputTensor); nearest
    round_prefer_floor with half_pixel coordinates."""
    r, *_ = infer
    x = np.arange(6, dtype=np.float32).reshape(1, 1, 2, 3)
    rows, cols = np.array([0, 0, 1, 1]), np.array([0])   # (i + 0.5) / s - 0.5, ties down
    np.testing.assert_array_equal(r["resize_empty_roi"], x[:, :, rows][:, :, :, cols])
    rows = np.array([0, 0, 1])        # 3 rows of 2: (i + .5) * 2/3 - .5 = -1/6, 1/2, 7/6
    cols = np.repeat([0, 1, 2], 2)
    np.testing.assert_array_equal(r["resize_empty_scales"], x[:, :, rows][:, :, :, cols])


def _convt_ref(x, w, lo, out):
    """PyTorch's full transposed convolution (no padding), cropped to ``out`` from ``lo``."""
    y = F.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(w), stride=2).numpy()
    return y[:, :, lo[0]:lo[0] + out[0], lo[1]:lo[1] + out[1]]


def test_conv_transpose_auto_pad(infer):
    """ConvTransposeOp::setup: auto_pad only places the cropping output_shape asks for
    (ceil(total / 2) at the start for SAME_UPPER, floor(total / 2) for SAME_LOWER and
    NOTSET); without output_shape the output is the full transposed convolution."""
    r, *_ = infer
    full = _convt_ref(CT_X, CT_W, (0, 0), (9, 9))
    assert full.shape == (1, 3, 9, 9)
    np.testing.assert_allclose(r["convt_same_upper"], full[:, :, 1:, 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["convt_notset"], full[:, :, :8, 1:8], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["convt_same_no_shape"], full, rtol=1e-5, atol=1e-5)


def test_scan_concatenates_along_the_output_axis(infer):
    """ScanOp::setup: a scan output is the body output with its axis times the trip count."""
    r, *_ = infer
    np.testing.assert_allclose(r["scan_state"], XS.sum(0), rtol=1e-6)
    assert r["scan_out"].shape == (2, 12)
    np.testing.assert_array_equal(r["scan_out"], np.concatenate([2 * XS[t] for t in range(4)], 1))


def test_multiconv_per_convolution_lists(infer):
    """MultiConvBaseOp: each convolution's strides / pads / dilations follow those of the
    convolutions before it in the flattened lists, whatever their spatial rank."""
    r, *_ = infer
    t = [torch.from_numpy(v) for v in MC]
    y0 = F.conv1d(F.pad(t[0], (1, 0)), t[1], stride=2)
    y1 = F.conv2d(F.pad(t[2], (1, 0, 0, 1)), t[3], stride=(1, 2), dilation=(2, 1))
    np.testing.assert_allclose(r["mc0"], y0.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r["mc1"], y1.numpy(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Opset 10 and 6 models

def resize_pytorch(x, scales):
    """PopART's nearest_mode "pytorch": index floor(i / scale) in float32, only on the axes
    whose size changes."""
    for ax, s in enumerate(np.float32(scales)):
        n_in = x.shape[ax]
        n_out = int(np.floor(n_in * s))
        if n_out != n_in:
            idx = np.floor(np.arange(n_out, dtype=np.float32) / s).astype(np.int64)
            x = np.take(x, np.clip(idx, 0, n_in - 1), axis=ax)
    return x


def test_resize10_is_popart_resize_and_add6_ignores_axis():
    """Resize-10: nearest_mode "pytorch" and half_pixel coordinates (getNearestMode and the
    creator's defaults in willow/src/op/resize.cpp)."""
    x = RNG.standard_normal((1, 2, 2, 5)).astype(np.float32)
    scales = [1, 1, 1.2, 0.6]          # axis 2 keeps its size: not resized at all
    b = popart.Builder()
    xi = b.addInputTensor(popart.TensorInfo(x), "x")
    y = b.aiOnnxOpset10.resize([xi, b.aiOnnxOpset10.constant(np.array(scales, np.float32))])
    up = b.aiOnnxOpset10.resize([xi, b.aiOnnxOpset10.constant(np.array([1, 1, 2, 1.4], np.float32))],
                                mode="linear")
    _, out = run_session(b, {xi: x}, [y, up])
    np.testing.assert_array_equal(out[y], resize_pytorch(x, scales))
    assert not np.array_equal(out[y][:, :, 1], x[:, :, 0, [0, 1, 3]])   # ONNX's floor(i/1.2) = 0
    # linear: PopART's default half_pixel coordinates, as PyTorch's bilinear
    ref = F.interpolate(torch.from_numpy(x), scale_factor=(2, 1.4), mode="bilinear", align_corners=False)
    np.testing.assert_allclose(out[up], ref.numpy(), rtol=1e-5, atol=1e-6)

    b = popart.Builder()
    a = b.addInputTensor(popart.TensorInfo(X4), "a")
    z = b.aiOnnxOpset6.add([a, a], axis=7, broadcast=0)   # Add-6: axis unused without broadcast
    _, out = run_session(b, {a: X4}, [z])
    np.testing.assert_array_equal(out[z], 2 * X4)


# ---------------------------------------------------------------------------------------
# Training: BatchNormalization's outputs and types, ReduceMedian on int32, Atan2's gradient

BN_X = (RNG.standard_normal((4, 2, 3)) * 8 + 3).astype(np.float32)
ATAN = (np.array([0, 1, -2], np.float32), np.array([0, 1, 3], np.float32))


@pytest.fixture(scope="module")
def train():
    b = popart.Builder()
    o, g = b.aiOnnxOpset9, b.aiGraphcore
    inp, f = feeder(b)
    stats = [np.ones(2), np.zeros(2), np.full(2, 0.5), np.full(2, 2.0)]   # scale, B, mean, var
    w = [b.addInitializedInputTensor(v.astype(np.float32), n) for v, n in zip(stats, "sbmv")]
    bn = o.batchnormalization([inp("x", BN_X)] + w, 5, momentum=0.75)
    h = inp("x16", BN_X.astype(np.float16))
    bn16 = o.batchnormalization([h] + [inp(n + "32", v.astype(np.float32))
                                       for v, n in zip(stats, "sbmv")], 5)
    bn16b = o.batchnormalization([h] + [inp(n + "16", v.astype(np.float16))
                                        for v, n in zip(stats, "sbmv")], 5)
    a, c = inp("a", ATAN[0]), inp("c", ATAN[1])
    at = g.atan2([a, c])
    med = g.reducemedian([inp("ints", np.array([[5, 1, 3], [2, 9, 4]], np.int32))], axes=[1],
                         keepdims=0)[0]
    one = o.constant(np.ones(3, np.float32))
    losses = [g.l1loss([bn[0]], 1.0), g.l1loss([o.add([at, one])], 1.0, reduction=popart.ReductionType.Sum),
              o.cast([g.l1loss([bn16[0]], 1.0)], "FLOAT"), o.cast([g.l1loss([bn16b[0]], 1.0)], "FLOAT")]
    big16 = g.l1loss([inp("big16", np.full(2000, 100, np.float16))], 1.0)   # Mean of 2e5 in fp16
    losses.append(o.cast([big16], "FLOAT"))
    loss = o.sum(losses)
    outs = list(bn[1:]) + list(bn16) + list(bn16b) + [med, big16]
    _, anchors = run_session(b, f, outs, train=True, loss=loss,
                             anchors=[bn[0], GRAD + "a", GRAD + "c"])
    return anchors, bn, bn16, bn16b, med, big16


def test_batchnorm_training_outputs(train):
    """BatchNormOp with 5 outputs: running mean and variance (momentum * running + (1 -
    momentum) * batch), the saved batch mean and (biased) variance, each [C], anchorable."""
    r, bn, *_ = train
    m, v = BN_X.mean((0, 2)), BN_X.var((0, 2))
    expected = [0.75 * 0.5 + 0.25 * m, 0.75 * 2.0 + 0.25 * v, m, v]
    for tid, e in zip(bn[1:], expected):
        assert r[tid].shape == (2,)
        np.testing.assert_allclose(r[tid], e, rtol=1e-5)
    y = (BN_X - m[:, None]) / np.sqrt(v[:, None] + 1e-5)
    np.testing.assert_allclose(r[bn[0]], y, rtol=1e-4, atol=1e-5)


def test_batchnorm_float16_data_with_float32_or_float16_statistics(train):
    """BatchNormOp takes statistics of their own type: Y has X's type, the statistics
    outputs the statistics' type; float16 training stays finite."""
    r, _, bn16, bn16b, *_ = train
    m, v = BN_X.mean((0, 2)), BN_X.var((0, 2))
    assert r[bn16[0]].dtype == np.float16 and r[bn16[1]].dtype == np.float32
    assert all(r[t].dtype == np.float16 for t in bn16b)
    for outs, tol in ((bn16, 2e-3), (bn16b, 2e-2)):
        assert all(np.isfinite(r[t]).all() for t in outs)
        np.testing.assert_allclose(r[outs[3]], m, rtol=tol)
        np.testing.assert_allclose(r[outs[4]], v, rtol=tol)
        y = (BN_X - m[:, None]) / np.sqrt(v[:, None] + 1e-5)
        np.testing.assert_allclose(r[outs[0]].astype(np.float32), y, atol=1e-2)


def test_float16_l1_mean_stays_finite(train):
    """L1's Mean sums in float32 (poplar's reduce, scale FLOAT) before the float16 result."""
    r, *_, big16 = train
    assert r[big16].dtype == np.float16 and r[big16] == 100


def test_reduce_median_of_int32_in_training(train):
    r, *_, med, _ = train
    np.testing.assert_array_equal(r[med], [3, 4])


def test_atan2_gradient_is_zero_at_the_origin(train):
    """Atan2Arg0GradOpPattern / Atan2Arg1GradOpPattern: g * x / (x^2 + y^2) and g * -y /
    (x^2 + y^2) for atan2(y, x); 0 where both are 0."""
    r, *_ = train
    y, x = ATAN
    d = np.where(x * x + y * y == 0, 1, x * x + y * y)
    np.testing.assert_allclose(r[GRAD + "a"], x / d, rtol=1e-6)
    np.testing.assert_allclose(r[GRAD + "c"], -y / d, rtol=1e-6)
    assert r[GRAD + "a"][0] == 0 and r[GRAD + "c"][0] == 0


# ---------------------------------------------------------------------------------------
# Abort

def test_abort_without_inputs_and_triggered_abort_raise_poplar_runtime_error():
    b = popart.Builder()
    c = b.addInputTensor(popart.TensorInfo("BOOL", []), "c")
    b.aiGraphcore.abort([c])
    y = b.aiOnnxOpset11.identity([c])
    sess, out = run_session(b, {c: np.array(False)}, [y])   # a false condition runs
    with pytest.raises(popart.poplar_runtime_error) as info:
        sess.run(popart.PyStepIO({c: np.array(True)}, out))
    assert isinstance(info.value, popart.poplar_application_runtime_error)   # poplar's Abort

    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo(X4), "x")
    b.aiGraphcore.abort([])
    with pytest.raises(popart.poplar_runtime_error):
        run_session(b, {x: X4}, [b.aiOnnxOpset11.relu([x])])


# ---------------------------------------------------------------------------------------
# PopART's checks: its message as args[0], the package's context in a note

def _input(b, shape, dtype="FLOAT"):
    return b.addInputTensor(popart.TensorInfo(dtype, shape))


def _rnn(b):
    x, w, r = _input(b, [2, 1, 3]), b.aiOnnxOpset11.constant(np.ones((1, 4, 3), np.float32)), \
        b.aiOnnxOpset11.constant(np.ones((1, 4, 4), np.float32))
    y = b.aiOnnxOpset11.rnn([x, w, r], 2, hidden_size=5, debugContext="rnn")
    return y, (f"hidden_size attribute passed to Op(rnn (ai.onnx.RNN:7), inputs=[{x}, {w}, {r}], "
               f"outputs=[{', '.join(y)}]) (5) does not match hidden size calculated from "
               f"recurrenceWeights tensor (4).")


def _tile(repeats, message, dtype=np.int64):
    def build(b):
        reps = b.aiOnnxOpset11.constant(np.array(repeats, dtype))
        return b.aiOnnxOpset11.tile([_input(b, [2, 3]), reps]), message.format(reps)
    return build


def _abort_non_scalar(b):
    x = _input(b, [2], "BOOL")
    b.aiGraphcore.abort([x])
    return b.aiOnnxOpset11.identity([x]), "Conditional abort op can only test a scalar tensor"


CHECKS = {   # build(builder) -> (outputs, PopART's message)
    "dropout": lambda b: (b.aiOnnxOpset11.dropout([_input(b, [2])], 1, 1.0)[0],   # Dropout-10
                          "ai.onnx.Dropout:10 ratio value 1 is not valid. Please use a value in "
                          "the interval [0,1)"),
    "reverse_negative": lambda b: (b.aiGraphcore.reverse([_input(b, [2, 2])], [-1], debugContext="rev"),
                                   "ReverseOp 'rev (ai.graphcore.Reverse:1)' invalid dimension "
                                   "'-1'. Only positive dimensions are supported"),
    "reverse_duplicate": lambda b: (b.aiGraphcore.reverse([_input(b, [2, 2])], [1, 1], debugContext="rev"),
                                    "Dimension 1 appears multiple times in the list of dimensions "
                                    "of ReverseOp 'rev (ai.graphcore.Reverse:1)'"),
    "rnn_hidden_size": _rnn,
    "mean6": lambda b: (b.aiOnnxOpset6.mean([_input(b, [2, 3]), _input(b, [3])]),
                        "Inputs to ai.onnx.Mean:6 do not all the same type & shape, with "
                        "opid.version = 6"),
    "tile_length": _tile([2], "'Repeats' tensor `{}' should have one element for each dimension "
                              "of the data tensor"),
    "tile_value": _tile([2, 0], "'Repeats' tensor `{}' has invalid value `0' at index 1"),
    "tile_int32": _tile([2, 1], "'Repeats' tensor `{}' is not INT64, it is INT32", np.int32),
    "reverse_rank": lambda b: (b.aiGraphcore.reverse([_input(b, [2, 2])], [2], debugContext="rev"),
                               "ReverseOp 'rev (ai.graphcore.Reverse:1)' invalid dimension '2' "
                               "for input tensor of rank 2"),
    "abort_non_scalar": _abort_non_scalar,
    "convt_valid_output_shape": lambda b: (b.aiOnnxOpset11.convtranspose(
        [_input(b, [1, 1, 3, 3]), b.aiOnnxOpset11.constant(np.ones((1, 1, 2, 2), np.float32))],
        output_shape=[5, 5], auto_pad="VALID"),
        "`VALID` type for auto_pad cannot be used if the `output_shape` is also set"),
}


@pytest.mark.parametrize("case", list(CHECKS))
def test_popart_check_messages(case):
    b = popart.Builder()
    outs, message = CHECKS[case](b)
    outs = [outs] if isinstance(outs, str) else list(outs)
    with pytest.raises(popart.popart_exception) as info:
        run_session(b, {}, outs)
    assert info.value.args[0] == message
    assert getattr(info.value, "__notes__", None), "the package's context goes in a note"
