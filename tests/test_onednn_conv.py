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
