"""Round trips (issue 15, item 6): what comes in goes out in the same form.

* ``modelToHost`` keeps each initializer's storage form (``float_data`` / ``int32_data`` /
  ``raw_data`` / sparse / external), byte for byte where the value did not change;
* external tensor data as PopART handles it (willow/src/onnxutil.cpp,
  ``saveInitializersExternally``; session.cpp ``modelToHost`` /
  ``updateExternallySavedTensorLocations``; ir.cpp ``addAdditionalModelProtoTensors``):
  absolute and relative paths, Builders and sessions made from such models, trained values
  and optimizer state written back to the external file, checkpoints, PopART's errors;
* a model may read external data only from its own folder, from files the program wrote
  itself, or from folders listed in POPART_EXTERNAL_DATA_DIRS;
* sparse initializers and Constant ``sparse_value`` import as dense tensors;
* the attribute forms of older opsets, built through ``aiOnnxOpsetN``, run as onnxruntime
  runs them.

Expected values are PopART's documented behaviour; numbers come from onnxruntime.
"""
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import popart

CPU = popart.DeviceManager().createCpuDevice
RNG = np.random.default_rng(15)


# ----------------------------------------------------------------------------- helpers
def ort_run(model, feeds, base_dir=None, outputs=None):
    """onnxruntime on ``model`` (path, bytes or ModelProto), its external data inlined by a
    reader of its own here (absolute locations as they are, relative ones from
    ``base_dir`` / the model's folder): onnx and onnxruntime refuse absolute locations,
    which PopART writes."""
    if isinstance(model, (str, os.PathLike)):
        base_dir = base_dir or os.path.dirname(os.path.abspath(model))
        model = onnx.load(str(model), load_external_data=False)
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    else:
        model = onnx.ModelProto.FromString(model.SerializeToString())
    for t in model.graph.initializer:
        if t.data_location == TP.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            path = info["location"]
            path = path if os.path.isabs(path) else os.path.join(base_dir or os.getcwd(), path)
            with open(path, "rb") as f:
                f.seek(int(info.get("offset", 0)))
                t.raw_data = f.read(int(info["length"]))
            del t.external_data[:]
            t.data_location = TP.DEFAULT
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def run(session, feeds):
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO(feeds, anchors))
    return anchors


def infer(model, feeds, anchors):
    s = popart.InferenceSession(model, popart.DataFlow(1, anchors), CPU())
    s.prepareDevice()
    return s, run(s, feeds)


def ext(t: onnx.TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def data_fields(t: onnx.TensorProto) -> list:
    return [f.name for f, _ in t.ListFields() if f.name.endswith("_data") and f.name != "external_data"]


def inits(path) -> dict:
    return {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}


def external_model(folder, location="w.bin", w=None):
    """y = x + w, w's data in ``location`` (relative to ``folder``, or absolute)."""
    w = np.array([1.0, -2.0, 3.0], np.float32) if w is None else w
    path = location if os.path.isabs(location) else os.path.join(folder, location)
    with open(path, "wb") as f:
        f.write(w.tobytes())
    t = TP(name="w", data_type=TP.FLOAT, dims=list(w.shape), data_location=TP.EXTERNAL)
    for k, v in (("location", location), ("offset", "0"), ("length", str(w.nbytes))):
        t.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "ext",
                          [helper.make_tensor_value_info("x", TP.FLOAT, list(w.shape))],
                          [helper.make_tensor_value_info("y", TP.FLOAT, list(w.shape))], [t])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    out = os.path.join(folder, "m.onnx")
    with open(out, "wb") as f:
        f.write(model.SerializeToString())
    return out, w


# ----------------------------------------------------------------------------- storage forms
def mixed_model(folder):
    """A model whose initializers come in every storage form: W float_data, B raw_data,
    H float16 in int32_data, E external (at offset 8 of a file with other bytes around it),
    S a sparse initializer; y = ((x W + B + E) S) * H."""
    W = RNG.standard_normal((4, 3)).astype(np.float32)
    B = RNG.standard_normal(3).astype(np.float32)
    H = (RNG.standard_normal(3) + 2).astype(np.float16)
    E = RNG.standard_normal(3).astype(np.float32)
    with open(os.path.join(folder, "e.bin"), "wb") as f:
        f.write(b"\x07" * 8 + E.tobytes() + b"tail")
    e = TP(name="E", data_type=TP.FLOAT, dims=[3], data_location=TP.EXTERNAL)
    for k, v in (("location", "e.bin"), ("offset", "8"), ("length", "12")):
        e.external_data.add(key=k, value=v)
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([2.0, -1.0, 0.5], np.float32), "S"),
        numpy_helper.from_array(np.array([1, 5, 6], np.int64), "S_indices"), [3, 3])
    nodes = [helper.make_node("Gemm", ["x", "W", "B"], ["g"]),
             helper.make_node("Add", ["g", "E"], ["g2"]),
             helper.make_node("MatMul", ["g2", "S"], ["m"]),
             helper.make_node("Cast", ["H"], ["h"], to=TP.FLOAT),
             helper.make_node("Mul", ["m", "h"], ["y"])]
    g = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2, 3])],
                          [helper.make_tensor("W", TP.FLOAT, [4, 3], W.ravel(), raw=False),
                           numpy_helper.from_array(B, "B"),
                           helper.make_tensor("H", TP.FLOAT16, [3], H, raw=False), e],
                          sparse_initializer=[sparse])
    path = os.path.join(folder, "m.onnx")
    with open(path, "wb") as f:
        f.write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString())
    return path


