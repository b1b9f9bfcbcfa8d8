"""PopART's internal ai.graphcore ops (ConvFlipWeights, LossScaleUpdate, HostLoad, HostStore,
RemoteLoad, RemoteStore, PackedDataBlock) on hand-written ONNX graphs against NumPy / PyTorch
references written from PopART's op definitions."""
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from popart.engine.shapes import run_model
from popart.errors import popart_exception

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

GC = "ai.graphcore"
RNG = np.random.default_rng(0)


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def vi(name, arr):
    dt = helper.np_dtype_to_tensor_dtype(arr.dtype)
    return helper.make_tensor_value_info(name, dt, arr.shape)


def model(nodes, feeds, outputs, consts=None):
    g = helper.make_graph(nodes, "g", [vi(k, v) for k, v in feeds.items()],
                          [onnx.ValueInfoProto(name=o) for o in outputs],
                          [onnx.numpy_helper.from_array(v, k) for k, v in (consts or {}).items()])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(GC, 1)]
    return helper.make_model(g, opset_imports=opsets, ir_version=10)


def gc(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, domain=GC, **attrs)


def run(nodes, feeds, outputs, consts=None):
    out = run_model(model(nodes, feeds, outputs, consts), feeds)
    return [out[o] for o in outputs]


# ---------------------------------------------------------------------------------------
# ConvFlipWeights

