"""oneDNN post-op fusion (popart.ops.conv_fusion, onednn.conv2d_fused): the fused call's
forward and gradients against PyTorch, and an inference graph of every fused pattern (bias,
ReLU, SiLU, residual Add, Clip, HardSwish, Gelu, LeakyRelu, HardSigmoid) against
onnxruntime, with one oneDNN call per Conv and the post-ops in them; a training step's forward
and POPART_ONEDNN's XLA path are left unfused."""
from __future__ import annotations

import re

import jax
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import popart
import popart.testing
from popart.engine import onednn
from popart.ops import nn

pytestmark = pytest.mark.skipif(not onednn.available(),
                                reason="the oneDNN custom call cannot be built or loaded here")
F = torch.nn.functional
RNG = np.random.default_rng(7)

# name, alpha, beta -> PyTorch's function of y (and the binary input v)
TORCH_POSTS = {
    "relu": lambda y, a, b: F.leaky_relu(y, a),
    "clip": lambda y, a, b: torch.clamp(y, a, b),
    "hardswish": lambda y, a, b: y * torch.clamp(y * a + b, 0, 1),
    "hardsigmoid": lambda y, a, b: torch.clamp(y * a + b, 0, 1),
    "sigmoid": lambda y, a, b: torch.sigmoid(y),
    "swish": lambda y, a, b: y * torch.sigmoid(y * a),
    "gelu": lambda y, a, b: F.gelu(y),
    "gelu_tanh": lambda y, a, b: F.gelu(y, approximate="tanh"),
    "tanh": lambda y, a, b: torch.tanh(y),
    "elu": lambda y, a, b: F.elu(y, a),
    "linear": lambda y, a, b: y * a + b,
}
CHAINS = {
    "bias-relu": [("bias", 0, 0), ("relu", 0, 0)],
    "bias-swish": [("bias", 0, 0), ("swish", 1, 0)],
    "bias-add-relu": [("bias", 0, 0), ("add", 0, 0), ("relu", 0, 0)],
    "hardswish-mul(n,c)": [("hardswish", 1 / 6, 0.5), ("mul", 0, 0)],
    "add(scalar)-leaky": [("add", 0, 0), ("relu", 0.1, 0)],
    "eltwise-all": [("clip", -2, 6), ("hardsigmoid", 0.2, 0.5), ("gelu", 0, 0), ("tanh", 0, 0),
                    ("elu", 1.5, 0), ("linear", 2, 1), ("sigmoid", 0, 0), ("gelu_tanh", 0, 0)],
}
# which dims of the binary input are the result's (else 1), NCHW order
BINARY_DIMS = {"bias-add-relu": (1, 1, 1, 1), "hardswish-mul(n,c)": (1, 1, 0, 0),
               "add(scalar)-leaky": (0, 0, 0, 0)}


def _torch_chain(y, operands, chain):
    rest = iter(operands)
    for name, a, b in chain:
        if name == "bias":
            y = y + next(rest).reshape(-1, 1, 1)
        elif name in ("add", "mul"):
            v = next(rest)
            y = y + v if name == "add" else y * v
        else:
            y = TORCH_POSTS[name](y, a, b)
    return y


