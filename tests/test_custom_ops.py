"""C++ custom ops as Python equivalents (popart.custom_ops, docs/custom_ops.md): popxl-addons'
ops, forward and gradient against NumPy transcriptions of their C++ rules (collectives over
vmapped replicas, and one replicated popxl program over the host devices); the cppimport
import resolution with and without a real cppimport; a user's own op end to end in popart
(Builder.customOp) and popxl; the errors."""
from __future__ import annotations

import importlib
import sys
import textwrap

import jax
import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from popart import custom_ops
from popart.custom_ops import ADDONS_DOMAIN
from popart.custom_ops import addons_collectives as AC
from popart.custom_ops import addons_ops as AO
from popxl.ops._base import node

from helpers.custom_ops_ref import (cross_entropy_reference, fp8_mse_scale_reference, groups,
                                    layer_norm_reference, member_sum, pack_nibbles, rotate_complex)


class Ctx:
    """The lowering context of a node traced over ``r`` replicas (vmap axis "r")."""
    op_type, domain, version, name, node = "Op", ADDONS_DOMAIN, 1, "op", None
    input_ids, output_ids = [], []

    def __init__(self, r: int = 1) -> None:
        self.replication_factor, self.replica_axis = r, ("r" if r > 1 else None)

    def error(self, msg):
        return popart.UnsupportedOperatorError(msg)


def replicated(fn, *xs):
    """``fn`` per replica over the leading axis of ``xs`` (vmap with the replica axis)."""
    return jax.vmap(fn, axis_name="r")(*xs)


def vjp(fn, xs, gs):
    """The cotangents of ``xs`` for output cotangents ``gs`` (PopART's grad op here)."""
    out, pull = jax.vjp(fn, *xs)
    return out, pull(gs)


RNG = np.random.default_rng(7)


# ---------------------------------------------------------------------------------------
# Collectives

@pytest.mark.parametrize("ii,igi", [(1, 0), (0, 1), (0, 0)])
def test_all_reduce_tp_identity_side(ii, igi):
    """identicalInputs: forward identity, gradient the group's sum; identicalGradInputs: the
    reverse; neither: both sums (the grad op is the op with the flags swapped)."""
    R, grp = 4, [4, 1, 2]
    x, g = RNG.normal(size=(R, 3)).astype(np.float32), RNG.normal(size=(R, 3)).astype(np.float32)
    y, (dx,) = replicated(lambda a, b: vjp(lambda v: AC.all_reduce_tp(
        Ctx(R), v, "Add", grp, ii, igi), (a,), b), x, g)
    gs = groups(R, 1, 2)
    np.testing.assert_allclose(y, x if ii else member_sum(x, gs), rtol=1e-6)
    np.testing.assert_allclose(dx, g if igi else member_sum(g, gs), rtol=1e-6)


def test_strided_collectives():
    """Strided groups (stride 2: {0, 2}, {1, 3}): all-reduce Mean and its Mean gradient,
    all-gather of the flattened inputs in rank order, reduce-scatter of the padded sum."""
    R = 4
    x = RNG.normal(size=(R, 2, 3)).astype(np.float32)
    g = RNG.normal(size=(R, 2, 3)).astype(np.float32)
    ctx = Ctx(R)
    y, (dx,) = replicated(lambda a, b: vjp(lambda v: AC.all_reduce_strided(
        ctx, v, "Mean", 2, 2), (a,), b), x, g)
    gather = replicated(lambda a: AC.all_gather_strided(ctx, a, 2, 2), x)
    scatter = replicated(lambda a: AC.reduce_scatter_strided(ctx, a, "Add", 2, 2), x)
    gs = groups(R, 2, 2)
    np.testing.assert_allclose(y, member_sum(x, gs) / 2, rtol=1e-6)
    np.testing.assert_allclose(dx, member_sum(g, gs) / 2, rtol=1e-6)
    for grp in gs:
        total = x[grp].sum(0).reshape(-1)
        for rank, rep in enumerate(grp):
            np.testing.assert_allclose(gather[rep], np.concatenate([x[m].reshape(-1) for m in grp]))
            np.testing.assert_allclose(scatter[rep], total[3 * rank:3 * rank + 3], rtol=1e-6)
    with pytest.raises(popart.popart_exception, match="Add and CollectiveOperator::Mean"):
        AC.all_reduce_strided(ctx, x[0], "Max", 2, 2)
    with pytest.raises(popart.popart_exception, match="stride and group size must be > 0"):
        AC.all_gather_strided(ctx, x[0], 0, 2)
    with pytest.raises(popart.popart_exception, match="CollectiveOperator::Add is the only"):
        AC.all_reduce_tp(ctx, x[0], "mean", [4, 1, 4])


