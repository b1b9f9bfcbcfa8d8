"""popxl: PopART's Python-first IR API, building the same IR as popart's ONNX front-end and
running it on XLA through the same engine."""
from __future__ import annotations

import popart as _popart  # noqa: F401  (configures host devices, registers the op lowerings)
import popart.ops.popxl_ops as _popxl_ops  # noqa: F401  (the ai.popxl lowerings)

from . import dtypes, errors, fp8_utils, ops, transforms, utils  # noqa: F401
from .context import (gcg, get_current_graph, get_ir, get_main_graph, gir, gmg, in_sequence,  # noqa: F401
                      io_tiles, ipu, merge_exchange, name_scope, pipeline_stage)
from .dtypes import (bfloat16, bool, complex64, complex128, double, dtype, float, float8_143,  # noqa: F401
                     float8_152, float16, float32, float64, half, int8, int16, int32, int64, uint8,
                     uint16, uint32, uint64)
from .graph import Graph  # noqa: F401
from .ir import Ir  # noqa: F401
from .module import Module  # noqa: F401
from .random_seed import create_seeds, two_uint32_to_uint64, uint64_to_two_uint32  # noqa: F401
from .remote_buffer import RemoteBuffer, remote_buffer  # noqa: F401
from .replica_grouping import ReplicaGrouping  # noqa: F401
from .session import Session  # noqa: F401
from .streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream  # noqa: F401
from .tensor import (Constant, Tensor, TensorByRef, TensorLike, TensorSpec, Variable,  # noqa: F401
                     constant, graph_input, graph_output, remote_replica_sharded_variable,
                     remote_variable, replica_sharded_buffer, replica_sharded_variable, variable)
from .tensorlocation import (ExecutionContext, ReplicatedTensorSharding, TensorLocation,  # noqa: F401
                             TensorStorage, TileSet)
from .transforms.autodiff import ExpectedConnectionType, GradGraphInfo  # noqa: F401

from popart import ReductionType  # noqa: F401,E402
