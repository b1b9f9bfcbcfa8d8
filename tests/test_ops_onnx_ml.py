"""ai.onnx.ml ops (Binarizer, ArrayFeatureExtractor, LabelEncoder, TreeEnsemble) through the
ONNX backend (string tensors included) against onnxruntime, and in sessions (the op tester);
the ai.onnx.preview.training optimizers (Adagrad, Adam, Momentum) run by the op tester against
NumPy transcriptions of the ONNX operator docs."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from popart import onnx_backend
from popart.errors import popart_exception

from op_tester import one_op

ML = "ai.onnx.ml"
TRAIN = "ai.onnx.preview.training"
RNG = np.random.default_rng(7)


def _elem(a):
    a = np.asarray(a)
    return TensorProto.STRING if a.dtype.kind in "OUS" else helper.np_dtype_to_tensor_dtype(a.dtype)


def model_of(op, feeds, n_out=1, domain=ML, opset=1, **attrs):
    node = helper.make_node(op, list(feeds), [f"y{i}" for i in range(n_out)], domain=domain, **attrs)
    ins = [helper.make_tensor_value_info(k, _elem(v), np.shape(v)) for k, v in feeds.items()]
    outs = [onnx.ValueInfoProto(name=f"y{i}") for i in range(n_out)]   # types inferred
    imports = [helper.make_opsetid(domain, opset), helper.make_opsetid("", 19)]
    return helper.make_model(helper.make_graph([node], "g", ins, outs), opset_imports=imports,
                             ir_version=10)


def ours(model, feeds):
    return onnx_backend.prepare(model).run(dict(feeds))


def theirs(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def check(model, feeds, rtol=1e-6, atol=1e-6):
    got, exp = ours(model, feeds), theirs(model, feeds)
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        g, e = np.asarray(g), np.asarray(e)
        assert g.shape == e.shape, (g.shape, e.shape)
        if e.dtype.kind in "OUS":
            assert g.dtype.kind in "OUS"
            assert [str(v) for v in g.reshape(-1)] == [str(v) for v in e.reshape(-1)]
        else:
            assert g.dtype == e.dtype, (g.dtype, e.dtype)
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    return got


# ---------------------------------------------------------------------------------------
# Binarizer, ArrayFeatureExtractor

@pytest.mark.parametrize("threshold", [None, 0.25, -1.0])
def test_binarizer(threshold):
    x = RNG.standard_normal((3, 4, 5)).astype(np.float32)
    x[0, 0, :2] = [0.25, -1.0]
    attrs = {} if threshold is None else {"threshold": threshold}
    check(model_of("Binarizer", {"x": x}, **attrs), {"x": x})


@pytest.mark.parametrize("shape,idx", [((3, 4), [0, 2]), ((2, 3, 5), [[4, 0, 4]]), ((6,), [5, 1]),
                                       ((2, 5), [[1, 2], [3, 0]]), ((4, 3), [2])])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_array_feature_extractor(shape, idx, dtype):
    x = (RNG.standard_normal(shape) * 10).astype(dtype)
    feeds = {"x": x, "i": np.asarray(idx, np.int64)}
    check(model_of("ArrayFeatureExtractor", feeds), feeds)


def test_array_feature_extractor_runtime_indices(op_tester):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    i = np.array([3, 1, 1], np.int64)
    op_tester.run(one_op("ArrayFeatureExtractor", [x, i], domain=ML), lambda ref: [x[:, [3, 1, 1]]],
                  rtol=0, atol=0)


def test_array_feature_extractor_strings():
    x = np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)
    feeds = {"x": x, "i": np.array([2, 0], np.int64)}
    check(model_of("ArrayFeatureExtractor", feeds), feeds)


# ---------------------------------------------------------------------------------------
# LabelEncoder

def _tensor(name, a):
    return numpy_helper.from_array(np.asarray(a), name)


STRS = np.array([["a", "b", "zz"], ["c", "", "a"]], dtype=object)

LABEL_CASES = [
    # (opset, input, attributes)
    (2, STRS, dict(keys_strings=["a", "b", "c"], values_int64s=[5, 6, 7])),
    (2, STRS, dict(keys_strings=["a", "b", "c"], values_int64s=[5, 6, 7], default_int64=42)),
    (2, STRS, dict(keys_strings=["a", "b", "c"], values_floats=[0.5, 1.5, 2.5])),
    (2, STRS, dict(keys_strings=["a", "c"], values_strings=["x", "y"], default_string="?")),
    (2, STRS, dict(keys_strings=["a", "c"], values_strings=["x", "y"])),
    (2, np.array([[1, 5, -3], [7, 5, 0]], np.int64),
     dict(keys_int64s=[5, 7, -3], values_int64s=[50, 70, -30], default_int64=0)),
    (2, np.array([3, 1, 4, 1, 5, 9], np.int64), dict(keys_int64s=[1, 9], values_strings=["one", "nine"])),
    (2, np.array([1.5, -0.0, np.nan, 2.0, 7.0], np.float32),
     dict(keys_floats=[1.5, 0.0, 2.0], values_floats=[10.0, 20.0, 40.0])),
    (2, np.array([1.5, 3.0, 2.0], np.float32), dict(keys_floats=[2.0, 1.5], values_int64s=[1, 2])),
    (4, STRS, dict(keys_tensor=_tensor("k", np.array(["a", "b", "c"], object)),
                   values_tensor=_tensor("v", np.array([1, 2, 3], np.int16)),
                   default_tensor=_tensor("d", np.array([-7], np.int16)))),
    (4, np.array([[4, 2], [2, 9]], np.int64),
     dict(keys_tensor=_tensor("k", np.array([2, 4], np.int64)),
          values_tensor=_tensor("v", np.array([0.25, 0.5], np.float64)),
          default_tensor=_tensor("d", np.array([-1.0], np.float64)))),
    (4, np.array([1.0, 2.0, 5.0], np.float64),
     dict(keys_tensor=_tensor("k", np.array([2.0, 1.0], np.float64)),
          values_tensor=_tensor("v", np.array(["two", "one"], object)),
          default_tensor=_tensor("d", np.array(["none"], object)))),
    (4, STRS, dict(keys_strings=["a", "b"], values_tensor=_tensor("v", np.array([3, 4], np.int64)),
                   default_tensor=_tensor("d", np.array([0], np.int64)))),
]


@pytest.mark.parametrize("opset,x,attrs", LABEL_CASES)
def test_label_encoder(opset, x, attrs):
    check(model_of("LabelEncoder", {"x": x}, opset=opset, **attrs), {"x": x})


def test_label_encoder_spec_nan_and_repeated_keys(op_tester):
    """As the ONNX spec says (onnxruntime differs): a repeated key maps to its last value, and
    a NaN key matches every NaN input."""
    x = np.array([1.5, -0.0, np.nan, 2.0, 7.0, 1.5], np.float32)
    op_tester.run(one_op("LabelEncoder", [x], domain=ML, keys_floats=[1.5, 0.0, np.nan, 2.0, 1.5],
                         values_int64s=[1, 2, 3, 4, 5]),
                  lambda ref: [np.array([5, 2, 3, 4, -1, 5], np.int64)], opsets={ML: 2})
    s = np.array(["a", "b", "c"], object)
    (got,) = ours(model_of("LabelEncoder", {"x": s}, opset=2, keys_strings=["a", "b", "a"],
                           values_strings=["x", "y", "z"]), {"x": s})
    assert list(got) == ["z", "y", "_Unused"]


def test_label_encoder_opset1():
    check(model_of("LabelEncoder", {"x": STRS}, opset=1, classes_strings=["a", "c", "b"]),
          {"x": STRS})
    x = np.array([0, 2, 5, 1], np.int64)
    check(model_of("LabelEncoder", {"x": x}, opset=1, classes_strings=["a", "c", "b"],
                   default_string="??"), {"x": x})


def test_label_encoder_numeric_at_run_time(op_tester):
    """Numeric keys work on run-time data (a jitted lookup, not host code)."""
    x = np.array([[3, 1], [8, 3]], np.int64)
    op_tester.run(one_op("LabelEncoder", [x], domain=ML, keys_int64s=[1, 3],
                         values_floats=[0.5, 1.5], default_float=-2.0),
                  lambda ref: [np.array([[1.5, 0.5], [-2.0, 1.5]], np.float32)], opsets={ML: 2},
                  rtol=0, atol=0)


def test_label_encoder_string_output_needs_constant_input(op_tester):
    x = np.array([1, 2], np.int64)
    with pytest.raises(popart_exception, match="compile time"):
        op_tester.run(one_op("LabelEncoder", [x], domain=ML, keys_int64s=[1], values_strings=["a"]),
                      None, opsets={ML: 2})


def test_label_encoder_bad_attributes():
    model = model_of("LabelEncoder", {"x": STRS}, opset=2, keys_strings=["a"],
                     values_int64s=[1, 2])
    with pytest.raises(popart_exception, match="1 keys but 2 values"):
        ours(model, {"x": STRS})


# ---------------------------------------------------------------------------------------
# TreeEnsemble

def _random_ensemble(n_trees, n_features, n_targets, dtype, modes, depth=4, member=True):
    """Random full-ish trees as TreeEnsemble (opset 5) attributes."""
    nodes = dict(splits=[], feat=[], modes=[], t=[], f=[], tl=[], fl=[], mtt=[])
    leaves_w, leaves_t, roots, members = [], [], [], []

    def leaf():
        leaves_w.append(float(RNG.standard_normal() * 3))
        leaves_t.append(int(RNG.integers(0, n_targets)))
        return len(leaves_w) - 1, 1

    def build(d):
        if d == depth or (d > 1 and RNG.random() < 0.25):
            return leaf()
        k = len(nodes["splits"])
        mode = int(RNG.choice(modes))
        for key in nodes:
            nodes[key].append(0)
        nodes["feat"][k] = int(RNG.integers(0, n_features))
        nodes["modes"][k] = mode
        nodes["mtt"][k] = int(RNG.random() < 0.3)
        if mode == 6:
            vals = sorted(set(RNG.integers(-3, 4, int(RNG.integers(1, 4))).tolist()))
            members.extend([float(v) for v in vals] + [np.nan])
            nodes["splits"][k] = np.nan
        elif mode in (4, 5):
            nodes["splits"][k] = float(RNG.integers(-2, 3))
        else:
            nodes["splits"][k] = round(float(RNG.standard_normal()), 2)
        nodes["t"][k], nodes["tl"][k] = build(d + 1)
        nodes["f"][k], nodes["fl"][k] = build(d + 1)
        return k, 0

    for _ in range(n_trees):
        r, is_leaf = build(0 if n_trees else 0)
        roots.append(r)
    attrs = dict(
        nodes_splits=_tensor("s", np.array(nodes["splits"], dtype)),
        nodes_featureids=nodes["feat"], nodes_modes=_tensor("m", np.array(nodes["modes"], np.uint8)),
        nodes_truenodeids=nodes["t"], nodes_falsenodeids=nodes["f"],
        nodes_trueleafs=nodes["tl"], nodes_falseleafs=nodes["fl"],
        nodes_missing_value_tracks_true=nodes["mtt"],
        leaf_targetids=leaves_t, leaf_weights=_tensor("w", np.array(leaves_w, dtype)),
        tree_roots=roots, n_targets=n_targets)
    if members:
        attrs["membership_values"] = _tensor("mv", np.array(members, dtype))
    return attrs


def _tree_input(n, f, dtype, integers=False):
    x = RNG.integers(-3, 4, (n, f)).astype(dtype) if integers else RNG.standard_normal((n, f)).astype(dtype)
    x.reshape(-1)[::7] = np.nan
    return x


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tree_ensemble_aggregates(aggregate, dtype):
    attrs = _random_ensemble(5, 3, 3, dtype, modes=[0, 1, 2, 3])
    x = _tree_input(40, 3, dtype)
    check(model_of("TreeEnsemble", {"x": x}, opset=5, aggregate_function=aggregate, **attrs),
          {"x": x}, rtol=1e-5, atol=1e-5)


def _np_post(y, post):
    from scipy.special import erfinv
    if post == 1:
        e = np.exp(y - y.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if post == 2:
        return 1 / (1 + np.exp(-y))
    return np.sqrt(2) * erfinv(2 * y.astype(np.float64) - 1)


@pytest.mark.parametrize("post", [0, 1, 2, 3, 4])
def test_tree_ensemble_post_transform(post):
    """NONE and SOFTMAX_ZERO against onnxruntime; SOFTMAX (1), LOGISTIC (2) and PROBIT (4)
    against NumPy on onnxruntime's raw scores: onnxruntime 1.x swaps codes 1 and 2 of this
    opset-5 op and approximates PROBIT's erfinv (to about 1e-3)."""
    attrs = _random_ensemble(4, 2, 3, np.float32, modes=[0, 3])
    x = _tree_input(30, 2, np.float32)
    if post == 4:    # probit wants scores in (0, 1)
        w = numpy_helper.to_array(attrs["leaf_weights"])
        attrs["leaf_weights"] = _tensor("w", (np.abs(w) / (np.abs(w).sum() + 1)).astype(np.float32))
    model = model_of("TreeEnsemble", {"x": x}, opset=5, post_transform=post, **attrs)
    if post in (0, 3):
        check(model, {"x": x}, rtol=1e-5, atol=1e-5)
        return
    (raw,) = theirs(model_of("TreeEnsemble", {"x": x}, opset=5, **attrs), {"x": x})
    (got,) = ours(model, {"x": x})
    assert got.dtype == np.float32 and got.shape == raw.shape
    np.testing.assert_allclose(got, _np_post(raw, post), rtol=1e-5, atol=1e-5)