def flip_ref(w, group, group_reshape):
    o, ig = w.shape[:2]
    k = w.shape[2:]
    w5 = w.reshape((group, o // group, ig) + k)
    out = np.empty((group, ig, o // group) + k, w.dtype)
    for g in range(group):
        for a in range(o // group):
            for b in range(ig):
                out[g, b, a] = np.flip(w5[g, a, b])      # flips every spatial axis
    return out.reshape(((ig * group, o // group) if group_reshape else (ig, o)) + k)


@pytest.mark.parametrize("shape,group,reshape", [((4, 3, 3, 2), 1, 0), ((6, 2, 3, 3), 2, 1),
                                                 ((6, 2, 3, 3), 3, 0), ((4, 2, 5), 2, 1),
                                                 ((4, 1, 2, 2, 3), 1, 1)])
def test_conv_flip_weights_vs_numpy(shape, group, reshape):
    w = rnd(*shape)
    (got,) = run([gc("ConvFlipWeights", ["w"], ["y"], group=group, groupReshape=reshape)],
                 {"w": w}, ["y"])
    exp = flip_ref(w, group, reshape)
    assert got.shape == exp.shape
    np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("group", [1, 2])
def test_conv_flip_weights_gives_the_data_gradient_convolution(group):
    """conv(dy, ConvFlipWeights(w), pad=k-1-p) is the input gradient of conv(x, w, pad=p)."""
    x = rnd(2, 4, 6, 5)
    w = rnd(6, 4 // group, 3, 3)
    xt = torch.from_numpy(x).requires_grad_()
    y = F.conv2d(xt, torch.from_numpy(w), padding=1, groups=group)
    dy = rnd(*y.shape)
    y.backward(torch.from_numpy(dy))
    (wf,) = run([gc("ConvFlipWeights", ["w"], ["y"], group=group, groupReshape=1)], {"w": w}, ["y"])
    assert wf.shape == (4, 6 // group, 3, 3)
    dx = F.conv2d(torch.from_numpy(dy), torch.from_numpy(np.array(wf)), padding=1, groups=group)
    np.testing.assert_allclose(dx.numpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_conv_flip_weights_bad_group():
    with pytest.raises(popart_exception, match="group"):
        run([gc("ConvFlipWeights", ["w"], ["y"], group=4)], {"w": rnd(6, 1, 3, 3)}, ["y"])


# ---------------------------------------------------------------------------------------
# LossScaleUpdate

def lsu_ref(factor, stats, t, loss_scaling=None, clip=False):
    lower = sum(float(s[0]) for s in stats)
    upper = sum(float(s[1]) for s in stats)
    new = factor / 2 if upper / max(upper + lower, 1e-30) > t else factor * 2
    if clip:
        new = min(new, 32768.0 / loss_scaling)
    return new


@pytest.mark.parametrize("stats", [[[1000, 0]], [[1000, 1]], [[990, 10], [5, 0]], [[0, 0]]])
@pytest.mark.parametrize("t", [1e-7, 0.02])
def test_loss_scale_update_vs_numpy(stats, t):
    feeds = {"f": np.array(4.0, np.float32)}
    names = []
    for i, s in enumerate(stats):
        feeds[f"s{i}"] = np.array(s, np.uint32)
        names.append(f"s{i}")
    (got,) = run([gc("LossScaleUpdate", ["f"] + names, ["y"], thresholdUpperCountProportion=t)],
                 feeds, ["y"])
    assert got.shape == () and got.dtype == np.float32
    assert got == lsu_ref(4.0, stats, t)


def test_loss_scale_update_default_threshold_and_dtype():
    """Default threshold 1e-7 (no session options): one value above the edge halves."""
    feeds = {"f": np.array(2.0, np.float32), "ls": np.array(128.0, np.float32),
             "s": np.array([100000, 1], np.uint32)}
    (got,) = run([gc("LossScaleUpdate", ["f", "ls", "s"], ["y"],
                     updateFactorDType=TensorProto.FLOAT16)], feeds, ["y"])
    assert got.dtype == np.float16 and got == 1.0
    feeds["s"] = np.array([100000, 0], np.uint32)
    (got,) = run([gc("LossScaleUpdate", ["f", "ls", "s"], ["y"])], feeds, ["y"])
    assert got.dtype == np.float32 and got == 4.0


@pytest.mark.parametrize("ls,exp", [(1024.0, 32.0), (8192.0, 4.0), (32.0, 32.0)])
def test_loss_scale_update_clip_output(ls, exp):
    """Scaling up from 16 gives 32, clipped to 2^15 / loss_scaling."""
    feeds = {"f": np.array(16.0, np.float32), "ls": np.array(ls, np.float32),
             "s": np.array([10, 0], np.uint32)}
    (got,) = run([gc("LossScaleUpdate", ["f", "ls", "s"], ["y"], clipOutput=1)], feeds, ["y"])
    assert got == exp == lsu_ref(16.0, [[10, 0]], 1e-7, ls, clip=True)


def test_loss_scale_update_rejects_bad_statistics():
    feeds = {"f": np.array(1.0, np.float32), "s": np.array([1, 2, 3], np.uint32)}
    with pytest.raises(popart_exception, match=r"expected \[2\]"):
        run([gc("LossScaleUpdate", ["f", "s"], ["y"])], feeds, ["y"])


# ---------------------------------------------------------------------------------------
# HostLoad / HostStore

def test_host_load_reads_the_named_stream():
    x, s = np.zeros((2, 3), np.float32), rnd(2, 3)
    (got,) = run([gc("HostLoad", ["x"], ["y"], streamid="s")], {"x": x, "s": s}, ["y"])
    np.testing.assert_array_equal(got, s)


def test_host_load_without_stream_is_identity():
    x = rnd(4)
    (got,) = run([gc("HostLoad", ["x"], ["y"], streamid="nothing")], {"x": x}, ["y"])
    np.testing.assert_array_equal(got, x)


def test_host_load_shape_mismatch():
    with pytest.raises(popart_exception, match="shape"):
        run([gc("HostLoad", ["x"], ["y"], streamid="s")], {"x": rnd(3), "s": rnd(4)}, ["y"])


def test_host_store_makes_the_stream_readable():
    x = rnd(3)
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             gc("HostStore", ["r"], [], streamid="out_stream")]
    (got,) = run(nodes, {"x": x}, ["out_stream"])
    np.testing.assert_array_equal(got, np.maximum(x, 0))


def test_host_store_does_not_overwrite_an_existing_tensor():
    x = rnd(3)
    nodes = [helper.make_node("Neg", ["x"], ["n"]), gc("HostStore", ["x"], ["y"], streamid="n")]
    n, y = run(nodes, {"x": x}, ["n", "y"])
    np.testing.assert_array_equal(n, -x)
    np.testing.assert_array_equal(y, x)


# ---------------------------------------------------------------------------------------
# RemoteStore / RemoteLoad

def test_remote_store_then_load_static_offsets():
    a, b, z = rnd(2, 2), rnd(2, 2), np.zeros((2, 2), np.float32)
    consts = {"o0": np.array([0], np.int32), "o1": np.array([1], np.int32)}
    nodes = [gc("RemoteLoad", ["z", "o0"], ["before"], bufferid=7),
             gc("RemoteStore", ["a", "o0"], [], bufferid=7),
             gc("RemoteStore", ["b", "o1"], [], bufferid=7),
             gc("RemoteLoad", ["z", "o0"], ["l0"], bufferid=7),
             gc("RemoteLoad", ["z", "o1"], ["l1"], bufferid=7),
             gc("RemoteLoad", ["z", "o1"], ["other"], bufferid=8),
             gc("RemoteStore", ["b", "o0"], [], bufferid=7),
             gc("RemoteLoad", ["z", "o0"], ["l0b"], bufferid=7)]
    before, l0, l1, other, l0b = run(nodes, {"a": a, "b": b, "z": z},
                                     ["before", "l0", "l1", "other", "l0b"], consts)
    np.testing.assert_array_equal(before, z)
    np.testing.assert_array_equal(l0, a)
    np.testing.assert_array_equal(l1, b)
    np.testing.assert_array_equal(other, z)
    np.testing.assert_array_equal(l0b, b)      # the latest store wins


@pytest.mark.parametrize("offs", [(0, 1, 1), (1, 0, 0), (2, 2, 2), (0, 1, 5)])
def test_remote_runtime_offsets(offs):
    """Offsets fed at run time (and the omitted offset, entry 0)."""
    a, b, z = rnd(3), rnd(3), rnd(3)
    feeds = {"a": a, "b": b, "z": z, "sa": np.array(offs[0], np.int32),
             "sb": np.array(offs[1], np.int32), "ld": np.array(offs[2], np.int32)}
    nodes = [gc("RemoteStore", ["a", "sa"], [], bufferid=1),
             gc("RemoteStore", ["b", "sb"], [], bufferid=1),
             gc("RemoteLoad", ["z", "ld"], ["y"], bufferid=1),
             gc("RemoteLoad", ["z"], ["y0"], bufferid=1)]
    y, y0 = run(nodes, feeds, ["y", "y0"])
    stores = {offs[0]: a}
    stores[offs[1]] = b
    np.testing.assert_array_equal(y, stores.get(offs[2], z))
    np.testing.assert_array_equal(y0, stores.get(0, z))


def test_remote_store_shape_mismatch():
    nodes = [gc("RemoteStore", ["a"], [], bufferid=1), gc("RemoteStore", ["b"], [], bufferid=1)]
    with pytest.raises(popart_exception, match="remote buffer 1"):
        run(nodes + [helper.make_node("Identity", ["a"], ["y"])], {"a": rnd(2), "b": rnd(3)}, ["y"])


# ---------------------------------------------------------------------------------------
# PackedDataBlock

def pdb_ref(datas, offsets, lengths, max_lens, r_off, r_len, result_size, bsz, fn):
    """PopART's documented Python semantics (packeddatablock.hpp)."""
    result = None
    for i in range(len(offsets[0]) // bsz):
        seqs = []
        for d, o, l, m in zip(datas, offsets, lengths, max_lens):
            block = []
            for j in range(bsz):
                idx = i * bsz + j
                s = d[o[idx]:o[idx] + l[idx]]
                pad = [(0, 0)] * d.ndim
                pad[0] = (0, m - s.shape[0])
                block.append(np.pad(s, pad))
            seqs.append(np.stack(block))
        r = fn(*seqs)
        if result is None:
            result = np.zeros((result_size,) + r.shape[2:], r.dtype)
        for j in range(bsz):
            idx = i * bsz + j
            result[r_off[idx]:r_off[idx] + r_len[idx]] = r[j][:r_len[idx]]
    return result


def callback_graph(nodes, inputs, outputs):
    ins = [helper.make_tensor_value_info(i, TensorProto.FLOAT, None) for i in inputs]
    return helper.make_graph(nodes, "callback", ins, [onnx.ValueInfoProto(name=o) for o in outputs])


@pytest.mark.parametrize("bsz", [1, 2, 4])
def test_packed_data_block_single_input(bsz):
    """Callback: cumulative sum over each (zero-padded) sequence, times 2."""
    lengths = np.array([3, 1, 2, 2], np.int32)
    offsets = np.array([0, 3, 4, 8], np.int32)
    data = rnd(10, 3)
    cb = callback_graph([helper.make_node("Constant", [], ["ax"], value_int=1),
                         helper.make_node("CumSum", ["s", "ax"], ["c"]),
                         helper.make_node("Add", ["c", "c"], ["r"])], ["s"], ["r"])
    feeds = {"d": data, "o": offsets, "l": lengths}
    node = gc("PackedDataBlock", ["d", "o", "l", "o", "l"], ["y"], maxSequenceLengths=[4],
              resultSize=10, callbackBatchSize=bsz, callback=cb)
    (got,) = run([node], feeds, ["y"])
    exp = pdb_ref([data], [offsets], [lengths], [4], offsets, lengths, 10, bsz,
                  lambda s: 2 * np.cumsum(s, 1))
    assert got.shape == (10, 3)
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    assert np.all(got[6:8] == 0)           # rows 6, 7 are in no sequence


def test_packed_data_block_two_inputs_and_result_layout():
    """Two packed inputs of different maximum lengths; results go to their own offsets
    and lengths (shorter than the callback's output rows)."""
    la, oa = np.array([2, 3, 1], np.int32), np.array([0, 2, 5], np.int32)
    lb, ob = np.array([1, 2, 2], np.int32), np.array([4, 0, 2], np.int32)
    a, b = rnd(6, 2), rnd(5, 2)
    ro, rl = np.array([6, 0, 3], np.int32), np.array([2, 2, 1], np.int32)
    # r = a_seq[:, :2] + b_seq  (a padded to 3, b padded to 2)
    cb = callback_graph([helper.make_node("Slice", ["sa", "st", "en", "axs"], ["sa2"]),
                         helper.make_node("Add", ["sa2", "sb"], ["r"])], ["sa", "sb"], ["r"])
    cb.initializer.extend([onnx.numpy_helper.from_array(np.array([v], np.int64), n)
                           for n, v in (("st", 0), ("en", 2), ("axs", 1))])
    feeds = {"a": a, "oa": oa, "la": la, "b": b, "ob": ob, "lb": lb, "ro": ro, "rl": rl}
    node = gc("PackedDataBlock", ["a", "oa", "la", "b", "ob", "lb", "ro", "rl"], ["y"],
              maxSequenceLengths=[3, 2], resultSize=9, callbackBatchSize=1, callback=cb)
    (got,) = run([node], feeds, ["y"])
    exp = pdb_ref([a, b], [oa, ob], [la, lb], [3, 2], ro, rl, 9, 1, lambda x, y: x[:, :2] + y)
    assert got.shape == (9, 2)
    np.testing.assert_allclose(got, exp, rtol=1e-6)


def test_packed_data_block_runtime_offsets_are_traced():
    """Offsets and lengths fed at run time: same answer as with constants."""
    lengths = np.array([2, 2], np.int32)
    offsets = np.array([2, 0], np.int32)
    data = rnd(4, 1)
    cb = callback_graph([helper.make_node("Neg", ["s"], ["r"])], ["s"], ["r"])
    node = gc("PackedDataBlock", ["d", "o", "l", "o", "l"], ["y"], maxSequenceLengths=[2],
              resultSize=4, callbackBatchSize=2, callback=cb)
    (got,) = run([node], {"d": data, "o": offsets, "l": lengths}, ["y"])
    np.testing.assert_allclose(got, -data)


def test_packed_data_block_input_count():
    cb = callback_graph([helper.make_node("Neg", ["s"], ["r"])], ["s"], ["r"])
    node = gc("PackedDataBlock", ["d", "o", "l", "o"], ["y"], maxSequenceLengths=[2],
              resultSize=4, callbackBatchSize=1, callback=cb)
    with pytest.raises(popart_exception, match="3 inputs"):
        run([node], {"d": rnd(4, 1), "o": np.zeros(2, np.int32), "l": np.ones(2, np.int32)}, ["y"])


# ---------------------------------------------------------------------------------------
# In a session: anchored host stream, remote buffer, threshold from the session options

def test_in_an_inference_session():
    import popart
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2          # 2 batches per step
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             gc("HostStore", ["r"], [], streamid="stream_r"),
             gc("RemoteStore", ["x"], [], bufferid=3),
             helper.make_node("Neg", ["x"], ["z"]),
             gc("RemoteLoad", ["z"], ["back"], bufferid=3),
             gc("LossScaleUpdate", ["f", "s"], ["nf"])]
    feeds = {"x": x[0], "f": np.array(1.0, np.float32), "s": np.array([8, 2], np.uint32)}
    anchors = ["stream_r", "back", "nf"]
    df = popart.DataFlow(2, {a: popart.AnchorReturnType("ALL") for a in anchors})
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.thresholdUpperCountProportion = 0.3
    s = popart.InferenceSession(model(nodes, feeds, ["back"]).SerializeToString(), df,
                                popart.DeviceManager().createCpuDevice(), userOptions=opts)
    s.prepareDevice()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": x, "f": np.array([1.0, 1.0], np.float32),
                           "s": np.array([[8, 2], [6, 4]], np.uint32)}, out))
    np.testing.assert_array_equal(out["stream_r"], np.maximum(x, 0))
    np.testing.assert_array_equal(out["back"], x)
    np.testing.assert_array_equal(out["nf"], [2.0, 0.5])   # 2/10 <= 0.3 < 4/10
