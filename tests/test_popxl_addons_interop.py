"""popxl-addons' reach into PopART's IR (issue 34): PopART's OpToIdentityPattern through
``Ir._pb_ir.applyPreAliasPatterns`` (the collectives with identicalInputs / identicalGradInputs
and PopART's other canBeReplacedByIdentity rules), checked against NumPy sums over replica
groups."""
from __future__ import annotations

import numpy as np
import pytest

import popart
import popart.testing
import popxl
import popxl.ops as ops
from popart._internal.ir import patterns as pb_patterns
from popart.custom_ops import ADDONS_DOMAIN
from popxl.ops._base import node

from helpers.custom_ops_ref import groups, member_sum

RNG = np.random.default_rng(34)
R = 2


def apply_patterns(ir: popxl.Ir, level=None) -> None:
    """popxl_addons.patterns.apply_pre_alias_patterns: set the level, run every graph."""
    if level is not None:
        ir._pb_ir.setPatterns(pb_patterns.Patterns(level))
    for g in ir._pb_ir.getAllGraphs():
        ir._pb_ir.applyPreAliasPatterns(g)


def tp_program(flag: str):
    """y = all_reduce_TP(x) with ``flag`` set, and dx from popxl's autodiff of it given dy."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        gs = popxl.h2d_stream((3,), popxl.float32, "g")
        x, g = ops.host_load(xs), ops.host_load(gs)
        fwd = ir.create_graph(lambda a: node("ReplicatedAllReduceTP", [a], {
            "op": "Add", "group": [R, 1, R], flag: 1}, domain=ADDONS_DOMAIN)[0], x)
        bwd = popxl.transforms.autodiff(fwd)
        (y,) = ops.call(fwd, x)
        (dx,) = ops.call(bwd.graph, g)
        out = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in (("y", y), ("dx", dx))}
        ops.host_store(out["y"], y)
        ops.host_store(out["dx"], dx)
    return ir, fwd, bwd.graph, (xs, gs), out


@pytest.mark.parametrize("flag", ["identicalInputs", "identicalGradInputs"])
def test_unpatterned_identical_collective_raises_popart_error(flag):
    """PopART's Opx of the op (or of its grad op, the same op with the flags swapped) refuses
    an op that OpToIdentityPattern should have replaced; Minimal patterns (popxl.Session's)
    do not hold OpToIdentity."""
    ir, *_ = tp_program(flag)
    apply_patterns(ir, pb_patterns.PatternsLevel.Minimal)
    with pytest.raises(popart.popart_exception,
                       match="You need to run the `OpToIdentityPattern` pattern before running the IR."):
        popxl.Session(ir, "ipu_model")


@pytest.mark.parametrize("flag", ["identicalInputs", "identicalGradInputs"])
def test_op_to_identity_on_identical_collectives(flag):
    """After the default patterns the identity side is an Identity op of the graph (the
    forward for identicalInputs, the grad op for identicalGradInputs) and the other side the
    group's sum."""
    ir, fwd, bwd, (xs, gs), out = tp_program(flag)
    apply_patterns(ir)
    types = [op.opType() for op in fwd._pb_graph.getOpSchedule()]
    grad_types = [op.opType() for op in bwd._pb_graph.getOpSchedule()]
    ii = flag == "identicalInputs"
    assert ("Identity" in types) == ii and ("Identity" in grad_types) == (not ii)
    x, g = (RNG.normal(size=(R, 3)).astype(np.float32) for _ in range(2))
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run({xs: x, gs: g})
    sums = groups(R, 1, R)
    np.testing.assert_allclose(got[out["y"]], x if ii else member_sum(x, sums), rtol=1e-6)
    np.testing.assert_allclose(got[out["dx"]], member_sum(g, sums) if ii else g, rtol=1e-6)


def test_op_to_identity_rules_of_popart_ops():
    """PopART's canBeReplacedByIdentity: a reshape to its own shape, a sorted transpose, a
    scale by 1, a one-input concat / sum, a cast to its own type become Identity; a real
    reshape or scale stays. The values are unchanged."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((2, 3), popxl.float32, "x")
        x = ops.host_load(xs)
        y = ops.reshape(x, (2, 3))
        y = ops.transpose(y, (0, 1))
        y = ops.scale(y, 1.0)
        y = ops.concat([y], 0)
        y = ops.cast(y, popxl.float32)
        z = ops.reshape(ops.mul(y, popxl.constant(2.0)), (3, 2))
        out = popxl.d2h_stream(z.shape, z.dtype, "z")
        ops.host_store(out, z)
    main = ir.main_graph._pb_graph
    before = [op.opType() for op in main.getOpSchedule()]
    apply_patterns(ir)
    after = [op.opType() for op in main.getOpSchedule()]
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == "Identity" for _, a in changed)
    assert {b for b, _ in changed} >= {"Reshape", "Transpose", "Scale", "Concat", "Cast"}
    assert after.count("Reshape") == 1 and "Mul" in after
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    with popxl.Session(ir, "ipu_model") as s:
        np.testing.assert_allclose(s.run({xs: x})[out], (2 * x).reshape(3, 2), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Adam from popxl's var-update ops, as popxl-addons' AdamOptimizerStep composes them

def adam_numpy(w, grads, lr, b1, b2, eps, wd, m_dtype):
    """PopART's AccumulateOpx (MovingAverage / MovingAverageSquare: f * t + (1 - f) * g (* g),
    in the accumulator's type), AdamUpdaterOpx (step += 1; corrections 1 - beta ** step in
    float32 cast to each moment's type; mhat / (sqrt(vhat) + eps) in the second moment's type;
    + wd * w in the weight's) and ScaledAdd (w - lr * updater), op by op in NumPy."""
    f32 = np.float32
    m, v, step = np.zeros(w.shape, m_dtype), np.zeros(w.shape, f32), f32(0)
    for g in grads:
        gm = g.astype(m_dtype)
        m = (m_dtype(b1) * m + m_dtype(1 - b1) * gm).astype(m_dtype)
        v = (f32(b2) * v + f32(1 - b2) * g * g).astype(f32)
        step = step + f32(1)
        mhat = (m / m_dtype(f32(1) - f32(b1) ** step)).astype(m_dtype)
        vhat = v / (f32(1) - f32(b2) ** step)
        upd = mhat.astype(f32) / (np.sqrt(vhat) + f32(eps)) + f32(wd) * w
        w = (w - f32(lr) * upd).astype(f32)
    return w, m, v


@pytest.mark.parametrize("m_dtype", [np.float32, np.float16])
def test_adam_steps_equal_popart_formulas(m_dtype):
    """Two Adam steps (lr 2, weight decay 0.01; first moment float32 or float16, as
    popxl-addons' default) equal the op-by-op NumPy transcription; a float16 bias correction
    divides exactly (not by a half-precision reciprocal)."""
    lr, b1, b2, eps, wd = 2.0, 0.9, 0.999, 1e-5, 0.01
    rng = np.random.default_rng(4)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    grads = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(2)]
    ir = popxl.Ir()
    with ir.main_graph:
        gs = popxl.h2d_stream((3, 4), popxl.float32, "g")
        var = popxl.variable(w, popxl.float32)
        m = popxl.variable(np.zeros((3, 4)), popxl.dtype.as_dtype(m_dtype))
        v = popxl.variable(np.zeros((3, 4)), popxl.float32)
        step = popxl.variable(np.zeros(()), popxl.float32)
        g = ops.host_load(gs)
        ops.var_updates.accumulate_moving_average_(m, g, f=b1)
        ops.var_updates.accumulate_moving_average_square_(v, g, f=b2)
        upd = ops.var_updates.adam_updater(m, v, weight=var, weight_decay=wd, time_step=step,
                                           beta1=b1, beta2=b2, epsilon=eps)
        ops.scaled_add_(var, upd, b=-lr)
    with popxl.Session(ir, "ipu_model") as s:
        for x in grads:
            s.run({gs: x})
        got = s.get_tensors_data([var, m, v])
    ref_w, ref_m, ref_v = adam_numpy(w, grads, lr, b1, b2, eps, wd, m_dtype)
    np.testing.assert_allclose(got[m], ref_m, rtol=1e-5 if m_dtype == np.float32 else 1e-3)
    np.testing.assert_allclose(got[v], ref_v, rtol=1e-6)
    np.testing.assert_allclose(got[var], ref_w, rtol=1e-5, atol=1e-6)