def test_layer_norm_distributed_forward_and_grad_op():
    R, N, h, eps = 4, 5, 3, 1e-5
    x = RNG.normal(size=(R, N, h)).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, size=(R, h)).astype(np.float32)
    b = RNG.normal(size=(R, h)).astype(np.float32)
    g = RNG.normal(size=(R, N, h)).astype(np.float32)

    def per_replica(xr, wr, br, gr):
        fn = lambda a, c, d: AC.layer_norm_distributed(Ctx(R), a, c, d, eps, [R, 1, R])  # noqa: E731
        (y, mean, inv), pull = jax.vjp(fn, xr, wr, br)
        return y, mean, inv, pull((gr, jax.numpy.zeros_like(mean), jax.numpy.zeros_like(inv)))

    y, mean, inv, (dx, dw, db) = replicated(per_replica, x, w, b, g)
    ry, rmean, rinv, rdx, rdw, rdb = layer_norm_reference(list(x), list(w), list(b), list(g), eps)
    for r in range(R):
        cols = slice(h * r, h * r + h)
        np.testing.assert_allclose(y[r], ry[:, cols], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mean[r], rmean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(inv[r], rinv, rtol=1e-4)
        np.testing.assert_allclose(dx[r], rdx[:, cols], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dw[r], rdw[cols], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(db[r], rdb[cols], rtol=1e-5, atol=1e-6)


def test_cross_entropy_sharded_over_a_group():
    """Logits sharded over groups of 2 of 4 replicas; each shard's indices shifted by its first
    class; a label outside every shard gives loss 0 and no -dLoss."""
    R, N, c = 4, 6, 5
    logits = RNG.normal(size=(R, N, c)).astype(np.float32) * 3
    labels = RNG.integers(0, 2 * c, size=(2, N))
    labels[:, 0] = -1
    g = RNG.normal(size=(N,)).astype(np.float32)
    gs = groups(R, 1, 2)
    idx = np.stack([labels[gi] - c * grp.index(rep) for rep in range(R)
                    for gi, grp in enumerate(gs) if rep in grp]).astype(np.int32)

    def per_replica(lr, ir):
        fn = lambda a: AC.cross_entropy_sharded(Ctx(R), a, ir, [R, 1, 2])  # noqa: E731
        (loss, nls), pull = jax.vjp(fn, lr)
        return loss, nls, pull((jax.numpy.asarray(g), jax.numpy.zeros_like(nls)))[0]

    loss, nls, dl = replicated(per_replica, logits, idx)
    for gi, grp in enumerate(gs):
        ref, rnls, dref = cross_entropy_reference(np.concatenate([logits[m] for m in grp], 1),
                                                  labels[gi], g)
        for rank, rep in enumerate(grp):
            cols = slice(rank * c, (rank + 1) * c)
            np.testing.assert_allclose(loss[rep], ref, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(nls[rep], rnls[:, cols], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(dl[rep], dref[:, cols], rtol=1e-5, atol=1e-6)


def test_cross_entropy_sharded_within_replica():
    """CrossEntropyShardedWR: class shards of 3 and 2 on two IPUs, indices not shifted."""
    N = 4
    l0, l1 = RNG.normal(size=(N, 3)).astype(np.float32), RNG.normal(size=(N, 2)).astype(np.float32)
    lab = np.array([0, 4, 2, 7], np.int32)
    g = RNG.normal(size=(N,)).astype(np.float32)
    (loss, n0, n1), pull = jax.vjp(lambda a, b: tuple(AC.cross_entropy_sharded_wr(
        Ctx(), a, b, lab, lab, ipus=[0, 1])), l0, l1)
    d0, d1 = pull((g, np.zeros_like(l0), np.zeros_like(l1)))
    ref, rnls, dref = cross_entropy_reference(np.concatenate([l0, l1], 1), lab, g)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([n0, n1], 1), rnls, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([d0, d1], 1), dref, rtol=1e-5, atol=1e-6)
    with pytest.raises(popart.popart_exception, match="n logits, n indices"):
        AC.cross_entropy_sharded_wr(Ctx(), l0, l1, lab, lab, ipus=[0])


# ---------------------------------------------------------------------------------------
# Ops without collectives

@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_rotary_pos_embed_is_a_complex_rotation(rotary_dim):
    """Pairs (x[2i], x[2i+1]) as complex numbers times exp(i phi); the grad op rotates the
    output gradient back (times exp(-i phi)); sin / cos get no gradient."""
    B, S, H, hh = 2, 5, 3, 8
    d = rotary_dim or hh
    x = RNG.normal(size=(B, S, H, hh)).astype(np.float32)
    g = RNG.normal(size=(B, S, H, hh)).astype(np.float32)
    phi = RNG.uniform(-3, 3, size=(1, S, d // 2)).astype(np.float32)
    sin, cos = np.sin(phi), np.cos(phi)
    y, (dx, ds, dc) = vjp(lambda a, s, c: AO.rotary_pos_embed(Ctx(), a, s, c, rotary_dim),
                          (x, sin, cos), g)

    np.testing.assert_allclose(y, rotate_complex(x, phi, d, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, rotate_complex(g, phi, d, -1), rtol=1e-5, atol=1e-6)
    assert not np.any(ds) and not np.any(dc)
    with pytest.raises(popart.popart_exception, match="multiple of 2"):
        AO.rotary_pos_embed(Ctx(), x, sin, cos, 3)
    with pytest.raises(popart.popart_exception, match="rank 4"):
        AO.rotary_pos_embed(Ctx(), x[0], sin, cos, 4)


def test_group_quantize_decompress():
    rows, grps, ids = 3, 2, 4
    vals = RNG.integers(0, 16, size=(rows, grps, ids * 4))
    packed = pack_nibbles(vals)
    scale = RNG.uniform(0.1, 1, size=(rows, grps, 1)).astype(np.float16)
    bias = RNG.normal(size=(rows, grps, 1)).astype(np.float16)
    y = AO.group_quantize_decompress(Ctx(), packed, scale, bias)
    assert y.dtype == np.float16 and y.shape == (rows, grps * ids * 4)
    ref = (vals.astype(np.float16) * scale + bias).reshape(rows, -1)
    np.testing.assert_array_equal(np.asarray(y), ref)
    with pytest.raises(popart.popart_exception, match="last dimension should be 1"):
        AO.group_quantize_decompress(Ctx(), packed, scale[..., [0, 0]], bias)


def test_grad_reduce_square_add_and_linear_layout():
    x = RNG.normal(size=(4, 5)).astype(np.float16)
    y = AO.grad_reduce_square_add(Ctx(), x, np.float32(1 / 64 ** 2))
    assert y.dtype == np.float32 and y.shape == ()
    np.testing.assert_allclose(y, (x.astype(np.float64) ** 2).sum() / 64 ** 2, rtol=1e-5)
    np.testing.assert_array_equal(AO.linear_layout(Ctx(), x, 4), x)
    assert not np.any(jax.grad(lambda v: AO.linear_layout(Ctx(), v, 1).sum())(x.astype(np.float32)))


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 300.0, 1e5])
def test_fp8_mse_scale(scale):
    """Both float8 formats (pxa's CandidateConfig parameters), float32 and float16 data; the
    C++ op agrees with popxl's host estimate (host_fp8_mse_scale), as pxa's test asserts."""
    from popxl.fp8_utils import host_fp8_mse_scale
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype, (U, S, m) in ((popxl.float8_143, (85, 18, 3)), (popxl.float8_152, (78, 33, 2))):
            x = (RNG.normal(size=(32, 16)) * scale).astype(np.float32)
            got = int(AO.fp8_scale(Ctx(), x, U, S, 2.0 ** (-2 * (23 - m))))
            assert got == fp8_mse_scale_reference(x, U, S, 2.0 ** (-2 * (23 - m)))
            assert got == host_fp8_mse_scale(x, dtype)[1]
        if 1e-4 < scale < 1e4:
            x16 = (RNG.normal(size=(32, 16)) * scale).astype(np.float16)
            assert int(AO.fp8_scale(Ctx(), x16, 85, 18, 2.0 ** -14)) == \
                fp8_mse_scale_reference(x16, 85, 18, 2.0 ** -14)


def test_sparse_matmul():
    from scipy.sparse import csr_matrix
    rhs = RNG.normal(size=(6, 5)).astype(np.float32) * (RNG.uniform(size=(6, 5)) < 0.4)
    csr = csr_matrix(rhs)
    lhs = RNG.normal(size=(1, 3, 6)).astype(np.float32)
    y = AO.sparse_matmul(Ctx(), lhs, csr.data.tolist(), csr.indices.tolist(), csr.indptr.tolist(), 5)
    np.testing.assert_allclose(y, lhs @ rhs, rtol=1e-5, atol=1e-6)
    with pytest.raises(popart.popart_exception, match="not currently supported"):
        AO.sparse_matmul(Ctx(), lhs.astype(np.int32), [], [], [0] * 7, 5)


# ---------------------------------------------------------------------------------------
# A replicated popxl program (replicas on the host devices)

def test_replicated_popxl_program_with_addons_ops():
    """popxl nodes of the addons' ops over 4 replicas (groups of 2 for the TP ops): the
    sharded cross entropy and its grad op through popxl's autodiff, and the TP all-reduce
    whose gradient is the identity (identicalGradInputs)."""
    R, N, c = 4, 3, 4
    logits = RNG.normal(size=(R, N, c)).astype(np.float32)
    labels = np.array([1, 6, 3])
    idx = np.stack([labels - c * (r % 2) for r in range(R)]).astype(np.int32)
    ir = popxl.Ir(replication=R)
    grp = [R, 1, 2]
    with ir.main_graph:
        ls = popxl.h2d_stream((N, c), popxl.float32, "logits")
        xs = popxl.h2d_stream((N,), popxl.int32, "idx")
        x, i = ops.host_load(ls), ops.host_load(xs)

        def loss_fn(a, b):
            loss, _ = node("CrossEntropySharded", [a, b], {"group": grp}, domain=ADDONS_DOMAIN,
                           num_outputs=2)
            (red,) = node("ReplicatedAllReduceTP", [a], {"op": "Add", "group": grp,
                                                        "identicalGradInputs": 1},
                          domain=ADDONS_DOMAIN)
            return ops.sum(loss) + ops.sum(red)

        fwd = ir.create_graph(loss_fn, x, i)
        bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[:1])
        info = ops.call_with_info(fwd, x, i)
        (dx,) = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        outs = {"loss": info.outputs[0], "dx": dx}
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in outs.items()}
        for k, t in outs.items():
            ops.host_store(streams[k], t)
    for g in ir._pb_ir.getAllGraphs():   # OpToIdentity: the identical-inputs side
        ir._pb_ir.applyPreAliasPatterns(g)
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run({ls: logits, xs: idx})
    for grp_members in groups(R, 1, 2):
        full = np.concatenate([logits[m] for m in grp_members], 1)
        ref, _, dref = cross_entropy_reference(full, labels, np.ones(N, np.float32))
        for rank, rep in enumerate(grp_members):
            np.testing.assert_allclose(got[streams["loss"]][rep], ref.sum() + full.sum(), rtol=1e-5)
            np.testing.assert_allclose(got[streams["dx"]][rep], dref[:, rank * c:(rank + 1) * c] + 1,
                                       rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# A user's own op, end to end

USER_DOMAIN = "com.example.ops"


@custom_ops.register_op("ScaledCube", USER_DOMAIN, 1)
def scaled_cube(ctx, x, alpha=2.0):
    """The user's C++ op: y = alpha * x^3, whose grad op clips: dx = alpha * 3 x^2 * g,
    clipped to [-1, 1]."""
    return custom_ops.grad_rule(
        lambda v: (alpha * v ** 3, v),
        lambda v, g: (jax.numpy.clip(alpha * 3 * v * v * g, -1, 1),))(
            jax.numpy.asarray(x))


USER_OP = custom_ops.binding_op("ScaledCube", ("alpha",), domain=USER_DOMAIN, name="ScaledCubeOp")


def test_user_op_in_popart_training_session():
    """Builder.customOp finds the registered equivalent by domain / type / version (no .so is
    loaded); training uses its grad rule."""
    x0 = np.array([0.1, 0.5, -1.0, 2.0], np.float32)
    b = popart.Builder()
    w = b.addInitializedInputTensor(x0, "w")
    (y,) = b.customOp("ScaledCube", 1, USER_DOMAIN, [w], {"alpha": 0.5})
    loss = b.aiGraphcore.l1loss([y], 1.0, reduction=popart.ReductionType.Sum)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, {y: popart.AnchorReturnType("ALL")}),
                               loss, popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, anchors))
    np.testing.assert_allclose(anchors[y], 0.5 * x0 ** 3, rtol=1e-6)
    weights = {w: np.zeros(4, np.float32)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(weights))
    grad = np.clip(0.5 * 3 * x0 ** 2 * np.sign(0.5 * x0 ** 3), -1, 1)
    np.testing.assert_allclose(weights[w], x0 - 0.1 * grad, rtol=1e-6)


