"""PopART's tail, second round, host side (issue 37; issue 35 item 6): state, files and
storage, messages, sessions and logs, the launcher. Each test names the PopART source it
transcribes."""
import subprocess
import sys

import numpy as np
import onnx
import pytest

import popart


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------ op definitions (issue 35.6)
def test_supported_operations_definition_reads_graphcore_table():
    """The ai.graphcore attribute / output table (graphcore_schema) is read, and popart does
    not import popxl to read it."""
    r = _python("import sys, popart\n"
                "d = popart.getSupportedOperationsDefinition(False)\n"
                "(k, v), = [(k, v) for k, v in d.items() if k.type == 'CtcBeamSearchDecoder']\n"
                "print(k.numOutputs, sorted(v.attributes), 'popxl' in sys.modules)")
    assert r.returncode == 0, r.stderr
    # ctcbeamsearchdecoder(args, blank, beam_width, top_paths) -> 3 outputs (builder.cpp)
    assert r.stdout.split("\n")[-2] == "3 ['beam_width', 'blank', 'top_paths'] False"


# ------------------------------------------------------------------ state
CPU = popart.DeviceManager().createCpuDevice
W0 = np.array([1.0, -2.0, 3.0], np.float32)


def _l1_model():
    """loss = sum |x * w| (L1, Sum); dloss/dw = x * sign(x * w)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    w = b.addInitializedInputTensor(W0, "w")
    loss = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, w])], 1.0, reduction=popart.ReductionType.Sum)
    return b, x, w, loss


def test_variable_anchor_holds_the_updated_value():
    """IrLowering::getAnchorReturnFragment: a Variable's anchor is copied in the backward
    fragment, after the VarUpdate: each batch's anchor is that batch's updated weight."""
    b, x, w, loss = _l1_model()
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(2, {w: popart.AnchorReturnType("All"),
                                                                      loss: popart.AnchorReturnType("All")}),
                               loss, popart.ConstSGD(0.25), CPU())
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    xs = np.array([[1, 1, 1], [2, -1, 0.5]], np.float32)
    s.run(popart.PyStepIO({x: xs}, anchors))
    want, ref = [], W0.copy()
    for xb in xs:   # the reference: plain SGD on the L1 gradient
        ref = ref - 0.25 * xb * np.sign(xb * ref)
        want.append(ref)
    np.testing.assert_allclose(anchors[w], np.stack(want), rtol=1e-6)
    np.testing.assert_allclose(anchors[loss], [np.abs(xs[0] * W0).sum(),
                                               np.abs(xs[1] * want[0]).sum()], rtol=1e-6)


def test_session_copies_its_options():
    """Ir::setUserOptions copies the SessionOptions: changing them later leaves the session."""
    b, x, w, loss = _l1_model()
    opts = popart.SessionOptions()
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [loss]), CPU(),
                                userOptions=opts)
    opts.constantWeights = False
    opts.enableOutlining = False
    with pytest.raises(popart.popart_exception, match="constantWeights is set"):
        s.prepareDevice()
        s.writeWeights(popart.PyWeightsIO({w: np.zeros(3, np.float32)}))


# ------------------------------------------------------------------ files and storage
@pytest.mark.parametrize("n", [1, 2, 5])
def test_builder_packs_float16_initializers(n):
    """BuilderImpl::populateTensorProtoFromConstVoidData: FLOAT16 bytes memcpy'd into
    ceil(n/2) int32_data entries (low half first); read back as such (onnxutil::getConstData)
    by a session."""
    value = (np.arange(n) * 1.5 - 2).astype(np.float16)
    b = popart.Builder()
    wid = b.addInitializedInputTensor(value)
    y = b.aiOnnx.identity([wid])
    (t,) = onnx.load_from_string(b.getModelProto()).graph.initializer
    padded = np.zeros(-(-n // 2) * 2, np.float16)
    padded[:n] = value
    assert list(t.int32_data) == padded.view(np.int32).tolist()
    assert not t.raw_data and t.data_type == onnx.TensorProto.FLOAT16
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, anchors))
    np.testing.assert_array_equal(anchors[y], value)


def test_builder_lists_initialized_inputs_and_stepio_may_feed_a_weight():
    """BuilderImpl::addInitializedInputTensor adds a graph input and its initializer; the
    StepIO may then hold the weight (CorrectnessAsserter::checkIn: an ONNX input of the
    right size passes and is not streamed), but not one of the wrong size."""
    b, x, w, loss = _l1_model()
    m = onnx.load_from_string(b.getModelProto())
    assert [v.name for v in m.graph.input] == [x, w]
    assert m.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in m.graph.input[1].type.tensor_type.shape.dim] == [3]
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [loss]), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.ones(3, np.float32), w: np.full(3, 9, np.float32)}, anchors))
    assert anchors[loss] == np.abs(W0).sum()          # the weight, not the StepIO's array
    with pytest.raises(popart.popart_exception,
                       match=f"Unexpected number of input elements for Tensor {w}. Expected 3, "
                             f"but received 2"):
        s.run(popart.PyStepIO({x: np.ones(3, np.float32), w: np.ones(2, np.float32)}, anchors))


def test_constant_debug_info_id_is_not_its_value():
    """A Constant carries the Builder's ``__debug_info_id`` attribute: shape inference reads
    its 'value' only (Reshape to the constant shape [1, 2], not to [debug id])."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 1]))
    c = b.aiOnnx.constant(np.array([1, 2], np.int64))
    r = b.aiOnnx.reshape([x, c])
    assert b.getTensorShape(r) == [1, 2]


