"""GRPO on prompts with images (a tiny random Qwen2.5-VL HF folder, images drawn here): the sampler's
logprobs are the trainer's passes' and update's with the images (the sampler's own against
transformers: tests/engines/test_colocated_vision.py), each group's images go through the tower once
in the passes, the rewards see the prompt's text, and what cannot take images yet is one line."""

import numpy as np
import pytest
from PIL import Image, ImageDraw

from helpers import first_groups, grpo_config, make_step, run_cli, write_jsonl
from unitrain.errors import ConfigError
from unitrain.models import qwen2_5_vl
from unitrain.tasks import rl

# float32; the trainer's forward and the sampler's cached decode sum in another order.
TOL = dict(atol=2e-4, rtol=1e-5)
BUDGET = 32  # patches: the 56 x 84 image's 24 and the 56 x 56 one's 16 fit


@pytest.fixture
def image_prompts(tmp_path):
    """Prompt records of a user turn's image and text parts, the images drawn beside the file."""
    (tmp_path / "pics").mkdir()
    records = []
    for i, (size, shapes) in enumerate([((56, 84), 1), ((56, 56), 2), ((84, 56), 3), ((56, 56), 1)] * 2):
        image = Image.new("RGB", size, "white")
        for k in range(shapes):
            ImageDraw.Draw(image).ellipse([4 + 16 * k, 4, 16 + 16 * k, 16], fill=("red", "blue", "green")[k])
        image.save(tmp_path / "pics" / f"{i}.png")
        question = [{"type": "image", "image": f"pics/{i}.png"}, {"type": "text", "text": "How many shapes?"}]
        records.append({"prompt": question, "label": str(shapes)})
    return write_jsonl(tmp_path / "shapes.jsonl", records)


def vision_config(tmp_path, ckpt, data, *overrides):
    return grpo_config(
        tmp_path,
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={data}",
        "prompt_key=prompt",
        "label_key=label",
        f"max_image_patches={BUDGET}",
        "max_prompt_length=64",
        "rollout_temperature=1.0",
        *overrides,
    )


def test_the_trainer_sees_each_groups_images_once_and_matches_the_sampler(
    tmp_path, tiny_checkpoint, image_prompts, monkeypatch
):
    """32 rows of 8 prompts: the logprob pass shares each group's prompt (4 rows) and its images, the
    update's micro-batches runs of 2; both take the sampler's logprobs, which without the images
    they would not. An image pad the sampler drew is text to every pass, as it was to the sampler."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    cfg = vision_config(tmp_path, ckpt, image_prompts, "rollout_batch_size=8", "gradient_accumulation_steps=2")
    task, graphdef, params, _ = make_step(cfg)
    assert task.group_rows == {"logprobs": 4, "update": 2}
    groups, _ = first_groups(task, params)
    assert {g.prompt.text for g in groups} == {"How many shapes?"}  # the rewards' text: no image in it
    assert len({g.prompt.images.key for g in groups}) == 4  # every record's own pixels (4 distinct images)
    rows = task.to_rows(groups)
    sampled = rows["loss_mask"].astype(bool)

    encoded = []  # the patches the tower takes each time it is traced
    tower = qwen2_5_vl.VisionTower.__call__
    monkeypatch.setattr(
        qwen2_5_vl.VisionTower, "__call__", lambda self, x, layout: encoded.append(x.shape[0]) or tower(self, x, layout)
    )
    stats = lambda group_rows, batch=rows: rl.token_stats(graphdef, 1.0, 0, params, batch, False, group_rows)
    shared, own = stats(4).logprobs, stats(1).logprobs
    assert encoded == [8 * BUDGET, 32 * BUDGET]  # a group's images once, or every row's
    np.testing.assert_allclose(shared, own, **TOL)
    np.testing.assert_allclose(np.asarray(shared)[sampled], rows["sampler_logprobs"][sampled], **TOL)
    drawn = dict(rows, inputs=rows["inputs"].copy())  # every row's first answer token an image pad: text
    drawn["inputs"][:, -rows["targets"].shape[1]] = task.run.model.cfg.image_token_id
    np.testing.assert_allclose(stats(4, drawn).logprobs, stats(1, drawn).logprobs, **TOL)
    text_only = {k: v for k, v in rows.items() if k not in ("pixels", "rope_positions")}
    gap = np.abs(np.asarray(stats(1, text_only).logprobs) - rows["sampler_logprobs"])[sampled]
    assert gap.mean() > 0.05  # the image pads' embeddings alone: other logprobs

    rows.update(advantages=np.linspace(-1, 1, 32).astype(np.float32))
    state = {"params": params, "opt_state": task.run.optimizer.init(params), "step": np.int32(0)}
    _, metrics = task.update(state, rows, 0)
    assert metrics["sampler_trainer_logprob_gap"] < 1e-4  # the update's forward (the old policy) with the images


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["rl_packing=true"], "max_image_patches with rl_packing: packed rows do not carry images yet"),
        (["workflow=multi_turn", "env=calculator"], "prompts with images take single sampled answers only so far"),
        (["mode=ppo"], "images are read by mode=sft and mode=grpo only so far; mode is ppo"),
    ],
)
def test_what_cannot_take_images_yet_is_one_line(tmp_path, tiny_checkpoint, image_prompts, overrides, error):
    with pytest.raises(ConfigError, match=error):
        vision_config(tmp_path, tiny_checkpoint("qwen2_5_vl"), image_prompts, *overrides)


def test_the_entry_exits_2_on_images_for_another_sampler(tmp_path, tiny_checkpoint, image_prompts):
    """python -m unitrain.train: one line, exit 2, nothing started."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    keys = [f"load_parameters_path={ckpt}", f"dataset_path={image_prompts}", f"max_image_patches={BUDGET}"]
    proc = run_cli(f"base_output_directory={tmp_path}", "run_name=vllm", "mode=grpo", "sampler=vllm", *keys, devices=1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("unitrain: ")]
    assert len(errors) == 1 and "sampled by sampler colocated only so far; sampler is vllm" in errors[0]
    assert "Traceback" not in err and not (tmp_path / "vllm").exists()
