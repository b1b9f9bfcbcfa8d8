"""DeviceManager / DeviceInfo (reference 13.7, user guide 4.2) on JAX devices."""
import os
import subprocess
import sys
import textwrap

import pytest

from popart import devices
from popart import testing
from popart.devices import (DeviceConnectionType, DeviceInfo, DeviceManager,
                            DeviceSelectionCriterion, DeviceType, SyncPattern,
                            configure_host_devices)
from popart.errors import popart_exception, poplar_exception

configure_host_devices(8)  # no-op if JAX is already up (popart's __init__ does this first)
import jax  # noqa: E402

SRC = os.path.dirname(os.path.dirname(os.path.abspath(devices.__file__)))


@pytest.fixture
def dm():
    yield DeviceManager()
    for info in list(devices._ATTACHED.values()):  # leave every device free for other tests
        info.detach()
    DeviceManager().setOnDemandAttachTimeout(0)


def _pool_sizes():
    accel, cpu = devices._platform_devices()
    return len(accel), len(cpu), max(len(accel), len(cpu))


def _system():
    """(IPUs of the manager's system, devices they run on)."""
    return devices.num_ipus(), len(set(devices._ipu_devices()))


def test_enum_members():
    assert list(DeviceType.__members__) == ["IpuModel", "Cpu", "Ipu", "OfflineIpu", "Sim"]
    assert list(DeviceConnectionType.__members__) == ["Always", "OnDemand", "Never"]
    assert list(SyncPattern.__members__) == ["Full", "SinglePipeline", "ReplicaAndLadder"]
    assert list(DeviceSelectionCriterion.__members__) == ["First", "Random"]
    assert SyncPattern.Full == 0 and DeviceType.Ipu == 2


def test_cpu_device(dm):
    d = dm.createCpuDevice()
    assert d.type == DeviceType.Cpu and d.numIpus == 1 and d.isAttached
    assert d.jax_devices == [jax.devices("cpu")[0]] and d.distinct_devices
    assert not d.offline
    assert "Cpu" in repr(d)


def test_ipu_model_device(dm):
    d = dm.createIpuModelDevice({"numIPUs": 2, "tilesPerIPU": 4, "compileIPUCode": True})
    assert d.type == DeviceType.IpuModel and d.numIpus == 2 and d.tilesPerIPU == 4
    assert len(d.jax_devices) == 2
    assert d.distinct_devices == (_pool_sizes()[2] >= 2)
    # model devices are not exclusive
    assert dm.createIpuModelDevice({"numIPUs": 2}).isAttached
    assert dm.createIpuModelDevice({}).numIpus == 1
    with pytest.raises(popart_exception, match="numIPUs"):
        dm.createIpuModelDevice({"numIPUs": 0})


def test_more_model_ipus_than_devices_repeat_devices(dm):
    n = _pool_sizes()[2] + 1
    d = dm.createIpuModelDevice({"numIPUs": n})
    assert d.numIpus == n and not d.distinct_devices


def test_offline_devices(dm):
    d = dm.createOfflineIPUDevice({"numIPUs": 2, "ipuVersion": "ipu2"})
    assert d.type == DeviceType.OfflineIpu and d.offline and d.numIpus == 2
    assert not d.isAttached and d.attach() is False
    assert d.connectionType == DeviceConnectionType.Never
    e = dm.createOfflineIpuFromDeviceInfo(dm.createIpuModelDevice({"numIPUs": 2,
                                                                  "tilesPerIPU": 8}))
    assert e.offline and e.numIpus == 2 and e.tilesPerIPU == 8
    f = dm.createOfflineIpuFromSystemString("POD16", 4)
    assert f.offline and f.numIpus == 4 and f.version == "POD16"
    s = dm.createSimDevice({"numIPUs": 1})
    assert s.type == DeviceType.Sim and not s.offline


def test_acquire_available_device(dm):
    d = dm.acquireAvailableDevice(1)
    assert d.type == DeviceType.Ipu and d.isAttached and d.numIpus == 1
    assert d.connectionType == DeviceConnectionType.Always
    assert d.driverIds == d.ipus == [d.ipus[0]]
    assert d.id in [e.id for e in dm.enumerateDevices()]


