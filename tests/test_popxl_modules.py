"""PopXL's module tree: every module of PopART's popxl package imports with its names (from
the audit's spec), PopXL's per-op modules hold popxl.ops' own objects (popxl.ops.add stays the
function), and the helpers those modules define (ops.utils, collectives.collectives,
var_updates, log2, create_random_seed, grouped_scatter_reduce, slice / reshape helpers,
ConditionalSiteInfo, fp8_utils' histogram scale, session / streams / utils / testing /
typing_ / merge_exchange) behave as PopXL's, checked against NumPy."""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from test_popxl_ops import _run

RNG = np.random.default_rng(5)
SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools", "api_audit", "spec_modules.json")
# the popxl modules that need PopART's C++ IR binding and so are not provided (none)
NOT_PROVIDED: set = set()


def _spec() -> dict:
    if not os.path.exists(SPEC):
        pytest.skip("the audit's spec_modules.json is not beside the project")
    with open(SPEC) as f:
        return {k: v for k, v in json.load(f)["modules"].items() if v["package"] == "popxl"}


def test_every_popxl_module_imports_with_its_names():
    missing = []
    for mod, entry in _spec().items():
        m = importlib.import_module(mod)
        missing += [f"{mod}.{n}" for n in entry["names"] if not hasattr(m, n)]
    assert not missing, missing


def test_op_modules_hold_the_package_objects_and_package_attributes_stay_functions():
    import popxl.ops.add  # noqa: F401
    from popxl.ops.add import add_
    from popxl.ops.conv import PadType, conv
    from popxl.ops.negative_log_likelihood import REDUCTION_TYPE, nll_loss
    assert conv is ops.conv and add_ is ops.add_ and nll_loss is ops.nll_loss
    assert PadType is ops.PadType and REDUCTION_TYPE.__args__ == ("mean", "sum", "none")
    assert callable(ops.add) and ops.add is sys.modules["popxl.ops.add"].add
    assert callable(ops.log2) and ops.log2 is sys.modules["popxl.ops.log"].log2
    assert ops.collectives.all_reduce is sys.modules["popxl.ops.collectives.all_reduce"].all_reduce
    assert callable(ops.var_updates.adam_updater)
    assert ops.remote_code_load is importlib.import_module("popxl.ops.code_copy").remote_code_load
    assert importlib.util.find_spec("popxl.ops.conv").name == "popxl.ops.conv"
    assert importlib.reload(sys.modules["popxl.ops.conv"]).conv is ops.conv and callable(ops.conv)


# ---------------------------------------------------------------------------------------
# ops.utils, collectives.collectives, var_updates.utils


def test_ops_utils_checks():
    from popxl.ops.utils import (cast_if_needed, check_in_graph, check_tensor_ipu_and_tile_set,
                                 convert_optional_float, convert_optional_int64_list, handle_negative_axis)
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.zeros((2, 3), np.float32), name="a")
        with popxl.ipu(0):
            x = a + 1.0
        with popxl.ipu(1):
            y = a + 2.0
        check_in_graph(ir.main_graph, a=a, x=x)
        check_tensor_ipu_and_tile_set(a=a, x=x)            # a's IPU is undefined: not compared
        with pytest.raises(ValueError, match="`x` and `y` are located on different IPUs: 0 != 1"):
            check_tensor_ipu_and_tile_set(x=x, y=y)
        with pytest.raises(TypeError, match="The input `a` is not a Tensor"):
            check_in_graph(ir.main_graph, a=1.0)
        with pytest.raises(Exception, match="keyword arguments"):
            check_in_graph(ir.main_graph, a)
        assert cast_if_needed(a, popxl.float32) is a and cast_if_needed(a, popxl.float16).dtype == popxl.float16
        assert handle_negative_axis(a, -1) == 1 and handle_negative_axis(a, 0) == 0
    sub = ir.create_empty_graph("sub")
    with pytest.raises(ValueError, match="The input tensor `a` is not in the current Graph sub"):
        check_in_graph(sub, a=a)
    assert convert_optional_float(None) is None and convert_optional_float(2) == 2.0
    assert convert_optional_int64_list((1, 2)) == [1, 2]


