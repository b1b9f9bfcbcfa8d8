"""popxl.transforms.autodiff as PopXL builds grad graphs: nothing is recomputed; the forward
tensors PopART's grad ops read become outputs of the forward graph (also at call sites made
before autodiff) and inputs of the gradient graph, after the provided gradients. Checked
against PyTorch / NumPy gradients: the user guide's call_with_info / inputs_dict pattern, a
gradient graph connected by hand from expected_inputs, intermediate grads_provided /
grads_required, and a replicated (collective) forward graph."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import popxl
import popxl.ops as ops
from popxl import ExpectedConnectionType as ECT
from popxl.ops import collectives as C

from helpers.popxl_case import Linear, store_and_run

RNG = np.random.default_rng(7)
X = RNG.normal(size=(4, 3)).astype(np.float32)
W1 = RNG.normal(size=(3, 5)).astype(np.float32)
B1 = RNG.normal(size=5).astype(np.float32)
W2 = RNG.normal(size=(5, 2)).astype(np.float32)


def _torch_linear_relu():
    t = [torch.tensor(v, requires_grad=True) for v in (X, W1, B1)]
    y = torch.relu(t[0] @ t[1] + t[2])
    (y * y).sum().backward(torch.tensor(1.0))
    return y.detach().numpy(), [v.grad.numpy() for v in t]


def test_user_guide_pattern_call_with_info_then_inputs_dict():
    """The user guide: call the forward graph (call_with_info), autodiff, inputs_dict of the
    forward call site, call the gradient graph; the relu output its grad op reads becomes an
    output of the forward graph and of the call made before autodiff."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(X, name="x")
        W, b = popxl.variable(W1, name="W"), popxl.variable(B1, name="b")
        lin = Linear()
        graph = ir.create_graph(lin, x, out_features=5)
        fwd_info = ops.call_with_info(graph, x, inputs_dict={lin.W: W, lin.b: b})
        assert len(fwd_info.outputs) == 1
        bwd = popxl.transforms.autodiff(graph)
        # nothing to add: relu's grad reads its output, the matmul's its inputs
        assert [e.connection_type for e in bwd.expected_inputs] == [ECT.FwdGrad] + [ECT.Fwd] * 3
        assert bwd.expected_inputs[0].fwd_tensor is graph.outputs[0]
        assert {e.fwd_tensor for e in bwd.expected_inputs[1:]} == {graph.outputs[0], graph.inputs[0], lin.W}
        assert [e.fwd_tensor for e in bwd.expected_outputs] == list(graph.inputs)
        (y,) = fwd_info.outputs
        grads_info = ops.call_with_info(bwd.graph, y * 2.0, inputs_dict=bwd.inputs_dict(fwd_info))
        grads = bwd.fwd_parent_ins_to_grad_parent_outs(fwd_info, grads_info)
        assert list(grads) == [x, W, b]
        by_fwd = bwd.fwd_graph_ins_to_grad_parent_outs(grads_info)
        assert list(by_fwd) == list(graph.inputs) and list(by_fwd.values()) == list(grads.values())
        ops_in_grad = {n.op_type for n in bwd.graph._g.nodes}
    assert ops_in_grad <= {"OpVJP", "Sum", "Mul"}, ops_in_grad   # no forward op runs again
    got = store_and_run(ir, {"y": y, **{k: grads[t] for k, t in (("dx", x), ("dW", W), ("db", b))}})
    want_y, want = _torch_linear_relu()
    np.testing.assert_allclose(got["y"], want_y, rtol=1e-6)
    for k, w in zip(("dx", "dW", "db"), want):
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-6)


def _two_layer(x, w1, b1, w2):
    h = ops.tanh(x @ w1 + b1)
    return ops.sum(ops.softmax(h @ w2, axis=-1) * popxl.constant(np.array([1.0, -2.0], np.float32)))


