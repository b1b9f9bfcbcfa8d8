"""popxl behaviours as PopXL has them (PopART's python/popxl/python_files), issue 37's popxl
part: np.memmap variables through the session, write_variable_data's messages, float8 host
data as PopXL's uint8 records, the session's device setter, CallSiteInfo.
set_parent_input_modified (calls and repeats), grouped reduce-scatter and grouped remote
variables, and AllReduce's gradient graph (only gradients in)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import popart
import popxl
import popxl.ops as ops
from popxl import fp8_utils
from popxl.dtypes import np_dtype_float8_143, np_dtype_float8_152
from popxl.ops import collectives as C

F32 = popxl.float32


# ---------------------------------------------------------------------------------------
# One cheap session: a variable from an np.memmap, float8 variables and streams

@pytest.fixture(scope="module")
def host_case(tmp_path_factory):
    path = tmp_path_factory.mktemp("mm") / "w.bin"
    mm = np.memmap(str(path), dtype=np.float32, mode="w+", shape=(2, 3))
    mm[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    x8 = fp8_utils.host_pow2scale_cast_to_fp8(np.array([[0.5, -2.0, 3.0]], np.float32),
                                              popxl.float8_143)
    ir = popxl.Ir()
    with ir.main_graph:
        w = popxl.variable(mm, name="w")
        ops.var_updates.accumulate_(w, popxl.constant(np.ones((2, 3), np.float32)))
        v8 = popxl.variable(x8, popxl.float8_143, name="v8")
        c8 = popxl.constant([1.0, 2.0], popxl.float8_152, name="c8")
        h8 = popxl.h2d_stream((1, 3), popxl.float8_143, "in8")
        d8 = popxl.d2h_stream((1, 3), popxl.float8_143, "out8")
        ops.host_store(d8, ops.host_load(h8))
        dv = popxl.d2h_stream((1, 3), popxl.float8_143, "v8_out")
        ops.host_store(dv, v8)
    s = popxl.Session(ir, "cpu")
    return dict(s=s, mm=mm, path=path, x8=x8, w=w, v8=v8, c8=c8, h8=h8, d8=d8, dv=dv)


def test_get_tensor_data_returns_the_very_memmap(host_case):
    s, mm, w = host_case["s"], host_case["mm"], host_case["w"]
    assert s.get_tensor_data(w) is mm                       # PopXL: t._memmap_arr itself
    with s:
        s.run({host_case["h8"]: host_case["x8"]})
        got = s.get_tensor_data(w)
        assert got is mm                                    # written into and flushed
    np.testing.assert_array_equal(mm, np.arange(6).reshape(2, 3) + 1)
    on_disk = np.fromfile(str(host_case["path"]), np.float32).reshape(2, 3)
    np.testing.assert_array_equal(on_disk, np.arange(6).reshape(2, 3) + 1)


def test_write_variable_data_messages_are_popxls(host_case):
    s, w, v8 = host_case["s"], host_case["w"], host_case["v8"]
    with pytest.raises(TypeError) as e:
        s.write_variable_data(w, np.zeros((2, 3), np.int32))
    assert str(e.value) == ("The dtype of the input array int32 must match the equivalent type "
                            "of the tensor w : popxl.dtypes.float32")
    with pytest.raises(ValueError) as e:
        s.write_variable_data(w, np.zeros((3, 2), np.float32))
    assert str(e.value) == ("The shape of the input array (3, 2) must match the shape of the "
                            "tensor w : (2, 3)")
    with pytest.raises(TypeError) as e:
        s.write_variable_data(v8, 1.0)
    assert str(e.value) == ("Data for variable v8 must be passed in as an np.array with dtype "
                            "[('float8_143', 'u1')] (see popxl.fp8_utils.host_pow2scale_cast_to_fp8)")
    with pytest.raises(TypeError, match="input array float32 must match .* v8 : popxl.dtypes.float8_143"):
        s.write_variable_data(v8, np.zeros((1, 3), np.float32))


def test_memmap_with_a_non_const_grouping_warns_popxls_text(tmp_path, caplog):
    mm = np.memmap(str(tmp_path / "g.bin"), dtype=np.float32, mode="w+", shape=(2, 3))
    ir = popxl.Ir(replication=4)
    with caplog.at_level(logging.WARNING, logger="popart"), ir.main_graph:
        v = popxl.variable(mm, replica_grouping=ir.replica_grouping_from_assignments([0, 1, 1, 0]),
                           name="g")
    text = ("In creation of variable g, you have passed np.memmap data and a non-const replica "
            "grouping, which requires us to make a copy of your np.memmap data. Your variable "
            "will be treated as NOT an np.memmap.")
    assert text in caplog.messages
    assert v._memmap_arr is None


# ---------------------------------------------------------------------------------------
# float8 host data: PopXL's uint8 records (fp8_utils.py:287-291)

def _torch_bits(x: np.ndarray, fmt: torch.dtype) -> np.ndarray:
    """PyTorch's float8 (Graphcore's formats, "fnuz") bits of ``x``: the reference."""
    return torch.tensor(x).to(fmt).view(torch.uint8).numpy()


@pytest.mark.parametrize("dt,np_dt,fmt", [(popxl.float8_143, np_dtype_float8_143, torch.float8_e4m3fnuz),
                                          (popxl.float8_152, np_dtype_float8_152, torch.float8_e5m2fnuz)])
def test_host_fp8_conversions_give_and_take_uint8_records(dt, np_dt, fmt):
    x = np.array([[0.0, 1.0, -2.0], [0.3, 100.0, -1e-3]], np.float32)
    got = fp8_utils.host_pow2scale_cast_to_fp8(x, dt, 1)
    assert got.dtype == np_dt and got.dtype == np.dtype([(dt.name, "u1")]) and got.shape == x.shape
    np.testing.assert_array_equal(got[dt.name], _torch_bits(x * 2, fmt))
    assert fp8_utils.host_pow2scale_cast_to_fp8(np.float32(1.0), dt).view(np.uint8) == 0x40
    big = fp8_utils.host_pow2scale_cast_to_fp8(np.array([1e6], np.float32), dt)
    assert big.view(np.uint8)[0] == 0x80                     # NaN (the one NaN of the format)
    sat = fp8_utils.host_pow2scale_cast_to_fp8(np.array([1e6], np.float32), dt, nan_on_overflow=False)
    assert sat.view(np.uint8)[0] == 0x7F                     # the largest magnitude
    special = np.array([np.inf, -np.inf, np.nan], np.float32)    # never saturated: NaN
    np.testing.assert_array_equal(
        fp8_utils.host_pow2scale_cast_to_fp8(special, dt, nan_on_overflow=False).view(np.uint8),
        _torch_bits(special, fmt))
    back = fp8_utils.host_pow2scale_cast_from_fp8(got, popxl.float32, -1)
    ref = torch.tensor(_torch_bits(x * 2, fmt)).view(fmt).to(torch.float32).numpy() / 2
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, ref)
    with pytest.raises(RuntimeError, match="src.dtype float32 not currently supported"):
        fp8_utils.host_pow2scale_cast_from_fp8(x, popxl.float32)
    assert popxl.dtype.as_dtype(np_dt) is dt
    u = popxl.utils.to_numpy(x, dt)                          # to_numpy's float8 form too
    assert u.dtype == np_dt
    np.testing.assert_array_equal(u.view(np.uint8), _torch_bits(x, fmt))


def test_session_float8_data_are_uint8_records(host_case):
    s, x8, v8, c8 = host_case["s"], host_case["x8"], host_case["v8"], host_case["c8"]
    with s:
        out = s.run({host_case["h8"]: x8})
        assert out[host_case["d8"]].dtype == np_dtype_float8_143
        np.testing.assert_array_equal(out[host_case["d8"]], x8)
        np.testing.assert_array_equal(out[host_case["dv"]], x8)
        got = s.get_tensor_data(v8)
        assert got.dtype == np_dtype_float8_143
        np.testing.assert_array_equal(got.view(np.uint8), _torch_bits(
            np.array([[0.5, -2.0, 3.0]], np.float32), torch.float8_e4m3fnuz))
        c = s.get_tensor_data(c8)
        assert c.dtype == np_dtype_float8_152
        np.testing.assert_array_equal(c.view(np.uint8), _torch_bits(np.array([1.0, 2.0], np.float32),
                                                                    torch.float8_e5m2fnuz))
        new = fp8_utils.host_pow2scale_cast_to_fp8(np.array([[7.0, -0.25, 1.5]], np.float32),
                                                   popxl.float8_143)
        s.write_variable_data(v8, new)                       # takes the records
        np.testing.assert_array_equal(s.get_tensor_data(v8), new)
        outs = s.create_host_outputs()
        assert outs[host_case["dv"]].dtype == np_dtype_float8_143
        s.run_with_outputs({host_case["h8"]: new}, outs)     # written into the caller's records
        np.testing.assert_array_equal(outs[host_case["dv"]], new)
        np.testing.assert_array_equal(outs[host_case["d8"]], new)
        raw = np.array([[0x40, 0xC8, 0x7F]], np.uint8)      # bytes: as PopXL's run sends them
        out = s.run({host_case["h8"]: raw})[host_case["d8"]]
        np.testing.assert_array_equal(out.view(np.uint8), raw)
        np.testing.assert_array_equal(fp8_utils.host_pow2scale_cast_from_fp8(out, popxl.float32),
                                      [[1.0, -2.0, 240.0]])


# ---------------------------------------------------------------------------------------
# Session.device: PopXL's Session has none, so assigning it changes nothing (PopXL's
# test_session.py does); _set_device moves the session

def test_assigning_device_leaves_the_session_on_its_device(host_case):
    s, w = host_case["s"], host_case["w"]
    own = s.device
    before = s.get_tensor_data(w).copy()
    other = popart.DeviceManager().createCpuDevice()
    assert other.isAttached                                  # a CPU device comes attached
    s.device = other                                         # a plain attribute, as in PopXL
    assert s.device is other and s._device is own and not s.is_attached
    with s:                                                  # attaches its own device
        s.run({host_case["h8"]: host_case["x8"]})
        assert own.isAttached
    assert not s.is_attached and not own.isAttached
    np.testing.assert_array_equal(s.get_tensor_data(w), before + 1)
    s._set_device(other)                                     # PopXL's: the session moves
    assert s._device is other and s.is_attached              # the session follows its device
    s.run({host_case["h8"]: host_case["x8"]})                # the weights went to it first
    np.testing.assert_array_equal(s.get_tensor_data(w), before + 2)
    other.detach()
    assert not s.is_attached
    with pytest.raises(TypeError, match="popart.DeviceInfo, not str"):
        s._set_device("cpu")
    # a device the program was not built for is taken, but using it raises (Poplar's targets)
    dm = popart.DeviceManager()
    for wrong in (dm.createIpuModelDevice({"numIPUs": 1}), dm.createIpuModelDevice({"numIPUs": 2})):
        wrong.detach()
        s._set_device(wrong)
        assert s._device is wrong
        with pytest.raises(popart.poplar_runtime_error,
                           match=f"compiled for device type Cpu with 1 IPU\\(s\\); it cannot run on "
                                 f"device {wrong.id} of type IpuModel with {wrong.numIpus} IPU"):
            s.__enter__()
        assert not wrong.isAttached
    s._set_device(own)                                       # back on a device it runs on
    with s:
        s.run({host_case["h8"]: host_case["x8"]})
    np.testing.assert_array_equal(s.get_tensor_data(w), before + 3)


# ---------------------------------------------------------------------------------------
# CallSiteInfo.set_parent_input_modified (ops/call.py:137) and repeat

def test_set_parent_input_modified_for_calls_and_repeats():
    ones = np.ones(2, np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        def body(x, y):
            ops.var_updates.accumulate_(y, popxl.constant(ones))   # in place on a by-value input
            return x + y
        spec = popxl.TensorSpec((2,), F32)
        g = ir.create_graph(body, spec, spec)
        x = popxl.variable(np.zeros(2, np.float32), name="x")
        plain = popxl.variable(np.zeros(2, np.float32), name="plain")
        called = popxl.variable(np.zeros(2, np.float32), name="called")
        first = ops.call_with_info(g, x, plain)                   # by value: plain unchanged
        info = ops.call_with_info(g, x, called)
        later = popxl.variable(np.zeros(2, np.float32), name="later")
        i = info._op.inIndex(called._pb_tensor)
        assert info.parent_to_graph_input_index(i) == 1 and info.graph_to_parent_input_index(1) == i
        info.set_parent_input_modified(called)                   # from now on called is 1
        ops.call(g, x, later)                                     # a later call: by value still
        assert info._op.modifiesIndex(1) and not info._op.modifiesIndex(0)
        assert not first._op.modifiesIndex(1)                     # PopART: per op
        g2 = ir.create_graph(lambda a, b: ops.add(a, b), spec, spec)   # no op modifies b
        kept = popxl.variable(np.zeros(2, np.float32), name="kept")
        ops.call_with_info(g2, x, kept).set_parent_input_modified(kept, infer_modified_regions=True)
        rx = popxl.variable(np.zeros(2, np.float32), name="rx")
        looped = popxl.variable(np.zeros(2, np.float32), name="looped")
        r = ops.repeat_with_info(g, 3, rx, looped)
        j = r._op.inIndex(looped._pb_tensor)
        assert j == 3 and r.parent_to_graph_input_index(j) == 1   # after the trip count, condition
        r.set_parent_input_modified(looped)
        streams = {}
        for k, t in {"plain": plain, "called": called, "later": later, "kept": kept, "looped": looped,
                     "rx": r.outputs[0], "call_out": info.outputs[0]}.items():
            streams[k] = popxl.d2h_stream(t.shape, t.dtype, k)
            ops.host_store(streams[k], t)
    with popxl.Session(ir, "cpu") as s:
        out = s.run()
    got = {k: out[st] for k, st in streams.items()}
    np.testing.assert_array_equal(got["plain"], 0 * ones)
    np.testing.assert_array_equal(got["called"], ones)
    np.testing.assert_array_equal(got["later"], 0 * ones)
    np.testing.assert_array_equal(got["call_out"], ones)          # x + the modified y
    np.testing.assert_array_equal(got["kept"], 0 * ones)          # nothing inferred: unchanged
    # repeat: looped goes 1, 2, 3 and rx gathers 1 + 2 + 3
    np.testing.assert_array_equal(got["looped"], 3 * ones)
    np.testing.assert_array_equal(got["rx"], 6 * ones)


# ---------------------------------------------------------------------------------------
# Grouped reduce-scatter, grouped remote variables

def _groups(r: int, stride: int, size: int) -> list[list[int]]:
    """PopART's groups: ``size`` replicas ``stride`` apart, block by block."""
    return [[f + i * stride for i in range(size)] for f in range(r) if f % (stride * size) < stride]


