"""DeviceManager and DeviceInfo (API reference 13.7, user guide 4.2) mapped onto JAX devices.

A DeviceInfo for n IPUs owns ``jax_devices``: n accelerators when the machine has that many,
else n of the host CPU's virtual devices (see :func:`configure_host_devices`), else devices
repeated (replicas then run side by side; ``distinct_devices`` is False).

The manager's "hardware" IPUs (``acquireAvailableDevice``, ``enumerateDevices``,
``acquireDeviceById``) form a system of :func:`num_ipus` IPUs on any machine, as an IPU-POD
has: IPU i runs on the machine's device i mod d (its accelerators, else its host CPU devices),
so several IPUs share a device when there are fewer devices (a log line says so). Acquired
devices are exclusive, IPU by IPU, while attached.
"""
from __future__ import annotations

import os
from typing import Optional


HOST_DEVICES_ENV = "POPART_HOST_DEVICES"
NUM_IPUS_ENV = "POPART_NUM_IPUS"   # IPUs the manager's system has (default: 16, or more devices)
DEFAULT_NUM_IPUS = 16              # an IPU-POD16


def configure_host_devices(n: Optional[int] = None) -> None:
    """Make XLA's host platform present ``n`` CPU devices, if JAX has no backend yet.

    ``n`` defaults to the POPART_HOST_DEVICES environment variable, else 1: several virtual
    host devices share the same cores, give replicas no extra speed, and make XLA's CPU code
    markedly slower (a third, measured on matmul training), so replicas run side by side
    (vmap) unless asked otherwise. Sets JAX's ``jax_num_cpu_devices`` (public config; no
    environment variable is changed) unless the user chose a count already (that option, or
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``); once JAX has created its
    backends the count is fixed and this does nothing."""
    if n is None:
        n = int(os.environ.get(HOST_DEVICES_ENV, "1") or 1)
    import jax
    if (n <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
            or jax.config.jax_num_cpu_devices != -1):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:   # JAX's backends exist already: too late to change the count
        pass


import random  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from .errors import check_arguments, integral, noted, popart_exception, poplar_exception  # noqa: E402
from .logging import getLogger  # noqa: E402
from .options import _enum  # noqa: E402

__all__ = ["DeviceType", "DeviceConnectionType", "SyncPattern", "DeviceSelectionCriterion",
           "DeviceInfo", "DeviceManager", "configure_host_devices"]

DeviceType = _enum("DeviceType", "IpuModel Cpu Ipu OfflineIpu Sim")
DeviceConnectionType = _enum("DeviceConnectionType", "Always OnDemand Never")
SyncPattern = _enum("SyncPattern", "Full SinglePipeline ReplicaAndLadder")
DeviceSelectionCriterion = _enum("DeviceSelectionCriterion", "First Random")

_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")
_DEFAULT_TILES = 1472  # tiles of a Mk2 IPU
_FEW_TILES = 4  # PopART's defaultFewTiles: IpuModel / Sim devices without "tilesPerIPU"
_GC_MONITOR = ("If you have enabled the Poplar SDK you can check device availability with the "
               "`gc-monitor` command-line utility.")

# IPU index of the system -> the DeviceInfo attached to it (entries vanish when that
# DeviceInfo is freed)
_ATTACHED: "weakref.WeakValueDictionary[int, DeviceInfo]" = weakref.WeakValueDictionary()
_logger = getLogger("devicex")


def _platform_devices() -> tuple[list, list]:
    """(accelerators, host CPU devices) that JAX presents."""
    import jax
    accel = list(jax.local_devices()) if jax.default_backend() in _ACCELERATORS else []
    try:
        cpu = list(jax.local_devices(backend="cpu"))
    except RuntimeError:  # CPU backend disabled (JAX_PLATFORMS)
        cpu = []
    return accel, cpu


