"""What popxl-addons' helpers rest on, without popxl-addons (tests/test_popxl_addons_usage.py
uses the library itself): the pieces found missing while writing those tests."""
from __future__ import annotations

import numpy as np

import popxl
import popxl.ops as ops


def test_call_outputs_keep_the_callee_outputs_meta_shape():
    """PopART's CallOp::setup gives each output the callee output's TensorInfo, meta shape
    included: a replica shard loaded in a subgraph (popxl-addons' load_remote_graph) is still
    known as a shard of its full shape after the call, so a gather of it (rts.py's
    gather_replica_sharded_tensor) gathers. Values against NumPy over 2 replicas."""
    R = 2
    full = np.arange(16, dtype=np.float32).reshape(4, 4)
    ir = popxl.Ir(replication=R)
    with ir.main_graph:
        buf = popxl.remote_buffer((8,), popxl.float32, 1)
        popxl.remote_replica_sharded_variable(full, buf, 0)
        load = ir.create_empty_graph("load")
        with load:
            popxl.graph_output(ops.remote_load(buf, popxl.graph_input([], popxl.int32, "i")))
        (shard,) = ops.call(load, 0)
        assert shard.shape == (8,) and shard.meta_shape == (4, 4)
        gathered = ops.collectives.replicated_all_gather(shard).reshape(shard.meta_shape)
        out = popxl.d2h_stream(gathered.shape, gathered.dtype, "out")
        ops.host_store(out, gathered)
    with popxl.Session(ir, "ipu_model") as s:
        got = s.run()[out]
    np.testing.assert_array_equal(got, np.stack([full] * R))
