"""Framework-independent driving of PopART (API reference 13.10.1): :class:`NetWriter`, the
base class a framework's writer derives from (one per framework, e.g. a torch writer that
exports its model to ONNX and runs it for comparison)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from .errors import popart_exception

__all__ = ["NetWriter"]


class NetWriter:
    """Base class, to be inherited once per framework.

    ``inNames``: the model's inputs, in order; ``outNames``: its outputs; ``optimizer``: an
    optimizer (SGD, ConstSGD, ...) or None for inference; ``dataFlow``: the data feeds and
    fetches (a DataFlow); ``inputShapeInfo``: the shape and data type of every input (an
    InputShapeInfo)."""

    def __init__(self, inNames: Sequence[str], outNames: Sequence[str], optimizer: Any,
                 dataFlow: Any, inputShapeInfo: Any) -> None:
        for what, names in (("inNames", inNames), ("outNames", outNames)):
            if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
                raise popart_exception(f"NetWriter: {what} must be a list of tensor names "
                                       f"(str), got {names!r}")
        self.inNames = list(inNames)
        self.outNames = list(outNames)
        self.optimizer = optimizer
        self.dataFlow = dataFlow
        self.inputShapeInfo = inputShapeInfo
        self.trainable = optimizer is not None

    def saveModel(self, filename: str) -> None:
        """Save the model as ONNX to ``filename``: the framework-specific export."""
        raise NotImplementedError(f"{type(self).__name__}.saveModel: each framework's "
                                  f"NetWriter implements exporting its model to ONNX")

    def train(self, inputsMap: Mapping[str, Any]) -> Any:
        """Perform batchesPerStep training steps (frameworks used to verify PopART)."""
        raise NotImplementedError(f"{type(self).__name__}.train: implemented by frameworks "
                                  f"used to verify PopART")

    def infer(self, inputsMap: Mapping[str, Any]) -> Any:
        """Perform batchesPerStep inference steps (frameworks used to verify PopART)."""
        raise NotImplementedError(f"{type(self).__name__}.infer: implemented by frameworks "
                                  f"used to verify PopART")

    def step(self, inputsMap: Mapping[str, Any]) -> Optional[Any]:
        """:meth:`train` when the writer has an optimizer, else :meth:`infer`."""
        return self.train(inputsMap) if self.trainable else self.infer(inputsMap)
