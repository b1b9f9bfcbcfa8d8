"""popxl parity, the rest of issue 24: op output names as PopXL writes them ("<op>_out" and
PopXL's own), Session._set_device / the device setter / POPXL_OFFLINE_DEVICE, and the private
members popxl-addons uses (Ir._graph_cache, Context._add_in_sequence_topocons,
ReplicaGrouping.stride's NotImplementedError)."""
from __future__ import annotations

import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from popxl.context import get_current_context

RNG = np.random.default_rng(24)


# ---------------------------------------------------------------------------------------
# Output names: PopXL's ops name their outputs g._create_tensor_id("<op>_out") (or their own)


def test_op_outputs_have_popxl_names():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32), name="x")
        i = popxl.variable(np.zeros((2,), np.int32), name="i")
        seed = popxl.variable(np.zeros((2,), np.uint32), popxl.uint32, name="seed")
        one = popxl.constant(np.ones(3, np.float32))
        got = {
            "add_out": x + x, "relu_out": ops.relu(x), "negate_out": -x, "max_out": ops.max(x),
            "maximum_out": ops.maximum(x, x), "sum_out": ops.sum(x), "l2_out": ops.l2(x),
            "matmul_out": x @ popxl.constant(np.ones((3, 2), np.float32)), "x_float16": ops.cast(x, popxl.float16),
            "x_reshaped": ops.reshape(x, (3, 2)), "x_T": x.T, "argmax_out": ops.argmax(x),
            "group_norm_out": ops.group_norm(x, one, one, 1), "softmax_out": ops.softmax(x),
            "dropout_out": ops.dropout(x, seed, 0.1), "gather_out": ops.gather(x, i),
            "shapeddropout_out": ops.shaped_dropout(x, seed, (2, 1), 0.1), "identity_x": ops.identity(x),
            "loss": ops.nll_loss(ops.softmax(x), i), "scaled_add_out": ops.scaled_add(x, x, 2.0),
            "dynamic_slice_out": ops.dynamic_slice(x, popxl.constant(np.array([0], np.uint32)), [0], [1]),
        }
        split = ops.split(x, 3, 1)
        values, indices = ops.topk(x, 1)
        with popxl.name_scope("layer"):
            scoped = ops.relu(x)
        again = ops.relu(x)
    for name, t in got.items():
        assert t.id == name, (name, t.id)
    assert [t.id for t in split] == ["x_split_0", "x_split_1", "x_split_2"]
    assert (values.id, indices.id, indices.dtype) == ("topk_out_value", "topk_out_indices", popxl.int32)
    assert got["argmax_out"].dtype == popxl.int32
    assert scoped.id == "layer/relu_out" and again.id.startswith("relu_out__t")   # unique ids
    # the op keeps its own name (PopXL's op settings name), only its outputs are "<op>_out"
    nodes = {n.outputs[0]: n for n in ir.main_graph._g.nodes}
    assert nodes["add_out"].name == "add" and nodes["layer/relu_out"].name == "layer/relu"


def test_subgraph_outputs_are_named_in_the_graph_scope():
    ir = popxl.Ir()

    def body(a: popxl.Tensor) -> popxl.Tensor:
        return ops.mul(a, a)

    with ir.main_graph:
        g = ir.create_graph(body, popxl.TensorSpec((2,), popxl.float32))
    out = g.outputs[0]
    assert out.id == f"{g.id}/mul_out" and out.name == "mul_out"


# ---------------------------------------------------------------------------------------
# Session devices


def _counting_ir():
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(np.zeros(3, np.float32), name="w")
        ops.var_updates.accumulate_(w, popxl.constant(np.ones(3, np.float32)))
        d2h = popxl.d2h_stream(w.shape, w.dtype)
        ops.host_store(d2h, w)
    return ir, w, d2h


@pytest.fixture(scope="module")
def counting():
    return _counting_ir()


def test_set_device_moves_the_values_and_the_program(counting):
    ir, w, d2h = counting
    s = popxl.Session(ir, "ipu_model")
    with s:
        np.testing.assert_array_equal(s.run()[d2h], [1, 1, 1])
        cpu = popart.DeviceManager().createCpuDevice()
        s._set_device(cpu)                   # PopXL's (popxl-addons use it)
        assert s.device is cpu and s.is_attached and s.device.type == popart.DeviceType.Cpu
        np.testing.assert_array_equal(s.run()[d2h], [2, 2, 2])   # the device value came along
    assert not cpu.isAttached
    np.testing.assert_array_equal(s.get_tensor_data(w), [2, 2, 2])
    with pytest.raises(TypeError, match="popart.DeviceInfo"):
        s._set_device("cpu")