@pytest.fixture(scope="module")
def l1_training():
    b, x, w, loss = _l1_model()
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.5), CPU())
    s.prepareDevice()
    return s, x, w, loss


def _weights_model(**arrays):
    b = popart.Builder()
    for name, value in arrays.items():
        b.addInitializedInputTensor(value, name)
    return b.getModelProto()


def test_reset_host_weights_skips_a_tensor_of_the_model(l1_training):
    """Executablex::resetWeights: an initializer naming any tensor of the session
    (containsTensor), here the input 'x', is not 'no tensor'; its info is still checked;
    one naming no tensor raises unless ignoreWeightsInModelWithoutCorrespondingHostWeight."""
    s, x, w, loss = l1_training
    new = np.array([4.0, 5.0, 6.0], np.float32)
    s.resetHostWeights(_weights_model(w=new, x=np.zeros(3, np.float32)))
    with pytest.raises(popart.popart_exception) as e:
        s.resetHostWeights(_weights_model(w=new, x=np.zeros(2, np.float32)))
    assert e.value.args[0] == ("Trying to reset weights using tensor with non matching tensor "
                               "info. Tensor ID: x")
    with pytest.raises(popart.popart_exception) as e:
        s.resetHostWeights(_weights_model(w=new, extra=np.zeros(1, np.float32)))
    assert e.value.args[0] == "resetWeights, no tensor 'extra' in tensors"
    s.resetHostWeights(_weights_model(w=new, extra=np.zeros(1, np.float32)), True)
    s.weightsFromHost()
    out = {w: np.zeros(3, np.float32)}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(out))
    np.testing.assert_array_equal(out[w], new)


# ------------------------------------------------------------------ multi-process jobs
@pytest.mark.parametrize("as_module", [False, True])
def test_poprun_sees_a_rank_raising_system_exit(tmp_path, as_module):
    """`poprun --num-instances 2 python prog.py` (or `python -m prog`): rank 1 ends with
    `raise SystemExit(7)` (the common `raise SystemExit(main())`) while rank 0 sleeps for two
    minutes. The job ends with 7 within seconds of both ranks being in it, as with
    `sys.exit(7)`; the program ran as `python prog.py` would run it (`__name__`,
    `sys.argv`)."""
    import os
    import socket
    import time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "helpers", "raise_exit_worker.py")
    program = ["-m", "raise_exit_worker"] if as_module else [worker]
    p = subprocess.run([sys.executable, "-m", "popdist.poprun", "--num-instances", "2",
                        "--port", str(port), sys.executable, *program, str(tmp_path)],
                       capture_output=True, text=True, timeout=200, cwd=os.path.dirname(worker))
    took = time.time() - max(os.path.getmtime(tmp_path / f"ready.{r}") for r in range(2))
    assert p.returncode == 7, p.stderr
    assert took < 30, took
    assert f"[rank 1] rank 1 joined; __name__ __main__; argv ['{tmp_path}']" in p.stdout
    assert "poprun: rank 1 exited with status 7" in p.stderr


def test_broadcast_weights_before_prepare_device(tmp_path):
    """Session::broadcastWeights broadcasts the executable's host weights, so called before
    prepareDevice it gives every rank rank 0's initial weights (here w = 1 on rank 0, 2 on
    rank 1): both ranks' loss sum |x * w| is rank 0's, 6."""
    import os
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from popart.cli import main
    worker = os.path.join(os.path.dirname(__file__), "helpers", "broadcast_worker.py")
    assert main(["launch", "-n", "2", "--port", str(port), worker, str(tmp_path)]) == 0
    for r in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"{r}.npy"), 6.0)


# ------------------------------------------------------------------ the engine cache
@pytest.fixture
def session_log(capsys):
    """The session / devicex log lines (module, level, message) written while the test runs."""
    import popart.logging as plog
    plog.getLogger().setLevel("TRACE")
    capsys.readouterr()

    def lines():
        out = []
        for line in capsys.readouterr().err.splitlines():
            if line.startswith("[") and "] [popart:" in line:
                module, rest = line.split("] [popart:", 1)[1].split("] [", 1)
                level, msg = rest.split("] ", 1)
                out.append((module, level, msg))
        return out
    yield lines
    plog.getLogger().setLevel("OFF")


def _cached_session(folder, scale=2.0):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    y = b.aiGraphcore.scale([x], scale)
    opts = popart.SessionOptions()
    opts.enableEngineCaching, opts.cachePath = True, str(folder)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU(),
                                userOptions=opts)
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.array([1, 2], np.float32)}, anchors))
    np.testing.assert_allclose(anchors[y], [scale, 2 * scale])
    return s


