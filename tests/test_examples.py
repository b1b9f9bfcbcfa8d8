"""Every script in examples/ runs to completion (small sizes) and reports OK."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {"inference_from_file", "builder_add", "training_nll_sgd", "distributed_training",
            "replication", "pipelining", "sharding", "custom_op"} <= names


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path):
    if script.stem.startswith("popxl") and importlib.util.find_spec("popxl") is None:
        pytest.skip("popxl is not available")
    env = dict(os.environ, POPART_EXAMPLE_SMALL="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, \
        f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"{script.stem}: OK" in proc.stdout


def test_two_ipu_examples_run_on_a_one_device_machine():
    """Graphcore's sharding and pipelining programs call acquireAvailableDevice(2): with one
    host device, the DeviceManager's system still has 2 IPUs (sharing the device)."""
    for name in ("sharding", "pipelining"):
        env = dict(os.environ, POPART_EXAMPLE_SMALL="1", POPART_HOST_DEVICES="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and f"{name}: OK" in proc.stdout, proc.stderr[-2000:]
