"""Mixture of experts (models/moe.py in our decoder): Qwen3-MoE and Mixtral against transformers'
forward, the KV-cache decode, the ragged path's gradients against a dense every-expert reference,
the router losses against transformers' formula, both checkpoint layouts, training, config errors."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import save_file

from helpers import MOE_CFG, REPO, SFT_FAST, TINY_MOE, grpo_rows, packed_batch, sharp_moe, torch_logits
from unitrain import train
from unitrain.adapters import hf
from unitrain.errors import ConfigError
from unitrain.models import decoder, kv_cache, moe

FAMILIES = ["qwen3_moe", "mixtral"]
TOL = 1e-4  # float32 logits against transformers', as test_hf_parity's dense families
# Mixtral with a sliding window shorter than the long row, as test_hf_parity's mistral.
VARIANTS = {"qwen3_moe": {}, "mixtral": {"sliding_window": 64}}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from make_tiny_model import make_tiny_model

    made = {}

    def get(family):
        if family not in made:
            out = tmp_path_factory.mktemp(f"hf_{family}")
            made[family] = make_tiny_model(out, family, init_std=0.25, experts=(8, 2, 32), **VARIANTS[family])
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_on_a_long_and_a_packed_row(moe_checkpoint, family):
    path = moe_checkpoint(family)
    model = hf.load(path)
    assert model.cfg.model_family == family and model.cfg.num_experts == 8
    tokens, positions, segment_ids, long_seq, segs = packed_batch(np.random.default_rng(0))
    logits = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))[0])
    np.testing.assert_allclose(logits[0], torch_logits(path, long_seq), atol=TOL, rtol=0)
    start = 0
    for s in segs:  # each packed segment against transformers run on it alone
        np.testing.assert_allclose(logits[1, start : start + len(s)], torch_logits(path, s), atol=TOL, rtol=0)
        start += len(s)


def test_unnormalised_top_k_is_caught_by_the_tolerance(moe_checkpoint):
    """Negative control: Qwen3-MoE's weights without renormalisation over the k must break parity."""
    path = moe_checkpoint("qwen3_moe")
    model = hf.load(path)
    model.cfg = dataclasses.replace(model.cfg, moe_norm_topk_prob=False)
    tokens = np.random.default_rng(3).integers(0, 512, 60)
    ours = model(jnp.asarray(tokens)[None], jnp.arange(60)[None], jnp.ones((1, 60), jnp.int32))[0]
    assert np.abs(np.asarray(ours[0]) - torch_logits(path, tokens)).max() > 1e-2


@pytest.mark.parametrize("copies", [True, False], ids=["cpu_route", "accelerator_route"])
def test_kv_cache_decode_equals_the_full_forward(copies, monkeypatch):
    """A left-padded prefill, then one token per row per call through
    `for_decoding(decode_weights())` as the samplers call it: every step's logits are the full
    forward's, each of the few tokens routed through the ragged experts."""
    monkeypatch.setattr(decoder, "copies_weight_slices", lambda platform: copies)
    model = sharp_moe(MOE_CFG)
    call = nnx.jit(lambda model, *args: model.for_decoding(model.decode_weights())(*args))
    full = nnx.jit(lambda model, t: model(t[None], jnp.arange(t.shape[0])[None], jnp.ones((1, t.shape[0]), jnp.int32)))
    rng = np.random.default_rng(0)
    prompt_lens, width, steps = (6, 3), 6, 5
    seqs = [rng.integers(0, 128, n + steps) for n in prompt_lens]
    expected = [np.asarray(full(model, jnp.asarray(s))[0][0]) for s in seqs]
    tokens, positions, segments = (np.zeros((2, width), np.int32) for _ in range(3))
    for b, n in enumerate(prompt_lens):
        tokens[b, width - n :], positions[b, width - n :], segments[b, width - n :] = seqs[b][:n], np.arange(n), 1
    cache = kv_cache.init_cache(model.cfg, batch_size=2, max_length=width + steps)
    logits, cache = call(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments), cache)
    close = functools.partial(np.testing.assert_allclose, atol=1e-3, rtol=1e-5)  # sharp weights: logits ~ 1e2
    for b, n in enumerate(prompt_lens):
        close(np.asarray(logits[b, width - n :]), expected[b][:n])
    for step in range(steps):
        pos = np.asarray(prompt_lens) + step
        tok = np.asarray([seqs[b][p] for b, p in enumerate(pos)])
        logits, cache = call(
            model, jnp.asarray(tok)[:, None], jnp.asarray(pos)[:, None], jnp.ones((2, 1), jnp.int32), cache
        )
        for b in range(2):
            close(np.asarray(logits[b, 0]), expected[b][pos[b]])