def test_engine_cache_entries_are_named_by_the_hash(tmp_path, session_log, monkeypatch):
    """Executablex::getCachePath: <cachePath>/<hash>.popef. A second session finds it by its
    name (session.cpp inferCacheEntryFromPath), checks the hash the file holds (popef
    Reader), loads it and logs no compilation; POPART_PRELOAD_POPEF=full-preload reads the
    file through first; another file in the folder is looked into and ignored."""
    from popart import testing
    _cached_session(tmp_path)
    (entry,) = tmp_path.glob("*.popef")
    assert entry.stem.isdigit() and int(entry.stem) < 2 ** 64
    (tmp_path / "notes.popef").write_bytes(b"not an executable")
    session_log()
    monkeypatch.setenv("POPART_PRELOAD_POPEF", "full-preload")
    s = _cached_session(tmp_path)
    assert testing.executable_source(s) == "engine cache"
    log = session_log()
    msgs = [m for _, _, m in log]
    assert ("session", "info", f"PopEF file inferred to have hash '{entry.stem}' has been "
                               f"found: {entry}") in log
    assert ("session", "info", f"PopART cache file has been found: {entry}") in log
    assert ("session", "debug", f"Performing preload of popef file {entry}") in log
    assert ("session", "debug", f"Completed preload of popef file {entry}") in log
    assert ("session", "trace", "Cannot infer IR hash from PopEF file name: notes") in log
    assert any(m.startswith(f"Ignoring invalid cache file {tmp_path / 'notes.popef'}: ")
               for m in msgs)
    assert not any("ompil" in m for m in msgs), msgs   # no compilation logged


def test_engine_cache_false_hit_is_ignored(tmp_path, session_log):
    """Ir::compareWithSavedHash: a file named by this IR's hash that holds another program
    (its stored hash differs) is a false cache hit: warned about, and the program compiled."""
    from popart import testing
    _cached_session(tmp_path / "a", 2.0)
    _cached_session(tmp_path / "b", 3.0)
    (a,), (b,) = (tmp_path / "a").glob("*.popef"), (tmp_path / "b").glob("*.popef")
    b.write_bytes(a.read_bytes())            # the 2.0 program under the 3.0 program's hash
    session_log()
    s = _cached_session(tmp_path / "b", 3.0)
    assert testing.executable_source(s) == "compiled (cached)"
    log = session_log()
    assert ("session", "warning", "Cache file hash did not match the IR hash, ignoring false "
                                  "cache hit.") in log
    assert ("devicex", "info", "Starting compilation") in log


# ------------------------------------------------------------------ messages
def _error(fn):
    """(class, args[0], notes) of what ``fn()`` raises."""
    with pytest.raises(popart.popart_exception) as e:
        fn()
    return type(e.value), e.value.args[0], getattr(e.value, "__notes__", [])


@pytest.mark.parametrize("method,text", [("getPipelineStage", "Pipeline stage"),
                                         ("getExecutionPhase", "Execution phase"),
                                         ("getVirtualGraph", "Virtual graph")])
def test_builder_scope_getters_without_a_scope(method, text):
    """builder.cpp Builder::getPipelineStage / getExecutionPhase / getVirtualGraph."""
    _, msg, notes = _error(getattr(popart.Builder(), method))
    assert msg == f"{text} not set in current scope." and notes


def test_convert_initializers_to_constants_names_the_missing_id():
    """graphtransformer_impl.cpp convertInitializersToConstants (PopART's spelling)."""
    b = popart.Builder()
    b.addInitializedInputTensor(np.ones(2, np.float32), "w")
    g = popart.GraphTransformer(b.getModelProto())
    assert _error(lambda: g.convertInitializersToConstants(["w", "nope"]))[1] == \
        "TensorId nope not in the model initalizers"


@pytest.mark.parametrize("values,text", [
    ({"defaultLearningRate": (-0.5, False)},
     "Negative learning rate (-0.5) in SGD, bailing as this might be a user error."),
    ({"defaultLearningRate": (0.0, True)},
     "Constant, zero learning rate in SGD, bailing as this might be a user error."),
    ({"defaultWeightDecay": (-1.0, True)},
     "Negative weight decay (-1) in SGD, bailing as this might be a user error"),
    ({"defaultDampening": (-0.25, True)},
     "Negative dampening (-0.25) in SGD, bailing as this might be a user error"),
    ({"defaultVelocityScaling": (0.0, True)},
     "Non-positive velocity scaling (0) in SGD is not supported")])
def test_sgd_value_checks(values, text):
    """sgd.cpp SGD::runValueChecks; a non-const zero learning rate is allowed."""
    assert _error(lambda: popart.SGD(values))[1] == text
    popart.SGD({"defaultLearningRate": (0.0, False)})


def test_adam_value_checks():
    """adam.cpp Adam::runValueChecks."""
    assert _error(lambda: popart.Adam({"defaultBeta2": (-0.1, True)}))[1] == \
        "Negative beta2 (-0.1) in Adam, bailing as this might be a user error"
    assert _error(lambda: popart.Adam({"defaultEps": (0.0, True)}))[1] == \
        "Non-positive eps (0) in Adam is not supported"


