"""popxl.ops: every op appends IR nodes of registry ops (ai.onnx / ai.graphcore / ai.popxl)
to the current graph. In-place variants (``add_``, ``relu_``, ...) give the tensor a new
version, so later reads of it see the new value."""
from ..tensor import _bind_ops
from . import _core
from ._core import *  # noqa: F401,F403  (the ops, and the names PopXL's popxl.ops has)
from .call import (CallSiteInfo, call, call_with_info, conditional, conditional_with_info,  # noqa: F401
                   host_load, host_store, repeat, repeat_with_info)
from . import collectives, var_updates  # noqa: F401
from .remote import remote_load, remote_load_, remote_store  # noqa: F401
from ._op_modules import log2, remote_code_load  # noqa: F401  (and PopXL's per-op modules)

_bind_ops(_core)   # Tensor's methods and operators
