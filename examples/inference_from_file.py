"""User guide section 2 (Importing graphs): export a PyTorch model to ONNX and run it in an
InferenceSession.

The guide uses ``torchvision.models.alexnet``; torchvision is not needed here: ``AlexNetLike``
has AlexNet's layer structure with fewer channels. The outputs are checked against
onnxruntime. Set POPART_EXAMPLE_SMALL=1 for fewer batches per step.
"""
import os
import tempfile
import warnings

import numpy as np
import torch
import torch.onnx

import popart

SMALL = os.environ.get("POPART_EXAMPLE_SMALL") == "1"
BATCHES_PER_STEP = 2 if SMALL else 10   # the guide uses 100 (with 64x more channels)


class AlexNetLike(torch.nn.Module):
    """AlexNet's layers (5 convolutions, 3 max-pools, 3 linear layers), narrower."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(16, 48, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(48, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(32 * 6 * 6, 256), nn.ReLU(),
            nn.Dropout(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


torch.manual_seed(0)
input_ = torch.FloatTensor(torch.randn(4, 3, 224, 224))
model = AlexNetLike().eval()

output_name = "output"
tmp = tempfile.TemporaryDirectory()  # removed at exit
model_path = os.path.join(tmp.name, "alexnet.onnx")
warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
torch.onnx.export(model, input_, model_path, input_names=["input"], output_names=[output_name],
                  opset_version=11, dynamo=False)

# Create a runtime environment
anchors = {output_name: popart.AnchorReturnType("All")}
dataFlow = popart.DataFlow(BATCHES_PER_STEP, anchors)
device = popart.DeviceManager().createCpuDevice()

session = popart.InferenceSession(model_path, dataFlow, device)
session.prepareDevice()

# One run() executes BATCHES_PER_STEP batches: inputs are [batchesPerStep, 4, 3, 224, 224].
anchors = session.initAnchorArrays()
data = np.random.default_rng(0).standard_normal(
    (BATCHES_PER_STEP, 4, 3, 224, 224)).astype(np.float32)
session.run(popart.PyStepIO({"input": data}, anchors))
out = anchors[output_name]
print(f"{output_name}: shape {out.shape} (batchesPerStep, batch, classes)")

# The same model in onnxruntime, batch by batch.
import onnxruntime as ort  # noqa: E402

ref = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
expected = np.stack([ref.run(None, {"input": d})[0] for d in data])
err = np.abs(out - expected).max()
print(f"max |popart - onnxruntime| = {err:.2e}")
assert out.shape == (BATCHES_PER_STEP, 4, 1000) and err < 1e-3, err
print("inference_from_file: OK")
