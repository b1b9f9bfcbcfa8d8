"""popxl.ops against NumPy: every op runs through the registry's lowerings in one session."""
from __future__ import annotations

import numpy as np
import pytest

import popxl
import popxl.ops as ops

RNG = np.random.default_rng(3)
A = RNG.normal(size=(2, 3)).astype(np.float32)
Bm = RNG.normal(size=(3, 4)).astype(np.float32)
IMG = RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)
KER = RNG.normal(size=(3, 2, 3, 3)).astype(np.float32)


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _run(build):
    """Build ops in a fresh Ir's main graph; ``build`` returns {name: tensor}; returns values."""
    ir = popxl.Ir()
    with ir.main_graph:
        tensors = build(ir)
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in tensors.items()}
        for k, t in tensors.items():
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "cpu") as s:
        out = s.run()
    return {k: out[st] for k, st in streams.items()}, tensors


def test_ops_and_operators_match_numpy():
    def build(ir):
        a, b = popxl.variable(A, name="a"), popxl.variable(Bm, name="b")
        img, ker = popxl.constant(IMG), popxl.constant(KER)
        idx = popxl.constant(np.array([2, 0], np.int32))
        return {
            "add": a + 1.0, "rsub": 2.0 - a, "mul": a * a, "div": a / 2.0, "neg": -a, "pow": abs(a) ** 2,
            "matmul": a @ b, "T": a.T, "gt": a > 0.0, "lt": a < 0.0,
            "relu": ops.relu(a), "gelu": ops.gelu(a), "softmax": ops.softmax(a, axis=1),
            "sigmoid": ops.sigmoid(a), "exp": ops.exp(a), "tanh": ops.tanh(a),
            "sum": ops.sum(a), "sum1": ops.sum(a, axis=1, keepdims=True), "mean0": ops.mean(a, 0),
            "max": ops.max(a, axis=1), "min": ops.min(a), "argmax": ops.argmax(a, 1),
            "reshape": a.reshape((3, 2)), "transpose": ops.transpose(a, (1, 0)),
            "concat": ops.concat([a, a], axis=0), "split1": ops.split(b, [1, 3], axis=1)[1],
            "squeeze": ops.squeeze(ops.reshape(a, (1, 2, 3))), "flatten": ops.flatten(a),
            "getitem": a[1], "getitem2": a[:, 1:], "getitem3": a[0, ::2], "gather": ops.gather(b, idx),
            "slice": ops.slice(a, start=[0, 1], stop=[1, 3]), "where": ops.where(a > 0.0, a, 0.0),
            "dyn": ops.dynamic_slice(b, popxl.constant(np.array([1], np.uint32)), [0], [2]),
            "cast": ops.cast(a, popxl.int32), "clip": ops.clip(a, -0.5, 0.5),
            "scaled_add": ops.scaled_add(a, a, 2.0, 3.0),
            "conv": ops.conv(img, ker, padding=(1, 1, 1, 1)), "maxpool": ops.max_pool(img, (2, 2), (2, 2)),
            "avgpool": ops.average_pool(img, (2, 2), (2, 2)),
            "nll": ops.nll_loss(ops.softmax(a, axis=1), popxl.constant(np.array([0, 2], np.int32))),
        }
    got, t = _run(build)
    ref = {
        "add": A + 1, "rsub": 2 - A, "mul": A * A, "div": A / 2, "neg": -A, "pow": np.abs(A) ** 2,
        "matmul": A @ Bm, "T": A.T, "gt": A > 0, "lt": A < 0,
        "relu": np.maximum(A, 0), "softmax": _softmax(A, 1), "sigmoid": 1 / (1 + np.exp(-A)),
        "exp": np.exp(A), "tanh": np.tanh(A), "sum": A.sum(), "sum1": A.sum(1, keepdims=True),
        "mean0": A.mean(0), "max": A.max(1), "min": A.min(), "argmax": A.argmax(1),
        "reshape": A.reshape(3, 2), "transpose": A.T, "concat": np.concatenate([A, A]), "split1": Bm[:, 1:],
        "squeeze": A, "flatten": A.reshape(-1), "getitem": A[1], "getitem2": A[:, 1:], "getitem3": A[0, ::2],
        "gather": Bm[[2, 0]], "slice": A[0:1, 1:3], "where": np.where(A > 0, A, 0),
        "dyn": Bm[1:3], "cast": A.astype(np.int32), "clip": np.clip(A, -0.5, 0.5),
        "scaled_add": 5 * A, "nll": -np.log(_softmax(A, 1)[[0, 1], [0, 2]]).mean(),
    }
    import torch
    ti = torch.tensor(IMG)
    ref["conv"] = torch.nn.functional.conv2d(ti, torch.tensor(KER), padding=1).numpy()
    ref["maxpool"] = torch.nn.functional.max_pool2d(ti, 2).numpy()
    ref["avgpool"] = torch.nn.functional.avg_pool2d(ti, 2).numpy()
    ref["gelu"] = torch.nn.functional.gelu(torch.tensor(A), approximate="tanh").numpy()
    for k, v in ref.items():
        assert t[k].shape == np.shape(v), k             # shapes inferred while building
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert t["gt"].dtype == popxl.bool and t["argmax"].dtype == popxl.int32
    assert t["cast"].dtype == popxl.int32 and t["matmul"].dtype == popxl.float32


