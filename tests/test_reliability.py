"""Hostile and careless inputs (issue 16, items 3-6): bounded reads of executables and
external data, nested control flow traced once, executables and engine-cache entries tied
to what compiled them, atomic file writes, one session from two threads, sub-byte external
data, and `popart launch` when a process fails."""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
import tracemalloc
import zipfile

import jax
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import popart
from popart import fileio
from popart.engine import lower

CPU = lambda: popart.DeviceManager().createCpuDevice()


def small_model(scale: float = 2.0) -> bytes:
    """y = x * w with w = [scale] * 4 (an initializer: a weight of the session)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]), "x")
    w = b.addInitializedInputTensor(np.full(4, scale, np.float32), "w")
    b.addOutputTensor(b.aiOnnx.mul([x, w]))
    return b.getModelProto()


def infer(model, options=None):
    """An InferenceSession anchoring the model's (first) output."""
    anchor = onnx.load_from_string(model).graph.output[0].name
    return popart.InferenceSession(model, popart.DataFlow(1, [anchor]), CPU(), userOptions=options)


def run_once(session, x=None):
    out = session.initAnchorArrays()
    session.run(popart.PyStepIO({"x": np.arange(4, dtype=np.float32) if x is None else x}, out))
    return next(iter(out.values()))


# ----------------------------------------------------------------------- bounded resources
def test_zip_bomb_executable_is_rejected_before_it_is_read(tmp_path):
    """A small .popef whose entry inflates to 256 MiB: rejected from the zip's declared sizes,
    quickly and without allocating them."""
    s = infer(small_model())
    bomb = tmp_path / "bomb.popef"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("executable.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                     "shape": (256 << 20,)})
            chunk = bytes(1 << 20)
            for _ in range(256):
                f.write(chunk)
        z.writestr("metadata.npy", b"")
    assert bomb.stat().st_size < 2 << 20
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(popart.popart_exception, match="declares .* bytes"):
            s.loadExecutable(str(bomb))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5
    assert peak < 32 << 20, f"peak {peak >> 20} MiB"


def test_executable_entry_with_wrong_shape_or_extra_entries_is_rejected(tmp_path):
    s = infer(small_model())
    s.prepareDevice()
    good = tmp_path / "good.popef"
    s.saveExecutable(str(good))
    with np.load(good) as z:
        entries = {k: z[k] for k in z.files}
    for name, bad in (("var/w", {**entries, "var/w": np.zeros(1 << 16, np.float32)}),
                      ("unexpected", {**entries, "extra": np.zeros(3)})):
        path = tmp_path / f"{name.replace('/', '_')}.popef"
        with open(path, "wb") as f:
            np.savez(f, **bad)
        with pytest.raises(popart.popart_exception, match="expected|unexpected"):
            infer(small_model()).loadExecutable(str(path))


def external_model(tmp_path, dims, location="w.bin", length=None, elem=TensorProto.FLOAT):
    """A model y = Identity(w) whose initializer w keeps its data in ``location``."""
    w = TensorProto(name="w", data_type=elem, dims=dims, data_location=TensorProto.EXTERNAL)
    entries = {"location": location, **({"length": str(length)} if length is not None else {})}
    for k, v in entries.items():
        w.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "ext", [],
                          [helper.make_tensor_value_info("y", elem, dims)], [w])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=9).SerializeToString())
    return str(path)


def test_external_data_reads_only_the_tensors_bytes(tmp_path):
    """A [4] float tensor whose external file is 256 MiB (sparse): 16 bytes are read."""
    with open(tmp_path / "w.bin", "wb") as f:
        f.write(np.array([1, 2, 3, 4], np.float32).tobytes())
        f.truncate(256 << 20)
    model = external_model(tmp_path, [4])
    tracemalloc.start()
    try:
        s = popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"peak {peak >> 20} MiB"
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, out))
    np.testing.assert_array_equal(out["y"], [1, 2, 3, 4])


