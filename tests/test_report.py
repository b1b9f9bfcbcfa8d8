"""Reports (issue 27): PopART's switches turn on capture; report.json / trace.json.gz /
report.html name the model's nodes; times come from the profiler's trace events, memory from
XLA's analysis of the executable; switched off, nothing is written and numbers are unchanged."""
import gzip
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest

import popart
from popart import testing
from popart.engine import hooks
from popart.engine.compiled import xla_errors
from popart.report import capture, switches

CPU = lambda: popart.DeviceManager().createCpuDevice()  # noqa: E731


def _matmul_model():
    """One 512x512 MatMul (an anchor of its own) beside small elementwise ops."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [512, 512]), "x")
    s = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 4]), "s")
    w = b.addInitializedInputTensor(np.random.RandomState(0).rand(512, 512).astype(np.float32), "w")
    with b.nameScope("big"):
        m = b.aiOnnx.matmul([x, w])
    t = b.aiOnnx.sigmoid([b.aiOnnx.relu([b.aiOnnx.add([s, s])])])
    return b, x, s, m, t


@pytest.fixture(scope="module")
def inference(tmp_path_factory):
    """The MatMul model with autoReport on (3 traced runs)."""
    out = str(tmp_path_factory.mktemp("report"))
    b, x, s, m, t = _matmul_model()
    o = popart.SessionOptions()
    o.engineOptions = {"autoReport.all": "true", "autoReport.directory": out,
                       "autoReport.executionProfileProgramRunCount": "3"}
    sess = popart.InferenceSession(b.getModelProto(), popart.DataFlow(2, [m, t]), CPU(), userOptions=o)
    sess.prepareDevice()
    anchors = sess.initAnchorArrays()
    rs = np.random.RandomState(1)
    for _ in range(3):
        sess.run(popart.PyStepIO({x: rs.rand(2, 512, 512).astype(np.float32),
                                  s: rs.rand(2, 4, 4).astype(np.float32)}, anchors))
    with open(os.path.join(out, "report.json")) as f:
        data = json.load(f)
    with gzip.open(os.path.join(out, "trace.json.gz")) as f:
        trace = json.load(f)
    return sess, out, data, trace


def test_report_peak_is_memory_analysis_peak(inference):
    sess, _, data, _ = inference
    mem = testing.compiled(sess).memory_analysis()
    assert data["schema"] == capture.SCHEMA
    assert data["memory"]["peak_bytes"] == mem.peak_memory_in_bytes > 0
    assert data["memory"]["argument_bytes"] == mem.argument_size_in_bytes
    assert data["memory"]["temp_bytes"] == mem.temp_size_in_bytes
    # the live buffers at the peak (XLA's buffer assignment for this executable) name nodes
    live = data["memory"]["live_at_peak"]
    assert any(b["node"] == "Add + Relu + Sigmoid" for b in live)   # a fusion: its nodes
    assert any(b["node"] == "(argument feeds['x'])" and b["bytes"] == 2 * 512 * 512 * 4 for b in live)
    assert sum(b["bytes"] for b in live) == data["memory"]["live_peak_bytes"]
    assert os.listdir(os.path.join(inference[1], "xla_buffer_assignment"))


def test_matmul_ranks_first_by_traced_time(inference):
    _, _, data, trace = inference
    rows = data["time"]["per_node"]
    assert [r["node"] for r in rows][0] == "big/MatMul"
    assert {r["node"] for r in rows} == {"big/MatMul", "Add", "Relu", "Sigmoid"}   # one row per node
    top = rows[0]
    assert top["us"] > 0 and top["share"] > 0.5
    # the time is the sum of the trace's events of that node's instructions (not an estimate)
    events = [e for e in trace["traceEvents"] if (e.get("args") or {}).get("nodes") == ["big/MatMul"]]
    assert events and sum(e["dur"] for e in events) == pytest.approx(top["us"])
    assert {e["name"] for e in events} == {"big/MatMul"}
    by_type = {r["op_type"]: r for r in data["time"]["per_op_type"]}
    assert data["time"]["per_op_type"][0]["op_type"] == "MatMul"
    assert by_type["MatMul"]["us"] == pytest.approx(top["us"])


def test_trace_events_well_formed_one_step_per_run(inference):
    _, _, data, trace = inference
    events = trace["traceEvents"]
    assert events and all(all(k in e for k in ("ph", "ts", "pid", "tid")) for e in events)
    steps = [e for e in events if e["name"] == capture.STEP_EVENT]
    assert len(steps) == data["time"]["runs_traced"] == 3
    assert sorted(int(e["args"]["step_num"]) for e in steps) == [0, 1, 2]
    assert [r["traced"] for r in data["runs"]] == [True, True, True]
    assert all(r["samples_per_second"] > 0 for r in data["runs"])


def test_summary_report_gains_memory_phases_throughput_top_ops(inference):
    sess, _, data, _ = inference
    text = sess.getSummaryReport()
    assert f"peak={data['memory']['peak_bytes']}" in text
    assert "trace_and_lower=" in text and "xla_compile=" in text
    assert re.search(r"recent throughput: [\d.]+ samples/s", text)
    assert "top ops (us per run): big/MatMul [MatMul]" in text


def _train(tmp, report=False, recompute=False, steps=3, layers=4, width=64, batch=256):
    """A tanh chain trained with SGD; with ``recompute`` every other layer is recomputed."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, width]), "x")
    rs, h = np.random.RandomState(0), x
    for i in range(layers):
        w = b.addInitializedInputTensor((rs.randn(width, width) / 8).astype(np.float32), f"w{i}")
        with b.nameScope(f"layer{i}"):
            m = b.aiOnnx.matmul([h, w])
            h = b.aiOnnx.tanh([m])
        if recompute:
            b.recomputeOutputInBackwardPass(m, popart.RecomputeType.Recompute)
            b.recomputeOutputInBackwardPass(
                h, popart.RecomputeType.Checkpoint if i % 2 else popart.RecomputeType.Recompute)
    loss = b.aiGraphcore.l1loss([h], 0.1, reduction=popart.ReductionType.Sum)
    o = popart.SessionOptions()
    if report:
        o.engineOptions = {"autoReport.all": "true", "autoReport.directory": str(tmp),
                           "autoReport.executionProfileProgramRunCount": str(steps)}
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.SGD({"defaultLearningRate": (0.05, False)}), CPU(), userOptions=o)
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    X = np.random.RandomState(1).randn(batch, width).astype(np.float32)
    losses = []
    for _ in range(steps):
        s.run(popart.PyStepIO({x: X}, out))
        losses.append(out[loss].copy())
    ws = {f"w{i}": np.zeros((width, width), np.float32) for i in range(layers)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(ws))
    return s, np.array(losses), ws


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    on = tmp_path_factory.mktemp("train_on")
    return _train(on, report=True), on, _train(tmp_path_factory.mktemp("train_off"))


