"""popxl model parallelism (src/popxl/_placement.py) with replica-sharded variables, remote
buffers, all-reduces across IPUs and calls of graphs spanning IPUs: the main graph runs
placed on a (replica, ipu) mesh of the suite's 4 host devices, with the numbers of the
unplaced run and of NumPy, each device holding 1/R of its IPU's sharded variables and its
IPU's remote buffers only."""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

import popart
from popart import testing
import popxl
import popxl.ops as ops
from popxl.ops import collectives as C

from test_popxl_placement import (B, D, LR, N, _across_ipus, _assert_close, _graph_on_two_ipus,
                                  _layer, _remote, _repeat_of_a_call_over_two_ipus, _small_ir, data,
                                  numpy_training, run)

R = 2   # replicas; 2 IPUs each


def _rts_layer(i: int, h, fwd, bwd, weights: dict) -> tuple:
    """Layer i of the replica-sharded model on IPU i: its weight gathered from its shard, its
    bias a plain variable; returns (output, update(gradient) -> input gradient)."""
    shard, b = weights[i]
    with popxl.ipu(i):
        info = ops.call_with_info(fwd, h, C.replicated_all_gather(shard), b)

    def update(g):
        with popxl.ipu(i):
            gx, gw, gb = ops.call(bwd.graph, g, inputs_dict=bwd.inputs_dict(info))
            gw = C.replicated_reduce_scatter(gw, "add", configure_output_for_replicated_tensor_sharding=True)
            ops.scaled_add_(shard, gw, b=-LR / R)
            ops.var_updates.copy_var_update_(b, b - C.replicated_all_reduce(gb) * (LR / R))
        return gx
    return info.outputs[0], update


def _remote_layer(i: int, h, fwd, bwd, weights: dict) -> tuple:
    """Layer i of the remote model on IPU i: its weight a remote variable (entry 1 of its
    buffer), its bias a remote replica-sharded variable; loaded, updated and stored there."""
    wbuf, bbuf = weights[i]
    with popxl.ipu(i):
        w, b_shard = ops.remote_load(wbuf, 1), ops.remote_load(bbuf, 0)
        info = ops.call_with_info(fwd, h, w, C.replicated_all_gather(b_shard))

    def update(g):
        with popxl.ipu(i):
            gx, gw, gb = ops.call(bwd.graph, g, inputs_dict=bwd.inputs_dict(info))
            ops.remote_store(wbuf, 1, w - C.replicated_all_reduce(gw) * (LR / R))
            gb = C.replicated_reduce_scatter(gb, "add", configure_output_for_replicated_tensor_sharding=True)
            ops.remote_store(bbuf, 0, b_shard - gb * (LR / R))
        return gx
    return info.outputs[0], update


def model_ir(kind: str) -> tuple:
    """2 replicas of a 2-layer model, layer i on IPU i (ops.ipu_copy between), trained as
    test_popxl_placement.training_ir (loss and gradients averaged over the replicas) with
    its weights replica-sharded (``kind`` "rts") or remote ("remote"). Returns (ir, x stream,
    loss stream, the full variables [w0, b0, w1, b1])."""
    rng = np.random.default_rng(0)
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = N
    spec = popxl.TensorSpec((B, D), popxl.float32)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((B, D), popxl.float32, "x")
        loss_s = popxl.d2h_stream((), popxl.float32, "loss")
        weights, variables = {}, []
        for i in range(2):
            w = rng.normal(size=(D, D)).astype(np.float32) * 0.5
            b = rng.normal(size=D).astype(np.float32)
            with popxl.ipu(i):
                if kind == "rts":
                    var, shard = popxl.replica_sharded_variable(w, name=f"w{i}")
                    weights[i] = (shard, popxl.variable(b, name=f"b{i}"))
                    variables += [var, weights[i][1]]
                else:
                    wbuf = popxl.remote_buffer((D, D), popxl.float32, 2)
                    bbuf = popxl.replica_sharded_buffer((D,), popxl.float32)
                    weights[i] = (wbuf, bbuf)
                    variables += [popxl.remote_variable(w, wbuf, 1, name=f"w{i}"),
                                  popxl.remote_replica_sharded_variable(b, bbuf, 0, name=f"b{i}")]
        fwd = ir.create_graph(_layer, spec, popxl.TensorSpec((D, D), popxl.float32),
                              popxl.TensorSpec((D,), popxl.float32))
        bwd = popxl.transforms.autodiff(fwd)
        layer = _rts_layer if kind == "rts" else _remote_layer
        for _ in range(N):
            with popxl.ipu(0):
                h = ops.host_load(xs)
            h, update0 = layer(0, h, fwd, bwd, weights)
            h, update1 = layer(1, ops.ipu_copy(h, 1), fwd, bwd, weights)
            with popxl.ipu(1):
                ops.host_store(loss_s, C.replicated_all_reduce(ops.sum(h * h) * 0.5) / R)
            update0(ops.ipu_copy(update1(h), 0))
    return ir, xs, loss_s, variables


