"""``popart._internal.ir.view``: regions of tensors (whole or empty on XLA)."""
from popxl._pb import Region

__all__ = ["Region"]