def test_outputs_bit_identical_with_profiling_on_and_off(training):
    (s_on, losses_on, w_on), _, (s_off, losses_off, w_off) = training
    assert testing.compiled_step(s_on).recorder is not None and testing.compiled_step(s_off).recorder is None
    np.testing.assert_array_equal(losses_on, losses_off)
    for k in w_on:
        np.testing.assert_array_equal(w_on[k], w_off[k])


def test_training_report_names_forward_and_backward(training):
    _, folder, _ = training
    with open(folder / "report.json") as f:
        data = json.load(f)
    rows = {r["node"]: r for r in data["time"]["per_node"]}
    assert set(rows) >= {f"layer{i}/MatMul" for i in range(4)}
    timed = [r for r in rows.values() if r["us"] > 0] + [
        {"node": n} for g in data["time"]["fusions"] for n in g["nodes"]]
    assert any(r["node"].startswith("layer") for r in timed)
    assert any(r.get("backward_us", 0) > 0 for r in rows.values()) or data["time"]["fusions"]
    html = (folder / "report.html").read_text()
    assert "layer0/MatMul" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")


def test_recomputation_lowers_reported_peak(tmp_path):
    peaks = {}
    for rc in (False, True):
        folder = tmp_path / str(rc)
        _train(folder, report=True, recompute=rc, steps=1, layers=8, batch=512)
        with open(folder / "report.json") as f:
            peaks[rc] = json.load(f)["memory"]
    assert peaks[True]["live_peak_bytes"] < 0.9 * peaks[False]["live_peak_bytes"], peaks
    assert peaks[True]["temp_bytes"] < 0.8 * peaks[False]["temp_bytes"], peaks


def test_progress_logger_never_decreases_and_ends_at_total():
    seen = []
    b, x, s, m, t = _matmul_model()
    o = popart.SessionOptions()
    o.compilationProgressLogger = lambda p, total: seen.append((p, total))
    o.compilationProgressTotal = 50
    sess = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [t]), CPU(), userOptions=o)
    assert seen == [(0, 50)]   # PopART's first call, when the session is built
    sess.prepareDevice()
    values = [p for p, _ in seen]
    assert values == sorted(values) and len(values) >= 4
    assert seen[-1] == (50, 50) and all(tot == 50 for _, tot in seen)
    assert testing.compiled_step(sess).recorder is None   # progress alone does not profile


