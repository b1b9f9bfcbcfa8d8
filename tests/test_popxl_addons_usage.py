"""popxl-addons used as a user uses it (issue 34, item 3): Modules and NamedTensors, graphs bound
and called with info, autodiff (with accumulation, recomputation), TaskSession with its
checkpoints, InputStreams / OutputStreams, remote variables and replica-sharded variables, tensor
parallel with data parallel replica groupings, patterns and seed variables; every number against
NumPy. Skipped where popxl-addons cannot be imported (tests/helpers/addons.py); what each one
rests on of ours has a test that does not need popxl-addons, named in each test's docstring."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import popxl
import popxl.ops as ops

from helpers.addons import addons_or_skip

addons = addons_or_skip(module_level=True)
from popxl_addons.layers import Linear  # noqa: E402
from popxl_addons.ops.replicated_all_reduce_TP import (  # noqa: E402
    replicated_all_reduce_identical_grad_inputs, replicated_all_reduce_identical_inputs)
from popxl_addons.patterns import apply_pre_alias_patterns  # noqa: E402
from popxl_addons.rts import all_gather_replica_sharded_graph, reduce_replica_sharded_graph  # noqa: E402

F32 = popxl.float32
B, D, H, O = 6, 4, 8, 3
LR, STEPS = 0.1, 3


class MLP(addons.Module):
    """Linear -> relu -> Linear, sub-modules named as attributes (fc1.weight, fc2.bias, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = Linear(H), Linear(O)

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        return self.fc2(ops.relu(self.fc1(x)))


def mlp_numpy(w, x, y):
    """loss = mean((mlp(x) - y)^2) and its gradients by hand."""
    h = x @ w["fc1.weight"] + w["fc1.bias"]
    a = np.maximum(h, 0)
    out = a @ w["fc2.weight"] + w["fc2.bias"]
    d = out - y
    dout = 2 * d / d.size
    da = dout @ w["fc2.weight"].T
    dh = da * (h > 0)
    grads = {"fc2.weight": a.T @ dout, "fc2.bias": dout.sum(0),
             "fc1.weight": x.T @ dh, "fc1.bias": dh.sum(0)}
    return float(np.mean(d * d)), grads


@pytest.fixture(scope="module")
def sgd_session():
    """A TaskSession training the MLP with SGD: streams from InputStreams / OutputStreams, the
    forward graph bound to its variables and called with info, addons.autodiff's gradient graph
    called with the activations its GradGraphInfo asks for."""
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        ins = addons.InputStreams(x=((B, D), F32), y=((B, O), F32))
        outs = addons.OutputStreams(loss=((), F32))
        facts, fwd = MLP().create_graph(popxl.TensorSpec((B, D), F32))
        variables = facts.init()
        bwd = addons.autodiff(fwd, grads_required=fwd.args.tensors)
        x, y = ops.host_load(ins.x), ops.host_load(ins.y)
        info = fwd.bind(variables).call_with_info(x)
        diff = info.outputs[0] - y
        binfo = bwd.call_with_info(diff * (2.0 / diff.nelms),
                                   args=bwd.grad_graph_info.inputs_dict(info))
        grad_of = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, binfo)
        for v in variables.tensors:
            ops.scaled_add_(v, grad_of[v], b=-LR)
        ops.host_store(outs.loss, ops.mean(diff * diff))
    session = addons.TaskSession(ins, outs, variables, ir=ir, device_desc="ipu_model")
    return session, ins, outs, facts


