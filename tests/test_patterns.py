"""popart.Patterns / popart.PatternsLevel against PopART's API and pattern registry."""
import copy

import pytest

import popart
from popart import patterns as pp
from popart.errors import popart_exception

# PopART's patterns (willow/src/patterns/*.cpp), split by their registration flags.
MANDATORY = set("""
AbsGradOp AllReduceToIdentity Atan2Arg0GradOp Atan2Arg1GradOp ConvDataGrad
ConvFlipWeightsGradOp ConvTranspose CosGradOp CoshOp DivArg0GradOp DivArg1GradOp ExpGradOp
Expm1GradOp FmodArg0GradOp Log1pGradOp LogGradOp LoopScanOut MatMulLhsGradOp MatMulOp
MatMulRhsGradOp MulArgGradOp PowArg0GradOp PowArg1GradOp RandomNormalLikeOpPattern
RandomUniformLikeOpPattern ReciprocalGradOp ScanToLoop SinGradOp SqrtGradOp
SubtractArg1GradOp ZerosLikeOpPattern""".split())
DEFAULT_OPTIONAL = set("""
ConvFlipWeightsDoubleFlip DecomposeBinaryConstScalar ExpandCast InitAccumulate
LambSerialisedWeight NegativeOneScale NlllWithSoftmaxGradDirect OpToIdentity PackedDataBlock
PadSum PostNRepl PreUniRepl RemoveUnnecessaryLossGradCast SoftmaxGradDirect SplitGradOpToConcat
SplitOp SumToAdd TransposeToIdentityOrReshapePattern UpsampleToResize""".split())
OFF_BY_DEFAULT = {"LSTMOp", "Slice2SliceSubsample", "SplitGather", "TiedGather",
                  "TiedGatherAccumulate"}
ALL = MANDATORY | DEFAULT_OPTIONAL | OFF_BY_DEFAULT
BOUND_PROPERTIES = ["PreUniRepl", "PostNRepl", "SoftMaxGradDirect", "NlllWithSoftMaxGradDirect",
                    "OpToIdentity", "SubtractArg1GradOp", "MulArgGradOp", "MatMulOp",
                    "MatMulLhsGradOp", "MatMulRhsGradOp", "InPlace"]


def enabled(p):
    return {n for n in ALL if p.isPatternEnabled(n)}


def test_registry_counts():
    assert len(ALL) == 55 and len(MANDATORY) == 31
    assert set(pp.PATTERNS) == ALL
    assert {n for n, (_, m) in pp.PATTERNS.items() if m} == MANDATORY
    assert {n for n, (d, _) in pp.PATTERNS.items() if d} == MANDATORY | DEFAULT_OPTIONAL
    assert all(pp.PATTERNS[n][0] for n in MANDATORY)  # mandatory implies on by default
    assert pp.NUMERIC_PATTERNS == {"SoftmaxGradDirect", "NlllWithSoftmaxGradDirect"}
    assert pp.NUMERIC_PATTERNS <= ALL


def test_patterns_level_enum():
    L = popart.PatternsLevel
    assert [m.name for m in L] == ["All", "Default", "Minimal", "NoPatterns"]
    assert (int(L.NoPatterns), int(L.Minimal), int(L.Default), int(L.All)) == (0, 1, 2, 3)
    assert str(L.Default) == "PatternsLevel.Default"


def test_default_constructor_is_default_level():
    for p in (popart.Patterns(), popart.Patterns(popart.PatternsLevel.Default),
              popart.Patterns(level=popart.PatternsLevel.Default)):
        assert enabled(p) == MANDATORY | DEFAULT_OPTIONAL
        assert p.InPlace is True
        assert p.isUpdateInplacePrioritiesForIpuEnabled() is False
        assert p.getRuntimeAssertsOn() is True
        assert set(p.getSettings()) == ALL


