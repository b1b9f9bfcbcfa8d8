"""Tensor-parallel GPT-J and LLaMA language models written with this project's popxl the way
Graphcore's popxl applications write theirs with popxl-addons: layers are modules whose
``build`` adds their weights as graph inputs; QKV, feed-forward up projections and the LM head
are column-parallel (each tensor-parallel rank holds its heads / columns / vocabulary rows),
the attention output and feed-forward down projections row-parallel followed by an
all-reduce; the embedding and the cross entropy are vocabulary-sharded.

A run is ``replicas`` replicas as ``replicas // tp`` data-parallel groups of ``tp``
tensor-parallel ranks: tensor-parallel groups are ``ir.replica_grouping(1, tp)`` (consecutive
replicas), a sharded weight's variable grouping is ``ir.replica_grouping(tp, replicas // tp)``
(the replicas of one rank share its shard), and gradients are averaged over that grouping
(data parallelism) before the Adam step.

The tensor-parallel collectives, the rotary embedding and the sharded loss are a
:class:`TPOps`: :data:`PUBLIC_OPS` builds them from popxl's public ops only
(``replicated_all_reduce``, ``detach``, elementwise ops); tests/helpers/tp_addons.py swaps in
popxl-addons' ops and its Adam module."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

import popxl
import popxl.ops as ops
from popxl import ReplicaGrouping, Tensor
from popxl.ops import collectives as C

# ---------------------------------------------------------------------------------------------
# Tensor-parallel collectives


def all_reduce_identical_inputs(x: Tensor, group: ReplicaGrouping) -> Tensor:
    """Identity forward, gradient all-reduced over ``group`` (Megatron's f; popxl-addons'
    ``replicated_all_reduce_identical_inputs``): ``x`` is equal on every rank, its gradient is
    the sum of the ranks' partial gradients. ``detach(x - A) + A`` with ``A`` the all-reduce."""
    a = C.replicated_all_reduce(x, "add", group)
    return ops.detach(x - a) + a


def all_reduce_identical_grad_inputs(x: Tensor, group: ReplicaGrouping) -> Tensor:
    """All-reduce over ``group`` forward, gradient passed through (Megatron's g; popxl-addons'
    ``replicated_all_reduce_identical_grad_inputs``): every rank's gradient of the sum is the
    same. ``A(detach(x)) + (x - detach(x))``."""
    d = ops.detach(x)
    return C.replicated_all_reduce(d, "add", group) + (x - d)


# ---------------------------------------------------------------------------------------------
# Configuration and weights


@dataclass(frozen=True)
class Config:
    """A tiny causal LM: ``family`` "gptj" (parallel residual, LayerNorm, interleaved rotary on
    the first ``rotary_dim`` dims of each head, gelu MLP with biases, LM head with bias) or
    "llama" (sequential residual, RMSNorm, half rotation, SwiGLU MLP, no biases; ``kv_heads``
    below ``heads`` is grouped-query attention)."""
    family: str
    vocab: int = 64
    hidden: int = 32
    heads: int = 8
    kv_heads: int = 8
    inner: int = 64
    rotary_dim: int = 2
    seq: int = 6
    batch: int = 2
    layers: int = 2
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Weight:
    """A weight's HF parameters (Linear weights transposed to popxl's ``x @ w`` layout) and the
    axis each is split along over the tensor-parallel ranks (None: replicated); several
    parameters are concatenated along that axis rank by rank (the fused QKV)."""
    hf: Tuple[str, ...]
    axis: Optional[int]
    transpose: bool = True

    def value(self, state: Dict[str, np.ndarray], tp: int) -> np.ndarray:
        """[tp, *shard] for a sharded weight, else the whole value, from an HF state dict."""
        mats = [state[n].T if self.transpose else state[n] for n in self.hf]
        if self.axis is None:
            return mats[0]
        return np.stack([np.concatenate([np.split(m, tp, self.axis)[r] for m in mats], self.axis)
                         for r in range(tp)])