def test_module_variables_and_sgd_steps_equal_numpy(sgd_session):
    """Module / NamedVariableFactories / NamedTensors names, bind + call_with_info,
    addons.autodiff, TaskSession.run and get_named_tensors_data, against NumPy SGD.
    Ours without popxl-addons: tests/test_internal_ir.py (the binding calls), tests/test_popxl_autodiff.py."""
    session, ins, outs, facts = sgd_session
    assert sorted(facts.to_dict()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    w = {k: np.array(v) for k, v in session.get_named_tensors_data().to_dict().items()}
    assert w["fc1.weight"].shape == (D, H) and not np.any(w["fc2.bias"])
    rng = np.random.default_rng(1)
    xs, ys = rng.normal(size=(STEPS, B, D)), rng.normal(size=(STEPS, B, O))
    with session:
        for step in range(STEPS):
            got = session.run({ins.x: xs[step].astype(np.float32), ins.y: ys[step].astype(np.float32)})
            loss, grads = mlp_numpy(w, xs[step], ys[step])
            np.testing.assert_allclose(got[outs.loss], loss, rtol=1e-5)
            w = {k: w[k] - LR * grads[k] for k in w}
    assert session.session_state["steps"] == STEPS
    for k, v in session.get_named_tensors_data().to_dict().items():
        np.testing.assert_allclose(v, w[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_task_session_checkpoint_save_and_load(sgd_session, tmp_path):
    """save_checkpoint writes each variable (model/<name>.npz) and the session state; other
    values written over the variables, load_checkpoint restores both.
    Ours: Session.get_tensors_data / write_variables_data (tests/test_popxl_placement.py)."""
    session, *_ = sgd_session
    saved = {k: np.array(v) for k, v in session.get_named_tensors_data().to_dict().items()}
    session.add_session_state_info({"note": "h10"})
    ckpt = str(tmp_path / "ckpt")
    session.save_checkpoint(ckpt)
    files = sorted(os.listdir(os.path.join(ckpt, "model")))
    assert files == [f"{k}.npz" for k in sorted(saved)]
    np.testing.assert_array_equal(np.load(os.path.join(ckpt, "model", "fc1.weight.npz"))["fc1.weight"],
                                  saved["fc1.weight"])
    state = json.load(open(os.path.join(ckpt, "session_info.json")))
    session.write_variables_data({t: np.zeros(t.shape, np.float32) for t in session.state.tensors})
    session.session_state = {"steps": 0}
    assert not np.any(session.get_named_tensors_data().to_dict()["fc1.weight"])
    session.load_checkpoint(ckpt)
    assert session.session_state == state and state["note"] == "h10"
    for k, v in session.get_named_tensors_data().to_dict().items():
        np.testing.assert_array_equal(v, saved[k], err_msg=k)


def test_autodiff_with_accumulation_and_recompute():
    """autodiff_with_accumulation's running means (accum.*, mean_accum_counter, by reference)
    over 3 micro-batches, through recompute_graph (the forward called again in the gradient
    graph), against NumPy's mean of the gradients.
    Ours: tests/test_popxl_autodiff.py (GradGraphInfo.inputs_dict, expected connections),
    tests/test_internal_ir.py (removeOutput, BwdGraphInfo, GradGraphInfo._from_pb)."""
    K = 3
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        ins = addons.InputStreams(**{f"x{k}": ((B, D), F32) for k in range(K)},
                                  **{f"g{k}": ((B, O), F32) for k in range(K)})
        facts, fwd = Linear(O).create_graph(popxl.TensorSpec((B, D), F32))
        acc_facts, bwd = addons.autodiff_with_accumulation(fwd, fwd.args.tensors)
        rbwd = addons.recompute_graph(bwd)
        variables, accum = facts.init(), acc_facts.init()
        layer, grad = fwd.bind(variables), rbwd.bind(accum)
        for k in range(K):
            info = layer.call_with_info(ops.host_load(ins[f"x{k}"]))
            grad.call(ops.host_load(ins[f"g{k}"]), args=rbwd.grad_graph_info.inputs_dict(info))
    assert sorted(acc_facts.to_dict()) == ["accum.bias", "accum.weight", "mean_accum_counter"]
    assert "Call" in {op.opType() for op in rbwd.graph._pb_graph.getOps()}   # the recomputation
    assert len(bwd.graph.outputs) == 0   # the accumulated gradients' outputs removed
    rng = np.random.default_rng(2)
    data = {s: rng.normal(size=s.shape).astype(np.float32) for s in ins}
    with popxl.Session(ir, "ipu_model") as s:
        w = s.get_tensor_data(variables.weight)
        s.run(data)
        got = {k: s.get_tensor_data(t) for k, t in accum.to_dict().items()}
    xs, gs = ([data[ins[f"{c}{k}"]] for k in range(K)] for c in "xg")
    assert got["mean_accum_counter"] == K
    np.testing.assert_allclose(got["accum.weight"], np.mean([x.T @ g for x, g in zip(xs, gs)], 0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["accum.bias"], np.mean([g.sum(0) for g in gs], 0), rtol=1e-5)
    assert w.shape == (D, O)


def test_remote_replica_sharded_variables_data_parallel():
    """Phased data-parallel training as the applications write it: two Linear layers' variables
    in one sharded remote buffer (named_variable_buffers, init_remote: RTS over 2 replicas),
    load_remote_graph, all_gather_replica_sharded_graph, forward and addons.autodiff per layer,
    reduce_replica_sharded_graph (the gradients' sum, reduce-scattered to this replica's shard),
    SGD on the shard, store_remote_graph. Outputs and new weights against NumPy.
    Ours: tests/test_popxl_placement_rts.py, tests/test_popxl_remote.py,
    tests/test_custom_ops.py (the strided collectives)."""
    R, L = 2, 2
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        ins = addons.InputStreams(x=((B, D), F32), g=((B, D), F32))
        outs = addons.OutputStreams(y=((B, D), F32))
        facts, fwd = Linear(D).create_graph(popxl.TensorSpec((B, D), F32))
        bwd = addons.autodiff(fwd)
        buffers = addons.named_variable_buffers(facts, entries=L)
        layers = [facts.init_remote(buffers, e, prefix=f"layer{e}") for e in range(L)]
        load, names = addons.load_remote_graph(buffers, L)
        store = addons.store_remote_graph(buffers, L)
        shards = [addons.NamedTensors.pack(names, load.call(e)) for e in range(L)]
        gather, gnames = all_gather_replica_sharded_graph(shards[0])
        h, infos = ops.host_load(ins.x), []
        for e in range(L):
            full = addons.NamedTensors.pack(gnames, gather.bind(shards[e]).call())
            infos.append((h, full, fwd.bind(full).call_with_info(h)))
            h = infos[-1][2].outputs[0]
        ops.host_store(outs.y, h)
        dy = ops.host_load(ins.g)
        for e in reversed(range(L)):
            h_in, full, info = infos[e]
            binfo = bwd.call_with_info(dy, args=bwd.grad_graph_info.inputs_dict(info))
            grad_of = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, binfo)
            dy = grad_of[h_in]
            grads = addons.NamedTensors.from_dict({k: grad_of[t] for k, t in full.to_dict().items()})
            reduce, rnames = reduce_replica_sharded_graph(grads, "add")
            summed = dict(zip(rnames, reduce.bind(grads).call()))
            new = {k: t - LR * summed[k] for k, t in shards[e].to_dict().items()}
            store.bind(addons.NamedTensors.from_dict(new)).call(e)
    assert buffers.weight.meta_shape == (D, D) and buffers.weight.tensor_shape == (D * D // R,)
    rng = np.random.default_rng(3)
    x, g = (rng.normal(size=(R, B, D)).astype(np.float32) for _ in range(2))
    with popxl.Session(ir, "ipu_model") as s:
        w = [{k: np.array(s.get_tensor_data(t)) for k, t in lay.to_dict().items()} for lay in layers]
        got = s.run({ins.x: x, ins.g: g})
        new = [{k: s.get_tensor_data(t) for k, t in lay.to_dict().items()} for lay in layers]
    acts = [x]
    for e in range(L):
        acts.append(acts[-1] @ w[e]["weight"] + w[e]["bias"])
    np.testing.assert_allclose(got[outs.y], acts[-1], rtol=1e-5, atol=1e-6)
    dy = g
    for e in reversed(range(L)):
        ref = {"weight": np.einsum("rbi,rbo->io", acts[e], dy), "bias": dy.sum((0, 1))}
        dy = dy @ w[e]["weight"].T
        for k in ref:
            np.testing.assert_allclose(new[e][k], w[e][k] - LR * ref[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"layer{e}.{k}")


class TPMLP(addons.Module):
    """Megatron-style MLP over a tensor-parallel group: the input all-reduced in the backward
    only, a column-parallel Linear, relu, a row-parallel Linear, its output all-reduced in
    the forward only; each rank's shards are variables of replica grouping ``shards`` (equal
    across the data-parallel replicas, one value per tensor-parallel rank)."""

    def __init__(self, tp: popxl.ReplicaGrouping, shards: popxl.ReplicaGrouping, n: int) -> None:
        super().__init__()
        self.tp = tp
        self.fc1 = Linear(H // n, replica_grouping=shards)
        self.fc2 = Linear(O, bias=False, replica_grouping=shards)

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        x = replicated_all_reduce_identical_inputs(x, group=self.tp)
        z = self.fc2(ops.relu(self.fc1(x)))
        return replicated_all_reduce_identical_grad_inputs(z, group=self.tp)


def create_seeds_numpy(seed: int, replicas: int) -> np.ndarray:
    """PopXL's create_seeds: uint64 draws of NumPy's default_rng(seed), each as its
    (most, least) significant 32-bit words."""
    draws = np.random.default_rng(seed).integers(0, 2**64 - 1, endpoint=True, dtype="uint64",
                                                 size=replicas)
    return np.array([[int(v) >> 32, int(v) & 0xFFFFFFFF] for v in draws], np.uint32)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_with_data_parallel_replica_groupings(tp):
    """4 replicas as 2 tensor-parallel x 2 data-parallel: the variables' replica grouping
    (stride tp, groups of 4 / tp: one value per tensor-parallel rank), popxl-addons'
    all-reduces over the tensor-parallel group, apply_pre_alias_patterns (the identity sides
    become Identity), the gradients all-reduced over the data-parallel group, SGD; the loss and
    each rank's new shards against NumPy's unsharded model. seed_variable: one seed per
    replica, PopXL's create_seeds, and its draws distinct per replica.
    Ours: tests/test_popxl_tp_decoder.py (tensor parallel x data parallel without popxl-addons),
    tests/test_popxl_addons_interop.py (OpToIdentity through the binding), tests/test_custom_ops.py."""
    R = 4
    dp = R // tp
    ir = popxl.Ir(replication=R)
    tp_group = ir.replica_grouping(group_size=tp)
    shards = ir.replica_grouping(stride=tp, group_size=dp)
    with ir.main_graph, popxl.in_sequence():
        ins = addons.InputStreams(x=((B, D), F32), y=((B, O), F32))
        outs = addons.OutputStreams(loss=((), F32), u=((3,), F32))
        facts, fwd = TPMLP(tp_group, shards, tp).create_graph(popxl.TensorSpec((B, D), F32))
        variables = facts.init()
        bwd = addons.autodiff(fwd, grads_required=fwd.args.tensors)
        info = fwd.bind(variables).call_with_info(ops.host_load(ins.x))
        diff = info.outputs[0] - ops.host_load(ins.y)
        binfo = bwd.call_with_info(diff * (2.0 / diff.nelms),
                                   args=bwd.grad_graph_info.inputs_dict(info))
        grad_of = bwd.grad_graph_info.fwd_parent_ins_to_grad_parent_outs(info, binfo)
        for v in variables.tensors:
            g = ops.collectives.replicated_all_reduce(grad_of[v], group=shards)
            ops.scaled_add_(v, g, b=-LR)
        ops.host_store(outs.loss, ops.mean(diff * diff))
        seed_var, seed = addons.seed_variable(7)
        _, s1 = ops.split_random_seed(seed)
        ops.host_store(outs.u, ops.random_uniform(s1, (3,)))
    apply_pre_alias_patterns(ir, "default")
    op_types = [op.opType() for g in (fwd.graph, bwd.graph) for op in g._pb_graph.getOps()]
    # the forward's identity side and the grad op's; the input's gradient (an all-reduce) is
    # not required, so autodiff leaves it out
    assert op_types.count("Identity") == 2 and op_types.count("ReplicatedAllReduceTP") == 1
    rng = np.random.default_rng(4)
    xd, yd = rng.normal(size=(dp, B, D)), rng.normal(size=(dp, B, O))
    with popxl.Session(ir, "ipu_model") as s:
        w = {k: np.array(s.get_tensor_data(t)) for k, t in variables.to_dict().items()}
        seeds = s.get_tensor_data(seed_var)
        got = s.run({ins.x: np.repeat(xd, tp, 0).astype(np.float32),
                     ins.y: np.repeat(yd, tp, 0).astype(np.float32)})
        new = {k: s.get_tensor_data(t) for k, t in variables.to_dict().items()}
    assert w["fc1.weight"].shape == (tp, D, H // tp)       # one value per tensor-parallel rank
    full = {"fc1.weight": np.concatenate(list(w["fc1.weight"]), 1),
            "fc1.bias": np.concatenate(list(w["fc1.bias"]), 0),
            "fc2.weight": np.concatenate(list(w["fc2.weight"]), 0),
            "fc2.bias": np.zeros(O)}
    losses, grads = zip(*(mlp_numpy(full, xd[d], yd[d]) for d in range(dp)))
    np.testing.assert_allclose(got[outs.loss], np.repeat(losses, tp), rtol=1e-5)
    split = {"fc1.weight": (1, H // tp), "fc1.bias": (0, H // tp), "fc2.weight": (0, H // tp)}
    for k, (axis, n) in split.items():
        g = sum(gr[k] for gr in grads)
        ref = [w[k][t] - LR * np.take(g, range(t * n, (t + 1) * n), axis) for t in range(tp)]
        np.testing.assert_allclose(new[k], np.stack(ref), rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_array_equal(seeds, create_seeds_numpy(7, R))
    u = got[outs.u]
    assert u.shape == (R, 3) and np.all((u >= 0) & (u < 1)) and len({tuple(r) for r in u}) == R


@pytest.mark.parametrize("io_mode", ["compute", "io_overlapped"])
def test_batch_serialised_forward_and_gradient(io_mode):
    """Phased execution's batch serialisation (batch_serialise_fwd_and_grad): a Linear layer's
    forward and accumulated gradient repeated over 4 micro-batches from host streams, the
    activations the gradient reads kept in a remote buffer by the transform; io_overlapped
    interleaves the next batch's load with this one's compute. Outputs and gradient means
    against NumPy.
    Ours: tests/test_popxl_addons_interop.py (batch_serialise's remote buffer growth, the
    pipelining transform), tests/test_popxl_remote.py, tests/test_popxl_context.py (io tiles),
    tests/test_internal_ir.py (getSessionOptions)."""
    from popxl.transforms.autodiff import ExpectedConnectionType
    from popxl_addons.transforms.batch_serialisation import batch_serialise_fwd_and_grad
    steps = 4
    ir = popxl.Ir()
    ir._pb_ir.getSessionOptions().numIOTiles = 32   # as the applications set them
    with ir.main_graph, popxl.in_sequence():
        xs, dys = popxl.h2d_stream((B, D), F32, "x"), popxl.h2d_stream((B, O), F32, "dy")
        ys = popxl.d2h_stream((B, O), F32, "y")
        facts, fwd = Linear(O).create_graph(popxl.TensorSpec((B, D), F32))
        acc_facts, bwd = addons.autodiff_with_accumulation(fwd, fwd.args.tensors)
        (dy_in,) = [bwd.graph.inputs[i] for i, ec in enumerate(bwd.grad_graph_info.expected_inputs)
                    if ec.connection_type == ExpectedConnectionType.FwdGrad]
        fwd_bs, bwd_bs = batch_serialise_fwd_and_grad(
            fwd, bwd, fwd.args, steps, {fwd.graph.inputs[0]: xs, dy_in: dys},
            {fwd.graph.outputs[0]: ys}, {}, io_mode=io_mode)
        variables, accum = facts.init(), acc_facts.init()
        fwd_bs.graph.bind(variables).call(0)
        bwd_bs.graph.bind(addons.NamedTensors.from_dict(
            {**variables.to_dict(), **accum.to_dict()})).call(0)
    ir.num_host_transfers = steps
    rng = np.random.default_rng(5)
    x, dy = (rng.normal(size=(steps, B, n)).astype(np.float32) for n in (D, O))
    with popxl.Session(ir, "ipu_model") as s:
        w, b = (s.get_tensor_data(variables[k]) for k in ("weight", "bias"))
        y = s.run({xs: x, dys: dy})[ys]
        got = {k: s.get_tensor_data(t) for k, t in accum.to_dict().items()}
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["accum.weight"], np.einsum("kbi,kbo->io", x, dy) / steps,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["accum.bias"], dy.sum((0, 1)) / steps, rtol=1e-5, atol=1e-6)
    assert got["mean_accum_counter"] == steps


class ManualLinear(addons.Module):
    """A Module with its own gradient (build_grad, aux, var_grad), as in Module.create_grad_graph's
    documentation."""

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        rng = np.random.default_rng(6)
        w = self.add_variable_input("w", lambda: rng.normal(size=(D, O)).astype(np.float32), F32)
        b = self.add_variable_input("b", lambda: rng.normal(size=(O,)).astype(np.float32), F32)
        self.aux["x"], self.aux["w"] = x, w
        return x @ w + b

    def build_grad(self, dy: popxl.Tensor) -> popxl.Tensor:
        self.var_grad["b"] = ops.sum(dy, 0)
        self.var_grad["w"] = (dy.T @ self.aux["x"]).T
        return dy @ self.aux["w"].T


def test_build_grad_route_tensor_and_stream_helpers():
    """Module.build_grad through GraphWithNamedArgs.autodiff (the forward graph stitched with
    its aux outputs, a GradGraphInfo built from PopART's BwdGraphInfo); popxl_addons.ops'
    host_load / host_store; route_tensor_into_graph reaching a main-graph variable from a graph
    called inside a repeated graph after both call sites exist (the binding's call and loop ops
    get the new input, modified). Against NumPy.
    Ours: tests/test_internal_ir.py (connectInTensor, addModified, BwdGraphInfo),
    tests/test_popxl_addons_interop.py (the repeat's middle graph, addLoopInput)."""
    from popxl_addons.route_tensor import route_tensor_into_graph
    rng = np.random.default_rng(7)
    x, dy = rng.normal(size=(B, D)).astype(np.float32), rng.normal(size=(B, O)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        x_np, x_s, xt = addons.host_load(x, F32, "x")
        dy_np, dy_s, dyt = addons.host_load(dy, F32, "dy")
        facts, fwd = ManualLinear().create_graph(xt)
        bwd = fwd.autodiff()
        variables = facts.init()
        info = fwd.bind(variables).call_with_info(xt)
        dx, dw, db = bwd.call(dyt, args=bwd.grad_graph_info.inputs_dict(info))
        streams = [addons.host_store(t) for t in (info.outputs[0], dx, dw, db)]
        count = popxl.variable(np.float32(0), name="count")
        inner, body = ir.create_empty_graph("inner"), ir.create_empty_graph("body")
        ops.repeat(body, 3)
        with body:
            ops.call(inner)
        with inner:
            ops.var_updates.accumulate_(route_tensor_into_graph(count, modified=True),
                                        popxl.constant(np.float32(2)))
    with popxl.Session(ir, "ipu_model") as s:
        w, b = (s.get_tensor_data(variables[k]) for k in ("w", "b"))
        got = s.run({x_s: x_np, dy_s: dy_np})
        n = s.get_tensor_data(count)
    y, gdx, gdw, gdb = (got[st] for st in streams)
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gdx, dy @ w.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gdw, x.T @ dy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gdb, dy.sum(0), rtol=1e-5, atol=1e-6)
    assert n == 6


def test_adam_on_remote_replica_sharded_variables():
    """AdamOptimizerStep on replica-sharded remote state, as the phased applications train:
    the weight and Adam's moments (sharded, meta shape the full shape) and step in remote
    buffers (named_variable_buffers of the optimizer's own factories), each replica's gradient
    reduce-scattered to its shard (reduce_replica_sharded_tensor), the step on the shard, all
    stored back; two runs against NumPy's Adam on the full tensors.
    Ours: tests/test_popxl_placement_rts.py, tests/test_popxl_tp_decoder.py (Adam's rules)."""
    from popxl_addons.optimizers.adam import AdamOptimizerStep
    from popxl_addons.remote import load_remote, store_remote
    from popxl_addons.rts import reduce_replica_sharded_tensor
    R, lr, b1, b2, eps, wd = 2, 0.01, 0.9, 0.999, 1e-5, 0.01
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        gs = popxl.h2d_stream((D, O), F32, "grad")
        facts, _ = Linear(O, bias=False).create_graph(popxl.TensorSpec((B, D), F32))
        wbuf = addons.named_variable_buffers(facts)
        (weight,) = facts.init_remote(wbuf).tensors
        w = ops.remote_load(wbuf.weight, 0)
        g = reduce_replica_sharded_tensor(ops.host_load(gs))
        opt_facts, opt = AdamOptimizerStep().create_graph(
            w, g.spec, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
            first_order_dtype=F32)
        obuf = addons.named_variable_buffers(opt_facts, shard_over_dict={"step": 1})
        state = opt_facts.init_remote(obuf, prefix="adam")
        loaded = load_remote(obuf)
        opt.bind(loaded).call(w, g)
        ops.remote_store(wbuf.weight, 0, w)
        store_remote(obuf, loaded)
    assert w.meta_shape == (D, O) and g.shape == w.shape and obuf.first_order.meta_shape == (D, O)
    rng = np.random.default_rng(8)
    grads = rng.normal(size=(2, R, D, O)).astype(np.float32)
    with popxl.Session(ir, "ipu_model") as s:
        w0 = np.array(s.get_tensor_data(weight))
        for step in range(2):
            s.run({gs: grads[step]})
        got = s.get_tensor_data(weight)
        moments = {k: s.get_tensor_data(t) for k, t in state.to_dict().items()}
    ref, m, v = w0.astype(np.float64), 0.0, 0.0
    for t in (1, 2):
        gsum = grads[t - 1].sum(0)
        m, v = b1 * m + (1 - b1) * gsum, b2 * v + (1 - b2) * gsum ** 2
        upd = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * ref
        ref = ref - lr * upd
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moments["first_order"], m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(moments["second_order"], v, rtol=1e-5, atol=1e-7)
    assert moments["step"] == 2