def test_to_collective_op_and_optimizer_values():
    from popxl.ops.collectives.collectives import OP_MAP, CollectiveOps, to_collective_op
    from popxl.ops.var_updates.utils import handle_optimizer_value
    assert [to_collective_op(o) for o in CollectiveOps.__args__] == list(OP_MAP.values())
    assert to_collective_op("mul") == "Mul"
    with pytest.raises(ValueError, match="Not a valid op: local. Must choose from: add, mean"):
        to_collective_op("local")
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.variable(np.float32(0.5), name="lr")
    ins: dict = {}
    assert handle_optimizer_value(t, ins, 4) == popart.OptimizerValue(0.0, False) and ins == {4: t.id}
    assert handle_optimizer_value(0.25, ins, 5) == popart.OptimizerValue(0.25, True) and 5 not in ins
    assert handle_optimizer_value(None, ins, 6) == popart.OptimizerValue()


# ---------------------------------------------------------------------------------------
# Ops the per-op modules add: numbers against NumPy


def test_module_ops_match_numpy():
    from popxl.ops.random_seed import create_random_seed
    from popxl.ops.scatter_reduce import grouped_scatter_reduce
    from popxl.ops.var_updates.adam_updater import create_adamupdater
    x = RNG.uniform(0.5, 4.0, size=(3, 4)).astype(np.float32)
    data = RNG.normal(size=(2, 5, 3)).astype(np.float32)           # 2 groups
    idx = np.array([[0, 2, 2, 1, 0], [3, 3, 0, 1, 1]], np.int32)
    m, v = RNG.normal(size=4).astype(np.float32), RNG.uniform(0.1, 1, 4).astype(np.float32)
    w = RNG.normal(size=4).astype(np.float32)
    seed = np.array([7, 11], np.uint32)

    def build(ir):
        out = {"log2": ops.log2(popxl.constant(x))}
        s = popxl.constant(seed)
        for i in range(2):
            out[f"seed{i}"] = create_random_seed(s, popxl.constant(np.uint32(i)))
        out["seed0_again"] = create_random_seed(s, popxl.constant(np.uint32(0)))
        d, ix = popxl.constant(data), popxl.constant(idx)
        out["grouped"] = grouped_scatter_reduce(d, ix, "sum", axis=1, axis_size=4, group_size=2)
        out["grouped_max"] = grouped_scatter_reduce(d, ix, "max", axis=1, axis_size=4, group_size=2)
        out["ungrouped"] = grouped_scatter_reduce(d[0], ix[0], "sum", axis_size=3)
        for mode in popart.AdamMode.__members__:
            step = popxl.variable(np.float32(2), name=f"step_{mode}")
            out[mode] = create_adamupdater(popxl.constant(m), popxl.constant(v), {}, mode,
                                           weight=popxl.constant(w), time_step=step, weight_decay=0.1,
                                           beta1=0.9, beta2=0.99, epsilon=1e-3)
        return out
    got, _ = _run(build)
    np.testing.assert_allclose(got["log2"], np.log2(x), rtol=1e-6)
    # PopART's ModifyRandomSeed keeps the seed's first word and draws the second
    assert got["seed0"].dtype == np.uint32 and got["seed0"][0] == seed[0] == got["seed1"][0]
    assert got["seed0"][1] != got["seed1"][1] and np.array_equal(got["seed0"], got["seed0_again"])
    ref, ref_max = np.zeros((2, 4, 3), np.float32), np.full((2, 4, 3), -np.inf, np.float32)
    for g in range(2):
        for j, i in enumerate(idx[g]):
            ref[g, i] += data[g, j]
            ref_max[g, i] = np.maximum(ref_max[g, i], data[g, j])
    np.testing.assert_allclose(got["grouped"], ref, rtol=1e-6)
    written = np.isfinite(ref_max)
    np.testing.assert_allclose(got["grouped_max"][written], ref_max[written], rtol=1e-6)
    ref0 = np.zeros((3, 3), np.float32)
    np.add.at(ref0, idx[0], data[0])
    np.testing.assert_allclose(got["ungrouped"], ref0, rtol=1e-6)
    t = 3.0                                  # the step, incremented first
    mc, vc = m / (1 - 0.9 ** t), v / (1 - 0.99 ** t)
    np.testing.assert_allclose(got["Adam"], mc / (np.sqrt(vc) + 1e-3) + 0.1 * w, rtol=1e-5)
    np.testing.assert_allclose(got["Lamb"], got["Adam"], rtol=1e-6)
    np.testing.assert_allclose(got["AdamNoBias"], m / (np.sqrt(v) + 1e-3) + 0.1 * w, rtol=1e-5)
    np.testing.assert_allclose(got["LambNoBias"], got["AdamNoBias"], rtol=1e-6)
    np.testing.assert_allclose(got["AdaMax"], mc / (v + 1e-3) + 0.1 * w, rtol=1e-5)