def test_levels():
    L = popart.PatternsLevel
    p = popart.Patterns(L.All)
    assert enabled(p) == ALL and p.InPlace is True
    p = popart.Patterns(L.Minimal)
    assert enabled(p) == MANDATORY and p.InPlace is False and set(p.getSettings()) == ALL
    p = popart.Patterns(L.NoPatterns)
    assert enabled(p) == set() and p.InPlace is False and p.getSettings() == {}
    assert repr(p) == ""


def test_from_names():
    p = popart.Patterns(["PostNRepl", "InPlace"])
    assert enabled(p) == {"PostNRepl"}
    assert p.PostNRepl is True and p.InPlace is True and p.SoftMaxGradDirect is False
    p = popart.Patterns(patterns=["SplitGather", "UpdateInplacePrioritiesForIpu", "SplitGather"])
    assert enabled(p) == {"SplitGather"} and p.InPlace is False
    assert p.isUpdateInplacePrioritiesForIpuEnabled() is True
    assert enabled(popart.Patterns([])) == set()
    assert enabled(popart.Patterns(("PreUniRepl",))) == {"PreUniRepl"}
    assert enabled(popart.Patterns.create(["MatMulOp"])) == {"MatMulOp"}


def test_constructor_errors():
    with pytest.raises(popart_exception) as e:
        popart.Patterns(["PreUniRepl", "NoSuchPattern"])
    assert str(e.value) == "Unknown pattern NoSuchPattern"
    with pytest.raises(popart_exception) as e:
        popart.Patterns(["Inplace"])
    assert str(e.value) == "Unknown pattern Inplace, did you mean InPlace?"
    for bad in [(2,), ("PreUniRepl",), ([1],), ({"PreUniRepl"},), (None,),
                (popart.PatternsLevel.All, ["PreUniRepl"])]:
        with pytest.raises(TypeError, match="incompatible constructor arguments"):
            popart.Patterns(*bad)
    with pytest.raises(TypeError):
        popart.Patterns(level=["PreUniRepl"])
    with pytest.raises(TypeError):
        popart.Patterns(patterns=popart.PatternsLevel.All)
    with pytest.raises(TypeError):
        popart.Patterns(levels=popart.PatternsLevel.All)


def test_enable_pattern_and_is_enabled():
    p = popart.Patterns()
    assert p.isPatternEnabled("PadSum") is True
    assert p.enablePattern("PadSum", False) is p
    assert p.isPatternEnabled("PadSum") is False
    p.enablePattern("SplitGather", True)
    assert p.isPatternEnabled("SplitGather") is True and p.SplitGather is True
    p.enablePattern("InPlace", False)
    assert p.InPlace is False
    p.enablePattern("InPlace", True)
    assert p.InPlace is True
    p.enablePattern("UpdateInplacePrioritiesForIpu", True)
    assert p.isUpdateInplacePrioritiesForIpuEnabled()
    # enabling a mandatory pattern is fine; disabling it is not
    p.enablePattern("MatMulOp", True)
    with pytest.raises(popart_exception) as e:
        p.enablePattern("MatMulOp", False)
    assert str(e.value) == "Pattern 'MatMulOp' is mandatory and cannot be disabled"
    assert p.MatMulOp is True
    # a pattern without a setting yet (built from names) gets one
    q = popart.Patterns(["PostNRepl"])
    q.enablePattern("PreUniRepl", True).enablePattern("SoftmaxGradDirect", False)
    assert q.getSettings() == {"PreUniRepl": True, "SoftmaxGradDirect": False,
                               "PostNRepl": True}


def test_unknown_names():
    p = popart.Patterns()
    for call in (lambda: p.isPatternEnabled("Foo"), lambda: p.enablePattern("Foo", True),
                 lambda: p.isPatternEnabled("SoftMaxGradDirect"),
                 # InPlace is not a registered pattern: PopART only reads it by property
                 lambda: p.isPatternEnabled("InPlace")):
        with pytest.raises(popart_exception, match=r"^Unknown pattern \w+\.$"):
            call()
    with pytest.raises(popart_exception) as e:
        p.enablePattern("Inplace", True)
    assert str(e.value) == "Unknown pattern Inplace."
    with pytest.raises(TypeError):
        p.enablePattern(3, True)
    with pytest.raises(TypeError):
        p.enablePattern("PadSum", "yes")
    with pytest.raises(TypeError):
        p.isPatternEnabled(None)