def dense_reference(h, p, k, normalise):
    """Every expert on every token, masked by the routing weights: the top-k set by a threshold at
    the k-th largest probability, not by moe's sort and ragged matmuls."""
    x = h.reshape(-1, h.shape[-1])
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    kth = jnp.sort(probs, axis=-1)[:, -k][:, None]
    weights = jnp.where(probs >= kth, probs, 0.0)
    if normalise:
        weights = weights / weights.sum(-1, keepdims=True)
    gate = jnp.einsum("ne,xem->xnm", x, p["moe_gate"])
    up = jnp.einsum("ne,xem->xnm", x, p["moe_up"])
    every = jnp.einsum("xnm,xme->xne", jax.nn.silu(gate) * up, p["moe_down"])  # [X, N, E]
    return jnp.einsum("xne,nx->ne", every, weights).reshape(h.shape)


@pytest.mark.parametrize("normalise", [True, False])
def test_ragged_path_and_its_gradients_equal_the_dense_reference(normalise):
    X, E, M, k = 6, 16, 8, 2
    keys = jax.random.split(jax.random.key(0), 6)
    p = {
        "router": jax.random.normal(keys[0], (E, X)),
        "moe_gate": jax.random.normal(keys[1], (X, E, M)) / 4,
        "moe_up": jax.random.normal(keys[2], (X, E, M)) / 4,
        "moe_down": jax.random.normal(keys[3], (X, M, E)) / 3,
    }
    h = jax.random.normal(keys[4], (3, 7, E))
    probe = jax.random.normal(keys[5], (3, 7, E))
    valid = jnp.ones((3, 7), bool)

    def ours(h, p):
        return jnp.sum(probe * moe.moe_mlp(h, p, valid, k=k, normalise=normalise, dtype=jnp.float32)[0])

    def reference(h, p):
        return jnp.sum(probe * dense_reference(h, p, k, normalise))

    value, grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(h, p)
    ref_value, ref_grads = jax.value_and_grad(reference, argnums=(0, 1))(h, p)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-4, rtol=1e-4), grads, ref_grads)
    assert float(jnp.abs(grads[1]["router"]).max()) > 1e-3  # the router learns through the weights


def np_logsumexp(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def transformers_aux_loss(router_logits, mask, k):
    """transformers' load_balancing_loss_func written out in NumPy: over all layers' real tokens
    pooled, num_experts * sum_e (share of token-slots routed to e) * (mean router probability of e)."""
    probs = np.exp(router_logits - np_logsumexp(router_logits)[..., None])  # [L, N, X]
    top = np.argsort(-probs, axis=-1)[..., :k]
    num_experts = probs.shape[-1]
    counts = np.zeros(num_experts)
    for layer_top in top:
        np.add.at(counts, layer_top[mask], 1.0)
    tokens = mask.sum() * len(router_logits)
    return num_experts * np.sum(counts / tokens * (probs * mask[None, :, None]).sum((0, 1)) / tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_losses_equal_transformers_formula(moe_checkpoint, family):
    """The aux loss and z-loss our forward reports, over a batch with a right-padded row, against the
    NumPy formulas on transformers' router logits of the same batch (and against transformers' own
    aux_loss); padding is excluded from both."""
    path = moe_checkpoint(family)
    lengths, width = (40, 25), 40
    rng = np.random.default_rng(5)
    tokens = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), bool)
    for b, n in enumerate(lengths):
        tokens[b, :n], mask[b, :n] = rng.integers(0, 512, n), True
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = ref.eval()(
            torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)), output_router_logits=True
        )
    router_logits = np.stack([r.numpy() for r in out.router_logits])  # [L, B*T, X]
    flat_mask = mask.reshape(-1)
    want_aux = transformers_aux_loss(router_logits, flat_mask, k=2)
    want_z = np.mean(np_logsumexp(router_logits)[:, flat_mask] ** 2)
    np.testing.assert_allclose(want_aux, float(out.aux_loss), rtol=1e-5)

    model = hf.load(path)
    positions = np.broadcast_to(np.arange(width), (2, width))
    with moe.collect_router_stats() as collected:
        model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), jnp.asarray(mask, jnp.int32))
    got = moe.router_losses(collected)
    np.testing.assert_allclose(float(got["aux_loss"]), want_aux, rtol=1e-4)
    np.testing.assert_allclose(float(got["z_loss"]), want_z, rtol=1e-4)
    # Every real token takes k slots: per layer and expert, k * tokens / num_experts on average.
    np.testing.assert_allclose(float(got["mean_load"]), 2 * sum(lengths) / 8)
    assert float(got["max_load"]) >= float(got["mean_load"])