def _jax_devices_for(n: int, cpu_only: bool = False) -> list:
    """n devices: accelerators if enough, else distinct CPU devices if enough, else repeats
    (``cpu_only``: the host CPU's devices whatever accelerators there are)."""
    accel, cpu = _platform_devices()
    if cpu_only and cpu:
        accel = []
    for pool in (accel, cpu):
        if len(pool) >= n:
            return pool[:n]
    pool = cpu or accel
    return [pool[i % len(pool)] for i in range(n)]


def num_ipus() -> int:
    """The IPUs of the manager's system: ``POPART_NUM_IPUS``, default 16 (an IPU-POD16), and
    at least one per device of the machine."""
    accel, cpu = _platform_devices()
    try:
        n = int(os.environ.get(NUM_IPUS_ENV, "") or DEFAULT_NUM_IPUS)
    except ValueError:
        raise popart_exception(f"{NUM_IPUS_ENV} must be a number of IPUs, got "
                               f"{os.environ[NUM_IPUS_ENV]!r}") from None
    return max(n, len(accel or cpu), 1)


def _ipu_devices() -> list:
    """The JAX device each IPU of the system runs on: IPU i on device i mod d."""
    accel, cpu = _platform_devices()
    pool = accel or cpu
    return [pool[i % len(pool)] for i in range(num_ipus())]


