"""``popart.Patterns`` and ``popart.PatternsLevel``: which of PopART's graph patterns are on.

The API is PopART's (``popart_core.Patterns``): the three constructors, the bound properties
(``PreUniRepl``, ``PostNRepl``, ``SoftMaxGradDirect``, ``NlllWithSoftMaxGradDirect``,
``OpToIdentity``, ``SubtractArg1GradOp``, ``MulArgGradOp``, ``MatMulOp``, ``MatMulLhsGradOp``,
``MatMulRhsGradOp``, ``InPlace``), ``isPatternEnabled``, ``enablePattern``,
``enableRuntimeAsserts`` and ``__repr__``; the static ``getAllPreAliasPatternNames`` and
``isMandatory`` of ``popart._internal.ir.Patterns``; and the accessors of the C++ class
(``enableInPlace``, ``isInPlaceEnabled``, ``getRuntimeAssertsOn``, ``enableSplitGather``, ...).

Sessions call :func:`for_session` on their ``patterns`` argument.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from .errors import incompatible_arguments, popart_exception
from .options import _Enum

__all__ = ["Patterns", "PatternsLevel"]

# PopART's C++ enum values (NoPatterns = 0 ... All = 3), members listed in the order of the
# Python binding.
PatternsLevel = _Enum("PatternsLevel", [("All", 3), ("Default", 2), ("Minimal", 1),
                                        ("NoPatterns", 0)], module=__name__)
PatternsLevel.__doc__ = """The pattern set to run.

