"""Scalar-head models (models/scalar_head.py) against transformers' *ForSequenceClassification: the
pooled scores of tiny random Llama, Qwen2, Qwen3 and Mistral classifiers on right- and left-padded
batches, the export round trip, the causal-LM start, Tunix backbones, and the bad inputs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers import make_cfg
from unitrain import sharding
from unitrain.errors import CheckpointError, ConfigError
from unitrain.models.scalar_head import ScalarHeadModel, build_scalar_model, pool_last

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
VARIANTS = {"llama": dict(rope_scaling="llama3"), "qwen2": dict(tie=True), "mistral": dict(sliding_window=8)}
TOL = 1e-4  # float32 on both sides, as the causal LM parity tests (test_hf_parity.py)
PAD = 0  # make_tiny_model's pad token (<|endoftext|>); the rows below never contain it


def classifier(tiny_checkpoint, family, **extra):
    return tiny_checkpoint(family, num_labels=1, **VARIANTS.get(family, {}), **extra)


def padded_batch(side: str, lengths=(12, 7, 1), seed=0):
    """Rows of real tokens (never PAD) of `lengths`, padded on `side` to the longest."""
    rng, T = np.random.default_rng(seed), max(lengths)
    tokens = np.full((len(lengths), T), PAD, np.int32)
    positions = np.zeros_like(tokens)
    segment_ids = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(T - n, T)
        tokens[i, cols] = rng.integers(3, 512, n)
        positions[i, cols] = np.arange(n)
        segment_ids[i, cols] = 1
    return tokens, positions, segment_ids


def torch_scores(path, tokens, segment_ids):
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert ref.config.pad_token_id == PAD
    with torch.no_grad():
        return ref(torch.tensor(tokens), attention_mask=torch.tensor(segment_ids > 0).long()).logits.numpy()


def our_scores(model, tokens, positions, segment_ids):
    values = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))
    return np.asarray(pool_last(values, jnp.asarray(segment_ids)))


def mesh8():
    return sharding.create_mesh({"data": 2, "fsdp": 4, "tensor": 1}, {"data": 1, "fsdp": 1, "tensor": 1})


def build(path, num_labels=1, require_classifier=False, **overrides):
    cfg = make_cfg(model_name="", load_parameters_path=str(path), **overrides)
    return build_scalar_model(cfg, mesh8(), cfg.load_parameters_path, num_labels, require_classifier=require_classifier)


# ---------------------------------------------------------------- pooling


def test_pool_last_takes_the_rightmost_real_token_as_transformers_does():
    values = jnp.arange(2 * 5 * 2, dtype=jnp.float32).reshape(2, 5, 2)
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])  # right-padded, left-padded
    np.testing.assert_array_equal(pool_last(values, mask), np.asarray(values)[[0, 1], [2, 4]])
    # transformers' rule written out: argmax over positions of index * (token != pad)
    tokens = np.where(np.asarray(mask) > 0, 7, PAD)
    last = (np.arange(5) * (tokens != PAD)).argmax(-1)
    np.testing.assert_array_equal(pool_last(values, mask), np.asarray(values)[[0, 1], last])


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_scores_equal_transformers_logits(tiny_checkpoint, family, side):
    path = classifier(tiny_checkpoint, family)
    model = build(path)
    assert isinstance(model, ScalarHeadModel) and "lm_head" not in vars(model.backbone)
    tokens, positions, segment_ids = padded_batch(side)
    ours = our_scores(model, tokens, positions, segment_ids)
    theirs = torch_scores(path, tokens, segment_ids)
    assert ours.shape == theirs.shape == (3, 1) and np.abs(theirs).max() > 1e-2  # not trivially small
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_reloads_in_transformers_with_equal_logits(tiny_checkpoint, tmp_path, family):
    path = classifier(tiny_checkpoint, family)
    model = build(path)
    model.save_hf(str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [transformers.AutoConfig.from_pretrained(path).architectures[0]]
    assert config["pad_token_id"] == PAD and len(config["id2label"]) == 1
    tokens, positions, segment_ids = padded_batch("left")
    np.testing.assert_allclose(
        torch_scores(tmp_path / "out", tokens, segment_ids), torch_scores(path, tokens, segment_ids), atol=1e-6, rtol=0
    )
    again = build(tmp_path / "out")  # and unitrain reads its own export
    np.testing.assert_allclose(
        our_scores(again, tokens, positions, segment_ids), our_scores(model, tokens, positions, segment_ids), atol=1e-6
    )


def test_a_causal_lm_gives_its_backbone_under_a_fresh_head(tiny_checkpoint):
    lm = tiny_checkpoint("qwen3")
    model = build(lm)
    hidden_ref = transformers.AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    tokens, positions, segment_ids = padded_batch("right", lengths=(6,))
    with torch.no_grad():
        hidden = hidden_ref.model(torch.tensor(tokens)).last_hidden_state.numpy()
    score = np.asarray(model.score[...])
    assert score.shape == (64, 1) and 0.01 < score.std() < 0.04  # HF's init: normal(0, 0.02)
    values = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))
    np.testing.assert_allclose(values, hidden @ score, atol=TOL, rtol=0)
    with pytest.raises(ConfigError, match="ForCausalLM.*must be a \\*ForSequenceClassification"):
        build(lm, require_classifier=True)


def test_param_axes_decay_and_flops_include_the_head(tiny_checkpoint):
    model = build(classifier(tiny_checkpoint, "llama"))
    assert model.param_axes()["score"] == ("embed", None)
    assert model.decay_mask()["score"] is True and model.decay_mask()["backbone"]["final_norm"] is False
    assert "lm_head" not in model.param_axes()["backbone"]
    backbone_flops = model.backbone.flops_per_token(16)
    assert model.flops_per_token(16) == backbone_flops + 6 * 64
    c = model.backbone.cfg  # the backbone counts no LM head
    per_layer = c.emb_dim * (2 * c.num_query_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.emb_dim * c.mlp_dim
    assert backbone_flops == 6 * c.num_decoder_layers * per_layer + 12 * c.num_decoder_layers * 4 * 16 * 16


def test_random_init_from_the_config_keys_and_sharded():
    cfg = make_cfg()
    model = build_scalar_model(cfg, mesh8(), "")
    values = model(jnp.ones((8, 4), jnp.int32), jnp.tile(jnp.arange(4), (8, 1)), jnp.ones((8, 4), jnp.int32))
    assert values.shape == (8, 4, 1) and values.dtype == jnp.float32
    assert len(model.backbone.embed.get_value().devices()) == 8


# ---------------------------------------------------------------- bad input


def test_a_classifier_of_another_num_labels_is_one_line(tiny_checkpoint):
    path = tiny_checkpoint("llama", num_labels=3)
    with pytest.raises(ConfigError, match="num_labels=3; a scalar reward or value needs 1"):
        build(path)


def test_a_classifier_without_score_weight_is_one_line(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    src = classifier(tiny_checkpoint, "qwen3")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["score.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'score.weight'"):
        build(broken)


# ---------------------------------------------------------------- Tunix backbones


def test_tunix_backbone_scores_equal_transformers(tiny_checkpoint):
    pytest.importorskip("tunix")
    path = tiny_checkpoint("qwen2", num_labels=1, tie=True)  # Tunix reads a tied classifier
    model = build(path, model_source="tunix")
    tokens, positions, segment_ids = padded_batch("left")
    np.testing.assert_allclose(
        our_scores(model, tokens, positions, segment_ids), torch_scores(path, tokens, segment_ids), atol=TOL, rtol=0
    )


def test_tunix_causal_lm_start_drops_its_lm_head(tiny_checkpoint, tmp_path):
    pytest.importorskip("tunix")
    path = tiny_checkpoint("llama", rope_theta=1e6)  # Tunix's Llama3 applies theta 1e6
    model = build(path, model_source="tunix")
    assert "lm_head" not in model.param_axes()["backbone"]["net"]
    model.save_hf(str(tmp_path / "out"))
    tokens, positions, segment_ids = padded_batch("right")
    np.testing.assert_allclose(
        torch_scores(tmp_path / "out", tokens, segment_ids), our_scores(model, tokens, positions, segment_ids), atol=TOL
    )
    with pytest.raises(ConfigError, match="untied classifier has no lm_head.weight"):  # Tunix's loader needs it
        build(tmp_path / "out", model_source="tunix")


# ---------------------------------------------------------------- a plugin model source


def test_a_plugin_source_builds_the_backbone_of_a_reward_model_from_an_hf_classifier(tiny_checkpoint):
    from safetensors.numpy import load_file

    import plugin_model_source

    path = classifier(tiny_checkpoint, "qwen3")
    plugin_model_source.BUILT.clear()
    model = build(path, require_classifier=True, model_source="plugin_model_source:source")
    assert plugin_model_source.BUILT == [False] and "lm_head" not in vars(model.backbone)  # built headless
    score = load_file(str(path / "model.safetensors"))["score.weight"]  # the head: the classifier's
    np.testing.assert_array_equal(np.asarray(model.score[...]), score.T)