def test_tree_ensemble_equality_and_membership():
    attrs = _random_ensemble(6, 3, 2, np.float32, modes=[4, 5, 6, 0])
    x = _tree_input(50, 3, np.float32, integers=True)
    check(model_of("TreeEnsemble", {"x": x}, opset=5, **attrs), {"x": x}, rtol=1e-5, atol=1e-5)


def test_tree_ensemble_single_leaf_tree():
    attrs = dict(nodes_splits=_tensor("s", np.array([0.0, 0.5], np.float32)),
                 nodes_featureids=[0, 0], nodes_modes=_tensor("m", np.array([0, 0], np.uint8)),
                 nodes_truenodeids=[0, 1], nodes_falsenodeids=[0, 2], nodes_trueleafs=[1, 1],
                 nodes_falseleafs=[1, 1], leaf_targetids=[0, 1, 0],
                 leaf_weights=_tensor("w", np.array([2.0, 3.0, 4.0], np.float32)),
                 tree_roots=[0, 1], n_targets=2)
    x = np.array([[0.2], [0.9]], np.float32)
    got = check(model_of("TreeEnsemble", {"x": x}, opset=5, **attrs), {"x": x})[0]
    np.testing.assert_array_equal(got, [[2.0, 3.0], [6.0, 0.0]])


