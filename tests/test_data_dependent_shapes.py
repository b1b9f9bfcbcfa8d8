"""Ops with data-dependent output shapes on run-time data (engine/segments.py): the graph runs
as compiled segments with NonZero / Unique / Compress / NonMaxSuppression on the host between
them, through the ONNX backend, run_model and InferenceSession; checked against onnxruntime on
hand-built graphs (onnx.helper)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import popart
from popart import onnx_backend
from popart.engine import compiled as _compiled
from popart.engine.segments import Segmented, has_data_dependent
from popart.engine.shapes import run_model
from popart.errors import UnsupportedOperatorError, popart_exception


def _model(nodes, inputs, outputs, inits=(), opset=13):
    """A model from nodes; ``inputs`` / ``outputs``: (name, TensorProto type, shape or None)."""
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info(*i) for i in inputs],
                     [h.make_tensor_value_info(*o) for o in outputs], list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    return m


def _const(name, value):
    return onnx.numpy_helper.from_array(np.asarray(value), name)


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_outputs(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert np.shape(g) == np.shape(w) and np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# x [3, 4] -> Greater(0.5) -> NonZero -> Transpose -> GatherND(x) -> Mul 2: torch's x[x > 0.5] * 2
MASKED = _model([h.make_node("Greater", ["x", "half"], ["m"]),
                 h.make_node("NonZero", ["m"], ["nz"]),
                 h.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
                 h.make_node("GatherND", ["x", "idx"], ["g"]),
                 h.make_node("Mul", ["g", "two"], ["y"]),
                 h.make_node("Relu", ["x"], ["r"])],
                [("x", T.FLOAT, [3, 4])], [("y", T.FLOAT, None), ("nz", T.INT64, None)],
                [_const("half", np.float32(0.5)), _const("two", np.float32(2))])


@pytest.fixture(scope="module")
def masked_rep():
    return onnx_backend.prepare(MASKED)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nonzero_gathernd_backend(masked_rep, seed):
    x = np.random.default_rng(seed).random((3, 4), dtype=np.float32)
    _assert_outputs(masked_rep.run([x]), _ort(MASKED, {"x": x}))


def test_empty_result(masked_rep):
    """No element passes: NonZero gives [2, 0], the tail runs on zero-sized tensors."""
    x = np.zeros((3, 4), np.float32)
    got = masked_rep.run([x])
    assert got[1].shape == (2, 0) and got[0].shape == (0,)
    _assert_outputs(got, _ort(MASKED, {"x": x}))


def test_run_model():
    x = np.random.default_rng(5).random((3, 4), dtype=np.float32)
    got = run_model(MASKED, {"x": x})
    _assert_outputs([got["y"], got["nz"]], _ort(MASKED, {"x": x}))


def _count_runner(seg):
    from popart.engine import x64

    def run(count):
        x = np.zeros((3, 4), np.float32)
        x.reshape(-1)[:count] = 1
        with x64():
            y = seg({"x": x})[0]
        assert np.asarray(y).shape == (count,) and np.all(np.asarray(y) == 2)
    return run


def test_shape_cache():
    """The head is compiled once; the tail, for a count first seen, runs folded on the host,
    and is compiled when the count comes again, then reused."""
    seg = Segmented(onnx_backend.prepare(MASKED).graph, ["y"])
    run = _count_runner(seg)
    run(3)
    assert (seg.compiled, seg.reused, seg.folded) == (1, 0, 1)   # head; tail folded
    run(3)
    assert (seg.compiled, seg.reused, seg.folded) == (2, 1, 1)   # tail for 3 compiled
    run(3)
    assert (seg.compiled, seg.reused, seg.folded) == (2, 3, 1)   # both reused
    run(5)
    assert (seg.compiled, seg.reused, seg.folded) == (2, 4, 2)   # head reused, new tail folded
    run(5)
    assert (seg.compiled, seg.reused, seg.folded) == (3, 5, 2)   # only the tail compiled


def test_shape_cache_bound():
    """A bounded cache, least recently used out (fold_first off: every tail compiled)."""
    seg = Segmented(onnx_backend.prepare(MASKED).graph, ["y"], cache_size=3, fold_first=False)
    run = _count_runner(seg)
    for count in (3, 5, 7):
        run(count)
    assert (seg.compiled, len(seg._stages)) == (4, 3)   # tail 3 went out
    run(7)
    assert seg.compiled == 4   # head and tail 7 kept
    run(3)
    assert seg.compiled == 5   # tail 3 again


def test_log_names_the_host_op(caplog):
    logger = popart.getLogger("session")
    level = logger.getLevel()
    logger.setLevel("INFO")
    try:
        onnx_backend.prepare(MASKED).run([np.ones((3, 4), np.float32)])
    finally:
        logger.setLevel(level)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "then on the host: ai.onnx::NonZero" in text and "segments cached" in text


# -------------------------------------------------------------------------------------
# A detection tail: scores > threshold -> NonZero -> Gather boxes and scores -> NMS -> Gather

DETECT = _model([
    h.make_node("Greater", ["scores", "thr"], ["keep"]),
    h.make_node("NonZero", ["keep"], ["nz"]),
    h.make_node("Squeeze", ["nz", "ax0"], ["idx"]),
    h.make_node("Gather", ["boxes", "idx"], ["kb"], axis=0),            # [K, 4]
    h.make_node("Gather", ["scores", "idx"], ["ks"], axis=0),           # [K]
    h.make_node("Unsqueeze", ["kb", "ax0"], ["b3"]),                    # [1, K, 4]
    h.make_node("Unsqueeze", ["ks", "ax01"], ["s3"]),                   # [1, 1, K]
    h.make_node("NonMaxSuppression", ["b3", "s3", "maxout", "iou", "sthr"], ["sel"]),
    h.make_node("Gather", ["sel", "two"], ["col"], axis=1),             # [S]
    h.make_node("Gather", ["kb", "col"], ["out_boxes"], axis=0),        # [S, 4]
    h.make_node("Gather", ["ks", "col"], ["out_scores"], axis=0)],      # [S]
    [("boxes", T.FLOAT, [20, 4]), ("scores", T.FLOAT, [20])],
    [("out_boxes", T.FLOAT, None), ("out_scores", T.FLOAT, None), ("sel", T.INT64, None)],
    [_const("thr", np.float32(0.3)), _const("ax0", np.array([0], np.int64)),
     _const("ax01", np.array([0, 1], np.int64)), _const("maxout", np.array([6], np.int64)),
     _const("iou", np.array([0.4], np.float32)), _const("sthr", np.array([0.0], np.float32)),
     _const("two", np.int64(2))])


def _detections(seed):
    rng = np.random.default_rng(seed)
    corner = rng.random((20, 2), dtype=np.float32) * 4
    boxes = np.concatenate([corner, corner + 0.5 + rng.random((20, 2), dtype=np.float32)], 1)
    return {"boxes": boxes, "scores": rng.random(20, dtype=np.float32)}


@pytest.mark.parametrize("seed", [0, 1])
def test_detection_tail_backend(seed):
    feeds = _detections(seed)
    rep = onnx_backend.prepare(DETECT)
    want = _ort(DETECT, feeds)
    for _ in range(3):   # the head compiled, the rest folded on the host; seen again: compiled
        _assert_outputs(rep.run(feeds), want)
    seg = next(iter(rep._cache.values()))
    assert (seg.folded, seg.compiled) == (2, 3)   # head, between NonZero and NMS, the tail


@pytest.fixture(scope="module")
def detect_session():
    anchors = {o: popart.AnchorReturnType("ALL") for o in ("out_boxes", "out_scores", "sel")}
    s = popart.InferenceSession(DETECT.SerializeToString(), popart.DataFlow(1, anchors),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    return s


@pytest.mark.parametrize("seed", [2, 3])
def test_detection_tail_session(detect_session, seed):
    feeds = _detections(seed)
    anchors = detect_session.initAnchorArrays()
    detect_session.run(popart.PyStepIO(feeds, anchors))
    _assert_outputs([anchors[o] for o in ("out_boxes", "out_scores", "sel")], _ort(DETECT, feeds))


def test_session_infos(detect_session):
    """Shapes after a cut are -1 where they depend on the data."""
    assert detect_session.getInfo("kb").shape() == [-1, 4]
    assert detect_session.getInfo("sel").shape() == [-1, 3]
    assert detect_session.getInfo("keep").shape() == [20]


# -------------------------------------------------------------------------------------
# Compress, Unique, a data-dependent node in the middle of a model

def test_compress():
    m = _model([h.make_node("ReduceSum", ["x", "ax1"], ["s"], keepdims=0),
                h.make_node("Greater", ["s", "zero"], ["c"]),
                h.make_node("Compress", ["x", "c"], ["k"], axis=0),
                h.make_node("Add", ["k", "k"], ["y"])],
               [("x", T.FLOAT, [6, 3])], [("y", T.FLOAT, None)],
               [_const("ax1", np.array([1], np.int64)), _const("zero", np.float32(0))])
    rep = onnx_backend.prepare(m)
    for seed in range(2):
        x = np.random.default_rng(seed).standard_normal((6, 3)).astype(np.float32)
        _assert_outputs(rep.run([x]), _ort(m, {"x": x}))


@pytest.mark.parametrize("sorted_", [1, 0])
def test_unique(sorted_):
    m = _model([h.make_node("Abs", ["x"], ["a"]),
                h.make_node("Unique", ["a"], ["u", "first", "inverse", "counts"], sorted=sorted_),
                h.make_node("Mul", ["u", "u"], ["y"])],
               [("x", T.INT64, [10])],
               [("y", T.INT64, None), ("first", T.INT64, None), ("inverse", T.INT64, None),
                ("counts", T.INT64, None)])
    x = np.array([3, -1, 2, 3, 1, -2, 7, 1, 0, 3], np.int64)
    _assert_outputs(onnx_backend.prepare(m).run([x]), _ort(m, {"x": x}))


MIDDLE = _model([
    h.make_node("MatMul", ["x", "w"], ["hidden"]),                       # segment 0
    h.make_node("Relu", ["hidden"], ["act"]),
    h.make_node("ReduceMax", ["act"], ["best"], axes=[1], keepdims=0),
    h.make_node("Greater", ["best", "thr"], ["rows"]),
    h.make_node("NonZero", ["rows"], ["nz"]),                            # host
    h.make_node("Squeeze", ["nz", "ax0"], ["idx"]),                      # segment 1
    h.make_node("Gather", ["act", "idx"], ["picked"], axis=0),
    h.make_node("MatMul", ["picked", "w2"], ["proj"]),
    h.make_node("ReduceSum", ["proj", "ax0"], ["total"], keepdims=0),
    h.make_node("Shape", ["picked"], ["count"])],
    [("x", T.FLOAT, [8, 5])],
    [("total", T.FLOAT, [3]), ("proj", T.FLOAT, None), ("count", T.INT64, [2])],
    [_const("w", np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)),
     _const("w2", np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)),
     _const("thr", np.float32(1.0)), _const("ax0", np.array([0], np.int64))])


def _middle_x(seed):
    return np.random.default_rng(seed).standard_normal((8, 5)).astype(np.float32)


def test_middle_backend():
    rep = onnx_backend.prepare(MIDDLE)
    for seed in range(3):
        x = _middle_x(seed)
        _assert_outputs(rep.run([x]), _ort(MIDDLE, {"x": x}))


def test_middle_session_batches():
    """batchesPerStep 3: an anchor of data-dependent shape comes back as a list per batch;
    one of fixed shape in its usual array; the Shape of a data-dependent tensor is data too."""
    anchors = {"proj": popart.AnchorReturnType("ALL"), "total": popart.AnchorReturnType("ALL"),
               "count": popart.AnchorReturnType("FINAL")}
    s = popart.InferenceSession(MIDDLE.SerializeToString(), popart.DataFlow(3, anchors),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    out = s.initAnchorArrays()
    x = np.stack([_middle_x(seed) for seed in range(3)])
    s.run(popart.PyStepIO({"x": x}, out))
    assert isinstance(out["proj"], list) and len(out["proj"]) == 3
    assert [s.getInfo(t).shape() for t in ("w", "picked", "total")] == [[5, 4], [-1, 4], [3]]
    assert out["total"].shape == (3, 3)
    for b in range(3):
        total, proj, count = _ort(MIDDLE, {"x": x[b]})
        np.testing.assert_allclose(out["proj"][b], proj, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["total"][b], total, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["count"], count)   # FINAL: the last batch's


# -------------------------------------------------------------------------------------
# Graphs without a cut: one compiled program, as before

def test_without_cut_one_program(monkeypatch):
    """A graph with no data-dependent node, and one whose NonZero reads a constant (folded),
    compile one program per session and run it once per run()."""
    calls = []
    real = _compiled.CompiledStep.compile
    monkeypatch.setattr(_compiled.CompiledStep, "compile",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    folded = _model([h.make_node("NonZero", ["c"], ["nz"]),
                     h.make_node("Cast", ["nz"], ["f"], to=T.FLOAT),
                     h.make_node("ReduceSum", ["f"], ["s"], keepdims=0),
                     h.make_node("Add", ["x", "s"], ["y"])],
                    [("x", T.FLOAT, [2])], [("y", T.FLOAT, [2])],
                    [_const("c", np.array([[0, 1], [1, 1]], np.int64))])
    plain = _model([h.make_node("Relu", ["x"], ["y"])], [("x", T.FLOAT, [2])], [("y", T.FLOAT, [2])])
    for m, want in ((folded, 4.0), (plain, 0.0)):   # the indices of c: rows 0 1 1, cols 1 0 1
        calls.clear()
        s = popart.InferenceSession(m.SerializeToString(),
                                    popart.DataFlow(1, {"y": popart.AnchorReturnType("ALL")}),
                                    popart.DeviceManager().createCpuDevice())
        assert s._segments() is None
        s.prepareDevice()
        out = s.initAnchorArrays()
        for _ in range(2):
            s.run(popart.PyStepIO({"x": np.zeros(2, np.float32)}, out))
        assert len(calls) == 1 and s.getInfo("y").shape() == [2]
        np.testing.assert_allclose(out["y"], [want, want])
    assert has_data_dependent(onnx_backend.prepare(folded).graph)
    assert not has_data_dependent(onnx_backend.prepare(plain).graph)


# -------------------------------------------------------------------------------------
# Errors

def test_training_through_a_cut_names_the_op():
    m = _model([h.make_node("Mul", ["x", "w"], ["xw"]),
                h.make_node("Greater", ["xw", "zero"], ["m"]),
                h.make_node("NonZero", ["m"], ["nz"]),
                h.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
                h.make_node("GatherND", ["xw", "idx"], ["g"]),
                h.make_node("ReduceSum", ["g"], ["loss"], keepdims=0)],
               [("x", T.FLOAT, [2, 3])], [("loss", T.FLOAT, [])],
               [_const("w", np.ones((2, 3), np.float32)), _const("zero", np.float32(0))])
    with pytest.raises(UnsupportedOperatorError, match=r"NonZero.*training step"):
        popart.TrainingSession(m.SerializeToString(),
                               popart.DataFlow(1, {"loss": popart.AnchorReturnType("ALL")}),
                               "loss", popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice())


def test_sum_anchor_of_data_dependent_shape():
    s = popart.InferenceSession(MASKED.SerializeToString(),
                                popart.DataFlow(2, {"y": popart.AnchorReturnType("SUM")}),
                                popart.DeviceManager().createCpuDevice())
    with pytest.raises(popart_exception, match=r"Anchor 'y'.*SUM.*'ALL'"):
        s.prepareDevice()


def test_callback_stepio_refused():
    s = popart.InferenceSession(MASKED.SerializeToString(),
                                popart.DataFlow(1, {"y": popart.AnchorReturnType("ALL")}),
                                popart.DeviceManager().createCpuDevice())
    cb = popart.PyStepIOCallback(lambda i, p: np.zeros((3, 4), np.float32), lambda i: None,
                                 lambda i: np.zeros(1, np.float32), lambda i: None)
    with pytest.raises(popart_exception, match="PyStepIO"):
        s.run(cb)


RESHAPED = _model([h.make_node("NonZero", ["x"], ["nz"]),
                   h.make_node("Squeeze", ["nz", "ax0"], ["idx"]),
                   h.make_node("Add", ["idx", "one"], ["shape"]),
                   h.make_node("Reshape", ["d", "shape"], ["y"])],
                  [("d", T.FLOAT, [6]), ("x", T.INT64, [3])], [("y", T.FLOAT, None)],
                  [_const("ax0", np.array([0], np.int64)), _const("one", np.int64(1))])


def test_values_needed_at_compile_time_after_a_cut():
    """A Reshape whose shape is NonZero's values (not its shape) cannot compile: the nodes
    after the cut stay folded on the host, run after run."""
    rep = onnx_backend.prepare(RESHAPED)
    feeds = {"d": np.arange(6, dtype=np.float32), "x": np.array([0, 1, 3], np.int64)}
    for _ in range(3):
        _assert_outputs(rep.run(feeds), _ort(RESHAPED, feeds))   # [2, 3]
    seg = next(iter(rep._cache.values()))
    assert seg.folded == 3 and seg.compiled == 1   # only the head


def test_invalid_reshape_after_a_cut_names_the_node():
    with pytest.raises(popart_exception, match="Reshape"):
        run_model(RESHAPED, {"d": np.arange(6, dtype=np.float32), "x": np.array([1, 0, 0], np.int64)})   # shape [1]


def test_torch_exported_masks():
    """torch's x[mask], torch.nonzero and masked_select, exported by torch.onnx.export
    (NonZero + GatherND), through the backend and an InferenceSession."""
    torch = pytest.importorskip("torch")
    import io
    import warnings

    class Masks(torch.nn.Module):
        def forward(self, x):
            return x[x > 0.5] * 2, torch.nonzero(x < 0.1), torch.masked_select(x, x > 0.9).sum()

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Masks(), (torch.rand(4, 5),), buf, dynamo=False, opset_version=17,
                          input_names=["x"])
    model = onnx.load_from_string(buf.getvalue())
    assert [n.op_type for n in model.graph.node].count("NonZero") == 3
    rep = onnx_backend.prepare(model)
    outs = [o.name for o in model.graph.output]
    session = popart.InferenceSession(buf.getvalue(), popart.DataFlow(
        1, {o: popart.AnchorReturnType("ALL") for o in outs}), popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    for seed in range(2):
        x = np.random.default_rng(seed).random((4, 5), dtype=np.float32)
        want = _ort(model, {"x": x})
        _assert_outputs(rep.run([x]), want)
        anchors = session.initAnchorArrays()
        session.run(popart.PyStepIO({"x": x}, anchors))
        _assert_outputs([anchors[o] for o in outs], want)
