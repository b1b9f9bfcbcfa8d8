"""popxl (and the popart.ir alias): the seeds' examples, training against PyTorch and the
ONNX-builder TrainingSession, subgraph calls, repeat, autodiff, replica groupings."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import popart
import popart.ir
import popxl
import popxl.ops as ops


def _pir():
    """``import popart.ir as pir``."""
    return importlib.import_module("popart.ir")


# ---------------------------------------------------------------------------------------
# Seed 003: the popart.ir examples


def test_popart_ir_alias():
    import popart.ir as pir
    import popart.ir.ops as pir_ops
    assert pir.Ir is popxl.Ir and pir.h2d_stream is popxl.h2d_stream
    assert pir_ops is popxl.ops and pir_ops.__name__ == "popxl.ops"


def test_simple_addition_with_host_streams():
    pir = _pir()
    import popart.ir.ops as ops_
    ir = pir.Ir()
    main = ir.main_graph()
    with main:
        input0 = pir.h2d_stream([1], pir.float32, name="input0_stream")
        a = ops_.host_load(input0, "a")
        input1 = pir.h2d_stream([1], pir.float32, name="input1_stream")
        b = ops_.host_load(input1, "b")
        o = ops_.add(a, b)
        o_d2h = pir.d2h_stream(o.shape, o.dtype, name="output_stream")
        ops_.host_store(o_d2h, o)
    assert ir.get_all_h2d_streams() == {input0, input1}
    assert ir.get_all_d2h_streams() == {o_d2h}
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({input0: np.array([1.5], np.float32), input1: np.array([2.25], np.float32)})
    assert out[o_d2h].dtype == np.float32
    np.testing.assert_array_equal(out[o_d2h], [3.75])


def test_variable_plus_constant_and_literal():
    pir = _pir()
    ir = pir.Ir()
    with ir.main_graph():
        a = pir.variable(3, dtype=pir.int8, name="variable_a")
        b = pir.constant(1, dtype=pir.int8, name="constant_b")
        o = a + b
        o2 = a + 1
        assert o.dtype == pir.int8 and o2.dtype == pir.int8 and o.shape == ()
        d, d2 = pir.d2h_stream(o.shape, o.dtype, "o"), pir.d2h_stream(o2.shape, o2.dtype, "o2")
        ops.host_store(d, o)
        ops.host_store(d2, o2)
    assert isinstance(a, popxl.Variable) and isinstance(b, popxl.Constant)
    with popxl.Session(ir, "cpu") as s:
        out = s.run()
        assert s.get_tensor_data(a) == 3 and s.get_tensor_data(b) == 1
    assert out[d] == 4 and out[d2] == 4 and out[d].dtype == np.int8


@pytest.mark.parametrize("name,np_type,is_int,is_float,signed", [
    ("bool", np.bool_, False, False, False), ("int8", np.int8, True, False, True),
    ("int32", np.int32, True, False, True), ("uint8", np.uint8, True, False, False),
    ("uint32", np.uint32, True, False, False), ("float16", np.float16, False, True, True),
    ("float32", np.float32, False, True, True), ("float64", np.float64, False, True, True)])
def test_dtype_table(name, np_type, is_int, is_float, signed):
    dt = getattr(popxl, name)
    assert dt.as_numpy() == np.dtype(np_type)
    assert (dt.is_int, dt.is_floating_point, dt.is_signed) == (is_int, is_float, signed)
    assert popxl.dtype.as_dtype(np_type) is dt


def test_dtype_aliases_and_python_types():
    assert popxl.half is popxl.float16 and popxl.float is popxl.float32 and popxl.double is popxl.float64
    assert popxl.dtype.as_dtype(float) is popxl.float32 and popxl.dtype.as_dtype(bool) is popxl.bool


# ---------------------------------------------------------------------------------------
# Training: popxl (autodiff + SGD by scaled_add_) vs PyTorch vs popart.TrainingSession

B, D, H, C, STEPS, LR = 4, 3, 5, 2, 3, 0.1


def _mlp_data():
    rng = np.random.default_rng(0)
    w = dict(w1=rng.normal(size=(D, H)).astype(np.float32), b1=rng.normal(size=H).astype(np.float32),
             w2=rng.normal(size=(H, C)).astype(np.float32))
    X = rng.normal(size=(STEPS, B, D)).astype(np.float32)
    Y = rng.integers(0, C, size=(STEPS, B)).astype(np.int32)
    return w, X, Y


def _popxl_train(w0, X, Y):
    def model(x, y, w1, b1, w2):
        h = ops.relu(x @ w1 + b1)
        return ops.nll_loss(ops.softmax(h @ w2, axis=-1), y)

    ir = popxl.Ir()
    ir.num_host_transfers = STEPS
    with ir.main_graph:
        xs, ys = popxl.h2d_stream((B, D), popxl.float32, "x"), popxl.h2d_stream((B,), popxl.int32, "y")
        ls = popxl.d2h_stream((), popxl.float32, "loss")
        w = [popxl.variable(w0[k], name=k) for k in ("w1", "b1", "w2")]
        fwd = ir.create_graph(model, popxl.TensorSpec((B, D), popxl.float32),
                              popxl.TensorSpec((B,), popxl.int32), *w)
        bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[2:])
        assert [e.connection_type for e in bwd.expected_inputs][:2] == \
            [popxl.ExpectedConnectionType.FwdGrad, popxl.ExpectedConnectionType.Fwd]
        assert bwd.forward_graph is fwd and len(bwd.graph.outputs) == 3

        def step(w1: popxl.TensorByRef, b1: popxl.TensorByRef, w2: popxl.TensorByRef):
            info = ops.call_with_info(fwd, ops.host_load(xs), ops.host_load(ys), w1, b1, w2)
            ops.host_store(ls, info.outputs[0])
            grads = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
            for v, g in zip((w1, b1, w2), grads):
                ops.scaled_add_(v, g, b=-LR)

        ops.repeat(ir.create_graph(step, *w), STEPS, *w)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run({xs: X, ys: Y})
    return out[ls], {k: s.get_tensor_data(v) for k, v in zip(("w1", "b1", "w2"), w)}


def test_mlp_training_matches_pytorch_and_training_session():
    w0, X, Y = _mlp_data()
    losses, got = _popxl_train(w0, X, Y)
    assert losses.shape == (STEPS,)

    t = {k: torch.tensor(v, requires_grad=True) for k, v in w0.items()}
    opt = torch.optim.SGD(list(t.values()), lr=LR)
    ref = []
    for i in range(STEPS):
        opt.zero_grad()
        p = torch.softmax(torch.relu(torch.tensor(X[i]) @ t["w1"] + t["b1"]) @ t["w2"], -1)
        loss = torch.nn.functional.nll_loss(torch.log(p), torch.tensor(Y[i]).long())
        loss.backward()
        opt.step()
        ref.append(loss.item())
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    for k in got:
        np.testing.assert_allclose(got[k], t[k].detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["w1"], w0["w1"])  # it trained

    # The same model through the ONNX builder and popart.TrainingSession.
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [B, D]), "x")
    lab = b.addInputTensor(popart.TensorInfo("INT32", [B]), "label")
    W1, B1, W2 = (b.addInitializedInputTensor(w0[k], k) for k in ("w1", "b1", "w2"))
    p = b.aiOnnx.softmax([b.aiOnnx.matmul([b.aiOnnx.relu([b.aiOnnx.add([b.aiOnnx.matmul([x, W1]), B1])]), W2])],
                         axis=1)
    nll = b.aiGraphcore.nllloss([p, lab], reduction=popart.ReductionType.Mean)
    sess = popart.TrainingSession(b.getModelProto(), popart.DataFlow(STEPS, {nll: popart.AnchorReturnType("ALL")}),
                                  nll, popart.SGD({"defaultLearningRate": (LR, True)}),
                                  popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    sess.weightsFromHost()
    anchors = sess.initAnchorArrays()
    sess.run(popart.PyStepIO({x: X, lab: Y}, anchors))
    np.testing.assert_allclose(anchors[nll], losses, rtol=1e-5, atol=1e-6)
    sess.weightsToHost()
    res = {k: np.zeros_like(w0[k]) for k in w0}
    sess.readWeights(popart.PyWeightsIO({i: res[k] for i, k in ((W1, "w1"), (B1, "b1"), (W2, "w2"))}))
    for k in got:
        np.testing.assert_allclose(got[k], res[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Subgraphs: several call sites, repeat, gradients through calls


def test_create_graph_call_sites_repeat_and_host_transfers():
    ir = popxl.Ir()
    ir.num_host_transfers = 3
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "xs")
        out = popxl.d2h_stream((2,), popxl.float32, "out")
        w = popxl.variable(np.array([1.0, 2.0], np.float32), name="w")

        def affine(x: popxl.Tensor, w: popxl.Tensor, scale: float):
            return x * w + scale

        g = ir.create_graph(affine, popxl.TensorSpec((2,), popxl.float32), w, scale=0.5)
        assert [t.shape for t in g.inputs] == [(2,), (2,)] and len(g.outputs) == 1
        c = popxl.constant(np.array([3.0, 4.0], np.float32))
        (y1,) = ops.call(g, c, w)                      # two call sites of the same graph
        (y2,) = ops.call(g, y1, inputs_dict={g.inputs[1]: w})
        d = popxl.d2h_stream((2,), popxl.float32, "d")
        ops.host_store(d, y2)

        def body(acc, w):                              # reads one stream element per iteration
            x = ops.host_load(xs)
            ops.host_store(out, x * w)
            return acc + x

        (total,) = ops.repeat(ir.create_graph(body, c, w), 3, popxl.constant(np.zeros(2, np.float32)), w)
        t_d = popxl.d2h_stream((2,), popxl.float32, "total")
        ops.host_store(t_d, total)
    X = np.arange(6, dtype=np.float32).reshape(3, 2)
    with popxl.Session(ir, "cpu") as s:
        r = s.run({xs: X})
    wv = np.array([1.0, 2.0], np.float32)
    y1 = np.array([3.0, 4.0]) * wv + 0.5
    zero = np.zeros(2)
    np.testing.assert_allclose(r[d], [y1 * wv + 0.5, zero, zero])  # stored once: element 0 of 3
    np.testing.assert_allclose(r[out], X * wv)                      # stored on every iteration
    np.testing.assert_allclose(r[t_d], [X.sum(0), zero, zero])


def test_gradients_through_called_subgraphs_match_numpy():
    ir = popxl.Ir()
    with ir.main_graph:
        inner = ir.create_graph(lambda a, b: ops.tanh(a @ b), popxl.TensorSpec((2, 3), popxl.float32),
                                popxl.TensorSpec((3, 2), popxl.float32))

        def outer(x, w):
            (h,) = ops.call(inner, x, w)
            (h2,) = ops.call(inner, h @ popxl.constant(np.ones((2, 3), np.float32)), w)
            return ops.sum(h2 * h2)

        fwd = ir.create_graph(outer, popxl.TensorSpec((2, 3), popxl.float32), popxl.TensorSpec((3, 2), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd)
        assert [e.fwd_tensor for e in bwd.expected_outputs] == list(fwd.inputs)
        X = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
        W = np.linspace(0.5, -0.5, 6, dtype=np.float32).reshape(3, 2)
        x, w = popxl.variable(X, name="x"), popxl.variable(W, name="w")
        info = ops.call_with_info(fwd, x, w)
        ginfo = ops.call_with_info(bwd.graph, 1.0, inputs_dict=bwd.inputs_dict(info))
        grads = bwd.fwd_parent_ins_to_grad_parent_outs(info, ginfo)
        assert set(grads) == {x, w}
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in
                   (("loss", info.outputs[0]), ("dx", grads[x]), ("dw", grads[w]))}
        for k, t in (("loss", info.outputs[0]), ("dx", grads[x]), ("dw", grads[w])):
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "cpu") as s:
        r = s.run()
    xt, wt = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    h = torch.tanh(xt @ wt)
    h2 = torch.tanh((h @ torch.ones(2, 3)) @ wt)
    loss = (h2 * h2).sum()
    loss.backward()
    np.testing.assert_allclose(r[streams["loss"]], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(r[streams["dx"]], xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r[streams["dw"]], wt.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_variables_persist_between_runs_and_host_data_round_trips():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        c = popxl.constant(np.array([1.0, 2.0, 3.0], np.float32))
        popxl.ops.var_updates.accumulate_(v, c, 2.0)     # v += 2 * c, on every run
        d = popxl.d2h_stream((3,), popxl.float32, "v_now")
        ops.host_store(d, v)
    with popxl.Session(ir, "ipu_hw") as s:
        np.testing.assert_allclose(s.run()[d], [2, 4, 6])
        np.testing.assert_allclose(s.run()[d], [4, 8, 12])
        np.testing.assert_allclose(s.get_tensor_data(v), [4, 8, 12])
        s.write_variable_data(v, np.array([10, 10, 10], np.float32))
        np.testing.assert_allclose(s.run()[d], [12, 14, 16])
        with pytest.raises(ValueError):
            s.write_variable_data(v, np.zeros(4, np.float32))
    np.testing.assert_allclose(s.get_tensors_data([v, c])[c], [1, 2, 3])
    np.testing.assert_allclose(s.get_tensor_data(v), [12, 14, 16])
    with pytest.raises(ValueError, match="Session"):
        s.run()


def test_tensor_by_ref_updates_caller_and_by_value_does_not():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.float32(1.0), name="a")
        b = popxl.variable(np.float32(1.0), name="b")

        def bump_ref(t: popxl.TensorByRef):
            ops.add_(t, popxl.constant(np.float32(5.0)))

        def bump_val(t):
            ops.add_(t, popxl.constant(np.float32(5.0)))

        g_ref, g_val = ir.create_graph(bump_ref, a), ir.create_graph(bump_val, b)
        ops.call(g_ref, a)
        ops.call(g_ref, a)
        ops.call(g_val, b)
    with popxl.Session(ir, "cpu") as s:
        s.run()
        vals = s.get_tensors_data([a, b])
    assert vals[a] == 11.0 and vals[b] == 1.0


# ---------------------------------------------------------------------------------------
# Replication


@pytest.mark.parametrize("stride,group_size,assignment", [
    (1, 2, [0, 0, 1, 1, 2, 2, 3, 3]), (1, 4, [0, 0, 0, 0, 1, 1, 1, 1]),
    (2, 4, [0, 1, 0, 1, 0, 1, 0, 1]), (4, 2, [0, 1, 2, 3, 0, 1, 2, 3])])
def test_replica_grouping_assignments(stride, group_size, assignment):
    ir = popxl.Ir(replication=8)
    g = ir.replica_grouping(stride, group_size)
    assert g.assignment == assignment
    assert g.num_groups == 8 // group_size and g.group_size == group_size and g.stride == stride


def test_replica_grouping_defaults_and_from_assignments():
    ir = popxl.Ir(replication=8)
    assert ir.replica_grouping().assignment == [0] * 8
    assert ir.replica_grouping(2).assignment == [0, 1] * 4      # group_size = 8 // stride
    assert ir.replica_grouping([0, 0, 1, 1, 0, 0, 1, 1]).assignment == [0, 0, 1, 1, 0, 0, 1, 1]
    g = popxl.Ir(replication=6).replica_grouping_from_assignments([0, 1, 0, 0, 1, 1])
    assert g.assignment == [0, 1, 0, 0, 1, 1] and g.num_groups == 2 and not g.is_const
    assert ir.replication_factor == 8 and ir.instance_replication_factor == 8
    with pytest.raises(ValueError):
        ir.replica_grouping(3, 2)
    with pytest.raises(ValueError):
        ir.replica_grouping_from_assignments([0, 1])


def test_replicated_all_reduce_and_grouped_variables():
    ir = popxl.Ir(replication=2)
    ir.num_host_transfers = 2
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        v = popxl.variable(np.array([[1.0], [2.0]], np.float32), name="v",
                           replica_grouping=ir.replica_grouping(1, 1))  # one value per replica
        s_ = popxl.d2h_stream((3,), popxl.float32, "sum")
        c = popxl.constant(np.arange(4, dtype=np.float32))
        rs = ops.collectives.replicated_reduce_scatter(c * v, "add")     # [2]: this replica's shard
        ag = ops.collectives.replicated_all_gather(rs, output_shape="new_axis")
        assert rs.shape == (2,) and ag.shape == (2, 2)
        d_rs, d_ag = popxl.d2h_stream((2,), popxl.float32, "rs"), popxl.d2h_stream((2, 2), popxl.float32, "ag")
        ops.host_store(d_rs, rs)
        ops.host_store(d_ag, ag)
        g = ir.create_graph(lambda x, v: ops.collectives.replicated_all_reduce(x * v, "add"),
                            popxl.TensorSpec((3,), popxl.float32), v)

        def body(v):
            (y,) = ops.call(g, ops.host_load(xs), v)
            ops.host_store(s_, y)
        ops.repeat(ir.create_graph(body, v), 2, v)
    X = np.arange(12, dtype=np.float32).reshape(2, 2, 3)   # [transfers, replicas, 3]
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run({xs: X})
        assert s.get_tensor_data(v).shape == (2, 1)
    want = X[:, 0] * 1.0 + X[:, 1] * 2.0
    np.testing.assert_allclose(out[s_], np.stack([want, want], 1))  # [transfers, replicas, 3]
    full = np.arange(4) * 1.0 + np.arange(4) * 2.0
    np.testing.assert_allclose(out[d_rs][0], [full[:2], full[2:]])  # transfer 0, per replica
    np.testing.assert_allclose(out[d_ag][0, 1], full.reshape(2, 2))
    with pytest.raises(ValueError, match="shape"):
        with s:
            s.run({xs: X[0]})


def test_popart_ir_is_only_popxls_alias():
    """popart.ir (PopART's older name of popxl) and every module below it are popxl's; the
    internal IR has a name of its own; PopART's C++ binding is a facade of popxl's IR."""
    import importlib

    import popart.ir
    import popart.ir.ops
    import popart.ir.transforms
    assert popart.ir.transforms is popxl.transforms
    assert popart.ir.transforms.autodiff is popxl.transforms.autodiff
    assert popart.ir.ops is popxl.ops and popart.ir.Ir is popxl.Ir
    assert importlib.import_module("popart.ir.ops.collectives") is popxl.ops.collectives
    binding = importlib.import_module("popart._internal.ir")
    assert binding.Graph is type(popxl.Ir().main_graph._pb_graph)
    # popxl's graph module, not the internal IR's (popart._ir.graph)
    assert importlib.import_module("popart.ir.graph") is popxl.graph
