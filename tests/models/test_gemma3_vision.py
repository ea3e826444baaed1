"""Gemma 3 with images (models/gemma3_vision.py, its HF loading and export in adapters/hf.py) against
transformers' float32 Gemma3ForConditionalGeneration of a tiny random checkpoint, on pixels the
model's own image processor makes of images drawn here: a right-padded batch of one image, two
images (the second past the local layers' 64-position window) and none."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import drawn
from unitrain.adapters import hf
from unitrain.errors import ConfigError

# Logits reach ~13; float32 sums in another order move them by ~1e-5.
TOL = 1e-4


@pytest.fixture(scope="module")
def case(tiny_checkpoint):
    """The checkpoint, the images' pixels, and right-padded rows: text, one image, text; text, an
    image, 66 tokens of text, another image, text; text alone."""
    path = tiny_checkpoint("gemma3_vision")
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    pixels = processor(images=[drawn(64, 64, "red"), drawn(140, 84, "blue"), drawn(56, 100, "green")])
    config = json.loads((path / "config.json").read_text())
    boi, pad, eoi = (config[k] for k in ("boi_token_index", "image_token_index", "eoi_token_index"))
    text = lambda n, seed: list(np.random.default_rng(seed).integers(3, boi - 4, n))  # noqa: E731
    image = [boi] + [pad] * config["mm_tokens_per_image"] + [eoi]
    rows = [text(3, 0) + image + text(4, 1), text(2, 2) + image + text(66, 3) + image + text(3, 4), text(9, 5)]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    segments = (np.arange(ids.shape[1]) < np.asarray([len(r) for r in rows])[:, None]).astype(np.int32)
    return dict(
        path=path,
        pixels=np.asarray(pixels["pixel_values"], np.float32),
        ids=ids,
        segments=segments,
        lengths=[len(r) for r in rows],
        pad=pad,
    )


def torch_logits(path, case):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = dict(
        input_ids=torch.tensor(case["ids"], dtype=torch.long),
        attention_mask=torch.tensor(case["segments"]),
        pixel_values=torch.tensor(case["pixels"]),
        token_type_ids=torch.tensor((case["ids"] == case["pad"]).astype(np.int64)),
    )
    with torch.no_grad():
        return model(**inputs).logits.numpy()


@nnx.jit
def forward(model, pixels, ids, segments):
    positions = jnp.where(segments > 0, jnp.arange(ids.shape[1]), 0)
    return model(ids, positions, segments, image_features=model.encode_images(pixels))[0]


def ours(model, case):
    return np.asarray(forward(model, *(jnp.asarray(case[k]) for k in ("pixels", "ids", "segments"))))


def assert_rows_close(got, want, case):
    for b, n in enumerate(case["lengths"]):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=TOL, rtol=0)


def test_logits_with_one_two_and_no_image_match_transformers(case):
    model = hf.load(case["path"])
    assert model.cfg.model_family == "gemma3" and model.cfg.sliding_window_pattern == 6
    assert_rows_close(ours(model, case), torch_logits(case["path"], case), case)


def test_images_attending_causally_are_caught_by_the_tolerance(case):
    """Negative control: the images' tokens attending causally (Gemma 3 text's mask) miss the logits
    after an image, so the parity test sees the bidirectional spans."""
    model = hf.load(case["path"])
    model.cfg = dataclasses.replace(model.cfg, model_family="gemma3_text")
    got, want = ours(model, case), torch_logits(case["path"], case)
    assert np.abs(got[0, : case["lengths"][0]] - want[0, : case["lengths"][0]]).max() > 1e-2


def test_published_tower_names_load_alike(case, tmp_path):
    """The published checkpoints' `vision_tower.vision_model.*` names read as transformers 5's
    `vision_tower.*` do."""
    out = tmp_path / "published"
    out.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (out / name).write_bytes((case["path"] / name).read_bytes())
    tensors = load_file(case["path"] / "model.safetensors")
    renamed = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_array_equal(ours(hf.load(out), case), ours(hf.load(case["path"]), case))


def test_save_hf_then_transformers_load_gives_the_same_logits(case, tmp_path):
    hf.load(case["path"]).save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((case["path"] / "config.json").read_text())
    for field in ("mm_tokens_per_image", "image_token_index", "boi_token_index", "eoi_token_index"):
        assert config[field] == source[field], field
    np.testing.assert_array_equal(torch_logits(tmp_path / "out", case), torch_logits(case["path"], case))


def test_a_run_refuses_a_gemma3_folder_in_one_line(case):
    """Gemma 3's images have no data path yet: a run's config naming the folder stops at the load."""
    from helpers import make_cfg

    with pytest.raises(ConfigError, match="model_type.*gemma3"):
        make_cfg(load_parameters_path=str(case["path"]), model_name="")


def test_calls_without_the_images_own_mask_refuse_images(case):
    """A cached call and a shared prefix have no form of the images' bidirectional spans yet: they
    refuse images instead of attending causally."""
    from unitrain.models import kv_cache

    model = hf.load(case["path"])
    ids, segments = jnp.asarray(case["ids"][:1, :12]), jnp.asarray(case["segments"][:1, :12])
    features = model.encode_images(jnp.asarray(case["pixels"][:1]))
    positions = jnp.arange(12)[None]
    with pytest.raises(ValueError, match="without a cache"):
        model(ids, positions, segments, kv_cache.init_cache(model.cfg, 1, 16), image_features=features)
    with pytest.raises(ValueError, match="shared prefix"):
        model.hidden_states_shared_prefix(ids, positions, segments, 10, 1, image_features=features[None])
