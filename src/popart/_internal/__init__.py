"""PopART's private modules that popxl-addons reaches: ``popart._internal.ir``, the IR binding
(here a facade of live handles on popxl's IR; see docs/internal_ir.md)."""
