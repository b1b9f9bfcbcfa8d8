"""popxl-addons' reach into PopART's IR (issue 34): PopART's OpToIdentityPattern through
``Ir._pb_ir.applyPreAliasPatterns`` (the collectives with identicalInputs / identicalGradInputs
and PopART's other canBeReplacedByIdentity rules), checked against NumPy sums over replica
groups."""
from __future__ import annotations

import numpy as np
import pytest

import popart
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
    w = RNG.normal(size=(3, 4)).astype(np.float32)
    grads = [RNG.normal(size=(3, 4)).astype(np.float32) for _ in range(2)]
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
    np.testing.assert_allclose(got[m], ref_m, rtol=1e-6 if m_dtype == np.float32 else 1e-3)
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