def test_external_data_short_file_or_wrong_length_is_a_clear_error(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.zeros(2, np.float32).tobytes())
    with pytest.raises(popart.popart_exception, match="'w'.*8 bytes: 16 bytes from offset 0"):
        popart.InferenceSession(external_model(tmp_path, [4]), popart.DataFlow(1, ["y"]), CPU())
    (tmp_path / "w.bin").write_bytes(np.zeros(64, np.float32).tobytes())
    with pytest.raises(popart.popart_exception, match="length 256 does not match"):
        popart.InferenceSession(external_model(tmp_path, [4], length=256),
                                popart.DataFlow(1, ["y"]), CPU())


def nested_if(depth: int) -> onnx.ModelProto:
    """y = x*x through ``depth`` Ifs nested in the then-branches (else branches: -x)."""
    branch = lambda nodes, out, name: helper.make_graph(nodes, name, [], [onnx.ValueInfoProto(name=out)])
    inner = branch([helper.make_node("Mul", ["x", "x"], ["t0"])], "t0", "then0")
    for d in range(1, depth + 1):
        els = branch([helper.make_node("Neg", ["x"], [f"e{d}"])], f"e{d}", f"else{d}")
        inner = branch([helper.make_node("If", ["c"], [f"t{d}"], then_branch=inner, else_branch=els)],
                       f"t{d}", f"then{d}")
    g = helper.make_graph(list(inner.node), "nested", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                                       helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(f"t{depth}", TensorProto.FLOAT, [4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)], ir_version=10)


def test_nested_if_traces_each_branch_once(monkeypatch):
    """Depth 12: the innermost Mul is lowered once per trace of the whole step (a couple of
    times), not 2**12 times."""
    calls = []
    real = lower.lower_node
    monkeypatch.setattr(lower, "lower_node", lambda node, *a, **k: (
        calls.append(node.op_type), real(node, *a, **k))[1])
    depth = 12
    s = popart.InferenceSession(nested_if(depth).SerializeToString(),
                                popart.DataFlow(1, [f"t{depth}"]), CPU())
    s.prepareDevice()
    assert 1 <= calls.count("Mul") <= 4, calls.count("Mul")
    x = np.arange(4, dtype=np.float32)
    for c, want in ((True, x * x), (False, -x)):
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({"c": np.array(c), "x": x}, out))
        np.testing.assert_array_equal(out[f"t{depth}"], want)


# ----------------------------------------------------------------------- integrity
def test_executable_for_other_options_optimizer_or_version_is_rejected(tmp_path, monkeypatch):
    path = str(tmp_path / "exe.popef")
    s = infer(small_model())
    s.prepareDevice()
    s.saveExecutable(path)
    opts = popart.SessionOptions()
    opts.partialsTypeMatMuls = "half"
    with pytest.raises(popart.popart_exception, match="option partialsTypeMatMuls"):
        infer(small_model(), opts).loadExecutable(path)
    with pytest.raises(popart.popart_exception, match="model_sha256"):
        infer(small_model(3.0)).loadExecutable(path)
    monkeypatch.setattr("popart.engine.executable.package_version", lambda: "99.0")
    with pytest.raises(popart.popart_exception, match="popart_xla .file: .*session: 99.0"):
        infer(small_model()).loadExecutable(path)

    b, ids = training_model()
    t = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                               popart.ConstSGD(0.1), CPU())
    t.prepareDevice()
    t.weightsFromHost()
    t.saveExecutable(path)
    t2 = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                                popart.ConstSGD(0.2), CPU())
    monkeypatch.undo()
    with pytest.raises(popart.popart_exception, match="optimizer"):
        t2.loadExecutable(path)
        t2.weightsFromHost()


