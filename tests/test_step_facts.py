"""Step facts come from the plan (issue 26 item 2): a program loaded from the engine cache
or an executable file has the run-time checks of the one compiled from the graph, without
tracing it again. An out-of-range Gather on IPU 1 raises popart_runtime_error naming the node
in the process that compiles the program and in a second process that loads it from the
cache (or the file a popart session saved), for popart (TrainingSession) and popxl, placed on
two devices (asserted with ``popart.testing``) and unplaced."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
CASES = ["popart placed", "popart", "popart placed executable", "popxl placed", "popxl"]
NODE = {"popart": "Gather node 'the_gather': index 9 in 'idx' is out of range",
        "popxl": "Gather node 'gather': index 7 in 'add_out"}


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Each case's result in the first process (compiles, fills the cache) and the second
    (loads every program from the cache)."""
    cache = tmp_path_factory.mktemp("engine_cache")
    env = {**os.environ, "POPART_HOST_DEVICES": "4"}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, os.path.join(HERE, "helpers", "step_facts_case.py"),
                              str(cache)], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append({r["case"]: r for r in map(json.loads, out.stdout.splitlines())})
    return runs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("process", [0, 1], ids=["compiled", "from_cache"])
def test_bad_gather_index_raises_popart_runtime_error_naming_the_node(processes, case, process):
    got = processes[process][case]
    if case.endswith("executable"):   # saved by the first process, loaded by the second
        assert got["source"].startswith("executable" if process else "compiled")
    else:
        assert got["source"] == ("engine cache" if process else "compiled (cached)")
    assert got["placed"] == ("placed" in case)
    assert got["mesh"] == ([1, 2] if got["placed"] else [])   # the program really ran placed
    assert got["ok"] == pytest.approx(0.08 if case.startswith("popart") else 3.0)
    assert got["error"] == "popart_runtime_error" and got["popart"], got
    assert NODE[case.split()[0]] in got["message"]
