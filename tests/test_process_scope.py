"""Importing and using the package leaves the process as it was: JAX's default types, the
environment, the host program's logging."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import logging, os
import jax, jax.numpy as jnp   # JAX sets a few variables of its own at import
env_before = dict(os.environ)
import numpy as np
import popart, popxl

b = popart.Builder()
x = b.addInputTensor(popart.TensorInfo("INT64", [3]))
y = b.aiOnnx.add([x, x])
df = popart.DataFlow(1, {y: popart.AnchorReturnType("ALL")})
s = popart.InferenceSession(b.getModelProto(), df, popart.DeviceManager().createCpuDevice())
s.prepareDevice()
out = s.initAnchorArrays()
s.run(popart.PyStepIO({x: np.arange(3, dtype=np.int64)}, out))
assert out[y].dtype == np.int64 and list(out[y]) == [0, 2, 4], out[y]

ir = popxl.Ir()
with ir.main_graph:
    v = popxl.variable(np.ones(2, np.float32))
    st = popxl.d2h_stream((2,), popxl.float32)
    popxl.ops.host_store(st, v + 1.0)
with popxl.Session(ir, "ipu_model") as sess:
    res = sess.run()
assert list(res[st]) == [2.0, 2.0]

assert jnp.arange(3).dtype == jnp.int32, jnp.arange(3).dtype
assert jnp.array(1.0).dtype == jnp.float32, jnp.array(1.0).dtype
assert not jax.config.jax_enable_x64
assert dict(os.environ) == env_before, set(os.environ.items()) ^ set(env_before.items())
assert logging.getLogger("popart").propagate
assert logging.getLevelName(5) == "Level 5"
print("SCOPE OK")
"""


def test_jax_defaults_environment_and_logging_untouched():
    env = {"PATH": "/usr/bin:/bin", "POPART_HOST_DEVICES": "1"}
    import os
    env.update({k: v for k, v in os.environ.items() if k.startswith(("PYTHON", "HOME", "OPENBLAS"))})
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "SCOPE OK" in r.stdout, r.stdout + r.stderr
