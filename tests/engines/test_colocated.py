"""The sampler: greedy = argmax of the full forward, stop tokens, logprobs, top-k/top-p, buckets, sharding."""

import dataclasses
import logging
import re

import jax
import numpy as np
import pytest
import qwix
from flax import nnx

from helpers import ROLLOUT_CFG as CFG
from helpers import ROLLOUT_PROMPTS as PROMPTS
from helpers import full_logits, log_softmax, naive_sample, scaled, tiny_model
from unitrain import sharding
from unitrain.engines import buckets, colocated, programs
from unitrain.engines.base import SamplingParams
from unitrain.engines.factory import make_sampler
from unitrain.errors import ConfigError
from unitrain.models import decoder as model_lib


def generate(model, prompts, sampling, key, mesh=None, rules=None, cache_phases=3, quantization="none"):
    """The sampler's draws, its decode loop in phases (a cache grown twice) unless told otherwise."""
    sampler = colocated.ColocatedSampler(
        model, mesh=mesh, rules=rules, cache_phases=cache_phases, quantization=quantization
    )
    return sampler.generate(prompts, sampling, key)


def greedy(model, prompts, n=6, quantization="none", **kw):
    sampling = SamplingParams(max_new_tokens=n, temperature=0.0, **kw)
    return generate(model, prompts, sampling, jax.random.key(0), quantization=quantization)


def test_greedy_equals_argmax_of_full_forward_step_by_step():
    model = tiny_model()
    out = greedy(model, PROMPTS)
    assert out.tokens.shape == (4, 6) and out.tokens.dtype == np.int32
    np.testing.assert_array_equal(out.mask, 1)
    np.testing.assert_array_equal(out.lengths, 6)
    for b, prompt in enumerate(PROMPTS):
        generated = list(out.tokens[b])
        for j, token in enumerate(generated):
            logits = full_logits(model, prompt + generated[:j])[-1]
            assert np.argmax(logits) == token, (b, j)
            np.testing.assert_allclose(out.logprobs[b, j], log_softmax(logits)[token], atol=1e-4)
    # Not a degenerate model: rows differ and tokens vary along a row.
    assert len({tuple(r) for r in out.tokens}) > 1 and len(set(out.tokens.ravel())) > 3


def test_stop_token_ends_only_its_row():
    model = tiny_model()
    reference = greedy(model, PROMPTS)
    stop = int(reference.tokens[0, 2])
    out = greedy(model, PROMPTS, stop_token_ids=(stop,))
    # Each row stops at its first emission of `stop` (row 0: step 2 at the latest); others run to N.
    first_stop = [int(np.argmax(r == stop)) if (r == stop).any() else 5 for r in reference.tokens]
    assert first_stop[0] <= 2 and any(k == 5 for k in first_stop[1:])
    for b in range(len(PROMPTS)):
        length = first_stop[b] + 1
        assert out.lengths[b] == length
        np.testing.assert_array_equal(out.tokens[b, :length], reference.tokens[b, :length])
        np.testing.assert_array_equal(out.tokens[b, length:], 0)
        np.testing.assert_array_equal(out.mask[b], np.arange(6) < length)
        np.testing.assert_array_equal(out.logprobs[b, length:], 0.0)
    assert out.tokens[0, out.lengths[0] - 1] == stop


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_full_forward(temperature):
    model = tiny_model()
    params = SamplingParams(max_new_tokens=5, temperature=temperature)
    out = generate(model, PROMPTS, params, jax.random.key(1))
    assert out.logprobs.dtype == np.float32
    for b, prompt in enumerate(PROMPTS):
        generated = [int(t) for t in out.tokens[b]]
        logits = full_logits(model, prompt + generated)
        for j, token in enumerate(generated):
            expected = log_softmax(logits[len(prompt) + j - 1] / temperature)[token]
            np.testing.assert_allclose(out.logprobs[b, j], expected, atol=1e-4)


