"""DataFlow, AnchorReturnType, StepIO classes and the host buffer shapes (glossary 11.8)."""
import numpy as np
import pytest

from popart.dataflow import (AnchorReturnType, AnchorReturnTypeId, DataFlow, InputSettings,
                             InputShapeInfo, PyStepIO, PyStepIOCallback, PyWeightsIO,
                             anchor_host_shape, input_host_shape, validate_input)
from popart.errors import StepIOError, popart_exception
from popart.options import ExchangeStrategy, ReplicatedStreamMode, TileSet
from popart.tensorinfo import TensorInfo


# --- AnchorReturnType ---------------------------------------------------------------------------
@pytest.mark.parametrize("text,kind", [
    ("ALL", AnchorReturnTypeId.All), ("All", AnchorReturnTypeId.All),
    ("all", AnchorReturnTypeId.All), ("FINAL", AnchorReturnTypeId.Final),
    ("Final", AnchorReturnTypeId.Final), ("SUM", AnchorReturnTypeId.Sum),
    ("Sum", AnchorReturnTypeId.Sum),
])
def test_anchor_return_type_strings(text, kind):
    art = AnchorReturnType(text)
    assert art.id() is kind
    assert art.rp() == 0
    assert art.tileSet() == TileSet.Compute
    assert art.exchangeStrategy() == ExchangeStrategy.JustInTime
    assert art.str() == text and str(art) == text


def test_anchor_return_type_every_n():
    art = AnchorReturnType("EVERYN", 2)
    assert art.id() is AnchorReturnTypeId.EveryN and art.rp() == 2
    assert AnchorReturnType("EveryN", 3).rp() == 3
    assert repr(art) == 'AnchorReturnType("EVERYN", 2)'
    assert art == AnchorReturnType("EVERYN", 2) and art != AnchorReturnType("EVERYN", 4)


def test_anchor_return_type_tile_set_and_exchange():
    art = AnchorReturnType("All", TileSet.IO, ExchangeStrategy.OverlapInnerLoop)
    assert art.tileSet() == TileSet.IO
    assert art.exchangeStrategy() == ExchangeStrategy.OverlapInnerLoop
    art = AnchorReturnType("EVERYN", 2, TileSet.IO, ExchangeStrategy.OverlapLoops)
    assert (art.rp(), art.tileSet(), art.exchangeStrategy()) == \
        (2, TileSet.IO, ExchangeStrategy.OverlapLoops)


@pytest.mark.parametrize("args", [("ALLL",), ("",), ("EVERYN",), ("EVERYN", 0), ("EVERYN", -1),
                                  (3,)])
def test_anchor_return_type_errors(args):
    with pytest.raises(popart_exception):
        AnchorReturnType(*args)


def test_anchor_return_type_id_members():
    assert list(AnchorReturnTypeId.__members__) == ["Final", "EveryN", "All", "Sum"]


# --- DataFlow -----------------------------------------------------------------------------------
def test_dataflow_from_dict():
    df = DataFlow(4, {"a": AnchorReturnType("ALL"), "b": AnchorReturnType("EVERYN", 2)})
    assert df.batchesPerStep() == 4
    assert df.anchors() == ["a", "b"] and df.nAnchors() == 2
    assert df.isAnchored("a") and not df.isAnchored("c")
    assert df.art("b").rp() == 2
    with pytest.raises(popart_exception, match="Tensor c is not an anchor"):
        df.art("c")
    df.setBatchesPerStep(8)
    assert df.batchesPerStep() == 8


def test_dataflow_from_list():
    df = DataFlow(2, ["x", "y"])
    assert [df.art(i).id() for i in df.anchors()] == [AnchorReturnTypeId.All] * 2
    df = DataFlow(2, ["x"], AnchorReturnType("FINAL"))
    assert df.art("x").id() is AnchorReturnTypeId.Final
    df = DataFlow(batchesPerStep=3, anchorIds=["z"], anchorReturnType=AnchorReturnType("SUM"))
    assert df.art("z").id() is AnchorReturnTypeId.Sum and df.batchesPerStep() == 3
    assert DataFlow(1, {}).nAnchors() == 0