def test_bound_properties():
    p = popart.Patterns()
    for name in BOUND_PROPERTIES:
        assert getattr(p, name) is True
    p = popart.Patterns(popart.PatternsLevel.NoPatterns)
    for name in BOUND_PROPERTIES:
        assert getattr(p, name) is False
    p = popart.Patterns()
    p.PreUniRepl = False
    assert p.PreUniRepl is False and p.isPatternEnabled("PreUniRepl") is False
    assert p.PostNRepl is True and p.InPlace is True
    p.SoftMaxGradDirect = False
    assert p.isPatternEnabled("SoftmaxGradDirect") is False and p.SoftmaxGradDirect is False
    p.NlllWithSoftmaxGradDirect = False
    assert p.NlllWithSoftMaxGradDirect is False
    p.InPlace = False
    assert p.InPlace is False and p.isInPlaceEnabled() is False
    with pytest.raises(popart_exception, match="'MulArgGradOp' is mandatory"):
        p.MulArgGradOp = False


def test_every_pattern_has_accessors():
    p = popart.Patterns(popart.PatternsLevel.NoPatterns)
    for name in sorted(ALL):
        assert getattr(p, name) is False
        assert getattr(p, f"is{name}Enabled")() is False
        assert getattr(p, f"enable{name}")(True) is p
        assert getattr(p, name) is True and p.isPatternEnabled(name)
    for name in sorted(ALL - MANDATORY):
        setattr(p, name, False)
        assert not p.isPatternEnabled(name)
        setattr(p, name, True)
    assert enabled(p) == ALL
    # C++ accessor names
    for name in ("SoftMaxGradDirect", "SplitGather", "UpsampleToResize", "ReciprocalGradOp",
                 "Atan2Arg0GradOp", "DivArg0GradOp", "PowArg0GradOp", "TiedGather",
                 "RandomNormalLikeOpPattern", "InitAccumulate"):
        assert callable(getattr(p, f"is{name}Enabled"))
        assert callable(getattr(p, f"enable{name}"))
    assert p.enableSoftMaxGradDirect(False).isSoftMaxGradDirectEnabled() is False


def test_unknown_attribute_is_an_error():
    p = popart.Patterns()
    with pytest.raises(AttributeError):
        p.Inplace = False  # a typo does not pass silently
    with pytest.raises(AttributeError):
        p.NoSuchPattern  # noqa: B018


def test_inplace_and_update_priorities_methods():
    p = popart.Patterns()
    assert p.enableInPlace(False) is p and p.isInPlaceEnabled() is False
    assert p.getInplaceEnabled() is False
    assert p.enableUpdateInplacePrioritiesForIpu(True) is p
    assert p.getUpdateInplacePrioritiesForIpuEnabled() is True
    p.UpdateInplacePrioritiesForIpu = False
    assert p.isUpdateInplacePrioritiesForIpuEnabled() is False


def test_runtime_asserts():
    p = popart.Patterns(popart.PatternsLevel.NoPatterns)
    assert p.getRuntimeAssertsOn() is True
    assert p.enableRuntimeAsserts(False) is p
    assert p.getRuntimeAssertsOn() is False
    assert p.getPreAliasList() == []
    p.enableRuntimeAsserts(True)
    with pytest.raises(popart_exception, match="^Pattern 'CoshOp' must be enabled$"):
        p.getPreAliasList()


