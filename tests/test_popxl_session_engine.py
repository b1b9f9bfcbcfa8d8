"""popxl.Session on the engine's compiled-step layer: replicas on distinct devices (the test
session's host presents 4, see conftest), the engine cache (POPXL_CACHE_DIR), input
validation shared with popart sessions, run-time checks from a cached program."""

import jax
import numpy as np
import pytest

import popart
from popart import testing
import popxl
import popxl.ops as ops

R, N = 4, 3


def replicated_ir(scale: float = 2.0) -> tuple:
    """Each replica: y = x * w + scale, total = all-reduce(sum(y)); w += 1 every run."""
    ir = popxl.Ir(replication=R)
    ir.num_host_transfers = N
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        w = popxl.variable(np.array([1.0, -1.0], np.float32), name="w")
        y_d2h = popxl.d2h_stream((2,), popxl.float32, "y")
        t_d2h = popxl.d2h_stream((), popxl.float32, "total")
        for _ in range(N):
            x = ops.host_load(xs)
            y = x * w + scale
            ops.host_store(y_d2h, y)
            ops.host_store(t_d2h, ops.collectives.replicated_all_reduce(ops.sum(y)))
        ops.var_updates.accumulate_(w, popxl.constant(np.ones(2, np.float32)))
    return ir, xs, w, y_d2h, t_d2h


def reference(x: np.ndarray, scale: float) -> tuple:
    w = np.array([1.0, -1.0], np.float32)
    y = x * w + scale                                   # [N, R, 2]
    return y, np.broadcast_to(y.sum(axis=(1, 2))[:, None], (N, R))


def test_replicas_run_on_distinct_devices_with_their_own_variable_copies():
    ir, xs, w, y_d2h, t_d2h = replicated_ir()
    x = np.random.default_rng(0).normal(size=(N, R, 2)).astype(np.float32)
    with popxl.Session(ir, "ipu_model") as s:
        assert len({d.id for d in testing.mesh_devices(s)}) == R        # shard_map over 4 devices
        out = s.run({xs: x})
        shards = testing.device_values(s)[w.id].addressable_shards
        assert len({sh.device for sh in shards}) == R
        assert all(sh.data.shape == (1, 2) for sh in shards)          # one replica's copy each
    y, total = reference(x, 2.0)
    np.testing.assert_allclose(out[y_d2h], y, rtol=1e-6)
    np.testing.assert_allclose(out[t_d2h], total, rtol=1e-6)
    np.testing.assert_array_equal(s.get_tensor_data(w), [2.0, 0.0])


def test_input_validation_is_popart_stepio_rule_after_popxl_downcast():
    ir, xs, *_ = replicated_ir()
    with popxl.Session(ir, "ipu_model") as s:
        s.run({xs: np.zeros((N, R, 2), np.float64)})       # 64-bit is downcast (popxl's default)
        with pytest.raises(popart.popart_exception, match="Type discrepancy for tensor .*INT32 and expected : FLOAT"):
            s.run({xs: np.zeros((N, R, 2), np.int32)})
        with pytest.raises(popart.popart_exception, match="float64"):
            s.run({xs: np.zeros((N, R, 2), np.float64)}, downcast_inputs=False)
        with pytest.raises(ValueError, match="shape"):
            s.run({xs: np.zeros((N, R, 3), np.float32)})


def test_engine_cache_entry_is_written_then_used(tmp_path, monkeypatch):
    monkeypatch.setenv("POPXL_CACHE_DIR", str(tmp_path))
    x = np.arange(N * R * 2, dtype=np.float32).reshape(N, R, 2)
    results = []
    for scale in (2.0, 2.0, 5.0):
        ir, xs, w, y_d2h, _ = replicated_ir(scale)
        with popxl.Session(ir, "ipu_model") as s:
            results.append((s.executable_source, s.run({xs: x})[y_d2h]))
    assert [src for src, _ in results] == ["compiled (cached)", "engine cache", "compiled (cached)"]
    assert len(list(tmp_path.glob("[0-9]*.popef"))) == 2          # one entry per program
    np.testing.assert_array_equal(results[0][1], results[1][1])
    np.testing.assert_allclose(results[2][1], reference(x, 5.0)[0], rtol=1e-6)
    assert jax.config.jax_compilation_cache_dir is None              # JAX's config put back


def test_run_time_checks_hold_for_a_program_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POPXL_CACHE_DIR", str(tmp_path))

    def build() -> tuple:
        ir = popxl.Ir()
        with ir.main_graph:
            idx_s = popxl.h2d_stream((1,), popxl.int32, "idx")
            out_s = popxl.d2h_stream((1,), popxl.float32, "out")
            table = popxl.constant(np.arange(4, dtype=np.float32))
            ops.host_store(out_s, ops.gather(table, ops.host_load(idx_s)))
        return ir, idx_s, out_s

    for expected_source in ("compiled (cached)", "engine cache"):
        ir, idx_s, out_s = build()
        with popxl.Session(ir, "cpu") as s:
            assert s.executable_source == expected_source
            assert s.run({idx_s: np.array([3], np.int32)})[out_s] == 3.0
            with pytest.raises(popart.popart_exception, match="out of range"):
                s.run({idx_s: np.array([7], np.int32)})


def test_session_without_enough_devices_runs_replicas_side_by_side():
    ir, xs, w, y_d2h, t_d2h = replicated_ir()
    one = popart.DeviceManager().createIpuModelDevice({"numIPUs": 1})
    x = np.ones((N, R, 2), np.float32)
    with popxl.Session(ir, one) as s:
        assert testing.mesh_devices(s) == []                             # vmap on one device
        out = s.run({xs: x})
    np.testing.assert_allclose(out[t_d2h], reference(x, 2.0)[1], rtol=1e-6)