@pytest.mark.parametrize("bps", [0, -1, 1.5, "2", True])
def test_dataflow_bad_batches_per_step(bps):
    with pytest.raises(popart_exception, match="batchesPerStep"):
        DataFlow(bps, {"a": AnchorReturnType("ALL")})
    df = DataFlow(1, ["a"])
    with pytest.raises(popart_exception, match="batchesPerStep"):
        df.setBatchesPerStep(bps)
    assert df.batchesPerStep() == 1


def test_dataflow_every_n_must_divide_batches_per_step():
    with pytest.raises(popart_exception, match="factor"):
        DataFlow(5, {"a": AnchorReturnType("EVERYN", 2)})
    df = DataFlow(4, {"a": AnchorReturnType("EVERYN", 2)})
    with pytest.raises(popart_exception, match="factor"):
        df.setBatchesPerStep(3)


def test_dataflow_rejects_duplicates_and_bad_values():
    with pytest.raises(popart_exception, match="unique"):
        DataFlow(1, ["a", "a"])
    with pytest.raises(popart_exception, match="'a'"):
        DataFlow(1, {"a": "ALL"})


# --- settings and StepIO holders ------------------------------------------------------------------
def test_input_settings():
    s = InputSettings()
    assert (s.tileSet(), s.exchangeStrategy(), s.replicatedStreamMode()) == \
        (TileSet.Compute, ExchangeStrategy.JustInTime, ReplicatedStreamMode.Replicate)
    s = InputSettings(TileSet.IO, ExchangeStrategy.OverlapLoops)
    assert s.tileSet() == TileSet.IO and s.exchangeStrategy() == ExchangeStrategy.OverlapLoops
    assert InputSettings(ReplicatedStreamMode.Broadcast).replicatedStreamMode() == \
        ReplicatedStreamMode.Broadcast


def test_input_shape_info():
    info = InputShapeInfo()
    assert not info.has("x")
    info.add("x", TensorInfo("FLOAT", [2, 3]))
    assert info.has("x") and info.get("x").shape() == [2, 3]
    with pytest.raises(popart_exception, match="'y'"):
        info.get("y")


def test_stepio_holders():
    inputs, outputs = {"a": np.zeros(2, np.float32)}, {"b": np.zeros(2, np.float32)}
    io = PyStepIO(inputs, outputs)
    assert io.inputs is inputs and io.outputs is outputs and io.runtime_asserts is None
    io.enableRuntimeAsserts(True)
    assert io.runtime_asserts is True
    calls = [lambda i, p: None, lambda i: None, lambda i: None, lambda i: None]
    cb = PyStepIOCallback(*calls)
    assert [cb.input_callback, cb.input_complete_callback, cb.output_callback,
            cb.output_complete_callback] == calls
    w = {"w": np.ones(3, np.float32)}
    assert PyWeightsIO(w).weights is w


# --- host shapes --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[], [5], [2, 3], [1, 4, 1]])
@pytest.mark.parametrize("bps,accl,repl,leading", [
    (1, 1, 1, []), (4, 1, 1, [4]), (1, 3, 1, [3]), (1, 1, 2, [2]), (4, 3, 1, [4, 3]),
    (4, 1, 2, [4, 2]), (1, 3, 2, [3, 2]), (4, 3, 2, [4, 3, 2]),
])
def test_input_host_shape(shape, bps, accl, repl, leading):
    assert input_host_shape(shape, bps, accl, repl) == leading + shape


@pytest.mark.parametrize("shape", [[], [5], [2, 3], [1, 4, 1]])
@pytest.mark.parametrize("bps,accl,repl", [(1, 1, 1), (4, 1, 1), (6, 1, 1), (4, 3, 1),
                                           (4, 1, 2), (6, 3, 2), (2, 1, 2)])