def test_user_op_in_popxl_and_a_binding_class():
    """The user's binding class adds the node through graph.createCustomOp (a handle that
    adds it with popxl's node here); popxl's autodiff uses the grad rule."""
    Op = USER_OP

    class GraphHandle:
        def createCustomOp(self, op_type, domain, version, inputs, outputs, attributes, settings):
            self.call = (op_type, domain, version, inputs, outputs, attributes)
            ts = [by_id[inputs[k]] for k in sorted(inputs)]
            return node(op_type, ts, attributes, domain=domain, name=outputs[0])

    x0 = np.array([0.2, -0.4, 3.0], np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(x0, name="x")
        by_id = {x.id: x}
        h = GraphHandle()
        (y,) = Op.createOpInGraph(h, {0: x.id}, {0: "cube"}, 3.0, None)
        assert h.call == ("ScaledCube", USER_DOMAIN, 1, {0: x.id}, {0: "cube"}, {"alpha": 3.0})
        fwd = ir.create_graph(lambda a: ops.sum(node("ScaledCube", [a], {"alpha": 3.0},
                                                     domain=USER_DOMAIN)[0]), x)
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, x)
        (dx,) = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        sy, sd = popxl.d2h_stream(y.shape, y.dtype, "y"), popxl.d2h_stream(dx.shape, dx.dtype, "dx")
        ops.host_store(sy, y)
        ops.host_store(sd, dx)
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run()
    np.testing.assert_allclose(got[sy], 3 * x0 ** 3, rtol=1e-6)
    np.testing.assert_allclose(got[sd], np.clip(9 * x0 ** 2, -1, 1), rtol=1e-6)
    with pytest.raises(TypeError, match="createOpInGraph"):
        Op.createOpInGraph(h, {0: x.id}, {0: "c2"}, 1.0, None, 5)