def test_engine_cache_belongs_to_the_session_and_checks_its_entries(tmp_path, capfd):
    def cached(model, folder):
        o = popart.SessionOptions()
        o.enableEngineCaching, o.cachePath = True, str(tmp_path / folder)
        return infer(model, o)

    entries = lambda folder: sorted(p.name for p in (tmp_path / folder).glob("*.popef"))
    a, b = cached(small_model(2.0), "a"), cached(small_model(3.0), "b")
    a.prepareDevice()
    b.prepareDevice()
    b.weightsFromHost()
    assert len(entries("a")) == 1 and len(entries("b")) == 1
    plain = infer(small_model(5.0))
    plain.prepareDevice()
    plain.weightsFromHost()
    assert len(entries("a")) == 1 and len(entries("b")) == 1
    assert not list(tmp_path.glob("*/.tmp_*"))
    assert jax.config.jax_compilation_cache_dir is None   # JAX's process-wide config is left as it was

    again = cached(small_model(2.0), "a")
    again.prepareDevice()
    again.weightsFromHost()
    assert "executable_source: engine cache" in again.getSummaryReport()
    np.testing.assert_array_equal(run_once(again), np.arange(4) * 2.0)

    # Copy b's entry over a's: the session notices, says so and recompiles its own model.
    (tmp_path / "a" / entries("a")[0]).write_bytes((tmp_path / "b" / entries("b")[0]).read_bytes())
    logger = popart.getLogger("session")
    level = logger.getLevel()
    logger.setLevel("WARN")
    try:
        swapped = cached(small_model(2.0), "a")
        swapped.prepareDevice()
        swapped.weightsFromHost()
    finally:
        logger.setLevel(level)
    assert "Cache file hash did not match the IR hash" in capfd.readouterr().err   # PopART's text
    np.testing.assert_array_equal(run_once(swapped), np.arange(4) * 2.0)
    fresh = cached(small_model(2.0), "a")
    fresh.prepareDevice()
    assert "executable_source: engine cache" in fresh.getSummaryReport()   # rewritten for this model


def test_atomic_write_keeps_mode_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    fileio.atomic_write(target, b"one")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    os.chmod(target, 0o600)
    fileio.atomic_write(target, b"two")
    assert target.read_bytes() == b"two" and stat.S_IMODE(target.stat().st_mode) == 0o600

    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(fileio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write(target, b"three")
    monkeypatch.undo()
    assert target.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_atomic_write_symlinks(tmp_path):
    inside, outside = tmp_path / "d", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (inside / "real.onnx").write_bytes(b"old")
    (inside / "link.onnx").symlink_to("real.onnx")
    fileio.atomic_write(inside / "link.onnx", b"new")
    assert (inside / "link.onnx").is_symlink() and (inside / "real.onnx").read_bytes() == b"new"
    (outside / "victim").write_bytes(b"keep")
    (inside / "escape.onnx").symlink_to(outside / "victim")
    with pytest.raises(popart.popart_exception, match="outside its folder"):
        fileio.atomic_write(inside / "escape.onnx", b"evil")
    assert (outside / "victim").read_bytes() == b"keep"
    assert sorted(os.listdir(inside)) == ["escape.onnx", "link.onnx", "real.onnx"]


def test_builder_and_session_writes_keep_modes(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    b.addOutputTensor(b.aiOnnx.relu([x]))
    b.saveModelProto(str(tmp_path / "new.onnx"))
    assert stat.S_IMODE((tmp_path / "new.onnx").stat().st_mode) == 0o666 & ~umask
    s = infer(small_model())
    s.prepareDevice()
    (tmp_path / "private.onnx").write_bytes(b"")
    os.chmod(tmp_path / "private.onnx", 0o600)
    s.modelToHost(str(tmp_path / "private.onnx"))
    assert stat.S_IMODE((tmp_path / "private.onnx").stat().st_mode) == 0o600
    onnx.load(str(tmp_path / "private.onnx"))


# ----------------------------------------------------------------------- threads
def training_model():
    rng = np.random.default_rng(0)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [8, 16]), "x")
    label = b.addInputTensor(popart.TensorInfo("INT32", [8]), "label")
    w = b.addInitializedInputTensor(rng.standard_normal((16, 4)).astype(np.float32), "w")
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([x, w])], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label])
    return b, {"x": x, "label": label, "w": w, "loss": loss}