# ---------------------------------------------------------------------------------------
# ai.onnx.preview.training

def np_adagrad(r, t, x, g, h, norm_coefficient=0.0, epsilon=1e-6, decay_factor=0.0):
    r_ = r / (1 + t * decay_factor)
    gr = norm_coefficient * x + g
    h_new = h + gr * gr
    return x - r_ * gr / (np.sqrt(h_new) + epsilon), h_new


def np_adam(r, t, x, g, v, h, norm_coefficient=0.0, norm_coefficient_post=0.0, alpha=0.9,
            beta=0.999, epsilon=1e-6):
    gr = norm_coefficient * x + g
    v_new = alpha * v + (1 - alpha) * gr
    h_new = beta * h + (1 - beta) * gr * gr
    r_ = r * np.sqrt(1 - beta ** t) / (1 - alpha ** t) if t > 0 else r
    return (1 - norm_coefficient_post) * (x - r_ * v_new / (np.sqrt(h_new) + epsilon)), v_new, h_new


def np_momentum(r, t, x, g, v, norm_coefficient, alpha, beta, mode):
    gr = norm_coefficient * x + g
    v_new = alpha * v + (beta if t > 0 else 1) * gr
    step = v_new if mode == "standard" else gr + alpha * v_new
    return x - r * step, v_new


