"""The oneDNN convolution custom call (popart.engine.onednn) against PyTorch, and its fallback
to XLA's convolution when it is switched off or cannot be built."""
from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import torch

from popart.engine import onednn
from popart.ops import nn

needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="the oneDNN custom call cannot be built or loaded here "
                                         "(onednn-cpu-gomp / onednn-devel-cpu-gomp, g++)")


class Ctx:   # the LowerCtx services conv_nc reads
    platform = "cpu"
    training = False

    def channels_last(self, x, transpose=False):
        return x.transpose(0, 2, 3, 1) if transpose else None

    def keep_channels_last(self, y_nhwc):
        return y_nhwc.transpose(0, 3, 1, 2)


def torch_conv(x, w, stride, pad, dil, dy, groups=1):
    """y and (dx, dw) for the cotangent dy by PyTorch; pad ((top, bottom), (left, right))."""
    tx, tw = (torch.from_numpy(a).requires_grad_() for a in (x, w))
    (pt, pb), (pl, pr) = pad
    y = torch.nn.functional.conv2d(torch.nn.functional.pad(tx, (pl, pr, pt, pb)), tw,
                                   stride=stride, dilation=dil, groups=groups)
    y.backward(torch.from_numpy(dy))
    return y.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()


# (N, C, H, W, O, kernel, strides, ((top, bottom), (left, right)), dilation)
CASES = [(2, 3, 9, 10, 8, 3, (1, 1), ((1, 1), (1, 1)), (1, 1)),      # stem-like, 3 channels
         (2, 16, 8, 8, 32, 3, (2, 2), ((1, 1), (1, 1)), (1, 1)),     # stride 2
         (1, 8, 8, 6, 16, 1, (2, 2), ((0, 0), (0, 0)), (1, 1)),      # 1x1 downsample
         (2, 5, 11, 9, 7, 3, (1, 2), ((2, 0), (1, 3)), (2, 1)),      # uneven pads, dilation
         (0, 4, 5, 5, 3, 3, (1, 1), ((1, 1), (1, 1)), (1, 1))]       # empty batch: dw zeros


@needs_onednn
@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}c{c[1]}o{c[4]}k{c[5]}s{c[6][1]}")
def test_forward_and_gradients_match_torch(case, nhwc):
    n, c, h, w_, o, k, st, pad, dil = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w_), dtype=np.float32)
    w = rng.standard_normal((o, c, k, k), dtype=np.float32)

    def f(x, w):
        xin = x.transpose(0, 2, 3, 1) if nhwc else x
        y = onednn.conv2d(xin, w, st, pad, dil, nhwc)
        return y.transpose(0, 3, 1, 2) if nhwc else y
    y, vjp = jax.vjp(f, x, w)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    ref_y, ref_dx, ref_dw = torch_conv(x, w, st, pad, dil, dy)
    dx, dw = jax.jit(vjp)(dy)
    np.testing.assert_allclose(y, ref_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_vmap_folds_shared_weights_and_loops_batched_ones():
    """Under vmap (replicas, vectorised micro-batches) shared weights fold into the batch and
    per-item weights run one call each: both equal the convolutions one by one."""
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((3, 2, 4, 6, 6), dtype=np.float32)
    ws = rng.standard_normal((3, 5, 4, 3, 3), dtype=np.float32)
    pad = ((1, 1), (1, 1))

    def conv(x, w):
        return onednn.conv2d(x, w, (1, 1), pad, (1, 1), False)
    shared = jax.vmap(conv, (0, None))(xs, ws[0])
    each = jax.vmap(jax.grad(lambda x, w: (conv(x, w) ** 2).sum(), (0, 1)))(xs, ws)
    for i in range(3):
        zero = np.zeros((2, 5, 6, 6), np.float32)
        np.testing.assert_allclose(shared[i], torch_conv(xs[i], ws[0], 1, pad, 1, zero)[0],
                                   rtol=1e-4, atol=1e-4)
        y = torch_conv(xs[i], ws[i], 1, pad, 1, zero)[0]
        _, dx, dw = torch_conv(xs[i], ws[i], 1, pad, 1, 2 * y)
        np.testing.assert_allclose(each[0][i], dx, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(each[1][i], dw, rtol=1e-4, atol=1e-3)


def _lowered(x, w) -> str:
    """The HLO of popart's Conv lowering (conv_nc) of x by w, 3x3, padding 1."""
    return jax.jit(lambda a, b: nn.conv_nc(Ctx(), a, b, (1, 1), ((1, 1), (1, 1)))).lower(
        x, w).as_text()


@needs_onednn
def test_conv_lowering_dispatches_to_onednn_on_the_cpu_for_float32_only():
    x, w = np.ones((2, 64, 8, 8), np.float32), np.ones((64, 64, 3, 3), np.float32)
    assert onednn.TARGET in _lowered(x, w)
    assert onednn.TARGET not in _lowered(x.astype(np.float16), w.astype(np.float16))
    with nn.onednn_off():
        assert onednn.TARGET not in _lowered(x, w)

    class Gpu:
        platform = "cuda"
    assert not nn._use_onednn(Gpu(), x, w, (1, 1), (1, 1), (1, 1), 1)
    assert not nn._use_onednn(Ctx(), x, w, (1, 1), (2, 2), (1, 1), 1)      # input dilated
    assert nn._use_onednn(Ctx(), x, w[:, :32], (1, 1), (1, 1), (1, 1), 2)  # grouped too


def test_fallback_when_switched_off_logs_once_and_uses_xla(monkeypatch, caplog):
    """POPART_ONEDNN=0 (as a missing wheel or compiler): available() is False with one log
    line, and Conv lowers to XLA's convolution with the same numbers as PyTorch."""
    was = onednn.available()
    monkeypatch.setenv("POPART_ONEDNN", "0")
    onednn.available.cache_clear()
    logger = logging.getLogger("popart.devicex")
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="popart.devicex"):
            assert not onednn.available()
            assert not onednn.available()   # cached: logged once
        lines = [r.getMessage() for r in caplog.records if "oneDNN" in r.getMessage()]
        assert lines == ["oneDNN convolutions unavailable, using XLA's: switched off "
                         "(POPART_ONEDNN=0)"]
        rng = np.random.default_rng(2)
        x = rng.standard_normal((2, 64, 8, 8), dtype=np.float32)
        w = rng.standard_normal((64, 64, 3, 3), dtype=np.float32)
        assert onednn.TARGET not in _lowered(x, w)
        y = jax.jit(lambda a, b: nn.conv_nc(Ctx(), a, b, (1, 1), ((1, 1), (1, 1))))(x, w)
        ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1)
        np.testing.assert_allclose(y, ref.numpy(), rtol=1e-4, atol=1e-3)
    finally:
        monkeypatch.undo()
        onednn.available.cache_clear()
        assert onednn.available() == was   # registering again is harmless


