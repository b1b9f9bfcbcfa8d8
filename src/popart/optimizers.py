"""PopART's optimizers (API reference 13.4): configuration facades over a chain of parts
(unscale, clip with an engine-supplied norm, the per-weight rule), in pure jax.numpy.

The update formulas and the composition: docs/optimizers.md.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from .engine.norms import GradientNorms, local_sum_squares
from .errors import OptimizerError, incompatible_arguments, noted, real, sequence_of
from .options import AdamMode, AdaptiveMode, SGDAccumulatorAndMomentum, WeightDecayMode
from .tensorinfo import DataType, np_dtype, to_datatype

__all__ = ["OptimizerValue", "OptimizerValueMap", "ClipNormSettings", "Optimizer", "SGD",
           "ConstSGD", "Adam", "Adaptive", "WeightDecayMode", "AdamMode", "AdaptiveMode",
           "SGDAccumulatorAndMomentum"]

Array = Any  # jax.Array or np.ndarray


class OptimizerValue:
    """A hyper-parameter value and whether it is constant for the session's lifetime."""

    def __init__(self, val: "float | tuple[float, bool] | OptimizerValue" = 0.0,
                 isConst: bool = True) -> None:
        if isinstance(val, OptimizerValue):
            val, isConst = val.val(), val.isConst()
        elif isinstance(val, (tuple, list)):
            if len(val) != 2:
                raise OptimizerError(f"OptimizerValue expects a (value, isConst) pair, got {val!r}")
            val, isConst = val
        try:
            self._val = float(val)
        except (TypeError, ValueError):
            raise OptimizerError(f"OptimizerValue expects a float value, got {val!r}") from None
        self._const = bool(isConst)

    def val(self) -> float:
        return self._val

    def isConst(self) -> bool:
        return self._const

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, OptimizerValue)
                and (self._val, self._const) == (other._val, other._const))

    def __hash__(self) -> int:
        return hash((self._val, self._const))

    def __repr__(self) -> str:
        return f"OptimizerValue({self._val}, isConst={self._const})"


class OptimizerValueMap:
    """A default OptimizerValue plus weight-specific overrides."""

    def __init__(self, default: OptimizerValue) -> None:
        self._default = default
        self._specifics: dict[str, OptimizerValue] = {}

    def getDefault(self) -> OptimizerValue:
        return self._default

    def get(self, weightId: str) -> OptimizerValue:
        return self._specifics.get(weightId, self._default)

    __getitem__ = get

    def hasSpecific(self, weightId: str | None = None) -> bool:
        return bool(self._specifics) if weightId is None else weightId in self._specifics

    def insertSpecific(self, weightId: str, value: OptimizerValue) -> None:
        self._specifics[weightId] = value

    def keys(self) -> list[str]:
        """Ids of the weights with specific values."""
        return list(self._specifics)

    def getSpecifics(self) -> dict[str, OptimizerValue]:
        return dict(self._specifics)


# PopART's names of the hyper-parameters in runValueChecks' messages
_VALUE_PHRASES = {"learningRate": "learning rate", "weightDecay": "weight decay",
                  "momentum": "momentum", "dampening": "dampening", "beta1": "beta1",
                  "beta2": "beta2", "alpha": "alpha", "eps": "eps",
                  "velocityScaling": "velocity scaling"}


def _fmt(x: float) -> str:
    """A float32 value as fmt's ``{}`` prints it (-1.0 -> '-1', 0.1 -> '0.1')."""
    text = str(np.float32(x))
    return text[:-2] if text.endswith(".0") else text


class ClipNormSettings:
    """Clip a group's gradients so that their global L2 norm is at most ``maxNorm``."""

    def __init__(self, weightIds: Iterable[str] | None, maxNorm: float) -> None:
        self.weightIds = None if weightIds is None else list(weightIds)  # None: all weights
        self.maxNorm = float(maxNorm)
        if self.maxNorm <= 0:
            raise OptimizerError(f"ClipNormSettings: maxNorm must be > 0, got {maxNorm}")

    @staticmethod
    def clipAllWeights(maxNorm: float) -> "ClipNormSettings":
        return ClipNormSettings(None, maxNorm)

    @staticmethod
    def clipWeights(weightIds: list[str], maxNorm: float) -> "ClipNormSettings":
        return ClipNormSettings(weightIds, maxNorm)

    def getWeightIds(self) -> list[str]:
        return list(self.weightIds or [])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ClipNormSettings)
                and (self.weightIds, self.maxNorm) == (other.weightIds, other.maxNorm))

    def __repr__(self) -> str:
        which = "all weights" if self.weightIds is None else self.weightIds
        return f"ClipNormSettings({which}, maxNorm={self.maxNorm})"


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _dtype(t: Any, weight_dtype: Any) -> np.dtype:
    """NumPy dtype of an accumulator DataType; UNDEFINED / None means the weight's dtype."""
    if t is None or to_datatype(t) == DataType.UNDEFINED:
        return np.dtype(weight_dtype)
    return np_dtype(t)


def _getter(name: str):
    def get(self: "Optimizer") -> OptimizerValueMap:
        return self._maps[name]
    get.__doc__ = f"The {name} values (default and weight-specific)."
    return get


def unscale(grads: Mapping[str, Array], ls: Any) -> dict[str, Array]:
    """The gradients of the loss (at least float32) from those of ``loss * ls``."""
    return {k: jnp.asarray(v, jnp.result_type(v, jnp.float32)) / ls for k, v in grads.items()}


