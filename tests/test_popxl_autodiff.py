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

RNG = np.random.default_rng(7)
X = RNG.normal(size=(4, 3)).astype(np.float32)
W1 = RNG.normal(size=(3, 5)).astype(np.float32)
B1 = RNG.normal(size=5).astype(np.float32)
W2 = RNG.normal(size=(5, 2)).astype(np.float32)


def _run(ir: popxl.Ir, tensors: dict) -> dict:
    """Store ``tensors`` (main-graph tensors) to host and run once."""
    with ir.main_graph:
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in tensors.items()}
        for k, t in tensors.items():
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run()
    return {k: out[st] for k, st in streams.items()}


class Linear(popxl.Module):
    def __init__(self) -> None:
        self.W = self.b = None

    def build(self, x: popxl.Tensor, out_features: int) -> popxl.Tensor:
        self.W = popxl.graph_input((x.shape[-1], out_features), popxl.float32, "W")
        self.b = popxl.graph_input((out_features,), popxl.float32, "b")
        return ops.relu(x @ self.W + self.b)


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
    got = _run(ir, {"y": y, **{k: grads[t] for k, t in (("dx", x), ("dW", W), ("db", b))}})
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
    got = _run(ir, {"dw1": g1[0], "db1": g1[1], "dw2": g1[2], "dw2_other": g2[2]})
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
    got = _run(ir, {"du": du, "dw": dw})
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
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in (("loss", info.outputs[0]), ("dw", dw))}
        ops.host_store(streams["loss"], info.outputs[0])
        ops.host_store(streams["dw"], dw)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run({xs: xr})
    y = sum(xr[r] @ W1 for r in range(R))
    gy = 1 - np.tanh(y) ** 2
    for r in range(R):
        np.testing.assert_allclose(out[streams["loss"]][r], np.tanh(y).sum(), rtol=1e-5)
        np.testing.assert_allclose(out[streams["dw"]][r], xr[r].T @ (R * gy), rtol=1e-5, atol=1e-5)


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
    got = _run(ir, {"loss": info.outputs[0], "dx": grads[x], "dw": grads[w]})
    tx, tw = torch.tensor(Xs, requires_grad=True), torch.tensor(Ws, requires_grad=True)
    th = torch.relu(tx @ tw)
    loss = (torch.relu((th * 2.0) @ tw) * th).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(got["dx"], tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["dw"], tw.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_defaults_and_graphs_that_cannot_get_outputs():
    """By default the gradients of the inputs that get one (not the int labels, not an unused
    input), from the outputs that lead to them; a graph that repeat already calls gets no
    outputs: its gradient graph recomputes what its grad ops read (PopART's
    SafeAddFwdOutputStitcher falls back to the RecomputeStitcher)."""
    ir = popxl.Ir()
    with ir.main_graph:
        def f(x, labels, unused):
            return ops.nll_loss(ops.softmax(ops.tanh(x), axis=-1), labels)

        g = ir.create_graph(f, popxl.TensorSpec((4, 3), popxl.float32), popxl.TensorSpec((4,), popxl.int32),
                            popxl.TensorSpec((2,), popxl.float32))
        info = popxl.transforms.autodiff(g)
        assert [e.fwd_tensor for e in info.expected_outputs] == [g.inputs[0]]
        assert info.expected_inputs[0].fwd_tensor is g.outputs[0]
        assert g.inputs[1] in info.inputs          # NllGrad reads the labels
        r = ir.create_graph(lambda a: ops.sigmoid(ops.tanh(a)) * 1.0, popxl.TensorSpec((2,), popxl.float32))
        ops.repeat(r, 2, popxl.constant(np.zeros(2, np.float32)))
        rinfo = popxl.transforms.autodiff(r)
        assert len(r.outputs) == 1      # not stitched: the repeat's loop body calls it
        assert all(t in r.inputs or t in r.outputs for t in rinfo.inputs)
        assert {"Tanh", "Sigmoid"} <= {n.op_type for n in rinfo.graph._g.nodes}   # recomputed
