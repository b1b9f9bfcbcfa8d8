"""PopART's error hierarchy (user guide 4.7).

Every user mistake raises a subclass of :class:`popart_exception` whose message names the
tensor, op, option or file, what was expected and what was given; Poplar's errors
(:class:`poplar_exception` and its runtime errors, :class:`poplibs_exception`) are apart, as
PopART binds them.
"""
from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Optional

__all__ = [
    "popart_exception", "popart_internal_exception", "popart_runtime_error", "poplibs_exception",
    "poplar_exception", "poplar_runtime_error", "poplar_application_runtime_error",
    "poplar_system_runtime_error", "RecoveryAction", "poplar_recoverable_runtime_error",
    "poplar_unrecoverable_runtime_error", "poplar_unknown_runtime_error", "poplar_recoverable_error",
    "poplar_unrecoverable_error", "unknown_runtime_error", "OutOfMemoryException",
    "UnsupportedOperatorError", "StepIOError", "ModelError", "OptionError", "OptimizerError",
    "DataFlowError", "BuilderError", "IrError", "WeightsIOError", "ArgumentError",
    "OptionTypeError",
]


class popart_exception(RuntimeError):
    """Base of all errors raised by PopART."""


def noted(exc: BaseException, note: str) -> BaseException:
    """``exc`` with the package's context as an exception note: PopART's own text stays
    ``args[0]`` (what programs match on), tracebacks show the note."""
    exc.add_note(note)
    return exc


class popart_internal_exception(popart_exception):
    """A bug in the runtime rather than in the user's program."""


class popart_runtime_error(popart_exception):
    """An error found while running a compiled program."""


# PopART registers Poplar's and PopLibs' errors apart from its own (popart.cpp:3646-3669,
# ``py::exception`` with the default base ``Exception``): ``except popart_exception`` does
# not catch them. The package raises them only where PopART passes Poplar's error on (a
# device id that does not exist, an Abort op, a device the program was not built for).
class poplibs_exception(Exception):
    """PopLibs' errors (``poputil::poplibs_error``); not a popart_exception."""


class poplar_exception(Exception):
    """Poplar's errors (``poplar::poplar_error``), base of the runtime errors; not a
    popart_exception."""


class poplar_runtime_error(poplar_exception):
    pass


class poplar_application_runtime_error(poplar_runtime_error):
    pass


class poplar_system_runtime_error(poplar_runtime_error):
    pass


class RecoveryAction(enum.Enum):
    IPU_RESET = 0
    PARTITION_RESET = 1
    POWER_CYCLE = 2
    LINK_RESET = 3     # PopART's binding also lists these two (poplar::RecoveryAction)
    FULL_RESET = 4


class poplar_recoverable_runtime_error(poplar_system_runtime_error):
    def __init__(self, msg: str = "", recoveryAction: RecoveryAction = RecoveryAction.IPU_RESET):
        super().__init__(msg)
        self.recoveryAction = recoveryAction


class poplar_unrecoverable_runtime_error(poplar_system_runtime_error):
    pass


class poplar_unknown_runtime_error(poplar_system_runtime_error):   # PopART's binding's base
    pass


# Aliases under the spellings used in the user guide's prose.
poplar_recoverable_error = poplar_recoverable_runtime_error
poplar_unrecoverable_error = poplar_unrecoverable_runtime_error
unknown_runtime_error = poplar_unknown_runtime_error


class OutOfMemoryException(popart_exception):
    """Raised when compilation or execution runs out of device memory."""

    def __init__(self, e: object = "") -> None:
        super().__init__(str(e))
        self._summary = str(e)
        self.error = e   # PopART's: the exception (here: or message) it wraps

    def getSummaryReport(self) -> str:
        return self._summary

    def getProfilePath(self) -> str:
        return ""


# Finer-grained user errors: all are popart_exception, so `except popart.popart_exception` works.
class UnsupportedOperatorError(popart_exception):
    """An operator, opset version, dtype or attribute value the runtime does not implement."""


class StepIOError(popart_exception):
    """A StepIO input or output buffer that does not fit the session (shape, dtype, or an
    array that is not C-contiguous)."""


class ModelError(popart_exception):
    """A model file or proto that cannot be read or is invalid."""


class OptionError(popart_exception):
    """A SessionOptions value or combination that cannot be honoured."""


class OptimizerError(popart_exception):
    """An optimizer that is invalid or incompatible with the session."""


class DataFlowError(popart_exception):
    """An invalid DataFlow or AnchorReturnType (batches per step, return periods)."""


class BuilderError(popart_exception):
    """An invalid Builder call: an attribute set twice on a node, a setting out of range, a
    node that cannot be found, an untyped input of the main graph."""


class IrError(popart_exception):
    """A program PopART rejects when it builds its IR, before compiling: no anchors in
    inference, a graph pruned empty, inconsistent virtual graph or pipeline stage
    annotations, reserved tensor names, inputs without a known shape, an unknown loss."""


class WeightsIOError(popart_exception):
    """A PyWeightsIO buffer that readWeights / writeWeights cannot use: an unknown tensor, a
    different size, an array that is not C-contiguous."""


class ArgumentError(popart_exception, TypeError):
    """An argument of the wrong type or out of range for its parameter (where PopART's
    bindings raise TypeError); catchable as popart_exception or TypeError."""


class OptionTypeError(OptionError, ArgumentError):
    """A SessionOptions value of a type the option's pybind11 setter cannot take."""


def incompatible_arguments(fn: str, signatures: "list[str]", args: tuple,
                           constructor: bool = False, kwargs: Optional[Mapping] = None,
                           cls: type = ArgumentError) -> ArgumentError:
    """pybind11's TypeError for a call no overload of a PopART binding accepts: ``fn`` (the
    method name, ``__init__`` for a constructor), each overload's signature as pybind11
    prints it, the arguments given (a constructor's ``self`` left out) and the keyword
    arguments (``cpp_function::dispatcher``: "; kwargs: name=value, ...")."""
    kind = "constructor" if constructor else "function"
    overloads = "\n".join(f"    {i}. {sig}" for i, sig in enumerate(signatures, 1))
    invoked = ", ".join(repr(a) for a in args)
    if kwargs:
        invoked += ("; " if args else "") + "kwargs: " + ", ".join(
            f"{k}={v!r}" for k, v in kwargs.items())
    return cls(f"{fn}(): incompatible {kind} arguments. The following argument "
               f"types are supported:\n{overloads}\n\nInvoked with: {invoked}")


# What pybind11's casters accept (for ``check_arguments``): an int (``__index__``, bools
# too), a float (any real number), a sequence (not str / bytes / a dict) of such.
def integral(v: Any) -> bool:
    return isinstance(v, numbers.Integral)


def real(v: Any) -> bool:
    return isinstance(v, numbers.Real)


def sequence_of(v: Any, ok: Callable[[Any], bool]) -> bool:
    return (not isinstance(v, (str, bytes, Mapping)) and hasattr(v, "__len__")
            and hasattr(v, "__getitem__") and all(ok(x) for x in v))


def check_arguments(ok: bool, fn: str, signatures: "list[str]", args: tuple,
                    constructor: bool = False) -> None:
    """Raise pybind11's ``incompatible_arguments`` TypeError unless ``ok`` (the arguments
    fit one of the binding's ``signatures``)."""
    if not ok:
        raise incompatible_arguments(fn, signatures, args, constructor)
