"""A rank of the small jobs of tests/test_fail_fast.py: ``fail_fast_worker.py MODE OUT``.

The rank comes from the launcher's variables (``import popart`` joins a job started by
``popart launch`` / ``poprun``) or, for plain processes, from Open MPI's rank variables and
MASTER_ADDR / MASTER_PORT (``hvd.init()``). Each rank writes OUT/ready.<rank> once it is in
the job and OUT/pid.<rank> with its process id. Modes:

exit7       rank 1 exits with status 7 right after init; rank 0 sleeps for two minutes
idle        rank 1 exits with status 5; rank 0 sleeps (no launcher: the runtime must end it)
collective  rank 1 exits with status 3 while rank 0 waits in an all-reduce
wait        every rank sleeps for two minutes (the launcher gets a signal)
train       a replicated TrainingSession over the ranks (its gradients all-reduced); in the
            third step rank 1 raises (argv[3] == "raise") or kills itself with SIGKILL
            ("kill") while its inputs are fetched, inside ``run()``
checkpoint  rank 0 trains alone and writes modelToHost(OUT/model.onnx) again and again,
            logging each version's weights first; rank 1 exits with status 9 meanwhile
popxl       a popxl program (Ir(replication="popdist"), an all-reduce per run) under poprun;
            rank 1 raises in its third run ("raise"), is killed by SIGKILL there ("kill"),
            or every rank runs on ("wait")
"""
import os
import signal
import sys
import time

import numpy as np

import popart
import popart.horovod as hvd

mode, out = sys.argv[1], sys.argv[2]
what = sys.argv[3] if len(sys.argv) > 3 else ""
hvd.init()
rank = hvd.rank()
assert hvd.size() == 2, hvd.size()


def mark(name: str) -> None:
    with open(os.path.join(out, f"{name}.{rank}"), "w") as f:
        f.write(str(os.getpid()))


def model(batch: int = 2):
    """y = x @ w, loss = L1(y): one weight, every gradient all-reduced across the ranks."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [batch, 4]), "x")
    w = b.addInitializedInputTensor(np.full((4, 3), 0.5, np.float32), "w")
    loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([x, w])], 0.1)
    return b, x, w, loss


def session(distributed: bool):
    b, x, w, loss = model()
    opts = popart.SessionOptions()
    if distributed:
        opts.enableDistributedReplicatedGraphs = True
        opts.globalReplicationFactor, opts.globalReplicaOffset = 2, rank
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice(),
                               userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    return s, x, w, loss


mark("pid")
print(f"rank {rank} joined", flush=True)

if mode in ("exit7", "idle"):
    mark("ready")
    if rank == 1:
        sys.exit(7 if mode == "exit7" else 5)
    time.sleep(120)
elif mode == "collective":
    hvd.allreduce(np.ones(2, np.float32))
    mark("ready")
    if rank == 1:
        time.sleep(2)          # rank 0 is in the next all-reduce by now
        sys.exit(3)
    print("rank 0 waits in an all-reduce", flush=True)
    hvd.allreduce(np.ones(2, np.float32))
    time.sleep(120)
elif mode == "wait":
    mark("ready")
    print(f"rank {rank} is waiting", flush=True)
    time.sleep(120)
elif mode == "train":
    s, x, w, loss = session(distributed=True)
    step = [0]

    def feed(tid: str, prefetch: bool) -> np.ndarray:
        if rank == 1 and step[0] == 3:
            if what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails inside its third training step")
        return np.ones((2, 4), np.float32)

    anchors = s.initAnchorArrays()
    io = popart.PyStepIOCallback(feed, lambda tid: None, lambda tid: anchors[tid],
                                 lambda tid: None)
    mark("ready")
    for step[0] in range(1, 1000):
        s.run(io)
        print(f"rank {rank} finished step {step[0]}", flush=True)
elif mode == "checkpoint":
    mark("ready")
    if rank == 1:
        while not os.path.exists(os.path.join(out, "model.onnx")):
            time.sleep(0.05)
        time.sleep(1.0)
        sys.exit(9)
    s, x, w, loss = session(distributed=False)
    io = popart.PyStepIO({x: np.ones((2, 4), np.float32)}, s.initAnchorArrays())
    with open(os.path.join(out, "versions.txt"), "a") as log:
        for i in range(100000):
            s.run(io)
            s.weightsToHost()
            value = np.zeros((4, 3), np.float32)
            s.readWeights(popart.PyWeightsIO({w: value}))
            log.write(f"{value.sum():.9g}\n")
            log.flush()
            s.modelToHost(os.path.join(out, "model.onnx"))
elif mode == "popxl":
    import popxl
    import popxl.ops as ops
    from popxl.ops import collectives as C
    ir = popxl.Ir(replication="popdist")
    with ir.main_graph:
        xs = popxl.h2d_stream((2,), popxl.float32, "x")
        ws = popxl.d2h_stream((2,), popxl.float32, "w_out")
        v = popxl.variable(np.ones(2, np.float32), name="w")
        ops.scaled_add_(v, C.replicated_all_reduce(ops.host_load(xs) * v, "mean"), b=-0.1)
        ops.host_store(ws, v)
    with popxl.Session(ir, "ipu_model") as s:
        mark("ready")
        for i in range(1, 100000):
            if what == "raise" and rank == 1 and i == 3:
                raise RuntimeError("instance 1 fails in its third run")
            if what == "kill" and rank == 1 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            s.run({xs: np.full(2, 0.01, np.float32)})
            if i < 5:
                print(f"instance {rank} finished run {i}", flush=True)
print(f"rank {rank} ended", flush=True)