@pytest.mark.parametrize("model,shown", [
    (b"\x08\x01{not a 'model'}\n", r"\x08\x01{{not a \'model\'}}\n"),
    ("missing.onnx", "missing.onnx"),
    (b"\xff" * 120, r"\xff" * 101 + "...")])
def test_a_string_that_is_no_model(model, shown):
    """filereader.cpp getModelFromString, the string as formatModelProtoString shows it."""
    cls, msg, notes = _error(lambda: popart.InferenceSession(model, popart.DataFlow(1, ["y"]),
                                                             CPU()))
    assert msg == (f"Failed to load a ModelProto from the string '{shown}'.\nCheck that it is "
                   f"either a valid path to an existing onnx model file, or is a valid onnx "
                   f"ModelProto string.") and notes


def test_device_id_that_does_not_exist():
    """Poplar's text for an id no device has: PopART's tryAcquireDeviceById
    (devicemanager.cpp:259) asks Poplar's device manager, whose poplar_error PopART passes
    on as ``poplar_exception`` (popart.cpp:3654), not a popart_exception."""
    with pytest.raises(popart.poplar_exception) as e:
        popart.DeviceManager().acquireDeviceById(100000)
    assert not isinstance(e.value, popart.popart_exception)
    assert e.value.args[0] == "No such device set id: '100000'" and e.value.__notes__


def test_session_without_a_device():
    """session.cpp createFromOnnxModel: checked before the model is read."""
    _, msg, notes = _error(lambda: popart.InferenceSession(b"junk", popart.DataFlow(1, ["y"]),
                                                           None))
    assert msg == "Must pass a valid deviceInfo to InferenceSession::createFromOnnxModel" and notes


def test_weights_to_host_before_prepare_device():
    """devicex.cpp Devicex::weightsToHost, as a popart runtime error."""
    b, x, w, loss = _l1_model()
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.5), CPU())
    cls, msg, notes = _error(s.weightsToHost)
    assert issubclass(cls, popart.popart_runtime_error) and notes
    assert msg == ("Devicex::prepare() must be called before Devicex::weightsToHost(const "
                   "std::map<TensorId, MutableVoidData> &) is called.")


def test_session_argument_of_a_type_the_binding_rejects():
    """pybind11's TypeError for PopART's _InferenceSessionCore / _TrainingSessionCore
    constructors (popart.cpp): raised before any PopART check (the missing device)."""
    b, x, w, loss = _l1_model()
    with pytest.raises(TypeError) as e:
        popart.InferenceSession(b.getModelProto(), {loss: "ALL"}, None)
    msg = e.value.args[0]
    assert msg.startswith("__init__(): incompatible constructor arguments. The following "
                          "argument types are supported:\n    1. popart_core._InferenceSession"
                          "Core(model: str, dataFlow: popart_core.DataFlow, deviceInfo: ")
    assert "\n    2. popart_core._InferenceSessionCore(ir: popart_core.Ir" in msg
    assert f"\n\nInvoked with: " in msg and repr({loss: "ALL"}) in msg
    assert isinstance(e.value, popart.popart_exception)
    with pytest.raises(TypeError, match=r"optimizer: popart_core\.Optimizer"):
        popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss, 0.1, CPU())


# ------------------------------------------------------------------ pipelining checks
def _pipelined(stages, bps=4, accumulation=None):
    """Mul on (virtual graph, stage) stages[0], Relu + L1 loss on stages[1]; 2 IPUs."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    w = b.addInitializedInputTensor(np.ones(2, np.float32), "w")
    with b.virtualGraph(stages[0]):
        y = b.aiOnnx.mul([x, w])
    with b.virtualGraph(stages[1]):
        loss = b.aiGraphcore.l1loss([b.aiOnnx.relu([y])], 1.0)
    o = popart.SessionOptions()
    o.enablePipelining, o.virtualGraphMode = True, popart.VirtualGraphMode.Manual
    if accumulation is not None:
        o.enableGradientAccumulation, o.accumulationFactor = True, accumulation
    return lambda: popart.TrainingSession(
        b.getModelProto(), popart.DataFlow(bps, [loss]), loss, popart.ConstSGD(0.1),
        popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}), userOptions=o)


def test_pipeline_depth_against_batches_per_step():
    """Pipeline::apply: enough batches (or accumulated micro-batches) to fill 2 stages."""
    assert _error(_pipelined((0, 1), bps=1))[1] == (
        "For pipelining, depth (batchesPerStep) must equal at least the number of pipeline "
        "stages (2)")
    assert _error(_pipelined((0, 1), bps=8, accumulation=1))[1] == (
        "For pipelining, depth (gradient accumulation factor) must equal at least the number "
        "of pipeline stages (2)")
    _pipelined((0, 1), bps=2)()


def test_tensor_consumed_in_an_earlier_pipeline_stage():
    """InferPipelineStages' checkOrder (stages from the virtual graphs): raised when the
    session is built."""
    _, msg, _ = _error(_pipelined((1, 0)))
    lines = msg.split("\n")
    assert lines[0] == "Tensor Mul:0 is consumed in an earlier pipeline stage than it is produced"
    assert lines[1].startswith("Producer Op(Mul (ai.onnx.Mul:") and \
        lines[1].endswith("inputs=[x, w], outputs=[Mul:0]) has pipeline stage 1")
    assert lines[2].startswith("Consumer Op(Relu (ai.onnx.Relu:") and \
        lines[2].endswith("inputs=[Mul:0], outputs=[Relu:0]) has pipeline stage 0")


# ------------------------------------------------------------------ sessions and logs
def test_print_tensor_writes_to_stderr(capfd):
    """PrintTensor's output goes to stderr (PopART's), the anchors are the input's."""
    import jax
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
    y = b.aiGraphcore.printtensor([x], title="seen")
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    capfd.readouterr()
    s.run(popart.PyStepIO({x: np.array([1.5, -2, 3], np.float32)}, anchors))
    jax.effects_barrier()
    out, err = capfd.readouterr()
    assert "seen" not in out and "seen: [ 1.5 -2.   3. ]" in err
    np.testing.assert_array_equal(anchors[y], [1.5, -2, 3])