def clip_by_norm(settings: Iterable["ClipNormSettings"], g: Mapping[str, Array],
                 trainable: list[str], norms: GradientNorms = GradientNorms()
                 ) -> dict[str, Array]:
    """PopART's gradient clipping, group after group: each :class:`ClipNormSettings` group
    scaled by ``maxNorm / max(||g_group||, maxNorm)``, its global L2 norm from ``norms``."""
    g = dict(g)
    for c in settings:
        ids = list(trainable) if c.weightIds is None else c.weightIds
        missing = [i for i in ids if i not in trainable]
        if missing:
            raise OptimizerError(f"ClipNormSettings: weights {missing} are not trainable "
                                 f"weights of the model (have {sorted(trainable)})")
        norm = jnp.sqrt(norms.sum_squares(ids, g))
        g = norms.scale(ids, g, c.maxNorm / jnp.maximum(norm, c.maxNorm))
    return g


# ----------------------------------------------------------------- the parts and their chain
# How an engine runs a per-weight rule over its stored form: (rule, weights, grads, state) ->
# (weights, state), ``rule(weights, grads, state, sum_squares)`` taking dicts of whole tensors
# (or of replica shards, with ``sum_squares`` summing over the shards).
PerWeight = Callable[[Callable, dict, dict, dict], tuple[dict, dict]]


def whole_tensors(rule: Callable, w: dict, g: dict, s: dict) -> tuple[dict, dict]:
    """Weights held whole on one device: the rule on all of them, local sums of squares."""
    return rule(w, g, s, local_sum_squares)


@dataclass(frozen=True)
class Context:
    """What one update's parts read: the optimizer (its per-weight values), the runtime
    hyper-parameters, the loss scaling, and the engine's ``norms``, ``per_weight`` and
    trainable weight ids."""
    optimizer: "Optimizer"
    hyper: Mapping[str, Array]
    ls: Any
    norms: GradientNorms
    per_weight: PerWeight
    trainable: list[str]


@dataclass(frozen=True)
class Transform:
    """A part of an optimizer, as optax's ``GradientTransformation(init, update)``:
    ``init(optimizer, weight_id, w)`` -> the state it keeps for a weight (prefix -> (dtype,
    initial value)), ``update(g, w, s, ctx)`` -> (g, w, the state entries it wrote)."""
    init: Callable[["Optimizer", str, Array], dict[str, tuple[np.dtype, float]]]
    update: Callable[[dict, dict, dict, Context], tuple[dict, dict, dict]]


def _no_state(optimizer: "Optimizer", weight_id: str, w: Array) -> dict:
    return {}


def chain(*parts: Transform) -> Transform:
    """The parts one after another (optax's ``chain``): their states side by side."""
    def init(opt: "Optimizer", weight_id: str, w: Array) -> dict:
        return {k: v for p in parts for k, v in p.init(opt, weight_id, w).items()}

    def update(g: dict, w: dict, s: dict, ctx: Context) -> tuple[dict, dict, dict]:
        written: dict = {}
        for p in parts:
            g, w, out = p.update(g, w, {**s, **written}, ctx)
            written.update(out)
        return g, w, written
    return Transform(init, update)


def map_grads(fn: Callable[[Array], Array]) -> Transform:
    """A stateless part applying ``fn`` to each gradient."""
    return Transform(_no_state, lambda g, w, s, ctx: ({k: fn(v) for k, v in g.items()}, w, {}))


def unscale_part() -> Transform:
    """:func:`unscale` by the update's loss scaling."""
    return Transform(_no_state, lambda g, w, s, ctx: (unscale(g, ctx.ls), w, {}))


def clip_part(settings: Iterable["ClipNormSettings"]) -> Transform:
    """:func:`clip_by_norm` with the engine's norms over its trainable weights."""
    settings = list(settings)
    return Transform(_no_state, lambda g, w, s, ctx: (
        clip_by_norm(settings, g, ctx.trainable, ctx.norms) if settings else g, w, {}))


# A per-weight rule: (w, g, its state by prefix, its values by name, ls, sum_squares) ->
# (w, state by prefix), on the unscaled, clipped gradient of one weight.
Rule = Callable[[Array, Array, dict, dict, Any, Callable], tuple[Array, dict]]


def rule_part(optimizer: "Optimizer", fn: "Rule | None" = None,
              spec: "Callable[[str, Array], dict] | None" = None) -> Transform:
    """A per-weight rule run by the engine's ``per_weight``: ``fn`` with the state ``spec``
    (weight id, weight -> prefix -> (dtype, initial value)); by default ``optimizer``'s own
    (``_update``, ``_state_spec``); a given ``fn`` keeps no state unless ``spec`` says."""
    fn = fn or optimizer._update
    spec = spec or (optimizer._state_spec if fn == optimizer._update else lambda wid, w: {})

    def update(g: dict, w: dict, s: dict, ctx: Context) -> tuple[dict, dict, dict]:
        def rule(w, g, s, sum_squares):
            return run_rule(optimizer, fn, spec, w, g, s, ctx.hyper, ctx.ls, sum_squares)
        w2, s2 = ctx.per_weight(rule, w, g, s)
        return g, {**w, **w2}, s2
    return Transform(lambda opt, wid, w: spec(wid, w), update)