def test_model_to_host_keeps_every_storage_form_byte_for_byte(tmp_path):
    path = mixed_model(str(tmp_path))
    model_bytes = open(path, "rb").read()
    ext_bytes = (tmp_path / "e.bin").read_bytes()
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    s, out = infer(path, {"x": x}, ["y"])
    np.testing.assert_allclose(out["y"], ort_run(path, {"x": x})[0], rtol=1e-5, atol=1e-6)
    s.modelToHost(str(tmp_path / "saved.onnx"))
    assert (tmp_path / "saved.onnx").read_bytes() == model_bytes
    assert (tmp_path / "e.bin").read_bytes() == ext_bytes      # written back, same bytes
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_trained_values_keep_their_storage_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # Builder(path) keeps relative locations as they are
    path = mixed_model(str(tmp_path))
    b = popart.Builder(path)
    loss = b.aiOnnx.reducemean([b.aiOnnx.abs(["y"])], keepdims=0)
    session = popart.TrainingSession(
        fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [loss]), loss=loss,
        optimizer=popart.SGD({"defaultLearningRate": (0.1, True), "defaultMomentum": (0.9, True)}),
        deviceInfo=CPU())
    session.prepareDevice()
    session.weightsFromHost()
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    run(session, {"x": x})
    session.modelToHost("trained.onnx")
    saved = inits("trained.onnx")
    assert data_fields(saved["W"]) == ["float_data"]
    assert data_fields(saved["B"]) == ["raw_data"]
    assert data_fields(saved["H"]) == ["int32_data"] and saved["H"].data_type == TP.FLOAT16
    assert saved["E"].data_location == TP.EXTERNAL
    assert ext(saved["E"]) == {"location": "e.bin", "offset": "8", "length": "12"}
    sparse = onnx.load("trained.onnx", load_external_data=False).graph.sparse_initializer
    assert [sp.values.name for sp in sparse] == ["S"] and list(sparse[0].indices.dims) == [
        sparse[0].values.dims[0]]                  # linear indices stay linear
    ids = ["W", "B", "H", "E", "S"]
    weights = {i: np.zeros(s, d) for i, s, d in (("W", (4, 3), np.float32), ("B", 3, np.float32),
                                                  ("H", 3, np.float16), ("E", 3, np.float32),
                                                  ("S", (3, 3), np.float32))}
    session.readWeights(popart.PyWeightsIO(weights))
    blob = (tmp_path / "e.bin").read_bytes()
    assert blob[:8] == b"\x07" * 8 and blob[20:24] == b"tail"   # other bytes kept
    assert np.frombuffer(blob[8:20], np.float32).tolist() == weights["E"].tolist()
    # the optimizer state of E follows it in e.bin (PopART's additional model-proto tensors)
    assert ext(saved["Accl___E"]) == {"location": "e.bin", "length": "12", "offset": "24"}
    assert len(blob) == 36
    assert {f"Accl___{i}" for i in ids} <= set(saved)
    # onnxruntime reads the trained model back as saved: a new session agrees
    expected = ort_run("trained.onnx", {"x": x}, outputs=["y"])[0]
    _, out = infer(str(tmp_path / "trained.onnx"), {"x": x}, ["y"])
    np.testing.assert_allclose(out["y"], expected, rtol=1e-5, atol=1e-6)
    for i in ("W", "B", "H"):
        np.testing.assert_array_equal(numpy_helper.to_array(saved[i]), weights[i])


# ----------------------------------------------------------------------------- saveInitializersExternally
def two_weight_builder():
    d1 = np.array([1], np.float32)
    d2 = np.array([7, 4], np.float16)
    b = popart.Builder()
    i1 = b.addInitializedInputTensor(d1)
    i2 = b.addInitializedInputTensor(d2)
    y = b.aiOnnx.add([i1, b.aiOnnx.cast([i2], "FLOAT")])
    b.addOutputTensor(y)
    return b, i1, i2, y, d1, d2


