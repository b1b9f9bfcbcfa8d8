"""The planned run path (popart/run_plan.py, popxl.Session's _RunPlan): a run that takes the
common path gives what the general path gives, and every error of the general path is still
raised once a session has run (and planned). References: NumPy."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import popart
import popxl
import popxl.ops as ops

N = 4


def _gather_model() -> bytes:
    """y = Relu(Gather(table, idx)) with table [5, 4] a constant: float and int64 inputs,
    and a run-time check (indices in range)."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, N],
                               np.linspace(-1, 1, 5 * N, dtype=np.float32))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, N])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT32, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, N])
    nodes = [helper.make_node("Gather", ["table", "idx"], ["g"], axis=0),
             helper.make_node("Add", ["g", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x, idx], [y], initializer=[table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


TABLE = np.linspace(-1, 1, 5 * N, dtype=np.float32).reshape(5, N)
BPS = 2


def _expected(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.maximum(TABLE[idx] + x, 0)


@pytest.fixture(scope="module")
def inference():
    sess = popart.InferenceSession(_gather_model(), popart.DataFlow(BPS, {"y": popart.AnchorReturnType("All")}),
                                   popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    return sess


def _inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BPS, 2, N)).astype(np.float32),
            rng.integers(0, 5, (BPS, 2)).astype(np.int32))


def test_common_and_general_paths_agree(inference):
    x, idx = _inputs(0)
    fast = inference.initAnchorArrays()
    inference.run(popart.PyStepIO({"x": x, "idx": idx}, fast))   # the common path
    assert inference._run_plan is not None
    assert inference._run_plan.feeds(popart.PyStepIO({"x": x, "idx": idx}, fast)) is not None
    np.testing.assert_allclose(fast["y"], _expected(x, idx), rtol=1e-6)
    # the general path: INT64 indices (narrowed), a flat input, a dict subclass of outputs
    general = type("Outs", (dict,), {})(inference.initAnchorArrays())
    stepio = popart.PyStepIO({"x": x.reshape(-1), "idx": idx.astype(np.int64)}, general)
    assert inference._run_plan.feeds(stepio) is None and inference._run_plan.outputs(stepio, {}) is None
    inference.run(stepio)
    np.testing.assert_array_equal(general["y"], fast["y"])
    # a new input array each run: the plan reads the StepIO's arrays, never a copy of them
    x2, idx2 = _inputs(1)
    inference.run(popart.PyStepIO({"x": x2, "idx": idx2}, fast))
    np.testing.assert_allclose(fast["y"], _expected(x2, idx2), rtol=1e-6)


@pytest.mark.parametrize("case, error, text", [
    ("dtype", popart.popart_exception, "Type discrepancy for tensor x"),
    ("missing", popart.popart_exception, "Input tensor 'idx' is missing from the StepIO"),
    ("count", popart.popart_exception, "Unexpected number of input elements for Tensor x"),
    ("noncontiguous", popart.popart_exception, "not c-contiguous"),
    ("anchor_dtype", popart.popart_exception, "Output array for anchor 'y' has dtype float64"),
    ("anchor_missing", popart.popart_exception, "Anchor 'y' has no output array"),
    ("index", popart.popart_runtime_error, "out of range"),
])
def test_errors_after_planning(inference, case, error, text):
    x, idx = _inputs(2)
    outs = inference.initAnchorArrays()
    inference.run(popart.PyStepIO({"x": x, "idx": idx}, outs))   # planned
    inputs = {"x": x, "idx": idx}
    if case == "dtype":
        inputs["x"] = x.astype(np.float64)
    elif case == "missing":
        del inputs["idx"]
    elif case == "count":
        inputs["x"] = x[:1]
    elif case == "noncontiguous":
        inputs["x"] = np.asfortranarray(x)
    elif case == "anchor_dtype":
        outs = {"y": outs["y"].astype(np.float64)}
    elif case == "anchor_missing":
        outs = {}
    elif case == "index":
        inputs["idx"] = np.full_like(idx, 7)
    stepio = popart.PyStepIO.__new__(popart.PyStepIO)   # (the constructor checks contiguity)
    stepio.inputs, stepio.outputs, stepio.runtime_asserts, stepio.offsets = inputs, outs, None, {}
    with pytest.raises(error, match=text):
        inference.run(stepio)


def test_optimizer_update_reaches_the_planned_run():
    """Non-const SGD learning rate: the plan holds it on the device until
    updateOptimizerFromHost, after which the next run uses the new value (W - lr * x^T sign(xW))."""
    w0 = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    x = np.array([[1.0, -2.0]], np.float32)
    b = popart.Builder()
    xi = b.addInputTensor(popart.TensorInfo("FLOAT", [1, 2]), "x")
    w = b.addInitializedInputTensor(w0, "W")
    loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([xi, w])], 1.0, reduction=popart.ReductionType.Sum)
    sess = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, {loss: popart.AnchorReturnType("All")}),
                                  loss, popart.SGD({"defaultLearningRate": (0.1, False)}),
                                  popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    sess.weightsFromHost()
    outs = sess.initAnchorArrays()
    ref = w0.copy()
    for lr in (0.1, 0.1, 0.5, 0.0):
        if lr != 0.1 or sess._run_plan is None:
            sess.updateOptimizerFromHost(popart.SGD({"defaultLearningRate": (lr, False)}))
        sess.run(popart.PyStepIO({xi: x}, outs))
        np.testing.assert_allclose(outs[loss], np.abs(x @ ref).sum(), rtol=1e-6)
        ref = ref - lr * x.T @ np.sign(x @ ref)
    weights = {"W": np.zeros_like(w0)}
    sess.weightsToHost()
    sess.readWeights(popart.PyWeightsIO(weights))
    np.testing.assert_allclose(weights["W"], ref, rtol=1e-6)