def run_rule(optimizer: "Optimizer", fn: Rule, spec: Callable[[str, Array], dict],
             weights: Mapping[str, Array], g: Mapping[str, Array], state: Mapping[str, Array],
             hyper: Mapping[str, Array], ls: Any, sum_squares: Callable[[Array], Array]
             ) -> tuple[dict[str, Array], dict[str, Array]]:
    """``fn`` on each weight, in the gradient's dtype, with the weight's values (runtime ones
    from ``hyper``) and state; the results cast back to the stored dtypes."""
    new_w, new_s = {}, {}
    for wid, w in weights.items():
        h = {n: optimizer.value(hyper, optimizer.hyper_value(wid, n), f"{n}/{wid}")
             for n in optimizer.hyper_names()}
        sp = spec(wid, w)
        s = {p: jnp.asarray(state[p + wid], g[wid].dtype) for p in sp}
        w2, s2 = fn(jnp.asarray(w, g[wid].dtype), g[wid], s, h, ls, sum_squares)
        new_w[wid] = w2.astype(jnp.asarray(w).dtype)
        new_s.update({p + wid: s2[p].astype(sp[p][0]) for p in sp})
    return new_w, new_s


# pybind11's view of the optimizers' constructors (popart.cpp): each parameter's printed
# type and what its caster loads. The package also takes a number or None for the values
# (a changeable learning rate / PopART's defaults), hyper-parameters as keywords and
# DataType names.
def _enum(cls: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, cls)


def _data_type(default: str) -> tuple:
    index = {"FLOAT": 11, "UNDEFINED": 18}[default]   # datatype.hpp's enumerators
    return (f"popart_core.DataType = <DataType.{default}: {index}>",
            lambda v: isinstance(v, (DataType, str)))


_VALUES = ("dict", lambda v: v is None or isinstance(v, Mapping) or real(v))
_CLIP = ("List[popart_core.ClipNormSettings] = []",
         lambda v: sequence_of(v, lambda c: isinstance(c, ClipNormSettings)))
_BOOL = ("bool = False", lambda v: isinstance(v, (numbers.Number, np.bool_)))  # nb_bool
_WD_MODE = ("popart_core.WeightDecayMode = <WeightDecayMode.Decay: 0>", _enum(WeightDecayMode))


def _debug(name: str) -> tuple:
    return (f"popart_core.DebugContext = '{name}'",
            lambda v: isinstance(v, str) or type(v).__name__ == "DebugContext")


def _pybind_init(cls_name: str, params: dict) -> Callable:
    """Check a constructor's arguments as pybind11 does for the binding whose parameters
    are ``params`` (name -> (printed type and default, caster test)): an argument the
    caster cannot load raises pybind11's "incompatible constructor arguments" TypeError."""
    sig = f"popart_core.{cls_name}(" + ", ".join(f"{n}: {t}" for n, (t, _) in params.items()) + ")"

    def wrap(init: Callable) -> Callable:
        # the package's parameter names -> the binding's (SGD's ``values`` is ``pyd`` there)
        rename = dict(zip(list(inspect.signature(init).parameters)[1:], params))

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            given = {**dict(zip(params, args)), **{rename.get(k, k): v for k, v in kwargs.items()}}
            bad = [n for n, (_, ok) in params.items() if n in given and not ok(given[n])]
            if bad or len(args) > len(params):
                raise noted(incompatible_arguments("__init__", [sig], args, True, kwargs),
                            f"{cls_name}: " + (f"'{bad[0]}' cannot be {given[bad[0]]!r}" if bad
                                               else f"{len(args)} positional arguments"))
            init(self, *args, **kwargs)
        return checked
    return wrap


def _check_value_dictionary(values: Mapping) -> None:
    """popart.cpp getOptimizerValueDictionary's checks (PopART's errors); the package also
    takes a value as a number (constant), a list pair or an OptimizerValue."""
    for key, value in values.items():
        if not isinstance(key, str):
            raise OptimizerError("A key in the optimizer map input must be a py::str (in "
                                 "getOptimizerValueDictionary)")
        if not isinstance(value, (tuple, list, OptimizerValue, numbers.Real)):
            raise noted(OptimizerError("A value in the optimizer map must be a py::tuple (in "
                                       "getOptimizerValueDictionary)"),
                        f"'{key}' is {value!r}; give (value, isConst)")