@pytest.mark.parametrize("broken, why", [
    ("_onednn_prefix", "oneDNN not found"),                 # no wheel
    pytest.param("_cache_dir", "could not be built or loaded",   # the cache is not writable
                 marks=needs_onednn),
], ids=["no-wheel", "no-cache-folder"])
def test_missing_onednn_or_unbuildable_falls_back(monkeypatch, caplog, tmp_path, broken, why):
    (tmp_path / "file").write_text("")
    fake = {"_onednn_prefix": lambda: None, "_cache_dir": lambda key: tmp_path / "file" / key}
    monkeypatch.setattr(onednn, broken, fake[broken])
    monkeypatch.delenv("POPART_ONEDNN", raising=False)
    onednn.available.cache_clear()
    monkeypatch.setattr(logging.getLogger("popart.devicex"), "level", logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="popart.devicex"):
            assert not onednn.available()
        assert [why in r.getMessage() for r in caplog.records if "oneDNN" in r.getMessage()] \
            == [True]
    finally:
        monkeypatch.undo()
        onednn.available.cache_clear()


@needs_onednn
def test_session_conv_runs_on_onednn_and_through_the_engine_cache(tmp_path):
    """A Conv model's session: the step holds the custom call, matches PyTorch, and a second
    session loads the same program from the engine cache (jax.export allows the target)."""
    import popart
    import popart.testing
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((2, 8, 6, 6), dtype=np.float32)
    wv = rng.standard_normal((16, 8, 3, 3), dtype=np.float32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(xv.shape)))
    y = b.aiOnnx.conv([x, b.addInitializedInputTensor(wv)], pads=[1, 1, 1, 1], strides=[2, 2])
    b.addOutputTensor(y)
    opts = popart.SessionOptions()
    opts.enableEngineCaching, opts.cachePath = True, str(tmp_path)
    ref = torch.nn.functional.conv2d(torch.from_numpy(xv), torch.from_numpy(wv), padding=1,
                                     stride=2).numpy()
    sources = []
    for _ in range(2):
        s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                    popart.DeviceManager().createCpuDevice(), userOptions=opts)
        s.prepareDevice()
        anchors = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: xv}, anchors))
        np.testing.assert_allclose(anchors[y], ref, rtol=1e-4, atol=1e-4)
        sources.append(popart.testing.executable_source(s))
    assert sources == ["compiled (cached)", "engine cache"]
    entry = next(tmp_path.glob("[0-9]*.popef"))
    assert onednn.TARGET.encode() in entry.read_bytes()


# ---- Inference layouts and the residual sum (sessions against onnxruntime) ----