@contextlib.contextmanager
def session_log():
    """The messages the "session" logger writes at INFO level inside the block."""
    logger, messages = logging.getLogger("popart.session"), []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    level = popart.getLogger("session").getLevel()
    popart.getLogger("session").setLevel("INFO")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        popart.getLogger("session").setLevel(level)


def _run_both(kind: str, x: np.ndarray) -> dict:
    """The model run placed (4 devices: 2 replicas of 2 IPUs) and unplaced (a device of R
    IPUs: one device per replica): run()'s results, the placed session's log and state."""
    ir, *rest = model_ir(kind)
    with session_log() as log:
        placed = run(ir, *rest, "ipu_model", x)
    variables = rest[2]
    ir, *rest = model_ir(kind)
    unplaced = run(ir, *rest, popart.DeviceManager().createIpuModelDevice({"numIPUs": R}), x)
    initial = list(ir._variable_data.values())
    return {"placed": placed, "unplaced": unplaced, "log": log, "initial": initial,
            "variables": variables}


@pytest.fixture(scope="module")
def rts() -> dict:
    return _run_both("rts", data(2, R))


@pytest.fixture(scope="module")
def remote() -> dict:
    with pytest.MonkeyPatch.context() as mp:   # remote buffers in host memory between runs
        mp.setenv("POPXL_REMOTE_MEMORY_KIND", "pinned_host")
        return _run_both("remote", data(2, R))


def _check_values(res: dict) -> None:
    """Placed: a mesh of 2 replicas x 2 IPUs (log line); losses and variables (after the
    first run and at the end) those of the unplaced run and of NumPy."""
    s = res["placed"][3]
    assert testing.is_placed(s) and testing.mesh_shape(s) == (R, 2)
    assert not testing.is_placed(res["unplaced"][3])
    assert any("the main graph runs placed, 5 stage(s) on the devices of 2 IPUs" in m for m in res["log"])
    assert not any("runs on one device per replica" in m for m in res["log"])
    for a, b in zip(res["placed"][:3], res["unplaced"][:3]):
        _assert_close(a, b)
    losses, final = numpy_training(res["initial"], data(2, R))
    np.testing.assert_allclose(res["placed"][0][..., 0], losses, rtol=1e-5)
    _assert_close(res["placed"][2], final)


def _device_elements(s: popxl.Session) -> dict:
    """Elements of the session's state per device."""
    out: dict = {}
    for arr in testing.device_values(s).values():
        for sh in arr.addressable_shards:
            out[sh.device] = out.get(sh.device, 0) + sh.data.size
    return out


def test_replica_sharded_variables_placed_equal_the_unplaced_run_and_numpy(rts):
    _check_values(rts)