def test_stitched_activation_reaches_call_sites_made_before_autodiff_and_connect_by_hand():
    """tanh's output h is read by tanh's grad and by the second matmul's grad, and softmax's
    output by its grad: they become outputs of the forward graph, also at the call made
    before autodiff. The gradient graph, connected by hand from expected_inputs, gives
    PyTorch's gradients; given another h it uses that h (it never recomputes h)."""
    ir = popxl.Ir()
    with ir.main_graph:
        ts = [popxl.variable(v, name=n) for v, n in ((X, "x"), (W1, "w1"), (B1, "b1"), (W2, "w2"))]
        fwd = ir.create_graph(_two_layer, *[popxl.TensorSpec(v.shape, popxl.float32) for v in (X, W1, B1, W2)])
        info = ops.call_with_info(fwd, *ts)
        bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[1:])
        # loss, then h, the softmax output and the product (MulArg0GradOp reads both
        # inputs and the output, PopART's ElementWiseBinaryGradOp)
        assert len(fwd.outputs) == 4 and len(info.outputs) == 4
        added = fwd.outputs[1:]
        assert {t.shape for t in added} == {(4, 5), (4, 2)}
        fwd_ts = [e.fwd_tensor for e in bwd.expected_inputs]
        assert bwd.expected_inputs[0].connection_type == ECT.FwdGrad and fwd_ts[0] is fwd.outputs[0]
        assert all(e.connection_type == ECT.Fwd and (t in fwd.inputs or t in fwd.outputs)
                   for e, t in zip(bwd.expected_inputs[1:], fwd_ts[1:]))
        # b1 is read by no grad op (Add), w1 only for x's gradient (MatMulLhsGrad), not asked
        assert set(fwd_ts[1:]) == set(added) | {fwd.inputs[0], fwd.inputs[3]}

        def parent(t: popxl.Tensor) -> popxl.Tensor:
            return info.inputs[list(fwd.inputs).index(t)] if t in fwd.inputs \
                else info.outputs[list(fwd.outputs).index(t)]

        seed = popxl.constant(1.0)
        by_hand = [seed] + [parent(t) for t in fwd_ts[1:]]
        g1 = ops.call(bwd.graph, *by_hand)
        h = next(t for t in added if t.shape == (4, 5))
        other_h = popxl.constant(np.full((4, 5), 0.5, np.float32), name="other_h")
        g2 = ops.call(bwd.graph, *[other_h if t is h else p for t, p in zip(fwd_ts, by_hand)])
    got = store_and_run(ir, {"dw1": g1[0], "db1": g1[1], "dw2": g1[2], "dw2_other": g2[2]})
    t = [torch.tensor(v, requires_grad=True) for v in (X, W1, B1, W2)]
    th = torch.tanh(t[0] @ t[1] + t[2])
    p = torch.softmax(th @ t[3], -1)
    (p * torch.tensor([1.0, -2.0])).sum().backward()
    for k, v in zip(("dw1", "db1", "dw2"), t[1:]):
        np.testing.assert_allclose(got[k], v.grad.numpy(), rtol=1e-5, atol=1e-6)
    pn = p.detach().numpy()
    gz = pn * (np.array([1.0, -2.0]) - (pn * np.array([1.0, -2.0])).sum(-1, keepdims=True))
    np.testing.assert_allclose(got["dw2_other"], np.full((4, 5), 0.5).T @ gz, rtol=1e-5, atol=1e-6)


