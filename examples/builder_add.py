"""User guide section 3 (Building graphs) and the talk's inference example.

Builds ``o = i1 + i2`` with the Builder, runs it in an InferenceSession with an "ALL" anchor,
then runs the talk's ``add.onnx`` (inputs x, y, output sum) from a file with a "FINAL" anchor.
"""
import os
import tempfile

import numpy as np
import onnx

import popart

builder = popart.Builder()

# Build a simple graph
i1 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 32, 32]))
i2 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1, 2, 32, 32]))

o = builder.aiOnnx.add([i1, i2])

builder.addOutputTensor(o)

# Get the ONNX protobuf from the builder to pass to the Session
proto = builder.getModelProto()

# Create a runtime environment
anchors = {o: popart.AnchorReturnType("ALL")}
dataFlow = popart.DataFlow(1, anchors)
device = popart.DeviceManager().createCpuDevice()

# Create the session from the graph, data feed and device information
session = popart.InferenceSession(proto, dataFlow, device)
session.prepareDevice()

# Create buffers to receive results from the execution
anchors = session.initAnchorArrays()
data_a = np.random.rand(1, 2, 32, 32).astype(np.float32)
data_b = np.random.rand(1, 2, 32, 32).astype(np.float32)
stepio = popart.PyStepIO({i1: data_a, i2: data_b}, anchors)
session.run(stepio)
assert np.allclose(anchors[o], data_a + data_b)
print(f"{o}: shape {anchors[o].shape}, max |error| {np.abs(anchors[o] - (data_a + data_b)).max()}")

# The talk's inference example: a model file "add.onnx" (written here with onnx.helper) with
# inputs "x", "y" and output "sum", batchesPerStep=1 and a FINAL anchor, on a device acquired
# from the DeviceManager.
X = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 4, 5])
Y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 4, 5])
S = onnx.helper.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, [3, 4, 5])
graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "y"], ["sum"])], "add",
                               [X, Y], [S])
model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 11)])
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "add.onnx")
    onnx.save(model, path)
    session = popart.InferenceSession(
        fnModel=path,
        dataFlow=popart.DataFlow(batchesPerStep=1,
                                 anchorTensors={"sum": popart.AnchorReturnType("FINAL")}),
        deviceInfo=popart.DeviceManager().acquireAvailableDevice(numIpus=1))
    # Compile graph - where the magic happens
    session.prepareDevice()
    # Create buffers to receive the output data from the execution of the model
    anchors = session.initAnchorArrays()
    x = np.random.rand(3, 4, 5).astype(np.float32)
    y = np.random.rand(3, 4, 5).astype(np.float32)
    # Run the inference session. The PyStepIO defines the inputs and outputs for the run
    session.run(popart.PyStepIO({"x": x, "y": y}, anchors))
    assert np.allclose(anchors["sum"], x + y)
    print(f"sum from add.onnx: shape {anchors['sum'].shape}, "
          f"first values {anchors['sum'].ravel()[:3]}")
print("builder_add: OK")