def test_matmul_of_float32_and_float16_is_the_lhs_type():
    """MatMulOp::setup takes the lhs's type whatever the rhs's: float32 @ float16 is float32,
    float16 @ float32 float16; popxl's autodiff gives each operand's gradient in its type."""
    a = RNG.normal(size=(2, 3)).astype(np.float32)
    b = RNG.normal(size=(3, 4)).astype(np.float16)
    g = RNG.normal(size=(2, 4)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        at, bt, gt = (popxl.variable(x, popxl.dtype.as_dtype(x.dtype)) for x in (a, b, g))
        fwd = ir.create_graph(lambda x, y: ops.matmul(x, y), at, bt)
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, at, bt)
        y = info.outputs[0]
        da, db = ops.call(bwd.graph, gt, inputs_dict=bwd.inputs_dict(info))
        rev = ops.matmul(ops.transpose(bt), ops.transpose(at))
        outs = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in
                (("y", y), ("da", da), ("db", db), ("rev", rev))}
        for k, t in (("y", y), ("da", da), ("db", db), ("rev", rev)):
            ops.host_store(outs[k], t)
    assert (y.dtype, da.dtype, db.dtype, rev.dtype) == (popxl.float32, popxl.float32, popxl.float16,
                                                        popxl.float16)
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run()
    b32 = b.astype(np.float32)
    np.testing.assert_allclose(got[outs["y"]], a @ b32, rtol=1e-5)
    np.testing.assert_allclose(got[outs["da"]], g @ b32.T, rtol=1e-5)
    np.testing.assert_allclose(got[outs["db"]], (a.T @ g).astype(np.float16), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got[outs["rev"]], (b32.T @ a.T).astype(np.float16), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------
# PopXL's repeat structure, walked by popxl-addons' pipelining transform

@pytest.fixture(scope="module")
def addons():
    """popxl_addons as a user imports it (helpers/addons.py), else skip."""
    from helpers.addons import addons_or_skip
    return addons_or_skip()


def test_repeat_calls_the_graph_from_a_middle_graph():
    """PopXL's repeat: the LoopOp calls a middle graph whose one CallOp calls the repeated
    graph; a loop input added through the binding (addLoopInput, then the call's
    connectInTensor, as popxl-addons' route_tensor does) reaches the repeated graph every
    iteration, and addLoopOutput makes a new output of it the carried value."""
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.float32([1, 2]), name="x")
        w = popxl.variable(np.float32([10, 20]), name="w")
        g = ir.create_graph(lambda a: a + 1.0, x)
        info = ops.repeat_with_info(g, 3, x)
        loop = info._op
        (middle,) = loop.getCalledGraphs()
        (call,) = middle.getOps()
        assert isinstance(call, _pb_op("CallOp")) and call.getCalledGraph() == g._pb_graph
        # route w into g: a new input of the loop, the middle graph and the call
        mid_w = middle.getIr().createIntermediateTensorId("w")
        loop.addLoopInput(loop.getNumExplicitInputs(), w.id, mid_w, False)
        with g:
            gw = popxl.graph_input((2,), popxl.float32, "w")
            out = g.outputs[0] * gw
            popxl.graph_output(out)
        call.connectInTensor(call.subgraphInToOpInIndex(g._pb_graph.getInputIndex(gw.id)), mid_w)
        new = popxl.Graph._from_pb(middle)._create_tensor_id("scaled")
        call.createAndConnectOutTensor(g._pb_graph.getOutputIndex(out.id), new)
        loop.addLoopOutput(0, loop.outId(0), new, True)
        y = popxl.Tensor._from_pb_tensor(loop.outTensor(0))
        s = popxl.d2h_stream((2,), popxl.float32, "y")
        ops.host_store(s, y)
    with popxl.Session(ir, "ipu_model") as sess:
        got = sess.run()[s]
    want = np.float32([1, 2])
    for _ in range(3):
        want = (want + 1) * np.float32([10, 20])
    np.testing.assert_allclose(got, want)