@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("groups", [1, 4], ids=["dense", "grouped"])
@pytest.mark.parametrize("chain", CHAINS, ids=str)
def test_fused_call_and_its_gradients_match_torch(chain, groups, nhwc):
    posts = tuple((n, float(a), float(b)) for n, a, b in CHAINS[chain])
    n, c, h, o = 2, 8, 9, 8
    x = RNG.standard_normal((n, c, h, h), dtype=np.float32)
    w = RNG.standard_normal((o, c // groups, 3, 3), dtype=np.float32) * 0.3
    operands = [RNG.standard_normal(o, dtype=np.float32)] if posts[0][0] == "bias" else []
    if chain in BINARY_DIMS:
        shape = [d if keep else 1 for d, keep in zip((n, o, 5, 5), BINARY_DIMS[chain])]
        operands.append(RNG.standard_normal(shape, dtype=np.float32))
    static = ((2, 2), ((1, 1), (1, 1)), (1, 1), nhwc, groups, posts)
    last = (lambda t: t.transpose(0, 2, 3, 1)) if nhwc else (lambda t: t)
    first = (lambda t: t.transpose(0, 3, 1, 2)) if nhwc else (lambda t: t)
    ops = tuple(v if v.ndim == 1 else last(v) for v in operands)

    def f(x, w, ops):
        return first(onednn.conv2d_fused(last(x), w, ops, *static))
    y, vjp = jax.vjp(jax.jit(f), x, w, ops)
    dy = RNG.standard_normal(y.shape, dtype=np.float32)
    dx, dw, dops = vjp(dy)

    tx, tw, *tops = (torch.tensor(v, requires_grad=True) for v in (x, w, *operands))
    ty = _torch_chain(F.conv2d(tx, tw, stride=2, padding=1, groups=groups), tops, posts)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(np.asarray(y), ty.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx), tx.grad.numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(dw), tw.grad.numpy(), rtol=1e-3, atol=1e-3)
    for got, t in zip(dops, tops):
        want = t.grad.numpy()
        np.testing.assert_allclose(np.asarray(got if got.ndim == 1 else first(got)), want,
                                   rtol=1e-3, atol=1e-3)


def test_vmapped_fused_call_folds_or_loops_over_the_binary_input():
    """Under vmap (batchesPerStep): a binary input per batch folds with x into one call; one
    shared by every batch but per image makes the call loop; both give PyTorch's numbers."""
    x = RNG.standard_normal((3, 2, 6, 7, 7), dtype=np.float32)
    w = RNG.standard_normal((6, 6, 3, 3), dtype=np.float32) * 0.3
    res = RNG.standard_normal((3, 2, 6, 7, 7), dtype=np.float32)
    static = ((1, 1), ((1, 1), (1, 1)), (1, 1), False, 1, (("add", 0.0, 0.0), ("relu", 0.0, 0.0)))
    per_batch = jax.vmap(lambda x, r: onednn.conv2d_fused(x, w, (r,), *static))(x, res)
    shared = jax.vmap(lambda x: onednn.conv2d_fused(x, w, (res[0],), *static))(x)
    for i in range(3):
        conv = F.conv2d(torch.from_numpy(x[i]), torch.from_numpy(w), padding=1)
        for got, r in ((per_batch, res[i]), (shared, res[0])):
            np.testing.assert_allclose(np.asarray(got[i]), F.relu(conv + torch.from_numpy(r)),
                                       rtol=1e-4, atol=1e-4)


# ---- Sessions: one ONNX graph with each pattern ----
C = 8
W = {f"w{i}": (RNG.standard_normal((C, 1 if i == 2 else C, 3, 3), dtype=np.float32) * 0.3)
     for i in range(1, 11)}
W.update({f"b{i}": RNG.standard_normal(C, dtype=np.float32) * 0.1 for i in (1, 3, 6)})
X = RNG.standard_normal((2, C, 10, 10), dtype=np.float32)


def _conv(name, x, w, b=None, group=1):
    return helper.make_node("Conv", [x, w] + ([b] if b else []), [name], pads=[1] * 4,
                            group=group)


def fusion_model() -> bytes:
    """x -> Conv+b, Relu (a) -> depthwise Conv, Sigmoid, Mul (SiLU) -> Conv+b, Add(a), Relu
    -> Conv, Clip(0, 6) (bounds: initializers, run-time values in a session) -> Conv,
    Clip(-1, 3) (bounds: Constant nodes) -> Conv, HardSwish -> Conv+b, Gelu -> Conv, LeakyRelu(0.1) -> Conv,
    HardSigmoid -> Conv (pre, an output too), Relu (y)."""
    mk = helper.make_node
    zero, six = (helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in (("lo", 0.), ("hi", 6.)))
    nodes = [_conv("c1", "x", "w1", "b1"), mk("Relu", ["c1"], ["a"]),
             _conv("c2", "a", "w2", group=C), mk("Sigmoid", ["c2"], ["s2"]),
             mk("Mul", ["c2", "s2"], ["silu"]),
             _conv("c3", "silu", "w3", "b3"), mk("Add", ["a", "c3"], ["r"]), mk("Relu", ["r"], ["r2"]),
             _conv("c4", "r2", "w4"), mk("Clip", ["c4", "lo", "hi"], ["k"]),
             mk("Constant", [], ["c_lo"], value_float=-1.0), mk("Constant", [], ["c_hi"], value_float=3.0),
             _conv("c10", "k", "w10"), mk("Clip", ["c10", "c_lo", "c_hi"], ["k2"]),
             _conv("c5", "k2", "w5"), mk("HardSwish", ["c5"], ["hs"]),
             _conv("c6", "hs", "w6", "b6"), mk("Gelu", ["c6"], ["g"]),
             _conv("c7", "g", "w7"), mk("LeakyRelu", ["c7"], ["l"], alpha=0.1),
             _conv("c8", "l", "w8"), mk("HardSigmoid", ["c8"], ["hsig"], alpha=0.2, beta=0.5),
             _conv("pre", "hsig", "w9"), mk("Relu", ["pre"], ["y"])]
    graph = helper.make_graph(
        nodes, "fusion", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(X.shape))],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "pre")],
        [numpy_helper.from_array(v, k) for k, v in W.items()] + [zero, six])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]).SerializeToString()


