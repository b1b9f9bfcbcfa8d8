"""popxl-addons 3.4's own op modules (``popxl_addons.ops.<name>``: ``import
cppimport.import_hook``, ``from . import <x>_binding``, ``createOpInGraph`` on
``graph._pb_graph``) run unchanged on their Python equivalents (popart.custom_ops), against the
NumPy transcriptions of the C++ rules: one program on one replica, one over 4 replicas. Skipped
where popxl-addons (installed, or POPXL_ADDONS_DIR) cannot be imported."""
from __future__ import annotations


import numpy as np

import popxl
import popxl.ops as ops

from helpers.addons import addons_or_skip
from helpers.custom_ops_ref import (cross_entropy_reference, fp8_mse_scale_reference, groups,
                                    layer_norm_reference, member_sum, pack_nibbles, rotate_complex)

addons_or_skip(module_level=True)

RNG = np.random.default_rng(3)


def store(outs):
    streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in outs.items()}
    for k, t in outs.items():
        ops.host_store(streams[k], t)
    return streams


def grad_of(ir, fn, *xs):
    """(first output, the gradient of xs[0] for that output's gradient all ones) of ``fn`` through
    popxl's autodiff."""
    fwd = ir.create_graph(fn, *xs)
    bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[:1])
    info = ops.call_with_info(fwd, *xs)
    y = info.outputs[0]
    seed = popxl.constant(np.ones(y.shape, y.dtype.as_numpy()))
    (dx,) = ops.call(bwd.graph, seed, inputs_dict=bwd.inputs_dict(info))
    return y, dx


