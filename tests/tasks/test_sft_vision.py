"""SFT of a vision-language model (a tiny random Qwen2.5-VL HF folder) on image-text conversations
(images drawn here) through the entry: the run takes the checkpoint as its model, its loss is
transformers' on the same rows, freeze_vision_tower leaves the tower as loaded while the decoder
trains, and a bad image or image key is one line."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from PIL import Image, ImageDraw

from helpers import metrics_by_step, run_cli, run_config, write_jsonl
from unitrain import sharding, train
from unitrain.config import vision_language_folder
from unitrain.data.prompt_ids import fitting_prompts
from unitrain.data.sft import eval_prompt_records, make_sft_iterator
from unitrain.data.sources import read_prompt_records
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError, DataError
from unitrain.models import sources

# Float32 on both sides; the sums run in another order: the mean NLL (~9) agrees to ~1e-5.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
# Image a: 4 x 4 patches (4 image tokens); b: 6 x 10 (15): both fit one row's budget.
IMAGES = {"a.png": ((64, 64), "red"), "b.png": ((140, 84), "blue")}
BUDGET = 96


def image_record(name, answer):
    question = [{"type": "image", "image": f"pics/{name}"}, {"type": "text", "text": "What colour is the square?"}]
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.fixture
def image_data(tmp_path):
    """A jsonl of two image conversations and a text one, the images drawn beside it."""
    (tmp_path / "pics").mkdir()
    for name, (size, colour) in IMAGES.items():
        image = Image.new("RGB", size, "white")
        ImageDraw.Draw(image).rectangle([4, 4, 40, 40], fill=colour)
        image.save(tmp_path / "pics" / name)
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    return write_jsonl(tmp_path / "chat.jsonl", [image_record("a.png", "red"), image_record("b.png", "blue"), text] * 4)


def vl_run(tmp_path, ckpt, data, *overrides):
    return run_config(
        tmp_path,
        "mode=sft",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={data}",
        "max_target_length=96",
        f"max_image_patches={BUDGET}",
        "per_device_batch_size=1",
        "eval_interval=0",
        "peak_flops_per_device=1e12",
        "log_period=1",
        "steps=2",
        "learning_rate=1e-2",
        "warmup_steps=0",
        "weight_decay=0.1",
        f"export_hf_path={tmp_path / 'export'}",
        *overrides,
    )


def torch_model(path):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def weights(path) -> dict:
    """The HF folder's tensors under transformers' names, whatever names the files use."""
    return {name: t.numpy() for name, t in torch_model(path).state_dict().items()}


def transformers_loss(ckpt, batch, folder) -> float:
    """The mean NLL of the batch's trained targets under transformers' float32 model, each packed
    segment run on its own with its image's pixels as the checkpoint's processor makes them (the
    image known by its count of pads)."""
    model, config = torch_model(ckpt), json.loads((ckpt / "config.json").read_text())
    processor = transformers.AutoImageProcessor.from_pretrained(ckpt, backend="pil")
    pixels = {}
    for name in IMAGES:
        out = processor(images=[Image.open(folder / "pics" / name).convert("RGB")])
        pixels[int(np.prod(out["image_grid_thw"][0])) // 4] = out
    total, count, packed_images = 0.0, 0, []
    for b in range(batch["inputs"].shape[0]):
        segmentation = batch["inputs_segmentation"][b]
        packed_images.append(0)
        for segment in set(segmentation[segmentation > 0]):
            columns = segmentation == segment
            ids = batch["inputs"][b][columns][None]
            inputs = dict(input_ids=torch.tensor(ids, dtype=torch.long))
            pads = int(np.sum(ids == config["image_token_id"]))
            if pads:
                packed_images[-1] += 1
                inputs.update(
                    pixel_values=torch.tensor(np.asarray(pixels[pads]["pixel_values"])),
                    image_grid_thw=torch.tensor(np.asarray(pixels[pads]["image_grid_thw"])),
                    mm_token_type_ids=torch.tensor((ids == config["image_token_id"]).astype(np.int64)),
                )
            with torch.no_grad():
                logp = torch.log_softmax(model(**inputs).logits[0], -1).numpy()
            targets, trained = batch["targets"][b][columns], batch["targets_segmentation"][b][columns] > 0
            total -= logp[np.arange(len(targets)), targets][trained].sum()
            count += trained.sum()
    assert max(packed_images) >= 2  # a row packs two image conversations
    return total / count


@pytest.mark.parametrize("frozen", [True, False])
def test_sft_with_images_on_a_qwen2_5_vl_checkpoint(tmp_path, tiny_checkpoint, image_data, frozen):
    """Through the entry: the first step's loss is transformers' on the first batch (rows packing
    image and text conversations, each conversation apart there); after two steps (weight decay on)
    the decoder moved and the tower moved only when trained."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    cfg = vl_run(tmp_path, ckpt, image_data, f"freeze_vision_tower={str(frozen).lower()}")
    assert cfg.model_family == "qwen2_5_vl"
    assert train.train(cfg) == 0
    if frozen:
        batch = next(iter(make_sft_iterator(cfg, load_tokenizer(str(ckpt)), 8)))
        expected = transformers_loss(ckpt, batch, tmp_path)
        np.testing.assert_allclose(metrics_by_step(cfg.run_dir)[0]["loss"], expected, **LOSS_TOL)
    before, after = weights(ckpt), weights(tmp_path / "export")
    moved = {name for name in before if not np.array_equal(before[name], after[name])}
    tower = {name for name in before if name.startswith("model.visual.")}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in moved
    assert (moved & tower == set()) if frozen else ("model.visual.blocks.0.mlp.up_proj.weight" in moved)
    if not frozen:  # a later run (a pipeline's next stage) from the checkpoint: the tower's shape from `ckpt`
        later = run_config(tmp_path, f"load_parameters_path={cfg.checkpoint_dir}", f"tokenizer_path={ckpt}")
        assert later.model_family == "qwen2_5_vl" and vision_language_folder(later.load_parameters_path) == str(ckpt)
        model = sources.build(later, sharding.trainer_mesh(later, sharding.layout_for(later)))
        np.testing.assert_array_equal(
            np.asarray(model.vision.merge_w2[...]), after["model.visual.merger.mlp.2.weight"].T
        )
        exported = transformers.AutoImageProcessor.from_pretrained(tmp_path / "export", backend="pil")
        assert exported.to_dict() == transformers.AutoImageProcessor.from_pretrained(ckpt, backend="pil").to_dict()


