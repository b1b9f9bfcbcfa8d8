"""pybind11's "incompatible function / constructor arguments" TypeError where PopART's
bindings reject an argument: the Builder's op methods, the optimizers' constructors and the
SessionOptions setters. The expected texts are written out here from PopART's binding
declarations (python/popart/popart_opset10/popart_opset10.gen.cpp, made by gen_operators.py;
python/popart/popart_core/popart.cpp) and pybind11's dispatcher (pybind11.h): the
signatures one per line, then "Invoked with:" and the arguments' reprs, keyword arguments
after "; kwargs: "."""
import numpy as np
import pytest

import popart

DC = "debugContext: popart_core.DebugContext = ''"


def pybind_text(fn: str, signature: str, invoked: str, constructor: bool = False) -> str:
    kind = "constructor" if constructor else "function"
    return (f"{fn}(): incompatible {kind} arguments. The following argument types are "
            f"supported:\n    1. {signature}\n\nInvoked with: {invoked}")


def raised(fn):
    with pytest.raises(TypeError) as e:
        fn()
    assert isinstance(e.value, popart.popart_exception)
    assert e.value.__notes__   # the package's reason, naming the argument
    return e.value


@pytest.fixture
def opsets():
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
    return b, b.aiOnnx, b.aiGraphcore, x


def test_onnx_op_given_one_id_instead_of_a_list(opsets):
    """popart_opset10.gen.cpp:1435-1442: relu(args: std::vector<TensorId>, debugContext);
    pybind11's list caster refuses a str. The list form builds the node."""
    b, onnx, _, x = opsets
    e = raised(lambda: onnx.relu(x))
    sig = f"(self: popart_opset10.AiOnnxOpset10, args: List[str], {DC}) -> str"
    assert e.args[0] == pybind_text("relu", sig, f"{onnx!r}, 'x'")
    assert b.getTensorShape(onnx.relu([x])) == [2, 3]


@pytest.mark.parametrize("call,fn,params,invoked", [
    # :245-255 concat(args, int64_t axis, debugContext): a str is no int
    (lambda o, x: o.concat([x, x], "0"), "concat", "axis: int", "['x', 'x'], '0'"),
    # :559-568 gather(args, axis = 0)
    (lambda o, x: o.gather([x, x], axis=1.5), "gather", "axis: int = 0",
     "['x', 'x']; kwargs: axis=1.5"),
    # :1867-1876 transpose(args, perm = std::vector<int64_t>())
    (lambda o, x: o.transpose([x], perm="10"), "transpose", "perm: List[int] = []",
     "['x']; kwargs: perm='10'"),
    # :1407-1417 reducesum(args, axes = nonstd::optional<std::vector<int64_t>>(), keepdims = 1)
    (lambda o, x: o.reducesum([x], [0], "no"), "reducesum",
     "axes: Optional[List[int]] = None, keepdims: int = 1", "['x'], [0], 'no'"),
    # :774-782 leakyrelu(args, alpha = 0.01f): the float default as pybind11 prints a float
    (lambda o, x: o.leakyrelu([x], alpha="a"), "leakyrelu", "alpha: float = 0.009999999776482582",
     "['x']; kwargs: alpha='a'"),
    # :154-176 averagepool(args, kernel_shape, ceil_mode = 0, count_include_pad = 0, pads, strides)
    (lambda o, x: o.averagepool([x], kernel_shape=2), "averagepool",
     "kernel_shape: List[int], ceil_mode: int = 0, count_include_pad: int = 0, "
     "pads: List[int] = [], strides: List[int] = []", "['x']; kwargs: kernel_shape=2"),
])
def test_onnx_attribute_of_the_wrong_type(opsets, call, fn, params, invoked):
    """An attribute given a value its C++ type's caster cannot load."""
    b, onnx, _, x = opsets
    e = raised(lambda: call(onnx, x))
    sig = f"(self: popart_opset10.AiOnnxOpset10, args: List[str], {params}, {DC}) -> str"
    assert e.args[0] == pybind_text(fn, sig, f"{onnx!r}, {invoked}")
    assert len(b.getValueTensorIds()) == 0   # nothing was added


def test_onnx_op_without_inputs_and_unknown_keyword(opsets):
    """:1247-1263 randomuniform has no args (an op without inputs); an unknown keyword
    fits no overload either."""
    _, onnx, _, x = opsets
    e = raised(lambda: onnx.randomuniform(shape=(2, "a")))
    sig = ("(self: popart_opset10.AiOnnxOpset10, shape: List[int], dtype: int = 1, high: float "
           f"= 1.0, low: float = 0.0, seed: Optional[float] = None, {DC}) -> str")
    assert e.args[0] == pybind_text("randomuniform", sig, f"{onnx!r}; kwargs: shape=(2, 'a')")
    e = raised(lambda: onnx.add([x, x], alpha=1))
    assert e.args[0].endswith(f"Invoked with: {onnx!r}, ['x', 'x']; kwargs: alpha=1")
    assert "alpha" in e.__notes__[0]


def test_graphcore_ops(opsets):
    """popart.cpp:2462-2467 scale(args, float scale); :2623-2630 nllloss(..., ignoreIndex =
    none); :2684-2689 with builder.hpp:910: reshape takes one TensorId."""
    b, _, gc, x = opsets
    e = raised(lambda: gc.scale([x], "two"))
    assert e.args[0] == pybind_text(
        "scale", f"(self: popart_core.AiGraphcoreOpset1, args: List[str], scale: float, {DC}) "
        "-> str", f"{gc!r}, ['x'], 'two'")
    e = raised(lambda: gc.nllloss([x, x], ignoreIndex=0.5))
    assert "ignoreIndex: Optional[int] = None" in e.args[0]
    assert "reduction: popart_core.ReductionType = <ReductionType.Mean: 1>" in e.args[0]
    assert "args: str, shape: List[int]" in raised(lambda: gc.reshape(7, [3, 2])).args[0]
    assert b.getTensorShape(gc.reshape(x, [3, 2])) == [3, 2]
    assert b.getTensorShape(gc.scale([x], np.float32(2))) == [2, 3]


