"""Graphcore-style popxl LLM layers, tensor parallel over 4 replicas, against HuggingFace.

Two-layer GPT-J and LLaMA (grouped-query attention) causal LMs written with this project's
popxl as popxl-addons' layers are (tests/helpers/tp_layers.py, docs/popxl_tensor_parallel.md):
one decoder-layer graph called per layer; column-parallel QKV / up projections / LM head,
row-parallel output / down projections with an all-reduce, a vocabulary-sharded embedding and
cross entropy, rotary position embeddings (GPT-J's interleaved pairs on part of each head,
LLaMA's half rotation). Each is trained with ``popxl.transforms.autodiff`` and popxl-addons'
Adam step on 4 replicas, as 4 tensor-parallel ranks and as 2 tensor-parallel x 2
data-parallel, against ``transformers``' GPTJForCausalLM / LlamaForCausalLM with the same
weights trained by ``torch.optim.Adam`` / ``AdamW``: the loss, the logits and every gradient of
the first step, then each step's loss and the final weights, to fp32 tolerance. The
``_addons`` cases build the same with popxl-addons' own ops and AdamOptimizerStep
(tests/helpers/tp_addons.py; skipped when ``popxl_addons`` is not importable, e.g. without
POPXL_ADDONS_DIR=<a checkout>)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import popart
import popart.testing

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers.tp_layers import Adam, Config, Program  # noqa: E402

STEPS = 3
GPTJ = Config("gptj", rotary_dim=2)
LLAMA = Config("llama", kv_heads=4)        # grouped-query attention: 2 query heads per key head


def hf_model(cfg: Config):
    """The HF model of ``cfg`` (no dropout, eager attention) with random weights
    large enough that every term matters."""
    torch.manual_seed(0)
    if cfg.family == "gptj":
        hf = transformers.GPTJConfig(
            vocab_size=cfg.vocab, n_positions=16, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads,
            rotary_dim=cfg.rotary_dim, n_inner=cfg.inner, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.eps,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
        cls = transformers.GPTJForCausalLM
    else:
        hf = transformers.LlamaConfig(
            vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.inner,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=16, rms_norm_eps=cfg.eps, hidden_act="silu",
            tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    hf._attn_implementation = "eager"
    model = cls(hf).float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:                               # norm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def batches(cfg: Config, dp: int) -> np.ndarray:
    """[STEPS, dp, B, S] token ids."""
    return np.random.default_rng(1).integers(0, cfg.vocab, (STEPS, dp, cfg.batch, cfg.seq)).astype(np.int32)


def torch_reference(cfg: Config, data: np.ndarray, adam: Adam):
    """Per step: (loss, logits [dp * B, S, V], {param: grad}) of HF on the step's whole batch
    (the data-parallel batches side by side), then torch.optim.Adam (AdamW with weight
    decay); and the final weights."""
    model = hf_model(cfg)
    kind, extra = (torch.optim.AdamW, {"weight_decay": adam.weight_decay}) if adam.weight_decay else (torch.optim.Adam, {})
    opt = kind(model.parameters(), lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, **extra)
    steps = []
    for step in data:
        ids = torch.from_numpy(step.reshape(-1, cfg.seq).astype(np.int64))
        opt.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        steps.append((out.loss.item(), out.logits.detach().numpy(),
                      {n: p.grad.numpy().copy() for n, p in model.named_parameters()}))
        opt.step()
    return steps, {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}


# (config, tensor-parallel ranks, popxl-addons' ops, replicas side by side on one device):
# 4 replicas are 4 / tp data-parallel groups; the data-parallel cases train with weight decay
CASES = {"gptj_tp4": (GPTJ, 4, False, False), "llama_tp4": (LLAMA, 4, False, False),
         "gptj_tp2_dp2": (GPTJ, 2, False, False), "llama_tp2_dp2": (LLAMA, 2, False, False),
         "llama_tp2_dp2_one_device": (LLAMA, 2, False, True),
         "gptj_tp4_addons": (GPTJ, 4, True, False), "llama_tp2_dp2_addons": (LLAMA, 2, True, False)}


def addons_or_skip(weight_decay: float):
    """popxl-addons' ops and Adam step (tests/helpers/addons.py), else skip."""
    try:
        from helpers.tp_addons import AddonsAdam, addons_ops
        return addons_ops(), AddonsAdam(weight_decay=weight_decay)
    except ImportError as e:
        pytest.skip(f"popxl_addons is not importable: {e}")


