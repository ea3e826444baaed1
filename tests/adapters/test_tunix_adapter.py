"""unitrain.adapters.tunix: Tunix's Llama3, Qwen2, Qwen3, Qwen3-MoE and Gemma3 behind the model interface,
against transformers' PyTorch forward of the same random HF checkpoint, per family."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec

from helpers import packed_batch
from unitrain import sharding
from unitrain.adapters import tunix
from unitrain.engines.base import SamplingParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.engines.programs import sharded_cache
from unitrain.errors import ConfigError

# Tunix 0.1.7 uses APIs that jax 0.10 and flax 0.12 deprecate (Variable.value, pxla.thread_resources, ...).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]
# Tunix 0.1.7's Llama3 and Qwen3 apply RoPE with theta 1e6 whatever the config says (the adapter
# refuses other thetas), so their checkpoints here use it; qwen2 and gemma3 take conftest's variants.
VARIANTS = {"llama": dict(rope_theta=1e6), "qwen3": dict(rope_theta=1e6)}
TOL = 1e-4
# Compiled, XLA folds RoPE's inverse frequencies correctly rounded where torch's float32 pow is up to
# 0.9 ulp off; at position 640 with sharp attention that moves Qwen2's logits by up to 1.1e-4.
JIT_TOL = 2e-4
SHARDED = {"data": 1, "fsdp": 4, "tensor": 2}
ONES = {"data": 1, "fsdp": 1, "tensor": 1}


def torch_logits(path, *sequences):
    """transformers' float32 logits of each sequence alone (a list, one [T, V] array per sequence)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [ref.eval()(torch.tensor(np.asarray(s))[None]).logits[0].numpy() for s in sequences]


PACKED = packed_batch(np.random.default_rng(0))

# The sampler's call pattern (engines/colocated.py): a left-padded prompt block of P columns, then
# N-1 one-token steps, teacher-forced here with the packed batch's own sequences so that the packed
# forward's logits are the reference. Rows: (packed row, start column, prompt length); the last row
# is batch padding. The long prompt (80) and its decode steps cross gemma3's 64-position window.
DECODE_ROWS = ((0, 0, 80), (1, 0, 33), (1, 300, 7), None)
P, N = 96, 24


def decode_batch():
    B = len(DECODE_ROWS)
    prompt = {k: np.zeros((B, P), np.int32) for k in ("tokens", "positions", "segments")}
    steps = {"tokens": np.zeros((B, N - 1), np.int32), "positions": np.tile(np.arange(N - 1, dtype=np.int32), (B, 1))}
    for b, (row, start, n) in enumerate(r for r in DECODE_ROWS if r):
        seq = PACKED[0][row, start : start + n + N]
        prompt["tokens"][b, P - n :], prompt["positions"][b, P - n :], prompt["segments"][b, P - n :] = (
            seq[:n],
            np.arange(n),
            1,
        )
        steps["tokens"][b], steps["positions"][b] = seq[n : n + N - 1], n + np.arange(N - 1)
    return prompt, steps


def forward(model, tokens, positions, segment_ids):
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, *batch: nnx.merge(graphdef, p)(*batch)[0])  # the trainer's pattern
    return np.asarray(fn(nnx.to_pure_dict(params), tokens, positions, segment_ids))


def decode(model, mesh=None, rules=None):
    """Prefill then the steps in one jitted program, calling the model as the sampler does
    -> (logits after the prompt [B, V], logits of each step [N-1, B, V])."""
    graphdef, params = nnx.split(model)
    B = len(DECODE_ROWS)

    def run(params, prompt, steps):
        model = nnx.merge(graphdef, params)
        cache = sharded_cache(model, B, P + N, rules)
        logits, cache = model(prompt["tokens"], prompt["positions"], prompt["segments"], cache)

        def step(cache, token_and_position):
            token, position = token_and_position
            logits, cache = model(token[:, None], position[:, None], jnp.ones((B, 1), jnp.int32), cache)
            return cache, logits[:, 0]

        _, step_logits = jax.lax.scan(step, cache, (steps["tokens"].T, steps["positions"].T))
        return logits[:, -1], step_logits

    prompt, steps = decode_batch()
    if mesh is None:
        out = jax.jit(run)(nnx.to_pure_dict(params), prompt, steps)
    else:
        prompt, steps = jax.device_put((prompt, steps), sharding.batch_sharding(mesh, rules))
        with jax.set_mesh(mesh):
            out = jax.jit(run)(nnx.to_pure_dict(params), prompt, steps)
    return tuple(np.asarray(a) for a in out)


