"""popxl collectives against NumPy: every CollectiveOperator over any replica grouping (stride,
group size), with replicas on distinct devices (shard_map: the test session's host presents 4)
and side by side (vmap); all-gather / reduce-scatter / slices and their gradients; all-reduce
across the IPUs of one replica."""
from __future__ import annotations

import numpy as np
import pytest

import popart
import popart.testing
import popxl
import popxl.ops as ops
from popxl.ops import collectives as C

OPS = ["add", "mean", "mul", "min", "max", "and", "or", "square_add"]


def groups_for(r: int, stride: int, size: int) -> list[list[int]]:
    """The docs' definition: groups of ``size`` replicas ``stride`` apart, block by block."""
    block = stride * size
    out = []
    for first in range(r):
        if first % block < stride:
            out.append([first + i * stride for i in range(size)])
    return out


def group_of(groups, rep):
    return next(g for g in groups if rep in g)


def reduce_ref(rows: np.ndarray, op: str) -> np.ndarray:
    return {"add": rows.sum(0), "mean": rows.mean(0), "mul": rows.prod(0), "min": rows.min(0),
            "max": rows.max(0), "and": np.all(rows != 0, 0).astype(rows.dtype),
            "or": np.any(rows != 0, 0).astype(rows.dtype), "square_add": (rows ** 2).sum(0)}[op]


def run_replicated(R, build, x, device="ipu_model"):
    """Each replica host-loads its row of ``x`` ([R, *shape]); ``build(ir, t)`` returns
    {name: tensor}; returns {name: [R, ...]} and the session."""
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream(x.shape[1:], popxl.dtype.as_dtype(x.dtype), "x")
        tensors = build(ir, ops.host_load(xs))
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in tensors.items()}
        for k, t in tensors.items():
            ops.host_store(streams[k], t)
    s = popxl.Session(ir, device)
    with s:
        out = s.run({xs: x})
    return {k: out[st] for k, st in streams.items()}, s


def one_ipu():
    return popart.DeviceManager().createIpuModelDevice({"numIPUs": 1})


@pytest.mark.parametrize("R,stride,size,placement", [
    (4, 1, 2, "shard_map"), (4, 2, 2, "shard_map"), (4, 1, 4, "shard_map"), (4, 4, 1, "shard_map"),
    (4, 2, 2, "vmap"), (4, 1, 2, "vmap"),
    (8, 2, 2, "vmap"), (8, 1, 4, "vmap"), (8, 4, 2, "vmap"), (8, 2, 4, "vmap")])
def test_every_operator_over_a_replica_grouping(R, stride, size, placement):
    rng = np.random.default_rng(R * 10 + stride + size)
    x = rng.uniform(0.5, 1.5, size=(R, 2, 3)).astype(np.float32)
    x[:, 0, 0] = 0.0                                  # and / or see a zero
    x[1, 1, 1] = 0.0

    def build(ir, t):
        g = ir.replica_grouping(stride, size)
        out = {op: C.replicated_all_reduce(t, op, g) for op in OPS}
        v = t * 1.0
        C.replicated_all_reduce_(v, "add", g)
        out["inplace"] = v
        out["gather"] = C.replicated_all_gather(t, group=g)
        out["gather1"] = C.replicated_all_gather(t, 1, g)
        out["gather_new"] = C.replicated_all_gather(t, group=g, output_shape="new_axis")
        out["rs_add"] = C.replicated_reduce_scatter(t, "add", g)
        out["rs_max"] = C.replicated_reduce_scatter(t, "max", g)
        out["rs_mean"] = C.replicated_reduce_scatter(t, "mean", g)
        out["shard"] = C.replica_sharded_slice(t, g)
        return out

    got, s = run_replicated(R, build, x, "ipu_model" if placement == "shard_map" else one_ipu())
    assert (len(popart.testing.mesh_devices(s)) == R) == (placement == "shard_map")
    groups = groups_for(R, stride, size)
    for rep in range(R):
        g = group_of(groups, rep)
        rank, rows = g.index(rep), x[g]
        for op in OPS:
            np.testing.assert_allclose(got[op][rep], reduce_ref(rows, op), rtol=1e-6,
                                       err_msg=f"{op} replica {rep}")
        np.testing.assert_allclose(got["inplace"][rep], rows.sum(0), rtol=1e-6)
        np.testing.assert_array_equal(got["gather"][rep], np.concatenate(list(rows), 0))
        np.testing.assert_array_equal(got["gather1"][rep], np.concatenate(list(rows), 1))
        np.testing.assert_array_equal(got["gather_new"][rep], rows)
        for key, red in (("rs_add", rows.sum(0)), ("rs_max", rows.max(0)), ("rs_mean", rows.mean(0))):
            flat = np.pad(red.ravel(), (0, -red.size % size)).reshape(size, -1)
            np.testing.assert_allclose(got[key][rep], flat[rank], rtol=1e-6, err_msg=key)
        own = np.pad(x[rep].ravel(), (0, -x[rep].size % size)).reshape(size, -1)
        np.testing.assert_array_equal(got["shard"][rep], own[rank])
    # output shapes were inferred while building
    assert got["gather"].shape == (R, 2 * size, 3) and got["gather1"].shape == (R, 2, 3 * size)


