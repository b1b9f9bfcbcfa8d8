"""User guide sections 2.1 and 4 and the talk's training example: train an exported PyTorch
model with a loss appended by the Builder.

* ``popart.Builder("model.onnx")`` loads the exported model; a softmax and ``nllloss`` and a
  label input are appended (the guide applies nllloss to the logits; nllloss takes
  probabilities, hence the softmax, as in the talk).
* A TrainingSession with ConstSGD (guide 2.1), then with SGD whose learning rate changes
  every step through ``updateOptimizerFromHost`` (guide 4.1), checked against PyTorch.
* ``modelToHost`` saves the trained model; ``resetHostWeights`` loads it into another
  session (guide 4.4).
"""
import os
import tempfile
import warnings

import numpy as np
import torch

import popart

SMALL = os.environ.get("POPART_EXAMPLE_SMALL") == "1"
BATCH, STEPS, BPS = 4, 3 if SMALL else 6, 2

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
    torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
    torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))
input_ = torch.randn(BATCH, 3, 32, 32)
output_name = "output"
tmp = tempfile.TemporaryDirectory()  # removed at exit
model_path = os.path.join(tmp.name, "model.onnx")
warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
torch.onnx.export(model, input_, model_path, input_names=["input"], output_names=[output_name],
                  opset_version=11, dynamo=False, do_constant_folding=False,
                  keep_initializers_as_inputs=False)

# Append a softmax, a label input and an Nll loss to the model.
builder = popart.Builder(model_path)
probs = builder.aiOnnx.softmax([output_name], axis=1)
labels = builder.addInputTensor("INT32", [BATCH])
nlll = builder.aiGraphcore.nllloss([probs, labels])   # reduction: Mean
proto = builder.getModelProto()

rng = np.random.default_rng(0)
data = rng.standard_normal((STEPS, BPS, BATCH, 3, 32, 32)).astype(np.float32)
label_data = rng.integers(0, 10, (STEPS, BPS, BATCH)).astype(np.int32)
dataFlow = popart.DataFlow(BPS, {nlll: popart.AnchorReturnType("ALL"),
                                 output_name: popart.AnchorReturnType("FINAL")})

# --- Guide 2.1: ConstSGD ---------------------------------------------------------------
session = popart.TrainingSession(builder.getModelProto(), deviceInfo=popart.DeviceManager()
                                 .createCpuDevice(), dataFlow=dataFlow, loss=nlll,
                                 optimizer=popart.ConstSGD(0.001))
session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()
session.run(popart.PyStepIO({"input": data[0], labels: label_data[0]}, anchors))
print(f"ConstSGD: loss per batch {anchors[nlll]}")

# --- Guide 4.1: SGD with a learning rate updated every step, compared with PyTorch ---------
learningRate = [0.1 * 0.8 ** i for i in range(STEPS)]
session = popart.TrainingSession(proto, dataFlow, nlll, popart.SGD(learningRate[0]),
                                 popart.DeviceManager().createCpuDevice())
session.prepareDevice()
session.weightsFromHost()
anchors = session.initAnchorArrays()

torch_opt = torch.optim.SGD(model.parameters(), lr=learningRate[0])
losses, torch_losses = [], []
for step in range(STEPS):
    # Update learning rate parameter between training steps (no recompilation)
    stepLr = learningRate[step]
    session.updateOptimizerFromHost(popart.SGD(stepLr))
    session.run(popart.PyStepIO({"input": data[step], labels: label_data[step]}, anchors))
    losses += list(anchors[nlll])
    for g in torch_opt.param_groups:
        g["lr"] = stepLr
    for x, y in zip(data[step], label_data[step]):
        torch_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                 torch.from_numpy(y).long())
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())
print("popart  losses:", np.round(losses, 4))
print("pytorch losses:", np.round(torch_losses, 4))
assert np.allclose(losses, torch_losses, atol=1e-4), "popart and PyTorch training differ"

# --- Guide 4.4: save the trained model, load its weights into another session -------------
trained = os.path.join(tmp.name, "trained_model.onnx")
session.modelToHost(trained)
infer_flow = popart.DataFlow(1, {output_name: popart.AnchorReturnType("ALL")})
writable = popart.SessionOptions()
writable.constantWeights = False   # PopART freezes an inference session's weights by default
fresh = popart.InferenceSession(model_path, infer_flow, popart.DeviceManager().createCpuDevice(),
                                userOptions=writable)
fresh.prepareDevice()
fresh.resetHostWeights(trained)   # the exported (untrained) weights -> the trained ones
fresh.weightsFromHost()
out = fresh.initAnchorArrays()
fresh.run(popart.PyStepIO({"input": data[0, 0]}, out))
expected = model(torch.from_numpy(data[0, 0])).detach().numpy()
err = np.abs(out[output_name] - expected).max()
print(f"reloaded weights: max |popart - PyTorch| on the output = {err:.2e}")
assert np.allclose(out[output_name], expected, atol=1e-4)
print("training_nll_sgd: OK")
