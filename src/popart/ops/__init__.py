"""Op lowerings, one module per family; importing this package registers them all."""
from . import registry  # noqa: F401
from . import elementwise  # noqa: F401

import importlib as _importlib

# Families written in parallel; each registers its ops on import.
for _name in ("math", "reduce", "shape", "nn", "rnn", "image", "control", "random",
              "graphcore", "losses", "collectives", "sequence", "misc", "popxl_ops",
              "onnx_losses", "detection", "quantized", "text"):
    try:
        _importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__name__}.{_name}":
            raise