def test_module_helpers_and_errors():
    from popxl.ops.code_copy import code_copy, remote_code_load
    from popxl.ops.histogram import check_increment
    from popxl.ops.random_seed import create_random_seed
    from popxl.ops.remote_load import multiply_tuple
    from popxl.ops.reshape import reshape_handle_negative_axis
    from popxl.ops.scatter_reduce import grouped_scatter_reduce
    from popxl.ops.slice import INT_MAX, INT_MIN, process_args
    from popxl.ops.var_updates.adam_updater import create_adamupdater, weight_decay_is_required
    assert multiply_tuple((2, 3, 4)) == 24 and multiply_tuple(()) == 1
    assert process_args(1, 5) == ([1], [5], [1], [0])
    assert process_args([None, 2], step=[-1, None], axis=[2, 0]) == ([-1, 2], [INT_MIN, INT_MAX], [-1, 1], [2, 0])
    with pytest.raises(ValueError, match="`stop` has length 1 != 2"):
        process_args([0, 1], [3])
    check_increment([0.0, 1.0, 2.5])
    with pytest.raises(ValueError, match="not a monotonically increasing list"):
        check_increment([0.0, 1.0, 1.0])
    assert weight_decay_is_required(0.1) and not weight_decay_is_required(0.0)
    assert not weight_decay_is_required(None)
    ir = popxl.Ir()
    g = ir.create_empty_graph("g")
    with ir.main_graph:
        t = popxl.variable(np.zeros((2, 6), np.float32), name="t")
        assert reshape_handle_negative_axis(t, (3, -1)) == (3, 4)
        remote_code_load(g, "executable")                      # nothing to load on XLA
        with pytest.raises(NotImplementedError, match="destination == 'io_buffer'"):
            remote_code_load(g, "io_buffer")
        with pytest.raises(ValueError, match="cannot load the code for the graph it resides in"):
            remote_code_load(ir.main_graph, "executable")
        with pytest.raises(NotImplementedError, match="not yet implemented"):
            code_copy(g, "executable", "executable")
        with pytest.raises(ValueError, match="seed Tensor must be shape=\\(2,\\) dtype=uint32"):
            create_random_seed(t, popxl.constant(np.uint32(0)))
        with pytest.raises(ValueError, match="One of initial_values and axis_size must be specified"):
            grouped_scatter_reduce(t, t, "sum")
        with pytest.raises(ValueError, match="The reduction must be one of"):
            grouped_scatter_reduce(t, t, "mul", axis_size=2)
        with pytest.raises(ValueError, match="AdamMode.Adam requires time_step"):
            create_adamupdater(t, t, {}, "Adam")
        with pytest.raises(ValueError, match="Weight decay requires weight"):
            ops.var_updates.adam_updater(t, t, weight_decay=0.5)


def test_conditional_site_info_maps_both_branches():
    from popxl.ops.conditional import ConditionalSiteInfo
    ir = popxl.Ir()

    def then_fn(a: popxl.Tensor, b: popxl.Tensor) -> popxl.Tensor:
        return a + b

    def else_fn(c: popxl.Tensor) -> popxl.Tensor:
        return -c
    with ir.main_graph:
        a = popxl.variable(np.ones(3, np.float32), name="a")
        b = popxl.variable(np.ones(3, np.float32), name="b")
        c = popxl.variable(np.ones(3, np.float32), name="c")
        cond = popxl.constant(True)
        tg, eg = ir.create_graph(then_fn, a, b), ir.create_graph(else_fn, c)
        info = ops.conditional_with_info(cond, tg, eg, [a, b], [c])
        (out,) = info.outputs
    assert isinstance(info, ConditionalSiteInfo)
    assert info.called_graph == (tg, eg) and info.inputs == (cond, a, b, c) and info.outputs == (out,)
    assert info.graph_to_parent_input_index(1) == 2 and info.graph_to_parent_input_index(0, False) == 3
    assert [info.is_parent_index_in_then_branch(i) for i in (1, 2, 3)] == [True, True, False]
    assert [info.parent_to_graph_input_index(i) for i in (1, 2, 3)] == [0, 1, 0]
    with pytest.raises(IndexError):
        info.is_parent_index_in_then_branch(0)                # the condition
    assert info.graph_to_parent(eg.inputs[0]) is c and info.graph_to_parent(tg.outputs[0]) is out
    assert info.parent_to_graph(b) is tg.inputs[1] and info.parent_to_graph(c) is eg.inputs[0]
    with pytest.raises(ValueError, match="not a parent graph input"):
        info.parent_to_graph(out)
    with pytest.raises(NotImplementedError):
        info.set_parent_input_modified(a)