def test_static_registry_queries():
    names = popart.Patterns.getAllPreAliasPatternNames()
    assert sorted(names) == sorted(ALL) and len(names) == 55
    # PopART's run order: by priority, then the patterns without one by name
    assert names[:3] == ["Slice2SliceSubsample", "ExpandCast", "ConvFlipWeightsDoubleFlip"]
    assert names.index("PreUniRepl") < names.index("PostNRepl") < names.index("SoftmaxGradDirect")
    assert names.index("LSTMOp") == 44
    assert names[45:] == sorted(names[45:])
    assert all(popart.Patterns.isMandatory(n) for n in MANDATORY)
    assert not any(popart.Patterns.isMandatory(n) for n in ALL - MANDATORY)
    assert popart.Patterns.isMandatory("NoSuchPattern") is False
    assert popart.Patterns.isMandatory("InPlace") is False


def test_repr():
    p = popart.Patterns(["PostNRepl", "InPlace", "PreUniRepl"])
    assert repr(p) == str(p) == "PreUniRepl PostNRepl "  # PopART's registry order
    d = repr(popart.Patterns())
    assert d.endswith(" ") and set(d.split()) == ALL
    p = popart.Patterns(["PreUniRepl"])
    p.enablePattern("SplitGather", False)  # disabled patterns with a setting are listed too
    assert repr(p) == "PreUniRepl SplitGather "


def test_for_session():
    s = pp.for_session(None)
    assert isinstance(s, popart.Patterns) and enabled(s) == MANDATORY | DEFAULT_OPTIONAL
    assert s.InPlace is True
    user = popart.Patterns(popart.PatternsLevel.All)
    s = pp.for_session(user)
    assert s is not user and enabled(s) == ALL
    user.enablePattern("PadSum", False)  # the session keeps its own copy
    assert s.isPatternEnabled("PadSum")
    assert enabled(pp.for_session(popart.Patterns(popart.PatternsLevel.Minimal))) == MANDATORY
    for bad in (popart.Patterns(["PreUniRepl"]), popart.Patterns(popart.PatternsLevel.NoPatterns)):
        with pytest.raises(popart_exception, match=r"^Pattern '\w+' must be enabled$"):
            pp.for_session(bad)
    with pytest.raises(popart_exception, match="^Pattern 'CoshOp' must be enabled$"):
        pp.for_session(popart.Patterns(popart.PatternsLevel.NoPatterns))
    ok = pp.for_session(popart.Patterns(["PreUniRepl"]).enableRuntimeAsserts(False))
    assert enabled(ok) == {"PreUniRepl"} and ok.getRuntimeAssertsOn() is False
    with pytest.raises(TypeError):
        pp.for_session("Default")


def test_level_name():
    L = popart.PatternsLevel
    assert pp.level_name(popart.Patterns()) == "default"
    assert pp.level_name(popart.Patterns(L.All)) == "all"
    assert pp.level_name(popart.Patterns(L.Minimal)) == "minimal"
    assert pp.level_name(popart.Patterns(L.NoPatterns)) == "no"
    assert pp.level_name(popart.Patterns().enableInPlace(False)) == "custom"
    assert pp.level_name(popart.Patterns(["PreUniRepl"])) == "custom"


def test_copy():
    p = popart.Patterns(["PreUniRepl"]).enableRuntimeAsserts(False)
    for q in (copy.copy(p), copy.deepcopy(p)):
        assert q is not p and repr(q) == repr(p) and q.getRuntimeAssertsOn() is False
        q.enablePattern("PostNRepl", True)
        assert not p.isPatternEnabled("PostNRepl")


def test_enable_pattern_logs(capsys):
    popart.getLogger("pattern").setLevel("INFO")
    try:
        capsys.readouterr()
        popart.Patterns().enablePattern("PadSum", False)
        pp.for_session(None)
        err = capsys.readouterr().err
        assert "[popart:pattern] [info] Pattern PadSum false" in err
        assert "Enabling default patterns" in err
    finally:
        popart.getLogger("pattern").setLevel("OFF")
