"""popxl.Session's context-manager semantics (PopART's popxl: attach / weights_from_host on
entering while detached, weights_to_host / detach on leaving that context, nesting,
weights_to_host_on_exit), run-input validation, and the Tensor / dtype / utils / context
parity additions."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import popart
import popxl
import popxl.ops as ops
from popxl.errors import UndefinedValue
from popxl.fp8_utils import from_host_fp8
from popxl.utils import table_to_string, to_numpy


def counter_ir(n: int = 1, r: int = 1):
    """v += x every run (x host-loaded), storing v."""
    ir = popxl.Ir(replication=r)
    ir.num_host_transfers = n
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        v = popxl.variable(np.zeros(2, np.float32), name="v")
        out = popxl.d2h_stream((2,), popxl.float32, "out")
        for _ in range(n):
            ops.var_updates.accumulate_(v, ops.host_load(xs))
            ops.host_store(out, v)
    return ir, xs, v, out


ONE = np.ones(2, np.float32)


# ---------------------------------------------------------------------------------------
# Context manager


def test_context_attaches_copies_weights_and_nests():
    ir, xs, v, out = counter_ir()
    s = popxl.Session(ir, "ipu_model")
    assert isinstance(s.device, popart.DeviceInfo) and s.device.numIpus == 1
    assert not s.is_attached and not s.device.isAttached
    with pytest.raises(ValueError, match="Must be attached"):
        s.run({xs: ONE})
    with s as entered:
        assert entered is s and s.is_attached and s.device.isAttached
        np.testing.assert_array_equal(s.run({xs: ONE})[out], [1, 1])
        assert not v.in_sync_with_ipu                       # the device holds a newer value
        with s:                                             # attached already: no weights_from_host
            assert s.is_attached
            np.testing.assert_array_equal(s.run({xs: ONE})[out], [2, 2])
        assert s.is_attached and not v.in_sync_with_ipu    # no weights_to_host / detach either
        np.testing.assert_array_equal(s.run({xs: ONE})[out], [3, 3])
    assert not s.is_attached and v.in_sync_with_ipu        # weights_to_host, then detach
    np.testing.assert_array_equal(s.get_tensor_data(v), [3, 3])
    with s:                                                 # weights_from_host of the host value
        np.testing.assert_array_equal(s.run({xs: ONE})[out], [4, 4])


def test_weights_to_host_on_exit_false_keeps_the_host_value():
    ir, xs, v, out = counter_ir()
    s = popxl.Session(ir, "cpu", weights_to_host_on_exit=False)
    assert s.weights_to_host_on_exit is False
    with s:
        s.run({xs: ONE})
        s.run({xs: ONE})
    assert not s.is_attached and not v.in_sync_with_ipu
    np.testing.assert_array_equal(s.get_tensor_data(v), [0, 0])   # never copied back
    with s:
        s.weights_to_host()                                # explicitly: still possible
        np.testing.assert_array_equal(s.get_tensor_data(v), [0, 0])  # re-entering re-sent 0
        np.testing.assert_array_equal(s.run({xs: ONE})[out], [1, 1])
        np.testing.assert_array_equal(s.get_tensor_data(v), [1, 1])  # read while attached


def test_an_exception_in_the_block_detaches_without_copying_back():
    ir, xs, v, out = counter_ir()
    s = popxl.Session(ir, "cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with s:
            s.run({xs: ONE})
            raise RuntimeError("boom")
    assert not s.is_attached
    np.testing.assert_array_equal(s.get_tensor_data(v), [0, 0])


def test_session_with_an_attached_device_is_attached_from_the_start():
    ir, xs, v, out = counter_ir()
    dev = popart.DeviceManager().createIpuModelDevice({"numIPUs": 1})
    assert dev.isAttached
    s = popxl.Session(ir, dev)
    assert s.device is dev and s.is_attached
    np.testing.assert_array_equal(s.run({xs: ONE})[out], [1, 1])   # weights already sent
    with s:
        s.run({xs: ONE})
    assert s.is_attached                                   # attached on enter: stays attached
    np.testing.assert_array_equal(s.get_tensor_data(v), [2, 2])
    dev.detach()
    assert not s.is_attached
    with pytest.raises(ValueError, match="cpu device"):
        popxl.Session(counter_ir(r=2)[0], "cpu")
    with pytest.raises(ValueError, match="Incorrect device type"):
        popxl.Session(ir, "gpu_farm")


def test_a_device_attached_elsewhere_cannot_be_entered():
    ir, xs, v, out = counter_ir()
    s = popxl.Session(ir, "ipu_hw")          # a hardware device, released until entered
    assert not s.is_attached
    other = popart.DeviceManager().acquireDeviceById(s.device.id)   # someone else takes it
    try:
        with pytest.raises(RuntimeError, match="Could not attach"):
            s.__enter__()
        assert not s.is_attached
    finally:
        other.detach()
    with s:
        assert s.is_attached
        np.testing.assert_array_equal(s.run({xs: ONE})[out], [1, 1])
    assert not s.is_attached


# ---------------------------------------------------------------------------------------
# Run-input validation


def test_run_validates_streams_and_shapes():
    ir, xs, v, out = counter_ir(n=3, r=2)
    with popxl.Session(ir, "ipu_model") as s:
        x = np.ones((3, 2, 2), np.float32)
        s.run({xs: x})
        with pytest.raises(ValueError, match="Unexpected/Missing input") as e:
            s.run({})
        assert "Missing: {" in str(e.value) and "x" in str(e.value)
        other = popxl.HostToDeviceStream((2,), popxl.float32, "other")
        with pytest.raises(ValueError, match="Unexpected/Missing input") as e:
            s.run({xs: x, other: x})
        assert "other" in str(e.value)
        with pytest.raises(ValueError, match="not large enough"):
            s.run({xs: np.ones((2, 2, 2), np.float32)})
        with pytest.raises(ValueError, match="(?s)wrong size.*replication_factor = 2"):
            s.run({xs: np.ones((3, 1, 2), np.float32)})
        with pytest.raises(ValueError, match="(?s)Shape mismatch.*array shape = \\(3, 2, 3\\)"):
            s.run({xs: np.ones((3, 2, 3), np.float32)})
        with pytest.raises(popart.popart_exception, match="data type int32"):
            s.run({xs: np.ones((3, 2, 2), np.int32)})
        outs = s.create_host_outputs()
        assert outs[out].shape == (3, 2, 2)
        s.run_with_outputs({xs: x}, outs)
        with pytest.raises(ValueError, match="Unexpected/Missing output"):
            s.run_with_outputs({xs: x}, {})
        with pytest.raises(ValueError, match="Shape mismatch for output"):
            s.run_with_outputs({xs: x}, {out: np.zeros((3, 2, 5), np.float32)})


def test_scalar_data_for_a_one_element_stream():
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((1,), popxl.float32, "x")
        d = popxl.d2h_stream((1,), popxl.float32, "y")
        ops.host_store(d, ops.host_load(xs) * 2.0)
    with popxl.Session(ir, "cpu") as s:
        assert s.run({xs: np.float32(3.0)})[d] == 6.0
        assert s.run({xs: torch.tensor([4.0])})[d] == 8.0        # torch tensors are converted


# ---------------------------------------------------------------------------------------
# Tensor properties


def test_tensor_strides_ipu_tile_set_scope_location():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros((2, 3, 4), np.float16))
        for dt, shape in ((np.float16, (2, 3, 4)), (np.int64, (5, 2)), (np.bool_, (3, 3, 2))):
            t = popxl.constant(np.zeros(shape, dt), downcast=False)
            assert t.strides() == np.zeros(shape, dt).strides
        assert a.strides((4, 6)) == np.zeros((4, 6), np.float16).strides
        with pytest.raises(UndefinedValue):
            a.ipu
        assert a.tile_set == "compute" and a.scope == ""
        with popxl.ipu(1):
            b = a + 1.0
            with popxl.io_tiles():
                c = b * 2.0
        assert b.ipu == 1 and b.tile_set == "compute" and c.ipu == 1 and c.tile_set == "io"
        info = a.location_info
        assert not info.isRemote() and not info.isSharded()
        g = ir.create_graph(lambda x: x + 1.0, a)
        assert g.inputs[0].scope == g.id != "" and g.outputs[0].scope == g.id
        assert g.main_graph is ir.main_graph and ir.main_graph.main_graph is ir.main_graph
        assert list(g.inputs_by_name) == ["x"] and g.inputs_by_name["x"] is g.inputs[0]
        h = ir.create_graph(lambda x: ops.call(g, x)[0], a)
        cond_t = ir.create_graph(lambda x: x * 2.0, a)
        ops.call(h, a)
        ops.conditional(popxl.constant(True), cond_t, g, [a], [a])
        assert set(ir.main_graph.called_graphs) == {h, cond_t, g}
        assert h.called_graphs == (g,)


def test_get_ir_op_debug_context_and_op_created_hooks():
    with pytest.raises(RuntimeError):
        popxl.get_ir()
    ir = popxl.Ir()
    main = ir.main_graph
    seen, other = [], []

    @popxl.context.op_debug_context
    def layer(x):
        return inner(x) + 1.0

    @popxl.context.op_debug_context("inner_op")
    def inner(x):
        return x * 2.0

    with main:
        assert popxl.gir() is ir and popxl.get_ir() is ir
        handle = main.register_op_created_hook(lambda n: seen.append(n.op_type))
        sub = ir.create_empty_graph("sub")
        sub.register_op_created_hook(lambda n: other.append(n.op_type))
        x = popxl.variable(np.ones(2, np.float32))
        with popxl.name_scope("blk"):
            y = layer(x)
        nodes = main._g.nodes
        assert nodes[-2].annotations["__debug_context"] == "blk/layer/inner_op"
        assert nodes[-1].annotations["__debug_context"] == "blk/layer"
        ops.relu(y)
        main.remove_op_created_hook(handle)
        ops.relu(y)
        with pytest.raises(ValueError, match="Unknown op created hook"):
            main.remove_op_created_hook(handle)
    assert seen == ["Mul", "Add", "Relu"] and other == []


# ---------------------------------------------------------------------------------------
# dtypes, torch conversion, utils


TORCH_DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.complex64,
                torch.complex128, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fnuz,
                torch.float8_e5m2fnuz]


@pytest.mark.parametrize("tdt", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_converts(tdt):
    dt = popxl.dtype.as_dtype(tdt)
    assert dt.as_torch() is tdt
    assert popxl.dtype.from_name(dt.name) is dt
    src = torch.tensor([1, 0, 3], dtype=torch.int64)
    t = src.to(tdt) if tdt not in (torch.uint16, torch.uint32, torch.uint64) else src.to(torch.int32).to(tdt)
    arr = to_numpy(t, downcast=False)
    assert arr.dtype == dt.as_numpy()
    want = [1, 0, 1] if tdt is torch.bool else [1, 0, 3]
    arr = from_host_fp8(arr)   # float8: PopXL's host records as their values
    np.testing.assert_array_equal(arr.astype(np.complex128 if dt.is_complex else np.float64), want)
    assert popxl.dtype.as_dtype(t) is dt
    with popxl.Ir().main_graph:
        v = popxl.variable(t, downcast=False)
        assert v.dtype is dt


def test_torch_int32_and_complex_data_run_through_a_session():
    ir = popxl.Ir()
    with ir.main_graph:
        i = popxl.variable(torch.tensor([1, 2, 3], dtype=torch.int32), name="i")
        z = popxl.variable(np.array([1 + 2j, -3j], np.complex64), popxl.complex64, name="z")
        zz = popxl.constant(torch.tensor([2 + 0j, 1 + 1j], dtype=torch.complex128), name="zz")
        assert (i.dtype, z.dtype, zz.dtype) == (popxl.int32, popxl.complex64, popxl.complex128)
        assert z.dtype.is_complex and not popxl.float32.is_complex
        di, dz = popxl.d2h_stream((3,), popxl.int32, "di"), popxl.d2h_stream((2,), popxl.complex64, "dz")
        ops.host_store(di, i * 2)
        ops.host_store(dz, ops.identity(z))        # (ONNX arithmetic ops take no complex types)
    with popxl.Session(ir, "cpu") as s:
        out = s.run()
        np.testing.assert_array_equal(s.get_tensor_data(zz), [2 + 0j, 1 + 1j])
    assert out[di].dtype == np.int32 and out[dz].dtype == np.complex64
    np.testing.assert_array_equal(out[di], [2, 4, 6])
    np.testing.assert_array_equal(out[dz], np.array([1 + 2j, -3j], np.complex64))


def test_dtype_lookups_and_errors():
    assert popxl.dtype.from_name("half") is popxl.float16 and popxl.dtype.from_name("complex128") is popxl.complex128
    with pytest.raises(ValueError, match="name: float17"):
        popxl.dtype.from_name("float17")
    assert popxl.dtype.as_dtype(type_value=np.complex64) is popxl.complex64
    assert popxl.dtype.as_dtype(np.zeros(2, np.uint8)) is popxl.uint8
    assert popxl.dtype.as_dtype("float8_143") is popxl.float8_143
    with pytest.raises(ValueError):
        popxl.dtype.as_dtype(object())
    assert popxl.float8_143.as_numpy() == popxl.dtypes.np_dtype_float8_143   # PopXL: the uint8 record
    assert popxl.float8_143.as_device_numpy() == ml_dtypes.float8_e4m3fnuz


def test_utils_to_numpy_and_table_to_string():
    x64 = np.arange(3, dtype=np.float64)
    a = to_numpy(x64)
    assert a.dtype == np.float32 and to_numpy(x64, downcast=False).dtype == np.float64
    assert to_numpy([1, 2]).dtype == np.int32 and to_numpy(2.5).dtype == np.float32
    b = np.arange(3, dtype=np.float32)
    assert not np.shares_memory(to_numpy(b), b) and np.shares_memory(to_numpy(b, copy=False), b)
    assert to_numpy(b, popxl.float16).dtype == np.float16
    assert to_numpy(torch.tensor([1, 2], dtype=torch.int32)).dtype == np.int32
    f8 = to_numpy(np.array([1.0, 300.0], np.float32), popxl.float8_143, log2_scale=-1)
    assert f8.dtype == popxl.dtypes.np_dtype_float8_143          # PopXL's host form: uint8 records
    f8 = f8.view(ml_dtypes.float8_e4m3fnuz)                      # the same bits
    np.testing.assert_array_equal(f8.astype(np.float32), [0.5, 144.0])     # 150 rounds to 144
    e4m3 = ml_dtypes.float8_e4m3fnuz
    assert np.isnan(to_numpy(np.array([500.0], np.float32), popxl.float8_143).view(e4m3).astype(np.float32)[0])
    assert to_numpy(np.array([500.0], np.float32), popxl.float8_143,
                    nan_on_overflow=False).view(e4m3).astype(np.float32)[0] == 240.0
    with pytest.raises(TypeError, match="float8"):
        to_numpy(np.array([1], np.int32), popxl.float8_143)
    with pytest.raises(RuntimeError, match="nan_on_overflow"):
        to_numpy(b, popxl.float32, nan_on_overflow=True)
    rows = [["num", "foo", "name"], [3, "aaab", "args"], [4, "barrrr", "kwargs"], [-1, "who", "popxl"]]
    assert table_to_string(rows) == ("num | foo    | name  \n" + "-" * 22 + "\n"
                                     "3   | aaab   | args  \n"
                                     "4   | barrrr | kwargs\n"
                                     "-1  | who    | popxl \n")
    assert table_to_string(rows, ", ", False).splitlines()[0] == "num, foo   , name  "