def test_vision_keys_need_a_vision_language_checkpoint(tmp_path, tiny_checkpoint):
    with pytest.raises(ConfigError, match="freeze_vision_tower is true but model_family llama has no vision tower"):
        run_config(tmp_path, "freeze_vision_tower=true")
    with pytest.raises(ConfigError, match="max_image_patches > 0 feeds images to a vision tower; model_family llama"):
        run_config(tmp_path, "max_image_patches=64")
    with pytest.raises(ConfigError, match="model_family qwen2_5_vl .* is read from an HF folder only"):
        run_config(tmp_path, "model_family=qwen2_5_vl")
    ckpt = tiny_checkpoint("qwen2_5_vl")
    with pytest.raises(ConfigError, match="mode=rm exports a sequence classifier, which transformers has none of"):
        run_config(tmp_path, "mode=rm", f"load_parameters_path={ckpt}", f"export_hf_path={tmp_path / 'out'}")


@pytest.mark.parametrize(
    "record, max_image_patches, error",
    [
        (image_record("missing.png", "red"), BUDGET, r"chat.jsonl:2: image '\S+/pics/missing.png' does not exist"),
        (image_record("not_an_image.png", "red"), BUDGET, r"chat.jsonl:2: '\S+/pics/not_an_image.png' is not a"),
        (image_record("b.png", "blue"), 32, r"chat.jsonl:2: the record's 1 images make 60 patches, more than max_imag"),
        (image_record("a.png", "red"), 0, r"chat.jsonl:1: the record has images; they need a vision-language model"),
    ],
)
def test_a_bad_image_is_one_line_naming_its_record(
    tmp_path, tiny_checkpoint, image_data, record, max_image_patches, error
):
    """Missing, not an image, over the budget, or images without max_image_patches: refused before
    training, the record's file:line named."""
    (tmp_path / "pics" / "not_an_image.png").write_text("plain text")
    data = write_jsonl(tmp_path / "chat.jsonl", [image_record("a.png", "red"), record])
    ckpt = tiny_checkpoint("qwen2_5_vl")
    cfg = vl_run(tmp_path, ckpt, data, f"max_image_patches={max_image_patches}")
    with pytest.raises(DataError, match=error):
        make_sft_iterator(cfg, load_tokenizer(str(ckpt)), 8)