_SGD = ("popart_core.SGD(pyd: dict, clip_norm_settings: List[popart_core.ClipNormSettings] = [], "
        "accumulatorAndMomentum: popart_core.SGDAccumulatorAndMomentum = "
        "<SGDAccumulatorAndMomentum.Combined: 0>, accumType: popart_core.DataType = "
        "<DataType.UNDEFINED: 18>, accl1Type: popart_core.DataType = <DataType.UNDEFINED: 18>, "
        "debugContext: popart_core.DebugContext = 'sgd')")
_DT = "popart_core.DataType = <DataType.{}: {}>"


def test_sgd_constructor():
    """popart.cpp:854-880 (datatype.hpp: UNDEFINED is 18, FLOAT 11)."""
    e = raised(lambda: popart.SGD(["lr"]))
    assert e.args[0] == pybind_text("__init__", _SGD, "['lr']", constructor=True)
    e = raised(lambda: popart.SGD({}, accumulatorAndMomentum="Separate"))
    assert e.args[0] == pybind_text("__init__", _SGD, "{}; kwargs: accumulatorAndMomentum="
                                    "'Separate'", constructor=True)
    sgd = popart.SGD({"defaultLearningRate": (0.5, False)}, [],
                     popart.SGDAccumulatorAndMomentum.Separate)
    assert sgd.learningRates().getDefault().val() == 0.5


def test_adam_and_adaptive_constructors():
    """popart.cpp:914-950 (Adam) and :966-1000 (Adaptive)."""
    adam = ("popart_core.Adam(values: dict, mode: popart_core.AdamMode = <AdamMode.Adam: 0>, "
            "weight_decay_mode: popart_core.WeightDecayMode = <WeightDecayMode.Decay: 0>, "
            f"accum_type: {_DT.format('UNDEFINED', 18)}, accl1_type: {_DT.format('FLOAT', 11)}, "
            f"accl2_type: {_DT.format('FLOAT', 11)}, clip_norm_settings: "
            "List[popart_core.ClipNormSettings] = [], scaled_optimizer_state: bool = False, "
            "debugContext: popart_core.DebugContext = 'adam')")
    e = raised(lambda: popart.Adam({}, "Lamb"))
    assert e.args[0] == pybind_text("__init__", adam, "{}, 'Lamb'", constructor=True)
    e = raised(lambda: popart.Adaptive({}, rmsprop_tf_variant="yes"))
    assert e.args[0].startswith("__init__(): incompatible constructor arguments. The following "
                                "argument types are supported:\n    1. popart_core.Adaptive("
                                "values: dict, mode: popart_core.AdaptiveMode = "
                                "<AdaptiveMode.RMSProp: 1>, ")
    assert e.args[0].endswith("\n\nInvoked with: {}; kwargs: rmsprop_tf_variant='yes'")
    assert popart.Adam({}, popart.AdamMode.Lamb, scaled_optimizer_state=1).scaled_optimizer_state


def test_optimizer_value_dictionary_errors():
    """popart.cpp:114-130 getOptimizerValueDictionary: PopART's own errors (popart_exception,
    not TypeError) for a key that is not a str or a value that is no tuple."""
    with pytest.raises(popart.popart_exception) as e:
        popart.SGD({1: (0.1, True)})
    assert e.value.args[0] == ("A key in the optimizer map input must be a py::str (in "
                               "getOptimizerValueDictionary)")
    with pytest.raises(popart.popart_exception) as e:
        popart.Adam({"defaultLearningRate": "0.1"})
    assert e.value.args[0] == ("A value in the optimizer map must be a py::tuple (in "
                               "getOptimizerValueDictionary)")
    assert not isinstance(e.value, TypeError)


@pytest.mark.parametrize("name,value,cpp", [
    ("enableOutlining", "yes", "bool"),                        # popart.cpp:1415
    ("accumulationFactor", 1.5, "int"),                        # :1428
    ("virtualGraphMode", "Sideways", "popart_core.VirtualGraphMode"),   # :1523
    ("engineOptions", ["a"], "Dict[str, str]"),
    ("automaticLossScalingSettings", True, "popart_core.AutomaticLossScalingSettings"),
])
def test_session_options_setters(name, value, cpp):
    """A def_readwrite setter is an unnamed pybind11 function of ``arg0``: "(): incompatible
    function arguments"; the option is named in the note. Still an OptionError."""
    opts = popart.SessionOptions()
    e = raised(lambda: setattr(opts, name, value))
    assert e.args[0] == pybind_text(
        "", f"(self: popart_core.SessionOptions, arg0: {cpp}) -> None", f"{opts!r}, {value!r}")
    assert isinstance(e, popart.OptionError) and name in e.__notes__[0]


def test_session_options_bool_setter_takes_what_pybind_takes():
    """pybind11's bool caster converts any object with a number protocol's bool (and None)."""
    opts = popart.SessionOptions()
    opts.enableOutlining = 0
    assert opts.enableOutlining is False
    opts.enableOutlining = 2.0
    assert opts.enableOutlining is True