class Optimizer:
    """Base of PopART's optimizers: hyper-parameter maps, loss scaling, clip norms and the
    engine-facing interface (``transform``, ``apply``, ``init_state``, ``non_const_feed``,
    ``check_compatible``, ``scalar_rows``, ``has_accumulator``, ``var_update_type``)."""

    _TYPE = "Optimizer"
    _UNSET: dict[str, float] = {}          # per-weight hyper-parameter -> PopART's default
    _KEY_ALIASES: dict[str, str] = {}      # extra constructor keys -> hyper-parameter
    _SETTINGS: tuple[str, ...] = ()        # structural attributes, fixed once compiled

    def __init__(self, values: Mapping[str, Any] | float | None,
                 clip_norm_settings: Iterable[ClipNormSettings] = (),
                 **kwargs: Any) -> None:
        self._maps = {n: OptimizerValueMap(OptimizerValue(v)) for n, v in self._UNSET.items()}
        self._ls = OptimizerValue(1.0)
        self.clip_norm_settings = list(clip_norm_settings)
        self.accum_type = DataType.UNDEFINED
        if values is None:
            values = {}
        elif not isinstance(values, Mapping):  # popart.SGD(stepLr): a changeable learning rate
            values = {"defaultLearningRate": (values, False)}
        _check_value_dictionary(values)
        keys = {"default" + n[0].upper() + n[1:]: n for n in self._UNSET}
        keys.update(self._KEY_ALIASES, lossScaling="lossScaling")
        snake = {_snake(n): k for k, n in keys.items()}
        given = dict(values)
        for k, v in kwargs.items():
            given[snake.get(k, k)] = v
        for key, v in given.items():
            if key not in keys:
                raise OptimizerError(f"{self.type_name()}: unknown hyper-parameter key '{key}'; "
                                     f"valid keys are {sorted(keys)}")
            ov = self._value(keys[key], v)
            if keys[key] == "lossScaling":
                self._ls = ov
            else:
                self._maps[keys[key]] = OptimizerValueMap(ov)

    # ---------------------------------------------------------------- PopART's Python API
    def _value(self, name: str, v: Any) -> OptimizerValue:
        """``v`` as an OptimizerValue, checked as PopART's ``runValueChecks`` (sgd.cpp,
        adam.cpp, adaptive.cpp: their texts, the package's for other names)."""
        ov = OptimizerValue(v)
        x, t = ov.val(), self.type_name()
        positive = name in ("eps", "velocityScaling", "lossScaling")
        if not (x < 0 or (positive and x == 0) or (name == "learningRate" and x == 0 and ov.isConst())):
            return ov
        phrase = _VALUE_PHRASES.get(name)
        if phrase is None:
            raise OptimizerError(f"{t}: {name} must be {'> 0' if positive else '>= 0'}, got {ov}")
        if positive:
            raise OptimizerError(f"Non-positive {phrase} ({_fmt(x)}) in {t} is not supported")
        if x == 0:
            raise OptimizerError(f"Constant, zero learning rate in {t}, bailing as this might be "
                                 f"a user error.")
        raise OptimizerError(f"Negative {phrase} ({_fmt(x)}) in {t}, bailing as this might be a "
                             f"user error" + ("." if name == "learningRate" else ""))

    def insertSpecific(self, weightId: str, values: Mapping[str, Any]) -> None:
        """Give weight ``weightId`` its own values, e.g. ``{"learningRate": (0.01, False)}``;
        hyper-parameters not named take the current defaults."""
        for key in values:
            if key not in self._maps:
                raise OptimizerError(f"{self.type_name()}.insertSpecific('{weightId}'): unknown "
                                     f"key '{key}'; valid keys are {list(self._maps)}")
        for name, m in self._maps.items():
            v = values.get(name, m.getDefault())
            m.insertSpecific(weightId, self._value(name, v))

    def getLossScalingVal(self) -> float:
        return self._ls.val()

    def lossScaling(self) -> OptimizerValue:
        return self._ls

    # ------------------------------------------------------------- engine-facing interface
    def type_name(self) -> str:
        return self._TYPE

    def hyper_names(self) -> list[str]:
        return list(self._UNSET)

    def hyper_value(self, weight_id: str, name: str) -> OptimizerValue:
        return self._maps[name].get(weight_id)

    def loss_scaling(self) -> OptimizerValue:
        return self._ls

    @property
    def elementwise_rule(self) -> bool:
        """Whether the per-weight rule (:meth:`update`, after clipping) updates each element
        from that element (and its state) only: no norm over a weight (Lamb)."""
        return True

    def settings(self) -> dict[str, Any]:
        """Structural settings; a replacement optimizer must have the same."""
        return {k: getattr(self, k) for k in ("clip_norm_settings",) + self._SETTINGS}

    def non_const_feed(self, weight_ids: Iterable[str]) -> dict[str, np.float32]:
        """Runtime values of every non-const hyper-parameter, keyed ``"<name>/<weight_id>"``
        (and ``"lossScaling"``)."""
        feed = {f"{n}/{w}": np.float32(self.hyper_value(w, n).val())
                for w in weight_ids for n in self.hyper_names()
                if not self.hyper_value(w, n).isConst()}
        if not self._ls.isConst():
            feed["lossScaling"] = np.float32(self._ls.val())
        return feed

    def check_compatible(self, new: "Optimizer", weight_ids: Iterable[str]) -> None:
        """Raise OptimizerError unless ``new`` may replace ``self`` in a compiled session."""
        where = "updateOptimizerFromHost"
        if new.type_name() != self.type_name():
            raise OptimizerError(f"{where}: the session was compiled with a {self.type_name()} "
                                 f"optimizer, got a {new.type_name()} optimizer")
        mine, theirs = self.settings(), new.settings()
        for k in mine:
            if mine[k] != theirs[k]:
                raise OptimizerError(f"{where}: {self.type_name()} setting '{k}' cannot change "
                                     f"after compilation: was {mine[k]!r}, got {theirs[k]!r}")
        pairs = [("lossScaling", "", self._ls, new._ls)]
        pairs += [(n, w, self.hyper_value(w, n), new.hyper_value(w, n))
                  for w in weight_ids for n in self.hyper_names()]
        for name, w, old, nv in pairs:
            what = f"{self.type_name()} {name}" + (f" of weight '{w}'" if w else "")
            if old.isConst() != nv.isConst():
                raise OptimizerError(f"{where}: {what} was compiled with isConst="
                                     f"{old.isConst()}, got isConst={nv.isConst()}")
            if old.isConst() and old.val() != nv.val():
                raise OptimizerError(f"{where}: {what} is const ({old.val()}) and cannot "
                                     f"change; got {nv.val()}")

    def has_specific(self, weight_id: str) -> bool:
        """Whether ``weight_id`` has values of its own (``insertSpecific``)."""
        return any(m.hasSpecific(weight_id) for m in self._maps.values())

    def has_accumulator(self, weight_id: str) -> bool:
        """Whether gradient accumulation keeps ``Accum___<weight_id>`` (PopART's gradient
        accumulator) apart from the optimizer's state."""
        return True

    def var_update_type(self, weight_id: str) -> str:
        """PopART's var-update op type for a weight (in the IR's JSON)."""
        return f"{self.type_name()}VarUpdate"

    def scalar_rows(self, v: Callable[[str], OptimizerValue], ls: OptimizerValue,
                    f: Mapping[str, Any]) -> list[tuple[str, float, tuple]]:
        """PopART's compound scalars of one weight (compoundscalarhelper.hpp): (prefix,
        value, the OptimizerValues that make it non-const) of the optimizer's combo op's
        inputs; ``v(name)`` the weight's values, ``f`` the reduction facts (``ga``:
        accumulating, ``mean``, ``A``, ``R``, ``paf`` / ``prf``: the post accumulation /
        replication factors)."""
        return []

    def accum_dtype(self, weight_dtype: Any) -> np.dtype:
        """dtype of the gradient accumulator (``Accum___``) of a weight of ``weight_dtype``."""
        return _dtype(self.accum_type, weight_dtype)

    def init_state(self, weight_id: str, w: np.ndarray) -> dict[str, np.ndarray]:
        """Initial optimizer state of one weight, keyed by PopART's reserved names."""
        return {p + weight_id: np.full(() if p == "Step___" else np.shape(w), fill, dtype)
                for p, (dtype, fill) in self.transform().init(self, weight_id, w).items()}

    def value(self, hyper: Mapping[str, Array], ov: OptimizerValue, key: str) -> Any:
        """A hyper-parameter's value: the constant, or the runtime value ``hyper[key]``."""
        if ov.isConst():
            return ov.val()
        if key not in hyper:
            raise OptimizerError(f"{self.type_name()}.apply: no runtime value for the "
                                 f"non-const hyper-parameter '{key}'")
        return jnp.asarray(hyper[key], jnp.float32)

    def transform(self) -> "Transform":
        """The optimizer as a chain of parts: :func:`unscale_part`, :func:`clip_part` of its
        clip norm settings, then its per-weight rule (:meth:`update`). A new optimizer
        overrides this (and :meth:`_state_spec` when its rule keeps state)."""
        return chain(unscale_part(), clip_part(self.clip_norm_settings), rule_part(self))

    def apply(self, weights: Mapping[str, Array], grads: Mapping[str, Array],
              state: Mapping[str, Array], hyper: Mapping[str, Array],
              norms: "GradientNorms | None" = None, per_weight: "PerWeight | None" = None,
              trainable: "list[str] | None" = None
              ) -> tuple[dict[str, Array], dict[str, Array]]:
        """One update of ``weights`` from the loss-scaled ``grads``: :meth:`transform`'s
        chain; returns (weights, state). The engine supplies how clipping sums a group's
        squares (``norms``), how a per-weight rule runs over its stored form (``per_weight``)
        and the ids of the trainable weights (default: ``weights``' keys). ``hyper`` holds
        the non-const values keyed as in :meth:`non_const_feed`."""
        ctx = Context(self, hyper, self.value(hyper, self._ls, "lossScaling"),
                      norms or GradientNorms(), per_weight or whole_tensors,
                      list(weights) if trainable is None else list(trainable))
        _, w, s = self.transform().update({k: v for k, v in grads.items() if k in weights},
                                          dict(weights), dict(state), ctx)
        return w, s

    def update(self, weights: Mapping[str, Array], g: Mapping[str, Array],
               state: Mapping[str, Array], hyper: Mapping[str, Array], ls: Any,
               sum_squares: Callable[[Array], Array] = local_sum_squares
               ) -> tuple[dict[str, Array], dict[str, Array]]:
        """The per-weight rule on unscaled, clipped gradients ``g`` (loss scaling ``ls``)."""
        return run_rule(self, self._update, self._state_spec, weights, g, state, hyper, ls,
                        sum_squares)

    # ------------------------------------------------------------- implemented per optimizer
    def _state_spec(self, weight_id: str, w: Array) -> dict[str, tuple[np.dtype, float]]:
        """State tensor prefix -> (dtype, initial value) for one weight."""
        raise NotImplementedError

    def _update(self, w: Array, g: Array, s: dict[str, Array], h: dict[str, Any],
                ls: Any, sum_squares: Callable[[Array], Array]) -> tuple[Array, dict[str, Array]]:
        """New weight and state from the unscaled, clipped gradient ``g``."""
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, nesterov and velocity scaling.

    ``SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.9, True)})``,
    ``SGD(0.05)`` (a non-const learning rate) or ``SGD(learning_rate=0.05)``."""

    _TYPE = "SGD"
    _UNSET = {"learningRate": 0.1, "weightDecay": 0.0, "momentum": 0.0, "dampening": 0.0,
              "velocityScaling": 1.0, "nesterov": 0.0}
    _KEY_ALIASES = {"nesterov": "nesterov"}
    _SETTINGS = ("accumulatorAndMomentum", "accum_type", "accl1_type")

    learningRates = _getter("learningRate")
    weightDecays = _getter("weightDecay")
    momentums = _getter("momentum")
    dampenings = _getter("dampening")
    velocityScalings = _getter("velocityScaling")
    nesterov = _getter("nesterov")

    @_pybind_init("SGD", {
        "pyd": _VALUES, "clip_norm_settings": _CLIP,
        "accumulatorAndMomentum": ("popart_core.SGDAccumulatorAndMomentum = "
                                   "<SGDAccumulatorAndMomentum.Combined: 0>",
                                   _enum(SGDAccumulatorAndMomentum)),
        "accumType": _data_type("UNDEFINED"), "accl1Type": _data_type("UNDEFINED"),
        "debugContext": _debug("sgd")})
    def __init__(self, values: Mapping[str, Any] | float | None = None,
                 clip_norm_settings: Iterable[ClipNormSettings] = (),
                 accumulatorAndMomentum: SGDAccumulatorAndMomentum =
                 SGDAccumulatorAndMomentum.Combined,
                 accumType: Any = DataType.UNDEFINED, accl1Type: Any = DataType.UNDEFINED,
                 debugContext: Any = "sgd", **hyper: Any) -> None:
        super().__init__(values, clip_norm_settings, **hyper)
        self.debugContext = debugContext   # PopART's; names nothing here
        self.accumulatorAndMomentum = SGDAccumulatorAndMomentum(accumulatorAndMomentum)
        self.accum_type, self.accl1_type = to_datatype(accumType), to_datatype(accl1Type)

    def _has_momentum(self, weight_id: str) -> bool:
        mm = self.hyper_value(weight_id, "momentum")
        return not mm.isConst() or mm.val() != 0.0

    def _state_spec(self, weight_id: str, w: Array) -> dict[str, tuple[np.dtype, float]]:
        return {"Accl___": (_dtype(self.accl1_type, w.dtype), 0.0)} \
            if self._has_momentum(weight_id) else {}

    def _combined(self) -> bool:
        return self.accumulatorAndMomentum == SGDAccumulatorAndMomentum.Combined

    def has_accumulator(self, weight_id: str) -> bool:
        """SGD1 (momentum combined with the accumulator) keeps both in ``Accl___``."""
        return not (self._combined() and self._has_momentum(weight_id))

    def var_update_type(self, weight_id: str) -> str:
        """SGD0 without momentum, SGD1 / SGD2 with it (combined / separate accumulators)."""
        if not self._has_momentum(weight_id):
            return "SGD0VarUpdate"
        return "SGD1VarUpdate" if self._combined() else "SGD2VarUpdate"

    def scalar_rows(self, v, ls, f):
        """SGD0 / SGD1 / SGD2's compound scalars (SGD::getInputIds)."""
        lr, wd, mm, dp, vs = (v(n) for n in ("learningRate", "weightDecay", "momentum",
                                             "dampening", "velocityScaling"))
        if mm.isConst() and mm.val() == 0.0:   # SGD0
            return [("scaledLearningRate0", lr.val() * (1 - dp.val()) /
                     (ls.val() * f["paf"] * f["prf"]), (lr, dp, ls)),
                    ("weightDecayScaleFactor0", 1 - lr.val() * (1 - dp.val()) * wd.val(),
                     (lr, dp, wd))]
        swd = ("scaledWeightDecay1", (1 - dp.val()) * wd.val() * vs.val(), (dp, wd, vs))
        if self._combined():   # SGD1
            rf = f["R"] if f["ga"] else 1.0
            rfd = f["R"] if f["ga"] and not f["mean"] else \
                1.0 / f["R"] if not f["ga"] and f["mean"] else 1.0
            afd = f["A"] if f["mean"] else 1.0
            rows = [swd, ("scaledLearningRate1", lr.val() / (vs.val() * rf), (lr, vs)),
                    ("scaledMomentum1", mm.val() / rf, (mm,)),
                    ("dampeningScaleFactor1", (1 - dp.val()) * vs.val() * rfd /
                     (ls.val() * afd), (dp, vs, ls))]
            nesterov = [("nesterovDampeningScaleFactor1", f["paf"] /
                         ((1 - dp.val()) * vs.val() * rfd), (dp, vs, ls)),
                        ("nesterovGradScaleFactor1", vs.val() * rf, (vs,))]
        else:   # SGD2
            rows = [swd, ("scaledLearningRate2", lr.val() / vs.val(), (lr, vs)),
                    ("scaledMomentum2", mm.val(), (mm,)),
                    ("dampeningScaleFactor2", (1 - dp.val()) * vs.val() /
                     (ls.val() * f["paf"] * f["prf"]), (dp, vs, ls))]
            nesterov = [("nesterovDampeningScaleFactor2", f["paf"] * f["prf"] /
                         ((1 - dp.val()) * vs.val()), (dp, vs, ls)),
                        ("nesterovGradScaleFactor2", vs.val(), (vs,))]
        if v("nesterov").val() != 0 and mm.val() > 0:   # SGD::enableNesterov
            rows += nesterov + [("sgdMomentum", mm.val(), (mm,)),
                                ("sgdWeightDecay", wd.val(), (wd,))]
        return rows

    def _update(self, w, g, s, h, ls, sum_squares):
        mm, dm, wd, lr, vs = (h[k] for k in ("momentum", "dampening", "weightDecay",
                                             "learningRate", "velocityScaling"))
        # The stored velocity is vs * v (PopART's velocity scaling): V' = mm*V + vs*(1-dm)*(g+wd*w).
        vel = mm * s.get("Accl___", 0.0) + vs * (1 - dm) * (g + wd * w)
        step = jnp.where(h["nesterov"] != 0, g + wd * w + mm * vel / vs, vel / vs)
        return w - lr * step, ({"Accl___": vel} if "Accl___" in s else {})