def test_acquire_more_than_available_raises(dm):
    total = _system()[0]
    big = 1 << total.bit_length()   # the next power of two above the system's IPUs
    with pytest.raises(popart_exception, match=f"^Failed to acquire device with {big} IPUs. "
                       "Ensure that there are sufficient IPUs available.") as e:
        dm.acquireAvailableDevice(big)
    assert "POPART_NUM_IPUS" in e.value.__notes__[0]
    assert dm.tryAcquireAvailableDevice(big) is None



def test_devices_are_exclusive_while_attached(dm):
    total, machine = _system()
    everything = dm.acquireAvailableDevice(total)
    assert everything.distinct_devices == (machine >= total) and everything.numIpus == total
    with pytest.raises(popart_exception, match="attached"):
        dm.acquireAvailableDevice(1)
    assert dm.tryAcquireAvailableDevice(1) is None
    everything.detach()
    assert not everything.isAttached
    one = dm.acquireAvailableDevice(1)
    assert one.isAttached
    assert everything.attach() is False  # part of it is now held by `one`
    one.detach()
    assert everything.attach() is True


def test_acquire_distinct_devices_in_turn(dm):
    total, machine = _system()
    held = [dm.acquireAvailableDevice(1) for _ in range(total)]
    assert len({d.jax_devices[0] for d in held}) == min(total, machine)   # IPU i on device i mod d
    assert len({d.id for d in held}) == total
    assert dm.tryAcquireAvailableDevice(1) is None


def test_on_demand_does_not_attach(dm):
    d = dm.acquireAvailableDevice(1, connectionType=DeviceConnectionType.OnDemand)
    assert not d.isAttached
    assert d.attach() and d.isAttached


def test_acquire_by_id(dm):
    ids = [d.id for d in dm.enumerateDevices(numIpus=1)]
    assert ids == list(range(len(ids)))  # single devices come first, as with gc-info
    d = dm.acquireDeviceById(ids[0])
    assert d.id == ids[0] and d.isAttached
    with pytest.raises(popart_exception, match="Failed to acquire device with id") as e:
        dm.acquireDeviceById(ids[0])
    assert "attached" in "".join(e.value.__notes__)
    assert dm.tryAcquireDeviceById(ids[0]) is None
    for acquire in (dm.acquireDeviceById, dm.tryAcquireDeviceById):   # Poplar's getDevice
        with pytest.raises(poplar_exception, match="No such device set id: .100000."):
            acquire(100000)


def test_enumerate_devices(dm):
    total = _system()[0]
    singles = dm.enumerateDevices()
    assert len(singles) == total and all(d.numIpus == 1 for d in singles)
    assert not any(d.isAttached for d in singles)
    if total >= 2:
        pairs = dm.enumerateDevices(numIpus=2)
        assert len(pairs) == total // 2
        assert pairs[0].id == total  # pairs are numbered after the single devices
    assert dm.enumerateDevices(deviceType=DeviceType.IpuModel) == []


def test_context_manager_attaches_and_detaches(dm):
    with dm.acquireAvailableDevice(1, connectionType=DeviceConnectionType.OnDemand) as d:
        assert d.isAttached
        assert isinstance(d, DeviceInfo)
    assert not d.isAttached
    with dm.acquireAvailableDevice(1) as d2:
        assert d2.isAttached
    assert not d2.isAttached


def test_try_attach_until_timeout(dm):
    holder = dm.acquireAvailableDevice(_system()[0])
    waiting = dm.enumerateDevices()[0]
    dm.setOnDemandAttachTimeout(0)
    assert waiting.tryAttachUntilTimeout() is False
    holder.detach()
    assert waiting.tryAttachUntilTimeout() is True


def test_random_selection_returns_a_free_device(dm):
    d = dm.acquireAvailableDevice(1, selectionCriterion=DeviceSelectionCriterion.Random,
                                  pattern=SyncPattern.ReplicaAndLadder)
    assert d.isAttached and d.pattern == SyncPattern.ReplicaAndLadder