NoPatterns: no pattern. Minimal: the mandatory patterns. Default: the default set (every
mandatory pattern and a few more). All: every pattern."""

# Every PreAliasPattern that PopART registers: name -> (enabled by default, mandatory).
# Read from the `PatternCreator<...>` registrations in willow/src/patterns/*.cpp of
# graphcore/popart (a creator's flags default to enabled = true, mandatory = false:
# willow/include/popart/patterns/patterns.hpp). The order is PopART's registry order, a
# std::map keyed by the pattern's C++ type (strcmp of the mangled type names); it is the
# order of `repr(Patterns)` and of the mandatory check. The C++ class is in each comment.
PATTERNS: dict[str, tuple[bool, bool]] = {
    "PreUniRepl": (True, False),                            # PreUniRepl
    "LSTMOp": (False, False),                               # LSTMPattern
    "Slice2SliceSubsample": (False, False),                 # SlicePattern
    "CoshOp": (True, True),                                 # CoshOpPattern
    "MatMulOp": (True, True),                               # MatMulPattern
    "PadSum": (True, False),                                # PadSumPattern
    "ZerosLikeOpPattern": (True, True),                     # LikeOpsPattern<ZerosLikeOp>
    "RandomNormalLikeOpPattern": (True, True),              # LikeOpsPattern<RandomNormalLikeOp>
    "RandomUniformLikeOpPattern": (True, True),             # LikeOpsPattern<RandomUniformLikeOp>
    "SplitOp": (True, False),                               # SplitOpPattern
    "SumToAdd": (True, False),                              # SumToAddPattern
    "CosGradOp": (True, True),                              # CosGradOpPattern
    "ExpGradOp": (True, True),                              # ExpGradOpPattern
    "LogGradOp": (True, True),                              # LogGradOpPattern
    "ExpandCast": (True, False),                            # ExpandCastPattern
    "ScanToLoop": (True, True),                             # ScanToLoopPattern
    "SoftmaxGradDirect": (True, False),                     # SoftmaxGradDirect
    "SqrtGradOp": (True, True),                             # SqrtGradOpPattern
    "TiedGather": (False, False),                           # TiedGatherPattern
    "Expm1GradOp": (True, True),                            # Expm1GradOpPattern
    "Log1pGradOp": (True, True),                            # Log1pGradOpPattern
    "LoopScanOut": (True, True),                            # LoopScanOutPattern
    "SplitGather": (False, False),                          # SplitGatherPattern
    "ConvDataGrad": (True, True),                           # ConvDataGradPattern
    "MulArgGradOp": (True, True),                           # MulArgGradOpPattern
    "OpToIdentity": (True, False),                          # OpToIdentityPattern
    "ConvTranspose": (True, True),                          # ConvTransposePattern
    "DivArg0GradOp": (True, True),                          # DivArg0GradOpPattern
    "DivArg1GradOp": (True, True),                          # DivArg1GradOpPattern
    "MatMulLhsGradOp": (True, True),                        # MatMulLhsGradPattern
    "MatMulRhsGradOp": (True, True),                        # MatMulRhsGradPattern
    "PowArg0GradOp": (True, True),                          # PowArg0GradOpPattern
    "PowArg1GradOp": (True, True),                          # PowArg1GradOpPattern
    "FmodArg0GradOp": (True, True),                         # FmodArg0GradOpPattern
    "InitAccumulate": (True, False),                        # InitAccumulatePattern
    "Atan2Arg0GradOp": (True, True),                        # Atan2Arg0GradOpPattern
    "Atan2Arg1GradOp": (True, True),                        # Atan2Arg1GradOpPattern
    "PackedDataBlock": (True, False),                       # PackedDataBlockPattern
    "NegativeOneScale": (True, False),                      # NegativeOneScalePattern
    "ReciprocalGradOp": (True, True),                       # ReciprocalGradOpPattern
    "UpsampleToResize": (True, False),                      # UpsampleToResizePattern
    "AbsGradOp": (True, True),                 # ElementWiseGradOpPattern<AbsGradOp, SignOp>
    "SinGradOp": (True, True),                 # ElementWiseGradOpPattern<SinGradOp, CosOp>
    "NlllWithSoftmaxGradDirect": (True, False),             # NlllWithSoftmaxGradDirect
    "SubtractArg1GradOp": (True, True),                     # SubtractArg1GradOpPattern
    "AllReduceToIdentity": (True, True),                    # AllReduceToIdentityPattern
    "DecomposeBinaryConstScalar": (True, False),            # DecomposeBinaryConstScalar
    "SplitGradOpToConcat": (True, False),                   # SplitGradOpToConcatPattern
    "LambSerialisedWeight": (True, False),                  # LambSerialisedWeightPattern
    "TiedGatherAccumulate": (False, False),                 # TiedGatherAccumulatePattern
    "ConvFlipWeightsGradOp": (True, True),                  # ConvFlipWeightsGradOpPattern
    "RemoveUnnecessaryLossGradCast": (True, False),         # RemoveUnnecessaryLossGradCast
    "ConvFlipWeightsDoubleFlip": (True, False),             # ConvFlipWeightsDoubleFlipPattern
    "TransposeToIdentityOrReshapePattern": (True, False),   # TransposeToIdentityOrReshapePattern
    "PostNRepl": (True, False),                             # PostNRepl
}

# The order PopART runs patterns in (Patterns::getPreAliasList, willow/src/patterns/
# patterns.cpp): descending priority; patterns without one come after, sorted by name.
_PRIORITY: dict[str, int] = {
    "Slice2SliceSubsample": 55, "ExpandCast": 54, "ConvFlipWeightsDoubleFlip": 53,
    "ConvFlipWeightsGradOp": 52, "Atan2Arg0GradOp": 51, "Atan2Arg1GradOp": 50,
    "DecomposeBinaryConstScalar": 47, "Log1pGradOp": 45, "Expm1GradOp": 44,
    "ZerosLikeOpPattern": 43, "RandomUniformLikeOpPattern": 42, "RandomNormalLikeOpPattern": 41,
    "FmodArg0GradOp": 39, "UpsampleToResize": 38, "InitAccumulate": 37, "PreUniRepl": 36,
    "PostNRepl": 35, "SoftmaxGradDirect": 34, "NlllWithSoftmaxGradDirect": 33,
    "OpToIdentity": 31, "SubtractArg1GradOp": 30, "MulArgGradOp": 29, "ReciprocalGradOp": 28,
    "DivArg0GradOp": 27, "DivArg1GradOp": 26, "SinGradOp": 25, "CosGradOp": 24,
    "SqrtGradOp": 22, "ExpGradOp": 21, "LogGradOp": 20, "CoshOp": 19, "NegativeOneScale": 16,
    "PadSum": 15, "AbsGradOp": 14, "SplitGather": 13, "ConvDataGrad": 12, "SumToAdd": 11,
    "SplitGradOpToConcat": 9, "SplitOp": 8, "PowArg0GradOp": 7, "PowArg1GradOp": 6,
    "MatMulOp": 4, "MatMulLhsGradOp": 3, "MatMulRhsGradOp": 2, "LSTMOp": 0,
}

# The two names PopART accepts besides its PreAliasPatterns (not in `PATTERNS`).
INPLACE = "InPlace"
UPDATE_INPLACE_PRIORITIES_FOR_IPU = "UpdateInplacePrioritiesForIpu"

# The patterns that change numbers on this XLA runtime (the session applies them itself when
# they are on); every other pattern names a graph rewrite that XLA makes on its own, or that
# has nothing to act on here, and changes no number.
NUMERIC_PATTERNS = frozenset({"SoftmaxGradDirect", "NlllWithSoftmaxGradDirect"})

# PopART's property names whose spelling differs from the registered pattern name.
_PROPERTY_ALIASES = {"SoftMaxGradDirect": "SoftmaxGradDirect",
                     "NlllWithSoftMaxGradDirect": "NlllWithSoftmaxGradDirect"}

_logger: Any = None


def _log_info(msg: str, *args: Any) -> None:
    global _logger
    if _logger is None:
        from .logging import getLogger
        _logger = getLogger("pattern")
    _logger.info(msg, *args)


def _cpp_bool(v: bool) -> str:
    return "true" if v else "false"


def _incompatible(fn: str, sig: str, args: tuple) -> TypeError:
    return incompatible_arguments(fn, [sig], args)


def _as_bool(fn: str, sig: str, v: Any, *args: Any) -> bool:
    if isinstance(v, (str, bytes)):
        raise _incompatible(fn, sig, args + (v,))
    return bool(v)


def _as_name(fn: str, sig: str, name: Any, *args: Any) -> str:
    if not isinstance(name, str):
        raise _incompatible(fn, sig, (name,) + args)
    return name


def _known(name: str) -> str:
    """``name`` if it is a registered pattern; else PopART's error."""
    if name not in PATTERNS:
        raise popart_exception(f"Unknown pattern {name}.")
    return name