@pytest.mark.parametrize("stride", [1, 2])
def test_grouped_reduce_scatter_and_grouped_remote_variables(stride):
    R, size = 4, 2
    x = np.arange(R * 6, dtype=np.float32).reshape(R, 6) - 7
    data = np.arange(2 * 6, dtype=np.float32).reshape(2, 6)       # one value per group
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        grp = ir.replica_grouping(stride=stride, group_size=size)
        xs = popxl.h2d_stream((6,), F32, "x")
        t = ops.host_load(xs)
        out = {"rs": C.replicated_reduce_scatter(t, "add", grp)}
        buf = popxl.RemoteBuffer((6,), F32, 1)
        rv = popxl.remote_variable(data, buf, 0, replica_grouping=grp, name="rv")
        out["rv"] = ops.remote_load(buf, 0)
        sbuf = popxl.replica_sharded_buffer((2, 6), F32, grp)
        sv = popxl.remote_replica_sharded_variable(data * 10, sbuf, 0, replica_grouping=grp, name="sv")
        one = ir.replica_grouping(stride=1, group_size=R)          # one group: data (1, 1)
        b1 = popxl.RemoteBuffer((1,), popxl.int32, 1)
        r1 = popxl.remote_variable(np.array([[5]], np.int32), b1, 0, replica_grouping=one, name="r1")
        out["r1"] = ops.remote_load(b1, 0)                         # the buffer's shape, (1,)
        with pytest.raises(ValueError, match="does not match buffer"):   # 2 elements for 1
            popxl.remote_variable(np.array([[5, 6]], np.int32), popxl.RemoteBuffer((1,), popxl.int32, 1))
        shard = ops.remote_load(sbuf, 0)
        out["sv"] = C.replicated_all_gather(shard, group=grp)
        ops.remote_store(sbuf, 0, shard + 1)
        streams = {k: popxl.d2h_stream(v.shape, v.dtype, k) for k, v in out.items()}
        for k, v in out.items():
            ops.host_store(streams[k], v)
    with popxl.Session(ir, "ipu_model") as s:
        o = s.run({xs: x})
        got_sv = s.get_tensor_data(sv)
        got_rv = s.get_tensor_data(rv)
        got_r1 = s.get_tensor_data(r1)
    assert r1.shape == (1, 1) and got_r1.shape == (1, 1) and got_r1[0, 0] == 5   # as PopXL
    np.testing.assert_array_equal(o[streams["r1"]], np.full((R, 1), 5))
    for gi, members in enumerate(_groups(R, stride, size)):
        total = x[members].sum(0)
        for rank, rep in enumerate(members):
            np.testing.assert_array_equal(o[streams["rs"]][rep], total[3 * rank:3 * rank + 3])
            np.testing.assert_array_equal(o[streams["rv"]][rep], data[gi])
            np.testing.assert_array_equal(o[streams["sv"]][rep], data[gi] * 10)
    np.testing.assert_array_equal(got_sv, data * 10 + 1)         # each group's shards, stored back
    np.testing.assert_array_equal(got_rv, data)