def test_top_k_samples_only_the_top_k():
    model = tiny_model()
    prompt = PROMPTS[1]
    params = SamplingParams(max_new_tokens=2, temperature=1.5, top_k=3)
    out = generate(model, [prompt] * 64, params, jax.random.key(2))
    top3 = set(np.argsort(full_logits(model, prompt)[-1])[-3:].tolist())
    assert set(out.tokens[:, 0].tolist()) == top3
    for row in out.tokens:  # the second token: top 3 after that row's own first token
        allowed = np.argsort(full_logits(model, prompt + [int(row[0])])[-1])[-3:]
        assert int(row[1]) in allowed


def nucleus(logits, p):
    probs = np.exp(log_softmax(logits.astype(np.float64)))
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    return set(order[: int(np.searchsorted(mass, p)) + 1].tolist())


def test_top_p_samples_only_the_nucleus():
    model = tiny_model()
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=3, top_p=0.5)
    out = generate(model, [prompt] * 64, params, jax.random.key(3))
    first = nucleus(full_logits(model, prompt)[-1], 0.5)
    assert set(out.tokens[:, 0].tolist()) == first  # 64 draws see every member of a small nucleus
    assert len(first) < CFG.vocab_size // 4
    for row in out.tokens:
        for j in range(1, 3):
            logits = full_logits(model, prompt + [int(t) for t in row[:j]])[-1]
            assert int(row[j]) in nucleus(logits, 0.5)


def test_prompts_in_one_bucket_compile_once(caplog):
    model = tiny_model()
    params = SamplingParams(max_new_tokens=7, temperature=0.0)
    sampler = colocated.ColocatedSampler(model)
    with caplog.at_level(logging.DEBUG, logger="unitrain"):
        a = sampler.generate([list(range(k, 6)) for k in range(1, 4)], params, jax.random.key(0))
        b = sampler.generate([list(range(k, 10)) for k in range(1, 5)], params, jax.random.key(0))
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled generate")]
    assert len(compiles) == 1 and compiles[0].startswith("compiled generate (batch=4 prompt=16 new=7 cache phases=1)")
    assert a.tokens.shape == (3, 7) and b.tokens.shape == (4, 7)
    assert buckets.bucket_prompt_length(17) == 32 and buckets.bucket_batch_size(3, 8) == 8
    assert buckets.bucket_batch_size(9, 8) == 16 and buckets.bucket_batch_size(3, 6) == 6


@pytest.mark.parametrize("phases, new_tokens, compiled", [(4, 7, 4), (3, 2, 2)])
def test_rollout_cache_phases_reach_the_sampler(caplog, phases, new_tokens, compiled):
    """The config key picks the decode loop's phases (fewer when there are fewer new tokens)."""
    from helpers import make_cfg
    from unitrain.run import build_run

    run, state = build_run(make_cfg(model_name="tiny", rollout_cache_phases=phases))
    sampler = make_sampler(run)
    sampler.update_weights(state["params"], 0)
    with caplog.at_level(logging.DEBUG, logger="unitrain"):
        out = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=1.0), jax.random.key(0))
    assert f"new={new_tokens} cache phases={compiled})" in caplog.text and out.tokens.shape == (4, new_tokens)


@pytest.mark.parametrize("fsdp, tensor, quantization", [(8, 1, "none"), (4, 2, "none"), (4, 2, "int8")])
def test_sharded_greedy_equals_unsharded(fsdp, tensor, quantization):
    """fsdp and tensor parallel (the decode step's fused q/k/v weight splits over the KV heads), also
    on int8 decode weights (made from the sharded parameters)."""
    mesh = sharding.create_mesh({"data": 1, "fsdp": fsdp, "tensor": tensor}, {"data": 1, "fsdp": 1, "tensor": 1})
    cfg = dataclasses.replace(CFG, logical_axis_rules=sharding.DEFAULT_RULES)
    model = scaled(sharding.init_sharded(lambda: model_lib.create(cfg), mesh, sharding.DEFAULT_RULES))
    assert model.embed[...].addressable_shards[0].data.shape == (64 // tensor, 32 // fsdp)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = PROMPTS + PROMPTS[:2] * 2  # 8 rows; with batch split 4 ways, a prefill block of the 4 prompts
    out = generate(
        model, prompts, params, jax.random.key(0), mesh=mesh, rules=sharding.DEFAULT_RULES, quantization=quantization
    )
    reference = greedy(tiny_model(), prompts, quantization=quantization)
    for k in ("tokens", "mask", "lengths"):
        np.testing.assert_array_equal(getattr(out, k), getattr(reference, k))
    np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-4)