def test_offline_device_runs_on_acquired_ipus_and_comes_back(counting, monkeypatch):
    ir, w, d2h = counting
    monkeypatch.setenv("POPXL_OFFLINE_DEVICE", "ipu2")
    s = popxl.Session(ir, "ipu_hw")
    offline = s.device
    assert offline.type == popart.DeviceType.OfflineIpu and not s.is_attached
    with pytest.raises(ValueError, match="Must be attached"):
        s.run()
    with s:                                  # PopXL: acquires IPUs for the block
        assert s.device.type == popart.DeviceType.Ipu and s.is_attached
        hw = s.device
        np.testing.assert_array_equal(s.run()[d2h], [1, 1, 1])
    assert s.device is offline and not hw.isAttached and not s.is_attached
    np.testing.assert_array_equal(s.get_tensor_data(w), [1, 1, 1])   # copied back on exit
    monkeypatch.delenv("POPXL_OFFLINE_DEVICE")
    big = popart.DeviceManager().createOfflineIPUDevice({"numIPUs": 32})   # no such IPUs
    s = popxl.Session(ir, big)
    with pytest.raises(RuntimeError, match="Failed to acquire device with 32 IPUs"):
        s.__enter__()
    assert s.device is big and not s.is_attached


# ---------------------------------------------------------------------------------------
# Private members popxl-addons uses


def test_ir_graph_cache_maps_ids_to_graphs():
    ir = popxl.Ir()
    with ir.main_graph:
        g = ir.create_graph(lambda a: a + 1, popxl.TensorSpec((2,), popxl.float32))
    cache = ir._graph_cache
    assert cache[g.id] is g and cache[ir.main_graph.id] is ir.main_graph and len(cache) == 2


def test_add_in_sequence_topocons_orders_an_op_made_in_a_pass_block():
    ir = popxl.Ir()

    def body(a: popxl.Tensor) -> popxl.Tensor:
        return a + 1

    with ir.main_graph:
        g = ir.create_graph(body, popxl.TensorSpec((2,), popxl.float32))
        x = popxl.variable(np.zeros(2, np.float32))
        with popxl.in_sequence(True):
            with popxl.in_sequence("pass"):
                info = ops.repeat_with_info(g, 2, x)
            node = info._op.node
            assert node.annotations["__in_sequence"] == "pass"
            get_current_context()._add_in_sequence_topocons(info._op)   # as popxl-addons does
            assert node.annotations["__in_sequence"] is True
            with popxl.in_sequence("pass"):
                get_current_context()._add_in_sequence_topocons(info._op)   # "pass": unchanged
            assert node.annotations["__in_sequence"] is True
        ctx = get_current_context()
        ctx.in_sequence = "sometimes"
        try:
            with pytest.raises(ValueError, match="`in_sequence` mode not understood: sometimes"):
                ctx._add_in_sequence_topocons(node)
        finally:
            ctx.in_sequence = None


def test_replica_grouping_stride_raises_without_a_constant_stride():
    ir = popxl.Ir(replication=4)
    const = ir.replica_grouping(stride=2, group_size=2)
    assert const.stride == 2 and repr(const) == \
        "ReplicaGrouping(num_replicas=4, stride=2, group_size=2, num_groups=2)"
    odd = ir.replica_grouping_from_assignments([0, 0, 1, 0])
    assert not odd.is_const and repr(odd) == "ReplicaGrouping(assignment=[0, 0, 1, 0])"
    with pytest.raises(NotImplementedError, match="non-constant stride"):
        odd.stride
    assert odd.const_rg.stride == 1       # the constant-stride form still has one
    with ir.main_graph:                    # collectives: PopXL's grouping check first
        x = popxl.variable(np.ones(4, np.float32))
        y = ops.collectives.replicated_all_reduce(x, group=const)
        assert y.shape == (4,)
        with pytest.raises(ValueError, match="constant stride"):
            ops.collectives.replicated_all_reduce(x, group=odd)
