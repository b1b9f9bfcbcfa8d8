"""PopART's tail, second round, host side (issue 37; issue 35 item 6): state, files and
storage, messages, sessions and logs, the launcher. Each test names the PopART source it
transcribes."""
import subprocess
import sys

import numpy as np
import onnx
import pytest

import popart


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------ op definitions (issue 35.6)
def test_supported_operations_definition_reads_graphcore_table():
    """The ai.graphcore attribute / output table (graphcore_schema) is read, and popart does
    not import popxl to read it."""
    r = _python("import sys, popart\n"
                "d = popart.getSupportedOperationsDefinition(False)\n"
                "(k, v), = [(k, v) for k, v in d.items() if k.type == 'CtcBeamSearchDecoder']\n"
                "print(k.numOutputs, sorted(v.attributes), 'popxl' in sys.modules)")
    assert r.returncode == 0, r.stderr
    # ctcbeamsearchdecoder(args, blank, beam_width, top_paths) -> 3 outputs (builder.cpp)
    assert r.stdout.split("\n")[-2] == "3 ['beam_width', 'blank', 'top_paths'] False"
