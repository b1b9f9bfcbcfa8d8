"""User guide chapter 8 (Custom operators): a LeakyRelu op in domain "com.acme".

In PopART a custom op is C++ (an Op, a GradOp, an Opx for Poplar and an ONNX schema). Here it
is one Python function registered with the op registry: it lowers the op to jax.numpy, and
its gradient comes from JAX's autodiff, or, as here, from a ``jax.custom_vjp`` playing the
part of the guide's LeakyReluGrad op. The op is then used with ``builder.customOp`` exactly as
in section 8.5, for inference and for training.
"""
import jax
import jax.numpy as jnp
import numpy as np

import popart
from popart.ops.registry import register


@jax.custom_vjp
def leaky_relu(x, alpha):
    return jnp.where(x >= 0, x, alpha * x)


def _fwd(x, alpha):
    return leaky_relu(x, alpha), (x, alpha)


def _bwd(res, dy):  # LeakyReluGrad: dy * (1 if x >= 0 else alpha)
    x, alpha = res
    return jnp.where(x >= 0, dy, alpha * dy), None


leaky_relu.defvjp(_fwd, _bwd)


@register("LeakyRelu", domain="com.acme", since=1)
def leaky_relu_op(ctx, x, alpha=1e-2, **_):
    """Lowering of com.acme::LeakyRelu-1: attribute ``alpha`` (default 0.01, as the guide's)."""
    return leaky_relu(x, jnp.asarray(alpha, x.dtype))


alpha = 0.1
builder = popart.Builder()
input_tensor = builder.addInputTensor(popart.TensorInfo("FLOAT", [2, 8]), "x")
w = builder.addInitializedInputTensor(np.eye(8, dtype=np.float32), "w")
h = builder.aiOnnx.matmul([input_tensor, w])
output_tensor = builder.customOp(opName="LeakyRelu",
                                 opVersion=1,
                                 domain="com.acme",
                                 inputs=[h],
                                 attributes={"alpha": alpha})[0]
builder.addOutputTensor(output_tensor)
x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
expected = np.where(x >= 0, x, alpha * x)

# Inference
dataFlow = popart.DataFlow(1, {output_tensor: popart.AnchorReturnType("ALL")})
session = popart.InferenceSession(builder.getModelProto(), dataFlow,
                                  popart.DeviceManager().createCpuDevice())
session.prepareDevice()
anchors = session.initAnchorArrays()
session.run(popart.PyStepIO({input_tensor: x}, anchors))
print(f"LeakyRelu({alpha}) of {x[0, :4]} ... = {anchors[output_tensor][0, :4]} ...")
assert np.allclose(anchors[output_tensor], expected)

# Training through the custom op: the loss is sum(LeakyRelu(x @ w)), so d loss / d w =
# x^T @ (1 if x @ w >= 0 else alpha).
loss = builder.aiGraphcore.identityloss([output_tensor], reduction=popart.ReductionType.Sum)
grad_w = popart.reservedGradientPrefix() + w
session = popart.TrainingSession(builder.getModelProto(),
                                 popart.DataFlow(1, {grad_w: popart.AnchorReturnType("FINAL")}),
                                 loss, popart.ConstSGD(0.01),
                                 popart.DeviceManager().createCpuDevice())
session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()
session.run(popart.PyStepIO({input_tensor: x}, anchors))
expected_grad = x.T @ np.where(x >= 0, 1.0, alpha).astype(np.float32)
print(f"{grad_w}: max |error| {np.abs(anchors[grad_w] - expected_grad).max():.2e}")
assert np.allclose(anchors[grad_w], expected_grad, atol=1e-6)
print("custom_op: OK")