def test_inplace_ops_random_dropout_and_conditional():
    seed = popxl.create_seeds(7)
    assert seed.shape == (2,) and seed.dtype == np.uint32

    def build(ir):
        v = popxl.variable(np.ones(4, np.float32), name="v")
        ops.add_(v, popxl.constant(np.full(4, 2.0, np.float32)))  # v = 3
        ops.relu_(v)
        w = v * 2.0                                                 # reads the new version: 6
        s = popxl.constant(seed, popxl.uint32)
        s1, s2 = ops.split_random_seed(s)
        x = popxl.constant(np.ones((200,), np.float32))
        then_g = ir.create_graph(lambda t: t + 1.0, x)
        else_g = ir.create_graph(lambda t: t - 1.0, x)
        (c_t,) = ops.conditional(popxl.constant(True), then_g, else_g, [x], [x])
        (c_f,) = ops.conditional(popxl.constant(np.array(False)), then_g, else_g, [x], [x])
        return {"v": v, "w": w, "d1": ops.dropout(x, s1, 0.5), "d1b": ops.dropout(x, s1, 0.5),
                "d2": ops.dropout(x, s2, 0.5), "n": ops.random_normal(s, (1000,), 1.0, 2.0),
                "u": ops.random_uniform(s, (1000,), -1.0, 1.0), "ct": c_t, "cf": c_f}
    got, _ = _run(build)
    np.testing.assert_allclose(got["v"], 3.0)
    np.testing.assert_allclose(got["w"], 6.0)
    d1, d2 = got["d1"], got["d2"]
    assert set(np.unique(d1)) <= {0.0, 2.0} and 40 < (d1 == 0).sum() < 160
    np.testing.assert_array_equal(d1, got["d1b"])                  # same seed, same mask
    assert not np.array_equal(d1, d2)
    assert abs(got["n"].mean() - 1.0) < 0.3 and abs(got["n"].std() - 2.0) < 0.3
    assert got["u"].min() >= -1 and got["u"].max() <= 1 and got["u"].std() > 0.4
    np.testing.assert_allclose(got["ct"], 2.0)
    np.testing.assert_allclose(got["cf"], 0.0)


def test_var_updates_and_copy():
    def build(ir):
        t = popxl.variable(np.array([1.0, 2.0], np.float32), name="t")
        x = popxl.constant(np.array([3.0, 4.0], np.float32))
        a = popxl.variable(np.zeros(2, np.float32), name="a")
        ops.var_updates.accumulate_square_(a, x, 0.5)               # 4.5, 8
        m = popxl.variable(np.zeros(2, np.float32), name="m")
        ops.var_updates.accumulate_mean_(m, x, 0.0)                 # 3, 4
        ops.var_updates.accumulate_mean_(m, t, 1.0)                 # 2, 3
        ma = popxl.variable(np.ones(2, np.float32), name="ma")
        ops.var_updates.accumulate_moving_average_(ma, x, 0.25)     # .25 + .75 x
        z = popxl.variable(np.ones(2, np.float32), name="z")
        ops.var_updates.accumulator_zero_(z)
        ops.var_updates.copy_var_update_(t, x)
        return {"t": t, "a": a, "m": m, "ma": ma, "z": z}
    got, _ = _run(build)
    np.testing.assert_allclose(got["t"], [3, 4])
    np.testing.assert_allclose(got["a"], [4.5, 8])
    np.testing.assert_allclose(got["m"], [2, 3])
    np.testing.assert_allclose(got["ma"], [0.25 + 2.25, 0.25 + 3.0])
    np.testing.assert_allclose(got["z"], [0, 0])


