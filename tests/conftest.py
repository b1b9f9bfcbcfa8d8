"""Test-session set-up: the host CPU presents 4 devices, so replicas on distinct devices
(shard_map) are exercised; the package's default is one (see popart.devices)."""
import os

os.environ.setdefault("POPART_HOST_DEVICES", "4")