def _session_vs_onnxruntime(nodes, inputs: dict, weights: dict, outputs: list, bps: int):
    """An opset-20 model of ``nodes`` run by an InferenceSession (batchesPerStep ``bps``: the
    second batch the first's negation) and by onnxruntime; asserts they agree and returns the
    session."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    import popart
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
                     for k, v in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]).SerializeToString()
    s = popart.InferenceSession(model, popart.DataFlow(bps, outputs),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    feeds = [inputs, {k: -v for k, v in inputs.items()}][:bps]
    s.run(popart.PyStepIO({k: np.stack([f[k] for f in feeds]) if bps > 1 else v
                           for k, v in inputs.items()}, anchors))
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for i, feed in enumerate(feeds):
        for name, want in zip(outputs, ref.run(outputs, feed)):
            got = anchors[name][i] if bps > 1 else anchors[name]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=name)
    return s


def _calls(session) -> list[str]:
    """Each oneDNN convolution call of the compiled program (its HLO line)."""
    import popart.testing
    return [line for line in popart.testing.compiled(session).as_text().splitlines()
            if 'custom_call_target="popart_onednn_conv"' in line]


def _geom(call: str) -> list[int]:
    import re
    return [int(v) for v in re.search(r"geom = dense<\[([\d, -]*)\]>", call).group(1).split(",")]


@needs_onednn
@pytest.mark.parametrize("bps", [1, 2])
def test_residual_add_is_a_sum_into_the_residual(bps):
    """a = Relu(Conv(x)); y = Relu(Conv(a) + a), a anchored too: the Add is oneDNN's sum
    post-op (code 6), its operand aliased to the call's result (XLA copies a, which is read
    elsewhere); under batchesPerStep's vmap too. Values: onnxruntime's."""
    from onnx import helper
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 8, 6, 6), dtype=np.float32)
    w = {k: rng.standard_normal((8, 8, 3, 3), dtype=np.float32) * 0.3 for k in ("w1", "w2")}
    mk = helper.make_node
    nodes = [mk("Conv", ["x", "w1"], ["c1"], pads=[1] * 4), mk("Relu", ["c1"], ["a"]),
             mk("Conv", ["a", "w2"], ["c2"], pads=[1] * 4), mk("Add", ["c2", "a"], ["r"]),
             mk("Relu", ["r"], ["y"])]
    s = _session_vs_onnxruntime(nodes, {"x": x}, w, ["y", "a"], bps)
    calls = _calls(s)
    summed = [c for c in calls if _geom(c)[11::3] == [onednn.POST_OPS["sum"][0], 10]]
    assert len(calls) == 2 and len(summed) == 1
    assert "output_to_operand_aliasing" in summed[0]


@needs_onednn
def test_sum_under_vmap_with_a_shared_residual_matches_torch():
    """vmap of a sum call whose residual is not batched: called without the alias (conv.cc
    copies the residual into each result); a batched residual keeps it."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 2, 4, 5, 5), dtype=np.float32)
    w = rng.standard_normal((4, 4, 1, 1), dtype=np.float32)
    res = rng.standard_normal((2, 5, 5, 4), dtype=np.float32)
    static = ((1, 1), ((0, 0), (0, 0)), (1, 1), True, 1, (("add", 0.0, 0.0),))
    f = lambda x, r: onednn.conv2d_fused(x.transpose(0, 2, 3, 1), w, (r,), *static)  # noqa: E731
    shared = jax.jit(jax.vmap(f, in_axes=(0, None)))(x, res)
    batched = jax.jit(jax.vmap(f))(x, np.stack([res, 2 * res, 3 * res]))
    for i in range(3):
        conv = torch.nn.functional.conv2d(torch.from_numpy(x[i]), torch.from_numpy(w)).numpy()
        conv = conv.transpose(0, 2, 3, 1)
        np.testing.assert_allclose(np.asarray(shared[i]), conv + res, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(batched[i]), conv + (i + 1) * res, rtol=1e-4,
                                   atol=1e-4)


@needs_onednn
def test_twin_less_channel_reducing_1x1_runs_nchw_in_inference():
    """SegFormer's head: Concat of NCHW maps (no channels-last form) -> 1x1 Conv halving the
    channels or more -> Relu -> 1x1 Conv: both run on NCHW activations (no transpose of the
    concatenation), matching onnxruntime; a 1x1 that keeps its channels runs NHWC."""
    from onnx import helper
    rng = np.random.default_rng(13)
    maps = {f"p{i}": rng.standard_normal((2, 8, 6, 6), dtype=np.float32) for i in range(4)}
    w = {"w1": rng.standard_normal((8, 32, 1, 1), dtype=np.float32) * 0.2,
         "w2": rng.standard_normal((2, 8, 1, 1), dtype=np.float32),
         "w3": rng.standard_normal((32, 32, 1, 1), dtype=np.float32) * 0.2}
    mk = helper.make_node
    nodes = [mk("Concat", list(maps), ["cat"], axis=1), mk("Conv", ["cat", "w1"], ["c1"]),
             mk("Relu", ["c1"], ["r"]), mk("Conv", ["r", "w2"], ["y"]),
             mk("Conv", ["cat", "w3"], ["z"])]
    s = _session_vs_onnxruntime(nodes, maps, w, ["y", "z"], 1)
    assert sorted(_geom(c)[1] for c in _calls(s)) == [0, 0, 1]   # the NHWC flag
    assert onednn.channels_last((2, 32, 6, 6), (8, 32, 1, 1), training=True) is False
    assert onednn.channels_last((2, 32, 1, 1), (8, 32, 1, 1), training=False) is True