def test_grads_provided_and_required_may_be_any_tensors_of_the_graph():
    """Gradient given for an intermediate (h = tanh(u), u = x @ w), gradients asked for an
    intermediate (u) and an input (w), in that order."""
    G = RNG.normal(size=(4, 5)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        names = {}

        def f(x, w):
            names["u"] = x @ w
            names["h"] = ops.tanh(names["u"])
            return ops.sum(names["h"])

        fwd = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((3, 5), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd, grads_provided=[names["h"]],
                                        grads_required=[names["u"], fwd.inputs[1]])
        assert bwd.expected_inputs[0].fwd_tensor is names["h"]
        assert [e.fwd_tensor for e in bwd.expected_outputs] == [names["u"], fwd.inputs[1]]
        assert names["h"] in fwd.outputs            # tanh's grad reads its output
        x = popxl.variable(X, name="x")
        info = ops.call_with_info(fwd, x, popxl.variable(W1, name="w"))
        du, dw = ops.call(bwd.graph, popxl.constant(G), inputs_dict=bwd.inputs_dict(info))
    got = store_and_run(ir, {"du": du, "dw": dw})
    h = np.tanh(X @ W1)
    want_du = G * (1 - h * h)
    np.testing.assert_allclose(got["du"], want_du, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["dw"], X.T @ want_du, rtol=1e-5, atol=1e-6)


def test_collective_grad_graph_called_with_gradients_and_saved_activations():
    """Replication 2: y = replicated_all_reduce(x_r @ w), loss = sum(tanh(y)). The gradient
    graph, called with the loss gradient and the activations inputs_dict maps, gives
    dw_r = x_r^T (R (1 - tanh(y)^2)) (the all-reduce's gradient all-reduces the identical
    output gradients), as NumPy."""
    R = 2
    xr = RNG.normal(size=(R, 4, 3)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((4, 3), popxl.float32, "x")
        x = ops.host_load(xs)
        w = popxl.variable(W1, name="w")
        fwd = ir.create_graph(lambda a, b: ops.sum(ops.tanh(C.replicated_all_reduce(a @ b))),
                              popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((3, 5), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd, grads_required=[fwd.inputs[1]])
        info = ops.call_with_info(fwd, x, w)
        fwd_saved = [e.fwd_tensor for e in bwd.expected_inputs if e.connection_type == ECT.Fwd]
        assert fwd.inputs[0] in fwd_saved and fwd.inputs[1] not in fwd_saved   # the matmul reads x
        assert any(t in fwd.outputs[1:] for t in fwd_saved)                     # tanh's output
        (dw,) = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
    got = store_and_run(ir, {"loss": info.outputs[0], "dw": dw}, {xs: xr})
    y = sum(xr[r] @ W1 for r in range(R))
    gy = 1 - np.tanh(y) ** 2
    for r in range(R):
        np.testing.assert_allclose(got["loss"][r], np.tanh(y).sum(), rtol=1e-5)
        np.testing.assert_allclose(got["dw"][r], xr[r].T @ (R * gy), rtol=1e-5, atol=1e-5)


def test_call_site_info_signature_and_all_grad_graphs():
    assert list(inspect.signature(ops.CallSiteInfo).parameters) == ["subgraph_op"]
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a * a, popxl.TensorSpec((2,), popxl.float32))
        res = popxl.transforms.autodiff(g, return_all_grad_graphs=True)
        assert list(res) == [g] and res[g].forward_graph is g
        with pytest.raises(ValueError, match="not a tensor of graph"):
            popxl.transforms.autodiff(g, grads_required=[popxl.constant(1.0)])


def test_called_graphs_are_differentiated_and_called_not_recomputed():
    """A graph calling another twice: autodiff differentiates the callee too (its relu output
    becomes its output and the outer graph's), the outer gradient graph calls the callee's
    gradient graph; return_all_grad_graphs gives both, called_graphs_grad_info reuses one."""
    ir = popxl.Ir()
    with ir.main_graph:
        inner = ir.create_graph(lambda a, w: ops.relu(a @ w), popxl.TensorSpec((4, 3), popxl.float32),
                                popxl.TensorSpec((3, 3), popxl.float32))

        def outer(x, w):
            (h,) = ops.call(inner, x, w)
            (h2,) = ops.call(inner, h * 2.0, w)
            return ops.sum(h2 * h)

        fwd = ir.create_graph(outer, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((3, 3), popxl.float32))
        infos = popxl.transforms.autodiff(fwd, return_all_grad_graphs=True)
        assert set(infos) == {fwd, inner}
        bwd, inner_bwd = infos[fwd], infos[inner]
        called = [n.attrs["callee"] for n in bwd.graph._g.nodes if n.op_type == "Call"]
        assert called == [inner_bwd.graph._g] * 2
        assert {n.op_type for n in bwd.graph._g.nodes} <= {"OpVJP", "Sum", "Call"}
        assert {n.op_type for n in inner_bwd.graph._g.nodes} <= {"OpVJP", "Sum"}
        again = popxl.transforms.autodiff(fwd, called_graphs_grad_info={inner: inner_bwd})
        assert [n.attrs["callee"] for n in again.graph._g.nodes if n.op_type == "Call"] == called
        Xs, Ws = X, RNG.normal(size=(3, 3)).astype(np.float32)
        x, w = popxl.variable(Xs, name="x"), popxl.variable(Ws, name="w")
        info = ops.call_with_info(fwd, x, w)
        ginfo = ops.call_with_info(bwd.graph, 1.0, inputs_dict=bwd.inputs_dict(info))
        grads = bwd.fwd_parent_ins_to_grad_parent_outs(info, ginfo)
    got = store_and_run(ir, {"loss": info.outputs[0], "dx": grads[x], "dw": grads[w]})
    tx, tw = torch.tensor(Xs, requires_grad=True), torch.tensor(Ws, requires_grad=True)
    th = torch.relu(tx @ tw)
    loss = (torch.relu((th * 2.0) @ tw) * th).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["dw"], tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_defaults_and_graphs_that_cannot_get_outputs():
    """PopXL's defaults: every input required (the int labels and an unused input have no
    gradient: PopART's error), every output provided, in order, even one that leads to no
    required gradient; called graphs get PopART's nullopt defaults. A graph that repeat
    already calls gets no outputs: its gradient graph recomputes what its grad ops read
    (PopART's SafeAddFwdOutputStitcher falls back to the RecomputeStitcher)."""
    from popart import popart_exception
    ir = popxl.Ir()
    with ir.main_graph:
        def f(x, labels, unused):
            return ops.nll_loss(ops.softmax(ops.tanh(x), axis=-1), labels), unused * 2.0

        g = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((4,), popxl.int32),
                            popxl.TensorSpec((2,), popxl.float32))
        with pytest.raises(popart_exception, match=r"Unable to provide required gradient output for "
                                                   r"fwd id '\S*labels'"):
            popxl.transforms.autodiff(g)
        info = popxl.transforms.autodiff(g, grads_required=[g.inputs[0]])
        assert [e.fwd_tensor for e in info.expected_outputs] == [g.inputs[0]]
        assert [e.fwd_tensor for e in info.expected_inputs[:2]] == list(g.outputs[:2])
        assert [e.connection_type for e in info.expected_inputs[:2]] == [ECT.FwdGrad] * 2
        assert g.inputs[1] in info.inputs          # NllGrad reads the labels
        both = popxl.transforms.autodiff(g, grads_required=[g.inputs[2], g.inputs[0]])
        assert [e.fwd_tensor for e in both.expected_outputs] == [g.inputs[2], g.inputs[0]]
        r = ir.create_graph(lambda a: ops.sigmoid(ops.tanh(a)) * 1.0, popxl.TensorSpec((2,), popxl.float32))
        ops.repeat(r, 2, popxl.constant(np.zeros(2, np.float32)))
        rinfo = popxl.transforms.autodiff(r)
        assert len(r.outputs) == 1      # not stitched: the repeat's loop body calls it
        assert all(t in r.inputs or t in r.outputs for t in rinfo.inputs)
        assert {"Tanh", "Sigmoid"} <= {n.op_type for n in rinfo.graph._g.nodes}   # recomputed


def test_required_gradient_without_a_path_raises_popart_error():
    """PopART's BackwardsGraphCreatorHelper: a tensor in grads_required that no gradient
    reaches (an int input, an input read only through a non-differentiable op, an unused
    one) raises "[Autodiff] Unable to provide required gradient output"; the forward graph
    is left as it was."""
    from popart import popart_exception
    ir = popxl.Ir()
    with ir.main_graph:
        def f(x, w, labels, unused):
            return ops.sum(ops.tanh(x) * ops.cast(ops.argmax(w, 0), popxl.float32)) + \
                ops.cast(ops.sum(labels), popxl.float32)

        g = ir.create_graph(f, popxl.TensorSpec((3,), popxl.float32), popxl.TensorSpec((2, 3), popxl.float32),
                            popxl.TensorSpec((3,), popxl.int32), popxl.TensorSpec((3,), popxl.float32))
        x, w, labels, unused = g.inputs
        n_out = len(g.outputs)
        for t in (w, labels, unused):
            with pytest.raises(popart_exception, match=rf"\[Autodiff\] Unable to provide required gradient "
                                                       rf"output for fwd id '{t.id}' in bwd graph subgraph "):
                popxl.transforms.autodiff(g, grads_required=[x, t])
        assert len(g.outputs) == n_out
        info = popxl.transforms.autodiff(g, grads_required=[x])
        assert [e.fwd_tensor for e in info.expected_outputs] == [x]


def test_conditional_is_differentiated_through_its_branches_gradient_graphs():
    """A conditional inside the differentiated graph (PopART's IfGradOp): its gradient is a
    conditional on the same condition calling the branches' gradient graphs; the branches
    get no new outputs (the If can expose none), their grad graphs recompute what their grad
    ops read (tanh's output), as PopART's SafeAddFwdOutputStitcher. Checked for both
    conditions against PyTorch, with an input the else branch does not read (zeros there)."""
    XV = np.array([0.1, -0.5, 2.0], np.float32)
    WV = np.array([0.3, 1.2, -0.7], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        spec = popxl.TensorSpec((3,), popxl.float32)
        then_g = ir.create_graph(lambda a, b: ops.tanh(a * b) * 2.0, spec, spec)
        else_g = ir.create_graph(lambda a: ops.sigmoid(a), spec)

        def f(x, w, c):
            (y,) = ops.conditional(c, then_g, else_g, [x * 3.0, w], [x])
            return ops.sum(y * x)

        g = ir.create_graph(f, spec, spec, popxl.TensorSpec((), popxl.bool))
        infos = popxl.transforms.autodiff(g, grads_required=g.inputs[:2], return_all_grad_graphs=True)
        assert set(infos) == {g, then_g, else_g}
        assert len(then_g.outputs) == 1 and len(else_g.outputs) == 1
        assert "Tanh" in {n.op_type for n in infos[then_g].graph._g.nodes}     # recomputed
        info = infos[g]
        assert [n.op_type for n in info.graph._g.nodes].count("If") == 1
        assert g.inputs[2] in info.inputs                                       # the condition
        x, w = popxl.variable(XV, name="x"), popxl.variable(WV, name="w")
        grads = {}
        for cv in (True, False):
            fi = ops.call_with_info(g, x, w, popxl.constant(np.array(cv)))
            grads[cv] = ops.call(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
    got = store_and_run(ir, {f"{k}{cv}": grads[cv][i] for cv in (True, False) for i, k in enumerate(("dx", "dw"))})
    for cv in (True, False):
        tx, tw = torch.tensor(XV, requires_grad=True), torch.tensor(WV, requires_grad=True)
        y = torch.tanh(tx * 3.0 * tw) * 2.0 if cv else torch.sigmoid(tx)
        (y * tx).sum().backward()
        # (TanhGrad's 1 - y^2 from the float32 output: saturated tanh loses digits)
        np.testing.assert_allclose(got[f"dx{cv}"], tx.grad.numpy(), rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(got[f"dw{cv}"], np.zeros(3) if tw.grad is None else tw.grad.numpy(),
                                   rtol=1e-5, atol=2e-5)


def test_repeat_saves_each_iteration_and_repeats_the_body_gradient_graph():
    """A repeat inside the differentiated graph: the Loop saves each iteration's carried value
    and the body's output (stacked, [3, 2, 3]) for the body's gradient graph, which a repeat in
    the gradient graph calls for iterations 2, 1, 0 (the forward loop does not run again);
    the gradient of the weight every iteration reads is summed. PyTorch's gradients."""
    XV = RNG.normal(size=(2, 3)).astype(np.float32)
    WV = (RNG.normal(size=(3, 3)) * 0.5).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        body = ir.create_graph(lambda h, w: ops.tanh(h @ w) * 1.5, popxl.TensorSpec((2, 3), popxl.float32),
                               popxl.TensorSpec((3, 3), popxl.float32))

        def f(x, w):
            (y,) = ops.repeat(body, 3, x, w)
            return ops.sum(y * y)

        g = ir.create_graph(f, popxl.TensorSpec((2, 3), popxl.float32), popxl.TensorSpec((3, 3), popxl.float32))
        infos = popxl.transforms.autodiff(g, return_all_grad_graphs=True)
        info = infos[g]
        assert len(body.outputs) == 1
        assert sorted(t.shape for t in info.inputs if t.shape[:1] == (3,) and len(t.shape) == 3) == [(3, 2, 3)] * 2
        assert [n.op_type for n in info.graph._g.nodes].count("Loop") == 1
        assert not any(n.op_type == "OpVJP" and n.attrs["fwd"].nodes[0].op_type == "Loop"
                       for n in info.graph._g.nodes)
        x, w = popxl.variable(XV, name="x"), popxl.variable(WV, name="w")
        fi = ops.call_with_info(g, x, w)
        gi = ops.call_with_info(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
        grads = info.fwd_parent_ins_to_grad_parent_outs(fi, gi)
    got = store_and_run(ir, {"loss": fi.outputs[0], "dx": grads[x], "dw": grads[w]})
    tx, tw = torch.tensor(XV, requires_grad=True), torch.tensor(WV, requires_grad=True)
    h = tx
    for _ in range(3):
        h = torch.tanh(h @ tw) * 1.5
    loss = (h * h).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["dw"], tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_grad_ops_take_their_forward_ops_placement():
    """PopART builds each grad op with its forward op's settings: the grad ops of ops built on
    IPU 1 / on IO tiles are there, whatever placement is active when autodiff is called;
    the numbers are unchanged (NumPy)."""
    XV = RNG.normal(size=(2, 3)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        def f(x, w):
            with popxl.ipu(1):
                h = ops.tanh(x @ w)
            with popxl.io_tiles():
                y = h * 2.0
            return ops.sum(y)

        g = ir.create_graph(f, popxl.TensorSpec((2, 3), popxl.float32), popxl.TensorSpec((3, 3), popxl.float32))
        with popxl.ipu(0):
            info = popxl.transforms.autodiff(g)
        placed = {n.name.split("/")[-1]: n.annotations for n in info.graph._g.nodes}
        assert placed["tanh_grad"].get("__ipu_number") == 1 and placed["matmul_grad"].get("__ipu_number") == 1
        assert placed["mul_grad"].get("__io_tiles") == 1 and "__ipu_number" not in placed["mul_grad"]
        assert "__ipu_number" not in placed["reducesum_grad"]
        x, w = popxl.variable(XV, name="x"), popxl.variable(W1.T[:3, :3].copy(), name="w")
        fi = ops.call_with_info(g, x, w)
        gi = ops.call_with_info(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
    got = store_and_run(ir, {"dx": gi.outputs[0], "dw": gi.outputs[1]})
    wv = W1.T[:3, :3]
    gz = 2.0 * (1 - np.tanh(XV @ wv) ** 2)
    np.testing.assert_allclose(got["dx"], gz @ wv.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["dw"], XV.T @ gz, rtol=1e-5, atol=1e-6)


def test_saved_activations_follow_popart_grad_input_info():
    """GRAD_READS from each grad op's gradInputInfo(): GroupNormGradOp reads x, scale and the
    saved mean / inv std (not the bias, not y); GatherGradOp only the indices; ClipGradOp only
    the clipped output; DivArg0GradOp both inputs and the output. PyTorch's gradients."""
    XV = RNG.normal(size=(4, 3)).astype(np.float32)
    SV, BV = RNG.normal(size=3).astype(np.float32), RNG.normal(size=3).astype(np.float32)
    DV = (RNG.uniform(size=(2, 3)) + 0.5).astype(np.float32)
    IV = np.array([3, 1], np.int32)
    ir = popxl.Ir()
    with ir.main_graph:
        names = {}

        def f(x, s, b, d, idx):
            names["h"] = ops.group_norm(x, s, b, 1)
            names["g"] = ops.gather(names["h"], idx)
            names["c"] = ops.clip(names["g"], -0.5, 0.5)
            names["q"] = names["c"] / d
            return ops.sum(names["q"])

        g = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((3,), popxl.float32),
                            popxl.TensorSpec((3,), popxl.float32), popxl.TensorSpec((2, 3), popxl.float32),
                            popxl.TensorSpec((2,), popxl.int32))
        info = popxl.transforms.autodiff(g, grads_required=g.inputs[:4])
        x, s, b, d, idx = g.inputs
        read = set(info.inputs[1:])
        assert {x, s, d, idx, names["c"], names["q"]} <= read
        assert not {b, names["h"], names["g"]} & read
        gn = next(n for n in g._g.nodes if n.op_type == "GroupNormalization")
        assert {t._ir_id for t in read if t not in g.inputs} == {*gn.outputs[1:], names["c"]._ir_id,
                                                                  names["q"]._ir_id}
        vs = [popxl.variable(v, name=k) for k, v in (("x", XV), ("s", SV), ("b", BV), ("d", DV), ("i", IV))]
        fi = ops.call_with_info(g, *vs)
        gi = ops.call_with_info(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
    got = store_and_run(ir, {k: gi.outputs[i] for i, k in enumerate(("dx", "ds", "db", "dd"))})
    t = [torch.tensor(v, requires_grad=True) for v in (XV, SV, BV, DV)]
    h = torch.nn.functional.group_norm(t[0], 1, t[1], t[2], eps=1e-5)
    (torch.clamp(h[torch.tensor(IV, dtype=torch.long)], -0.5, 0.5) / t[3]).sum().backward()
    for k, v in zip(("dx", "ds", "db", "dd"), t):
        np.testing.assert_allclose(got[k], v.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_grads_from_outputs_and_indices_read_no_inputs():
    """TopKGradOp and ReduceMedianGradOp read only the indices output, ReduceLogSumGradOp only its output,
    ScatterReduceGradOp (sum) only the indices: their (intermediate) inputs are not saved.
    PyTorch's gradients."""
    XV = RNG.normal(size=(4, 3)).astype(np.float32)
    IV = np.array([1, 0, 1, 1], np.int32)
    ir = popxl.Ir()
    with ir.main_graph:
        names = {}

        def f(x, idx):
            names["t"], names["p"], names["u"] = x + 1.0, x * x + 1.0, x - 1.0
            v, names["i"] = ops.topk(names["t"], 2, axis=1)
            names["ls"] = ops.logsum(names["p"], axis=1)
            sr = ops.scatter_reduce(names["u"], idx, "sum", axis_size=2)
            names["m"] = ops.negate(x)
            md = ops.median(names["m"], axis=0)
            return ops.sum(v * v) + ops.sum(names["ls"]) + ops.sum(sr * sr) + ops.sum(md * md)

        g = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((4,), popxl.int32))
        info = popxl.transforms.autodiff(g, grads_required=[g.inputs[0]])
        read = {t._ir_id for t in info.inputs[1:]}
        topk, med = (next(n for n in g._g.nodes if n.op_type == k) for k in ("TopK", "ReduceMedian"))
        assert {topk.outputs[1], med.outputs[1], names["ls"]._ir_id} <= read and g.inputs[1] in info.inputs
        assert not {names[k]._ir_id for k in "tpum"} & read
        fi = ops.call_with_info(g, popxl.variable(XV, name="x"), popxl.variable(IV, name="idx"))
        (dx,) = ops.call(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
    got = store_and_run(ir, {"loss": fi.outputs[0], "dx": dx})
    tx = torch.tensor(XV, requires_grad=True)
    v = torch.topk(tx + 1.0, 2, dim=1).values
    sr = torch.zeros(2, 3).index_add(0, torch.tensor(IV, dtype=torch.long), tx - 1.0)
    md = torch.median(-tx, dim=0).values      # (4 rows: the lower middle, as PopART's)
    loss = (v * v).sum() + torch.log((tx * tx + 1.0).sum(1)).sum() + (sr * sr).sum() + (md * md).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_max_min_grads_read_the_argument_and_the_output():
    """MaxArgGradOp / MinArgGradOp (NonLinearVariadicGradOp) read the argument whose gradient
    they give and the output: with only x required, the other argument w of max(tanh(x), w)
    is not saved; with w too it is. Broadcast w (3,) gets its gradient summed (PyTorch)."""
    XV = RNG.normal(size=(4, 3)).astype(np.float32)
    WV = np.array([-0.2, 0.1, 0.4], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        def f(x, w):
            return ops.sum(ops.maximum(ops.tanh(x), w) * 2.0) + ops.sum(ops.minimum(x, w))

        g = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((3,), popxl.float32))
        info = popxl.transforms.autodiff(g)
        assert g.inputs[1] in info.inputs
        # (explicit: the default would be every output, now with those stitched above)
        x_only = popxl.transforms.autodiff(g, grads_provided=g.outputs[:1], grads_required=g.inputs[:1])
        assert g.inputs[1] not in x_only.inputs
        fi = ops.call_with_info(g, popxl.variable(XV, name="x"), popxl.variable(WV, name="w"))
        dx, dw = ops.call(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
        (dx_only,) = ops.call(x_only.graph, popxl.constant(1.0), inputs_dict=x_only.inputs_dict(fi))
    got = store_and_run(ir, {"dx": dx, "dw": dw, "dx_only": dx_only})
    tx, tw = torch.tensor(XV, requires_grad=True), torch.tensor(WV, requires_grad=True)
    ((torch.maximum(torch.tanh(tx), tw) * 2.0).sum() + torch.minimum(tx, tw).sum()).backward()
    for k, want in (("dx", tx.grad), ("dw", tw.grad), ("dx_only", tx.grad)):
        np.testing.assert_allclose(got[k], want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trips", [2, 0])
def test_repeat_with_int_carry_and_invariants_inside_a_called_graph(trips):
    """A repeat (carried h and an int counter, invariant w and b) inside a graph that another
    calls: w and b get the sum over iterations, the counter none; a repeat of 0 passes the
    output gradients through. PyTorch's gradients."""
    XV = RNG.normal(size=(2, 3)).astype(np.float32)
    WV, BV = (RNG.normal(size=(3, 3)) * 0.5).astype(np.float32), RNG.normal(size=3).astype(np.float32)
    specs = [popxl.TensorSpec((2, 3), popxl.float32), popxl.TensorSpec((3, 3), popxl.float32),
             popxl.TensorSpec((3,), popxl.float32)]
    ir = popxl.Ir()
    with ir.main_graph:
        body = ir.create_graph(lambda h, c, w, b: (ops.relu(h @ w + b), c + 1), specs[0],
                               popxl.TensorSpec((), popxl.int32), *specs[1:])
        inner = ir.create_graph(lambda x, w, b: ops.repeat(body, trips, x, popxl.constant(np.int32(0)), w, b)[0],
                                *specs)
        g = ir.create_graph(lambda x, w, b: ops.sum(ops.call(inner, x, w, b)[0] ** 2) + ops.sum(w), *specs)
        info = popxl.transforms.autodiff(g)
        vs = [popxl.variable(v, name=k) for k, v in (("x", XV), ("w", WV), ("b", BV))]
        fi = ops.call_with_info(g, *vs)
        grads = ops.call(info.graph, popxl.constant(1.0), inputs_dict=info.inputs_dict(fi))
    got = store_and_run(ir, dict(zip(("dx", "dw", "db"), grads)))
    t = [torch.tensor(v, requires_grad=True) for v in (XV, WV, BV)]
    h = t[0]
    for _ in range(trips):
        h = torch.relu(h @ t[1] + t[2])
    ((h ** 2).sum() + t[1].sum()).backward()
    for k, v in zip(("dx", "dw", "db"), t):
        want = np.zeros(v.shape) if v.grad is None else v.grad.numpy()
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5)


def test_conditional_of_a_repeat_of_a_call():
    """Nesting: a conditional whose then branch repeats a graph that calls another. Each level
    gets its gradient op (IfGradOp, the repeat's, CallGradOp); the called graph's tanh output
    (its output) is read by its gradient graph; nothing is stitched. PyTorch's gradients."""
    XV = RNG.normal(size=(2, 3)).astype(np.float32)
    WV = (RNG.normal(size=(3, 3)) * 0.5).astype(np.float32)
    S = [popxl.TensorSpec((2, 3), popxl.float32), popxl.TensorSpec((3, 3), popxl.float32)]
    ir = popxl.Ir()
    with ir.main_graph:
        inner = ir.create_graph(lambda h, w: ops.tanh(h @ w), *S)
        body = ir.create_graph(lambda h, w: ops.call(inner, h, w)[0] * 0.5 + h, *S)
        then_g = ir.create_graph(lambda a, w: ops.repeat(body, 2, a, w)[0], *S)
        else_g = ir.create_graph(lambda a: ops.sigmoid(a), S[0])

        def f(x, w, c):
            (y,) = ops.conditional(c, then_g, else_g, [x, w], [x])
            return ops.sum(y * y)

        g = ir.create_graph(f, *S, popxl.TensorSpec((), popxl.bool))
        infos = popxl.transforms.autodiff(g, grads_required=g.inputs[:2], return_all_grad_graphs=True)
        assert set(infos) == {g, then_g, else_g, body, inner}
        assert all(len(x.outputs) == 1 for x in (inner, body, then_g))
        assert inner.outputs[0] in infos[inner].inputs         # TanhGrad reads the output
        vs = [popxl.variable(v, name=k) for k, v in (("x", XV), ("w", WV))]
        grads = {}
        for cv in (True, False):
            fi = ops.call_with_info(g, *vs, popxl.constant(np.array(cv)))
            grads[cv] = ops.call(infos[g].graph, popxl.constant(1.0), inputs_dict=infos[g].inputs_dict(fi))
    got = store_and_run(ir, {f"{k}{cv}": grads[cv][i] for cv in (True, False) for i, k in enumerate(("dx", "dw"))})
    for cv in (True, False):
        t = [torch.tensor(v, requires_grad=True) for v in (XV, WV)]
        h = t[0]
        for _ in range(2 if cv else 0):
            h = torch.tanh(h @ t[1]) * 0.5 + h
        h = h if cv else torch.sigmoid(t[0])
        (h * h).sum().backward()
        for k, v in zip(("dx", "dw"), t):
            want = np.zeros(v.shape) if v.grad is None else v.grad.numpy()
            np.testing.assert_allclose(got[f"{k}{cv}"], want, rtol=1e-5, atol=1e-5)