_INIT_FORMS = ("    1. popart.Patterns()\n"
               "    2. popart.Patterns(level: popart.PatternsLevel)\n"
               "    3. popart.Patterns(patterns: List[str])")


class Patterns:
    """Which of PopART's graph patterns (graph rewrites) a session runs: ``Patterns()`` (the
    default set), ``Patterns(level)`` or ``Patterns(names)``. Mandatory patterns stay on unless
    ``enableRuntimeAsserts(False)``; on XLA only :data:`NUMERIC_PATTERNS` change numbers, the
    others are recorded and reported. See docs/gradients.md#patterns.
    """

    __slots__ = ("_settings", "_inplace", "_update_inplace_priorities", "_runtime_asserts")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Patterns()``, ``Patterns(level: PatternsLevel)`` or ``Patterns(patterns:
        List[str])``."""
        self._settings: dict[str, bool] = {}
        self._inplace = False
        self._update_inplace_priorities = False
        self._runtime_asserts = True
        if len(args) + len(kwargs) > 1 or set(kwargs) - {"level", "patterns"}:
            raise self._bad_init(args, kwargs)
        if not args and not kwargs:
            self._init_level(PatternsLevel.Default)
            return
        value = args[0] if args else next(iter(kwargs.values()))
        want = next(iter(kwargs)) if kwargs else None
        if isinstance(value, PatternsLevel) and want in (None, "level"):
            self._init_level(value)
        elif (want in (None, "patterns") and isinstance(value, Sequence)
              and not isinstance(value, (str, bytes))
              and all(isinstance(p, str) for p in value)):
            self._init_names(list(value))
        else:
            raise self._bad_init(args, kwargs)

    @staticmethod
    def _bad_init(args: tuple, kwargs: dict) -> TypeError:
        invoked = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        return TypeError("__init__(): incompatible constructor arguments. The following "
                         f"argument types are supported:\n{_INIT_FORMS}\n\n"
                         f"Invoked with: {invoked}")

    def _init_level(self, level: Any) -> None:
        if level == PatternsLevel.Default:
            self._settings = {n: d for n, (d, _) in PATTERNS.items()}
            self._inplace = True
        elif level == PatternsLevel.All:
            self._settings = {n: True for n in PATTERNS}
            self._inplace = True
        elif level == PatternsLevel.Minimal:
            self._settings = {n: m for n, (_, m) in PATTERNS.items()}
            self._inplace = False
        # NoPatterns: no setting at all

    def _init_names(self, names: list[str]) -> None:
        enabled = set()
        for p in names:
            if p == INPLACE:
                self._inplace = True
            elif p == UPDATE_INPLACE_PRIORITIES_FOR_IPU:
                self._update_inplace_priorities = True
            elif p in PATTERNS:
                enabled.add(p)
            elif p == "Inplace":
                raise popart_exception(f"Unknown pattern {p}, did you mean InPlace?")
            else:
                raise popart_exception(f"Unknown pattern {p}")
        self._settings = {n: True for n in PATTERNS if n in enabled}  # registry order

    @staticmethod
    def create(patterns: Sequence[str]) -> "Patterns":
        """``Patterns(patterns)``."""
        return Patterns(patterns=list(patterns))

    # --- by name ---------------------------------------------------------------------------
    def isPatternEnabled(self, name: str, /) -> bool:
        """Whether the pattern registered as ``name`` is on (``InPlace`` is not a registered
        pattern: read it with the ``InPlace`` property)."""
        name = _as_name("isPatternEnabled",
                        "(self: popart.Patterns, arg0: str) -> bool", name)
        return self._settings.get(_known(name), False)

    def enablePattern(self, name: str, enabled: bool, /) -> "Patterns":
        """Turn the pattern ``name`` (or ``InPlace`` / ``UpdateInplacePrioritiesForIpu``) on
        or off; a mandatory pattern cannot be turned off. Returns ``self``."""
        sig = "(self: popart.Patterns, arg0: str, arg1: bool) -> popart.Patterns"
        name = _as_name("enablePattern", sig, name, enabled)
        enabled = _as_bool("enablePattern", sig, enabled, name)
        if name == INPLACE:
            return self.enableInPlace(enabled)
        if name == UPDATE_INPLACE_PRIORITIES_FOR_IPU:
            return self.enableUpdateInplacePrioritiesForIpu(enabled)
        return self._enable(_known(name), enabled)

    def _enable(self, name: str, enabled: bool) -> "Patterns":
        _log_info("Pattern {} {}", name, _cpp_bool(enabled))
        if not enabled and PATTERNS[name][1]:
            raise popart_exception(f"Pattern '{name}' is mandatory and cannot be disabled")
        if name not in self._settings:  # keep registry order
            settings = dict(self._settings)
            settings[name] = enabled
            self._settings = {n: settings[n] for n in PATTERNS if n in settings}
        else:
            self._settings[name] = enabled
        return self

    # --- InPlace, UpdateInplacePrioritiesForIpu, runtime asserts ---------------------------
    def enableInPlace(self, v: bool, /) -> "Patterns":
        self._inplace = bool(v)
        return self

    def isInPlaceEnabled(self) -> bool:
        return self._inplace

    getInplaceEnabled = isInPlaceEnabled

    InPlace = property(isInPlaceEnabled, lambda self, v: self.enableInPlace(
        _as_bool("InPlace", "(self: popart.Patterns, arg0: bool) -> None", v)),
        doc="Whether the InPlace pattern is on.")

    def enableUpdateInplacePrioritiesForIpu(self, v: bool, /) -> "Patterns":
        self._update_inplace_priorities = bool(v)
        return self

    def isUpdateInplacePrioritiesForIpuEnabled(self) -> bool:
        return self._update_inplace_priorities

    getUpdateInplacePrioritiesForIpuEnabled = isUpdateInplacePrioritiesForIpuEnabled

    UpdateInplacePrioritiesForIpu = property(
        isUpdateInplacePrioritiesForIpuEnabled,
        lambda self, v: self.enableUpdateInplacePrioritiesForIpu(bool(v)),
        doc="Whether the UpdateInplacePrioritiesForIpu pattern is on.")

    def enableRuntimeAsserts(self, b: bool, /) -> "Patterns":
        """If on (the default), a session checks that every mandatory pattern is enabled.
        Returns ``self``."""
        self._runtime_asserts = _as_bool(
            "enableRuntimeAsserts",
            "(self: popart.Patterns, arg0: bool) -> popart.Patterns", b)
        return self

    def getRuntimeAssertsOn(self) -> bool:
        return self._runtime_asserts

    # --- the registry ----------------------------------------------------------------------
    @staticmethod
    def getAllPreAliasPatternNames() -> list[str]:
        """Every registered pattern, in the order PopART runs them."""
        return Patterns(PatternsLevel.All).getPreAliasList()

    @staticmethod
    def isMandatory(name: str, /) -> bool:
        """Whether the pattern ``name`` is mandatory (``False`` for an unknown name)."""
        return PATTERNS.get(name, (False, False))[1]

    def getSettings(self) -> dict[str, bool]:
        """{pattern name: enabled} for every pattern this object has a setting for."""
        return dict(self._settings)

    def getPreAliasList(self) -> list[str]:
        """The names of the enabled patterns in the order PopART runs them; with runtime
        asserts on, first checks that every mandatory pattern is enabled."""
        if self._runtime_asserts:
            self._ensureAllMandatoryPreAliasPatternsAreEnabled()
        enabled = [n for n, on in self._settings.items() if on]
        return sorted(enabled, key=lambda n: (0, -_PRIORITY[n], "") if n in _PRIORITY
                      else (1, 0, n))

    def _ensureAllMandatoryPreAliasPatternsAreEnabled(self) -> None:
        for name, (_, mandatory) in PATTERNS.items():
            if mandatory and not self._settings.get(name, False):
                raise popart_exception(f"Pattern '{name}' must be enabled")

    # --- misc -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        # PopART prints the name of every pattern with a setting, each followed by a space.
        return "".join(f"{name} " for name in self._settings)

    def _copy(self) -> "Patterns":
        new = Patterns.__new__(Patterns)
        new._settings = dict(self._settings)
        new._inplace = self._inplace
        new._update_inplace_priorities = self._update_inplace_priorities
        new._runtime_asserts = self._runtime_asserts
        return new

    def __copy__(self) -> "Patterns":
        return self._copy()

    def __deepcopy__(self, memo: dict) -> "Patterns":
        return self._copy()

    def _same_settings(self, other: "Patterns") -> bool:
        """PopART's ``Patterns::operator==``: same pattern settings and same InPlace."""
        return self._settings == other._settings and self._inplace == other._inplace


