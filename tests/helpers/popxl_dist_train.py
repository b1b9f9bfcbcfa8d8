"""A small popxl training program on replicas spread over instances (tests/test_popxl_distributed.py).

As a script (a worker of ``popart launch -n 2`` or ``poprun --num-instances 2 --num-replicas 4``)
it trains on its instance's share of the global data with ``Ir(replication="popdist")`` and
writes what it sees to OUT/<instance>.npz. Under ``popart launch`` (no ``POPDIST_*``
variables) it sets them as poprun would, with 2 replicas per instance. ``train`` is also the
single-process reference: all replicas local."""
import os
import sys
from typing import Optional

import numpy as np

os.environ.setdefault("POPART_HOST_DEVICES", "2")   # before JAX starts: a device per local replica

import popxl  # noqa: E402
import popxl.ops as ops  # noqa: E402
from popxl.ops import collectives as C  # noqa: E402

R, N, B, D, K, LR = 4, 2, 2, 3, 3, 0.1   # global replicas, host transfers, batch, in, out, lr


def data() -> dict:
    """Global data: inputs [N, R, ...] (one slice per global replica) and the initial values."""
    rng = np.random.default_rng(0)
    f = np.float32
    return dict(x=rng.normal(size=(N, R, B, D)).astype(f), y=rng.normal(size=(N, R, B, K)).astype(f),
                w=rng.normal(size=(D, K)).astype(f), b=rng.normal(size=K).astype(f),
                scale=np.array([[1.0], [0.5]], f),            # 2 groups {0, 2}, {1, 3}: across instances
                seen=np.arange(R, dtype=f).reshape(R, 1))     # one value per replica


def train(ir: popxl.Ir, first_replica: int = 0, local: Optional[int] = None) -> dict:
    """Each replica: pred = (x @ w + b) * scale, loss = mean((pred - y)^2); the gradients
    averaged over all replicas (all-reduce for w, reduce-scatter into the shards of the
    replica-sharded b); ``seen`` (one per replica) accumulates the replica's losses, the remote
    variable ``total`` the mean losses; ``scale`` is read back per replica; ``pair_loss``: the
    losses summed over replicas {0, 2} and {1, 3} (a grouped collective across instances). Two
    runs of N steps, ``w`` doubled by write_variable_data between them. The instance feeds
    replicas ``first_replica .. first_replica + local`` of the global data."""
    d = data()
    local = ir.replication_factor if local is None else local
    ir.num_host_transfers = N
    with ir.main_graph, popxl.in_sequence():
        xs = popxl.h2d_stream((B, D), popxl.float32, "x")
        ys = popxl.h2d_stream((B, K), popxl.float32, "y")
        ls = popxl.d2h_stream((), popxl.float32, "loss")
        ps = popxl.d2h_stream((), popxl.float32, "pair_loss")
        w = popxl.variable(d["w"], name="w")
        b, b_shard = popxl.replica_sharded_variable(d["b"], name="b")
        scale = popxl.variable(d["scale"], name="scale", replica_grouping=ir.replica_grouping(2, 2),
                               retrieval_mode="all_replicas")
        buf = popxl.remote_buffer((1,), popxl.float32, 2)
        total = popxl.remote_variable(np.zeros(1, np.float32), buf, 1, name="total")
        seen = popxl.variable(d["seen"], name="seen", replica_grouping=ir.replica_grouping(group_size=1))

        def model(x, y, w, b, scale):
            err = (x @ w + b) * scale - y
            return ops.mean(err * err)

        spec = popxl.TensorSpec
        fwd = ir.create_graph(model, spec((B, D), popxl.float32), spec((B, K), popxl.float32), w,
                              spec((K,), popxl.float32), scale)
        bwd = popxl.transforms.autodiff(fwd, grads_required=fwd.inputs[2:4])
        for _ in range(N):
            b_full = C.replicated_all_gather(b_shard)           # [K]: the shards put together
            info = ops.call_with_info(fwd, ops.host_load(xs), ops.host_load(ys), w, b_full, scale)
            loss = info.outputs[0]
            ops.host_store(ls, loss)
            ops.host_store(ps, C.replicated_all_reduce(loss, "add", group=ir.replica_grouping(2, 2)))
            gw, gb = ops.call(bwd.graph, popxl.constant(np.float32(1)),
                              inputs_dict=bwd.inputs_dict(info))
            ops.scaled_add_(w, C.replicated_all_reduce(gw, "mean"), b=-LR)
            gb_shard = C.replicated_reduce_scatter(gb, "mean",
                                                   configure_output_for_replicated_tensor_sharding=True)
            ops.scaled_add_(b_shard, gb_shard, b=-LR)
            ops.var_updates.accumulate_(seen, ops.reshape(loss, (1,)))
            mean = ops.reshape(C.replicated_all_reduce(loss, "mean"), (1,))
            ops.remote_store(buf, 1, ops.remote_load(buf, 1) + mean)
    mine = slice(first_replica, first_replica + local)
    feeds = {xs: d["x"][:, mine], ys: d["y"][:, mine]}
    with popxl.Session(ir, "ipu_hw") as s:
        first = s.run(feeds)
        s.write_variable_data(w, s.get_tensor_data(w) * 2)
        second = s.run(feeds)
    got = s.get_tensors_data([w, b, scale, seen, total])
    return dict(loss=np.stack([first[ls], second[ls]]), pair_loss=np.stack([first[ps], second[ps]]),
                **{k: got[v] for k, v in dict(w=w, b=b, scale=scale, seen=seen, total=total).items()},
                replication_factor=ir.replication_factor,
                instance_replication_factor=ir.instance_replication_factor)


if __name__ == "__main__":
    import popart
    import popdist
    if not popdist.isPopdistEnvSet():   # started by `popart launch`: what poprun would set
        n, i = popart.distributed.process_count(), popart.distributed.process_index()
        os.environ.update(POPDIST_NUM_INSTANCES=str(n), POPDIST_INSTANCE_INDEX=str(i),
                          POPDIST_NUM_TOTAL_REPLICAS=str(R), POPDIST_NUM_LOCAL_REPLICAS=str(R // n))
    popdist.init()
    out = train(popxl.Ir(replication="popdist"), popdist.getReplicaIndexOffset(),
                popdist.getNumLocalReplicas())
    np.savez(os.path.join(sys.argv[1], f"{popdist.getInstanceIndex()}.npz"), **out)
