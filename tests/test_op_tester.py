"""The op_tester fixture itself: it checks what it is given, detects wrong references, and its
train mode's gradients are PyTorch's."""
import numpy as np
import pytest
import torch
from onnx.reference import ReferenceEvaluator

import popart

from op_tester import Const, one_op

GRAD = popart.reservedGradientPrefix()
RNG = np.random.default_rng(3)


def rnd(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def test_infer_checks_outputs_and_detects_a_wrong_reference(op_tester):
    x = rnd(3, 4)

    def init_builder(builder):
        return [builder.aiOnnx.relu([builder.addInputTensor(x)])]

    (y,) = op_tester.run(init_builder, lambda ref: [np.maximum(x, 0)])
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    with pytest.raises(AssertionError, match="Relu"):
        op_tester.run(init_builder, lambda ref: [np.abs(x)])
    with pytest.raises(AssertionError, match="shape"):
        op_tester.run(init_builder, lambda ref: [np.maximum(x, 0)[:2]])
    with pytest.raises(AssertionError, match="dtype"):
        op_tester.run(init_builder, lambda ref: [np.maximum(x, 0).astype(np.float64)])
    op_tester.check_dtypes = False
    op_tester.run(init_builder, lambda ref: [np.maximum(x, 0).astype(np.float64)])


def test_tolerances_and_integer_outputs(op_tester):
    x = rnd(5)
    init = lambda b: [b.aiOnnx.abs([b.addInputTensor(x)])]  # noqa: E731
    op_tester.run(init, lambda ref: [np.abs(x) + 1e-3], rtol=0, atol=2e-3)
    with pytest.raises(AssertionError):
        op_tester.run(init, lambda ref: [np.abs(x) + 1e-3])
    i = np.array([3, -1, 4], np.int32)
    op_tester.run(lambda b: [b.aiOnnx.neg([b.addInputTensor(i)])], lambda ref: [-i])
    with pytest.raises(AssertionError):
        op_tester.run(lambda b: [b.aiOnnx.neg([b.addInputTensor(i)])], lambda ref: [-i + 1])
    op_tester.run(lambda b: [b.aiOnnx.neg([b.addInputTensor(i)])], lambda ref: [-i + 1], atol=1)
    with pytest.raises(AssertionError):
        op_tester.run(lambda b: [b.aiOnnx.neg([b.addInputTensor(i)])], lambda ref: [-i + 2], atol=1)


def test_train_relu_matmul_gradients_match_torch(op_tester):
    """Output and gradients of relu(x @ w) for x and w, from one TrainingSession run, against
    torch.autograd with the tester's output gradient."""
    x, w = rnd(4, 3), rnd(3, 5)

    def init_builder(builder):
        xi, wi = builder.addInputTensor(x), builder.addInputTensor(w)
        y = builder.aiOnnx.relu([builder.aiOnnx.matmul([xi, wi])])
        return [y, GRAD + xi, GRAD + wi, GRAD + y]

    def reference(ref):
        tx, tw = (torch.tensor(v, requires_grad=True) for v in (x, w))
        ty = torch.relu(tx @ tw)
        gy = torch.from_numpy(ref.getOutputTensorGrad(0))
        ty.backward(gy)
        return [ty, tx.grad, tw.grad, gy]

    op_tester.run(init_builder, reference, step_type="train", opsets={"ai.onnx": 13})
    assert op_tester.sessions == 1    # outputs and gradients of one session


def test_train_detects_a_wrong_gradient(op_tester):
    x = rnd(2, 6)

    def init_builder(builder):
        xi = builder.addInputTensor(x)
        return [builder.aiOnnx.sigmoid([xi]), GRAD + xi]

    def reference(ref, wrong):
        s = 1 / (1 + np.exp(-x))
        g = ref.getOutputTensorGrad(0)
        return [s, (g if not wrong else np.ones_like(g)) * s * (1 - s)]

    op_tester.run(init_builder, lambda ref: reference(ref, False), step_type="train")
    with pytest.raises(AssertionError, match="Gradient___"):
        op_tester.run(init_builder, lambda ref: reference(ref, True), step_type="train")


def test_output_gradient_is_not_uniform_and_other_outputs_get_zero(op_tester):
    """The loss is sum(output0 * G) with G random (so transposed or permuted gradients are
    caught): output 1 of a two-output op gets no gradient."""
    x = rnd(3, 4)

    def init_builder(builder):
        xi = builder.addInputTensor(x)
        a, b = builder.aiOnnx.split([xi], num_outputs=2, axis=1)
        return [a, b, GRAD + xi]

    def reference(ref):
        ga, gb = ref.getOutputTensorGrad(0), ref.getOutputTensorGrad(1)
        assert ga.shape == (3, 2) and np.unique(ga).size == ga.size and not gb.any()
        return [x[:, :2], x[:, 2:], np.concatenate([ga, gb], 1)]

    op_tester.run(init_builder, reference, step_type="train", opsets={"ai.onnx": 11})
    with pytest.raises(TypeError, match="floating point"):
        op_tester.run(lambda b: [b.aiOnnx.argmax([b.addInputTensor(x)])], None, step_type="train")


def test_masked_reference_checks_only_unmasked_elements(op_tester):
    x = rnd(4)
    wrong = np.ma.masked_array(x + np.array([0, 0, 5, 5], np.float32), [False, False, True, True])
    op_tester.run(lambda b: [b.aiOnnx.identity([b.addInputTensor(x)])], lambda ref: [wrong])
    wrong.mask[2] = False
    with pytest.raises(AssertionError):
        op_tester.run(lambda b: [b.aiOnnx.identity([b.addInputTensor(x)])], lambda ref: [wrong])


def test_onnx_references_and_numeric_gradient(op_tester):
    """ref_data runs the forward model on onnxruntime and ONNX's reference evaluator, and
    differentiates the session's forward, or another, numerically (float64)."""
    x, w = rnd(2, 3, 5, 5, dtype=np.float64), rnd(4, 3, 3, 3, dtype=np.float64)

    def init_builder(dtype):
        def init(builder):
            xi, wi = builder.addInputTensor(x.astype(dtype)), builder.addInputTensor(w.astype(dtype))
            return [builder.aiOnnx.conv([xi, wi], pads=[1, 0, 1, 2]), GRAD + xi, GRAD + wi]
        return init

    op_tester.run(lambda b: init_builder(np.float32)(b)[:1], lambda ref: ref.onnxruntime(),
                  rtol=1e-5, atol=1e-5)

    def reference(ref):
        xi, wi = ref.inputs
        y = ref.onnx_reference()
        assert y[1:] == [None, None]
        ev = ReferenceEvaluator(ref.model)
        onnx_forward = lambda feeds: ev.run(None, feeds)[0]  # noqa: E731
        return [y[0], ref.numeric_grad(xi, n=8), ref.numeric_grad(wi, onnx_forward, n=None)]

    op_tester.run(init_builder(np.float64), reference, step_type="train", rtol=1e-6, atol=1e-8)
    with pytest.raises(AssertionError, match="Gradient___"):    # a sign error is caught
        op_tester.run(init_builder(np.float64), lambda ref: [
            None, None, -ref.numeric_grad(list(ref.inputs)[1], n=4)], step_type="train")
    with pytest.raises(TypeError, match="float64"):
        op_tester.run(lambda b: [b.aiOnnx.exp([b.addInputTensor(x.astype(np.float32))])],
                      lambda ref: [ref.numeric_grad(list(ref.inputs)[0])], step_type="train")


def test_weights_are_checked_after_the_step(op_tester):
    """A returned weight id is read back after the step: here one ConstSGD(0.1) update by its
    gradient."""
    x, w0 = rnd(2, 3), rnd(3)

    def init_builder(builder):
        xi, wi = builder.addInputTensor(x), builder.addInitializedInputTensor(w0)
        return [builder.aiOnnx.mul([xi, wi]), GRAD + wi, wi]

    def reference(ref):
        gw = (ref.getOutputTensorGrad(0) * x).sum(0)
        return [x * w0, gw, w0 - 0.1 * gw]

    op_tester.run(init_builder, reference, step_type="train", optimizer=popart.ConstSGD(0.1),
                  rtol=1e-5, atol=1e-6)


def test_replicated_inputs_get_the_replica_index(op_tester):
    """As PopART's op tester: with R replicas, replica r is fed input + r."""
    x = rnd(2, 3)
    op_tester.options = popart.SessionOptions()
    op_tester.options.enableReplicatedGraphs, op_tester.options.replicatedGraphCount = True, 2
    op_tester.run(lambda b: [b.aiOnnx.relu([b.addInputTensor(x)])],
                  lambda ref: [np.maximum(np.stack([x, x + 1]), 0)])


def test_one_op_constants_omitted_inputs_and_gradients(op_tester):
    """one_op: Clip(x, no min, constant max) and the gradient of its fed input only."""
    x, hi = rnd(3, 4, dtype=np.float64), np.array(0.5)
    op_tester.run(one_op("Clip", [x, None, Const(hi)], grads=True),
                  lambda ref: [np.minimum(x, hi), ref.getOutputTensorGrad(0) * (x < hi)],
                  step_type="train", opsets={"ai.onnx": 13})