@pytest.fixture
def eager_thread_switches():
    """Switch threads every few microseconds, so unserialised sessions fail reliably."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_one_session_from_four_threads_serialises(eager_thread_switches):
    """Four threads each run one training session 10 times: the 40 losses are the 40 of a
    sequential run and the final weights agree (unserialised, this ends in a donated-buffer
    error)."""
    b, ids = training_model()
    rng = np.random.default_rng(1)
    X = rng.standard_normal((8, 16)).astype(np.float32)
    L = rng.integers(0, 4, 8).astype(np.int32)

    def session():
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                                   popart.ConstSGD(0.05), CPU())
        s.prepareDevice()
        s.weightsFromHost()
        return s

    def steps(s, n, losses):
        out = s.initAnchorArrays()
        for _ in range(n):
            s.run(popart.PyStepIO({ids["x"]: X, ids["label"]: L}, out))
            losses.append(float(out[ids["loss"]]))
            s.weightsToHost()

    def weights(s):
        s.weightsToHost()
        w = np.zeros((16, 4), np.float32)
        s.readWeights(popart.PyWeightsIO({ids["w"]: w}))
        return w

    seq = session()
    expected = []
    steps(seq, 40, expected)
    par, got, errors = session(), [], []

    def worker():
        try:
            steps(par, 10, got)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    np.testing.assert_allclose(sorted(got), sorted(expected), rtol=1e-6)
    np.testing.assert_allclose(weights(par), weights(seq), rtol=1e-6)


# ----------------------------------------------------------------------- nothing lost
def test_int4_weight_saved_externally_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    b = popart.Builder(opsets={"ai.onnx": 21, "ai.graphcore": 1})   # Cast takes INT4 from 21
    w = b.addInitializedInputTensor(np.array([1, -2, 3, -4], dtype=ml_dtypes.int4), "w")
    y = b.aiOnnx.cast([w], "INT32")
    b.addOutputTensor(y)
    b.saveInitializersExternally([w], "w.bin")
    b.saveModelProto("m.onnx")
    assert os.path.getsize("w.bin") == 2           # two values per byte, as ONNX packs them
    np.testing.assert_array_equal(
        numpy_helper.to_array(onnx.load("m.onnx").graph.initializer[0]).astype(np.int8), [1, -2, 3, -4])
    s = popart.InferenceSession(str(tmp_path / "m.onnx"), popart.DataFlow(1, [y]), CPU())
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, out))
    np.testing.assert_array_equal(out[y], [1, -2, 3, -4])


LAUNCHED = """
import os, sys, time
if os.environ["POPART_DIST_PROCESS_ID"] == "1":
    sys.exit(3)
time.sleep(60)
open(sys.argv[1], "w").write("rank 0 was not stopped")
"""


def test_launch_stops_every_process_when_one_fails(tmp_path):
    from popart.cli import main
    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    t0 = time.perf_counter()
    code = main(["launch", "-n", "2", str(script), str(tmp_path / "survivor")])
    assert code == 3
    assert time.perf_counter() - t0 < 20
    time.sleep(0.2)
    assert not (tmp_path / "survivor").exists()


def test_popxl_session_from_four_threads_serialises(eager_thread_switches):
    import popxl
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(3, np.float32), name="v")
        popxl.ops.var_updates.accumulate_(v, popxl.constant(np.ones(3, np.float32)), 1.0)
    errors = []

    def worker(s):
        try:
            for _ in range(25):
                s.run()
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)
    with popxl.Session(ir, "cpu") as s:
        threads = [threading.Thread(target=worker, args=(s,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        np.testing.assert_array_equal(s.get_tensor_data(v), [100, 100, 100])