def fused_copy(src, dst):
    """The checkpoint at `src` in transformers 5's fused expert tensors, as its modules hold them
    (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_of_either_layout_and_export_round_trip(moe_checkpoint, tmp_path, family, layout):
    path = moe_checkpoint(family)
    source = path if layout == "per_expert" else fused_copy(path, tmp_path / "fused")
    tokens = np.random.default_rng(1).integers(0, 512, 90)
    want = torch_logits(path, tokens)
    model = hf.load(source)
    ours = model(jnp.asarray(tokens)[None], jnp.arange(90)[None], jnp.ones((1, 90), jnp.int32))[0]
    np.testing.assert_allclose(np.asarray(ours[0]), want, atol=TOL, rtol=0)
    hf.save(model, tmp_path / "out")  # the per-expert layout, as transformers' save_pretrained writes
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", tokens), want)
    assert hf.load(tmp_path / "out").cfg == model.cfg


def test_flops_count_the_active_experts_and_the_router():
    """An MoE layer costs what a dense layer of k experts' width does, plus the router's matmul."""
    k, X, E, M, L = 2, 8, 32, 16, 2
    dense = decoder.create(dataclasses.replace(MOE_CFG, model_family="qwen3", num_experts=0, mlp_dim=k * M))
    sparse = decoder.create(MOE_CFG)
    assert sparse.flops_per_token(64) == dense.flops_per_token(64) + 6 * L * E * X


def test_partly_dense_qwen3_moe_checkpoint_is_one_line(moe_checkpoint, tmp_path):
    src = moe_checkpoint("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["mlp_only_layers"] = [1]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        hf.load(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["num_experts=4"], "num_experts=4 needs a mixture-of-experts model_family"),
        (["model_family=qwen3_moe"], "set num_experts > 0"),
        ([*TINY_MOE, "num_experts_per_tok=5"], "num_experts_per_tok (5) must be at most num_experts (4)"),
        (["model_family=mixtral", "num_experts=4", "moe_norm_topk_prob=false"], "moe_norm_topk_prob must be true"),
        (["moe_aux_loss_coef=-1"], "moe_aux_loss_coef"),
        (["moe_z_loss_coef=-0.5"], "moe_z_loss_coef"),
        (["num_experts=-1"], "num_experts"),
    ],
)
def test_bad_moe_config_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *SFT_FAST, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_sft_on_a_tiny_moe_trains_and_logs_the_router_terms(tmp_path):
    """train.main on a 4-expert Qwen3-MoE: the loss falls, and each step's loss is the nll plus the
    router terms at their coefficients."""
    args = [*SFT_FAST, *TINY_MOE, "steps=40", "moe_aux_loss_coef=0.1", "moe_z_loss_coef=0.01"]
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *args]) == 0
    lines = [json.loads(line) for line in open(tmp_path / "default" / "metrics.jsonl")]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 40
    for line in steps:
        assert {"moe/aux_loss", "moe/z_loss", "moe/max_load", "moe/mean_load"} <= set(line)
        router = 0.1 * line["moe/aux_loss"] + 0.01 * line["moe/z_loss"]
        np.testing.assert_allclose(line["loss"], line["nll"] + router, rtol=1e-5)
    first, last = np.mean([s["nll"] for s in steps[:5]]), np.mean([s["nll"] for s in steps[-5:]])
    assert last < 0.7 * first


def test_shared_prefix_forward_equals_the_plain_one_and_counts_each_prompt_once():
    """GRPO's shared-prompt forward on an MoE: the hidden states of hidden_states, and router stats
    over each group's prompt once plus every completion, in every layer."""
    model = sharp_moe(MOE_CFG)
    rng = np.random.default_rng(0)
    P, C, n = 8, 6, 3
    tokens, positions, segments = grpo_rows(rng, [rng.integers(1, 128, size) for size in (8, 3)], n, P, C, 128)

    def shared(model):
        with moe.collect_router_stats() as collected:
            hidden = model.hidden_states_shared_prefix(tokens, positions, segments, P, n)
        return hidden, sum(jnp.sum(s.tokens) for s in collected)

    hidden, counted = nnx.jit(shared)(model)
    plain = nnx.jit(lambda m: m.hidden_states(tokens, positions, segments))(model)
    real = segments > 0
    np.testing.assert_allclose(np.asarray(hidden)[real], np.asarray(plain)[real], rtol=1e-4, atol=1e-3)
    once = segments[::n, :P].sum() + segments[:, P:].sum()
    assert float(counted) == MOE_CFG.num_decoder_layers * once


def test_unrolled_and_rematerialised_stacks_give_the_scanned_forward_and_router_stats():
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 128, (2, 12)))
    positions, segments = jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32)

    def forward(model):
        with moe.collect_router_stats() as collected:
            hidden = model.hidden_states(tokens, positions, segments)
        return hidden, moe.router_losses(collected)

    graphdef, params = nnx.split(sharp_moe(MOE_CFG))
    want = nnx.jit(forward)(nnx.merge(graphdef, params))
    for changes in (dict(scan_layers=False), dict(remat_policy="full")):
        model = nnx.merge(nnx.graphdef(decoder.create(dataclasses.replace(MOE_CFG, **changes))), params)
        got = nnx.jit(forward)(model)
        jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-4), got, want)