def test_unregistered_custom_op_errors():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]))
    (y,) = b.customOp("Missing", 3, "com.example.other", [x], {})
    with pytest.raises(popart.popart_exception,
                       match=r"com.example.other::Missing .*opset 3.*register_op\('Missing', "
                             r"'com.example.other', 3\)"):
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                popart.DeviceManager().createCpuDevice())
    with popxl.Ir().main_graph, pytest.raises(popart.popart_exception, match="register_op"):
        node("Missing", [popxl.constant(np.zeros(2, np.float32))], domain="com.example.other")


# ---------------------------------------------------------------------------------------
# Import resolution

def user_packages(root, name, other):
    """Package ``name`` whose ``<name>_binding`` is registered (the user's op class) and
    package ``other`` whose ``other_binding`` is not; returns ``name``'s op module imported."""
    custom_ops.register_binding(f"{name}_binding", ScaledCubeOp=USER_OP)
    make_package(root, name, f"{name}_binding")
    make_package(root, other, "other_binding")
    return importlib.import_module(f"{name}.op")


def make_package(root, name, binding):
    """A package like popxl-addons' op packages: ``<binding>.cpp`` beside a module that does
    ``import cppimport.import_hook`` and ``from . import <binding>``."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / f"{binding}.cpp").write_text("// cppimport\n")
    (pkg / "op.py").write_text(f"import cppimport.import_hook\nfrom . import {binding}\n")
    return pkg


@pytest.fixture
def isolated_imports(monkeypatch, tmp_path):
    """sys.path / sys.meta_path / cppimport modules restored after the test."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    for mod in ("cppimport", "cppimport.import_hook"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith(("userpkg", "fakepkg", "cppimport"))]:
        del sys.modules[mod]