def test_weights_to_host_logs_popart_lines(l1_training, session_log):
    """Devicex::weightsToHost's debug lines (devicex module)."""
    s = l1_training[0]
    s.weightsFromHost()
    session_log()
    s.weightsToHost()
    log = session_log()
    assert ("devicex", "debug", "Writing weights to host") in log
    assert ("devicex", "debug", "Writing weights to host complete.") in log


SYNTHETIC_TYPES = ["FLOAT", "FLOAT16", "INT32", "UINT32", "INT16", "UINT16", "INT8", "UINT8",
                   "BOOL"]


@pytest.mark.parametrize("mode", ["Zeros", "RandomNormal", "RandomUniform"])
def test_synthetic_data_over_every_input_type(mode):
    """Ir::registerInputTensors: every input type PopART makes synthetic data for (one
    session, an input of each); RandomNormal rounds to the integer types
    (convertFloatToDataType); INT64 has none, an error when the session is built."""
    b = popart.Builder()
    xs = [b.addInputTensor(popart.TensorInfo(t, [64]), t.lower()) for t in SYNTHETIC_TYPES]
    ys = [b.aiOnnx.identity([x]) for x in xs]
    opts = popart.SessionOptions()
    opts.syntheticDataMode = getattr(popart.SyntheticDataMode, mode)
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, ys), CPU(),
                                userOptions=opts)
    s.prepareDevice()
    feeds = s._io.synthetic()
    for x, t in zip(xs, SYNTHETIC_TYPES):
        v = feeds[x][0, 0, 0]
        assert v.dtype == popart.TensorInfo(t, [1]).np_dtype() and v.shape == (64,)
        if mode == "Zeros":
            assert not v.any()
        elif mode == "RandomNormal" and t in ("FLOAT", "FLOAT16"):
            assert abs(float(v.astype(np.float64).mean())) < 0.5 and 0.5 < v.astype(np.float64).std() < 1.5
        elif mode == "RandomNormal" and t.startswith("INT"):
            normal = np.random.default_rng(0).standard_normal(64).astype(np.float32)
            np.testing.assert_array_equal(v, np.rint(normal).astype(v.dtype))
        elif mode == "RandomUniform" and t != "BOOL":
            assert len(np.unique(v)) > 32
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({}, anchors))
    b = popart.Builder()
    y = b.aiOnnx.identity([b.addInputTensor(popart.TensorInfo("INT64", [2]), "i")])
    what = "generate synthetic data for" if mode == "RandomUniform" else "convert float to"
    assert _error(lambda: popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]),
                                                  CPU(), userOptions=opts))[1] == \
        f"Can't {what} DataType INT64"


def test_exception_classes_as_popart_binds_them():
    """popart.cpp's py::exception hierarchy: each _throw_* raises its class, whose base is
    the one PopART registers it with (unknown runtime errors are system runtime errors);
    Poplar's and PopLibs' errors are ``py::exception``s of the default base ``Exception``
    (popart.cpp:3652-3654), apart from popart_exception."""
    bases = {popart.poplar_exception: Exception, popart.poplibs_exception: Exception,
             popart.popart_internal_exception: popart.popart_exception,
             popart.popart_runtime_error: popart.popart_exception,
             popart.poplar_runtime_error: popart.poplar_exception,
             popart.poplar_application_runtime_error: popart.poplar_runtime_error,
             popart.poplar_system_runtime_error: popart.poplar_runtime_error,
             popart.poplar_recoverable_runtime_error: popart.poplar_system_runtime_error,
             popart.poplar_unrecoverable_runtime_error: popart.poplar_system_runtime_error,
             popart.poplar_unknown_runtime_error: popart.poplar_system_runtime_error}
    for cls, base in bases.items():
        assert cls.__bases__ == (base,), cls
    for fn, cls in ((popart._throw_unknown_runtime_error, popart.poplar_unknown_runtime_error),
                    (popart._throw_system_runtime_error, popart.poplar_system_runtime_error),
                    (popart._throw_popart_runtime_error, popart.popart_runtime_error)):
        with pytest.raises(cls) as e:
            fn("boom")
        assert type(e.value) is cls and e.value.args[0] == "boom"


