"""One process of tests/test_step_facts.py: runs an out-of-range Gather on IPU 1 (popart
TrainingSession and popxl.Session, placed on two devices and unplaced), with the engine
cache at argv[1], and prints one JSON line per case: where the program came from, whether
it ran placed, and the error the bad index raised."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("POPART_HOST_DEVICES", "4")
os.environ["POPXL_CACHE_DIR"] = os.path.join(sys.argv[1], "popxl")

import numpy as np  # noqa: E402

import popart  # noqa: E402
import popxl  # noqa: E402
from popart import testing  # noqa: E402
from popxl_case import gather_on_ipu1  # noqa: E402  (this folder, the script's sys.path[0])


def popart_case(placed: bool, executable: bool = False) -> dict:
    """The session's program compiled (and cached), or, with ``executable``, saved to an
    executable file by the first process and loaded from it by the second."""
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [4, 8]), "x")
    idx = b.addInputTensor(popart.TensorInfo("INT32", [2]), "idx")
    with b.virtualGraph(0):
        w = b.addInitializedInputTensor(np.full((8, 8), 0.1, np.float32), "w")
        h = b.aiOnnx.matmul([x, w])
    with b.virtualGraph(1):
        g = b.aiOnnx.gather([h, idx], axis=0, debugContext="the_gather")
        loss = b.aiGraphcore.l1loss([g], 0.1, reduction=popart.ReductionType.Mean)
    o = popart.SessionOptions()
    exe = os.path.join(sys.argv[1], f"placed{int(placed)}.popef")
    if not executable:
        o.enableEngineCaching, o.cachePath = True, os.path.join(sys.argv[1], "popart")
    if placed:
        o.virtualGraphMode = popart.VirtualGraphMode.Manual
    dev = popart.DeviceManager().acquireAvailableDevice(2 if placed else 1)
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                               popart.ConstSGD(0.1), dev, userOptions=o)
    if executable and os.path.exists(exe):
        s.loadExecutable(exe)
    else:
        s.prepareDevice()
        if executable:
            s.saveExecutable(exe)
    s.weightsFromHost()
    out = s.initAnchorArrays()
    xs = np.ones((4, 8), np.float32)
    s.run(popart.PyStepIO({x: xs, idx: np.array([0, 3], np.int32)}, out))
    ok = float(np.asarray(out[loss]))
    try:
        s.run(popart.PyStepIO({x: xs, idx: np.array([0, 9], np.int32)}, out))
        err = None
    except Exception as e:  # noqa: BLE001  (the test judges the class)
        err = e
    res = dict(placed=testing.is_placed(s), mesh=list(testing.mesh_shape(s)), ok=ok,
               source=testing.executable_source(s))
    dev.detach()
    return {**res, **_error(err)}



def _error(err) -> dict:
    if err is None:
        return dict(error=None, message="")
    return dict(error=type(err).__name__, popart=isinstance(err, popart.popart_exception),
                message=str(err))


def popxl_case(placed: bool) -> dict:
    ir, idx_s, out_s = gather_on_ipu1(placed)
    with popxl.Session(ir, "ipu_model") as s:
        ok = float(s.run({idx_s: np.array([3], np.int32)})[out_s][0])
        try:
            s.run({idx_s: np.array([7], np.int32)})
            err = None
        except Exception as e:  # noqa: BLE001
            err = e
        res = dict(placed=testing.is_placed(s), mesh=list(testing.mesh_shape(s)), ok=ok,
                   source=testing.executable_source(s))
    return {**res, **_error(err)}


if __name__ == "__main__":
    for name, fn in [("popart placed", lambda: popart_case(True)), ("popart", lambda: popart_case(False)),
                     ("popart placed executable", lambda: popart_case(True, executable=True)),
                     ("popxl placed", lambda: popxl_case(True)), ("popxl", lambda: popxl_case(False))]:
        print(json.dumps({"case": name, **fn()}), flush=True)