@pytest.fixture(scope="module")
def popxl_session():
    ir = popxl.Ir()
    with ir.main_graph:
        x_h2d = popxl.h2d_stream([N], popxl.float32, name="x")
        y = ops.relu(ops.host_load(x_h2d, "x"))
        y_d2h = popxl.d2h_stream(y.shape, y.dtype, name="y")
        ops.host_store(y_d2h, y)
    sess = popxl.Session(ir, "ipu_model")
    with sess:
        yield sess, x_h2d, y_d2h


def test_popxl_common_and_general_paths_agree(popxl_session):
    sess, x_h2d, y_d2h = popxl_session
    x = np.linspace(-1, 1, N, dtype=np.float32)
    fast = sess.run({x_h2d: x})[y_d2h]   # the common path
    assert sess._plan is not None and sess._plan.feeds({x_h2d: x}, True) is not None
    np.testing.assert_array_equal(fast, np.maximum(x, 0))
    general = sess.run({x_h2d: x.astype(np.float64).tolist()})[y_d2h]   # a list, downcast
    np.testing.assert_array_equal(general, fast)
    out = {y_d2h: np.full(N, 7.0)}   # float64 output array: the values converted
    sess.run_with_outputs({x_h2d: -x}, out)
    np.testing.assert_array_equal(out[y_d2h], np.maximum(-x, 0))


def test_popxl_errors_after_planning(popxl_session):
    sess, x_h2d, y_d2h = popxl_session
    x = np.ones(N, np.float32)
    sess.run({x_h2d: x})
    with pytest.raises(ValueError, match="Shape mismatch for input stream"):
        sess.run({x_h2d: np.ones(N + 1, np.float32)})
    with pytest.raises(ValueError, match="Unexpected/Missing input"):
        sess.run({})
    with pytest.raises(popart.popart_exception, match="Type discrepancy"):
        sess.run({x_h2d: x.astype(np.int32)})
    with pytest.raises(ValueError, match="Unexpected/Missing output"):
        sess.run_with_outputs({x_h2d: x}, {})


def test_64_bit_inputs_keep_the_64_bit_scope():
    """INT64 data beyond int32's range reaches a planned run whole (the plan keeps JAX's
    64-bit scope for it); the scope does not outlive the call."""
    import jax
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()
    sess = popart.InferenceSession(model, popart.DataFlow(1, {"y": popart.AnchorReturnType("All")}),
                                   popart.DeviceManager().createCpuDevice())
    sess.prepareDevice()
    outs = sess.initAnchorArrays()
    for v in (2 ** 40, -(2 ** 41) - 3):
        data = np.array([v, 1], np.int64)
        sess.run(popart.PyStepIO({"x": data}, outs))
        np.testing.assert_array_equal(outs["y"], 2 * data)
    assert sess._run_plan.x64 and not jax.config.jax_enable_x64