# ------------------------------------------------------------------ the IR's JSON
def _ir_ops(s):
    import json
    return json.loads(s._serializeIr(popart.IrSerializationFormat.JSON))["maingraph"]


def test_ir_json_sgd2_decomposition_and_schedule_priority():
    """SGD2Decompose (separate accumulators, 2 accumulated micro-batches): Accumulate into
    Accum___w, SGD2PartialAcclUpdate and Accumulate of Accl1___w (intermediate ids
    <id>__t<n>), AccumulatorZero, SGD2VarUpdate; every op's attributes end with
    schedulePriority (Op::appendMore)."""
    b, x, w, loss = _l1_model()
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
    opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)},
                     accumulatorAndMomentum=popart.SGDAccumulatorAndMomentum.Separate)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss, opt, CPU(),
                               userOptions=opts)
    ops = _ir_ops(s)
    got = [(o["type"], o["name"], [i["name"] for i in o["inputs"]],
            [t["name"] for t in o["outputs"]]) for o in ops]
    g = "Gradient___" + w
    assert got[-5:] == [
        ("Accumulate", "w_accumulate", ["Accum___w", g], ["Accum___w__t0"]),
        ("SGD2PartialAcclUpdate", "w_accl_update_0_prev_v_w", ["Accl1___w", "w"],
         ["Accl1___w__t1"]),
        ("Accumulate", "w_accl_update_1_grads", ["Accl1___w__t1", "Accum___w__t0"],
         ["Accl1___w__t1__t2"]),
        ("AccumulatorZero", "w_accumupdate", ["Accum___w"], ["UpdatedVar___Accum___w"]),
        ("SGD2VarUpdate", "w_var_update", ["w", "Accl1___w__t1__t2"], ["UpdatedVar___w"])]
    assert all(list(o["attributes"])[-1] == "schedulePriority" and
               o["attributes"]["schedulePriority"] == "0.000000" for o in ops)


def test_ir_json_random_like_ops_are_folded():
    """LikeOpsPattern: RandomNormalLike(x) is RandomNormal of x's shape and type, named
    <name>_RandomNormalLikeOpPattern, with no input."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    r = b.aiOnnx.randomuniformlike([x], high=2.0, low=1.0)
    y = b.aiOnnx.add([x, r])
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU())
    (op, add) = _ir_ops(s)
    assert (op["type"], op["inputs"], op["outputs"][0]["name"]) == ("RandomUniform", [], r)
    assert op["name"].endswith("_RandomUniformLikeOpPattern")
    assert op["attributes"]["shape"] == "[2 3]" and op["attributes"]["dtype"] == "FLOAT"
    # the folded op reads no x: the Add is its one reader, and Inplace (after LikeOps) makes
    # it AddLhsInplace
    assert op["attributes"]["high"] == "2.0" and add["type"] == "AddLhsInplace"


def test_ir_json_als_histograms_scheduled_early():
    """AutomaticLossScale: with delayed var updates and
    scheduleNonWeightUpdateGradientConsumersEarly, each Histogram's schedulePriority is the
    largest double (std::to_string of it as a float: inf)."""
    b2 = popart.Builder()
    x = b2.addInputTensor(popart.TensorInfo("FLOAT16", [3]), "x")
    w = b2.addInitializedInputTensor(W0.astype(np.float16), "w")
    loss = b2.aiGraphcore.l1loss([b2.aiOnnx.mul([x, w])], 1.0)
    opts = popart.SessionOptions()
    opts.automaticLossScalingSettings.enabled = True
    opts.scheduleNonWeightUpdateGradientConsumersEarly = True
    opt = popart.SGD({"defaultLearningRate": (0.1, False), "lossScaling": (8.0, False)})
    s = popart.TrainingSession(b2.getModelProto(), popart.DataFlow(1, [loss]), loss, opt, CPU(),
                               userOptions=opts)
    s.prepareDevice()
    hist = [o for o in _ir_ops(s) if o["type"] == "Histogram"]
    assert hist and all(o["attributes"]["schedulePriority"] == "inf" for o in hist)


def test_invalid_virtual_graph_names_the_op_as_popart():
    """IrLowering::prepareGraph (prepareDevice): the op as Op::debugName writes it."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2]), "x")
    with b.virtualGraph(0):
        y = b.aiOnnx.relu([x])
    with b.virtualGraph(3):
        z = b.aiOnnx.neg([y])
    opts = popart.SessionOptions()
    opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [z]),
                                popart.DeviceManager().createIpuModelDevice({"numIPUs": 2}),
                                userOptions=opts)
    msg = _error(s.prepareDevice)[1]
    assert msg.startswith("Op(Neg (ai.onnx.Neg:") and msg.endswith(
        f"inputs=[{y}], outputs=[{z}]) has been assigned to an invalid virtual graph 3. "
        f"numIPUs = 2.")