@pytest.fixture(scope="module", params=list(CASES))
def trained(request):
    """(program, per-step popxl outputs, its final weights, torch steps, torch final weights) for a case:
    one compiled session, STEPS runs."""
    cfg, tp, addons, one_device = CASES[request.param]
    dp = 4 // tp
    wd = 0.1 if dp > 1 else 0.0
    tp_ops, adam = addons_or_skip(wd) if addons else (None, Adam(weight_decay=wd))
    state = {n: p.detach().numpy().copy() for n, p in hf_model(cfg).state_dict().items()}
    device = popart.DeviceManager().createIpuModelDevice({"numIPUs": 1}) if one_device else "ipu_model"
    prog = Program(cfg, state, replicas=4, tp=tp, tp_ops=tp_ops, adam=adam, device=device)
    data = batches(cfg, dp)
    with prog.session:
        outs = [prog.run(step, step[..., 1:]) for step in data]
        final = prog.weights_now()
    ref, ref_final = torch_reference(cfg, data, prog.adam)
    return prog, outs, final, ref, ref_final


def test_the_variant_builds_with_its_ops(trained):
    """The popxl-addons variant runs its custom ops and calls AdamOptimizerStep graphs; the
    public one uses popxl's own ops only."""
    prog = trained[0]
    types = {op.opType() for g in (prog.fwd, *prog.fwd.called_graphs) for op in g._pb_graph.getOps()}
    assert "Call" in types                               # the decoder layer graph, once per layer
    custom = {"ReplicatedAllReduceTP", "CrossEntropySharded"} | (
        {"RotaryPosEmbed"} if prog.cfg.family == "gptj" else set())
    addons = prog.tp_ops is not None
    assert (custom <= types) if addons else not (custom & types), types
    # a device per replica where there are 4 (the test session's host CPU devices), unless the
    # case puts the replicas side by side (vmap)
    devices = len(popart.testing.mesh_devices(prog.session))
    assert devices == 0 if prog.device != "ipu_model" else (devices == 4 or len(jax.devices()) < 4)
    called = [g.name for g in prog.ir.main_graph.called_graphs]
    assert any("AdamOptimizerStep" in n for n in called) == addons, called


def shards(prog: Program, x: np.ndarray) -> np.ndarray:
    """[replicas, ...] of a per-replica output -> [dp, tp, ...]."""
    return x.reshape(prog.replicas // prog.tp, prog.tp, *x.shape[1:])


def test_forward_loss_and_sharded_logits_equal_huggingface(trained):
    prog, outs, _, ref, _ = trained
    cfg, dp = prog.cfg, prog.replicas // prog.tp
    loss, logits = outs[0]["loss"], outs[0]["logits"]
    # every replica of a data-parallel group has its batch's loss; HF's is the mean of them
    per_dp = shards(prog, loss)
    assert np.all(per_dp == per_dp[:, :1])
    np.testing.assert_allclose(per_dp[:, 0].mean(), ref[0][0], rtol=2e-5)
    # rank r holds vocabulary columns r * V / tp ...: put them side by side
    whole = np.concatenate(list(np.moveaxis(shards(prog, logits), 1, 0)), axis=-1)
    np.testing.assert_allclose(whole.reshape(dp * cfg.batch, cfg.seq, cfg.vocab), ref[0][1], rtol=1e-4, atol=1e-4)


def test_backward_every_gradient_equals_huggingface(trained):
    """Gradients at the initial weights: sharded weights rank by rank, replicated ones on
    every replica; after the data-parallel mean, so equal to HF's on the whole batch."""
    prog, outs, _, ref, _ = trained
    torch_grads = ref[0][2]
    assert {h for w in prog.weights.values() for h in w.hf} == set(torch_grads)
    for k, w in prog.weights.items():
        want = w.value(torch_grads, prog.tp)
        got = shards(prog, outs[0][f"grad/{k}"])              # [dp, tp, ...]
        for d in range(got.shape[0]):
            if w.axis is None:
                for r in range(prog.tp):
                    np.testing.assert_allclose(got[d, r], want, rtol=1e-4, atol=2e-5, err_msg=k)
            else:
                np.testing.assert_allclose(got[d], want, rtol=1e-4, atol=2e-5, err_msg=k)


def test_adam_steps_equal_torch_adam(trained):
    """popxl-addons' Adam step (accumulate_moving_average(_square)_, adam_updater,
    scaled_add_; in the addons variant its AdamOptimizerStep module itself) over STEPS steps:
    each step's loss and the final weights equal torch.optim.Adam's (AdamW's with weight
    decay: popxl-addons' updater adds weight_decay * w before the learning rate)."""
    prog, outs, final, ref, ref_final = trained
    losses = [shards(prog, o["loss"])[:, 0].mean() for o in outs]
    np.testing.assert_allclose(losses, [r[0] for r in ref], rtol=5e-5)
    for k, w in prog.weights.items():
        start = w.value(prog.state, prog.tp)
        want = w.value(ref_final, prog.tp)
        assert not np.allclose(want, start), k                       # the weight moved
        np.testing.assert_allclose(final[k], want, rtol=1e-4, atol=5e-5, err_msg=k)
