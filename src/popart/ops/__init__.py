"""Op lowerings, one module per family; importing this package registers them all."""
from . import registry  # noqa: F401
from . import (attention, collectives, control, deform, detection, elementwise, graphcore,  # noqa: F401
               graphcore_internal, image, losses, math, matmul_cpu, misc, nn, onnx_losses, onnx_ml,
               popxl_ops, preview_training, quantized, random, reduce, rnn, sequence, shape, text,
               transformer)