def test_set_random_seed_of_a_type_the_binding_rejects():
    """pybind11's TypeError for setRandomSeed(uint64_t) given a str."""
    b, x, w, loss = _l1_model()
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.5), CPU())
    with pytest.raises(TypeError) as e:
        s.setRandomSeed("3")
    assert e.value.args[0] == (
        "setRandomSeed(): incompatible function arguments. The following argument types are "
        "supported:\n    1. (self: popart_core._TrainingSessionCore, seedValue: int) -> None"
        f"\n\nInvoked with: {s!r}, '3'")


def test_variable_anchor_with_accumulated_gradients_holds_the_step_s_input():
    """With gradient accumulation the update runs after the micro-batches (the accumulate
    outer fragment), so each micro-batch's anchor of a Variable is the weight it used."""
    b, x, w, loss = _l1_model()
    opts = popart.SessionOptions()
    opts.enableGradientAccumulation, opts.accumulationFactor = True, 2
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, {w: popart.AnchorReturnType("All")}),
                               loss, popart.ConstSGD(0.25), CPU(), userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    anchors = s.initAnchorArrays()
    xs = np.ones((2, 3), np.float32)
    for step in range(2):
        s.run(popart.PyStepIO({x: xs}, anchors))
        # step 0 uses W0; the accumulated (summed) gradient 2 sign(W0) then updates it
        want = W0 - step * 0.25 * 2 * np.sign(W0)
        np.testing.assert_allclose(anchors[w], np.stack([want, want]), rtol=1e-6)


@pytest.mark.parametrize("inplace,anchor_expand", [(True, False), (False, False), (True, True)])
def test_ir_json_expand_inplace(inplace, anchor_expand):
    """The Inplace pattern (on by default) makes an inference Expand of a stream input
    ExpandInplace; not with InPlace off. An anchored output does not stop a view (ir.cpp
    applyInplacePattern checks that the input, not the output, is unmodifiable)."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [3, 1]), "x")
    e = b.aiOnnx.expand([x, b.aiOnnx.constant(np.array([2, 1, 6], np.int64))])
    y = b.aiOnnx.identity([e])
    patterns = popart.Patterns()
    patterns.InPlace = inplace
    s = popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y] + [e] * anchor_expand),
                                CPU(), patterns=patterns)
    types = [op["type"] for op in _ir_ops(s)]
    assert ("ExpandInplace" in types) == inplace
    assert ("Expand" in types) == (not inplace)
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: np.array([[1], [2], [3]], np.float32)}, anchors))
    np.testing.assert_array_equal(anchors[y], np.broadcast_to([[1], [2], [3]], (2, 3, 6)))


def test_random_seed_before_prepare_device_error_order(tmp_path):
    """Session::setRandomSeed / getRandomSeed before prepareDevice: a session built with a
    device has its executable (Session::setDevice), so Devicex's prepare check speaks;
    with an engine-cache hit setDevice makes none: 'There is no executatable'."""
    def session():
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
        y = b.aiOnnx.add([x, b.aiOnnx.randomuniform(shape=[3])])
        opts = popart.SessionOptions()
        opts.enableEngineCaching, opts.cachePath = True, str(tmp_path)
        return popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), CPU(),
                                       userOptions=opts)
    s = session()
    assert _error(lambda: s.setRandomSeed(1))[1] == (
        "Devicex::prepare() must be called before Devicex::setRandomSeedFromHost(uint64_t) "
        "is called.")
    assert _error(s.getRandomSeed)[1] == (
        "Devicex::prepare() must be called before Devicex::getRandomSeedToHost() is called.")
    s.prepareDevice()                        # writes the engine-cache entry
    hit = session()
    for call in (lambda: hit.setRandomSeed(1), hit.getRandomSeed):
        assert _error(call)[1] == "There is no executatable. Try calling Session::prepareDevice first."
    hit.prepareDevice()
    hit.setRandomSeed(5)
    assert hit.getRandomSeed() == 5


# ---------------------------------------------------------- pybind11's incompatible arguments
def _pybind_text(fn: str, constructor: bool, signatures: list, invoked: str) -> str:
    """pybind11's message (pybind11.h, ``cpp_function::dispatcher``), written out here."""
    kind = "constructor" if constructor else "function"
    lines = "".join(f"    {i}. {sig}\n" for i, sig in enumerate(signatures, 1))
    return (f"{fn}(): incompatible {kind} arguments. The following argument types are "
            f"supported:\n{lines}\nInvoked with: {invoked}")


_TI = "popart._internal.ir.TensorInfo"
_TI_SIGS = [f"{_TI}()", f"{_TI}(dataType: popart._internal.ir.DataType, shape: List[int])",
            f"{_TI}(dataType: popart._internal.ir.DataType, shape: List[int], metaShape: List[int])",
            f"{_TI}(dataType: str, shape: str)", f"{_TI}(dataType: str, shape: List[int])"]


@pytest.mark.parametrize("args,invoked", [(("FLOAT", 3), "'FLOAT', 3"),
                                          (("FLOAT", [2.5]), "'FLOAT', [2.5]"),
                                          ((3, [2]), "3, [2]")])
