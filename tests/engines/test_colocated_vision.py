"""The colocated sampler on prompts with images (a tiny random Qwen2.5-VL checkpoint): each distinct
prompt's images go through the tower once for all the rows sampled from it, and the sampled tokens'
logprobs are transformers' float32 forward of the whole rows with their pixels (its own M-RoPE
positions, get_rope_index), so the decode's per-row rope delta is right."""

import json

import jax
import numpy as np
import torch
import transformers
from PIL import Image, ImageDraw

from unitrain.adapters import hf
from unitrain.data.images import PromptImages
from unitrain.engines.base import SamplingParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.models import qwen2_5_vl

# float32 on both sides, sums in another order: logits (~15) agree to ~3e-5, their log-softmax too.
TOL = dict(atol=2e-4, rtol=1e-5)
BUDGET = 64


def drawn(width, height, colour):
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).ellipse([4, 4, width // 2, height - 4], fill=colour)
    return image


def test_prompts_with_images_encode_once_and_sample_the_full_forwards_logprobs(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("qwen2_5_vl")
    config = json.loads((path / "config.json").read_text())
    start, pad, end = (config[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    model = hf.load(path)
    pictures = [processor(images=[im]) for im in (drawn(56, 84, "red"), drawn(84, 56, "blue"))]
    images = [
        PromptImages.of([(np.asarray(p["pixel_values"], np.float32), tuple(map(int, p["image_grid_thw"][0])))])
        for p in pictures
    ]
    text = lambda n, seed: [int(t) for t in np.random.default_rng(seed).integers(3, start - 4, n)]  # noqa: E731
    image = lambda im: [start] + [pad] * qwen2_5_vl.image_tokens(im.grids[0], model.vision.cfg) + [end]  # noqa: E731
    # Two prompts of the same text and other images (one prompt each to the sampler), a text prompt.
    prompts = [text(3, 0) + image(images[0]) + text(2, 1), text(3, 0) + image(images[1]) + text(2, 1), text(5, 2)]
    rows, row_images = [prompts[0]] * 3 + [prompts[1]] * 3 + [prompts[2]], [images[0]] * 3 + [images[1]] * 3 + [None]

    encoded = []  # the patches of each time the tower is traced
    tower = qwen2_5_vl.VisionTower.__call__
    monkeypatch.setattr(
        qwen2_5_vl.VisionTower,
        "__call__",
        lambda self, pixels, layout: encoded.append(pixels.shape[0]) or tower(self, pixels, layout),
    )
    sampler = ColocatedSampler(model, pad_id=0, image_patches=BUDGET)
    out = sampler.generate(rows, SamplingParams(max_new_tokens=6, temperature=1.0), jax.random.key(3), row_images)
    # 7 rows (a bucket of 8) decode from 3 prefill rows (a bucket of 4): the tower encodes those alone.
    assert encoded == [4 * BUDGET]

    torch_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    for r, (prompt, im) in enumerate(zip(rows, row_images)):
        tokens = out.tokens[r, : out.lengths[r]]
        assert out.lengths[r] == 6 and pad not in tokens
        ids = torch.tensor([prompt + tokens.tolist()])
        inputs = dict(input_ids=ids)
        if im is not None:
            inputs.update(
                pixel_values=torch.tensor(im.pixels),
                image_grid_thw=torch.tensor([im.grids[0]]),
                mm_token_type_ids=(ids == pad).long(),
            )
        with torch.no_grad():
            logp = torch.log_softmax(torch_model(**inputs).logits[0], -1).numpy()
        expected = logp[np.arange(len(prompt) - 1, ids.shape[1] - 1), tokens]
        np.testing.assert_allclose(out.logprobs[r, : out.lengths[r]], expected, **TOL)