def test_each_device_holds_its_ipus_shards_only(rts):
    """Device (r, i) holds shard r of IPU i's sharded weight (D*D/R elements) and IPU i's
    bias: nothing of the other IPU's variables; one device per replica unplaced holds both
    IPUs' shards and biases."""
    s, variables = rts["placed"][3], rts["variables"]
    placed, mesh = testing.step_program(s), testing.step_program(s).mesh.devices
    assert set(_device_elements(s).values()) == {D * D // R + D}
    assert set(_device_elements(rts["unplaced"][3]).values()) == {2 * (D * D // R + D)}
    for i, var in enumerate(variables[::2]):
        assert placed.home[var._shard.id] == i
        ipu, key, shape = placed.layout.slots[var._shard.id]
        assert shape == (D * D // R,)
        full = s.get_tensor_data(var).reshape(-1)
        for sh in testing.device_values(s)[key].addressable_shards:
            r, j = sh.index[0].start, sh.index[1].start
            assert sh.device == mesh[r, j] and sh.data.shape == (1, 1, D * D // R)
            if j == ipu:
                np.testing.assert_array_equal(np.asarray(sh.data)[0, 0], full[r * shape[0]:(r + 1) * shape[0]])


def test_remote_variables_placed_equal_the_unplaced_run_and_numpy(remote):
    _check_values(remote)


def test_remote_buffers_live_with_the_ipu_loading_them_in_host_memory(remote):
    """Buffer i (remote weight: 2 entries of [D, D]; remote sharded bias: one shard of D/R)
    is with IPU i, in its slots only on IPU i's devices, in pinned_host memory as unplaced."""
    s = remote["placed"][3]
    placed = testing.step_program(s)
    assert s.remote_memory_kind == "pinned_host"
    assert all(arr.sharding.memory_kind == "pinned_host" for arr in testing.device_values(s).values())
    assert set(_device_elements(s).values()) == {2 * D * D + D // R}
    assert set(_device_elements(remote["unplaced"][3]).values()) == {2 * (2 * D * D + D // R)}
    buffers = [slot for slot in s._slots if slot.buffer is not None]
    assert [placed.home[slot.graph_in] for slot in buffers] == [0, 0, 1, 1]
    for slot in buffers:   # the entries of the remote variables in their IPU's blocks
        ipu, key, shape = placed.layout.slots[slot.graph_in]
        host = s._buffer_host[slot.key]
        for sh in testing.device_values(s)[key].addressable_shards:
            if sh.index[1].start == ipu:
                np.testing.assert_array_equal(np.asarray(sh.data)[0, 0], host[sh.index[0].start])


def _spanning_graph(x, home: int) -> tuple:
    """(a graph whose ops span IPUs 0 and 1, updating on IPU 1 a variable it takes by
    reference, first read on IPU ``home``; that variable)."""
    def body(t, v: popxl.TensorByRef):
        with popxl.ipu(0):
            t = t * (v if home == 0 else 2.0)
        with popxl.ipu(1):
            ops.var_updates.accumulate_(v, t)
            return t * v + 1.0, t
    with popxl.ipu(home):
        v = popxl.variable(np.array([1.0, 2.0, 3.0], np.float32), name="v")
    return popxl.gir().create_graph(body, x, v), v


def _call_with_a_variable(x):
    """The spanning graph called twice on IPU 0, its variable on IPU 0 (updated on IPU 1)."""
    g, v = _spanning_graph(x, 0)
    with popxl.ipu(0):
        a, b = ops.call(g, x, v)
        a, _ = ops.call(g, a, v)
    with popxl.ipu(1):
        return a + b + v


def _repeat_of_a_call_with_a_variable(x):
    """A graph calling the spanning graph (its variable on IPU 1), repeated 3 times."""
    g, v = _spanning_graph(x, 1)

    def step(t, w: popxl.TensorByRef):
        return ops.call(g, t, w)[0]
    with popxl.ipu(0):
        y = ops.repeat(popxl.gir().create_graph(step, x, v), 3, x, v)[0]
    with popxl.ipu(1):
        return y + v


def _all_reduce_gradients(x):
    """All-reduces across IPUs 0 and 1 (plain, identical inputs / grad inputs, max) and
    their gradients (autodiff)."""
    with popxl.ipu(1):
        x1 = x * popxl.constant(np.array([0.5, 4.0, -1.0], np.float32))
    out = C.all_reduce([x, x1], op="max")[1]
    for f in (C.all_reduce, C.all_reduce_identical_inputs, C.all_reduce_identical_grad_inputs):
        spec = popxl.TensorSpec((3,), popxl.float32)
        fwd = popxl.gir().create_graph(lambda a, b, f=f: ops.sum(f([a, b], [0, 1])[1] ** 2), spec, spec)
        bwd = popxl.transforms.autodiff(fwd)
        info = ops.call_with_info(fwd, x, x1)
        with popxl.ipu(1):
            g0, g1 = ops.call(bwd.graph, popxl.constant(np.float32(1)), inputs_dict=bwd.inputs_dict(info))
            out = out + g0 * g1 + info.outputs[0]
    return out


@pytest.mark.parametrize("build", [_remote, _across_ipus, _all_reduce_gradients, _graph_on_two_ipus,
                                   _call_with_a_variable, _repeat_of_a_call_over_two_ipus,
                                   _repeat_of_a_call_with_a_variable],
                         ids=["remote buffer of IPU 1", "all_reduce across IPUs", "all_reduce gradients",
                              "graph of IPU 0 called on IPU 1", "call spanning IPUs",
                              "repeat of a call spanning IPUs", "... with a variable"])
def test_remote_buffers_all_reduce_and_calls_across_ipus_run_placed(build):
    """Placed (a log line says so) with the values of the unplaced run, over two runs (the
    variables updated in place)."""
    x = np.array([1.0, -1.0, 0.5], np.float32)
    got = []
    for device in ("ipu_model", "cpu"):
        ir, xs, ys = _small_ir(build)
        with session_log() as log:
            s = popxl.Session(ir, device)
        assert testing.is_placed(s) == (device == "ipu_model")
        assert any("runs placed" in m for m in log) == (device == "ipu_model")
        with s:
            got.append([s.run({xs: x})[ys] for _ in range(2)] + [s.get_tensor_data(v) for v in ir._variables])
    _assert_close(got[0], got[1])
