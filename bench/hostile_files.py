"""Time and peak memory of reading two hostile files, each in a fresh process:

1. a ~4 MB ``.popef`` executable that is a zip bomb (an entry inflating to ~4 GiB), given
   to ``InferenceSession.loadExecutable``;
2. an ONNX model with a [4] float initializer whose external-data file is 3 GiB (sparse,
   so it costs no disk), given to ``InferenceSession``.

    python bench/hostile_files.py [--bomb-gib 4] [--external-gib 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

CHILD = r"""
import json, resource, sys, time
import numpy as np, onnx
import popart
kind, path = sys.argv[1], sys.argv[2]
cpu = popart.DeviceManager().createCpuDevice()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
try:
    if kind == "bomb":
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [4]), "x")
        y = b.aiOnnx.relu([x])
        b.addOutputTensor(y)
        popart.InferenceSession(b.getModelProto(), popart.DataFlow(1, [y]), cpu).loadExecutable(path)
    else:
        popart.InferenceSession(path, popart.DataFlow(1, ["y"]), cpu)
    result = "accepted"
except Exception as e:
    result = f"{type(e).__name__}: {str(e)[:160]}"
print(json.dumps({"seconds": time.perf_counter() - t0, "result": result,
                  "extra_peak_rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024}))
"""


def zip_bomb(path: str, gib: float) -> None:
    """An .npz whose 'executable' entry inflates to ``gib`` GiB of zeros."""
    n = int(gib * (1 << 30))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("executable.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False, "shape": (n,)})
            chunk = bytes(64 << 20)
            for _ in range(n // len(chunk)):
                f.write(chunk)
        z.writestr("metadata.npy", b"")


def external_model(folder: str, gib: float) -> str:
    """A model y = Identity(w), w a [4] float initializer in a ``gib`` GiB external file."""
    import onnx
    from onnx import TensorProto, helper
    with open(os.path.join(folder, "w.bin"), "wb") as f:
        f.write(np.arange(4, dtype=np.float32).tobytes())
        f.truncate(int(gib * (1 << 30)))
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    w.external_data.add(key="location", value="w.bin")
    g = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "ext", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    path = os.path.join(folder, "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


def measure(kind: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, path], capture_output=True, text=True,
                         timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"result": out.stderr.strip().splitlines()[-1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bomb-gib", type=float, default=4.0)
    ap.add_argument("--external-gib", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        bomb = os.path.join(d, "bomb.popef")
        t0 = time.perf_counter()
        zip_bomb(bomb, args.bomb_gib)
        print(f"zip bomb: {os.path.getsize(bomb) / 1e6:.1f} MB file, {args.bomb_gib:g} GiB inflated "
              f"(made in {time.perf_counter() - t0:.0f} s)")
        print("  loadExecutable:", measure("bomb", bomb))
        model = external_model(d, args.external_gib)
        print(f"external data: [4] float tensor, {args.external_gib:g} GiB file")
        print("  InferenceSession:", measure("external", model))


if __name__ == "__main__":
    main()