def test_switches_off_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k in ("POPLAR_ENGINE_OPTIONS", "POPART_DOT_CHECKS", "POPART_IR_DUMP"):
        monkeypatch.delenv(k, raising=False)
    b, x, s, m, t = _matmul_model()
    sess = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [t]), CPU())
    sess.prepareDevice()
    anchors = sess.initAnchorArrays()
    sess.run(popart.PyStepIO({x: np.ones((512, 512), np.float32), s: np.ones((4, 4), np.float32)}, anchors))
    assert os.listdir(tmp_path) == []
    assert testing.compiled_step(sess).recorder is None and hooks.current() is None
    assert "Execution profiling not enabled" in sess.getSummaryReport()
    assert "peak=" in sess.getSummaryReport()   # XLA's memory figures are there anyway


def test_poplar_engine_options_env_and_popxl_session(tmp_path, monkeypatch):
    import popxl
    import popxl.ops as ops
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps(
        {"autoReport.all": True, "autoReport.directory": str(tmp_path)}))
    ir = popxl.Ir()
    with ir.main_graph, popxl.name_scope("block"):
        h2d = popxl.h2d_stream((64, 64), popxl.float32, "xin")
        w = popxl.variable(np.eye(64, dtype=np.float32), name="w")
        y = ops.relu(ops.matmul(ops.host_load(h2d, "x"), w))
        d2h = popxl.d2h_stream(y.shape, y.dtype, "yout")
        ops.host_store(d2h, y)
    data = np.random.RandomState(0).rand(64, 64).astype(np.float32)
    with popxl.Session(ir, "ipu_model") as session:
        for _ in range(2):   # Poplar's default window: 2 traced runs, then the report is written
            out = session.run({h2d: data})[d2h]
    np.testing.assert_allclose(out, np.maximum(data, 0), rtol=1e-6)
    with open(tmp_path / "report.json") as f:
        rep = json.load(f)
    assert rep["program"]["kind"] == "popxl.Session" and rep["runs"]
    assert any("MatMul" in r["node"] or "matmul" in r["node"].lower() for r in rep["time"]["per_node"])


def test_bad_poplar_engine_options_raise(monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", "{autoReport.all: true")
    with pytest.raises(popart.popart_exception, match="POPLAR_ENGINE_OPTIONS"):
        switches.report_settings(popart.SessionOptions())


def test_dot_checks_and_ir_dump(tmp_path, monkeypatch):
    dump = tmp_path / "ir.json"
    monkeypatch.setenv("POPART_IR_DUMP", str(dump))
    monkeypatch.setenv("POPART_DOT_CHECKS", "bwd0")
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.ones((3, 3), np.float32), "w")
    y = b.aiOnnx.matmul([x, w], "mm")
    loss = b.aiGraphcore.l1loss([y], 0.1)
    o = popart.SessionOptions()
    o.dotChecks = {"Fwd0", "FINAL"}
    o.logDir = str(tmp_path / "logs")
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1), CPU(), userOptions=o)
    assert sorted(os.listdir(o.logDir)) == ["Fwd0_r.dot"]
    fwd = (tmp_path / "logs" / "Fwd0_r.dot").read_text()
    assert fwd.startswith("digraph net {") and fwd.rstrip().endswith("}")
    assert '"x" -> "n_0"' in fwd and '"w" [color=blue]' in fwd and "MatMul" in fwd and "L1" in fwd
    assert json.loads(dump.read_text()) == json.loads(s._serializeIr())
    s.prepareDevice()
    assert sorted(os.listdir(o.logDir)) == ["Bwd0_r.dot", "Final_r.dot", "Fwd0_r.dot"]
    bwd = (tmp_path / "logs" / "Bwd0_r.dot").read_text()
    assert "MatMulGrad" in bwd and '"n_3" -> "Gradient___x"' in bwd


def test_ipu_only_instrumentation_warns_once(caplog):
    o = popart.SessionOptions()
    o.instrumentWithHardwareCycleCounter = True
    switches._warned.discard("instrumentWithHardwareCycleCounter")
    with caplog.at_level(logging.WARNING, logger="popart.session"):
        switches.warn_ipu_only(o)
        switches.warn_ipu_only(o)
    msgs = [r.getMessage() for r in caplog.records if "instrumentWithHardwareCycleCounter" in r.getMessage()]
    assert len(msgs) == 1 and "does nothing" in msgs[0]
    caplog.clear()
    switches._warned.clear()
    with caplog.at_level(logging.WARNING, logger="popart.session"):
        switches.warn_ipu_only(popart.SessionOptions())   # the defaults: no warning
    assert not caplog.records


def test_out_of_memory_keeps_xla_peak_buffer_list():
    class JaxRuntimeError(Exception):
        pass
    buffers = "\n".join(f"  Buffer {i}: Size: 1.00MiB Operator: op_name=\"jit(step)/layer{i}/MatMul\""
                        for i in range(200))
    with pytest.raises(popart.OutOfMemoryException) as e:
        with xla_errors("Compiling the step"):
            raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating.\nPeak buffers:\n" + buffers)
    assert "Buffer 0:" in str(e.value) and "Buffer 199:" in str(e.value) and "layer100/MatMul" in str(e.value)


