"""unitrain's forward against transformers' PyTorch forward of the same checkpoint, per family."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import packed_batch, torch_logits
from unitrain.adapters import hf
from unitrain.errors import ConfigError

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    model = hf.load(path)
    tokens, positions, segment_ids, long_seq, segs = packed_batch(np.random.default_rng(0))
    logits, cache = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))
    logits = np.asarray(logits)
    assert cache is None and logits.shape == (2, 640, 512)
    np.testing.assert_allclose(logits[0], torch_logits(path, long_seq), atol=TOL, rtol=0)
    start = 0
    for s in segs:
        np.testing.assert_allclose(logits[1, start : start + len(s)], torch_logits(path, s), atol=TOL, rtol=0)
        start += len(s)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_transformers_load_gives_same_logits(tiny_checkpoint, tmp_path, family):
    path = tiny_checkpoint(family)
    hf.save(hf.load(path), tmp_path / "out")
    tokens = np.random.default_rng(1).integers(0, 512, 100)
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", tokens), torch_logits(path, tokens))


def test_sharded_safetensors_round_trip(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    hf.save(hf.load(path), tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    tokens = np.random.default_rng(2).integers(0, 512, 50)
    np.testing.assert_array_equal(torch_logits(tmp_path / "sharded", tokens), torch_logits(path, tokens))
    reloaded = hf.load(tmp_path / "sharded")
    ours, _ = reloaded(jnp.asarray(tokens)[None], jnp.arange(50)[None], jnp.ones((1, 50), jnp.int32))
    np.testing.assert_allclose(np.asarray(ours[0]), torch_logits(path, tokens), atol=TOL, rtol=0)


def test_wrong_rope_is_caught_by_the_tolerance(tiny_checkpoint):
    """Negative control: ignoring llama3 RoPE scaling must break parity, so the 1e-4 check has teeth."""
    path = tiny_checkpoint("llama")
    model = hf.load(path)
    model.cfg = dataclasses.replace(model.cfg, rope_scaling_type="none")
    tokens = np.random.default_rng(3).integers(0, 512, 600)
    ours, _ = model(jnp.asarray(tokens)[None], jnp.arange(600)[None], jnp.ones((1, 600), jnp.int32))
    assert np.abs(np.asarray(ours[0]) - torch_logits(path, tokens)).max() > 1e-3


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
        (dict(num_hidden_layers=3), "model.layers.2"),
        (dict(hidden_size=32), "shape"),
    ],
)
def test_bad_checkpoint_is_a_clear_error(tiny_checkpoint, tmp_path, changes, field):
    path = _edit_config(tiny_checkpoint("llama"), tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=field):
        hf.load(path)


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        hf.load(tmp_path)