@pytest.mark.parametrize("temperature, cache_phases", [(1.0, 1), (1.0, 3), (0.6, 3), (1.0, 20)])
def test_sampled_tokens_equal_a_naive_uncached_loop(temperature, cache_phases):
    """One loop over the whole cache, three phases, and more phases than tokens (one per token)."""
    model, key = tiny_model(), jax.random.key(7)
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature)
    out = generate(model, PROMPTS, sampling, key, cache_phases=cache_phases)
    tokens, logprobs = naive_sample(model, PROMPTS, 8, temperature, key)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-4)
    assert len(set(tokens.ravel())) > 8  # sampled, not a few greedy favourites


REPEATED = [PROMPTS[1]] * 3 + [PROMPTS[0], PROMPTS[3], PROMPTS[0], PROMPTS[1]]  # 7 rows, 3 distinct prompts


def test_a_repeated_prompt_is_prefilled_once_and_its_rows_sample_apart(caplog):
    model, key = tiny_model(), jax.random.key(3)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    sampler = colocated.ColocatedSampler(model, cache_phases=3)
    with caplog.at_level(logging.DEBUG, logger="unitrain"):
        out = sampler.generate(REPEATED, sampling, key)
    assert "generate (batch=8 prefill rows=4 prompt=16 new=8" in caplog.text
    block = sampler.generate_call(REPEATED, sampling, key).inputs.block
    assert block.tokens.shape == (4, 16)  # the prefill block: 3 prompts + 1 pad
    tokens, logprobs = naive_sample(model, REPEATED, 8, 1.0, key)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-4)
    assert len({tuple(row) for row in out.tokens[:3]}) == 3  # one prompt's samples differ