def test_graph_building_context_annotations_and_errors(tmp_path):
    ir = popxl.Ir()
    main = ir.main_graph
    assert main() is main and ir.id != popxl.Ir().id
    with main, popxl.in_sequence():
        with popxl.ipu(1), popxl.name_scope("layer"):
            x = popxl.constant(np.ones(3, np.float32), name="x")
            y = ops.relu(x)
        assert y.id == "layer/relu_out" and y.name == y.id   # PopXL: a name keeps its name scopes
        node = main._g.nodes[-1]
        assert node.op_type == "Relu" and node.domain == "ai.onnx"
        assert node.annotations["__ipu_number"] == 1 and node.annotations["__in_sequence"]
        with pytest.raises(Exception, match="MatMul"):
            ops.matmul(x, popxl.constant(np.ones((4, 2), np.float32)))  # shape error names the op
        with pytest.raises(ValueError, match="main graph"):
            popxl.graph_input((2,), popxl.float32)
        sub = ir.create_empty_graph("sub")
        with sub:
            t = popxl.graph_input((3,), popxl.float32, "t")
            popxl.graph_output(t * 2.0)
            with pytest.raises(ValueError, match="Variables"):
                popxl.variable(1.0)
            with pytest.raises(ValueError, match="belongs to graph"):
                ops.add(t, x)
        (z,) = ops.call(sub, y)
        with pytest.raises(ValueError, match="Too many inputs"):
            ops.call(sub, y, y)

    class Scale(popxl.Module):
        def build(self, a, factor=3.0):
            return a * factor

    g = ir.create_graph(Scale(), popxl.TensorSpec((3,), popxl.float32), factor=4.0)
    assert "Scale" in g.name and g.inputs[0].shape == (3,)
    ir.dot_checkpoint("check", tmp_path)
    assert "ai.onnx::Relu" in (tmp_path / "check.dot").read_text()
    assert z.shape == (3,)


def test_custom_jvp_op_on_a_constant_folds():
    """Relu (jax.nn.relu is a custom_jvp function) of a constant is folded at trace time while
    the session's replica vmap is active; the folded value must still come out right."""
    got, _ = _run(lambda ir: {"r": ops.relu(popxl.constant(A)), "v": popxl.variable(A) * 1.0})
    np.testing.assert_allclose(got["r"], np.maximum(A, 0))


def test_more_ops_match_numpy():
    import torch
    lab = np.array([1, 0], np.int32)

    def build(ir):
        a = popxl.variable(A, name="a")
        lb = popxl.constant(lab)
        w, bias = popxl.constant(np.full(3, 2.0, np.float32)), popxl.constant(np.full(3, 0.5, np.float32))
        loss, dx = ops.nll_loss_with_softmax_grad(ops.softmax(a, 1), lb)
        v, i = ops.topk(a, 2, axis=1)
        upd = ops.dynamic_update(a, popxl.constant(np.array([1], np.uint32)),
                                 popxl.constant(np.zeros((1, 3), np.float32)), [0], [1])
        return {"loss": loss, "dx": dx, "topv": v, "topi": i, "upd": upd,
                "onehot": ops.onehot(lb, 3, popxl.constant(np.array([0.0, 1.0], np.float32))),
                "cumsum": ops.cumsum(a, 1), "lse": ops.logsumexp(a, 1), "lsm": ops.log_softmax(a, 1),
                "median": ops.median(a, 1), "ln": ops.layer_norm(a, w, bias),
                "gn": ops.group_norm(a, w, bias, 1),
                "scatter": ops.scatter(a, popxl.constant(np.array([[0, 1, 0]], np.int32)),
                                       popxl.constant(np.full((1, 3), 9.0, np.float32))),
                "split": ops.split(a, 3, axis=1)[2], "prod": ops.prod(a, 0), "l2": ops.l2(a)}
    got, _ = _run(build)
    at = torch.tensor(A, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(at, torch.tensor(lab).long())
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["dx"], at.grad.numpy(), rtol=1e-5, atol=1e-6)
    srt = np.sort(A, 1)[:, ::-1]
    np.testing.assert_allclose(got["topv"], srt[:, :2], rtol=1e-6)
    np.testing.assert_array_equal(got["topi"], np.argsort(-A, 1)[:, :2])
    np.testing.assert_allclose(got["upd"], np.stack([A[0], np.zeros(3)]))
    np.testing.assert_allclose(got["onehot"], np.eye(3)[lab])
    np.testing.assert_allclose(got["cumsum"], np.cumsum(A, 1), rtol=1e-5)
    lse = np.log(np.exp(A).sum(1))
    np.testing.assert_allclose(got["lse"], lse, rtol=1e-5)
    np.testing.assert_allclose(got["lsm"], A - lse[:, None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["median"], np.median(A, 1), rtol=1e-6)
    norm = (A - A.mean(1, keepdims=True)) / np.sqrt(A.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got["ln"], norm * 2 + 0.5, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["gn"], norm * 2 + 0.5, rtol=1e-4, atol=1e-5)
    sc = A.copy()
    sc[0, 0] = sc[1, 1] = sc[0, 2] = 9.0                          # ScatterElements along axis 0
    np.testing.assert_allclose(got["scatter"], sc)
    np.testing.assert_allclose(got["split"], A[:, 2:])
    np.testing.assert_allclose(got["prod"], A.prod(0), rtol=1e-6)
    np.testing.assert_allclose(got["l2"], np.sqrt((A * A).sum()), rtol=1e-6)