class ConstSGD(SGD):
    """SGD with a constant learning rate, weight decay and loss scaling."""

    @_pybind_init("ConstSGD", {"learning_rate": ("float", real),
                               "weight_decay": ("float = 0.0", real),
                               "loss_scaling": ("float = 1.0", real),
                               "clip_norm_settings": _CLIP})
    def __init__(self, learning_rate: float, weight_decay: float = 0.0,
                 loss_scaling: float = 1.0,
                 clip_norm_settings: Iterable[ClipNormSettings] = ()) -> None:
        super().__init__({"defaultLearningRate": (learning_rate, True),
                          "defaultWeightDecay": (weight_decay, True),
                          "lossScaling": (loss_scaling, True)}, clip_norm_settings)


class Adam(Optimizer):
    """Adam, AdamW, AdamNoBias, Lamb, LambNoBias and AdaMax (rules: docs/optimizers.md)."""

    _TYPE = "Adam"
    _UNSET = {"learningRate": 0.1, "weightDecay": 0.0, "beta1": 0.9, "beta2": 0.999,
              "eps": 1e-6, "maxWeightNorm": 10.0}
    _KEY_ALIASES = {"maxWeightNorm": "maxWeightNorm"}
    _SETTINGS = ("mode", "weight_decay_mode", "accum_type", "accl1_type", "accl2_type",
                 "scaled_optimizer_state")

    learningRates = _getter("learningRate")
    weightDecays = _getter("weightDecay")
    beta1s = _getter("beta1")
    beta2s = _getter("beta2")
    epss = _getter("eps")
    maxWeightNorms = _getter("maxWeightNorm")

    @_pybind_init("Adam", {
        "values": _VALUES, "mode": ("popart_core.AdamMode = <AdamMode.Adam: 0>", _enum(AdamMode)),
        "weight_decay_mode": _WD_MODE, "accum_type": _data_type("UNDEFINED"),
        "accl1_type": _data_type("FLOAT"), "accl2_type": _data_type("FLOAT"),
        "clip_norm_settings": _CLIP, "scaled_optimizer_state": _BOOL,
        "debugContext": _debug("adam")})
    def __init__(self, values: Mapping[str, Any] | float | None = None,
                 mode: AdamMode = AdamMode.Adam,
                 weight_decay_mode: WeightDecayMode = WeightDecayMode.Decay,
                 accum_type: Any = DataType.UNDEFINED, accl1_type: Any = DataType.FLOAT,
                 accl2_type: Any = DataType.FLOAT,
                 clip_norm_settings: Iterable[ClipNormSettings] = (),
                 scaled_optimizer_state: bool = False, debugContext: Any = "adam",
                 **hyper: Any) -> None:
        super().__init__(values, clip_norm_settings, **hyper)
        self.debugContext = debugContext   # PopART's; names nothing here
        self.mode, self.weight_decay_mode = AdamMode(mode), WeightDecayMode(weight_decay_mode)
        self.accum_type, self.accl1_type, self.accl2_type = (
            to_datatype(accum_type), to_datatype(accl1_type), to_datatype(accl2_type))
        self.scaled_optimizer_state = bool(scaled_optimizer_state)

    def _state_spec(self, weight_id: str, w: Array) -> dict[str, tuple[np.dtype, float]]:
        return {"Accl1___": (_dtype(self.accl1_type, w.dtype), 0.0),
                "Accl2___": (_dtype(self.accl2_type, w.dtype), 0.0),
                "Step___": (np.dtype(np.float32), 0.0)}

    def scalar_rows(self, v, ls, f):
        """Adam's compound scalars (Adam::getInputIds)."""
        one, scaled = OptimizerValue(1.0, True), self.scaled_optimizer_state
        l2 = scaled and self.weight_decay_mode == WeightDecayMode.L2Regularization
        lr, wd = v("learningRate"), v("weightDecay")
        return [("learningRate", lr.val(), (lr,)),
                ("weightDecay", wd.val() * (ls.val() if l2 else 1.0), (wd, ls if l2 else one)),
                ("adamBeta1", v("beta1").val(), (v("beta1"),)),
                ("adamBeta2", v("beta2").val(), (v("beta2"),)),
                ("adamEps", v("eps").val() * (ls.val() if scaled else 1.0),
                 (v("eps"), ls if scaled else one)),
                ("lossScaling", ls.val(), (ls,)),
                ("maxWeightNorm", v("maxWeightNorm").val(), (v("maxWeightNorm"),)),
                ("adamGradientScaling", 1.0 / ((1.0 if scaled else ls.val()) * f["paf"] *
                                               f["prf"]), (one if scaled else ls,))]

    @property
    def elementwise_rule(self) -> bool:
        return self.mode not in (AdamMode.Lamb, AdamMode.LambNoBias)

    def _update(self, w, g, s, h, ls, sum_squares):
        M = AdamMode
        b1, b2, eps, wd = h["beta1"], h["beta2"], h["eps"], h["weightDecay"]
        sc = ls if self.scaled_optimizer_state else 1.0   # state kept scaled by ls (and ls^2)
        l2 = self.weight_decay_mode == WeightDecayMode.L2Regularization
        gt = sc * (g + wd * w) if l2 else sc * g
        m = b1 * s["Accl1___"] + (1 - b1) * gt
        if self.mode == M.AdaMax:
            v = jnp.maximum(b2 * s["Accl2___"], jnp.abs(gt))
        else:
            v = b2 * s["Accl2___"] + (1 - b2) * jnp.square(gt)
        t = s["Step___"] + 1
        mh = m / (1 - b1 ** t) if self.mode in (M.Adam, M.Lamb, M.AdaMax) else m
        vh = v / (1 - b2 ** t) if self.mode in (M.Adam, M.Lamb) else v
        u = mh / ((vh if self.mode == M.AdaMax else jnp.sqrt(vh)) + eps * sc)
        if not l2:
            u = u + wd * w
        if self.mode in (M.Lamb, M.LambNoBias):
            r1 = jnp.minimum(jnp.sqrt(sum_squares(w)), h["maxWeightNorm"])
            r2 = jnp.sqrt(sum_squares(u))
            ok = (r1 > 0) & (r2 > 0)
            u = u * jnp.where(ok, r1 / jnp.where(ok, r2, 1.0), 1.0)
        return w - h["learningRate"] * u, {"Accl1___": m, "Accl2___": v, "Step___": t}


