"""``popart._internal.ir.patterns``: PopART's ``Patterns`` and ``PatternsLevel`` (popart's
own). ``Ir.setPatterns`` records them; ``Ir.applyPreAliasPatterns`` runs OpToIdentityPattern
when they enable it (``popxl.transforms.patterns``); XLA's compiler makes the other rewrites,
and ``applyInplacePattern`` leaves the graphs as they are (docs/internal_ir.md#patterns)."""
from popart.patterns import Patterns, PatternsLevel

__all__ = ["Patterns", "PatternsLevel"]