def test_save_initializers_externally_with_an_absolute_path(tmp_path):
    b, i1, i2, y, d1, d2 = two_weight_builder()
    data = tmp_path / "data" / "tensors.bin"
    data.parent.mkdir()
    b.saveInitializersExternally([i1, i2], str(data))
    # PopART writes the file at once: float32 then float16, 8 bytes
    assert data.read_bytes() == d1.tobytes() + d2.tobytes()
    models = tmp_path / "models"
    models.mkdir()
    b.saveModelProto(str(models / "m.onnx"))     # an absolute location used to fail here
    saved = inits(models / "m.onnx")
    assert ext(saved[i1]) == {"location": str(data), "length": "4", "offset": "0"}
    assert ext(saved[i2]) == {"location": str(data), "length": "4", "offset": "4"}
    assert not data_fields(saved[i1]) and not data_fields(saved[i2])
    expected = ort_run(models / "m.onnx", {})[0]
    np.testing.assert_array_equal(expected, d1 + d2.astype(np.float32))
    for model in (str(models / "m.onnx"), b.getModelProto()):   # the program's own file
        _, out = infer(model, {}, [y])
        np.testing.assert_array_equal(out[y], expected)
    # a Builder made from the saved file keeps the tensors external, as they were
    again = onnx.load_from_string(popart.Builder(str(models / "m.onnx")).getModelProto())
    assert {t.name: ext(t) for t in again.graph.initializer} == {n: ext(t) for n, t in saved.items()}


def test_save_initializers_externally_with_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    b, i1, i2, y, d1, d2 = two_weight_builder()
    b.saveInitializersExternally([i1, i2], "tensors.bin")      # relative to the working dir
    assert (tmp_path / "tensors.bin").read_bytes() == d1.tobytes() + d2.tobytes()
    b.saveModelProto("m.onnx")
    assert ext(inits("m.onnx")[i1])["location"] == "tensors.bin"
    original = {t.name: t.SerializeToString() for t in onnx.load("m.onnx", load_external_data=False).graph.initializer}
    rebuilt = onnx.load_from_string(popart.Builder("m.onnx").getModelProto())
    assert {t.name: t.SerializeToString() for t in rebuilt.graph.initializer} == original
    expected = ort_run("m.onnx", {})[0]
    for model in ("m.onnx", b.getModelProto()):
        _, out = infer(model, {}, [y])
        np.testing.assert_array_equal(out[y], expected)
    # relative to the working directory (PopART), the model saved elsewhere still loads
    (tmp_path / "sub").mkdir()
    b.saveModelProto("sub/m.onnx")
    _, out = infer(str(tmp_path / "sub" / "m.onnx"), {}, [y])
    np.testing.assert_array_equal(out[y], expected)


def test_save_initializers_externally_errors_are_popart_s(tmp_path):
    b, i1, i2, y, d1, d2 = two_weight_builder()
    c = b.aiOnnx.constant(np.array([1, 6], np.float32))
    first = tmp_path / "first.bin"
    b.saveInitializersExternally([i1], str(first))
    for again in (first, tmp_path / "second.bin"):   # saving a tensor externally twice
        with pytest.raises(popart.popart_exception,
                           match=f"Tensor '{i1}' already has an external data_location"):
            b.saveInitializersExternally([i2, i1], str(again))
    assert not (tmp_path / "second.bin").exists()
    assert first.read_bytes() == d1.tobytes()        # nothing changed by the failed calls
    with pytest.raises(popart.popart_exception, match=f"Tensor '{c}' is not an initializer"):
        b.saveInitializersExternally([c], str(tmp_path / "c.bin"))
    with pytest.raises(popart.popart_exception, match="but its parent directory does not exist"):
        b.saveInitializersExternally([i2], str(tmp_path / "dummy" / "tensors.bin"))
    empty = popart.Builder()
    e = empty.addInitializedInputTensor(np.zeros((0, 3), np.float32))
    with pytest.raises(popart.popart_exception, match=f"Tensor '{e}' has no data to save externally"):
        empty.saveInitializersExternally([e], str(tmp_path / "e.bin"))
    # the same errors from a GraphTransformer
    gt = popart.GraphTransformer(b.getModelProto())
    with pytest.raises(popart.popart_exception, match="already has an external data_location"):
        gt.saveInitializersExternally([i1], str(tmp_path / "gt.bin"))


