"""Gemma 3 text in our decoder (model_family gemma3_text) against transformers' float32 Gemma3ForCausalLM
of a tiny random checkpoint: 6 layers, the 6th global (linear RoPE scaling) and the others local
over a 64-position window, rows longer than the window, a query scale other than head_dim and a
logit soft-cap in its curved range; the KV-cached decode, the export, and a sharded SFT step."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import (
    GEMMA3_ARCH,
    REPO,
    SFT_FAST,
    assert_same_step,
    one_step,
    only_first_device,
    packed_batch,
    torch_logits,
)
from helpers import fixed_step_config as step_config
from unitrain import train
from unitrain.adapters import hf
from unitrain.models import kv_cache

# Logits reach ~8 (the cap); float32 sums in another order move them by ~1e-5.
TOL = 1e-4
WINDOW = 64


@pytest.fixture(scope="module")
def path(tiny_checkpoint, tmp_path_factory):
    """conftest's tiny Gemma 3 with its scores scaled by 1/sqrt(24) (not 1/sqrt(head_dim) = 1/4)
    and its logits (up to ~12 uncapped) capped at 8."""
    out = tmp_path_factory.mktemp("gemma3") / "ckpt"
    shutil.copytree(tiny_checkpoint("gemma3"), out)
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window"] == WINDOW and config["layer_types"].count("full_attention") == 1
    config.update(query_pre_attn_scalar=24, final_logit_softcapping=8.0)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def batch():
    """Row 0: 200 tokens; row 1: 110 and 70 tokens packed, then padding (both beyond the window)."""
    return packed_batch(np.random.default_rng(0), length=200, seg_lengths=(110, 70))


@nnx.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)[0]


def test_load_reads_the_layer_kinds_and_scales(path):
    cfg = hf.load(path).cfg
    assert (cfg.model_family, cfg.sliding_window, cfg.sliding_window_pattern) == ("gemma3_text", WINDOW, 6)
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.rope_scaling_type) == (1e6, 1e4, "linear")
    assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcapping, cfg.tie_word_embeddings) == (24, 8.0, True)


def test_packed_and_right_padded_logits_match_transformers(path, batch):
    """The packed rows, then row 1 as its first sequence right-padded, against transformers' batch
    forward of the same right-padded rows (its attention_mask) and its forward of each sequence."""
    model = hf.load(path)
    tokens, positions, segment_ids, long_seq, segs = batch
    logits = np.asarray(forward(model, *map(jnp.asarray, (tokens, positions, segment_ids))))
    np.testing.assert_allclose(logits[0], torch_logits(path, long_seq), atol=TOL, rtol=0)
    start = 0
    for s in segs:
        np.testing.assert_allclose(logits[1, start : start + len(s)], torch_logits(path, s), atol=TOL, rtol=0)
        start += len(s)

    n = len(segs[0])
    segment_ids = segment_ids.copy()
    segment_ids[1, n:] = 0  # the second sequence is padding now
    padded = np.asarray(forward(model, *map(jnp.asarray, (tokens, positions, segment_ids))))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = ref.eval()(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segment_ids > 0)).logits
    np.testing.assert_allclose(padded[0], want[0].numpy(), atol=TOL, rtol=0)
    np.testing.assert_allclose(padded[1, :n], want[1, :n].numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "change",
    [
        dict(sliding_window=None),  # the local layers attending to the whole row
        dict(sliding_window_pattern=0),  # every layer local, on the global layers' RoPE
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=None),
    ],
    ids=["no_window", "no_global_layer", "no_cap", "head_dim_scale"],
)
def test_each_gemma_difference_is_caught_by_the_tolerance(path, batch, change):
    """Negative controls: a model without one of the differences misses transformers' logits by far
    more than TOL, so the parity test sees each."""
    model = hf.load(path)
    model.cfg = dataclasses.replace(model.cfg, **change)
    tokens, _, _, long_seq, _ = batch
    ours = forward(model, jnp.asarray(long_seq)[None], jnp.arange(len(long_seq))[None], jnp.ones((1, 200), jnp.int32))
    assert np.abs(np.asarray(ours[0]) - torch_logits(path, long_seq)).max() > 1e-2


@pytest.mark.parametrize("copies", [True, False], ids=["cpu_route", "accelerator_route"])
def test_kv_cached_decode_equals_the_full_forward(path, copies, monkeypatch):
    """A right-padded prefill in two calls, past the window, then token-by-token decode through
    `for_decoding(decode_weights())` as the samplers call the model (a `Decoding`'s per-layer
    weights, or the stacked ones), give the full forward's logits."""
    from unitrain.models import decoder

    monkeypatch.setattr(decoder, "copies_weight_slices", lambda platform: copies)
    model = hf.load(path)
    call = nnx.jit(lambda model, *args: model.for_decoding(model.decode_weights())(*args))
    rng = np.random.default_rng(1)
    prompt_lens, prefill_len, steps = (72, 50), 72, 4
    seqs = [rng.integers(0, 512, n + steps) for n in prompt_lens]
    expected = [
        np.asarray(forward(model, jnp.asarray(s)[None], jnp.arange(len(s))[None], jnp.ones((1, len(s)), jnp.int32)))[0]
        for s in seqs
    ]
    tokens, positions, segments = (np.zeros((2, prefill_len), np.int32) for _ in range(3))
    for b, n in enumerate(prompt_lens):
        tokens[b, :n], positions[b, :n], segments[b, :n] = seqs[b][:n], np.arange(n), 1
    cache = kv_cache.init_cache(model.cfg, batch_size=2, max_length=80)
    chunks = []
    for part in (slice(0, 40), slice(40, prefill_len)):
        logits, cache = call(model, *(jnp.asarray(a[:, part]) for a in (tokens, positions, segments)), cache)
        chunks.append(np.asarray(logits))
    logits = np.concatenate(chunks, axis=1)
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(logits[b, :n], expected[b][:n], atol=TOL, rtol=0)
    for step in range(steps):
        pos = np.asarray(prompt_lens) + step
        tok = np.asarray([seqs[b][pos[b]] for b in range(2)])
        logits, cache = call(
            model, jnp.asarray(tok)[:, None], jnp.asarray(pos)[:, None], jnp.ones((2, 1), jnp.int32), cache
        )
        for b in range(2):
            np.testing.assert_allclose(np.asarray(logits[b, 0]), expected[b][pos[b]], atol=TOL, rtol=0)