def test_pool_and_conv_option_records():
    from popxl.ops.conv import multi_conv_options
    from popxl.ops.pool import receptive_attributes
    from popxl.ops.print_tensor import FLOAT_FORMAT_MAP, PrintTensorFmt
    r = receptive_attributes((2, 2), (1, 1, 1, 1), None, None, None, "same_upper", True)
    assert (r.strides, r.pads, r.outPads, r.auto_pad, r.ceil_mode) == ([2, 2], [1, 1, 1, 1], [], "SAME_UPPER", 1)
    opts = popart.SessionOptions()
    mc = multi_conv_options(opts, None, [0.3], None, None)
    assert mc.availableMemoryProportions == [0.3] and mc.partialsTypes == []
    assert PrintTensorFmt().edgeItems == 3 and FLOAT_FORMAT_MAP["none"] == "None_"


# ---------------------------------------------------------------------------------------
# fp8_utils: PopXL's histogram estimate of the float8 scale


def test_fp8_histogram_scale_helpers():
    from popxl import fp8_utils as f
    assert f.find_exponential_range(f.float8_143_def) == (-10, 7)     # as PopXL's docstring states
    assert f.find_exponential_range(f.float8_152_def) == (-17, 15)
    assert f.find_exponential_range(f.ieee_fp32_no_denorms) == (-126, 127)
    x = (RNG.normal(size=300) * 1e-3).astype(np.float32)
    x[:3] = [0.0, 3e38, 2.0 ** -127]                # underflow and overflow bins
    hist, limits = f.log_histogram(x, f.ieee_fp32_no_denorms)
    assert limits[0] == 2.0 ** -126 and limits[-1] == 2.0 ** 126 and hist.sum() == x.size
    a = np.abs(x.astype(np.float64))
    ref = [np.sum(a < limits[0])] + [np.sum((a >= lo) & (a < hi)) for lo, hi in zip(limits, limits[1:])]
    np.testing.assert_array_equal(hist[:len(limits)], ref)
    assert hist[-1] == np.sum(a >= limits[-1]) == 1
    c = f.CandidateConfig(popxl.float8_143, f.ieee_fp32_no_denorms, f.float8_143_def, np.float32)
    assert (c.format_span, c.quantisation_error) == (18, 2.0 ** -40)
    assert (c.min_src_exp_index, c.max_src_exp_index, c.num_exp_src) == (85, 147, 63)
    clean, _ = f.log_histogram(x[3:], f.ieee_fp32_no_denorms)
    err, bias = f.calculate_candidate_metric(clean / clean.sum(), limits, c, "MSE")
    # host_fp8_mse_scale is this estimate (PopXL negates the bias into a scale)
    assert f.host_fp8_mse_scale(x[3:], popxl.float8_143) == (err, -bias) and err > 0
    with pytest.raises(RuntimeError, match="Only MSE metric is supported"):
        f.calculate_candidate_metric(hist, limits, c)
    assert isinstance(f.torch_imported, bool) and (f.min_scaling_bias, f.max_scaling_bias) == (-31, 31)


# ---------------------------------------------------------------------------------------
# dtypes, utils, streams, session, testing, typing_, transforms.merge_exchange


