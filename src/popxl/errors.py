"""popxl's own exceptions."""


class UndefinedValue(Exception):
    """A property of a tensor (its IPU, its tile set) that was never set."""