def _posts(session) -> list[list[str]]:
    """Each oneDNN call's post-op names, in the compiled program."""
    names = {code: name for name, (code, _) in onednn.POST_OPS.items()}
    geoms = re.findall(r'custom_call_target="popart_onednn_conv".*?geom = dense<\[([\d, -]*)\]>',
                       popart.testing.compiled(session).as_text())
    return [[names[int(c)] for c in g.split(",")[11::3]] for g in geoms]


def _infer(model: bytes, bps: int = 1):
    s = popart.InferenceSession(model, popart.DataFlow(bps, ["y", "pre"]),
                                popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": np.stack([X, -X]) if bps > 1 else X}, anchors))
    return s, anchors


@pytest.fixture(scope="module")
def reference():
    model = fusion_model()
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return model, {"X": sess.run(["y", "pre"], {"x": X}), "-X": sess.run(["y", "pre"], {"x": -X})}


@pytest.mark.parametrize("bps", [1, 2])
def test_inference_fuses_every_pattern_and_matches_onnxruntime(reference, bps):
    model, want = reference
    s, anchors = _infer(model, bps)
    for i, key in enumerate(["X", "-X"][:bps]):
        for name, ref in zip(("y", "pre"), want[key]):
            got = anchors[name][i] if bps > 1 else anchors[name]
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=name)
    # One call per Conv (the calls each post-op extended are dropped); the anchored
    # pre-activation of the last one is not fused.
    assert _posts(s) == [["bias", "relu"], ["swish"], ["bias", "sum", "relu"], ["max", "min"],
                         ["clip"], ["hardswish"], ["bias", "gelu"], ["relu"], ["hardsigmoid"], []]


def test_training_forward_and_onednn_off_stay_unfused(reference):
    model, want = reference
    b = popart.Builder(model)
    loss = b.aiGraphcore.l1loss(["y"], 0.1, reduction=popart.ReductionType.Sum)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.01), popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": X}, anchors))
    np.testing.assert_allclose(anchors[loss], 0.1 * np.abs(want["X"][0]).sum(), rtol=1e-4)
    assert all(p == [] for p in _posts(s))
    with nn.onednn_off():
        s, anchors = _infer(model)
    assert _posts(s) == []
    np.testing.assert_allclose(anchors["y"], want["X"][0], rtol=1e-4, atol=1e-4)