def test_dtypes_utils_testing_typing():
    import inspect

    from popxl import testing, typing_, utils
    from popxl.dtypes import np_dtype_float8_143, np_dtype_float8_152
    assert np_dtype_float8_143 == np.dtype([("float8_143", "u1")]) and np_dtype_float8_152.itemsize == 1
    assert popxl.dtype.as_dtype(np_dtype_float8_152) == popxl.float8_152
    assert utils.downcast_np_dtypes == {np.dtype("int64"): np.dtype("int32"), np.dtype("uint64"): np.dtype("uint32"),
                                        np.dtype("float64"): np.dtype("float32")}
    assert utils.HW_DEVICE_CONNECTION_TIMEOUT == 10000 and isinstance(utils.torch_imported, bool)
    assert utils._to_device_info("cpu").type == popart.DeviceType.Cpu
    assert utils._to_device_info("ipu_model", 2).numIpus == 2
    assert utils._to_device_info("ipu_hw", 2).type == popart.DeviceType.OfflineIpu
    with pytest.raises(ValueError, match="multiple devices \\(provided: 2\\)"):
        utils._to_device_info("cpu", 2)
    with pytest.raises(ValueError, match="Incorrect device type provided: gpu"):
        utils._to_device_info("gpu")
    ints = testing.get_all_int_dtypes()
    assert ints == [popxl.int8, popxl.int16, popxl.int32, popxl.int64, popxl.uint8, popxl.uint16,
                    popxl.uint32, popxl.uint64]
    assert testing.get_all_int_dtypes(include_signed=False) == ints[4:]
    all_ = testing.get_all_dtypes()
    assert all_[:8] == ints and all_[8:] == [popxl.float8_143, popxl.float8_152, popxl.float16, popxl.float32,
                                             popxl.float64, popxl.complex64, popxl.complex128]
    Id = typing_.NewAliasAnnotation("Id", int)

    def fn(x: Id) -> int:
        return x + 1
    sig = inspect.signature(fn, locals={"Id": Id}, eval_str=True)   # (annotations are strings here)
    assert sig.parameters["x"].annotation is Id and Id.__name__ == "Id"
    with pytest.raises(NotImplementedError, match="Id should only be used as an annotation"):
        Id(1)


def test_streams_and_session_helpers():
    from popxl.session import StreamBufferMaps, d2hStreamBufferMaps, h2dStreamBufferMaps
    from popxl.streams import Stream
    assert StreamBufferMaps.__args__ == (h2dStreamBufferMaps, d2hStreamBufferMaps)
    with pytest.raises(NotImplementedError, match="Cannot construct a popxl.Stream directly"):
        Stream((2,), popxl.float32, "s")
    ir = popxl.Ir()
    with ir.main_graph:
        x_in = popxl.h2d_stream((2,), popxl.float32, "x")
        out = popxl.d2h_stream((2,), popxl.float32, "y")
        ops.host_store(out, ops.host_load(x_in) * 3.0)
    assert isinstance(x_in, Stream) and (x_in.shape, x_in.dtype, x_in.tensor_id) == ((2,), popxl.float32, "x")
    assert x_in.spec.shape == (2,)
    s = popxl.Session(ir, "cpu")
    assert s.ir_ is ir is s.ir
    s._validate_run_inputs({x_in: np.zeros(2, np.float32)})
    s._validate_run_outputs({out: np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="Unexpected/Missing input"):
        s._validate_run_inputs({})
    with pytest.raises(ValueError, match="Shape mismatch for output stream y"):
        s._validate_run_outputs({out: np.zeros(3, np.float32)})
    with s:
        got = s.run({x_in: np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(got[out], [3.0, 6.0])


def test_merge_exchange_blocks():
    from popxl.transforms import io_tile_exchange, merge_exchange
    # as in PopXL, the package attribute is the function, the submodule is in sys.modules
    assert sys.modules["popxl.transforms.merge_exchange"].merge_exchange is merge_exchange
    ir = popxl.Ir()
    with ir.main_graph:
        st = popxl.h2d_stream((2,), popxl.float32, "x")
        buf = popxl.remote_buffer((2,), popxl.float32, 2)
        with merge_exchange():
            x = ops.host_load(st)
        with io_tile_exchange():                      # transfers only: they merge into one op
            ops.remote_store(buf, 0, x)
            y = ops.remote_load(buf, 1)
        with io_tile_exchange(verify_overlap=False):
            z = y * 2.0
        with pytest.raises(RuntimeError, match="More than one Op remained after `io_tile_exchange`"):
            with io_tile_exchange():
                ops.remote_store(buf, 1, z + 1.0)
    assert ir.main_graph._g.nodes[-1].op_type == "RemoteStore"