class Adaptive(Optimizer):
    """AdaGrad, RMSProp, CenteredRMSProp and AdaDelta (rules: docs/optimizers.md)."""

    _TYPE = "Adaptive"
    _UNSET = {"learningRate": 0.01, "weightDecay": 0.0, "alpha": 0.99, "momentum": 0.0,
              "eps": 1e-6}
    _SETTINGS = ("mode", "weight_decay_mode", "accum_type", "accl1_type", "accl2_type",
                 "accl3_type", "rmsprop_tf_variant")

    learningRates = _getter("learningRate")
    weightDecays = _getter("weightDecay")
    alphas = _getter("alpha")
    momentums = _getter("momentum")
    epss = _getter("eps")

    @_pybind_init("Adaptive", {
        "values": _VALUES,
        "mode": ("popart_core.AdaptiveMode = <AdaptiveMode.RMSProp: 1>", _enum(AdaptiveMode)),
        "weight_decay_mode": _WD_MODE, "accum_type": _data_type("UNDEFINED"),
        "accl1_type": _data_type("FLOAT"), "accl2_type": _data_type("FLOAT"),
        "accl3_type": _data_type("UNDEFINED"), "rmsprop_tf_variant": _BOOL,
        "debugContext": _debug("adaptive")})
    def __init__(self, values: Mapping[str, Any] | float | None = None,
                 mode: AdaptiveMode = AdaptiveMode.RMSProp,
                 weight_decay_mode: WeightDecayMode = WeightDecayMode.Decay,
                 accum_type: Any = DataType.UNDEFINED, accl1_type: Any = DataType.FLOAT,
                 accl2_type: Any = DataType.FLOAT, accl3_type: Any = DataType.UNDEFINED,
                 rmsprop_tf_variant: bool = False, debugContext: Any = "adaptive",
                 **hyper: Any) -> None:
        super().__init__(values, (), **hyper)
        self.debugContext = debugContext   # PopART's; names nothing here
        self.mode, self.weight_decay_mode = AdaptiveMode(mode), WeightDecayMode(weight_decay_mode)
        self.accum_type, self.accl1_type, self.accl2_type, self.accl3_type = (
            to_datatype(t) for t in (accum_type, accl1_type, accl2_type, accl3_type))
        self.rmsprop_tf_variant = bool(rmsprop_tf_variant)

    def _state_spec(self, weight_id: str, w: Array) -> dict[str, tuple[np.dtype, float]]:
        spec = {"Accl1___": (_dtype(self.accl1_type, w.dtype),
                             1.0 if self.rmsprop_tf_variant else 0.0)}
        if self.mode in (AdaptiveMode.CenteredRMSProp, AdaptiveMode.AdaDelta):
            spec["Accl2___"] = (_dtype(self.accl2_type, w.dtype), 0.0)
        mm = self.hyper_value(weight_id, "momentum")
        if not mm.isConst() or mm.val() > 0.0:
            spec["Accl3___"] = (_dtype(self.accl3_type, w.dtype), 0.0)
        return spec

    def scalar_rows(self, v, ls, f):
        """Adaptive's compound scalars (Adaptive::getInputIds)."""
        lr, wd = v("learningRate"), v("weightDecay")
        return [("learningRate", lr.val(), (lr,)), ("weightDecay", wd.val(), (wd,)),
                ("adaptiveAlpha", v("alpha").val(), (v("alpha"),)),
                ("adaptiveMomentum", v("momentum").val(), (v("momentum"),)),
                ("adaptiveEps", v("eps").val(), (v("eps"),)),
                ("lossScaling", ls.val(), (ls,)),
                ("adaptiveGradientScaling", 1.0 / (ls.val() * f["paf"] * f["prf"]), (ls,))]

    def _update(self, w, g, s, h, ls, sum_squares):
        A = AdaptiveMode
        a, eps, wd, lr = h["alpha"], h["eps"], h["weightDecay"], h["learningRate"]
        l2 = self.weight_decay_mode == WeightDecayMode.L2Regularization
        tf = self.rmsprop_tf_variant
        gt = g + wd * w if l2 else g
        out = dict(s)
        if self.mode == A.AdaGrad:
            out["Accl1___"] = s["Accl1___"] + jnp.square(gt)
        else:
            out["Accl1___"] = a * s["Accl1___"] + (1 - a) * jnp.square(gt)
        if self.mode == A.AdaDelta:
            x = gt * jnp.sqrt(s["Accl2___"] + eps) / jnp.sqrt(out["Accl1___"] + eps)
            out["Accl2___"] = a * s["Accl2___"] + (1 - a) * jnp.square(x)
        else:
            d = out["Accl1___"]
            if self.mode == A.CenteredRMSProp:
                out["Accl2___"] = a * s["Accl2___"] + (1 - a) * gt
                d = d - jnp.square(out["Accl2___"])
            x = gt / jnp.sqrt(d + eps) if tf else gt / (jnp.sqrt(d) + eps)
        decay = 0.0 if l2 else wd
        if "Accl3___" not in s:
            return w - lr * (x + decay * w), out
        if tf:  # PopART's TF variant accumulates lr into the momentum buffer
            out["Accl3___"] = h["momentum"] * s["Accl3___"] + lr * x
            return w * (1 - decay) - out["Accl3___"], out
        out["Accl3___"] = h["momentum"] * s["Accl3___"] + x
        return w - lr * (out["Accl3___"] + decay * w), out
