"""Test-session set-up: the host CPU presents 4 devices, so replicas on distinct devices
(shard_map) are exercised; the package's default is one (see popart.devices)."""
import os

os.environ.setdefault("POPART_HOST_DEVICES", "4")

import pytest  # noqa: E402

from popart.engine import x64  # noqa: E402

from op_tester import OpTester  # noqa: E402


@pytest.fixture
def engine_scope():
    """The package's 64-bit JAX scope, for tests that drive the engine's internals (lowerings,
    ``execute``) directly rather than through a session."""
    with x64():
        yield


@pytest.fixture
def op_tester():
    """PopART's op tester: ``op_tester.run(init_builder, reference, step_type="infer" |
    "train")`` runs a small Builder model through a session and checks the tensors it names
    against a reference (see tests/op_tester.py)."""
    return OpTester()