def test_a_second_call_for_the_same_file_appends(tmp_path):
    b, i1, i2, y, d1, d2 = two_weight_builder()
    path = str(tmp_path / "tensors.bin")
    b.saveInitializersExternally([i1], path)
    b.saveInitializersExternally([i2], path)         # PopART would overwrite i1's data
    assert open(path, "rb").read() == d1.tobytes() + d2.tobytes()
    model = onnx.load_from_string(b.getModelProto())
    assert [ext(t)["offset"] for t in model.graph.initializer] == ["0", "4"]
    _, out = infer(b.getModelProto(), {}, [y])
    np.testing.assert_array_equal(out[y], d1 + d2.astype(np.float32))


# ----------------------------------------------------------------------------- models with external initializers
def test_builder_and_session_from_a_model_proto_with_external_initializers(tmp_path, monkeypatch):
    path, w = external_model(str(tmp_path))
    proto = onnx.load(path, load_external_data=False)
    x = np.ones(3, np.float32)
    expected = ort_run(path, {"x": x})[0]
    # a Builder keeps the initializer external, byte for byte
    built = onnx.load_from_string(popart.Builder(proto).getModelProto())
    assert built.graph.initializer[0].SerializeToString() == proto.graph.initializer[0].SerializeToString()
    # a model in memory reads its external data relative to the working directory (PopART)
    monkeypatch.chdir(tmp_path)
    for model in (proto, proto.SerializeToString(), popart.Builder(proto).getModelProto()):
        _, out = infer(model, {"x": x}, ["y"])
        np.testing.assert_array_equal(out["y"], expected)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(popart.popart_exception,
                       match="Unrecognised file name 'w.bin' for externally stored tensor 'w'"):
        popart.InferenceSession(proto, popart.DataFlow(1, ["y"]), CPU())
    # from a file, a Builder resolves against the file's folder: its proto works anywhere
    _, out = infer(popart.Builder(path).getModelProto(), {"x": x}, ["y"])
    np.testing.assert_array_equal(out["y"], expected)


def test_external_data_location_errors(tmp_path):
    path, _ = external_model(str(tmp_path), location="nope.bin")
    os.remove(tmp_path / "nope.bin")
    with pytest.raises(popart.popart_exception,
                       match="Unrecognised file name 'nope.bin' for externally stored tensor 'w'"):
        popart.InferenceSession(path, popart.DataFlow(1, ["y"]), CPU())
    model = onnx.load(path, load_external_data=False)
    del model.graph.initializer[0].external_data[:]
    with pytest.raises(popart.popart_exception,
                       match="No location information for externally stored tensor 'w'"):
        popart.InferenceSession(model, popart.DataFlow(1, ["y"]), CPU())


def test_a_foreign_model_stays_in_its_folder_unless_allowed(tmp_path, monkeypatch):
    outside = tmp_path / "secret"
    outside.mkdir()
    models = tmp_path / "models"
    models.mkdir()
    w = np.array([5.0, 6.0, 7.0], np.float32)
    (outside / "w.bin").write_bytes(w.tobytes())
    path, _ = external_model(str(models), location=str(outside / "w.bin"), w=w)
    # a file this program did not write, outside the model's folder: refused, the option named
    for location in (str(outside / "w.bin"), "../secret/w.bin"):
        model = onnx.load(path, load_external_data=False)
        model.graph.initializer[0].external_data[0].value = location
        onnx.save(model, path)
        with pytest.raises(popart.popart_exception) as e:
            popart.InferenceSession(path, popart.DataFlow(1, ["y"]), CPU())
        assert "leaves the model's folder" in str(e.value)
        assert "POPART_EXTERNAL_DATA_DIRS" in str(e.value)
    monkeypatch.setenv("POPART_EXTERNAL_DATA_DIRS", os.pathsep.join(["/nonexistent", str(outside)]))
    _, out = infer(path, {"x": np.zeros(3, np.float32)}, ["y"])
    np.testing.assert_array_equal(out["y"], w)


def test_the_program_s_own_external_files_load_from_anywhere(tmp_path):
    b, i1, i2, y, d1, d2 = two_weight_builder()
    data = tmp_path / "data"
    models = tmp_path / "models"
    data.mkdir()
    models.mkdir()
    b.saveInitializersExternally([i1, i2], str(data / "t.bin"))
    b.saveModelProto(str(models / "m.onnx"))
    _, out = infer(str(models / "m.onnx"), {}, [y])
    np.testing.assert_array_equal(out[y], d1 + d2.astype(np.float32))
    # a file put in its place by someone else is no longer the program's
    shutil.copy(data / "t.bin", data / "copy.bin")
    os.replace(data / "copy.bin", data / "t.bin")
    with pytest.raises(popart.popart_exception, match="POPART_EXTERNAL_DATA_DIRS"):
        popart.InferenceSession(str(models / "m.onnx"), popart.DataFlow(1, [y]), CPU())