class Family:
    """One family's checkpoint, its model on one device, and (computed once, on first use) the
    model's compiled logits on PACKED and its decode outputs, which several tests compare against."""

    def __init__(self, path):
        self.path, self.model = path, tunix.load(path)

    @functools.cached_property
    def compiled(self):
        return forward(self.model, *PACKED[:3])

    @functools.cached_property
    def decoded(self):
        return decode(self.model)


@pytest.fixture(scope="module")
def families(tiny_checkpoint):
    """families(name) -> its Family, made once."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = Family(tiny_checkpoint(name, **VARIANTS.get(name, {})))
        return made[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(families, name):
    """The model as loaded and called (TOL), and compiled as the trainer runs it (JIT_TOL)."""
    family = families(name)
    tokens, positions, segment_ids, long_seq, segs = PACKED
    logits, cache = family.model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))
    assert cache is None and logits.shape == (2, 640, 512) and family.model.vocab_size == 512
    refs = torch_logits(family.path, long_seq, *segs)
    starts = np.cumsum([0, *map(len, segs)])
    for ours, tol in ((np.asarray(logits), TOL), (family.compiled, JIT_TOL)):
        np.testing.assert_allclose(ours[0], refs[0], atol=tol, rtol=0)
        for ref, start in zip(refs[1:], starts):
            np.testing.assert_allclose(ours[1, start : start + len(ref)], ref, atol=tol, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_cache_decode_matches_full_forward(families, name):
    family = families(name)
    last, step_logits = family.decoded
    assert np.isfinite(last).all() and np.isfinite(step_logits).all()  # the batch-padding row too
    full = family.compiled
    for b, (row, start, n) in enumerate(r for r in DECODE_ROWS if r):
        np.testing.assert_allclose(last[b], full[row, start + n - 1], atol=TOL, rtol=0)
        np.testing.assert_allclose(step_logits[:, b], full[row, start + n : start + n + N - 1], atol=TOL, rtol=0)


# ---------------------------------------------------------------- sharding


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_matches_single_device(families, name):
    family = families(name)
    reference = family.compiled  # computed outside the mesh below, whatever ran before
    mesh = sharding.create_mesh(SHARDED, ONES)
    model = tunix.load(family.path, mesh=mesh, max_replicated_param_mib=0.01)
    embedding = model.net.embedder.input_embedding.get_value()
    assert embedding.sharding.spec == PartitionSpec("tensor", "fsdp")  # vocab -> tensor, embed -> fsdp
    axes = model.param_axes()
    assert axes["net"]["embedder"]["input_embedding"] == ("vocab", "embed")
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(
        nnx.to_pure_dict(nnx.state(model))
    )
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(forward(model, *PACKED[:3]), reference, atol=TOL, rtol=0)


def test_sharded_decode_matches_single_device(families):
    """The sampler's program under the mesh: batch split over data x fsdp, the cache constrained by
    cache_axes. The cache code is the same for every family, so one family runs it."""
    family = families("llama")
    mesh = sharding.create_mesh(SHARDED, ONES)
    model = tunix.load(family.path, mesh=mesh)
    for ours, ref in zip(decode(model, mesh, sharding.DEFAULT_RULES), family.decoded):
        np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_sampler_phases_grow_the_cache_to_the_same_draws(families):
    """The sampler's decode phases grow Tunix's cache by empty columns (cache_axes' `length`): the
    draws of one loop over the whole cache, for rows of different prompt lengths."""
    model = families("qwen2").model
    prompts = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 11, 8, 1], [12]]
    sampling = SamplingParams(max_new_tokens=7, temperature=1.0)
    one, phased = (
        ColocatedSampler(model, cache_phases=k).generate(prompts, sampling, jax.random.key(4)) for k in (1, 3)
    )
    np.testing.assert_array_equal(phased.tokens, one.tokens)
    np.testing.assert_allclose(phased.logprobs, one.logprobs, atol=1e-5, rtol=0)
    assert len(set(one.tokens.ravel())) > 7


def test_indivisible_or_replicated_parameters_are_config_errors(families):
    path = families("qwen2").path
    with pytest.raises(ConfigError, match=r"parameter .*\['k_proj'\].* cannot be split"):  # 2 kv heads, 8 devices
        tunix.load(path, mesh=sharding.create_mesh({"data": 1, "fsdp": 1, "tensor": 8}, ONES))
    no_rules = tuple((name, None) for name, _ in sharding.DEFAULT_RULES)
    with pytest.raises(ConfigError, match="would be fully replicated"):
        tunix.load(path, mesh=sharding.create_mesh(SHARDED, ONES), rules=no_rules, max_replicated_param_mib=0.01)


# ---------------------------------------------------------------- the rest of the interface


@pytest.mark.parametrize("name", FAMILIES)
def test_save_hf_then_transformers_load_gives_same_logits(families, tmp_path, name):
    family = families(name)
    family.model.save_hf(str(tmp_path / "out"))
    tokens = np.random.default_rng(2).integers(0, 512, 100)
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", tokens)[0], torch_logits(family.path, tokens)[0])


def test_trainer_pattern_state_grads_and_interface(families):
    """Only parameters are state, the graph hashes (the sampler keys its programs by it), a loss
    differentiates through merge inside jit, and the pure-dict helpers match the parameters."""
    model = families("qwen2").model
    graphdef, params = nnx.split(model)
    assert len(jax.tree.leaves(params)) == len(jax.tree.leaves(nnx.state(model, nnx.Param))) > 0
    assert hash(graphdef) == hash(nnx.split(model)[0])
    params = nnx.to_pure_dict(params)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 512, (2, 32)), jnp.int32)

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, jnp.broadcast_to(jnp.arange(32), (2, 32)), jnp.ones_like(tokens))
        return jax.nn.logsumexp(logits, axis=-1).mean()

    grads = jax.jit(jax.grad(loss))(params)
    assert all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in jax.tree.leaves(grads))
    decay = model.decay_mask()
    assert jax.tree.structure(decay) == jax.tree.structure(params)
    assert decay["net"]["layers"][0]["attn"]["q_bias"] is False and decay["net"]["final_norm"]["w"] is False
    assert decay["net"]["layers"][0]["mlp"]["up_proj"]["kernel"] is True
    E, M, H, K, D, L, V = 64, 128, 4, 2, 16, 2, 512
    assert (
        model.flops_per_token(100)
        == 6 * (L * (2 * E * H * D + 2 * E * K * D + 3 * E * M) + E * V) + 12 * L * H * D * 100
    )


def test_mixed_precision_keeps_float32_parameters(families):
    family = families("llama")
    model = tunix.load(family.path, dtype="bfloat16", weight_dtype="float32")
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model))} == {jnp.dtype("float32")}
    logits = forward(model, *(a[:, :64] for a in PACKED[:3]))
    assert logits.dtype == jnp.bfloat16
    np.testing.assert_allclose(logits.astype(np.float32), family.compiled[:, :64], atol=0.5, rtol=0.05)


def test_source_builds_from_the_config(families):
    from helpers import make_cfg

    path = families("qwen3").path
    mesh = sharding.create_mesh(SHARDED, ONES)
    model = tunix.source(make_cfg(model_source="tunix", load_parameters_path=str(path)), mesh)
    assert isinstance(model, tunix.TunixModel) and len(model.net.embedder.input_embedding.get_value().devices()) == 8
    with pytest.raises(ConfigError, match="load_parameters_path"):
        tunix.source(make_cfg(model_source="tunix"), mesh)


# ---------------------------------------------------------------- the unchanged trainer


@pytest.mark.parametrize("mode", ["sft", "grpo"])
def test_trainer_with_model_source_tunix_sharded_equals_one_device(families, tmp_path, mode):
    """model_source=tunix through train.train: fsdp=4 x tensor=2 gives the losses of one device."""
    from helpers import make_cfg, only_first_device
    from unitrain import train

    path = str(families("qwen2").path)
    common = dict(
        model_source="tunix",
        load_parameters_path=path,
        tokenizer_path=path,
        mode=mode,
        steps=3,
        eval_interval=0,
        log_period=1,
        warmup_steps=0,
        learning_rate="1e-3",
        max_target_length=32,
        per_device_batch_size=1,
        base_output_directory=tmp_path,
        peak_flops_per_device="1e12",
        builtin_task_digits=1,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        rollout_max_response_len=4,
        max_prompt_length=32,
        reward="format",
        format_reward_pattern="[aeiou]",
        rollout_temperature=2.0,
    )
    with only_first_device():
        one = make_cfg(**common, run_name="one")  # the config still counts 8 devices: the same 8 rows per step
        assert train.train(one) == 0
    sharded = make_cfg(**common, run_name="sharded", ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
    assert train.train(sharded) == 0

    def curve(cfg):  # grpo: completions are sampled, so equal losses also mean equal rollouts
        keys = ("loss", "grad_norm") + (("reward_mean", "entropy") if mode == "grpo" else ())
        return [[l[k] for k in keys] for l in map(json.loads, open(cfg.metrics_file)) if "loss" in l]

    a, b = np.asarray(curve(one)), np.asarray(curve(sharded))
    assert a.shape[0] == 3 and a[:, 1].max() > 0  # real updates, not a run of zero advantages
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-6)


# ---------------------------------------------------------------- negative controls


def test_unsupported_checkpoints_are_one_line_config_errors(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"config.json: field 'rope_parameters.rope_type' is 'llama3'"):
        tunix.load(tiny_checkpoint("llama"))  # conftest's llama uses llama3 RoPE scaling
    with pytest.raises(ConfigError, match=r"config.json: field 'model_type' is 'mistral'"):
        tunix.load(tiny_checkpoint("mistral"))


def test_a_wrong_mask_is_caught_by_the_tolerance(families):
    """Causal by column, blind to segments: the second packed sequence then sees the first one."""
    family = families("llama")
    tokens, positions, _, _, segs = PACKED
    logits, _ = family.model.net(
        jnp.asarray(tokens), jnp.asarray(positions), None, jnp.tril(jnp.ones((2, 640, 640), bool))
    )
    second = np.asarray(logits[1, len(segs[0]) : len(segs[0]) + len(segs[1])])
    assert np.abs(second - family.compiled[1, len(segs[0]) : len(segs[0]) + len(segs[1])]).max() > 100 * TOL


def test_gemma3_sliding_window_is_exercised(families):
    """The same Gemma3 weights without the sliding window miss the reference: the window matters here."""
    family = families("gemma3")
    config = dataclasses.replace(family.model.net.config, sliding_window_size=4096)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: type(family.model.net)(config, rngs=nnx.Rngs(0))))
    model = nnx.merge(nnx.graphdef(family.model), nnx.state(family.model))
    model.net = nnx.merge(graphdef, nnx.state(family.model.net))
    logits, _ = model(*(jnp.asarray(a) for a in PACKED[:3]))
    assert np.abs(np.asarray(logits) - family.compiled).max() > 100 * TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_through_the_head_give_the_call_logits(families, name):
    """The losses' path (losses.token_stats): hidden states, then the output head a chunk at a time."""
    family = families(name)
    graphdef, params = nnx.split(family.model)

    def head_of_hidden(p, tokens, positions, segment_ids):
        model = nnx.merge(graphdef, p)
        return model.logits(model.hidden_states(tokens, positions, segment_ids))

    got = jax.jit(head_of_hidden)(params, *map(jnp.asarray, PACKED[:3]))
    np.testing.assert_allclose(np.asarray(got), family.compiled, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_hidden_states_equal_the_uncached_forward_and_fill_the_calls_cache(families, name):
    """The sampler's prefill (engines/colocated.py): hidden states with the cache filled, then the head."""
    family = families(name)
    graphdef, params = nnx.split(family.model)
    B = len(DECODE_ROWS)

    def prefill(p, prompt):
        model = nnx.merge(graphdef, p)
        empty = model.init_cache(B, P + N)
        hidden, cache = model.hidden_states(prompt["tokens"], prompt["positions"], prompt["segments"], empty)
        _, call_cache = model(prompt["tokens"], prompt["positions"], prompt["segments"], empty)
        uncached = model.hidden_states(*map(jnp.asarray, PACKED[:3]))
        return hidden, model.logits(hidden), cache, call_cache, uncached

    hidden, logits, cache, call_cache, uncached = jax.jit(prefill)(params, decode_batch()[0])
    for b, (row, start, n) in enumerate(r for r in DECODE_ROWS if r):
        np.testing.assert_allclose(np.asarray(hidden[b, P - n :]), uncached[row, start : start + n], atol=TOL, rtol=0)
        np.testing.assert_allclose(
            np.asarray(logits[b, P - n :]), family.compiled[row, start : start + n], atol=TOL, rtol=0
        )
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-6, rtol=0), cache, call_cache)
    assert int(cache.layers["layer_0"]["end_index"][0]) == P