def test_default_group_is_all_replicas_and_single_replica_is_identity():
    x = np.arange(8, dtype=np.float32).reshape(4, 2) + 1
    got, _ = run_replicated(4, lambda ir, t: {"sum": C.replicated_all_reduce(t),
                                              "sq": C.replicated_all_reduce(t, "square_add",
                                                                            ir.replica_grouping(1, 1))},
                            x)
    np.testing.assert_allclose(got["sum"], np.broadcast_to(x.sum(0), x.shape))
    np.testing.assert_allclose(got["sq"], x ** 2)            # a group of one: its own square
    ir = popxl.Ir()
    with ir.main_graph:
        c = popxl.constant(np.array([1.0, 2.0], np.float32))
        y = C.replicated_all_reduce(c, "mean")
        d = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(d, y)
    with popxl.Session(ir, "cpu") as s:
        np.testing.assert_array_equal(s.run()[d], [1.0, 2.0])


def test_replicated_slice_and_its_gradient_is_an_all_gather():
    """replicated_slice gives each replica of a group its rank's slice along an axis; the
    gradient of a replicated slice is the all-gather of the slices' gradients, and that of an
    all-gather this replica's slice of the output gradient (PopART's grad ops)."""
    R, stride, size = 4, 2, 2
    x = np.arange(R * 2 * 4, dtype=np.float32).reshape(R, 2, 4)

    def build(ir, t):
        g = ir.replica_grouping(stride, size)
        sl = C.replicated_slice(t, 1, g)                        # (2, 2): columns of this rank
        sl0 = C.replicated_slice(t, 0, g)                       # (4,): row of this rank, axis dropped
        fwd = ir.create_graph(lambda a: ops.sum(C.replicated_slice(a, 1, g) * a[:, :2]),
                              popxl.TensorSpec((2, 4), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, t)
        (dt,) = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        fwd2 = ir.create_graph(lambda a: ops.sum(C.replicated_all_gather(a, 0, g) *
                                                 popxl.constant(np.arange(4, dtype=np.float32)[:, None])),
                               popxl.TensorSpec((2, 4), popxl.float32))
        bwd2 = popxl.transforms.autodiff(fwd2)
        info2 = ops.call_with_info(fwd2, t)
        (dg,) = ops.call(bwd2.graph, popxl.constant(1.0), inputs_dict=bwd2.inputs_dict(info2))
        return {"sl": sl, "sl0": sl0, "dt": dt, "dg": dg}

    got, _ = run_replicated(R, build, x)
    groups = groups_for(R, stride, size)
    assert got["sl"].shape == (R, 2, 2) and got["sl0"].shape == (R, 4)
    w = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)
    for rep in range(R):
        grp = group_of(groups, rep)
        rank = grp.index(rep)
        np.testing.assert_array_equal(got["sl"][rep], x[rep][:, 2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(got["sl0"][rep], x[rep][rank])
        # d/da sum(slice(a) * a[:, :2]): the slice's cotangent a[:, :2] of every member,
        # all-gathered back into the columns (PopART), plus the direct term
        gathered = np.concatenate([x[m][:, :2] for m in grp], 1)
        direct = np.zeros((2, 4), np.float32)
        direct[:, :2] = x[rep][:, 2 * rank:2 * rank + 2]
        np.testing.assert_allclose(got["dt"][rep], gathered + direct, rtol=1e-6)
        # all-gather's gradient: this rank's rows of the output gradient
        np.testing.assert_array_equal(got["dg"][rep], w[2 * rank:2 * rank + 2])


def test_all_reduce_gradient_matches_the_sum_over_the_group():
    R = 4
    x = np.arange(R * 3, dtype=np.float32).reshape(R, 3) - 5

    def build(ir, t):
        g = ir.replica_grouping(1, 2)
        fwd = ir.create_graph(lambda a: ops.sum(C.replicated_all_reduce(a * a, "add", g)),
                              popxl.TensorSpec((3,), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, t)
        (da,) = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
        return {"loss": info.outputs[0], "da": da}

    got, _ = run_replicated(R, build, x)
    for rep in range(R):
        grp = group_of(groups_for(R, 1, 2), rep)
        np.testing.assert_allclose(got["loss"][rep], (x[grp] ** 2).sum())
        # the all-reduce's gradient is the all-reduce of the (identical) output gradients
        np.testing.assert_allclose(got["da"][rep], 2 * x[rep] * len(grp))


def test_all_reduce_across_ipus_and_identical_inputs_gradients():
    a0 = np.array([1.0, -2.0, 3.0], np.float32)
    a1 = np.array([0.5, 4.0, -1.0], np.float32)

    def fn(x0, x1, mode):
        f = {"plain": C.all_reduce, "ii": C.all_reduce_identical_inputs,
             "igi": C.all_reduce_identical_grad_inputs}[mode]
        y0, y1 = f([x0, x1], [0, 1])
        return ops.sum(y0 * popxl.constant(np.array([1.0, 2.0, 3.0], np.float32))) + ops.sum(y1 * y1)

    ir = popxl.Ir()
    res = {}
    with ir.main_graph:
        with popxl.ipu(0):
            x0 = popxl.constant(a0, name="x0") * 1.0
        with popxl.ipu(1):
            x1 = popxl.constant(a1, name="x1") * 1.0
        assert (x0.ipu, x1.ipu) == (0, 1)
        m0, m1 = C.all_reduce([x0, x1], op="max")               # IPUs inferred from the tensors
        s0, s1 = C.all_reduce([x0, x1], op="local")
        res.update(m0=m0, m1=m1, s1=s1)
        for mode in ("plain", "ii", "igi"):
            spec = popxl.TensorSpec((3,), popxl.float32)
            fwd = ir.create_graph(lambda a, b, mode=mode: fn(a, b, mode), spec, spec)
            bwd = popxl.transforms.autodiff(fwd)
            info = ops.call_with_info(fwd, x0, x1)
            g0, g1 = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
            res.update({f"{mode}_loss": info.outputs[0], f"{mode}_g0": g0, f"{mode}_g1": g1})
        with pytest.raises(ValueError, match="infer the IPU"):
            C.all_reduce([popxl.constant(a0), x1])
        with pytest.raises(ValueError, match="does not equal"):
            C.all_reduce([x0, x1], [0])
        with pytest.raises(ValueError, match="Not a valid op"):
            C.all_reduce([x0, x1], [0, 1], "xor")
        streams = {k: popxl.d2h_stream(t.shape, t.dtype, k) for k, t in res.items()}
        for k, t in res.items():
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "cpu") as s:
        out = s.run()
    got = {k: out[st] for k, st in streams.items()}
    w = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_array_equal(got["m0"], np.maximum(a0, a1))
    np.testing.assert_array_equal(got["m1"], np.maximum(a0, a1))
    np.testing.assert_array_equal(got["s1"], a1)
    tot = a0 + a1
    # plain: y0 = y1 = a0 + a1; every input's gradient is the sum of the output gradients
    np.testing.assert_allclose(got["plain_loss"], (tot * w).sum() + (tot * tot).sum(), rtol=1e-6)
    np.testing.assert_allclose(got["plain_g0"], w + 2 * tot, rtol=1e-6)
    np.testing.assert_allclose(got["plain_g1"], w + 2 * tot, rtol=1e-6)
    # identical inputs: forward identity, gradient the all-reduce of the output gradients
    np.testing.assert_allclose(got["ii_loss"], (a0 * w).sum() + (a1 * a1).sum(), rtol=1e-6)
    np.testing.assert_allclose(got["ii_g0"], w + 2 * a1, rtol=1e-6)
    np.testing.assert_allclose(got["ii_g1"], w + 2 * a1, rtol=1e-6)
    # identical grad inputs: forward all-reduce, each input gets its own output's gradient
    np.testing.assert_allclose(got["igi_loss"], got["plain_loss"], rtol=1e-6)
    np.testing.assert_allclose(got["igi_g0"], w, rtol=1e-6)
    np.testing.assert_allclose(got["igi_g1"], 2 * tot, rtol=1e-6)


def test_collective_errors_and_names():
    ir = popxl.Ir(replication=4)
    with ir.main_graph:
        t = popxl.variable(np.ones(3, np.float32))
        with pytest.raises(ValueError, match="Not a valid op"):
            C.replicated_all_reduce(t, "local")
        with pytest.raises(ValueError, match="constant stride"):
            C.replicated_all_reduce(t, group=ir.replica_grouping_from_assignments([0, 1, 1, 0]))
        with pytest.raises(ValueError, match="2 replicas"):
            C.replicated_all_reduce(t, group=popxl.Ir(replication=2).replica_grouping())
        with pytest.raises(ValueError, match="output_shape"):
            C.replicated_all_gather(t, output_shape="stack")
        with pytest.raises(ValueError, match="equally divide"):
            C.replicated_slice(t, 0, ir.replica_grouping(1, 2))
        y = C.replicated_all_reduce(t, "Max", ir.replica_grouping(2, 2))   # a CollectiveOperator name
        n = ir.main_graph._g.nodes[-1]
        assert n.attrs["collectiveOperator"] == "Max"
        assert n.attrs["__collectiveReplicaGrouping"] == [4, 2, 2]
        assert y.shape == (3,)
    assert C.CommGroup is popart.CommGroup and C.CommGroupType.Consecutive is popart.CommGroupType.Consecutive


def test_builder_comm_group_attribute_selects_the_groups():
    """The Builder's commGroup [type, size] (popart.CommGroup) reaches the same lowering:
    Consecutive 2 of 4 replicas is {0, 1}, {2, 3}; Orthogonal 2 is {0, 2}, {1, 3}."""
    import jax
    from popart.engine import x64
    from popart.ops import collectives as lowering

    class Ctx:
        replica_axis, replication_factor = "r", 4

        def error(self, msg):
            return popart.popart_exception(msg)
    xs = np.arange(8, dtype=np.float32).reshape(4, 2)
    with x64():
        cons = np.asarray(jax.vmap(lambda v: lowering.all_reduce(Ctx(), v, "Add", commGroup=[1, 2]),
                                   axis_name="r")(xs))
        orth = np.asarray(jax.vmap(lambda v: lowering.all_reduce(Ctx(), v, "Add", commGroup=[2, 2]),
                                   axis_name="r")(xs))
        with pytest.raises(popart.popart_exception, match="not allowed"):
            lowering.all_reduce(Ctx(), xs[0], "Add", commGroup=[1, 2],
                                __collectiveReplicaGrouping=[4, 1, 2])
    np.testing.assert_array_equal(cons, xs[[0, 0, 2, 2]] + xs[[1, 1, 3, 3]])
    np.testing.assert_array_equal(orth, xs[[0, 1, 0, 1]] + xs[[2, 3, 2, 3]])