def test_freed_device_info_releases_its_devices(dm):
    total = _system()[0]
    dm.acquireAvailableDevice(total)  # not kept: detaches when garbage collected
    import gc
    gc.collect()
    assert dm.acquireAvailableDevice(total).isAttached


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ.update(env, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=120)


def test_configure_host_devices_in_fresh_process():
    out = _run("""
        from popart.devices import configure_host_devices
        configure_host_devices(4)
        import jax, os
        print(len(jax.devices("cpu")), "XLA_FLAGS" in os.environ)
    """)
    assert out.returncode == 0, out.stderr
    count, flags_set = out.stdout.split()
    assert flags_set == "False"   # through jax_num_cpu_devices, not the environment
    # popart/__init__ may already have configured a count; either way several devices appear
    assert int(count) >= 4


def test_configure_host_devices_respects_user_flag_and_late_calls():
    out = _run("""
        from popart.devices import configure_host_devices
        import os
        configure_host_devices(6)
        print(os.environ["XLA_FLAGS"])
    """, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "--xla_force_host_platform_device_count=3"
    out = _run("""
        import os, jax
        jax.devices()
        os.environ.pop("XLA_FLAGS", None)
        from popart.devices import configure_host_devices
        os.environ.pop("XLA_FLAGS", None)
        configure_host_devices(6)
        print(repr(os.environ.get("XLA_FLAGS")))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"  # too late: JAX already has a backend


def test_any_machine_has_a_system_of_ipus(dm, caplog):
    """acquireAvailableDevice(n) gives n IPUs however few devices the machine has: IPU i runs
    on device i mod d, with a log line; what can be acquired is what enumerateDevices lists."""
    total, machine = _system()
    assert total >= 16 and machine == _pool_sizes()[2]
    import popart
    logger = popart.getLogger("devicex")
    level = logger.getLevel()
    logger.setLevel("INFO")
    try:
        big = dm.acquireAvailableDevice(2 * machine)
    finally:
        logger.setLevel(level)
    assert big.numIpus == 2 * machine and not big.distinct_devices
    assert big.jax_devices == [devices._ipu_devices()[i] for i in big.ipus]
    assert any("several IPUs per device" in r.getMessage() for r in caplog.records)
    for n in (1, 2, 4, 8, 16):
        listed = dm.enumerateDevices(numIpus=n)
        assert len(listed) == total // n and all(d.numIpus == n for d in listed)
    big.detach()


def test_replicas_on_a_device_with_shared_ipus_match_one_replica_per_device(dm):
    """A TrainingSession replicated over 8 IPUs of a 4-device machine runs its replicas side
    by side (vmap) and gives the numbers it gives over 4 distinct devices x 2 replicas."""
    import numpy as np
    import popart
    rs = np.random.RandomState(0)
    X = rs.randn(1, 8, 2, 3).astype(np.float32)

    def run(device, replicas):
        b = popart.Builder()
        x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]), "x")
        w = b.addInitializedInputTensor(np.full((3, 2), 0.5, np.float32), "w")
        loss = b.aiGraphcore.l1loss([b.aiOnnx.matmul([x, w])], 0.1, reduction=popart.ReductionType.Sum)
        o = popart.SessionOptions()
        o.enableReplicatedGraphs, o.replicatedGraphCount = True, replicas
        s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [loss]), loss,
                                   popart.ConstSGD(0.1), device, userOptions=o)
        s.prepareDevice()
        s.weightsFromHost()
        out = s.initAnchorArrays()
        s.run(popart.PyStepIO({x: X.reshape(8, 2, 3)}, out))
        got = np.zeros((3, 2), np.float32)
        s.weightsToHost()
        s.readWeights(popart.PyWeightsIO({w: got}))
        return s, out[loss], got

    shared, loss_a, w_a = run(dm.acquireAvailableDevice(8), 8)
    assert testing.mesh_devices(shared) == []       # fewer devices than replicas: vmap
    distinct, loss_b, w_b = run(dm.createIpuModelDevice({"numIPUs": 8}), 8)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    np.testing.assert_allclose(w_a, w_b, rtol=1e-6)