# ----------------------------------------------------------------------------- training, optimizer state, checkpoints
def matmul_builder(shape=(4, 4), layers=2):
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", list(shape)), "x")
    ws, inits_ = [], []
    out = x
    for _ in range(layers):
        inits_.append(RNG.random(shape).astype(np.float32))
        ws.append(b.addInitializedInputTensor(inits_[-1]))
        out = b.aiOnnx.matmul([out, ws[-1]])
    loss = b.aiOnnx.reducesum([out], keepdims=0)
    b.addOutputTensor(out)
    return b, x, ws, inits_, out, loss


def test_trained_values_are_written_back_to_the_external_file(tmp_path):
    b, x, ws, w0, out, loss = matmul_builder()
    weights_file = tmp_path / "weights.bin"
    b.saveInitializersExternally(ws, str(weights_file))
    for k, w in enumerate(w0):
        np.testing.assert_array_equal(np.fromfile(weights_file, np.float32, 16, offset=64 * k), w.ravel())
    session = popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [out]),
                                     loss=loss, optimizer=popart.ConstSGD(0.01), deviceInfo=CPU())
    session.prepareDevice()
    session.weightsFromHost()
    feeds = {x: RNG.random((4, 4)).astype(np.float32)}
    run(session, feeds)
    session.modelToHost(str(tmp_path / "model.onnx"))
    now = {w: np.zeros((4, 4), np.float32) for w in ws}
    session.readWeights(popart.PyWeightsIO(now))
    assert not np.allclose(now[ws[0]], w0[0])
    trained = [np.fromfile(weights_file, np.float32, 16, offset=64 * k).reshape(4, 4) for k in range(2)]
    for k, w in enumerate(ws):
        np.testing.assert_array_equal(trained[k], now[w])
    # and a new session reads them back
    expected = ort_run(tmp_path / "model.onnx", feeds, outputs=[out])[0]
    np.testing.assert_allclose(expected, feeds[x] @ trained[0] @ trained[1], rtol=1e-6)
    _, got = infer(str(tmp_path / "model.onnx"), feeds, [out])
    np.testing.assert_allclose(got[out], expected, rtol=1e-6)