def test_cli_profile(tmp_path, capsys):
    from popart.cli import main
    b, x, s, m, t = _matmul_model()
    b.addOutputTensor(m)
    b.addOutputTensor(t)
    model = tmp_path / "m.onnx"
    model.write_bytes(b.getModelProto())
    out = tmp_path / "prof"
    assert main(["profile", str(model), "--runs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "big/MatMul" in printed and "report.html" in printed
    assert sorted(f for f in os.listdir(out) if "." in f) == ["report.html", "report.json", "trace.json.gz"]
    assert json.loads((out / "report.json").read_text())["time"]["runs_traced"] == 2


# ------------------------------------------------------------------------ a real browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def test_report_html_in_headless_chromium(inference, monkeypatch):
    """Debian's chromium, driven by selenium: no request leaves file://, no console error, one
    table row per node, a header click sorts; a screenshot for docs/."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip("Debian's chromium / chromium-driver are not installed")
    webdriver = pytest.importorskip("selenium.webdriver")
    monkeypatch.setenv("SE_OFFLINE", "true")   # Selenium Manager never downloads a browser or driver
    from selenium.webdriver.common.by import By
    _, folder, data, _ = inference
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-gpu",
              "--window-size=1280,1700", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        driver.get("file://" + os.path.join(folder, "report.html"))
        rows = driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")
        assert len(rows) == data["program"]["nodes"] == 4
        assert rows[0].find_elements(By.TAG_NAME, "td")[0].text == "big/MatMul"
        header = driver.find_element(By.XPATH, "//table[@id='nodes']//th[text()='Node']")
        header.click()
        names = [r.find_elements(By.TAG_NAME, "td")[0].text
                 for r in driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")]
        assert names == sorted(names, key=str.casefold) and "asc" in header.get_attribute("class")
        header.click()
        names = [r.find_elements(By.TAG_NAME, "td")[0].text
                 for r in driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")]
        assert names == sorted(names, key=str.casefold, reverse=True)
        assert driver.find_elements(By.CSS_SELECTOR, "#time-chart svg rect")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        urls = []
        for entry in driver.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg["method"] == "Network.requestWillBeSent":
                urls.append(msg["params"]["request"]["url"])
        assert urls and all(u.startswith("file://") for u in urls), urls
        if os.environ.get("POPART_REPORT_SCREENSHOT"):
            for _ in range(2):   # slowest first
                driver.find_element(By.XPATH, "//table[@id='nodes']//th[text()='µs / run']").click()
            driver.save_screenshot(os.environ["POPART_REPORT_SCREENSHOT"])
    finally:
        driver.quit()


def test_op_names_map_to_innermost_node_and_pass():
    from popart.report.hlo import NodeMap
    nodes = NodeMap({"/0/Conv": "Conv", "layer1/MatMul": "MatMul", "MatMul": "MatMul", "Add_3": "Add"})
    assert nodes.node("jit(step)/while/body/transpose(jvp(/0/Conv))/conv_general_dilated") == \
        ("/0/Conv", "backward")
    assert nodes.node("jit(step)/while/body/closed_call/layer1/MatMul/dot_general") == \
        ("layer1/MatMul", "forward")
    assert nodes.node("jit(step)/Loop_1/body/Add_3/add") == ("Add_3", "forward")
    assert nodes.node("jit(step)/while/body/sub") == (None, "forward")   # the optimizer's own ops


def test_sessions_sharing_a_report_folder_get_their_own(tmp_path):
    first = capture.Recorder(str(tmp_path / "r"), "training", None)
    second = capture.Recorder(str(tmp_path / "r"), "inference", None)
    third = capture.Recorder(str(tmp_path / "r"), "inference", None)
    assert first.directory == str(tmp_path / "r")
    assert second.directory == str(tmp_path / "r" / "inference")
    assert third.directory == str(tmp_path / "r" / "inference-2")


def test_unmodified_example_leaves_a_report_naming_its_nodes(tmp_path):
    """An example program, run as it is with POPLAR_ENGINE_OPTIONS: its one run is traced
    (the window of 2 is not reached, so the trace ends at exit) and its node is named."""
    import subprocess
    import sys
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "builder_add.py")
    env = {**os.environ, "POPLAR_ENGINE_OPTIONS": json.dumps(
        {"autoReport.all": "true", "autoReport.directory": str(tmp_path / "rep")})}
    subprocess.run([sys.executable, os.path.abspath(example)], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=300)
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert [r["node"] for r in data["time"]["per_node"]] == ["Add"]
    assert data["time"]["runs_traced"] == 1 and data["time"]["per_node"][0]["us"] > 0
