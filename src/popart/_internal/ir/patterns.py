"""``popart._internal.ir.patterns``: PopART's ``Patterns`` and ``PatternsLevel`` (popart's
own). XLA's compiler makes the rewrites PopART's patterns make, so ``Ir.setPatterns`` records
them and ``Ir.applyPreAliasPatterns`` / ``applyInplacePattern`` leave the graphs as they are."""
from popart.patterns import Patterns, PatternsLevel

__all__ = ["Patterns", "PatternsLevel"]
