from .api import __getattr__  # noqa: E402,F401  (popart.ir: popxl's older spelling, seed 003)