class HideCppimport:
    """Makes an installed cppimport invisible (what the fallback finder gives instead)."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "cppimport":
            return custom_ops._imports.FallbackFinder().find_spec(fullname, path, target)
        return None


def test_binding_resolves_without_cppimport(isolated_imports):
    sys.meta_path.insert(1, HideCppimport())
    mod = user_packages(isolated_imports, "userpkg", "userpkg2")
    import cppimport
    assert getattr(cppimport, custom_ops._imports.STAND_IN)
    assert mod.userpkg_binding.ScaledCubeOp is USER_OP
    assert mod.userpkg_binding.__spec__.origin.endswith("userpkg_binding.cpp")
    assert cppimport.imp("userpkg.userpkg_binding") is mod.userpkg_binding
    with pytest.raises(ImportError, match=r"'userpkg2.other_binding'.*other_binding.cpp.*"
                                          r"register_binding\('other_binding'"):
        importlib.import_module("userpkg2.op")


def test_binding_resolves_before_a_real_cppimport_hook(isolated_imports):
    """A real cppimport (simulated) inserts its hook first on sys.meta_path: the registered
    binding still resolves to its equivalent; an unregistered one goes to the real hook."""
    fake = isolated_imports / "cppimport"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    (fake / "import_hook.py").write_text(textwrap.dedent("""
        import importlib.util, os, sys, types
        class Hook:
            seen = []
            def find_spec(self, fullname, path, target=None):
                name = fullname.rpartition(".")[2]
                for d in path or []:
                    if os.path.exists(os.path.join(d, name + ".cpp")):
                        Hook.seen.append(fullname)
                        return importlib.util.spec_from_loader(fullname, self)
            def create_module(self, spec):
                return types.ModuleType(spec.name)
            def exec_module(self, module):
                module.COMPILED = True
        sys.meta_path.insert(0, Hook())
    """))
    mod = user_packages(isolated_imports, "fakepkg", "fakepkg2")
    import cppimport
    import cppimport.import_hook as hook
    assert cppimport.REAL and custom_ops._imports.real_cppimport_hook()
    assert type(sys.meta_path[0]).__name__ == "BindingFinder"
    assert mod.fakepkg_binding.ScaledCubeOp is USER_OP
    assert importlib.import_module("fakepkg2.op").other_binding.COMPILED
    assert hook.Hook.seen == ["fakepkg2.other_binding"]


def test_addons_ops_in_a_replicated_popart_session():
    """Builder.customOp of the addons' ops in a popart session over 4 replicas: the sharded
    cross entropy over groups of 2 and the strided Mean all-reduce (stride 2)."""
    R, N, c = 4, 3, 4
    logits = RNG.normal(size=(R, N, c)).astype(np.float32)
    labels = np.array([2, 7, 0])
    idx = np.stack([labels - c * (r % 2) for r in range(R)]).astype(np.int32)
    b = popart.Builder()
    lt = b.addInputTensor(popart.TensorInfo("FLOAT", [N, c]))
    it = b.addInputTensor(popart.TensorInfo("INT32", [N]))
    loss, _ = b.customOp("CrossEntropySharded", 1, ADDONS_DOMAIN, [lt, it], {"group": [R, 1, 2]},
                         numOutputs=2)
    (mean,) = b.customOp("ReplicatedAllReduceStrided", 1, ADDONS_DOMAIN, [lt],
                         {"op": "Mean", "stride": 2, "groupSize": 2})
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, R
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [loss, mean]),
                                popart.DeviceManager().acquireAvailableDevice(R), userOptions=opts)
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({lt: logits, it: idx}, anchors))
    for grp in groups(R, 1, 2):
        ref, _, _ = cross_entropy_reference(np.concatenate([logits[m] for m in grp], 1), labels,
                                            np.ones(N, np.float32))
        for rep in grp:
            np.testing.assert_allclose(anchors[loss][rep], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(anchors[mean], member_sum(logits, groups(R, 2, 2)) / 2, rtol=1e-6)


def test_gradient_graph_reads_what_the_grad_op_reads():
    """popxl's gradient graph of ReplicatedAllReduceTP (identicalInputs) takes only the output
    gradient (its grad op's gradInputInfo), so it can be called with that alone, as
    popxl-addons' tests do; its output is the all-reduce of it."""
    R = 2
    x = RNG.normal(size=(R, 3)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        t = ops.host_load(xs)
        fwd = ir.create_graph(lambda a: node("ReplicatedAllReduceTP", [a], {
            "op": "Add", "group": [R, 1, R], "identicalInputs": 1}, domain=ADDONS_DOMAIN)[0], t)
        bwd = popxl.transforms.autodiff(fwd)
        assert len(bwd.graph.inputs) == 1
        (dx,) = ops.call(bwd.graph, t)
        sd = popxl.d2h_stream(dx.shape, dx.dtype, "dx")
        ops.host_store(sd, dx)
    for g in ir._pb_ir.getAllGraphs():   # OpToIdentity: the identical-inputs side
        ir._pb_ir.applyPreAliasPatterns(g)
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run({xs: x})[sd]
    np.testing.assert_allclose(got, member_sum(x, [[0, 1]]), rtol=1e-6)


def test_binding_parameters_as_attributes():
    """A binding's parameters as node attributes: PopART's CollectiveOperator enum and popxl's
    op name, PopART's replica grouping handle and popxl's, flags, params objects."""
    from popart._internal.ir import CollectiveOperator
    from popxl.ops.collectives.collectives import to_collective_op
    rg = popxl.Ir(replication=4).replica_grouping(2, 2)
    assert custom_ops.attribute_value(CollectiveOperator.Add) == "Add" == to_collective_op("add")
    assert custom_ops.attribute_value(rg) == [4, 2, 2] == custom_ops.attribute_value(rg._pb_replica_grouping)
    assert custom_ops.attribute_value(True) == 1
    assert custom_ops.attribute_value(np.arange(3)) == [0, 1, 2]
    Params = custom_ops.params_class("P", "a", "b")
    assert (Params(1, b=2).a, Params(1, b=2).b) == (1, 2)

    class Graph:
        def createCustomOp(self, *args):
            return args
    Op = custom_ops.binding_op("X", ("op", "group"), domain="d", version=3)
    assert Op.createOpInGraph(Graph(), {0: "t"}, {0: "y"}, CollectiveOperator.Mean, rg, settings="s") == \
        ("X", "d", 3, {0: "t"}, {0: "y"}, {"op": "Mean", "group": [4, 2, 2]}, "s")
    assert Op.create_op_in_graph(Graph(), {0: "t"}, {0: "y"}, Params(1, [2]), "s")[5] == {"a": 1, "b": [2]}