# ---------------------------------------------------------------------------------------
# AllReduce's gradient reads only gradients (willow/src/op/collectives/allreduce.cpp:131)

@pytest.mark.parametrize("fn", [C.all_reduce, C.all_reduce_identical_inputs,
                                C.all_reduce_identical_grad_inputs])
def test_all_reduce_grad_graph_takes_only_gradients(fn):
    ir = popxl.Ir()
    with ir.main_graph:
        spec = popxl.TensorSpec((3,), F32)
        fwd = ir.create_graph(lambda a, b: tuple(fn([a, b], [0, 1])), spec, spec)
        bwd = popxl.transforms.autodiff(fwd)
    kinds = [e.connection_type for e in bwd.expected_inputs]
    assert kinds == [popxl.transforms.ExpectedConnectionType.FwdGrad] * 2
    assert [e.fwd_tensor for e in bwd.expected_inputs] == list(fwd.outputs)
    assert len(bwd.graph.inputs) == 2


def test_memmap_downcast_message_prints_the_dtype_argument(tmp_path):
    """PopXL's utils.to_numpy prints the `dtype` argument (None when not given), not the
    array's dtype."""
    f64 = np.memmap(str(tmp_path / "d.bin"), dtype=np.float64, mode="w+", shape=(3,))
    with popxl.Ir().main_graph:
        with pytest.raises(ValueError) as e:
            popxl.variable(f64)
        assert str(e.value) == ("When passing a memory-mapped NumPy array, the dtype None is not "
                                "supported, as it requires downcasting the array into a new array "
                                "with a dtype supported by PopXL.")
        with pytest.raises(ValueError, match="the dtype popxl.dtypes.float64 is not supported"):
            popxl.variable(f64, popxl.float64)
        with pytest.raises(ValueError) as e:
            popxl.variable(f64, popxl.float32)
        assert str(e.value) == ("When passing a memory-mapped NumPy array, the `dtype` parameter "
                                "must be None or the same as the array's dtype")