def test_single_replica_ops():
    from scipy.sparse import csr_matrix
    from popxl_addons.ops.cross_entropy_sharded_wr_loss.cross_entropy_sharded_wr_loss import \
        cross_entropy_sharded_wr_loss
    from popxl_addons.ops.fp8_mse_scale.fp8_mse_scale import fp8_mse_scale
    from popxl_addons.ops.grad_reduce_square_add.grad_reduce_square_add import grad_reduce_square_add
    from popxl_addons.ops.group_quantize_decompress.group_quantize_decompress import \
        group_quantize_decompress
    from popxl_addons.ops.linear_layout.linear_layout import linear_layout
    from popxl_addons.ops.rotary_pos_embed.rotary_pos_embed import rotary_pos_embed, trig_tables
    from popxl_addons.ops.static_sparse_ops.dense_sparse_matmul import dense_const_sparse_matmul

    B, S, H, hh, d = 2, 4, 2, 8, 4
    q = RNG.normal(size=(B, S, H, hh)).astype(np.float32)
    sin, cos = trig_tables(S, d)
    vals = RNG.integers(0, 16, size=(3, 2, 8))
    gscale = RNG.uniform(0.1, 1, size=(3, 2, 1)).astype(np.float16)
    gbias = RNG.normal(size=(3, 2, 1)).astype(np.float16)
    big = (RNG.normal(size=(16, 8)) * 40).astype(np.float32)
    rhs = RNG.normal(size=(6, 5)).astype(np.float32) * (RNG.uniform(size=(6, 5)) < 0.5)
    lhs = RNG.normal(size=(3, 6)).astype(np.float32)
    l0, l1 = RNG.normal(size=(4, 3)).astype(np.float32), RNG.normal(size=(4, 2)).astype(np.float32)
    lab = np.array([0, 4, 2, 1], np.int32)

    ir = popxl.Ir()
    with ir.main_graph:
        qv = popxl.variable(q, name="q")
        rot, dq = grad_of(ir, lambda t: rotary_pos_embed(t, popxl.constant(sin), popxl.constant(cos), d), qv)
        lv0, lv1 = popxl.variable(l0, name="l0"), popxl.variable(l1, name="l1")
        wr, dl0 = grad_of(ir, lambda a, b: cross_entropy_sharded_wr_loss(
            [a, b], [popxl.constant(lab), popxl.constant(lab)], ipus=[0, 0]), lv0, lv1)
        outs = {
            "rot": rot, "dq": dq, "wr": wr, "dl0": dl0,
            "gqd": group_quantize_decompress(popxl.constant(pack_nibbles(vals)), popxl.constant(gscale),
                                             popxl.constant(gbias)),
            "norm": grad_reduce_square_add(popxl.constant(big), loss_scaling=8),
            "fp8": fp8_mse_scale(popxl.constant(big), popxl.float8_143),
            "lin": linear_layout(popxl.constant(lhs), 2),
            "sparse": dense_const_sparse_matmul(popxl.constant(lhs), csr_matrix(rhs), 5),
        }
        streams = store(outs)
    with popxl.Session(ir, "ipu_model") as s:
        res = s.run()
    got = {k: res[v] for k, v in streams.items()}
    phi = np.arctan2(sin, cos)[None]
    np.testing.assert_allclose(got["rot"], rotate_complex(q, phi, d, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["dq"], rotate_complex(np.ones_like(q), phi, d, -1), rtol=1e-5, atol=1e-6)
    loss, _, dref = cross_entropy_reference(np.concatenate([l0, l1], 1), lab, np.ones(4, np.float32))
    np.testing.assert_allclose(got["wr"], loss, rtol=1e-5)
    np.testing.assert_allclose(got["dl0"], dref[:, :3], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["gqd"], (vals.astype(np.float16) * gscale + gbias).reshape(3, -1))
    np.testing.assert_allclose(got["norm"], (big.astype(np.float64) ** 2).sum() / 64, rtol=1e-5)
    assert int(got["fp8"]) == fp8_mse_scale_reference(big, 85, 18, 2.0 ** -40)
    np.testing.assert_array_equal(got["lin"], lhs)
    np.testing.assert_allclose(got["sparse"], lhs @ rhs, rtol=1e-5, atol=1e-6)


def test_replicated_ops():
    """4 replicas: TP all-reduces (groups {0, 1}, {2, 3}), strided collectives (stride 2:
    {0, 2}, {1, 3}), the distributed layer norm over all 4, the sharded cross entropy over
    groups of 2; gradients through popxl's autodiff."""
    from popxl_addons.ops.cross_entropy_sharded_loss import cross_entropy_sharded_loss
    from popxl_addons.ops.layer_norm_distributed.layer_norm_distributed import layer_norm_distributed
    from popxl_addons.ops.replicated_all_reduce_TP.replicated_all_reduce_TP import (
        replicated_all_reduce, replicated_all_reduce_identical_grad_inputs,
        replicated_all_reduce_identical_inputs)
    from popxl_addons.ops.replicated_strided_collectives.replicated_all_gather_strided import \
        replicated_all_gather_strided
    from popxl_addons.ops.replicated_strided_collectives.replicated_all_reduce_strided import \
        replicated_all_reduce_strided
    from popxl_addons.ops.replicated_strided_collectives.replicated_reduce_scatter_strided import \
        replicated_reduce_scatter_strided

    R, N, h, c = 4, 3, 2, 3
    x = RNG.normal(size=(R, N, h)).astype(np.float32)
    logits = RNG.normal(size=(R, N, c)).astype(np.float32)
    labels = np.array([0, 5, 2])
    idx = np.stack([labels - c * (r % 2) for r in range(R)]).astype(np.int32)
    w = np.full((h,), 1.0, np.float32)
    ir = popxl.Ir(replication=R)
    tp, strided = ir.replica_grouping(1, 2), ir.replica_grouping(2, 2)
    with ir.main_graph:
        xs, ls, ids = (popxl.h2d_stream(a.shape[1:], popxl.dtype.as_dtype(a.dtype), k)
                       for k, a in (("x", x), ("logits", logits), ("idx", idx)))
        xt, lt, it = ops.host_load(xs), ops.host_load(ls), ops.host_load(ids)
        outs = {}
        for name, f in (("ii", replicated_all_reduce_identical_inputs),
                        ("igi", replicated_all_reduce_identical_grad_inputs),
                        ("ar", replicated_all_reduce)):
            outs[name], outs["d" + name] = grad_of(ir, lambda t, f=f: f(t * t, group=tp), xt)
        outs["mean"] = replicated_all_reduce_strided(xt, "mean", strided)
        outs["gather"] = replicated_all_gather_strided(xt, strided)
        outs["scatter"] = replicated_reduce_scatter_strided(xt, "add", strided)
        shard = replicated_reduce_scatter_strided(xt, "add", strided, True)
        assert shard.meta_shape == (N, h) and shard.shape == (N * h // 2,)
        outs["regathered"] = replicated_all_gather_strided(shard, strided)   # reshaped to the meta-shape
        outs["ln"], outs["dln"] = grad_of(
            ir, lambda t: layer_norm_distributed(t, popxl.constant(w), popxl.constant(np.zeros(h, np.float32)),
                                                 group=ir.replica_grouping(1, R)), xt)
        outs["ce"], outs["dce"] = grad_of(
            ir, lambda a, b: cross_entropy_sharded_loss(a, b, replica_grouping=tp, reduction="sum"), lt, it)
        streams = store(outs)
    from popxl_addons.patterns import apply_pre_alias_patterns
    apply_pre_alias_patterns(ir)   # OpToIdentity: the identical-inputs sides
    with popxl.Session(ir, "ipu_model") as s:
        res = s.run({xs: x, ls: logits, ids: idx})
    got = {k: res[v] for k, v in streams.items()}
    g2 = groups(R, 1, 2)
    sq, ones = x * x, np.ones_like(x)
    np.testing.assert_allclose(got["ii"], sq, rtol=1e-6)
    np.testing.assert_allclose(got["dii"], 2 * x * member_sum(ones, g2), rtol=1e-6)
    np.testing.assert_allclose(got["igi"], member_sum(sq, g2), rtol=1e-6)
    np.testing.assert_allclose(got["digi"], 2 * x, rtol=1e-6)
    np.testing.assert_allclose(got["ar"], member_sum(sq, g2), rtol=1e-6)
    np.testing.assert_allclose(got["dar"], 2 * x * member_sum(ones, g2), rtol=1e-6)
    gs = groups(R, 2, 2)
    np.testing.assert_allclose(got["mean"], member_sum(x, gs) / 2, rtol=1e-6)
    ln_ref = layer_norm_reference(list(x), [w] * R, [np.zeros(h)] * R, [np.ones((N, h))] * R, 1e-5)
    for grp in gs:
        flat = [x[m].reshape(-1) for m in grp]
        for rank, rep in enumerate(grp):
            np.testing.assert_allclose(got["gather"][rep], np.concatenate(flat))
            np.testing.assert_allclose(got["scatter"][rep], (flat[0] + flat[1])[3 * rank:3 * rank + 3],
                                       rtol=1e-6)
            np.testing.assert_allclose(got["regathered"][rep], x[grp].sum(0), rtol=1e-6)
    for rep in range(R):
        cols = slice(h * rep, h * rep + h)
        np.testing.assert_allclose(got["ln"][rep], ln_ref[0][:, cols], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["dln"][rep], ln_ref[3][:, cols], rtol=1e-4, atol=1e-5)
    for grp in g2:
        loss, _, dref = cross_entropy_reference(np.concatenate([logits[m] for m in grp], 1), labels,
                                                np.ones(N, np.float32))
        for rank, rep in enumerate(grp):
            np.testing.assert_allclose(got["ce"][rep], loss.sum(), rtol=1e-5)
            np.testing.assert_allclose(got["dce"][rep], dref[:, rank * c:(rank + 1) * c], rtol=1e-5, atol=1e-6)
