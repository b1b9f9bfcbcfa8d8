"""popart.host_memory: after ``import popart`` a large buffer freed and allocated again (in a
thread other than the main one, as XLA's) is reused from the heap, where glibc's defaults map it
anew and fault every page in again; ``POPART_HOST_MALLOC=0`` keeps the defaults."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

MB = 64
PROBE = f"""
import ctypes, resource, threading
import popart
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = {MB} << 20
def touch():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
def runs():
    touch()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        touch()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
t = threading.Thread(target=runs)
t.start()
t.join()
"""


def _faults(**env: str) -> int:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def test_large_buffers_are_reused():
    pages = 3 * (MB << 20) // 4096   # three fresh allocations, every 4 KiB page touched
    assert _faults() < pages // 20
    assert _faults(POPART_HOST_MALLOC="0") > pages // 2
