"""popxl model parallelism (src/popxl/_placement.py): a main graph with ops on several IPUs
runs with each IPU on its own device (the suite's 4 host devices), each device holding only
its IPU's variables, with the numbers of the whole graph on one device; what the placed
program lacks runs unplaced with a log line."""
from __future__ import annotations

import numpy as np
import pytest

import popart
from popart import testing
import popxl
import popxl.ops as ops
from helpers.popxl_case import gather_on_ipu1

B, D, N, LR = 2, 4, 2, 0.1   # batch, width, host transfers per run, learning rate


def _layer(x, w, b):
    return ops.tanh(x @ w + b)


def training_ir(ipus: list, R: int = 1) -> tuple:
    """Layer i, tanh(h @ w_i + b_i), on IPU ``ipus[i]`` (ops.ipu_copy between IPUs); loss
    sum(h^2) / 2; per host transfer the gradients of each layer's graph (autodiff, called on
    its IPU), all-reduced over the replicas, update w_i (accumulate_) and b_i
    (copy_var_update_). Returns (ir, x stream, loss stream, variables)."""
    rng = np.random.default_rng(0)
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = N
    spec = popxl.TensorSpec((B, D), popxl.float32)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((B, D), popxl.float32, "x")
        loss_s = popxl.d2h_stream((), popxl.float32, "loss")
        ws = []
        for i, ipu in enumerate(ipus):
            with popxl.ipu(ipu):
                ws.append((popxl.variable(rng.normal(size=(D, D)).astype(np.float32) * 0.5, name=f"w{i}"),
                           popxl.variable(rng.normal(size=D).astype(np.float32), name=f"b{i}")))
        fwd = ir.create_graph(_layer, spec, *ws[0])   # one graph, called on every IPU
        bwd = popxl.transforms.autodiff(fwd)
        for _ in range(N):
            with popxl.ipu(ipus[0]):
                h = ops.host_load(xs)
            infos = []
            for i, ipu in enumerate(ipus):
                if i and ipus[i - 1] != ipu:
                    h = ops.ipu_copy(h, ipu)
                with popxl.ipu(ipu):
                    infos.append(ops.call_with_info(fwd, h, *ws[i]))
                    h = infos[-1].outputs[0]
            with popxl.ipu(ipus[-1]):
                loss = ops.sum(h * h) * 0.5
                if R > 1:
                    loss = ops.collectives.replicated_all_reduce(loss) / R
                ops.host_store(loss_s, loss)
                g = h
            for i in reversed(range(len(ipus))):
                with popxl.ipu(ipus[i]):
                    gx, gw, gb = ops.call(bwd.graph, g, inputs_dict=bwd.inputs_dict(infos[i]))
                    if R > 1:
                        gw = ops.collectives.replicated_all_reduce(gw) / R
                        gb = ops.collectives.replicated_all_reduce(gb) / R
                    w, b = ws[i]
                    ops.var_updates.accumulate_(w, gw, -LR)
                    ops.var_updates.copy_var_update_(b, b - gb * LR)
                if i:
                    g = gx if ipus[i - 1] == ipus[i] else ops.ipu_copy(gx, ipus[i - 1])
    return ir, xs, loss_s, [v for pair in ws for v in pair]


