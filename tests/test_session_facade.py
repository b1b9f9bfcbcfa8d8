"""Sessions are facades (issue 26 item 4): the classes of popart/session.py stay small, and
the collaborators that do the work (ONNX write-back, executable files, RNG state) work on
their own, without a session or a compile."""
import ast
import os
import types

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import popart
import popxl
from popart._ir.onnx_import import import_model
from popart.engine.executable import SessionFiles
from popart.session_config import engine_config
from popart.session_rng import Rng, key_data
from popart.writeback import WriteBack, store_like, store_sparse_like


def _class_sizes(package) -> dict:
    """Lines of each top-level class of the package's session.py (decorators not counted)."""
    path = os.path.join(os.path.dirname(package.__file__), "session.py")
    tree = ast.parse(open(path).read())
    return {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.ClassDef)}


def test_no_session_class_is_over_500_lines():
    sizes = _class_sizes(popart)
    assert {"_Session", "InferenceSession", "TrainingSession"} <= set(sizes)
    assert max(sizes.values()) <= 500, sizes


def test_popxl_session_is_a_facade_under_500_lines():
    """popxl.Session (issue 35 item 7), counted as popart's: its state, step and streams
    are collaborators (popxl/_state.py, _step.py, _streams.py) that take explicit arguments."""
    sizes = _class_sizes(popxl)
    assert sizes["Session"] <= 500, sizes
    assert popxl.Session.__module__ == "popxl.session"
    for name in ("_state.py", "_step.py", "_streams.py", "_placement.py"):   # no session in
        tree = ast.parse(open(os.path.join(os.path.dirname(popxl.__file__), name)).read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                  for a in n.args.args + n.args.kwonlyargs}
        assert "session" not in imported and "session" not in params, name


def test_store_like_keeps_the_storage_form_and_unchanged_bytes():
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    typed = helper.make_tensor("w", onnx.TensorProto.FLOAT, [2, 3], value.reshape(-1), raw=False)
    raw = numpy_helper.from_array(value, "w")
    before = raw.SerializeToString()
    store_like(raw, value.astype(np.float64))          # the same values: the bytes stay
    assert raw.SerializeToString() == before
    for t in (typed, raw):
        store_like(t, value * 2)
        np.testing.assert_array_equal(numpy_helper.to_array(t), value * 2)
    assert len(typed.float_data) == 6 and not typed.HasField("raw_data")
    assert raw.HasField("raw_data") and len(raw.float_data) == 0


def test_store_sparse_like_keeps_coordinate_indices():
    dense = np.zeros((3, 4), np.float32)
    dense[0, 1], dense[2, 3] = 5.0, -1.0
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.array([5.0, -1.0], np.float32), "s"),
                                   numpy_helper.from_array(np.array([[0, 1], [2, 3]], np.int64), "s_i"),
                                   [3, 4])
    new = dense.copy()
    new[1, 0] = 7.0
    store_sparse_like(sp, new)
    assert list(sp.indices.dims) == [3, 2]               # coordinates, one row per non-zero
    got = np.zeros((3, 4), np.float32)
    got[tuple(numpy_helper.to_array(sp.indices).T)] = numpy_helper.to_array(sp.values)
    np.testing.assert_array_equal(got, new)


def _model() -> onnx.ModelProto:
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 2]), "x")
    w = b.addInitializedInputTensor(np.ones((2, 2), np.float32), "w")
    b.addOutputTensor(b.aiOnnx.matmul([x, w]))
    return onnx.load_from_string(b.getModelProto())


def test_write_back_without_a_session(tmp_path):
    proto = _model()
    graph, proto = import_model(proto, None)
    wb = WriteBack(proto, graph, None)
    assert wb.saved_model(None) is proto                 # not prepared: the model as it came
    state = {"Accl___w": np.full((2, 2), 3.0, np.float32)}
    model = wb.model({"w": np.full((2, 2), 2.0, np.float32), **state}, state)
    fn = tmp_path / "m.onnx"
    wb.write(str(fn), model, {})
    saved = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(fn)).graph.initializer}
    np.testing.assert_array_equal(saved["w"], np.full((2, 2), 2.0, np.float32))
    np.testing.assert_array_equal(saved["Accl___w"], state["Accl___w"])   # optimizer state added
    with pytest.raises(popart.popart_exception, match="modelToHost: cannot write"):
        wb.write(str(tmp_path / "missing" / "m.onnx"), model, {})
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(popart.popart_runtime_error, match="No ONNX model initializers have "
                                                          "external location set to '.*w.bin'"):
        wb.moving(str(tmp_path / "w.bin"), str(tmp_path / "v.bin"), None)


def test_executable_signature_has_the_options_that_shape_the_program():
    proto = _model()
    graph, proto = import_model(proto, None)
    files = SessionFiles("InferenceSession", proto, {"x": popart.TensorInfo("FLOAT", [2, 2])},
                         None, graph.initializers)

    def cfg(**opts):
        o = popart.SessionOptions()
        for k, v in opts.items():
            setattr(o, k, v)
        return types.SimpleNamespace(batches_per_step=1, accumulation_factor=1,
                                     replication_factor=1, anchors={}, loss=None,
                                     optimizer=None, config=engine_config(o))
    base = files.signature(cfg())
    assert files.signature(cfg(cachePath="/somewhere", enableEngineCaching=True)) == base
    assert files.signature(cfg(enableStochasticRounding=True))["options"] != base["options"]
    assert files.cache(cfg(), lambda: pytest.fail("not asked when caching is off")) is None


def test_rng_state_round_trip_and_popart_s_texts():
    rng = Rng()
    with pytest.raises(popart.popart_runtime_error, match="There is no executatable"):
        rng.set_seed(3, True, None, lambda: True)    # an engine-cache hit: no executable yet
    with pytest.raises(popart.popart_runtime_error, match=r"Devicex::prepare\(\) must be called"):
        rng.set_seed(3, True, None, lambda: False)
    options = types.SimpleNamespace(syntheticDataMode=popart.SyntheticDataMode.Off)
    assert rng.state(options) == [int(v) for v in key_data(0).ravel()]
    rng.set_state([1, 2], None)
    assert rng.state(options) == [1, 2]
    with pytest.raises(popart.popart_exception, match="setRNGState: expected 2 values"):
        rng.set_state([1, 2, 3], None)
    options.syntheticDataMode = popart.SyntheticDataMode.Zeros
    assert rng.state(options) == []
