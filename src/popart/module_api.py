"""The smaller module-level names of PopART's bindings: version queries, default opsets,
``getTensorInfo``, sync-pattern strings, the step-IO interfaces, ``NumericsReport``,
``OutOfMemoryError``, the Builder's opset and context-manager classes under PopART's names,
and the error-translation test helpers (``_throw_*``)."""
from __future__ import annotations

import abc
import functools
import hashlib
import math
import os
from typing import Any

import numpy as np

from . import builder as _builder
from . import errors as _errors
from .dataflow import PyStepIO, PyStepIOCallback, PyWeightsIO
from .devices import SyncPattern
from .errors import ModelError, popart_exception
from .tensorinfo import TensorInfo

__all__ = [
    "versionString", "versionNumber", "packageHash", "defaultAiOnnxOpset",
    "defaultAiOnnxMlOpset", "defaultAiGraphcoreOpset", "getTensorInfo",
    "syncPatternFromString", "syncPatternToString", "IStepIO", "IWeightsIO", "NumericsReport",
    "OutOfMemoryError", "AiGraphcoreOpset1",
    "_throw_popart_error", "_throw_popart_internal_error", "_throw_popart_runtime_error",
    "_throw_poplibs_error", "_throw_poplar_error", "_throw_poplar_runtime_error",
    "_throw_application_runtime_error", "_throw_system_runtime_error",
    "_throw_recoverable_runtime_error", "_throw_unrecoverable_runtime_error",
    "_throw_unknown_runtime_error",
]

VERSION = "0.1.0"

defaultAiOnnxOpset: int = int(getattr(_builder, "DEFAULT_AI_ONNX_OPSET", 11))
defaultAiOnnxMlOpset: int = 1
defaultAiGraphcoreOpset: int = int(getattr(_builder, "DEFAULT_AI_GRAPHCORE_OPSET", 1))

# The Builder's opset classes under PopART's names (AiGraphcoreOpset1, AiOnnxOpset6, ...).
AiGraphcoreOpset1 = _builder.AiGraphcoreOpset1
for _name in dir(_builder):
    if _name.startswith("AiOnnxOpset") and _name[len("AiOnnxOpset"):].isdigit():
        globals()[_name] = getattr(_builder, _name)
        __all__.append(_name)
# The Builder's context managers (nameScope, attribute scopes, outlineAttributes).
for _name, _private in (("NameContextManager", "_NameScope"),
                        ("AttributeContextManager", "_AttributeContext"),
                        ("KeyValueContextManager", "_AttributeContext")):
    if hasattr(_builder, _private):
        globals()[_name] = getattr(_builder, _private)
        __all__.append(_name)
del _name


def versionString() -> str:
    """This package's version, "major.minor.point"."""
    return VERSION


def versionNumber() -> tuple[int, int, int]:
    """This package's version as (major, minor, point)."""
    major, minor, point = (int(p) for p in VERSION.split(".")[:3])
    return major, minor, point


@functools.lru_cache(maxsize=1)
def packageHash() -> str:
    """A 10-hex-digit hash of this package's Python sources (what PopART gives as the
    commit its library was built from): equal for equal sources."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha1()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:10]


def getTensorInfo(array: Any) -> TensorInfo:
    """The TensorInfo (data type and shape) of a NumPy array (or anything np.asarray takes)."""
    return TensorInfo(np.asarray(array))


_SYNC_PATTERN_NAMES = {SyncPattern.Full: "full", SyncPattern.SinglePipeline: "singlePipeline",
                       SyncPattern.ReplicaAndLadder: "replicaAndLadder"}


def syncPatternFromString(str: str) -> Any:  # noqa: A002  (PopART's argument name)
    """"full", "singlePipeline" or "replicaAndLadder" as a SyncPattern."""
    for pattern, name in _SYNC_PATTERN_NAMES.items():
        if str == name:
            return pattern
    raise popart_exception(f"Unknown syncPattern setting: {str!r} (expected one of "
                           f"{', '.join(_SYNC_PATTERN_NAMES.values())})")


def syncPatternToString(pattern: Any) -> str:
    """A SyncPattern as "full", "singlePipeline" or "replicaAndLadder"."""
    try:
        return _SYNC_PATTERN_NAMES[SyncPattern(pattern)]
    except (ValueError, KeyError, TypeError):
        raise popart_exception(f"Unknown syncPattern setting: {pattern!r} (expected a "
                               f"SyncPattern: {', '.join(m.name for m in SyncPattern)})") from None


class IStepIO(abc.ABC):
    """The interface of a session's step inputs / outputs (PyStepIO, PyStepIOCallback)."""


class IWeightsIO(abc.ABC):
    """The interface of host weight buffers (PyWeightsIO)."""


IStepIO.register(PyStepIO)
IStepIO.register(PyStepIOCallback)
IWeightsIO.register(PyWeightsIO)