def test_anchor_host_shape(shape, bps, accl, repl):
    def drop(*dims):
        return [d for d in dims if d != 1] + shape

    assert anchor_host_shape(shape, AnchorReturnType("ALL"), bps, accl, repl) == \
        drop(bps, accl, repl)
    assert anchor_host_shape(shape, AnchorReturnTypeId.All, bps, accl, repl) == \
        drop(bps, accl, repl)
    for n in (1, 2):
        if bps % n == 0:
            assert anchor_host_shape(shape, AnchorReturnType("EVERYN", n), bps, accl, repl) == \
                drop(bps // n, accl, repl)
    assert anchor_host_shape(shape, AnchorReturnType("FINAL"), bps, accl, repl) == drop(repl)
    assert anchor_host_shape(shape, AnchorReturnType("SUM"), bps, accl, repl) == drop(repl)


def test_anchor_host_shape_examples():
    assert anchor_host_shape([2, 3], AnchorReturnType("ALL"), 4, 2, 2) == [4, 2, 2, 2, 3]
    assert anchor_host_shape([2, 3], AnchorReturnType("EVERYN", 2), 4, 1, 1) == [2, 2, 3]
    assert anchor_host_shape([2, 3], AnchorReturnType("EVERYN", 4), 4, 1, 1) == [2, 3]
    assert anchor_host_shape([1], AnchorReturnType("FINAL"), 8, 4, 1) == [1]
    assert anchor_host_shape([1], AnchorReturnType("SUM"), 8, 4, 2) == [2, 1]
    with pytest.raises(popart_exception):
        anchor_host_shape([2], AnchorReturnTypeId.EveryN, 4, 1, 1)


# --- validate_input -------------------------------------------------------------------------------
INFO = TensorInfo("FLOAT", [2, 3])


@pytest.mark.parametrize("bps,accl,repl", [(1, 1, 1), (4, 1, 1), (4, 3, 1), (2, 3, 2)])
def test_validate_input_reshapes_to_full_shape(bps, accl, repl):
    full = [bps, accl, repl, 2, 3]
    data = np.arange(np.prod(full), dtype=np.float32)
    for given in (data.reshape(input_host_shape([2, 3], bps, accl, repl)), data.reshape(full)):
        out = validate_input("x", given, INFO, bps, accl, repl, strict=True)
        assert out.shape == tuple(full)
        np.testing.assert_array_equal(out.ravel(), data)
    # Without runtime asserts any shape with the right number of elements is accepted.
    out = validate_input("x", data, INFO, bps, accl, repl, strict=False)
    assert out.shape == tuple(full) and out[-1, -1, -1, -1, -1] == data[-1]


def test_validate_input_wrong_element_count():
    with pytest.raises(StepIOError) as e:
        validate_input("x", np.zeros((3, 2, 3), np.float32), INFO, 4, 1, 1)
    assert e.value.args[0].startswith("Unexpected number of input elements for Tensor x. "
                                      "Expected 24, but received 18.\n")   # PopART's text
    msg = "\n".join(e.value.__notes__)   # the package's context
    assert "'x'" in msg and "[4, 2, 3]" in msg and "[3, 2, 3]" in msg and "FLOAT" in msg


def test_validate_input_wrong_dtype_never_casts():
    with pytest.raises(StepIOError) as e:
        validate_input("x", np.zeros((2, 3)), INFO, 1, 1, 1)
    assert e.value.args[0] == ("Type discrepancy for tensor x. User provided : DOUBLE and "
                               "expected : FLOAT. Consider a custom copy here (as memcpy "
                               "cannot be used)")   # Devicex's text; the context in a note
    assert "'x'" in e.value.__notes__[0] and "float64" in e.value.__notes__[0]
    with pytest.raises(StepIOError, match="does not fit INT32"):   # PopART narrows INT64
        validate_input("i", np.array([1, 2 ** 31], np.int64), TensorInfo("INT32", [2]), 1, 1, 1)
    got = validate_input("i", np.array([-5, 7], np.int64), TensorInfo("INT32", [2]), 1, 1, 1)
    assert got.dtype == np.int32 and got.reshape(-1).tolist() == [-5, 7]


def test_validate_input_strict_shape():
    flat = np.zeros(24, np.float32)
    assert validate_input("x", flat, INFO, 4, 1, 1, strict=False).shape == (4, 1, 1, 2, 3)
    with pytest.raises(StepIOError, match="runtime asserts") as e:
        validate_input("x", flat, INFO, 4, 1, 1, strict=True)
    assert "[4, 2, 3]" in str(e.value) and "[24]" in str(e.value)


def test_validate_input_scalar_tensor():
    info = TensorInfo("INT32", [])
    out = validate_input("s", np.arange(4, dtype=np.int32), info, 4, 1, 1, strict=True)
    assert out.shape == (4, 1, 1)
    assert validate_input("s", np.int32(7), info, 1, 1, 1, strict=True).shape == (1, 1, 1)