def test_call_input_checks_are_popxls():
    """PopXL's ops.call validation texts (ops/call.py _prep_and_validate_inputs) and PopART's
    CallOp::setup text for an input of another type or shape (willow/src/op/call.cpp:63)."""
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.float32(1), name="a")
        g = ir.create_graph(lambda x, y: x + y, a, a)
        x, y = g.inputs
        with pytest.raises(ValueError) as e:
            ops.call(g, a, a, a)
        assert str(e.value) == ("Too many inputs have been provided to the called graph. The number "
                                f"of positional inputs exceeds the number of inputs of the graph. "
                                f"3 > 2. For graph: {g}")
        with pytest.raises(ValueError) as e:
            ops.call(g, a, inputs_dict={x: a})
        assert str(e.value) == ("Graph input tensor is specified twice for the called graph, in "
                                f"`inputs_dict` and positionally in `inputs`: {x}")
        with pytest.raises(ValueError) as e:
            ops.call(g, a)
        text = str(e.value)
        assert text.startswith(f"Not enough inputs have been provided for the called graph ({g}).\n\n"
                               "Missing inputs:\nIndex | Graph Tensor")
        missing, connected = text.split("\n\n\nConnected inputs:\n")   # PopXL's tables
        assert missing.splitlines()[-1] == f"1     | {y.id}"
        rows = connected.splitlines()
        assert rows[0].split(" | ") == ["Index", "Graph Tensor".ljust(len(x.id)), "Parent Graph Tensor"]
        assert set(rows[1]) == {"-"} and rows[2].split(" | ") == ["0    ", x.id, "a".ljust(19)]
        with pytest.raises(TypeError) as e:
            ops.call(g, "s", a)
        assert str(e.value) == ('Input at position "0" could not be coerced into a tensor for the '
                                "called graph: Type <class 'str'>. Value: s")
        gi = ir.create_graph(lambda v: v, popxl.variable(np.int32(1)))
        with pytest.raises(TypeError):                      # np.asarray(None, int32) fails so
            ops.call(gi, None)
        h = popxl.variable(np.float16(1), name="h")
        with pytest.raises(popart.popart_exception) as e:
            ops.call(g, a, h)
        assert str(e.value) == ("CallOp input (@1) does not match callee input tensor (@1):\n"
                                f"   h -> {y.id}\n   FLOAT16 [] vs FLOAT   []")
        with pytest.raises(popart.popart_exception, match=r"FLOAT   \[2\] vs FLOAT   \[\]"):
            ops.call(g, popxl.variable(np.ones(2, np.float32)), a, )
        assert ops.call(g, 2.0, a)[0].dtype == popxl.float32   # a value: a constant of x's type
