"""popart: PopART's Python API (Builder, sessions, training, popxl) on XLA devices via JAX."""
from __future__ import annotations

from .devices import configure_host_devices as _configure_host_devices

_configure_host_devices()  # before JAX creates its CPU backend: several virtual host devices

from .host_memory import keep_large_buffers as _keep_large_buffers  # noqa: E402

_keep_large_buffers()  # before JAX's threads allocate: big buffers reused, not page-faulted anew

from . import distributed  # noqa: E402

distributed.initialize_from_env()  # a process started by `popart launch` joins its job

from . import ops as _ops  # noqa: E402,F401  (registers every op lowering)
from . import custom_ops  # noqa: E402,F401  (C++ custom ops' Python equivalents; cppimport finders)
from .builder import Builder  # noqa: E402
from .dataflow import *  # noqa: E402,F401,F403
from .devices import (DeviceConnectionType, DeviceInfo, DeviceManager,  # noqa: E402,F401
                      DeviceSelectionCriterion, DeviceType, SyncPattern)
from .errors import *  # noqa: E402,F401,F403
from .logging import getLogger  # noqa: E402,F401
from .optimizers import *  # noqa: E402,F401,F403
from .options import *  # noqa: E402,F401,F403
from .patterns import Patterns, PatternsLevel  # noqa: E402,F401
from .session import InferenceSession, TrainingSession  # noqa: E402,F401
from .tensorinfo import DataType, TensorInfo  # noqa: E402,F401
from . import writer  # noqa: E402,F401
from .debug_info import *  # noqa: E402,F401,F403
from .graph_transformer import GraphTransformer  # noqa: E402,F401
from .logging import Logger  # noqa: E402,F401
from .module_api import *  # noqa: E402,F401,F403
from .op_definitions import *  # noqa: E402,F401,F403

__version__ = "0.1.0"

# PopART's reserved tensor-name prefixes.
_PREFIXES = {
    "Gradient": "Gradient___", "Accum": "Accum___", "Accl": "Accl___", "Accl1": "Accl1___",
    "Accl2": "Accl2___", "Accl3": "Accl3___", "Step": "Step___", "UpdatedVar": "UpdatedVar___",
    "LossScaling": "lossScaling_", "Restored": "Restored___", "RandomSeed": "randomSeed___",
    "InitialValue": "InitialValue___", "Stash": "Stash___", "Concat": "Concat___",
}


def _prefix_fn(value: str):
    def fn() -> str:
        return value
    return fn


for _name, _value in _PREFIXES.items():
    globals()[f"reserved{_name}Prefix"] = _prefix_fn(_value)


def reservedPrefixes() -> list[str]:
    return list(_PREFIXES.values())


from .tensornames import *  # noqa: E402,F401,F403  (PopART's full set of reserved prefixes)
