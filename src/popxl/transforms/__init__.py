"""Graph transforms: autodiff, decompose_sum, and the exchange blocks merge_exchange /
io_tile_exchange (annotations on XLA)."""
from .autodiff import (ExpectedConnection, ExpectedConnectionType, GradGraphInfo,  # noqa: F401
                       autodiff)
from .decompose_sum import decompose_sum  # noqa: F401
from .merge_exchange import io_tile_exchange, merge_exchange  # noqa: F401