def test_tensorinfo_incompatible_constructor_arguments(args, invoked):
    """bindings/tensorinfo.cpp's five constructors; the accepted forms still work."""
    with pytest.raises(TypeError) as e:
        popart.TensorInfo(*args)
    assert str(e.value) == _pybind_text("__init__", True, _TI_SIGS, invoked)
    assert isinstance(e.value, popart.popart_exception)
    assert popart.TensorInfo("FLOAT", (2, np.int64(3))).shape() == [2, 3]


def test_tensorinfo_wrong_argument_count_is_the_wrappers_text():
    """python_files/tensorinfo.py: neither (dtype, shape) nor an array."""
    with pytest.raises(TypeError, match=r"^Can not create TensorInfo with args \(1, 2, 3\)$"):
        popart.TensorInfo(1, 2, 3)


_DF = ["popart_core.DataFlow(batchesPerStep: int, anchorTensors: "
       "Dict[str, popart_core.AnchorReturnType])"] * 2 + [
    "popart_core.DataFlow(batchesPerStep: int, anchorIds: List[str], anchorReturnType: "
    "popart_core.AnchorReturnType = <popart_core.AnchorReturnType object>)"]


@pytest.mark.parametrize("args,invoked", [((1.5, ["a"]), "1.5, ['a']"), ((1, "a"), "1, 'a'"),
                                          ((1, {"a": "ALL"}), "1, {'a': 'ALL'}"),
                                          ((1, ["a"], "ALL"), "1, ['a'], 'ALL'")])
def test_dataflow_incompatible_constructor_arguments(args, invoked):
    """popart.cpp's three DataFlow constructors (the first two are the same)."""
    with pytest.raises(TypeError) as e:
        popart.DataFlow(*args)
    assert str(e.value) == _pybind_text("__init__", True, _DF, invoked)
    assert popart.DataFlow(np.int32(2), ("a",)).batchesPerStep() == 2


def test_anchor_return_type_incompatible_constructor_arguments():
    sigs = [f"popart_core.AnchorReturnType(anchorReturnTypeString: str, {rp}tileSet: "
            "popart_core.TileSet = <TileSet.Compute: 0>, exchangeStrategy: "
            "popart_core.ExchangeStrategy = <ExchangeStrategy.JustInTime: 0>)"
            for rp in ("", "returnPeriod: int, ")]
    for args, invoked in [((3,), "3"), (("EveryN", "2"), "'EveryN', '2'")]:
        with pytest.raises(TypeError) as e:
            popart.AnchorReturnType(*args)
        assert str(e.value) == _pybind_text("__init__", True, sigs, invoked)
    assert popart.AnchorReturnType("EveryN", 2).rp() == 2


def test_pystepio_incompatible_constructor_arguments():
    with pytest.raises(TypeError) as e:
        popart.PyStepIO([np.zeros(2)], {})
    assert str(e.value) == _pybind_text("__init__", True, [
        "popart_core.PyStepIO(inputs: Dict[str, numpy.ndarray], outputs: "
        "Dict[str, numpy.ndarray])"], "[array([0., 0.])], {}")


def test_device_manager_incompatible_function_arguments():
    """popart.cpp's DeviceManager bindings: ``self`` leads "Invoked with"."""
    dm = popart.DeviceManager()
    link = ("pattern: popart_core.SyncPattern = <SyncPattern.Full: 0>, connectionType: "
            "popart_core.DeviceConnectionType = <DeviceConnectionType.Always: 0>")
    dm_self = "self: popart_core.DeviceManager"
    cases = [(dm.acquireDeviceById, ("0",), "acquireDeviceById",
              f"({dm_self}, id: int, {link}) -> popart_core.DeviceInfo", "'0'"),
             (dm.createIpuModelDevice, ([2],), "createIpuModelDevice",
              f"({dm_self}, arg0: dict) -> popart_core.DeviceInfo", "[2]"),
             (dm.acquireAvailableDevice, (1.0,), "acquireAvailableDevice",
              f"({dm_self}, numIpus: int = 1, tilesPerIpu: int = 0, {link}, selectionCriterion: "
              "popart_core.DeviceSelectionCriterion = <DeviceSelectionCriterion.First: 0>) -> "
              "popart_core.DeviceInfo", "1.0, 0")]
    for method, args, fn, sig, invoked in cases:
        with pytest.raises(TypeError) as e:
            method(*args)
        assert str(e.value) == _pybind_text(fn, False, [sig], f"{dm!r}, {invoked}")


def test_const_sgd_incompatible_constructor_arguments():
    with pytest.raises(TypeError) as e:
        popart.ConstSGD("0.1")
    assert str(e.value) == _pybind_text("__init__", True, [
        "popart_core.ConstSGD(learning_rate: float, weight_decay: float = 0.0, loss_scaling: "
        "float = 1.0, clip_norm_settings: List[popart_core.ClipNormSettings] = [])"],
        "'0.1'")   # pybind11 shows the arguments given, not the defaults
    assert popart.ConstSGD(np.float32(0.5), 0).learningRates().getDefault().val() == 0.5