def _add_accessors() -> None:
    """For every registered pattern X: property ``X``, ``isXEnabled()`` and ``enableX(v)``;
    also PopART's property spellings ``SoftMaxGradDirect`` / ``NlllWithSoftMaxGradDirect``
    (and their C++ accessors)."""
    names = {n: n for n in PATTERNS}
    names.update(_PROPERTY_ALIASES)
    for attr, name in names.items():
        def is_enabled(self: Patterns, _name: str = name) -> bool:
            return self._settings.get(_name, False)

        def enable(self: Patterns, v: bool, /, _name: str = name) -> Patterns:
            return self._enable(_name, bool(v))

        def set_property(self: Patterns, v: bool, _attr: str = attr, _name: str = name) -> None:
            self._enable(_name, _as_bool(_attr, "(self: popart.Patterns, arg0: bool) -> None", v))

        is_enabled.__name__ = is_enabled.__qualname__ = f"is{attr}Enabled"
        enable.__name__ = enable.__qualname__ = f"enable{attr}"
        is_enabled.__doc__ = f"Whether the {name} pattern is on."
        enable.__doc__ = f"Turn the {name} pattern on or off. Returns ``self``."
        setattr(Patterns, attr, property(is_enabled, set_property,
                                         doc=f"Whether the {name} pattern is on."))
        setattr(Patterns, f"is{attr}Enabled", is_enabled)
        setattr(Patterns, f"enable{attr}", enable)