# ---------------------------------------------------------------- mixture of experts (Qwen3-MoE)

MOE_VARIANT = dict(rope_theta=1e6, experts=(8, 2, 32))  # 8 experts, 2 per token, each of width 32


def test_qwen3_moe_equals_transformers_and_our_decoder_and_exports(tiny_checkpoint, tmp_path):
    """Tunix's Qwen3-MoE (its every-expert path on CPU) against transformers (a long and a packed
    row, JIT_TOL) and our decoder's ragged experts (TOL); its export reloads in transformers to the
    same logits; FLOPs by active experts, as our decoder counts them."""
    from unitrain.adapters import hf

    path = tiny_checkpoint("qwen3_moe", **MOE_VARIANT)
    model = tunix.load(path)
    assert model.net.config.num_experts == 8 and model.net.layers[0].mlp.gate_proj.shape == (8, 64, 32)
    tokens, positions, segment_ids, long_seq, segs = PACKED
    logits = forward(model, tokens, positions, segment_ids)
    refs = torch_logits(path, long_seq, *segs)
    np.testing.assert_allclose(logits[0], refs[0], atol=JIT_TOL, rtol=0)
    for ref, start in zip(refs[1:], np.cumsum([0, *map(len, segs)])):
        np.testing.assert_allclose(logits[1, start : start + len(ref)], ref, atol=JIT_TOL, rtol=0)
    ours = hf.load(path)
    real = segment_ids > 0
    np.testing.assert_allclose(logits[real], forward(ours, tokens, positions, segment_ids)[real], atol=TOL, rtol=0)
    assert model.flops_per_token(640) == ours.flops_per_token(640)
    model.save_hf(tmp_path / "out")
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", long_seq)[0], refs[0])


def test_qwen3_moe_with_experts_split_over_fsdp_equals_one_device(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", **MOE_VARIANT)
    reference = forward(tunix.load(path), *PACKED[:3])
    rules = tuple(dict(sharding.DEFAULT_RULES, expert="fsdp").items())
    mesh = sharding.create_mesh(SHARDED, ONES)
    model = tunix.load(path, mesh=mesh, rules=rules)
    gate = model.net.layers[0].mlp.gate_proj.get_value()
    assert gate.sharding.spec == PartitionSpec("fsdp", None, "tensor")  # experts over fsdp, embed whole
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(forward(model, *PACKED[:3]), reference, atol=TOL, rtol=0)


def test_qwen3_moe_without_renormalised_top_k_is_a_config_error(tiny_checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint("qwen3_moe", **MOE_VARIANT), bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(ConfigError, match="field 'norm_topk_prob' is False; Tunix's Qwen3-MoE renormalises"):
        tunix.load(bad)