SHAPES = [(3,), (2, 4), ()]


def _train_case(groups, t, dtype):
    r = np.array(0.1, dtype)
    t = np.array(t, np.int64)
    per = [[(RNG.standard_normal(s) if k < 2 else np.abs(RNG.standard_normal(s))).astype(dtype)
            for s in SHAPES] for k in range(groups)]
    feeds = {"R": r, "T": t}
    for k, tensors in enumerate(per):
        feeds |= {f"in{k}_{i}": a for i, a in enumerate(tensors)}
    return r, t, per, feeds


@pytest.mark.parametrize("t", [0, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adagrad(op_tester, t, dtype):
    attrs = dict(norm_coefficient=0.01, epsilon=1e-5, decay_factor=0.1)
    r, t, (xs, gs, hs), feeds = _train_case(3, t, dtype)
    exp = [np_adagrad(float(r), int(t), x, g, h, **attrs) for x, g, h in zip(xs, gs, hs)]
    exp = [e[0] for e in exp] + [e[1] for e in exp]
    op_tester.run(one_op("Adagrad", list(feeds.values()), domain=TRAIN, num_outputs=6, **attrs),
                  lambda ref: [e.astype(dtype) for e in exp], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [0, 1, 5])
def test_adam(op_tester, t):
    attrs = dict(norm_coefficient=0.01, norm_coefficient_post=0.02, alpha=0.85, beta=0.95,
                 epsilon=1e-3)
    r, t, (xs, gs, vs, hs), feeds = _train_case(4, t, np.float32)
    exp = [np_adam(float(r), int(t), *a, **attrs) for a in zip(xs, gs, vs, hs)]
    op_tester.run(one_op("Adam", list(feeds.values()), domain=TRAIN, num_outputs=9, **attrs),
                  lambda ref: [e[k].astype(np.float32) for k in range(3) for e in exp],
                  rtol=1e-5, atol=1e-6)


def test_adam_defaults(op_tester):
    r, t, (xs, gs, vs, hs), feeds = _train_case(4, 2, np.float64)
    exp = [np_adam(float(r), int(t), *a) for a in zip(xs, gs, vs, hs)]
    op_tester.run(one_op("Adam", list(feeds.values()), domain=TRAIN, num_outputs=9),
                  lambda ref: [e[k] for k in range(3) for e in exp], rtol=1e-10, atol=0)


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
@pytest.mark.parametrize("t", [0, 2])
def test_momentum(op_tester, mode, t):
    attrs = dict(norm_coefficient=0.001, alpha=0.9, beta=0.3, mode=mode)
    r, t, (xs, gs, vs), feeds = _train_case(3, t, np.float32)
    exp = [np_momentum(float(r), int(t), x, g, v, **attrs) for x, g, v in zip(xs, gs, vs)]
    op_tester.run(one_op("Momentum", list(feeds.values()), domain=TRAIN, num_outputs=6, **attrs),
                  lambda ref: [e[k].astype(np.float32) for k in range(2) for e in exp],
                  rtol=1e-5, atol=1e-6)


def test_momentum_requires_attributes(op_tester):
    r, t, _, feeds = _train_case(3, 1, np.float32)
    with pytest.raises(popart_exception, match="(?i)required attribute"):
        op_tester.run(one_op("Momentum", list(feeds.values()), domain=TRAIN, num_outputs=6,
                             alpha=0.9, beta=0.1, norm_coefficient=0.0), None)


def test_training_ops_match_onnx_reference(op_tester):
    """The three ops on the onnx reference evaluator's own implementation, one step each."""
    for op, groups, attrs in [("Adagrad", 3, dict(decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.01)),
                              ("Adam", 4, dict(alpha=0.9, beta=0.99, epsilon=1e-4, norm_coefficient=0.0,
                                               norm_coefficient_post=0.01)),
                              ("Momentum", 3, dict(alpha=0.9, beta=0.5, mode="nesterov",
                                                   norm_coefficient=0.01))]:
        _, _, _, feeds = _train_case(groups, 4, np.float32)
        op_tester.run(one_op(op, list(feeds.values()), domain=TRAIN, num_outputs=groups * 3 - 3,
                             **attrs),
                      lambda ref: [np.asarray(e, np.float32) for e in ref.onnx_reference()],
                      rtol=1e-5, atol=1e-6)