def numpy_training(values: list, x: np.ndarray) -> tuple:
    """The reference: losses [runs, N, (R,)] and the final variables."""
    values = [v.copy() for v in values]
    losses = []
    for xr in x.reshape((-1,) + x.shape[-3:]):          # each host transfer: [R, B, D]
        hs = [xr]
        for i in range(0, len(values), 2):
            hs.append(np.tanh(hs[-1] @ values[i] + values[i + 1]))
        losses.append((hs[-1] ** 2).sum(axis=(-2, -1)).mean() / 2)
        g = hs[-1] / xr.shape[0]                         # the mean of the replicas' gradients
        for i in reversed(range(0, len(values), 2)):
            pre = g * (1 - hs[i // 2 + 1] ** 2)
            gw, gb = np.einsum("rbi,rbo->io", hs[i // 2], pre), pre.sum(axis=(0, 1))
            g = pre @ values[i].T
            values[i] -= LR * gw
            values[i + 1] -= LR * gb
    return np.array(losses).reshape(x.shape[:2]), values


def run(ir, xs, loss_s, variables, device, x: np.ndarray) -> tuple:
    """Losses of len(x) runs, variables read (get_tensor_data) after the first run and at
    the end, and the session."""
    s = popxl.Session(ir, device)
    losses = []
    with s:
        for i, xr in enumerate(x):
            losses.append(s.run({xs: xr})[loss_s])
            if i == 0:
                mid = [s.get_tensor_data(v) for v in variables]
    return np.array(losses), mid, [s.get_tensor_data(v) for v in variables], s


def data(runs: int, R: int = 1) -> np.ndarray:
    shape = (runs, N) + ((R,) if R > 1 else ()) + (B, D)
    return np.random.default_rng(1).normal(size=shape).astype(np.float32)


def _assert_close(got: list, want: list) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ipus", [[0, 1], [0, 1, 2, 3], [0, 1, 1, 0]],
                         ids=["2 IPUs", "4 IPUs", "IPU 0 again"])
def test_training_equals_the_unplaced_run_and_numpy(ipus):
    x = data(3)
    ir, *rest = training_ir(ipus)
    got = run(ir, *rest, "ipu_model", x)
    assert testing.is_placed(got[3]) and testing.step_program(got[3]).ipus == max(ipus) + 1
    ir, *rest = training_ir(ipus)
    ref = run(ir, *rest, "cpu", x)                        # one device: unplaced
    assert not testing.is_placed(ref[3])
    for a, b in zip(got[:3], ref[:3]):
        _assert_close(a, b)
    losses, final = numpy_training(list(ir._variable_data.values()), x[:, :, None])
    np.testing.assert_allclose(got[0], losses, rtol=1e-5)
    _assert_close(got[2], final)


def test_each_device_holds_only_its_ipus_variables():
    ir, xs, loss_s, variables = training_ir([0, 1, 2, 3])
    with popxl.Session(ir, "ipu_model") as s:
        s.run({xs: data(1)[0]})
        placed, mesh_devices = testing.step_program(s), list(testing.mesh_devices(s))
        assert [placed.layout.slots[v.id][0] for v in variables] == [0, 0, 1, 1, 2, 2, 3, 3]
        versions = ir.main_graph._versions   # new values stay in the blocks: none is sent on
        assert not placed.finals and not any(versions.get(t) in placed.home for e in placed.exports for t in e)
        values = testing.device_values(s)
        for key, arr in values.items():   # [replicas, ipus, *block]: one block per device
            assert arr.shape[:2] == (1, 4)
            assert sorted(sh.device.id for sh in arr.addressable_shards) == \
                sorted(d.id for d in mesh_devices)
            assert all(sh.data.shape == (1, 1) + arr.shape[2:] for sh in arr.addressable_shards)
        for v in variables:               # its values in its IPU's device's block
            ipu, key, shape = placed.layout.slots[v.id]
            shard = next(sh for sh in values[key].addressable_shards if sh.index[1].start == ipu)
            assert shard.device == mesh_devices[ipu]
            np.testing.assert_array_equal(np.asarray(shard.data)[0, 0][tuple(slice(0, n) for n in shape)],
                                          s.get_tensor_data(v))


def test_write_variable_data_and_weights_to_host_with_the_placed_layout():
    x = data(2)
    results = []
    for device in ("ipu_model", "cpu"):
        ir, xs, loss_s, variables = training_ir([0, 1])
        s = popxl.Session(ir, device)
        with s:
            s.run({xs: x[0]})
            s.write_variable_data(variables[2], np.full((D, D), 0.25, np.float32))   # w1, IPU 1
            s.write_variables_data({variables[1]: np.arange(D, dtype=np.float32)})  # b0, IPU 0
            loss = s.run({xs: x[1]})[loss_s]
            s.weights_to_host()
            assert all(v.in_sync_with_ipu for v in variables)
        results.append((loss, [s.get_tensor_data(v) for v in variables]))
    _assert_close(results[0][0], results[1][0])
    _assert_close(results[0][1], results[1][1])


def test_replicas_and_ipus_on_a_mesh():
    """2 replicas of 2 IPUs: a (replica, ipu) mesh of 4 devices; the replicated all-reduces
    run inside the stages; the same numbers as the replicas side by side on 2 devices."""
    R, x = 2, data(2, 2)
    ir, *rest = training_ir([0, 1], R)
    got = run(ir, *rest, "ipu_model", x)
    assert testing.is_placed(got[3]) and testing.mesh_shape(got[3]) == (2, 2)
    ir, *rest = training_ir([0, 1], R)
    ref = run(ir, *rest, popart.DeviceManager().createIpuModelDevice({"numIPUs": R}), x)
    assert not testing.is_placed(ref[3])
    for a, b in zip(got[:3], ref[:3]):
        _assert_close(a, b)
    losses, final = numpy_training(list(ir._variable_data.values()), x)
    np.testing.assert_allclose(got[0][..., 0], losses, rtol=1e-5)
    _assert_close(got[2], final)


def _small_ir(build) -> tuple:
    """``build(x)`` on a streamed [3] input; its result streamed out."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((3,), popxl.float32, "x")
        with popxl.ipu(0):
            x = ops.host_load(xs)
        y = build(x)
        ys = popxl.d2h_stream(y.shape, y.dtype, "y")
        with popxl.ipu(1):
            ops.host_store(ys, y)
    return ir, xs, ys


def test_tensors_read_on_another_ipu_without_ipu_copy_move_there():
    """A tensor of IPU 0 and a variable read on IPUs 0, 1 and 2, and updated on IPU 2: moved
    where they are used (PopART would need an IpuCopy), the variable back to IPU 0."""
    def build(x):
        with popxl.ipu(0):
            v = popxl.variable(np.array([1.0, 2.0, 3.0], np.float32), name="v")
            a = x * v
        with popxl.ipu(1):
            b = a + v
        with popxl.ipu(2):
            c = b * v
            ops.var_updates.accumulate_(v, c)
        build.v = v
        return c

    ir, xs, ys = _small_ir(build)
    x = np.array([1.0, -1.0, 0.5], np.float32)
    with popxl.Session(ir, "ipu_model") as s:
        assert testing.is_placed(s) and testing.step_program(s).home == {build.v.id: 0}
        y1, y2 = s.run({xs: x})[ys], s.run({xs: x})[ys]
    v = np.array([1.0, 2.0, 3.0], np.float32)
    want1 = (x * v + v) * v
    v2 = v + want1
    np.testing.assert_allclose(y1, want1, rtol=1e-6)
    np.testing.assert_allclose(y2, (x * v2 + v2) * v2, rtol=1e-6)
    np.testing.assert_allclose(s.get_tensor_data(build.v), v2 + y2, rtol=1e-6)


def test_a_failed_run_time_check_in_a_stage_raises_also_from_the_engine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POPXL_CACHE_DIR", str(tmp_path))
    for source in ("compiled (cached)", "engine cache"):
        ir, idx_s, out_s = gather_on_ipu1(placed=True)
        with popxl.Session(ir, "ipu_model") as s:
            assert testing.is_placed(s) and s.executable_source == source
            assert s.run({idx_s: np.array([3], np.int32)})[out_s] == 3.0
            with pytest.raises(popart.popart_exception, match="out of range"):
                s.run({idx_s: np.array([7], np.int32)})


def _remote(x):
    buf = popxl.remote_buffer((3,), popxl.float32, 1)
    with popxl.ipu(1):
        ops.remote_store(buf, 0, x)
        return ops.remote_load(buf, 0) + 1.0


def _across_ipus(x):
    with popxl.ipu(1):
        y = x * 2.0
    return ops.collectives.all_reduce([x, y], [0, 1])[1]


def _graph_on_two_ipus(x):
    with popxl.ipu(0):
        g = popxl.gir().create_graph(lambda t: t * 2.0, x)
    with popxl.ipu(1):
        return ops.call(g, x)[0]


def _two_ipus_body(t):
    with popxl.ipu(0):
        t = t * 2.0
    with popxl.ipu(1):
        return t + 1.0


def _repeat_over_two_ipus(x):
    with popxl.ipu(0):
        return ops.repeat(popxl.gir().create_graph(_two_ipus_body, x), 2, x)[0]


def _repeat_of_a_call_over_two_ipus(x):
    g = popxl.gir().create_graph(_two_ipus_body, x)
    with popxl.ipu(0):
        return ops.repeat(popxl.gir().create_graph(lambda t: ops.call(g, t)[0], x), 2, x)[0]


def _conditional_over_two_ipus(x):
    g = popxl.gir().create_graph(_two_ipus_body, x)
    with popxl.ipu(0):
        return ops.conditional(popxl.constant(True), g, g, [x], [x])[0]


@pytest.mark.parametrize("build,device,why", [   # remote buffers, all_reduce, calls: see
    (_conditional_over_two_ipus, "ipu_model",       # test_popxl_placement_rts.py
     "ops on IPUs [0, 1] in the graphs ai.onnx::If"),
    (lambda x: x * 2.0, "cpu", "a device of 1 IPU(s)"),
], ids=["conditional over IPUs", "cpu"])
def test_what_the_placed_program_lacks_runs_unplaced_with_a_log_line(build, device, why, caplog):
    ir, xs, ys = _small_ir(build)
    logger = popart.getLogger("session")
    level = logger.getLevel()
    logger.setLevel("INFO")
    try:
        s = popxl.Session(ir, device)
    finally:
        logger.setLevel(level)
    assert not testing.is_placed(s)
    assert any(why in r.getMessage() and "runs on one device" in r.getMessage() for r in caplog.records)
    with s:
        s.run({xs: np.ones(3, np.float32)})


def test_ipus_per_replica_is_popxl_count():
    from popxl._placement import device_ipus, ipus_per_replica
    ir, *_ = training_ir([0, 2])
    assert ipus_per_replica(ir) == 3
    assert device_ipus(ir, "ipu_model", 1) == 4 and device_ipus(ir, "ipu_model", 2) == 8
    assert device_ipus(ir, "cpu", 1) == 1


def test_a_repeat_over_two_ipus_runs_placed():
    x = np.array([1.0, -1.0, 0.5], np.float32)
    ys = []
    for device in ("ipu_model", "cpu"):
        ir, xs, y_s = _small_ir(_repeat_over_two_ipus)
        with popxl.Session(ir, device) as s:
            assert testing.is_placed(s) == (device == "ipu_model")
            ys.append(s.run({xs: x})[y_s])
    np.testing.assert_allclose(ys[0], ys[1], rtol=1e-6)
    np.testing.assert_allclose(ys[0], (x * 2 + 1) * 2 + 1, rtol=1e-6)


T = 3   # training steps per ops.repeat


def repeat_training_ir(load_inside: bool) -> tuple:
    """A training step (layer 0 on IPU 0, ipu_copy, layer 1 and the loss on IPU 1, autodiff,
    var updates) repeated T times by ops.repeat in the main graph; its input x host_loaded
    and its loss host_stored inside the step (T host transfers), or x loaded once before the
    repeat and the last step's loss carried out of the repeat and streamed out. Returns (ir,
    x stream, loss stream, variables)."""
    rng = np.random.default_rng(0)
    ir = popxl.Ir()
    ir.num_host_transfers = T if load_inside else 1
    spec = popxl.TensorSpec((B, D), popxl.float32)
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((B, D), popxl.float32, "x")
        loss_s = popxl.d2h_stream((), popxl.float32, "loss")
        ws = []
        for i in range(2):
            with popxl.ipu(i):
                ws += [popxl.variable(rng.normal(size=(D, D)).astype(np.float32) * 0.5, name=f"w{i}"),
                       popxl.variable(rng.normal(size=D).astype(np.float32), name=f"b{i}")]
        fwd = ir.create_graph(_layer, spec, ws[0], ws[1])
        bwd = popxl.transforms.autodiff(fwd)

        def step(loss: popxl.Tensor, x: popxl.Tensor, w0: popxl.TensorByRef, b0: popxl.TensorByRef,
                 w1: popxl.TensorByRef, b1: popxl.TensorByRef) -> popxl.Tensor:
            with popxl.ipu(0):
                if load_inside:
                    x = ops.host_load(xs)
                f0 = ops.call_with_info(fwd, x, w0, b0)
            h = ops.ipu_copy(f0.outputs[0], 1)
            with popxl.ipu(1):
                f1 = ops.call_with_info(fwd, h, w1, b1)
                y = f1.outputs[0]
                loss = ops.sum(y * y) * 0.5
                if load_inside:
                    ops.host_store(loss_s, loss)
                gh, gw, gb = ops.call(bwd.graph, y, inputs_dict=bwd.inputs_dict(f1))
                ops.var_updates.accumulate_(w1, gw, -LR)
                ops.var_updates.copy_var_update_(b1, b1 - gb * LR)
            g = ops.ipu_copy(gh, 0)
            with popxl.ipu(0):
                _, gw, gb = ops.call(bwd.graph, g, inputs_dict=bwd.inputs_dict(f0))
                ops.var_updates.accumulate_(w0, gw, -LR)
                ops.var_updates.copy_var_update_(b0, b0 - gb * LR)
            return loss

        step_g = ir.create_graph(step, popxl.TensorSpec((), popxl.float32), spec, *ws)
        with popxl.ipu(0):
            x = popxl.constant(np.zeros((B, D), np.float32)) if load_inside else ops.host_load(xs)
            loss0 = popxl.constant(np.float32(0))
        loss, = ops.repeat(step_g, T, loss0, x, *ws)
        if not load_inside:
            with popxl.ipu(1):
                ops.host_store(loss_s, loss)
    return ir, xs, loss_s, ws


@pytest.mark.parametrize("load_inside", [False, True], ids=["host_load before", "host_load inside"])
def test_a_repeated_training_step_over_two_ipus_runs_placed(load_inside):
    shape = (2, T, B, D) if load_inside else (2, B, D)   # [runs, (transfers,) B, D]
    x = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    ir, *rest = repeat_training_ir(load_inside)
    got = run(ir, *rest, "ipu_model", x)
    placed = testing.step_program(got[3])
    assert placed is not None and len(placed.loops) == 1
    assert [placed.layout.slots[v.id][0] for v in rest[2]] == [0, 0, 1, 1]
    values = testing.device_values(got[3])
    for key, arr in values.items():   # one block per device, its IPU's variables only
        assert all(sh.data.shape == (1, 1) + arr.shape[2:] for sh in arr.addressable_shards)
    ir, *rest = repeat_training_ir(load_inside)
    ref = run(ir, *rest, "cpu", x)
    assert not testing.is_placed(ref[3])
    for a, b in zip(got[:3], ref[:3]):
        _assert_close(a, b)
    steps = x if load_inside else np.repeat(x[:, None], T, axis=1)   # each step's input
    losses, final = numpy_training(list(ir._variable_data.values()), steps[:, :, None])
    np.testing.assert_allclose(got[0], losses if load_inside else losses[:, -1], rtol=1e-5)
    _assert_close(got[2], final)
