"""popxl remote buffers, remote variables and replicated tensor sharding (RTS) against NumPy:
stores and loads within a run, across runs and through get_tensor_data; int and tensor
offsets (in subgraphs and loops); remote variables initialised from their data; RTS
variables holding only their shard on each replica's device, gathered and reduce-scattered
values equal to the unsharded computation, an optimizer step on the shards equal to the
full update; PopART's errors. The test session's host presents 4 devices (conftest)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import popart
from popart import testing
import popxl
import popxl.ops as ops
from popxl.ops import collectives as C

R = 4


def rng(seed=0):
    return np.random.default_rng(seed)


def d2h(t, name):
    s = popxl.d2h_stream(t.shape, t.dtype, name)
    ops.host_store(s, t)
    return s


# ---------------------------------------------------------------------------------------
# RemoteBuffer


def test_remote_buffer_members_ids_and_errors():
    with popxl.Ir().main_graph:
        b1 = popxl.RemoteBuffer((2, 3), popxl.float32, 4)
        b2 = popxl.remote_buffer((5,), popxl.int32)
        assert (b1.remote_buffer_id, b2.remote_buffer_id) == (1, 2)
        assert b1.tensor_shape == (2, 3) and b1.tensor_dtype == popxl.float32 and b1.entries == 4
        assert b2.entries == 1 and b2.meta_shape == ()
        b2.entries = 3
        assert b2.entries == 3
        with pytest.raises(AttributeError):
            b1.tensor_shape = (1,)
        with pytest.raises(AttributeError):
            b1.tensor_dtype = popxl.int8
        for bad in (0, -1):
            with pytest.raises(ValueError, match="^Entries must be a non-zero, positive integer"):
                popxl.RemoteBuffer((2,), popxl.float32, bad)
        with pytest.raises(ValueError, match="^Entries must be a non-zero, positive integer"):
            b2.entries = 0
        t = popxl.variable(np.zeros((2, 3), np.float32), name="t")
        b1.validate_tensor_matches_buffer(t)
        with pytest.raises(ValueError, match=f"^Tensor {t.id} does not match buffer."):
            b2.validate_tensor_matches_buffer(t)
        b1.set_remote_buffer_info(popxl.float32, (2, 3), 5)
        assert b1.entries == 5
    with popxl.Ir().main_graph:   # ids are per Ir
        assert popxl.remote_buffer((1,), popxl.float32).remote_buffer_id == 1


def test_store_and_load_in_one_run_across_runs_and_through_get_tensor_data():
    data = rng().normal(size=(2, 3)).astype(np.float32)
    inc = np.arange(6, dtype=np.float32).reshape(2, 3)
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((2, 3), popxl.float32, 3)
        rv = popxl.remote_variable(data, buf, 1, name="rv")
        assert rv.location_info.isRemote() and rv.location_info.getRemoteBufferInfo() == (1, 1)
        assert rv.location_info.location.storage == popxl.TensorStorage.OffChip
        before = ops.remote_load(buf, 1)
        ops.remote_store(buf, 1, before + popxl.constant(inc))
        after = ops.remote_load(buf, 1)
        other = ops.remote_load(buf, 2)                 # never stored: zeros
        ops.remote_store(buf, 0, after * popxl.constant(np.float32(2)))
        s_before, s_after, s_other = d2h(before, "before"), d2h(after, "after"), d2h(other, "other")
    with popxl.Session(ir, "ipu_model") as s:
        for k in range(3):
            out = s.run()
            np.testing.assert_allclose(out[s_before], data + k * inc, rtol=1e-6)
            np.testing.assert_allclose(out[s_after], data + (k + 1) * inc, rtol=1e-6)
            np.testing.assert_array_equal(out[s_other], 0)
        np.testing.assert_allclose(s.get_tensor_data(rv), data + 3 * inc, rtol=1e-6)
        s.write_variable_data(rv, np.ones((2, 3), np.float32))
        np.testing.assert_allclose(s.run()[s_before], 1)
        assert s.remote_memory_kind == "device"          # CPU: device memory is host memory
    np.testing.assert_allclose(s.get_tensor_data(rv), 1 + inc, rtol=1e-6)   # weights_to_host on exit
    with s:                                             # weights_from_host: the entry from the host
        np.testing.assert_allclose(s.run()[s_before], 1 + inc, rtol=1e-6)


def test_remote_variable_initialised_per_replica_group_and_retrieved():
    """Each replica's entry holds its group's data; get_tensor_data gives one value per
    group (or one per replica with retrieval_mode "all_replicas")."""
    data = rng(1).normal(size=(2, 3)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        g = ir.replica_grouping(stride=2, group_size=2)          # groups [0, 1, 0, 1]
        buf = popxl.remote_buffer((3,), popxl.float32, 2)
        one = popxl.remote_variable(data, buf, 0, replica_grouping=g)
        every = popxl.remote_variable(data, buf, 1, replica_grouping=g, retrieval_mode="all_replicas")
        x, y = ops.remote_load(buf, 0), ops.remote_load(buf, 1)
        ops.remote_store(buf, 0, x * popxl.constant(np.float32(3)))
        ops.remote_store(buf, 1, y + popxl.constant(np.float32(1)))
        sx = d2h(x, "x")
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run()[sx]
        np.testing.assert_allclose(out, data[g.assignment], rtol=1e-6)
        np.testing.assert_allclose(s.get_tensor_data(one), 3 * data, rtol=1e-6)
        np.testing.assert_allclose(s.get_tensor_data(every), (data + 1)[g.assignment], rtol=1e-6)


def test_int_and_tensor_offsets_in_subgraphs_and_loops():
    """A repeated subgraph stores entry i (a loop-carried tensor offset); a called subgraph's
    store reaches the caller; a host-loaded offset picks the entry at run time."""
    E = 4
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((3,), popxl.float32, E)
        base = popxl.variable(np.array([1, 2, 3], np.float32), name="base")

        def body(i, x):
            ops.remote_store(buf, i, x * ops.cast(i + 1, popxl.float32))
            return i + 1, x

        loop = ir.create_graph(body, popxl.constant(np.int32(0)), base)
        ops.repeat(loop, E, popxl.constant(np.int32(0)), base)

        def bump(t):
            ops.remote_store(buf, 0, ops.remote_load(buf, 3) + t)

        ops.call(ir.create_graph(bump, base), base)
        entries = [d2h(ops.remote_load(buf, e), f"e{e}") for e in range(E)]
        off_s = popxl.h2d_stream((), popxl.int32, "off")
        picked = d2h(ops.remote_load(buf, ops.host_load(off_s)), "picked")
    b = np.array([1, 2, 3], np.float32)
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run({off_s: np.int32(2)})
        np.testing.assert_allclose(out[entries[0]], 4 * b + b)
        for e in range(1, E):
            np.testing.assert_allclose(out[entries[e]], (e + 1) * b)
        np.testing.assert_allclose(out[picked], 3 * b)
        with pytest.raises(popart.popart_runtime_error, match="offset 7 is out of range for remote "
                                                              "buffer 1 with 4 entries"):
            s.run({off_s: np.int32(7)})


def test_remote_load_inplace():
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        buf = popxl.remote_buffer((2,), popxl.int32, 2)
        popxl.remote_variable(np.array([5, 6], np.int32), buf, 1)
        t = popxl.variable(np.zeros(2, np.int32), name="t")
        r = ops.remote_load_(buf, 1, t)
        assert r is t
        st = d2h(t, "t")
    with popxl.Session(ir, "ipu_model") as s:
        np.testing.assert_array_equal(s.run()[st], [5, 6])
        np.testing.assert_array_equal(s.get_tensor_data(t), [5, 6])   # t is a variable: updated


def test_remote_errors_follow_popart():
    ir = popxl.Ir()
    with ir.main_graph:
        buf = popxl.remote_buffer((2,), popxl.float32, 2)
        with pytest.raises(ValueError, match="does not match buffer"):
            popxl.remote_variable(np.zeros(3, np.float32), buf, 0)       # shape
        with pytest.raises(ValueError, match="does not match buffer"):
            popxl.remote_variable(np.zeros(2, np.int32), buf, 0)         # dtype
        with pytest.raises(ValueError, match="out of range"):
            popxl.remote_variable(np.zeros(2, np.float32), buf, 2)
        with pytest.raises(ValueError, match=">= 0"):
            popxl.remote_variable(np.zeros(2, np.float32), buf, -1)
        rv = popxl.remote_variable(np.zeros(2, np.float32), buf, 0)
        with pytest.raises(ValueError, match="already holds remote variable"):
            popxl.remote_variable(np.zeros(2, np.float32), buf, 0)
        with pytest.raises(ValueError, match="ops.remote_load"):
            _ = rv + 1.0                                                   # remote: not readable
        with pytest.raises(ValueError, match="does not match buffer"):
            ops.remote_store(buf, 0, popxl.constant(np.zeros(3, np.float32)))
        with pytest.raises(ValueError, match="out of range"):
            ops.remote_load(buf, 5)
        with pytest.raises(ValueError, match="out of range"):
            ops.remote_store(buf, 2, popxl.constant(np.zeros(2, np.float32)))
        with pytest.raises(ValueError, match="rank-0 integer tensor"):
            ops.remote_load(buf, popxl.constant(np.float32(0)))
        with pytest.raises(ValueError, match="does not match buffer"):
            ops.remote_load_(buf, 0, popxl.constant(np.zeros(2, np.int32)))
        ops.remote_load(buf, 1)
        buf.entries = 3            # PopXL sizes a buffer when lowering: it may grow after use
        with pytest.raises(ValueError, match="already used by ops"):
            buf.set_remote_buffer_info(popxl.float32, (3,), 3)             # not its tensor shape
        with pytest.raises(ValueError, match="replication factor is 1. It must be greater than 1"):
            popxl.replica_sharded_variable(np.zeros(4, np.float32))
    ir = popxl.Ir(replication=8)
    with ir.main_graph:
        with pytest.raises(ValueError, match="must be less than or equal to the replica group size"):
            popxl.replica_sharded_buffer((4, 4), popxl.float32, shard_over=16)
        with pytest.raises(ValueError, match="must be less than or equal to the replica group size"):
            popxl.replica_sharded_buffer((4, 4), popxl.float32, ir.replica_grouping(group_size=4), 8)
        with pytest.raises(ValueError, match="must be divisible by the sharding group size"):
            popxl.replica_sharded_buffer((4, 4), popxl.float32, ir.replica_grouping(group_size=4), 3)
        b = popxl.replica_sharded_buffer((4, 4), popxl.float32, shard_over=8)
        assert b.tensor_shape == (2,) and b.meta_shape == (4, 4)
        with pytest.raises(ValueError, match=r"^Cannot use RemoteBuffer\[id=1\] for replica sharded "
                                              r"variable of shape \(2, 8\)"):
            popxl.remote_replica_sharded_variable(np.zeros((2, 8), np.float32), b)
        with pytest.raises(ValueError, match="does not match buffer"):
            popxl.remote_replica_sharded_variable(np.zeros((4, 4), np.int32), b)


# ---------------------------------------------------------------------------------------
# Replicated tensor sharding


def _groups(assignment):
    out = {}
    for r, a in enumerate(assignment):
        out.setdefault(a, []).append(r)
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("grouping,shard_over", [
    (None, None),            # 4 shards over all replicas
    (None, 2),               # 2 shards: replicas 0, 1 hold one copy, 2, 3 another
    ((1, 2), None),          # 2 groups [0, 0, 1, 1] with their own values, 2 shards each
    ((2, 2), None),          # 2 groups [0, 1, 0, 1] (stride 2), 2 shards each
])
def test_replica_sharded_variable_holds_only_shards_and_gathers_the_full_value(grouping, shard_over):
    shape = (3, 5)                                    # 15 elements: padded to a multiple of k
    ir = popxl.Ir(replication=R)
    g = ir.replica_grouping(*grouping) if grouping else None
    groups = g.num_groups if g else 1
    data = rng(2).normal(size=((groups,) if groups > 1 else ()) + shape).astype(np.float32)
    k = shard_over or (g.group_size if g else R)
    size = math.ceil(15 / k)
    # the replicas holding one full copy: runs of k members of each variable group
    shard_group = ir.replica_grouping(g.stride if g else 1, k)
    with ir.main_graph, popxl.in_sequence():
        var, shard = popxl.replica_sharded_variable(data, popxl.float32, "w", replica_grouping=g,
                                                    shard_over=shard_over)
        assert var.shape == shape and shard.shape == (size,) and shard.meta_shape == shape
        assert var.location_info.isRemote() and var.location_info.isSharded()
        full = C.replicated_all_gather(shard, group=shard_group)      # meta shape: padding removed
        assert full.shape == shape
        s_full, s_shard = d2h(full, "full"), d2h(shard, "shard")
        ops.var_updates.accumulate_(shard, popxl.constant(np.ones(size, np.float32)))
    per_replica = data[g.assignment] if groups > 1 else np.broadcast_to(data, (R,) + shape)
    with popxl.Session(ir, "ipu_model") as s:
        dev = testing.device_values(s)[var.id]
        assert dev.shape == (R, size)
        shards = dev.addressable_shards
        assert len({sh.device for sh in shards}) == R and all(sh.data.shape == (1, size) for sh in shards)
        out = s.run()
        np.testing.assert_allclose(out[s_full], per_replica, rtol=1e-6)
        for r in range(R):                            # replica r holds shard (member index mod k)
            members = _groups((g or ir.replica_grouping()).assignment)
            m = next(grp.index(r) for grp in members if r in grp)
            flat = np.pad(per_replica[r].reshape(-1), (0, k * size - 15))
            np.testing.assert_allclose(out[s_shard][r], flat[m % k * size:(m % k + 1) * size])
        np.testing.assert_allclose(s.get_tensor_data(var), data + 1, rtol=1e-6)   # padding removed
        new = np.arange(np.prod(data.shape), dtype=np.float32).reshape(data.shape)
        s.write_variable_data(var, new)
        np.testing.assert_allclose(s.run()[s_full],
                                   new[g.assignment] if groups > 1 else np.broadcast_to(new, (R,) + shape))


def test_replica_sharded_all_replicas_retrieval_and_remote_rts_variables():
    data = rng(3).normal(size=(2, 5)).astype(np.float32)
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        var, shard = popxl.replica_sharded_variable(data, name="w", retrieval_mode="all_replicas")
        buf = popxl.replica_sharded_buffer((2, 5), popxl.float32, shard_over=2, entries=2)
        assert buf.tensor_shape == (5,) and buf.meta_shape == (2, 5)
        rv = popxl.remote_replica_sharded_variable(data * 2, buf, 1, name="rv")
        loaded = ops.remote_load(buf, 1)
        assert loaded.meta_shape == (2, 5)
        grp = ir.replica_grouping(group_size=2)
        full = C.replicated_all_gather(loaded, group=grp)
        ops.var_updates.accumulate_(full, popxl.constant(np.ones((2, 5), np.float32)))
        ops.remote_store(buf, 1, C.replica_sharded_slice(full, group=grp))
        s_full = d2h(full, "full")
    with popxl.Session(ir, "ipu_model") as s:
        buffer = testing.device_values(s)["remote_buffer:2"]
        assert buffer.shape == (R, 2, 5)            # [replicas, entries, shard]
        np.testing.assert_allclose(s.run()[s_full], np.broadcast_to(data * 2 + 1, (R, 2, 5)), rtol=1e-6)
        np.testing.assert_allclose(s.get_tensor_data(rv), data * 2 + 1, rtol=1e-6)
        np.testing.assert_allclose(s.get_tensor_data(var), np.broadcast_to(data, (R, 2, 5)))
        # PopXL does not write "all_replicas" variables of groups of several replicas
        with pytest.raises(NotImplementedError, match='"all_replicas" retreval mode'):
            s.write_variable_data(var, data * 5)


def test_replica_grouping_forms_for_sharding():
    """const_rg / to_device_map / to_host_map and transpose as PopART's docs give them, and an
    RTS variable over a grouping without a constant stride (sharded over its const_rg)."""
    ir = popxl.Ir(replication=8)
    g = ir.replica_grouping_from_assignments([0, 0, 1, 1, 0, 0, 1, 1])
    assert not g.is_const and g.const_rg.assignment == [0, 0, 1, 1, 2, 2, 3, 3]
    assert g.to_device_map == [0, 1, 0, 1] and g.to_host_map == [0, 1]
    c = ir.replica_grouping(2, 2)
    assert c.const_rg is c and c.to_device_map is None
    assert c.transpose().assignment == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ir.replica_grouping(1, 4).transpose().assignment == [0, 1, 2, 3, 0, 1, 2, 3]
    small = popxl.Ir(replication=4)
    for a, t in (([0, 0, 0, 0], [0, 1, 2, 3]), ([0, 1, 0, 1], [0, 0, 1, 1]),
                 ([0, 0, 1, 1], [0, 1, 0, 1]), ([0, 1, 2, 3], [0, 0, 0, 0])):
        assert small.replica_grouping_from_assignments(a).transpose().assignment == t

    data = np.arange(10, dtype=np.float32).reshape(2, 5)
    with ir.main_graph, popxl.in_sequence():
        var, shard = popxl.replica_sharded_variable(data, replica_grouping=g)
        assert shard.shape == (3,)                       # 5 elements over const_rg's 2 members
        full = C.replicated_all_gather(shard, group=g.const_rg)
        ops.var_updates.accumulate_(shard, popxl.constant(np.ones(3, np.float32)))
        sf = d2h(full, "full")
    with popxl.Session(ir, "ipu_model") as s:
        np.testing.assert_array_equal(s.run()[sf], data[g.assignment])
        np.testing.assert_array_equal(s.get_tensor_data(var), data + 1)


@pytest.mark.parametrize("shard_over", [R, 2])
def test_rts_optimizer_step_equals_the_full_update(shard_over):
    """Data-parallel SGD on a sharded weight: each replica gathers the weight, computes its
    gradient, reduce-scatters it (over the replicas sharing a copy; summed over the copies
    with an all-reduce over the transposed grouping), updates its shard. Equal to the update
    of the full weight with the summed gradient."""
    W = rng(4).normal(size=(3, 5)).astype(np.float32)
    X = rng(5).normal(size=(R, 2, 3)).astype(np.float32)
    LR, STEPS = 0.05, 2
    ir = popxl.Ir(replication=R)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((2, 3), popxl.float32, "x")
        var, shard = popxl.replica_sharded_variable(W, name="w", shard_over=shard_over)
        grp = ir.replica_grouping(group_size=shard_over)

        def model(x, w):
            y = x @ w
            return ops.sum(y * y)

        fwd = ir.create_graph(model, popxl.TensorSpec((2, 3), popxl.float32),
                              popxl.TensorSpec((3, 5), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[1:])
        x = ops.host_load(xs)
        w = C.replicated_all_gather(shard, group=grp)
        info = ops.call_with_info(fwd, x, w)
        (dw,) = ops.call(bwd.graph, popxl.constant(np.float32(1)), inputs_dict=bwd.inputs_dict(info))
        g = C.replicated_reduce_scatter(dw, "add", grp, configure_output_for_replicated_tensor_sharding=True)
        assert g.shape == shard.shape and g.meta_shape == (3, 5)
        if shard_over < R:
            g = C.replicated_all_reduce(g, "add", grp.transpose())
        ops.scaled_add_(shard, g, b=-LR)
        s_loss = d2h(info.outputs[0], "loss")
    ref = W.copy()
    with popxl.Session(ir, "ipu_model") as s:
        for _ in range(STEPS):
            loss = s.run({xs: X})[s_loss]
            y = X @ ref
            np.testing.assert_allclose(loss, (y * y).sum(axis=(1, 2)), rtol=1e-5)
            ref = ref - LR * np.einsum("rij,rik->jk", X, 2 * y)      # the summed full gradient
            np.testing.assert_allclose(s.get_tensor_data(var), ref, rtol=1e-5, atol=1e-6)
        size = math.ceil(15 / shard_over)
        shards = testing.device_values(s)[var.id].addressable_shards
        assert all(sh.data.shape == (1, size) for sh in shards)


def test_reduce_scatter_and_gather_equal_the_unsharded_computation():
    """replicated_reduce_scatter / replica_sharded_slice / replicated_slice shards put
    together by replicated_all_gather give the summed / original tensor (padding removed)."""
    x = rng(6).normal(size=(R, 3, 3)).astype(np.float32)       # 9 elements: padded to 12
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        xs = popxl.h2d_stream((3, 3), popxl.float32, "x")
        t = ops.host_load(xs)
        rs = C.replicated_reduce_scatter(t, "add", configure_output_for_replicated_tensor_sharding=True)
        sl = C.replica_sharded_slice(C.replicated_all_reduce(t))       # the same value everywhere
        mixed = C.replica_sharded_slice(t)                              # replica r: its x's shard r
        assert rs.shape == sl.shape == (3,) and rs.meta_shape == sl.meta_shape == (3, 3)
        outs = {"sum": C.replicated_all_gather(rs), "same": C.replicated_all_gather(sl),
                "mixed": C.replicated_all_gather(mixed),
                "rows": C.replicated_all_gather(C.replicated_slice(C.replicated_all_reduce(t)[:2], 0,
                                                                   ir.replica_grouping(1, 2)),
                                                0, ir.replica_grouping(1, 2), "new_axis"),
                "shard": rs}
        streams = {k: d2h(v, k) for k, v in outs.items()}
    with popxl.Session(ir, "ipu_model") as s:
        out = s.run({xs: x})
    total = x.sum(0)
    np.testing.assert_allclose(out[streams["sum"]], np.broadcast_to(total, (R, 3, 3)), rtol=1e-5)
    np.testing.assert_allclose(out[streams["same"]], np.broadcast_to(total, (R, 3, 3)), rtol=1e-5)
    flat = np.pad(x.reshape(R, -1), ((0, 0), (0, 3)))
    mixed = np.concatenate([flat[q, 3 * q:3 * q + 3] for q in range(R)])[:9].reshape(3, 3)
    np.testing.assert_allclose(out[streams["mixed"]], np.broadcast_to(mixed, (R, 3, 3)), rtol=1e-6)
    np.testing.assert_allclose(out[streams["rows"]], np.broadcast_to(total[:2], (R, 2, 3)), rtol=1e-5)
    padded = np.pad(total.reshape(-1), (0, 3))
    np.testing.assert_allclose(out[streams["shard"]], padded.reshape(R, 3), rtol=1e-5)


@pytest.mark.parametrize("placement", ["shard_map", "vmap"])
def test_remote_buffers_in_host_memory(monkeypatch, placement):
    """POPXL_REMOTE_MEMORY_KIND=pinned_host: the buffers live in host memory between runs
    (the default where a GPU has it), with the same results, with replicas on distinct
    devices or side by side on one; an unknown kind falls back to device memory."""
    device = "ipu_model" if placement == "shard_map" else \
        popart.DeviceManager().createIpuModelDevice({"numIPUs": 1})

    def build():
        ir = popxl.Ir(replication=2)
        with ir.main_graph, popxl.in_sequence():
            buf = popxl.remote_buffer((2,), popxl.float32, 2)
            rv = popxl.remote_variable(np.array([1, 2], np.float32), buf, 1)
            x = ops.remote_load(buf, 1)
            ops.remote_store(buf, 1, x + popxl.constant(np.float32(1)))
            sx = d2h(x, "x")
        return ir, rv, sx

    monkeypatch.setenv("POPXL_REMOTE_MEMORY_KIND", "pinned_host")
    ir, rv, sx = build()
    with popxl.Session(ir, device) as s:
        assert (len(testing.mesh_devices(s)) == 2) == (placement == "shard_map")
        assert s.remote_memory_kind == "pinned_host"
        s.run()
        np.testing.assert_allclose(s.run()[sx], [[2, 3], [2, 3]])
        assert testing.device_values(s)["remote_buffer:1"].sharding.memory_kind == "pinned_host"
        np.testing.assert_allclose(s.get_tensor_data(rv), [3, 4])
    monkeypatch.setenv("POPXL_REMOTE_MEMORY_KIND", "no_such_memory")
    ir, rv, sx = build()
    with popxl.Session(ir, "ipu_model") as s:
        assert s.remote_memory_kind == "device"
        np.testing.assert_allclose(s.run()[sx], [[1, 2], [1, 2]])