OPTIMIZERS = {
    "sgd_momentum": (lambda: popart.SGD({"defaultLearningRate": (0.2, True),
                                         "defaultMomentum": (0.5, True)}), ["Accl___"]),
    "adam": (lambda: popart.Adam({"defaultLearningRate": (0.2, True), "defaultBeta1": (0.1, True),
                                  "defaultBeta2": (0.1, True), "defaultWeightDecay": (0.5, True),
                                  "defaultEps": (1e-5, True), "lossScaling": (2, True)}),
             ["Accl1___", "Accl2___", "Step___"]),
    "adaptive": (lambda: popart.Adaptive({"defaultLearningRate": (0.2, True)},
                                         mode=popart.AdaptiveMode.CenteredRMSProp),
                 ["Accl1___", "Accl2___"]),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_is_saved_with_external_weights(tmp_path, name):
    make, prefixes = OPTIMIZERS[name]
    d1 = RNG.random((3, 3)).astype(np.float32)
    d2 = RNG.random(3).astype(np.float32)
    b = popart.Builder()
    i1 = b.addInitializedInputTensor(d1)
    i2 = b.addInitializedInputTensor(d2)
    o = b.aiOnnx.matmul([i1, i2])
    loss = b.aiGraphcore.identityloss([o])
    tensors = tmp_path / "tensors.bin"
    b.saveInitializersExternally([i1, i2], str(tensors))
    assert tensors.stat().st_size == 48
    anchors_ids = [o, popart.reservedGradientPrefix() + i1, popart.reservedGradientPrefix() + i2]

    def session(model):
        s = popart.TrainingSession(fnModel=model, dataFlow=popart.DataFlow(1, anchors_ids),
                                   loss=loss, optimizer=make(), deviceInfo=CPU())
        s.prepareDevice()
        s.weightsFromHost()
        return s

    s = session(b.getModelProto())
    run(s, {})
    state = {p + w: np.zeros(1 if p == "Step___" else size, np.float32)
             for p in prefixes for w, size in ((i1, 9), (i2, 3))}
    values = {i1: np.zeros(9, np.float32), i2: np.zeros(3, np.float32), **state}
    s.weightsToHost()
    s.readWeights(popart.PyWeightsIO(values))
    saved = tmp_path / "model.onnx"
    s.modelToHost(str(saved))
    # PopART's layout: the weights, then per prefix the state of each weight, appended
    expected = np.concatenate([values[i1], values[i2]] + [values[p + w] for p in prefixes for w in (i1, i2)])
    np.testing.assert_allclose(np.fromfile(tensors, np.float32), expected, rtol=0, atol=0)
    first = tensors.read_bytes(), saved.read_bytes()
    s.modelToHost(str(saved))                       # again: the same file, not appended twice
    assert (tensors.read_bytes(), saved.read_bytes()) == first
    # a new session from the saved model, its state reset from it, continues identically
    fresh = session(str(saved))
    fresh.resetHostWeights(str(saved))
    fresh.weightsFromHost()
    a, b_ = run(s, {}), run(fresh, {})
    for k in anchors_ids:
        np.testing.assert_allclose(b_[k], a[k], rtol=1e-6)


def test_checkpoint_with_external_weights_through_save_and_load_executable(tmp_path):
    b, x, ws, w0, out, loss = matmul_builder(layers=1)
    weights_file = tmp_path / "weights.bin"
    b.saveInitializersExternally(ws, str(weights_file))
    proto = b.getModelProto()
    optimizer = popart.SGD({"defaultLearningRate": (0.05, True), "defaultMomentum": (0.9, True)})

    def session():
        return popart.TrainingSession(fnModel=proto, dataFlow=popart.DataFlow(1, [out]), loss=loss,
                                      optimizer=optimizer, deviceInfo=CPU())

    feeds = {x: RNG.random((4, 4)).astype(np.float32)}
    a = session()
    a.prepareDevice()
    a.weightsFromHost()
    run(a, feeds)
    run(a, feeds)
    ckpt = tmp_path / "ckpt.popef"
    a.saveExecutable(str(ckpt))
    restored = session()
    restored.loadExecutable(str(ckpt))       # weights and momentum as they were
    restored.weightsFromHost()
    got, want = run(restored, feeds), run(a, feeds)
    np.testing.assert_allclose(got[out], want[out], rtol=1e-6)
    restored.modelToHost(str(tmp_path / "restored.onnx"))
    read = {ws[0]: np.zeros((4, 4), np.float32)}
    a.weightsToHost()
    a.readWeights(popart.PyWeightsIO(read))
    np.testing.assert_allclose(np.fromfile(weights_file, np.float32, 16).reshape(4, 4), read[ws[0]],
                               rtol=1e-6)


def test_update_externally_saved_tensor_locations_as_popart(tmp_path):
    b, x, ws, w0, out, loss = matmul_builder(layers=1)
    path0 = str(tmp_path / "model_tensors0.bin")
    b.saveInitializersExternally(ws, path0)
    s = popart.TrainingSession(fnModel=b.getModelProto(), dataFlow=popart.DataFlow(1, [out]),
                               loss=loss, optimizer=popart.ConstSGD(0.05), deviceInfo=CPU())
    s.prepareDevice()
    s.weightsFromHost()
    feeds = {x: RNG.random((4, 4)).astype(np.float32)}
    fake, path1, path2 = (str(tmp_path / n) for n in ("foo.bar", "model_tensors1.bin", "model_tensors2.bin"))
    with pytest.raises(popart.popart_exception, match=f"but file '{fake}' does not exist"):
        s.updateExternallySavedTensorLocations(fake, path1)
    with pytest.raises(popart.popart_exception, match=f"but file '{path0}' already exists"):
        s.updateExternallySavedTensorLocations(path0, path0)
    run(s, feeds)
    s.modelToHost(str(tmp_path / "model0.onnx"))
    weights1 = np.fromfile(path0, np.float32)
    s.updateExternallySavedTensorLocations(path0, path1)
    assert os.path.exists(path1)
    with pytest.raises(popart.popart_exception,
                       match="No ONNX model initializers have external location set to"):
        s.updateExternallySavedTensorLocations(path0, path2)
    s.modelToHost(str(tmp_path / "model1.onnx"))
    np.testing.assert_array_equal(np.fromfile(path1, np.float32), weights1)
    assert ext(inits(tmp_path / "model1.onnx")[ws[0]])["location"] == path1
    run(s, feeds)
    s.updateExternallySavedTensorLocations(path1, path2)
    s.modelToHost(str(tmp_path / "model2.onnx"))
    assert not np.array_equal(np.fromfile(path2, np.float32), weights1)
    np.testing.assert_array_equal(np.fromfile(path0, np.float32), weights1)   # left alone
    _, got = infer(str(tmp_path / "model2.onnx"), feeds, [out])
    np.testing.assert_allclose(got[out], ort_run(tmp_path / "model2.onnx", feeds, outputs=[out])[0],
                               rtol=1e-6)


# ----------------------------------------------------------------------------- sparse
def test_sparse_initializers_and_constants_import_as_dense(tmp_path):
    dense = np.zeros((3, 4), np.float32)
    dense[0, 1], dense[2, 3], dense[1, 0] = 2.0, -1.5, 0.25
    nz = np.flatnonzero(dense)
    linear = helper.make_sparse_tensor(numpy_helper.from_array(dense.ravel()[nz], "S"),
                                       numpy_helper.from_array(nz.astype(np.int64), "S_i"), [3, 4])
    coords = np.stack(np.unravel_index(nz, dense.shape), axis=1).astype(np.int64)
    constant = helper.make_sparse_tensor(numpy_helper.from_array(dense.ravel()[nz] * 3, "c"),
                                         numpy_helper.from_array(coords, "c_i"), [3, 4])
    nodes = [helper.make_node("Constant", [], ["C"], sparse_value=constant),
             helper.make_node("Add", ["x", "S"], ["a"]),
             helper.make_node("Mul", ["a", "C"], ["y"])]
    g = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TP.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [3, 4])],
                          sparse_initializer=[linear])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    expected = ort_run(model, {"x": x})[0]
    np.testing.assert_allclose(expected, (x + dense) * dense * 3, rtol=1e-6)
    _, out = infer(model.SerializeToString(), {"x": x}, ["y"])
    np.testing.assert_allclose(out["y"], expected, rtol=1e-6)
    # a Builder extends such a model, and the session's model keeps it sparse
    b = popart.Builder(model.SerializeToString())
    z = b.aiOnnx.relu(["y"])
    s, out = infer(b.getModelProto(), {"x": x}, [z])
    np.testing.assert_allclose(out[z], np.maximum(expected, 0), rtol=1e-6)
    s.modelToHost(str(tmp_path / "m.onnx"))
    saved = onnx.load(str(tmp_path / "m.onnx"))
    assert saved.graph.sparse_initializer[0].SerializeToString() == linear.SerializeToString()
    # a broken sparse tensor is a clear error
    for bad, why in ((np.array([1, 1, 2], np.int64), "twice"), (np.array([1, 2, 12], np.int64), "outside")):
        broken = onnx.ModelProto.FromString(model.SerializeToString())
        broken.graph.sparse_initializer[0].indices.CopyFrom(numpy_helper.from_array(bad, "S_i"))
        with pytest.raises(popart.popart_exception, match=why):
            popart.InferenceSession(broken, popart.DataFlow(1, ["y"]), CPU())


