"""The step program: one compiled XLA program per session.

A ``run()`` is one call into it. Inside: a ``lax.scan`` over batchesPerStep, within each batch a
``lax.scan`` over the accumulationFactor micro-batches, replicas side by side (``vmap`` with a
named axis, so collectives work), the forward pass, and for training the backward pass
(``jax.value_and_grad``), gradient accumulation, the replica reduction and the optimizer update.
Weights, optimizer state and the RNG key live on the device between runs (donated buffers);
the host moves only the step's inputs and anchors.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import jax
import jax.export  # noqa: F401  (jax < 0.7 does not import it with jax)
import jax.numpy as jnp
import numpy as np

from .. import distributed
from ..dataflow import AnchorReturnTypeId
from ..errors import ModelError, OutOfMemoryException, popart_exception, popart_runtime_error
from ..ir.graph import Graph
from ..tensorinfo import TensorInfo
from .lower import CHECKS, TraceState, check_flags, execute, first_failure, raise_failed_checks

GRAD_PREFIX = "Gradient___"
ALS_SCALE = "lossScaling_FLOAT"          # the automatic loss scale (optimizer state, anchorable)
ALS_STEP = "lossScaling_updateCounter"
FP16_MAX = 65504.0
REPLICA_AXIS = "replica"


@dataclass
class StepConfig:
    """Everything that shapes the compiled step."""
    batches_per_step: int
    accumulation_factor: int = 1
    replication_factor: int = 1
    anchors: dict = field(default_factory=dict)     # id -> popart.AnchorReturnType
    training: bool = False
    loss: Optional[str] = None
    optimizer: Any = None
    mean_reduction: bool = False                    # accumulation/replication reduction is Mean
    running_mean: bool = False                      # MeanReductionStrategy.Running
    als: Any = None                                 # AutomaticLossScalingSettings when enabled
    options: Any = None


@contextlib.contextmanager
def xla_errors(what: str) -> Iterator[None]:
    """XLA's own errors (out of memory, ...) as popart errors."""
    try:
        yield
    except Exception as e:
        if isinstance(e, popart_exception) or not (
                isinstance(e, MemoryError) or type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")):
            raise
        msg = " ".join(str(e).split())[:800]
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in msg:
            raise OutOfMemoryException(f"{what}: out of memory ({msg})") from None
        raise popart_runtime_error(f"{what}: {msg}") from None


def split_variables(graph: Graph) -> tuple[dict, dict]:
    """(variables, constants): float initializers are device-resident variables; the rest
    (integer shape tensors and declared constants) are compile-time constants."""
    variables, constants = {}, {}
    for tid, v in graph.initializers.items():
        if np.issubdtype(v.dtype, np.floating) and tid not in graph.constants or \
                v.dtype.name in ("bfloat16", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            variables[tid] = v
        else:
            constants[tid] = v
    return variables, constants


def _scan(f, init, xs):
    """``lax.scan``, or a direct call for a single step (XLA optimises straight-line code
    better than a loop of one iteration)."""
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if n != 1:
        return jax.lax.scan(f, init, xs)
    carry, y = f(init, jax.tree_util.tree_map(lambda a: a[0], xs))
    return carry, jax.tree_util.tree_map(lambda a: a[None], y)


def vector_chunk(n: int, bytes_per_item: int, budget: int = 1 << 26) -> int:
    """The largest divisor of ``n`` whose chunk of micro-batches keeps its activations within
    ``budget`` bytes."""
    cap = max(1, budget // max(1, bytes_per_item))
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= cap)


class StepProgram:
    """Builds, compiles and runs the step of one session."""

    def __init__(self, graph: Graph, cfg: StepConfig, input_infos: Mapping[str, TensorInfo],
                 device: Any = None):
        self.graph, self.cfg, self.input_infos, self.device = graph, cfg, dict(input_infos), device
        self.variables, self.constants = split_variables(graph)
        self.graph_consts = Graph(**{**graph.__dict__, "initializers": self.constants})
        self.trainable: list[str] = []
        self.assigned: list[str] = []
        self.anchor_ids = list(cfg.anchors)
        self.compiled = None
        self._opt_state: Optional[dict] = None
        self.uses_rng = True
        self.compile_seconds = 0.0
        self.run_checks: list = []   # RunCheck of every ctx.check by id (the trace's registry)

    # ------------------------------------------------------------------ tracing helpers
    def _trace(self, weights, feeds, key, probes=None, training=False):
        axis = REPLICA_AXIS if self.cfg.replication_factor > 1 else None
        state = TraceState(training=training, rng_key=key, replica_axis=axis,
                           replication_factor=self.cfg.replication_factor,
                           options=self.cfg.options, probes=probes or {},
                           platform=self._platform())
        env = execute(self.graph_consts, feeds, state, weights=weights)
        return env, state

    @staticmethod
    def _value(env, tid):
        return jnp.asarray(env[tid])   # plan() has checked every anchor names a tensor

    def plan(self) -> None:
        """Decide trainable variables and gradient anchors (abstract trace, no compile)."""
        cfg = self.cfg
        specs = {k: jax.ShapeDtypeStruct(tuple(i.shape()), i.np_dtype()) for k, i in self.input_infos.items()}
        wspecs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.variables.items()}
        out = {}

        def probe(weights, feeds):
            env, state = self._trace(weights, feeds, jax.random.key(0), training=cfg.training)
            out["ids"] = set(env)
            out["assigned"] = list(state.assignments)
            out["checks"] = list(state.registry)
            out["dtypes"] = {o: getattr(env.get(o), "dtype", None) for o in self.graph.outputs}
            out["rng"] = state.used_rng()
            out["act"] = sum(int(np.prod(jnp.shape(v))) * jnp.result_type(v).itemsize
                             for v in env.values() if isinstance(v, jax.core.Tracer))
            if cfg.training:
                if cfg.loss not in env:
                    raise popart_exception(f"The loss tensor '{cfg.loss}' is not a tensor of the model")
                out["loss_shape"] = jnp.shape(env[cfg.loss])
            shapes = {}
            for a in self.anchor_ids:
                base = a[len(GRAD_PREFIX):] if a.startswith(GRAD_PREFIX) else a
                if base in env and env[base] is not None:
                    shapes[a] = jax.ShapeDtypeStruct(jnp.shape(env[base]), jnp.result_type(env[base]))
            return shapes

        self.anchor_specs = jax.eval_shape(probe, wspecs, specs)
        self.assigned = out["assigned"]
        self.run_checks = out["checks"]
        for o, dtype in out["dtypes"].items():   # ONNX Runtime rejects these models too
            info = self.graph.tensor_info.get(o)
            if info is not None and dtype is not None and np.dtype(dtype) != info.np_dtype():
                raise ModelError(f"Graph output '{o}' is declared as {info.data_type()}, but the "
                                 f"model computes {np.dtype(dtype)} for it")
        self.uses_rng = out["rng"]
        self.activation_bytes = out["act"]   # every traced tensor of one micro-batch
        if cfg.training:
            if out["loss_shape"] != ():
                raise popart_exception(f"The loss tensor '{cfg.loss}' must be a scalar after "
                                       f"reduction, but its shape is {list(out['loss_shape'])}; "
                                       f"use a loss op with reduction Sum or Mean")
            self.trainable = [k for k in self.variables if k not in self.assigned]
        opt_ids = set(self.opt_state_ids())
        for a in self.anchor_ids:
            if a in self.anchor_specs or a in opt_ids:
                continue
            base = a[len(GRAD_PREFIX):] if a.startswith(GRAD_PREFIX) else a
            if a.startswith(GRAD_PREFIX) and not cfg.training:
                raise popart_exception(f"Anchor '{a}' is a gradient, which exists only in a TrainingSession")
            raise popart_exception(f"Anchor '{a}' names no tensor of the model (it has "
                                   f"{len(out['ids'])} tensors, e.g. "
                                   f"{', '.join(sorted(out['ids'])[:8])})")

    # ------------------------------------------------------------------ optimizer state
    def init_opt_state(self) -> dict:
        """The initial optimizer state, keyed by PopART's reserved names (computed once; the
        caller copies it before changing it)."""
        if self._opt_state is None:
            state = {}
            if self.cfg.training:
                for w in self.trainable:
                    state.update(self.cfg.optimizer.init_state(w, self.variables[w]))
                if self.cfg.als is not None:
                    state[ALS_SCALE] = np.float32(self.cfg.optimizer.loss_scaling().val())
                    state[ALS_STEP] = np.int32(0)
            self._opt_state = {k: np.asarray(v) for k, v in state.items()}
        return self._opt_state

    def opt_state_ids(self) -> list[str]:
        return list(self.init_opt_state())

    # ------------------------------------------------------------------ the step
    def _micro_fn(self):
        """(weights, feeds_per_replica, key) -> (anchor values, grads, assignments)."""
        cfg = self.cfg
        grad_ids = [a[len(GRAD_PREFIX):] for a in self.anchor_ids if a.startswith(GRAD_PREFIX)]
        fwd_ids = [a for a in self.anchor_ids if a in self.anchor_specs and not a.startswith(GRAD_PREFIX)]

        if not cfg.training:
            def micro(weights, feeds, key, hyper):
                env, state = self._trace(weights, feeds, key)
                return self._with_checks({a: self._value(env, a) for a in fwd_ids}, state), {}, {}
            return micro

        trainable = self.trainable
        probe_ids = [g for g in grad_ids if g not in trainable]

        def micro(weights, feeds, key, hyper):
            train_w = {k: weights[k] for k in trainable}
            other_w = {k: v for k, v in weights.items() if k not in train_w}
            probe_shapes = {p: self.anchor_specs[GRAD_PREFIX + p] for p in probe_ids}
            probes0 = {p: jnp.zeros(s.shape, s.dtype) for p, s in probe_shapes.items()}

            def loss_fn(tw, probes):
                env, state = self._trace({**other_w, **tw}, feeds, key, probes, training=True)
                loss = env[cfg.loss]
                ls = hyper["__als"] if "__als" in hyper else self._hyper(hyper, "lossScaling")
                scaled = loss * jnp.asarray(ls, loss.dtype)
                vals = self._with_checks({a: self._value(env, a) for a in fwd_ids}, state)
                return scaled, (vals, dict(state.assignments))

            (_, (vals, assigns)), (gw, gp) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True)(train_w, probes0)
            for g in grad_ids:
                vals[GRAD_PREFIX + g] = gw[g] if g in gw else gp[g]
            return vals, gw, assigns
        return micro

    def _with_checks(self, vals: dict, state: TraceState) -> dict:
        """The anchor values of a micro-batch and, under ``CHECKS``, the record of its
        first failed run-time check (of the checks plan() found)."""
        if state.registry != self.run_checks:
            raise popart_exception("Internal error: the step's run-time checks differ from the "
                                   "planned ones")
        flags = check_flags(state)
        return vals if flags is None else {**vals, CHECKS: flags}

    def raise_failed_checks(self, anchors: dict) -> None:
        """Remove the checks' record from a run's outputs; raise popart_runtime_error if a
        check failed."""
        flags = anchors.pop(CHECKS, None)
        if flags is not None:
            raise_failed_checks(self.to_host(flags), self.run_checks)

    def _auto_loss_scale(self, grads: dict, opt_state: dict, hyper: dict) -> tuple[dict, dict]:
        """Automatic loss scaling: gradients were computed with the dynamic scale; rescale them
        to the optimizer's static scale, then every ``updatePeriod`` batches halve the scale if
        more than ``thresholdUpperCountProportion`` of the gradient values lie above
        ``binEdgeLocation`` * max(float16) (or are not finite), else double it."""
        als = self.cfg.als
        scale = opt_state[ALS_SCALE]
        static = jnp.asarray(self._hyper(hyper, "lossScaling"), jnp.float32)
        flat = [jnp.abs(g.astype(jnp.float32)).ravel() for g in grads.values()]
        total = sum(f.size for f in flat)
        upper = sum(jnp.sum((f > als.binEdgeLocation * FP16_MAX) | ~jnp.isfinite(f)) for f in flat)
        too_big = upper.astype(jnp.float32) / max(total, 1) > als.thresholdUpperCountProportion
        step = opt_state[ALS_STEP] + 1
        update = step % max(int(als.updatePeriod), 1) == 0
        new_scale = jnp.where(update, jnp.where(too_big, scale / 2, scale * 2), scale)
        new_scale = jnp.clip(new_scale, 2.0 ** -14, 2.0 ** 24)
        grads = {k: g * (static / scale).astype(g.dtype) for k, g in grads.items()}
        return grads, {**opt_state, ALS_SCALE: new_scale.astype(jnp.float32), ALS_STEP: step}

    def _hyper(self, hyper, name):
        if name in hyper:
            return hyper[name]
        return self.cfg.optimizer.loss_scaling().val() if self.cfg.optimizer is not None else 1.0

    def _split(self, key, n: int):
        """``n`` keys from ``key``; when the graph draws no random numbers, ``n`` copies
        (no threefry work in the compiled program)."""
        if self.uses_rng:
            return jax.random.split(key, n)
        return jax.random.wrap_key_data(jnp.broadcast_to(jax.random.key_data(key),
                                                         (n,) + jax.random.key_data(key).shape))

    def replica_devices(self) -> list:
        """Distinct jax devices for the replicas, or [] to run them side by side. In a
        distributed job, each process's replicas are its first local devices."""
        R = self.cfg.replication_factor
        n = distributed.process_count()
        if n > 1:
            local = R // n
            devs = [d for p in range(n) for d in [d for d in jax.devices() if d.process_index == p][:local]]
            if len(devs) != R:
                raise popart_exception(f"Global replication needs {local} device(s) in each of "
                                       f"the {n} processes; some process has fewer")
            return devs
        devs = list(getattr(self.device, "jax_devices", None) or [])
        if R > 1 and len(set(devs)) >= R:
            return devs[:R]
        return []

    def _replicated(self, micro):
        """Run ``micro`` for every replica: one replica per device (shard_map over a mesh
        axis) when the session's device has enough distinct devices, else side by side (vmap
        with the same axis name); collectives work over the axis either way. With one replica,
        directly (no extra dimension for XLA to carry)."""
        if self.replica_devices():
            mesh = jax.sharding.Mesh(np.array(self.replica_devices()), (REPLICA_AXIS,))
            P = jax.sharding.PartitionSpec

            def per_device(weights, feeds, keys, hyper):   # feeds / keys: this replica's [1, ...]
                out = micro(weights, jax.tree_util.tree_map(lambda a: a[0], feeds), keys[0], hyper)
                return jax.tree_util.tree_map(lambda a: a[None], out)
            return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(REPLICA_AXIS), P(REPLICA_AXIS), P()),
                                 out_specs=P(REPLICA_AXIS), check_vma=False)
        if self.cfg.replication_factor > 1:
            return jax.vmap(micro, in_axes=(None, 0, 0, None), axis_name=REPLICA_AXIS)

        def single(weights, feeds, keys, hyper):
            out = micro(weights, jax.tree_util.tree_map(lambda a: a[0], feeds), keys[0], hyper)
            return jax.tree_util.tree_map(lambda a: a[None], out)
        return single

    def _inference_step_fn(self):
        """Inference has no state between micro-batches, so they are vectorised: chunks of
        micro-batches run as one wider batch (vmap), the chunks in a scan. Bigger matmuls and
        convolutions are what XLA's CPU and GPU backends run fastest."""
        cfg = self.cfg
        R, A, B = cfg.replication_factor, cfg.accumulation_factor, cfg.batches_per_step
        n = B * A
        chunk = vector_chunk(n, self.activation_bytes * R, self._vector_budget())
        replicas = self._replicated(self._micro_fn())

        def step(weights, opt_state, key_data, feeds, hyper):
            key = jax.random.wrap_key_data(key_data)

            def one(f, k):
                return replicas(weights, f, self._split(k, R), hyper)[0]

            key, sub = self._split(key, 2)
            flat = jax.tree_util.tree_map(lambda a: a.reshape((n // chunk, chunk) + a.shape[2:]), feeds)
            keys = self._split(sub, n).reshape((n // chunk, chunk))
            _, vals = _scan(lambda c, xs: (c, jax.vmap(one)(*xs)), None, (flat, keys))
            vals = jax.tree_util.tree_map(lambda v: v.reshape((B, A) + v.shape[2:]), vals)
            return weights, opt_state, jax.random.key_data(key), self._reduce_anchors(vals)

        return step

    def _platform(self) -> str:
        return next(iter(self._shardings()[0].device_set)).platform

    def _vector_budget(self) -> int:
        """Activation bytes a vectorised chunk may hold. XLA's CPU convolutions run slower on
        wider batches (cache), so conv nets on the CPU run micro-batch by micro-batch; matmul
        models gain from wider batches everywhere. POPART_VECTOR_BYTES overrides."""
        if "POPART_VECTOR_BYTES" in os.environ:
            return int(os.environ["POPART_VECTOR_BYTES"])
        on_cpu = self._platform() == "cpu"
        convs = any(n.op_type in ("Conv", "ConvTranspose", "MultiConv") for n in self.graph.nodes)
        return 1 if on_cpu and convs else 1 << 26

    def _step_fn(self):
        cfg = self.cfg
        if not cfg.training:
            return self._inference_step_fn()
        R, A, B = cfg.replication_factor, cfg.accumulation_factor, cfg.batches_per_step
        replicas = self._replicated(self._micro_fn())
        anchor_opt = [a for a in self.anchor_ids if a in self.opt_state_ids()]

        def accumulate(grads_acc, count, grads):
            g = {k: jnp.sum(v, axis=0) for k, v in grads.items()}          # replica reduction
            if cfg.mean_reduction and cfg.running_mean:
                n = count + 1.0
                return {k: grads_acc[k] * (count / n) + g[k] / (R * n) for k in g}
            return {k: grads_acc[k] + g[k] for k in g}

        def step(weights, opt_state, key_data, feeds, hyper):
            key = jax.random.wrap_key_data(key_data)

            def batch(carry, xs):
                weights, opt_state = carry
                feeds, bkey = xs                                          # feeds: [A, R, ...]

                def micro_batch(acc, xa):
                    grads_acc, count, w_assign = acc
                    f, akey = xa                                          # f: [R, ...]
                    h = {**hyper, "__als": opt_state[ALS_SCALE]} if cfg.als is not None else hyper
                    vals, grads, assigns = replicas(weights, f, self._split(akey, R), h)
                    if cfg.training:
                        grads_acc = accumulate(grads_acc, count, grads)
                        w_assign = {k: jnp.mean(v, axis=0).astype(weights[k].dtype)
                                    for k, v in assigns.items() if k in weights}
                    return (grads_acc, count + 1.0, w_assign), vals

                zeros = {k: jnp.zeros_like(weights[k]) for k in self.trainable}
                assign0 = {k: weights[k] for k in self.assigned if k in weights and cfg.training}
                (grads, _, w_assign), vals = _scan(
                    micro_batch, (zeros, 0.0, assign0), (feeds, self._split(bkey, A)))
                if cfg.training:
                    if cfg.mean_reduction and not cfg.running_mean:
                        grads = {k: v / (A * R) for k, v in grads.items()}
                    if cfg.als is not None:
                        grads, opt_state = self._auto_loss_scale(grads, opt_state, hyper)
                    new_w, new_state = cfg.optimizer.apply(
                        {k: weights[k] for k in self.trainable}, grads, opt_state, hyper)
                    opt_state = {**opt_state, **new_state}
                    weights = {**weights, **w_assign, **new_w}
                    for a in anchor_opt:   # optimizer state after this batch's update
                        vals[a] = jnp.broadcast_to(opt_state[a], (A, R) + jnp.shape(opt_state[a]))
                return (weights, opt_state), vals

            key, sub = self._split(key, 2)
            (weights, opt_state), vals = _scan(
                batch, (weights, opt_state), (feeds, self._split(sub, B)))
            return weights, opt_state, jax.random.key_data(key), self._reduce_anchors(vals)

        return step

    def _reduce_anchors(self, vals: dict) -> dict:
        """Each anchor's values [B, A, R, *shape] as its AnchorReturnType returns them
        (``dataflow.device_lead_dims`` gives the leading dims each kind keeps)."""
        out = {}
        for a, v in vals.items():
            if a == CHECKS:   # the run-time checks' record: the first failure of the step
                out[a] = first_failure(v)
                continue
            art = self.cfg.anchors[a]
            kind = art.id()
            if kind == AnchorReturnTypeId.All:
                out[a] = v
            elif kind == AnchorReturnTypeId.EveryN:
                out[a] = v[art.rp() - 1::art.rp()]
            elif kind == AnchorReturnTypeId.Final:
                out[a] = v[-1, -1]
            else:
                out[a] = jnp.sum(v, axis=(0, 1))
        return out

    # ------------------------------------------------------------------ placement
    def _shardings(self):
        """(state sharding, feeds sharding): replicated / split along the replica axis over
        the replicas' devices, or the session's one device."""
        devs = self.replica_devices()
        if devs:
            mesh = jax.sharding.Mesh(np.array(devs), (REPLICA_AXIS,))
            P = jax.sharding.PartitionSpec
            return (jax.sharding.NamedSharding(mesh, P()),
                    jax.sharding.NamedSharding(mesh, P(None, None, REPLICA_AXIS)))
        dev = (getattr(self.device, "jax_devices", None) or jax.local_devices())[0]
        one = jax.sharding.SingleDeviceSharding(dev)
        return one, one

    def put(self, tree: Any) -> Any:
        """Place weights / optimizer state / the RNG key on the device(s)."""
        return self._place(tree, self._shardings()[0])

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        """Move a step's inputs to the device(s): one transfer per input. In a distributed
        job each process gives its local replicas' data ([B, A, R_local, ...])."""
        return self._place(dict(feeds), self._shardings()[1])

    @staticmethod
    def _place(tree: Any, sharding: Any) -> Any:
        if distributed.process_count() > 1:
            return jax.tree_util.tree_map(
                lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)
        return jax.device_put(tree, sharding)

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        """A program output as a NumPy array (outputs are replicated on every process). The
        run's own errors surface here (XLA runs asynchronously)."""
        with xla_errors("Running the step"):
            if getattr(x, "is_fully_addressable", True):
                return np.asarray(x)
            return np.asarray(x.addressable_data(0))

    # ------------------------------------------------------------------ compile and run
    def _jit(self, fn):
        state_s, feed_s = self._shardings()
        return jax.jit(fn, donate_argnums=(0, 1, 2),
                       in_shardings=(state_s, state_s, state_s, feed_s, state_s),
                       out_shardings=(state_s, state_s, state_s, state_s))

    def _arg_specs(self, weights, opt_state, key, hyper) -> tuple:
        cfg = self.cfg
        feed_specs = {k: jax.ShapeDtypeStruct((cfg.batches_per_step, cfg.accumulation_factor,
                                               cfg.replication_factor, *i.shape()), i.np_dtype())
                      for k, i in self.input_infos.items()}
        spec = lambda tree: jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)
        return spec(dict(weights)), spec(dict(opt_state)), spec(key), feed_specs, spec(dict(hyper))

    def compile(self, weights: Mapping[str, Any], opt_state: Mapping[str, Any], key: Any,
                hyper: Mapping[str, Any], exported: Optional[bytes] = None) -> None:
        """Ahead-of-time compile the step for these argument shapes, from the IR or from a
        serialized executable (``exported``, see :meth:`export`)."""
        self._specs = self._arg_specs(weights, opt_state, key, hyper)
        t0 = time.perf_counter()
        if exported is None:
            self._jitted = self._jit(self._step_fn())
        else:
            self._jitted = self._jit(jax.export.deserialize(bytearray(exported)).call)
        with xla_errors("Compiling the step"):
            self.compiled = self._jitted.lower(*self._specs).compile()
        self.compile_seconds = time.perf_counter() - t0

    def export(self) -> bytes:
        """The compiled step as a serialized StableHLO module (``jax.export``)."""
        return bytes(jax.export.export(self._jitted)(*self._specs).serialize())

    def export_step(self, weights: Mapping[str, Any], opt_state: Mapping[str, Any], key: Any,
                    hyper: Mapping[str, Any]) -> bytes:
        """The step traced and serialized as :meth:`export` does, without compiling it (for
        ``compile(exported=...)``: the engine cache compiles the module it stores)."""
        specs = self._arg_specs(weights, opt_state, key, hyper)
        return bytes(jax.export.export(self._jit(self._step_fn()))(*specs).serialize())

    def run(self, weights, opt_state, key, feeds, hyper):
        with xla_errors("Running the step"):
            return self.compiled(weights, opt_state, key, self.put_feeds(feeds), self.put(hyper))