def _pb_op(name: str) -> type:
    from popart._internal.ir import op
    return getattr(op, name)


def test_pipelined_training_equals_unpipelined(addons):
    """A two-IPU pipeline written as popxl-addons' pipelining expects (stages in
    ``pipelined_execution``, host load in stage 0, activations stashed for the backward
    stage on IPU 0) gives the same losses and accumulated gradients as the same program run
    step by step, and NumPy's."""
    steps = 6
    X = RNG.normal(size=(steps, 3)).astype(np.float32)
    W0, W1 = RNG.normal(size=3).astype(np.float32), RNG.normal(size=3).astype(np.float32)

    def run(pipelined: bool):
        ir = popxl.Ir()
        with ir.main_graph:
            xs = popxl.h2d_stream((3,), popxl.float32, "x")
            ls = popxl.d2h_stream((), popxl.float32, "loss")
            with popxl.ipu(0):
                w0 = popxl.variable(W0, name="w0")
                a0 = popxl.variable(np.zeros(3, np.float32), name="a0")
            with popxl.ipu(1):
                w1 = popxl.variable(W1, name="w1")
                a1 = popxl.variable(np.zeros(3, np.float32), name="a1")
            spec = popxl.TensorSpec((3,), popxl.float32)
            f0 = ir.create_graph(lambda x, w: ops.tanh(x * w), spec, spec)
            g0 = popxl.transforms.autodiff(f0, grads_required=[f0.inputs[1]])
            f1 = ir.create_graph(lambda h, w: ops.sum((h * w) * (h * w)), spec, spec)
            g1 = popxl.transforms.autodiff(f1)

            def body(stage, stash):
                with stage(0), popxl.ipu(0):
                    i0 = ops.call_with_info(f0, ops.host_load(xs), w0)
                    h = i0.outputs[0].copy_to_ipu(1)
                with stage(1), popxl.ipu(1):
                    i1 = ops.call_with_info(f1, h, w1)
                    dh, dw1 = ops.call(g1.graph, popxl.constant(1.0), inputs_dict=g1.inputs_dict(i1))
                    ops.var_updates.accumulate_(a1, dw1)
                    ops.host_store(ls, i1.outputs[0])
                    dh = dh.copy_to_ipu(0)
                with stage(2), popxl.ipu(0):
                    (dw0,) = ops.call(g0.graph, dh, inputs_dict=stash(i0, g0))
                    ops.var_updates.accumulate_(a0, dw0)

            if pipelined:
                with addons.pipelined_execution(steps) as p:
                    body(p.stage, p.stash_and_restore_activations)
            else:
                import contextlib
                body(lambda i: contextlib.nullcontext(), lambda info, grad: grad.inputs_dict(info))
        ir.num_host_transfers = steps if pipelined else 1
        if pipelined:   # the pipeline's main cycle: a repeat, through PopXL's middle graph
            loops = [op for g in ir._pb_ir.getAllGraphs() for op in g.getOps()
                     if isinstance(op, _pb_op("LoopOp"))]
            assert loops and all(isinstance(op, _pb_op("CallOp")) for lp in loops
                                 for op in lp.getCalledGraphs()[0].getOps())
        with popxl.Session(ir, "ipu_model") as s:
            loss = s.run({xs: X})[ls] if pipelined else np.stack([s.run({xs: x})[ls] for x in X])
            data = s.get_tensors_data([a0, a1])
        return loss, data[a0], data[a1]

    ref, got = run(False), run(True)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-5)
    h = np.tanh(X * W0)
    np.testing.assert_allclose(got[0], ((h * W1) ** 2).sum(1), rtol=1e-5)
    np.testing.assert_allclose(got[2], (2 * h * h * W1).sum(0), rtol=1e-5)
    np.testing.assert_allclose(got[1], (2 * h * W1 * W1 * (1 - h * h) * X).sum(0), rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Remote buffers grown after ops use them (popxl-addons' batch serialisation)

def test_remote_buffer_grows_after_ops_use_it():
    """``buffer.entries`` set larger after stores and loads (in the main graph and in a called
    graph) resizes the buffer everywhere: stores at the new offsets land and load back."""
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32, 1)
        ops.remote_store(buf, 0, popxl.constant(np.float32([1, 2])))
        g = ir.create_graph(lambda t: ops.remote_store(buf, 0, t * 10.0), popxl.TensorSpec((2,), popxl.float32))
        ops.call(g, popxl.constant(np.float32([3, 4])))
        buf.entries = 3
        ops.remote_store(buf, 2, popxl.constant(np.float32([5, 6])))
        outs = {k: ops.remote_load(buf, k) for k in (0, 2)}
        streams = {k: popxl.d2h_stream((2,), popxl.float32, f"e{k}") for k in outs}
        for k, t in outs.items():
            ops.host_store(streams[k], t)
    assert buf.entries == 3
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run()
    np.testing.assert_allclose(got[streams[0]], [30, 40])
    np.testing.assert_allclose(got[streams[2]], [5, 6])


def test_grouped_collectives_of_replicas_side_by_side():
    """Four replicas on one device (vmapped, where JAX has no ``axis_index_groups``):
    all-reduces over groups of consecutive replicas and over strided groups (popxl-addons'
    ReplicatedAllReduceStrided), against NumPy sums over the groups."""
    R = 4
    x = RNG.normal(size=(R, 3)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        t = ops.host_load(xs)
        outs = {"tp": ops.collectives.replicated_all_reduce(t, "add", ir.replica_grouping(1, 2)),
                "strided": node("ReplicatedAllReduceStrided", [t], {"op": "Add", "stride": 2,
                                "groupSize": 2}, domain=ADDONS_DOMAIN)[0]}
        streams = {k: popxl.d2h_stream((3,), popxl.float32, k) for k in outs}
        for k, v in outs.items():
            ops.host_store(streams[k], v)
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": 1})
    with popxl.Session(ir, device) as s:
        assert popart.testing.mesh_devices(s) == []   # the replicas share one device
        got = s.run({xs: x})
    np.testing.assert_allclose(got[streams["tp"]], member_sum(x, groups(R, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(got[streams["strided"]], member_sum(x, groups(R, 2, 2)), rtol=1e-6)


def test_batch_serialise_grows_its_remote_buffer(addons):
    """popxl-addons' batch_serialise stores each of ``steps`` outputs in a buffer made for one
    entry (it grows the buffer after its ops use it): the entries hold x * w per step."""
    from popxl_addons.transforms.batch_serialisation import (RemoteHandle, batch_serial_buffer,
                                                             batch_serialise)

    class Scale(addons.Module):
        def build(self, x):
            return x * self.add_variable_input("w", lambda: np.float32([2, 3]), popxl.float32)

    steps = 4
    X = np.arange(8, dtype=np.float32).reshape(steps, 2)
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        ys = popxl.d2h_stream((2,), popxl.float32, "y")
        facts, graph = Scale().create_graph(popxl.TensorSpec((2,), popxl.float32))
        y = graph.graph.outputs[0]
        buf = batch_serial_buffer(y, steps=1)
        bs = batch_serialise(graph, steps, {graph.graph.inputs[0]: xs}, {}, {y: RemoteHandle(buf, None)},
                             io_mode="compute")
        bs.graph.bind(facts.init()).call(popxl.constant(0, popxl.int32))
        for k in range(steps):
            ops.host_store(ys, ops.remote_load(buf, k))
    assert buf.entries == steps
    ir.num_host_transfers = steps
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run({xs: X})[ys]
    np.testing.assert_allclose(got, X * np.float32([2, 3]))


def test_only_graphs_the_program_calls_must_be_patterned():
    """PopXL's session drops graphs nothing calls before lowering: an un-patterned identical
    collective in such a graph does not stop the session."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        ir.create_graph(lambda a: node("ReplicatedAllReduceTP", [a], {
            "op": "Add", "group": [R, 1, R], "identicalInputs": 1}, domain=ADDONS_DOMAIN)[0], x)
        s = popxl.d2h_stream((3,), popxl.float32, "y")
        ops.host_store(s, x + 1.0)
    with popxl.Session(ir, "ipu_model") as sess:
        np.testing.assert_allclose(sess.run()[s], np.full((R, 3), 2.0))