@dataclass(eq=False)
class Layer(popxl.Module):
    """popxl-addons' Module in miniature: ``build`` adds each weight as an input of the graph
    being built (``add_weight``), recorded in ``weights`` (shared with sub-layers) under the
    layer's name."""
    name: str
    weights: Dict[str, Tuple[Tensor, Weight]]
    cfg: Config
    tp: int
    group: ReplicaGrouping            # the tensor-parallel group
    tp_ops: Optional["TPOps"] = None          # None: PUBLIC_OPS

    def __post_init__(self) -> None:
        self.tp_ops = self.tp_ops or PUBLIC_OPS

    def add_weight(self, name: str, shape: Sequence[int], w: Weight, dtype=popxl.float32) -> Tensor:
        key = f"{self.name}.{name}" if self.name else name
        t = popxl.graph_input(shape, dtype, key)
        self.weights[key] = (t, w)
        return t

    def sub(self, cls, name: str, *args) -> "Layer":
        return cls(f"{self.name}.{name}" if self.name else name, self.weights, self.cfg, self.tp,
                   self.group, self.tp_ops, *args)


@dataclass(eq=False)
class Linear(Layer):
    """``x @ w (+ b)`` on this rank's part: ``split`` "col" holds columns (outputs), "row"
    rows (inputs; bias added whole after the caller's all-reduce), None the whole weight."""
    hf: Tuple[str, ...] = ()
    n_in: int = 0
    n_out: int = 0
    split: Optional[str] = None
    bias: bool = False

    def build(self, x: Tensor) -> Tensor:
        tp = self.tp if self.split else 1
        n_in, n_out = (self.n_in // tp, self.n_out) if self.split == "row" else (self.n_in, self.n_out // tp)
        axis = {"col": 1, "row": 0}.get(self.split)
        y = x @ self.add_weight("weight", (n_in, n_out), Weight(tuple(f"{h}.weight" for h in self.hf), axis))
        if self.bias and self.split != "row":
            y = y + self.add_weight("bias", (n_out,), Weight(tuple(f"{h}.bias" for h in self.hf),
                                                              0 if self.split == "col" else None))
        return y

    def row_bias(self, y: Tensor) -> Tensor:
        """A row-parallel layer's bias, added after the all-reduce."""
        if not self.bias:
            return y
        return y + self.add_weight("bias", (self.n_out,), Weight((f"{self.hf[0]}.bias",), None))


@dataclass(eq=False)
class Norm(Layer):
    """LayerNorm (GPT-J) or RMSNorm (LLaMA) over the last axis of [N, hidden], replicated."""
    hf: str = ""

    def build(self, x: Tensor) -> Tensor:
        h = self.cfg.hidden
        w = self.add_weight("weight", (h,), Weight((f"{self.hf}.weight",), None))
        if self.cfg.family == "gptj":
            return ops.layer_norm(x, w, self.add_weight("bias", (h,), Weight((f"{self.hf}.bias",), None)),
                                  self.cfg.eps)
        return x / ops.sqrt(ops.mean(x * x, -1, keepdims=True) + self.cfg.eps) * w


def rotary_tables(cfg: Config) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos, sin [seq, head_dim] and the rotation R [head_dim, head_dim] with
    ``rope(x) = x * cos + (x @ R) * sin``: GPT-J's ``rotate_every_two`` on the first
    ``rotary_dim`` dims (cos 1, sin 0 beyond), LLaMA's ``rotate_half`` on all of them."""
    d = cfg.head_dim
    rd = cfg.rotary_dim if cfg.family == "gptj" else d
    inv = 1.0 / (10000 ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    ang = np.arange(cfg.seq, dtype=np.float64)[:, None] * inv            # [seq, rd / 2]
    rot = np.zeros((d, d), np.float32)
    if cfg.family == "gptj":
        ang = np.repeat(ang, 2, axis=1)
        for i in range(0, rd, 2):
            rot[i + 1, i], rot[i, i + 1] = -1.0, 1.0
    else:
        ang = np.concatenate([ang, ang], axis=1)
        for j in range(d // 2):
            rot[j + d // 2, j], rot[j, j + d // 2] = -1.0, 1.0
    cos, sin = np.ones((cfg.seq, d)), np.zeros((cfg.seq, d))
    cos[:, :rd], sin[:, :rd] = np.cos(ang), np.sin(ang)
    return cos.astype(np.float32), sin.astype(np.float32), rot


def rope(t: Tensor, cfg: Config) -> Tensor:
    """Rotary position embeddings of t [B, S, heads, head_dim] from elementwise ops and a
    matmul (:func:`rotary_tables`)."""
    cos, sin, rot = (popxl.constant(a) for a in rotary_tables(cfg))
    shape = (cfg.seq, 1, cfg.head_dim)
    return t * ops.reshape(cos, shape) + (t @ rot) * ops.reshape(sin, shape)


@dataclass(eq=False)
class Attention(Layer):
    """Causal self-attention on this rank's heads: column-parallel fused QKV, rotary position
    embeddings on q and k, row-parallel output projection; returns the partial output (the
    caller all-reduces)."""
    hf: str = ""

    def build(self, x: Tensor) -> Tensor:
        c, tp = self.cfg, self.tp
        heads, kv, d = c.heads // tp, c.kv_heads // tp, c.head_dim
        names = ("q_proj", "k_proj", "v_proj")
        qkv = self.sub(Linear, "qkv", tuple(f"{self.hf}.{n}" for n in names), c.hidden,
                       (c.heads + 2 * c.kv_heads) * d, "col")(x)
        q, k, v = (ops.reshape(t, (c.batch, c.seq, n, d))
                   for t, n in zip(ops.split(qkv, [heads * d, kv * d, kv * d], axis=1), (heads, kv, kv)))
        q, k = (self.tp_ops.rope(t, c) for t in (q, k))
        if kv < heads:       # each key / value head serves heads // kv consecutive query heads
            k, v = (ops.reshape(ops.concat([ops.unsqueeze(t, [3])] * (heads // kv), 3), (c.batch, c.seq, heads, d))
                    for t in (k, v))
        q, k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))          # [B, heads, S, d]
        scores = q @ ops.transpose(k, (0, 1, 3, 2))
        scores = scores / float(np.sqrt(d)) if c.family == "gptj" else scores * float(d ** -0.5)
        mask = np.triu(np.full((c.seq, c.seq), -1e9, np.float32), 1)
        probs = ops.softmax(scores + popxl.constant(mask), -1)
        out = ops.reshape(ops.transpose(probs @ v, (0, 2, 1, 3)), (c.batch * c.seq, heads * d))
        o_name = "out_proj" if c.family == "gptj" else "o_proj"
        return self.sub(Linear, "out", (f"{self.hf}.{o_name}",), c.hidden, c.hidden, "row")(out)


def gelu_new(x: Tensor) -> Tensor:
    """HF's ``gelu_new`` (GPT-J's activation) from elementwise ops:
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). Not ``ops.gelu``: that is PopART's Gelu,
    whose gradient is popnn's approximation (0.5 (1 + tanh(u)) + sqrt(2 / pi) x exp(-x^2 / 2)),
    about 1e-3 from the exact one that autograd gives."""
    return 0.5 * x * (1.0 + ops.tanh(float(np.sqrt(2.0 / np.pi)) * (x + 0.044715 * x * x * x)))


@dataclass(eq=False)
class MLP(Layer):
    """GPT-J: fc_out(gelu(fc_in(x))); LLaMA: down(silu(gate(x)) * up(x)); up projections
    column-parallel, the down projection row-parallel; returns the partial output and the
    down projection (for its bias after the all-reduce)."""
    hf: str = ""

    def build(self, x: Tensor) -> Tuple[Tensor, Linear]:
        c = self.cfg
        if c.family == "gptj":
            h = gelu_new(self.sub(Linear, "fc_in", (f"{self.hf}.fc_in",), c.hidden, c.inner, "col", True)(x))
            down = self.sub(Linear, "fc_out", (f"{self.hf}.fc_out",), c.inner, c.hidden, "row", True)
        else:
            g = self.sub(Linear, "gate", (f"{self.hf}.gate_proj",), c.hidden, c.inner, "col")(x)
            h = g * ops.sigmoid(g) * self.sub(Linear, "up", (f"{self.hf}.up_proj",), c.hidden, c.inner, "col")(x)
            down = self.sub(Linear, "down", (f"{self.hf}.down_proj",), c.inner, c.hidden, "row")
        return down(h), down


@dataclass(eq=False)
class Embedding(Layer):
    """Vocabulary-sharded embedding: each rank looks up the ids in its rows (others give
    zeros) and the ranks' results are all-reduced."""
    hf: str = ""

    def build(self, ids: Tensor, offset: Tensor) -> Tensor:
        c = self.cfg
        table = self.add_weight("weight", (c.vocab // self.tp, c.hidden), Weight((f"{self.hf}.weight",), 0, False))
        local = ops.reshape(ids, (c.batch * c.seq,)) - offset
        inside = ops.logical_and(ops.greater_equal(local, 0), ops.less(local, c.vocab // self.tp))
        rows = ops.gather(table, ops.where(inside, local, popxl.constant(0, popxl.int32)))
        return self.tp_ops.identical_grad_inputs(rows * ops.unsqueeze(ops.cast(inside, popxl.float32), [1]),
                                                 self.group)


def sharded_cross_entropy(logits: Tensor, labels: Tensor, offset: Tensor, group: ReplicaGrouping,
                          tp_ops: TPOps) -> Tensor:
    """Mean cross entropy of [N, vocab / tp] logits sharded over ``group`` (this rank's
    classes start at ``offset``) against [N] labels: the maximum, the sum of exponentials and
    the label's logit are all-reduced over the ranks."""
    part = logits.shape[1]
    top = ops.detach(C.replicated_all_reduce(ops.max(logits, -1, keepdims=True), "max", group))
    shifted = logits - top
    total = tp_ops.identical_grad_inputs(ops.sum(ops.exp(shifted), -1), group)
    cls = popxl.constant(np.arange(part, dtype=np.int32)) + offset
    hit = ops.cast(ops.equal(ops.unsqueeze(labels, [1]), ops.unsqueeze(cls, [0])), popxl.float32)
    picked = tp_ops.identical_grad_inputs(ops.sum(shifted * hit, -1), group)
    return ops.mean(ops.log(total) - picked)


@dataclass(frozen=True)
class TPOps:
    """The tensor-parallel collectives, the rotary embedding and the sharded loss the layers
    use; the defaults are built from popxl's public ops."""
    identical_inputs: Callable[[Tensor, ReplicaGrouping], Tensor] = all_reduce_identical_inputs
    identical_grad_inputs: Callable[[Tensor, ReplicaGrouping], Tensor] = all_reduce_identical_grad_inputs
    rope: Callable[[Tensor, Config], Tensor] = rope
    cross_entropy: Callable[..., Tensor] = sharded_cross_entropy


PUBLIC_OPS = TPOps()


@dataclass(eq=False)
class DecoderBlock(Layer):
    """One decoder layer on [B * S, hidden]; its HF names hold ``{}`` for the layer index."""
    hf: str = ""

    def build(self, x: Tensor) -> Tensor:
        f, gptj = self.tp_ops, self.cfg.family == "gptj"
        h = f.identical_inputs(self.sub(Norm, "ln_1", f"{self.hf}.{'ln_1' if gptj else 'input_layernorm'}")(x),
                               self.group)
        attn = self.sub(Attention, "attn", f"{self.hf}.{'attn' if gptj else 'self_attn'}")(h)
        attn = f.identical_grad_inputs(attn, self.group)
        if gptj:
            mlp, down = self.sub(MLP, "mlp", f"{self.hf}.mlp")(h)
            return x + attn + down.row_bias(f.identical_grad_inputs(mlp, self.group))
        x = x + attn
        h = f.identical_inputs(self.sub(Norm, "ln_2", f"{self.hf}.post_attention_layernorm")(x), self.group)
        mlp, _ = self.sub(MLP, "mlp", f"{self.hf}.mlp")(h)
        return x + f.identical_grad_inputs(mlp, self.group)


@dataclass(eq=False)
class CausalLM(Layer):
    """Embedding, ``cfg.layers`` decoder layers (one graph, called per layer with that layer's
    weights, as the popxl applications bind one layer graph to each layer's variables), final
    norm, vocabulary-sharded LM head and loss; returns (loss, this rank's logits
    [B, S, vocab / tp])."""

    def build(self, ids: Tensor, labels: Tensor, offset: Tensor) -> Tuple[Tensor, Tensor]:
        c, tp, f = self.cfg, self.tp, self.tp_ops
        gptj = c.family == "gptj"
        pre, blk = ("transformer", "transformer.h.{}") if gptj else ("model", "model.layers.{}")
        x = self.sub(Embedding, "embed", f"{pre}.{'wte' if gptj else 'embed_tokens'}")(ids, offset)
        block = DecoderBlock("", {}, c, tp, self.group, f, blk)
        graph = popxl.gcg().ir.create_graph(block, x.spec)
        for i in range(c.layers):
            binds = {t: self.add_weight(f"h{i}.{k}", t.shape, replace(w, hf=tuple(h.format(i) for h in w.hf)))
                     for k, (t, w) in block.weights.items()}
            (x,) = ops.call(graph, x, inputs_dict=binds)
        h = f.identical_inputs(self.sub(Norm, "ln_f", f"{pre}.{'ln_f' if gptj else 'norm'}")(x), self.group)
        logits = self.sub(Linear, "lm_head", ("lm_head",), c.hidden, c.vocab, "col", gptj)(h)
        logits = ops.reshape(logits, (c.batch, c.seq, c.vocab // tp))
        shifted = ops.reshape(logits[:, :c.seq - 1], (c.batch * (c.seq - 1), c.vocab // tp))
        loss = f.cross_entropy(shifted, ops.reshape(labels, (c.batch * (c.seq - 1),)), offset, self.group, f)
        return loss, logits


# ---------------------------------------------------------------------------------------------
# The training program


@dataclass(frozen=True)
class Adam:
    """popxl-addons' AdamOptimizerStep written with popxl's var-update ops: bias-corrected,
    decoupled weight decay in the updater (``torch.optim.AdamW``; without it
    ``torch.optim.Adam``), state in float32 with the weight's replica grouping."""
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def step(self, var: Tensor, grad: Tensor, grouping: Optional[ReplicaGrouping]) -> None:
        zeros = np.zeros(((grouping.num_groups,) if grouping else ()) + var.shape, np.float32)
        m = popxl.variable(zeros, popxl.float32, f"{var.name}/first_order", replica_grouping=grouping)
        v = popxl.variable(zeros, popxl.float32, f"{var.name}/second_order", replica_grouping=grouping)
        t = popxl.variable(np.zeros((), np.float32), popxl.float32, f"{var.name}/step")
        ops.var_updates.accumulate_moving_average_(m, grad, f=self.beta1)
        ops.var_updates.accumulate_moving_average_square_(v, grad, f=self.beta2)
        upd = ops.var_updates.adam_updater(m, v, weight=var, weight_decay=self.weight_decay, time_step=t,
                                           beta1=self.beta1, beta2=self.beta2, epsilon=self.eps)
        ops.scaled_add_(var, upd, b=-self.lr)


@dataclass(eq=False)
class Program:
    """One training step of a tensor-parallel CausalLM over ``replicas`` replicas: forward,
    ``popxl.transforms.autodiff`` backward, data-parallel gradient mean, Adam; each run's
    loss, logits and gradients (before the update) come back."""
    cfg: Config
    state: Dict[str, np.ndarray]           # the HF model's initial weights
    replicas: int
    tp: int
    tp_ops: Optional[TPOps] = None
    adam: Adam = field(default_factory=Adam)
    device: Any = "ipu_model"              # popxl.Session's device

    def __post_init__(self) -> None:
        c, R, tp = self.cfg, self.replicas, self.tp
        self.ir = ir = popxl.Ir(replication=R)
        group = ir.replica_grouping(1, tp)
        self.shard_grouping = ir.replica_grouping(tp, R // tp)
        weights: Dict[str, Tuple[Tensor, Weight]] = {}
        model = CausalLM("", weights, c, tp, group, self.tp_ops)
        with ir.main_graph:
            fwd = ir.create_graph(model, popxl.TensorSpec((c.batch, c.seq), popxl.int32),
                                  popxl.TensorSpec((c.batch, c.seq - 1), popxl.int32),
                                  popxl.TensorSpec((), popxl.int32))
            self.fwd = fwd
            self.weights = {k: w for k, (_, w) in weights.items()}
            ins = {k: t for k, (t, _) in weights.items()}
            bwd = popxl.transforms.autodiff(fwd, grads_provided=fwd.outputs[:1],
                                            grads_required=list(ins.values()))
            self.vars = {k: popxl.variable(w.value(self.state, tp), popxl.float32, k,
                                           replica_grouping=self._grouping(w)) for k, w in self.weights.items()}
            offset = popxl.variable(np.arange(tp, dtype=np.int32) * (c.vocab // tp), popxl.int32,
                                    "vocab_offset", replica_grouping=self.shard_grouping)
            self.ids = popxl.h2d_stream((c.batch, c.seq), popxl.int32, "ids")
            self.labels = popxl.h2d_stream((c.batch, c.seq - 1), popxl.int32, "labels")
            data = dict(zip(fwd.inputs[:3], (ops.host_load(self.ids), ops.host_load(self.labels), offset)))
            data.update({ins[k]: v for k, v in self.vars.items()})
            info = ops.call_with_info(fwd, inputs_dict=data)
            loss, logits = info.outputs[:2]     # autodiff added the saved activations after them
            grads = ops.call(bwd.graph, popxl.constant(1.0), inputs_dict=bwd.inputs_dict(info))
            named = dict(zip(ins, grads))    # grads come in grads_required's order
            if R > tp:
                named = {k: C.replicated_all_reduce(g, "mean", self.shard_grouping) for k, g in named.items()}
            self.outs = {"loss": loss, "logits": logits, **{f"grad/{k}": g for k, g in named.items()}}
            self.streams = {k: popxl.d2h_stream(t.shape, t.dtype, k.replace("/", "_"))
                            for k, t in self.outs.items()}
            for k, t in self.outs.items():
                ops.host_store(self.streams[k], t)
            for k, var in self.vars.items():
                self.adam.step(var, named[k], self._grouping(self.weights[k]))
        for g in ir._pb_ir.getAllGraphs():   # OpToIdentity, as popxl-addons' users run it
            ir._pb_ir.applyPreAliasPatterns(g)
        self.session = popxl.Session(ir, self.device)

    def _grouping(self, w: Weight) -> Optional[ReplicaGrouping]:
        return self.shard_grouping if w.axis is not None else None

    def run(self, ids: np.ndarray, labels: np.ndarray) -> Dict[str, np.ndarray]:
        """One step on [replicas // tp, B, S] ids (a batch per data-parallel group); returns
        {name: [replicas, ...]} (loss, logits, grad/<weight>)."""
        per_replica = lambda a: np.repeat(a, self.tp, axis=0)  # noqa: E731  (rank r: batch r // tp)
        out = self.session.run({self.ids: per_replica(ids), self.labels: per_replica(labels)})
        return {k: out[s] for k, s in self.streams.items()}

    def weights_now(self) -> Dict[str, np.ndarray]:
        """Each weight as the session holds it ([tp, *shard] for sharded ones)."""
        return {k: self.session.get_tensor_data(v) for k, v in self.vars.items()}