_add_accessors()


def level_name(patterns: Patterns) -> str:
    """PopART's name for the set ``patterns`` holds: "all", "default", "minimal", "no", or
    "custom" (``Ir::getPatternLevelStr``)."""
    for level, word in ((PatternsLevel.All, "all"), (PatternsLevel.Default, "default"),
                        (PatternsLevel.Minimal, "minimal"), (PatternsLevel.NoPatterns, "no")):
        if Patterns(level)._same_settings(patterns):
            return word
    return "custom"


def for_session(patterns: Optional[Patterns]) -> Patterns:
    """The patterns a session runs with, given its ``patterns=`` argument.

    ``None`` is ``Patterns()`` (the default set). The session gets its own copy, so changing
    the user's object afterwards does not change the session. With runtime asserts on (the
    default), a disabled mandatory pattern raises PopART's ``popart_exception``
    ("Pattern 'X' must be enabled")."""
    if patterns is None:
        patterns = Patterns()
    elif not isinstance(patterns, Patterns):
        raise TypeError(f"patterns must be a popart.Patterns or None, not "
                        f"{type(patterns).__name__}")
    patterns = patterns._copy()
    _log_info("Enabling {} patterns", level_name(patterns))
    if patterns.getRuntimeAssertsOn():
        patterns._ensureAllMandatoryPreAliasPatternsAreEnabled()
    return patterns