def test_save_hf_then_transformers_load_gives_the_same_logits_and_config(path, tmp_path):
    hf.load(path).save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((path / "config.json").read_text())
    for field in ("layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping"):
        assert config[field] == source[field], field
    assert config["rope_parameters"] == source["rope_parameters"]
    tokens = np.random.default_rng(2).integers(0, 512, 100)
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", tokens), torch_logits(path, tokens))


# A randomly initialised Gemma 3 of the run's own keys: global layers every 2nd, the local ones over
# 6 of SFT's 32 positions.
GEMMA_KEYS = ["model_name=", *(f"{key}={value}" for key, value in GEMMA3_ARCH.items())]
SFT_STEP = ["mode=sft", "max_target_length=32", "per_device_batch_size=1", *GEMMA_KEYS]


def test_sft_step_split_over_fsdp_equals_one_device(tmp_path):
    """Every metric and the parameters after one SFT step of the same rows, the parameters split
    over 8 devices on fsdp against all on one."""
    with only_first_device():
        want = one_step(step_config(tmp_path / "one", *SFT_STEP))
    got = one_step(step_config(tmp_path / "fsdp", *SFT_STEP, "ici_fsdp_parallelism=8"))
    assert got[3].run.mesh.shape["fsdp"] == 8 and want[3].run.mesh.shape["fsdp"] == 1
    assert got[3].run.model.cfg.sliding_window_pattern == 2
    assert_same_step(got, want)


@pytest.mark.parametrize(
    "args, message",
    [
        (["sliding_window_pattern=6"], "sliding_window_pattern=6 makes local layers: set their sliding_window"),
        (["rope_local_base_freq=10000"], "rope_local_base_freq is set but sliding_window_pattern is 0"),
        (["query_pre_attn_scalar=0"], "query_pre_attn_scalar"),
        (["final_logit_softcapping=-1"], "final_logit_softcapping"),
    ],
)
def test_bad_gemma3_keys_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *SFT_FAST, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