def test_the_entry_exits_2_on_a_missing_image(tmp_path, tiny_checkpoint, image_data):
    """python -m unitrain.train: one line, exit 2, before anything is built."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    data = write_jsonl(tmp_path / "chat.jsonl", [image_record("missing.png", "red")])
    cfg = vl_run(tmp_path, ckpt, data)
    keys = [
        f"{k}={getattr(cfg, k)}"
        for k in ("load_parameters_path", "tokenizer_path", "dataset_path", "max_image_patches", "max_target_length")
    ]
    proc = run_cli(f"base_output_directory={tmp_path}", "run_name=bad", "eval_interval=0", *keys, devices=1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("unitrain: ")]
    assert len(errors) == 1 and "chat.jsonl:1: image" in errors[0] and "missing.png' does not exist" in errors[0]
    assert "Traceback" not in err


def test_generation_evals_prompt_with_the_records_images(tmp_path, tiny_checkpoint, image_data):
    """An eval record of one user turn with an image is a prompt with its pixels (its pad expanded to
    the image's tokens), labelled by its answer; a longer conversation with images is one line."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    cfg = vl_run(tmp_path, ckpt, image_data, f"eval_dataset_path={image_data}", "eval_interval=1")
    tokenizer = load_tokenizer(str(ckpt))
    records = eval_prompt_records(cfg, tokenizer)
    prompts = fitting_prompts(cfg, tokenizer, 3, records, image_data)
    pad = json.loads((ckpt / "config.json").read_text())["image_token_id"]
    assert [p.label for p in prompts] == ["red", "blue", "Hello"] and prompts[2].images is None
    for prompt, tokens in zip(prompts, (4, 15)):  # the images' tokens: 4 x 4 and 6 x 10 patches
        assert prompt.text == "What colour is the square?" and prompt.ids.count(pad) == tokens
        assert prompt.images.pixels.shape == (4 * tokens, 1176) and len(prompt.images.grids) == 1
    two_turns = image_record("a.png", "red")
    two_turns["messages"][:0] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    write_jsonl(tmp_path / "chat.jsonl", [two_turns])
    with pytest.raises(DataError, match=r"chat.jsonl:1: answers are generated for image records of one user turn"):
        eval_prompt_records(cfg, tokenizer)


def as_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def with_bytes(parts, folder):
    """Parts with each image's file as its bytes (datasets' Image feature: a struct {bytes, path})."""
    image = lambda p: {"type": "image", "image": {"bytes": (folder / p["image"]).read_bytes(), "path": None}}  # noqa: E731
    return [image(p) if p["type"] == "image" else p for p in parts]


def test_parquet_records_carry_their_images_bytes(tmp_path, tiny_checkpoint, image_data):
    """The conversations of the jsonl as a parquet file with each image's bytes, every content a list of
    parts (a column has one type): SFT's batches and GRPO's prompts are those of the files on disk;
    bytes that are no image are one line naming the row."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    tokenizer = load_tokenizer(str(ckpt))
    records = [json.loads(line) for line in open(image_data)]
    parts = lambda content: content if isinstance(content, list) else [{"type": "text", "text": content}]  # noqa: E731
    rows = [
        {"messages": [{"role": m["role"], "content": with_bytes(parts(m["content"]), tmp_path)} for m in r["messages"]]}
        for r in records
    ]
    batches = [
        next(iter(make_sft_iterator(vl_run(tmp_path, ckpt, data), tokenizer, 8)))
        for data in (image_data, as_parquet(tmp_path / "chat.parquet", rows))
    ]
    assert batches[0].keys() == batches[1].keys()
    for key in batches[0]:
        np.testing.assert_array_equal(batches[0][key], batches[1][key])

    question = records[1]["messages"][0]["content"]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": question, "label": "blue"}])
    in_parquet = as_parquet(tmp_path / "prompts.parquet", [{"prompt": with_bytes(question, tmp_path), "label": "blue"}])
    cfg = vl_run(tmp_path, ckpt, image_data, "mode=grpo", "max_prompt_length=64", "label_key=label")
    (on_disk,), (from_bytes,) = (
        fitting_prompts(cfg, tokenizer, 1, read_prompt_records(str(path), "prompt", "label"), str(path))
        for path in (prompts, in_parquet)
    )
    assert on_disk.ids == from_bytes.ids and on_disk.images.key == from_bytes.images.key
    np.testing.assert_array_equal(on_disk.images.pixels, from_bytes.images.pixels)

    rows[1]["messages"][0]["content"][0]["image"]["bytes"] = b"plain text"
    bad = as_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad.parquet:row 1: image 1 \(bytes\) is not a readable image"):
        make_sft_iterator(vl_run(tmp_path, ckpt, bad), tokenizer, 8)