@pytest.mark.parametrize("shape", [(16, 64), (3, 1000)])
def test_gumbel_noise_is_jax_randoms_bit_for_bit(shape):
    """Every row's noise, and any choice of rows in any order (a compacted decode's) gets theirs."""
    noise = jax.jit(programs.gumbel_noise, static_argnums=2)
    some = np.asarray([shape[0] - 1, 0, shape[0] // 2], np.int32)
    for i in range(3):
        key = jax.random.fold_in(jax.random.key(11), i)
        reference = np.asarray(jax.random.gumbel(key, shape, np.float32))
        np.testing.assert_array_equal(noise(key, np.arange(shape[0], dtype=np.int32), shape[1]), reference)
        np.testing.assert_array_equal(noise(key, some, shape[1]), reference[some])


def test_decode_weights_are_made_once_per_weight_version():
    """A version's calls share one decode copy of the weights; update_weights and release drop it,
    so that the next call samples the new policy, not a stale copy of the old."""
    model = tiny_model()
    graphdef, params = nnx.split(model)
    other = jax.tree.map(lambda w: w * 1.5, nnx.to_pure_dict(params))
    sampler = colocated.ColocatedSampler(model)
    sampling, key = SamplingParams(max_new_tokens=8, temperature=1.0), jax.random.key(3)
    first = sampler.generate(PROMPTS, sampling, key)
    kept = sampler.decode
    assert kept is not None  # CPU: the layers' slices are copies, made outside the token loop
    np.testing.assert_array_equal(sampler.generate(PROMPTS, sampling, key).tokens, first.tokens)
    assert sampler.decode is kept
    sampler.update_weights(other, 1)
    moved = sampler.generate(PROMPTS, sampling, key)
    fresh = colocated.ColocatedSampler(nnx.merge(graphdef, other)).generate(PROMPTS, sampling, key)
    np.testing.assert_array_equal(moved.tokens, fresh.tokens)
    np.testing.assert_allclose(moved.logprobs, fresh.logprobs, atol=1e-6)
    assert not np.array_equal(moved.tokens, first.tokens)
    sampler.release()
    assert sampler.decode is None
    np.testing.assert_array_equal(sampler.generate(PROMPTS, sampling, key).tokens, fresh.tokens)


# The input axes of the stacked weights [layers, ...] and the head: what a per-channel scale reduces.
INPUT_AXES = {"wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2), "w_gate": (1,), "w_up": (1,), "w_down": (1,)}


def dequantised(model, qtype):
    """`model` with every matmul weight replaced by qwix's dequantised per-output-channel quantisation
    of it, made from the stacked parameters (not the sampler's decode weights)."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)

    def fake(w, in_axes):
        channels = [ax for ax in range(w.ndim) if ax not in in_axes]
        return qwix.dequantize(qwix.quantize(w, qtype, channelwise_axes=channels))

    params["layers"] = {k: fake(w, INPUT_AXES[k]) if k in INPUT_AXES else w for k, w in params["layers"].items()}
    params["lm_head"] = fake(params["lm_head"], (0,))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("quantization,qtype", [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_quantised_sampler_samples_the_dequantised_model(quantization, qtype):
    """rollout_quantization: the logprobs the sampler records are those of a full forward of the
    dequantised weights, and differ from the full-precision model's by a small gap."""
    model = tiny_model()
    sampler = colocated.ColocatedSampler(model, cache_phases=3, quantization=quantization)
    out = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=1.0), jax.random.key(1))
    assert isinstance(sampler.decode["head"], qwix.QArray)
    reference, gaps = dequantised(model, qtype), []
    for b, prompt in enumerate(PROMPTS):
        generated = [int(t) for t in out.tokens[b]]
        quantised, full = full_logits(reference, prompt + generated), full_logits(model, prompt + generated)
        for j, token in enumerate(generated):
            at = len(prompt) + j - 1
            np.testing.assert_allclose(out.logprobs[b, j], log_softmax(quantised[at])[token], atol=1e-4)
            gaps.append(abs(out.logprobs[b, j] - log_softmax(full[at])[token]))
    # Measured on this model (weights scaled by 5: sharp distributions): int8 0.063, fp8 0.34 per token.
    assert 1e-3 < np.mean(gaps) < {"int8": 0.15, "fp8": 0.7}[quantization], np.mean(gaps)


def test_rollout_quantization_serves_the_jax_samplers_on_our_dense_decoder():
    """The quantised decode is our dense decoder's: other sources, MoE, plugin samplers and modes
    without a sampler are one line at the config check."""
    from helpers import make_cfg

    assert make_cfg(rollout_quantization="int8").rollout_quantization == "int8"
    assert make_cfg(rollout_quantization="fp8", mode="grpo", sampler="mesh", rollout_devices=2).sampler == "mesh"
    assert make_cfg(rollout_quantization="int8", mode="sft").mode == "sft"  # its generation evals
    refused = {
        "unitrain's dense decoder.*not model_source tunix": dict(model_source="tunix"),
        "unitrain's dense decoder.*num_experts 4": dict(num_experts=4, model_family="qwen3_moe"),
        "serves samplers colocated, mesh and vllm, not the plugin": dict(sampler="helpers:tiny_model"),
        "mode=dpo samples nothing": dict(mode="dpo"),
    }
    for message, keys in refused.items():
        with pytest.raises(ConfigError, match=message):
            make_cfg(rollout_quantization="int8", **keys)


def test_prefill_runs_the_output_head_on_the_last_column_only():
    """Only the last prompt column is sampled from: no [B, P, V] logits in the program."""
    B, P, N, V = 4, 16, 8, 96  # V unlike any other dimension of CFG
    model = model_lib.create(dataclasses.replace(CFG, vocab_size=V), 0)
    graphdef, params = nnx.split(model)
    key = colocated.GenerateKey(
        graphdef,
        cache_rules=None,
        pad_id=0,
        rows=B,
        prefill_rows=B,
        prompt_columns=P,
        new_tokens=N,
        cache_phases=1,
        greedy=False,
        top_k=0,
        use_top_p=False,
    )
    inputs = colocated.GenerateInputs(
        params=nnx.to_pure_dict(params),
        decode=model.decode_weights(),
        block=programs.left_padded(PROMPTS, B, P, pad_id=0),
        budgets=np.full((B,), N, np.int32),
        stop_ids=np.zeros((0,), np.int32),
        temperature=np.float32(1.0),
        top_p=np.float32(1.0),
        rng=jax.random.key(0),
        noise_rows=np.arange(B, dtype=np.int32),
    )
    text = colocated._build(key).lower(inputs).as_text()
    assert f"tensor<{B}x1x{V}xf32>" in text and f"tensor<{B}x{P}x{V}x" not in text


def library_dots(compiled) -> int:
    """How many of a compiled CPU program's dots XLA handed to YNNPACK (inside its library fusions)."""
    text = compiled.as_text()
    bodies = dict(re.findall(r"^(%\S+) .*?\{\n(.*?)\n\}", text, re.M | re.S))
    return sum(" dot(" in bodies.get(called, "") for called in re.findall(r'calls=(%[\w.\-]+).*"__ynn_fusion"', text))


def test_few_rows_decode_with_xlas_own_dots_and_draw_the_same_tokens(monkeypatch, caplog):
    """At most FEW_ROWS rows a device: the generate program's dots are XLA's own (its compile logs
    the option), and the draws are those of XLA's default program."""
    sampling, key = SamplingParams(max_new_tokens=8, temperature=1.0), jax.random.key(5)
    runs, bound = {}, programs.FEW_ROWS
    for few_rows in (bound, 0):
        monkeypatch.setattr(programs, "FEW_ROWS", few_rows)
        sampler = colocated.ColocatedSampler(tiny_model(), cache_phases=2)
        with caplog.at_level(logging.DEBUG, logger="unitrain"):
            program = sampler.generate_program(sampler.generate_call(PROMPTS, sampling, key))
        runs[few_rows] = library_dots(program), sampler.generate(PROMPTS, sampling, key)
    assert "compiled generate (batch=4 prompt=16 new=8 cache phases=2)" in caplog.text
    assert "XLA options {'xla_cpu_experimental_ynn_fusion_type': 'LIBRARY_FUSION_TYPE_REDUCE'}" in caplog.text
    (own, few), (library, default) = runs[bound], runs[0]
    assert own == 0 and library > 0
    np.testing.assert_array_equal(few.tokens, default.tokens)
    np.testing.assert_allclose(few.logprobs, default.logprobs, atol=1e-5)
    assert programs.compiler_options(1) is None  # FEW_ROWS is 0 now


@pytest.mark.parametrize("context, strategy, balance", [(2, "ring", True), (4, "all_gather", False)])
def test_prefill_split_on_the_context_axis_samples_as_unsplit(context, strategy, balance):
    """Left-padded prompts of 1 to 13 tokens prefilled over the context axis (ring or gathered keys,
    in chunks of 4 queries), the decode reading the cache split as the prefill left it: the unsplit
    sampler's tokens, and its logprobs within 1e-4 (float32; the split softmax sums in another order)."""
    mesh = sharding.create_mesh({"fsdp": 8 // context, "context": context}, {})
    cfg = dataclasses.replace(
        CFG,
        logical_axis_rules=sharding.DEFAULT_RULES,
        context_parallel_strategy=strategy,
        context_load_balance=balance,
        attention_chunk_size=4,
    )
    model = scaled(sharding.init_sharded(lambda: model_lib.create(cfg), mesh, sharding.DEFAULT_RULES))
    sampling, key = SamplingParams(max_new_tokens=8, temperature=1.0), jax.random.key(4)
    prompts = PROMPTS + PROMPTS[:2] * 2  # 8 rows, a prefill block of the 4 prompts
    out = generate(model, prompts, sampling, key, mesh=mesh, rules=sharding.DEFAULT_RULES)
    reference = generate(tiny_model(), prompts, sampling, key)
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    np.testing.assert_allclose(out.logprobs, reference.logprobs, atol=1e-4)
    assert len(set(out.tokens.ravel())) > 8  # sampled, not a few greedy favourites
