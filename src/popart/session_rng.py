"""A session's random seed and PRNG key: setRandomSeed / getRandomSeed and the RNG state
(getRNGState / setRNGState), with PopART's checks and texts."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np

from ._ir.graph import Graph
from .errors import OptionError, noted, popart_exception, popart_runtime_error
from .logging import getLogger
from .session_checks import has_random_ops

_logger = getLogger("session")


def key_data(seed: int) -> np.ndarray:
    """The raw state of the session's PRNG key for ``seed`` (what getRNGState returns)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))


def check_rng_state_enabled(options: Any, what: str, verb: str) -> None:
    """PopART's first check of get/setRNGState: the option that enables them."""
    if not getattr(options, "enableLoadAndOffloadRNGState", False):
        raise noted(OptionError(f"Trying to {verb} the RNG state, but the session option "
                                f"enableLoadAndOffloadRNGState must be set to True."),
                    f"{what}: SessionOptions.enableLoadAndOffloadRNGState is False")


def requires_random_seed(options: Any, program: Optional[Any], graph: Graph,
                         training: bool) -> bool:
    """RandomSetup::requiresRandomSeed: the IR has random ops (what the compiled step
    draws, once planned; before that, the graph's random ops: Dropout only when
    training), or enableStochasticRounding."""
    if getattr(options, "enableStochasticRounding", False):
        return True
    if program is not None:
        return bool(program.uses_rng)
    return has_random_ops(graph, training)


def _no_random(verb: str) -> None:
    _logger.warn(f"Trying to {verb} the random seed, but this session has no random "
                 f"behaviour. Doing nothing.")


# Devicex's checks in Session::setRandomSeed / getRandomSeed, by verb
_NOT_PREPARED = {"set": "Devicex::prepare() must be called before "
                        "Devicex::setRandomSeedFromHost(uint64_t) is called.",
                 "get": "Devicex::prepare() must be called before "
                        "Devicex::getRandomSeedToHost() is called."}


def _require_executable(program: Optional[Any], verb: str, hash_matched: Callable[[], bool]) -> None:
    """Session::assertExecutableLoaded, then Devicex's prepare check. A session has its
    executable from construction, unless its IR hash matched an engine-cache entry
    (Session::setDevice returns before making it); neither is prepared before prepareDevice."""
    if program is not None:
        return
    hint = "call prepareDevice() before setRandomSeed / getRandomSeed"
    if hash_matched():
        raise noted(popart_runtime_error("There is no executatable. Try calling "
                                         "Session::prepareDevice first."),
                    f"(PopART's text, its spelling included.) The engine cache has this "
                    f"program: {hint}")
    raise noted(popart_runtime_error(_NOT_PREPARED[verb]), hint)


class Rng:
    """The seed last set and the step's PRNG key (host data until the program is
    compiled, then on its device: ``place``). ``program`` arguments are the session's
    compiled program, or None before prepareDevice."""

    def __init__(self) -> None:
        self.seed = 0
        self.key: Any = None

    def host_key(self) -> Any:
        """The key (the seed's when none was set)."""
        if self.key is None:
            self.key = key_data(self.seed)
        return self.key

    def place(self, program: Any) -> None:
        """The key on ``program``'s device."""
        self.key = program.put(self.key)

    def _set_key(self, key: Any, program: Optional[Any]) -> None:
        self.key = program.put(key) if program is not None else key

    def set_seed(self, seedValue: Any, random: bool, program: Optional[Any],
                 hash_matched: Callable[[], bool]) -> None:
        """setRandomSeed: ``random``, the session has random behaviour; ``hash_matched``,
        whether its engine-cache entry exists (asked only before prepareDevice)."""
        if not random:
            return _no_random("set")
        _require_executable(program, "set", hash_matched)
        seed = int(seedValue)
        self._set_key(key_data(seed - 2 ** 64 if seed >= 2 ** 63 else seed), program)   # int64 bits
        self.seed = seed

    def get_seed(self, random: bool, program: Optional[Any],
                 hash_matched: Callable[[], bool]) -> int:
        """getRandomSeed (0, with a warning, without random behaviour)."""
        if not random:
            _no_random("get")
            return 0
        _require_executable(program, "get", hash_matched)
        return self.seed

    def state(self, options: Any) -> list[int]:
        """getRNGState's values (none with synthetic data: Devicex::getRngStateToHost copies
        nothing then)."""
        if getattr(getattr(options, "syntheticDataMode", None), "name", "Off") != "Off":
            return []
        key = self.key if self.key is not None else key_data(self.seed)
        return [int(v) for v in np.asarray(key).ravel()]

    def set_state(self, rngValue: Iterable[int], program: Optional[Any]) -> None:
        """setRNGState: the values getRNGState returned."""
        data = np.asarray(list(rngValue), dtype=np.uint32)
        expected = key_data(0).shape
        if data.size != int(np.prod(expected)):
            raise popart_exception(f"setRNGState: expected {int(np.prod(expected))} values (as "
                                   f"getRNGState returns), got {data.size}")
        self._set_key(data.reshape(expected), program)