def _device_groups() -> list[tuple[int, ...]]:
    """Every acquirable group of IPUs (indices); a group's index is its device id.

    As with ``gc-info -l``: single IPUs first, then pairs, fours, ... (then other sizes),
    each size as consecutive chunks."""
    n = num_ipus()
    groups: list[tuple[int, ...]] = []
    for k in sorted(range(1, n + 1), key=lambda k: (k & (k - 1) != 0, k)):  # powers of two first
        groups += [tuple(range(i * k, (i + 1) * k)) for i in range(n // k)]
    return groups


def _opt(opts: Optional[dict], *names: str, default: Any) -> Any:
    """The first of ``names`` present in ``opts`` (PopART accepts several spellings)."""
    for name in names:
        if opts and name in opts:
            return opts[name]
    return default


class DeviceInfo:
    """A device (group of IPUs) for a session; owns ``jax_devices``."""

    def __init__(self, type: Any, jax_devices: Sequence[Any], *, id: int = 0,
                 tilesPerIPU: int = _DEFAULT_TILES, version: str = "ipu2",
                 connectionType: Any = DeviceConnectionType.Always,
                 pattern: Any = SyncPattern.Full, exclusive: bool = False,
                 options: Optional[dict] = None, ipus: Sequence[int] = ()) -> None:
        self._type = DeviceType(type)
        self.jax_devices = list(jax_devices)
        self.ipus = list(ipus)   # the system's IPUs an acquired device holds
        self._id, self._tiles, self._version = int(id), int(tilesPerIPU), str(version)
        self._connection = DeviceConnectionType(connectionType)
        self.pattern = SyncPattern(pattern)
        self._exclusive = exclusive
        self.options = dict(options or {})
        self._attached = False

    # --- properties (pybind names) ---
    @property
    def type(self) -> Any:
        return self._type

    @property
    def numIpus(self) -> int:
        return len(self.jax_devices)

    @property
    def id(self) -> int:
        return self._id

    @property
    def tilesPerIPU(self) -> int:
        return self._tiles

    @property
    def version(self) -> str:
        return self._version

    @property
    def ipuVersion(self) -> str:
        """The IPU version ("ipu1", "ipu2", ...): PopART's DeviceInfo.ipuVersion."""
        return self._version

    @property
    def tilesPerIpu(self) -> int:
        """PopART's second spelling of :attr:`tilesPerIPU`."""
        return self._tiles

    @property
    def numWorkerContexts(self) -> int:
        """Worker contexts per tile: 6 on every IPU (Poplar's Target::getNumWorkerContexts)."""
        return 6

    @property
    def connectionType(self) -> Any:
        return self._connection

    @property
    def driverIds(self) -> list[int]:
        return list(self.ipus) if self._exclusive else []

    @property
    def isAttached(self) -> bool:
        return self._attached

    @property
    def offline(self) -> bool:
        """True for offline devices: sessions compile for them but refuse to run."""
        return self._type == DeviceType.OfflineIpu

    @property
    def distinct_devices(self) -> bool:
        """False when one JAX device stands in for several IPUs."""
        return len(set(self.jax_devices)) == len(self.jax_devices)

    # --- attach / detach ---
    def attach(self) -> bool:
        """Attach to the device; False if another attached DeviceInfo holds one of its devices
        or the device is offline."""
        if self.offline or self._connection == DeviceConnectionType.Never:
            return False
        if self._exclusive:
            if any(_ATTACHED.get(i, self) is not self for i in self.ipus):
                return False
            for i in self.ipus:
                _ATTACHED[i] = self
        self._attached = True
        return True

    def tryAttachUntilTimeout(self) -> bool:
        """Retry :meth:`attach` until the manager's on-demand attach timeout has passed."""
        deadline = time.monotonic() + DeviceManager._attach_timeout
        while not self.attach():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def detach(self) -> None:
        for i in self.ipus:
            if _ATTACHED.get(i) is self:
                del _ATTACHED[i]
        self._attached = False

    def __enter__(self) -> "DeviceInfo":
        if not self._attached and not self.offline and not self.attach():
            raise popart_exception(f"Could not attach to device {self._id} "
                                   f"({self.numIpus} IPUs): it is attached elsewhere")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"DeviceInfo(type={self._type.name}, id={self._id}, numIpus={self.numIpus}, "
                f"tilesPerIPU={self._tiles}, version={self._version}, "
                f"connectionType={self._connection.name}, attached={self._attached}, "
                f"jax_devices={self.jax_devices})")


# pybind11's signatures of DeviceManager methods (popart.cpp), for check_arguments.
_DM = "self: popart_core.DeviceManager"
_LINK = ("pattern: popart_core.SyncPattern = <SyncPattern.Full: 0>, connectionType: "
         "popart_core.DeviceConnectionType = <DeviceConnectionType.Always: 0>")
_BY_ID = f"({_DM}, id: int, {_LINK}) -> popart_core.DeviceInfo"
_AVAILABLE = (f"({_DM}, numIpus: int = 1, tilesPerIpu: int = 0, {_LINK}, selectionCriterion: "
              "popart_core.DeviceSelectionCriterion = <DeviceSelectionCriterion.First: 0>) -> "
              "popart_core.DeviceInfo")


class DeviceManager:
    """Creates and acquires devices. Stateless apart from the on-demand attach timeout."""

    _attach_timeout: float = 0.0

    # --- simulated / host devices (never exclusive) ---
    def createCpuDevice(self) -> DeviceInfo:
        """The host CPU as a one-IPU device."""
        return self._simulated(DeviceType.Cpu, {"numIPUs": 1, "tilesPerIPU": 1})

    def createIpuModelDevice(self, opts: Optional[dict] = None) -> DeviceInfo:
        """An IPU model with ``opts["numIPUs"]`` IPUs (default 1) of ``opts["tilesPerIPU"]``
        tiles (default 4, PopART's defaultFewTiles); other options are kept."""
        check_arguments(isinstance(opts, (dict, type(None))), "createIpuModelDevice",
                        [f"({_DM}, arg0: dict) -> popart_core.DeviceInfo"], (self, opts))
        return self._simulated(DeviceType.IpuModel, opts)

    def createSimDevice(self, opts: Optional[dict] = None) -> DeviceInfo:
        """A simulator device: ``numIPUs`` (default 1), ``tilesPerIPU`` (default 4)."""
        return self._simulated(DeviceType.Sim, opts)

    def createOfflineIPUDevice(self, opts: Optional[dict] = None) -> DeviceInfo:
        """A device to compile for without running (sessions refuse to run on it)."""
        check_arguments(isinstance(opts, (dict, type(None))), "createOfflineIPUDevice",
                        [f"({_DM}, opts: dict) -> popart_core.DeviceInfo"], (self, opts))
        return self._simulated(DeviceType.OfflineIpu, opts, DeviceConnectionType.Never)

    def createOfflineIpuFromDeviceInfo(self, deviceInfo: DeviceInfo) -> DeviceInfo:
        return self.createOfflineIPUDevice({"numIPUs": deviceInfo.numIpus,
                                            "tilesPerIPU": deviceInfo.tilesPerIPU,
                                            "ipuVersion": deviceInfo.version})

    def createOfflineIpuFromSystemString(self, system: str, numIpus: int) -> DeviceInfo:
        return self.createOfflineIPUDevice({"numIPUs": numIpus, "ipuVersion": system})

    def _simulated(self, type: Any, opts: Optional[dict],
                   connection: Any = DeviceConnectionType.Always) -> DeviceInfo:
        n = int(_opt(opts, "numIPUs", "numIpus", default=1))
        if n < 1:
            raise popart_exception(f"{DeviceType(type).name} device: numIPUs must be >= 1, "
                                   f"got {n}")
        few = DeviceType(type) in (DeviceType.IpuModel, DeviceType.Sim)
        info = DeviceInfo(type, _jax_devices_for(n, cpu_only=type == DeviceType.Cpu),
                          tilesPerIPU=_opt(opts, "tilesPerIPU", "tilesPerIpu",
                                           default=_FEW_TILES if few else _DEFAULT_TILES),
                          version=_opt(opts, "ipuVersion", default="ipu2"),
                          connectionType=connection, options=opts)
        info.attach()
        return info

    # --- "hardware" devices (exclusive while attached) ---
    def enumerateDevices(self, pattern: Any = SyncPattern.Full, numIpus: int = 1,
                         deviceType: Any = DeviceType.Ipu,
                         connectionType: Any = DeviceConnectionType.Always,
                         tilesPerIPU: int = 0) -> list[DeviceInfo]:
        """All devices of ``numIpus`` IPUs, attached or not (none are attached by this call)."""
        if DeviceType(deviceType) != DeviceType.Ipu:
            return []
        ipu_devices = _ipu_devices()
        return [self._hardware(i, g, pattern, connectionType, tilesPerIPU, ipu_devices)
                for i, g in enumerate(_device_groups()) if len(g) == numIpus]

    def tryAcquireAvailableDevice(self, numIpus: int = 1, tilesPerIpu: int = 0,
                                  pattern: Any = SyncPattern.Full,
                                  connectionType: Any = DeviceConnectionType.Always,
                                  selectionCriterion: Any = DeviceSelectionCriterion.First
                                  ) -> Optional[DeviceInfo]:
        """A free device of ``numIpus`` IPUs, or None. Attaches if connectionType is Always."""
        check_arguments(integral(numIpus) and integral(tilesPerIpu), "tryAcquireAvailableDevice",
                        [_AVAILABLE], (self, numIpus, tilesPerIpu))
        self._check_connection(connectionType)
        free = [d for d in self.enumerateDevices(pattern, numIpus, DeviceType.Ipu,
                                                 connectionType, tilesPerIpu)
                if not any(i in _ATTACHED for i in d.ipus)]
        if not free:
            return None
        if DeviceSelectionCriterion(selectionCriterion) == DeviceSelectionCriterion.Random:
            random.shuffle(free)
        return self._connect(free[0])

    def acquireAvailableDevice(self, numIpus: int = 1, tilesPerIpu: int = 0,
                               pattern: Any = SyncPattern.Full,
                               connectionType: Any = DeviceConnectionType.Always,
                               selectionCriterion: Any = DeviceSelectionCriterion.First
                               ) -> DeviceInfo:
        """Like :meth:`tryAcquireAvailableDevice` but raises when no device is free."""
        check_arguments(integral(numIpus) and integral(tilesPerIpu), "acquireAvailableDevice",
                        [_AVAILABLE], (self, numIpus, tilesPerIpu))
        device = self.tryAcquireAvailableDevice(numIpus, tilesPerIpu, pattern,
                                                connectionType, selectionCriterion)
        if device is None:
            raise noted(popart_exception(f"Failed to acquire device with {numIpus} IPUs. "
                                         "Ensure that there are sufficient IPUs available. "
                                         + _GC_MONITOR), self._unavailable(numIpus))
        return device

    def tryAcquireDeviceById(self, id: int, pattern: Any = SyncPattern.Full,
                             connectionType: Any = DeviceConnectionType.Always
                             ) -> Optional[DeviceInfo]:
        """Device ``id`` (see :meth:`enumerateDevices`), or None if it is attached; an id that
        does not exist raises ``poplar_exception``, as Poplar's device manager does."""
        check_arguments(integral(id), "tryAcquireDeviceById", [_BY_ID], (self, id))
        self._check_connection(connectionType, " For offline compilation, use "
                               "createOfflineIPUDevice")
        groups = _device_groups()
        if not 0 <= id < len(groups):
            raise noted(poplar_exception(f"No such device set id: '{id}'"),   # Poplar's text
                        f"valid device ids are 0 to {len(groups) - 1} (see "
                        f"DeviceManager.enumerateDevices)")
        device = self._hardware(id, groups[id], pattern, connectionType, 0)
        if any(i in _ATTACHED for i in device.ipus):
            return None
        return self._connect(device)

    def acquireDeviceById(self, id: int, pattern: Any = SyncPattern.Full,
                          connectionType: Any = DeviceConnectionType.Always) -> DeviceInfo:
        check_arguments(integral(id), "acquireDeviceById", [_BY_ID], (self, id))
        device = self.tryAcquireDeviceById(id, pattern, connectionType)
        if device is None:
            raise noted(popart_exception(f"Failed to acquire device with id '{id}'. Ensure "
                                         "it is available. " + _GC_MONITOR),
                        f"Device {id} is attached to another DeviceInfo; detach it first")
        return device

    @staticmethod
    def _check_connection(connectionType: Any, hint: str = "") -> None:
        if DeviceConnectionType(connectionType) == DeviceConnectionType.Never:
            raise popart_exception("Trying to acquire a hardware device when connectionType "
                                   "is DeviceConnectionType::Never" + hint)

    def setOnDemandAttachTimeout(self, attachTimeout: int) -> None:
        """Seconds that :meth:`DeviceInfo.tryAttachUntilTimeout` keeps retrying."""
        DeviceManager._attach_timeout = float(attachTimeout)

    @staticmethod
    def _hardware(id: int, group: tuple, pattern: Any, connectionType: Any,
                  tilesPerIPU: int, ipu_devices: Optional[list] = None) -> DeviceInfo:
        ipu_devices = ipu_devices or _ipu_devices()
        return DeviceInfo(DeviceType.Ipu, [ipu_devices[i] for i in group], id=id,
                          tilesPerIPU=tilesPerIPU or _DEFAULT_TILES,
                          connectionType=connectionType, pattern=pattern, exclusive=True,
                          ipus=group)

    @staticmethod
    def _connect(device: DeviceInfo) -> DeviceInfo:
        if device.connectionType == DeviceConnectionType.Always and not device.attach():
            raise popart_exception(f"Could not attach to device {device.id}")
        shared = len(set(device.jax_devices))
        if shared < device.numIpus:
            _logger.info(f"Device {device.id}: its {device.numIpus} IPUs run on {shared} "
                         f"{device.jax_devices[0].platform} device(s) of this machine, "
                         f"several IPUs per device (replicas side by side)")
        return device

    @staticmethod
    def _unavailable(numIpus: int) -> str:
        total = num_ipus()
        if numIpus > total:
            return (f"The system has {total} IPUs (set {NUM_IPUS_ENV} for more; "
                    "createIpuModelDevice accepts any numIPUs)")
        return (f"Every device with {numIpus} IPUs is attached; detach one first "
                "(DeviceInfo.detach())")