class OutOfMemoryError:
    """PopART's out-of-memory status object: ``isSuccessful()`` is True when no device
    memory ran out (the only outcome on XLA, where exhaustion raises OutOfMemoryException)."""

    def __init__(self) -> None:
        self._message = ""

    def isSuccessful(self) -> bool:
        return not self._message

    def getSummaryReport(self) -> str:
        return self._message

    def getProfilePath(self) -> str:
        return ""

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return "popart.OutOfMemoryError: " + self._message


class NumericsReport:
    """Compare the weight updates of two training runs: models A (``A0`` before, ``A1``
    after) and B (``B0``, ``B1``), four ONNX files with the same initializers. For each
    floating-point weight, with dA = A1 - A0 and dB = B1 - B0, the relative error is
    |dA - dB|^2 / (|dA||dB| + 1e-8)."""

    def __init__(self, A0: str, A1: str, B0: str, B1: str) -> None:
        from ._ir.onnx_import import load_model, tensor_to_numpy
        paths = [A0, A1, B0, B1]
        for p in paths:
            if not isinstance(p, (str, os.PathLike)) or not os.path.isfile(p):
                raise ModelError(f"NumericsReport: expected the path of an ONNX model file, got "
                                 f"{p!r}, which is not a regular file")
        models = [load_model(p) for p in paths]
        inits = [list(m.graph.initializer) for m, _ in models]
        if len({len(i) for i in inits}) != 1:
            raise ModelError(f"NumericsReport: the models have different numbers of "
                             f"initializers: {[len(i) for i in inits]} in {paths}")
        self._reports: dict[str, str] = {}
        self._relerrs: dict[str, float] = {}
        for index, tensors in enumerate(zip(*inits)):
            names = [t.name for t in tensors]
            if len(set(names)) != 1:
                raise ModelError(f"NumericsReport: initializer {index} is named differently in "
                                 f"the models: {names}")
            values = [tensor_to_numpy(t, base) for t, (_, base) in zip(tensors, models)]
            infos = [(v.dtype, v.shape) for v in values]
            if len(set(infos)) != 1:
                raise ModelError(f"NumericsReport: initializer '{names[0]}' has different "
                                 f"types / shapes in the models: {infos}")
            dtype = values[0].dtype
            if not (dtype.kind in "fc" or dtype.name.startswith(("bfloat16", "float8",
                                                                  "float4"))):
                continue   # integer / bool weights: nothing to compare (as PopART)
            a0, a1, b0, b1 = (v.astype(np.float64) for v in values)
            da, db = a1 - a0, b1 - b0
            ss_da, ss_db, ss_dab = float(np.sum(da * da)), float(np.sum(db * db)), \
                float(np.sum((da - db) ** 2))
            rel = ss_dab / (math.sqrt(ss_da * ss_db) + 1e-8)
            self._relerrs[names[0]] = rel
            self._reports[names[0]] = (
                f"|dA - dB|^2 / (|dA||dB| + 1e-8)  = {rel:.16g}  and  |dA||dB| = "
                f"{math.sqrt(ss_da * ss_db):.16g}  and  |dA| = {math.sqrt(ss_da):.16g}  and  "
                f"|dB| = {math.sqrt(ss_db):.16g}")

    def report(self, id: str) -> str:  # noqa: A002
        """The report of weight ``id``."""
        if id not in self._reports:
            raise popart_exception(f"No report available for {id!r} (reports exist for "
                                   f"{sorted(self._reports)})")
        return self._reports[id]

    def fullReport(self) -> str:
        """Every weight's report, by weight name."""
        return "".join(f"\n{k} : \n{v}" for k, v in sorted(self._reports.items()))

    def getRelativeErrors(self) -> dict[str, float]:
        """Weight name -> relative error of its update."""
        return dict(self._relerrs)


# --- error-translation test helpers (PopART binds these for its own tests) -----------------

def _raiser(exc: type, *extra: Any) -> Any:
    def throw(msg: str) -> None:
        raise exc(msg, *extra)
    throw.__doc__ = f"Raise {exc.__name__}(msg)."
    return throw


_throw_popart_error = _raiser(_errors.popart_exception)
_throw_popart_internal_error = _raiser(_errors.popart_internal_exception)
_throw_popart_runtime_error = _raiser(_errors.popart_runtime_error)
_throw_poplibs_error = _raiser(_errors.poplibs_exception)
_throw_poplar_error = _raiser(_errors.poplar_exception)
_throw_poplar_runtime_error = _raiser(_errors.poplar_runtime_error)
_throw_application_runtime_error = _raiser(_errors.poplar_application_runtime_error)
_throw_system_runtime_error = _raiser(_errors.poplar_system_runtime_error)
_throw_recoverable_runtime_error = _raiser(_errors.poplar_recoverable_runtime_error,
                                           _errors.RecoveryAction.IPU_RESET)
_throw_unrecoverable_runtime_error = _raiser(_errors.poplar_unrecoverable_runtime_error)
_throw_unknown_runtime_error = _raiser(_errors.poplar_unknown_runtime_error)