# ----------------------------------------------------------------------------- older opsets
def _bn_inputs(b):
    return [b.addInitializedInputTensor(np.array(v, np.float32))
            for v in ([1, 2, 3], [0.1, 0.2, 0.3], [0.5, 0, -0.5], [1, 2, 0.5])]


_W16 = RNG.standard_normal((16, 5)).astype(np.float32)

# name: (opset, build, reference opset or None (same), reference build or None (same))
OLD_FORMS = {
    "clip6_attributes": (6, lambda b, o, x: o.clip([x], max=0.5, min=-0.25)),
    "clip6_defaults": (6, lambda b, o, x: o.clip([x])),
    "clip11_inputs": (11, lambda b, o, x: o.clip([x, o.constant(np.array(-0.1, np.float32)),
                                                  o.constant(np.array(0.2, np.float32))])),
    "pad6_attributes": (6, lambda b, o, x: o.pad([x], [0, 0, 1, 2, 0, 0, 2, 1], "constant", 1.5)),
    "pad6_reflect": (6, lambda b, o, x: o.pad([x], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="reflect")),
    "pad11_inputs": (11, lambda b, o, x: o.pad([x, o.constant(np.array([0, 0, 1, 0, 0, 0, 0, 2], np.int64)),
                                                o.constant(np.array(2.0, np.float32))])),
    "slice6_attributes": (6, lambda b, o, x: o.slice([x], ends=[3, 3], starts=[1, 0], axes=[2, 3])),
    "slice6_no_axes": (6, lambda b, o, x: o.slice([x], [1, 2], [0, 1])),
    "slice10_inputs": (10, lambda b, o, x: o.slice([x, o.constant(np.array([1], np.int64)),
                                                    o.constant(np.array([3], np.int64)),
                                                    o.constant(np.array([2], np.int64))])),
    "upsample7_scales": (7, lambda b, o, x: o.upsample([x], [1.0, 1.0, 2.0, 3.0])),
    "upsample9_input": (9, lambda b, o, x: o.upsample([x, o.constant(np.array([1, 1, 2, 2], np.float32))])),
    "resize10_linear": (10, lambda b, o, x: o.resize([x, o.constant(np.array([1, 1, 2, 0.5], np.float32))],
                                                     mode="linear"),   # PopART's: half_pixel
                        11, lambda b, o, x: o.resize([x, o.constant(np.zeros(0, np.float32)),
                                                      o.constant(np.array([1, 1, 2, 0.5], np.float32))],
                                                     mode="linear")),
    "resize11_asymmetric": (11, lambda b, o, x: o.resize(
        [x, o.constant(np.zeros(0, np.float32)), o.constant(np.array([1, 1, 2, 2], np.float32))],
        coordinate_transformation_mode="asymmetric", mode="nearest", nearest_mode="floor")),
    "dropout7_ratio": (7, lambda b, o, x: o.dropout([x], 1, 0.3)[0]),
    "topk6_k_attribute": (6, lambda b, o, x: o.topk([x], 2, axis=1)),
    "topk10_k_input": (10, lambda b, o, x: o.topk([x, o.constant(np.array([2], np.int64))], axis=2)),
    "split6_attribute": (6, lambda b, o, x: o.split([x], 2, axis=1, split=[1, 2])),
    "split6_equal": (6, lambda b, o, x: o.split([x], 2, 2)),
    "reducesum11_axes": (11, lambda b, o, x: o.reducesum([x], axes=[1, 3], keepdims=0)),
    "reducesum11_defaults": (11, lambda b, o, x: o.reducesum([x])),
    "squeeze11_axes": (11, lambda b, o, x: o.squeeze([o.unsqueeze([x], axes=[0])], axes=[0])),
    "softmax6_default_axis": (6, lambda b, o, x: o.softmax([x])),
    "softmax11_axis": (11, lambda b, o, x: o.softmax([x], axis=2)),
    "averagepool7_pads": (7, lambda b, o, x: o.averagepool([x], kernel_shape=[3, 3], count_include_pad=1,
                                                           pads=[1, 1, 1, 1])),
    "maxpool8": (8, lambda b, o, x: o.maxpool([x], 1, kernel_shape=[2, 2], strides=[2, 2])[0]),
    "lrn6": (6, lambda b, o, x: o.lrn([x], size=3)),
    "argmax6": (6, lambda b, o, x: o.argmax([x], axis=1, keepdims=0)),
    "hardsigmoid6": (6, lambda b, o, x: o.hardsigmoid([x], alpha=0.3)),
    "tile6": (6, lambda b, o, x: o.tile([x, o.constant(np.array([1, 2, 1, 1], np.int64))])),
    # onnxruntime has no kernel for these at opset 6: compared with the same op at 7 / 9
    "dropout6_is_test": (6, lambda b, o, x: o.dropout([x], 1, is_test=1, ratio=0.3)[0],
                         7, lambda b, o, x: o.dropout([x], 1, 0.3)[0]),
    "batchnormalization6_is_test": (
        6, lambda b, o, x: o.batchnormalization([x] + _bn_inputs(b), 1, epsilon=1e-3, is_test=1)[0],
        9, lambda b, o, x: o.batchnormalization([x] + _bn_inputs(b), 1, epsilon=1e-3)[0]),
    "gemm6_broadcast": (6, lambda b, o, x: o.gemm([o.flatten([x], axis=2), b.addInitializedInputTensor(_W16),
                                                   b.addInitializedInputTensor(np.ones(5, np.float32))],
                                                  alpha=0.5, beta=2.0, broadcast=1),
                        7, lambda b, o, x: o.gemm([o.flatten([x], axis=2), b.addInitializedInputTensor(_W16),
                                                   b.addInitializedInputTensor(np.ones(5, np.float32))],
                                                  alpha=0.5, beta=2.0)),
}


def _build(version, build):
    b = popart.Builder(opsets={"ai.onnx": version, "ai.graphcore": 1})
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3, 4, 4]), "x")
    outs = build(b, getattr(b, f"aiOnnxOpset{version}"), x)
    outs = outs if isinstance(outs, list) else [outs]
    for o in outs:
        b.addOutputTensor(o)
    return b.getModelProto(), outs


@pytest.mark.parametrize("name", sorted(OLD_FORMS))
def test_older_opset_attribute_forms_run_as_onnxruntime_runs_them(name):
    version, build, *ref = OLD_FORMS[name]
    proto, outs = _build(version, build)
    assert {(o.domain, o.version) for o in onnx.load_from_string(proto).opset_import} >= {("", version)}
    ref_proto, ref_outs = _build(*ref) if ref else (proto, outs)
    x = RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)
    _, got = infer(proto, {"x": x}, outs)
    for o, r in zip(outs, ort_run(ref_proto, {"x": x}, outputs=ref_outs)):
        np.testing.assert_allclose(got[o], r, rtol=1e-5, atol=1e-6)
