"""Images of SFT and prompt records for a vision-language model (models/qwen2_5_vl.py): each image
file turned into its patches and patch grid by the model's own image processor (transformers', read
once from the checkpoint folder: no resizing code here), and a row's images laid out for the tower.

A record's user turns may hold image parts, `{"type": "image", "image": "<path>"}` beside
`{"type": "text", "text": ...}` (sources.py; the path relative to the data file; in a parquet or
arrow file the image's bytes, as datasets' Image feature stores them); so may a GRPO
prompt record's prompt, whose images ride with its Prompt (PromptImages) to the sampler and the
trainer's rows. A row of a batch holds at most `max_image_patches` patches: its images' pixels
padded to that budget, one compiled shape (qwen2_5_vl.RowLayout). A bad image (missing, not an
image, more patches than the budget) is one line naming its record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io

import numpy as np

from unitrain.config import VISION_LANGUAGE_FAMILIES, check
from unitrain.errors import DataError
from unitrain.models import qwen2_5_vl

# A record with images where the run reads none.
IMAGES_NEED_A_MODEL = (
    "the record has images; they need a vision-language model (load_parameters_path) and max_image_patches > 0"
)

# The batch fields a row's images add (beside data/sft.py's BATCH_FIELDS).
IMAGE_FIELDS = ("pixels", "patch_positions", "patch_windows", "patch_images", "rope_positions")


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images as the tower takes them: their patches one after the other [n, patch_dim],
    each one's patch grid (t, h, w), and a digest of the pixels: prompts of the same ids and images
    are one prompt to the sampler (prefilled, and their images encoded, once)."""

    pixels: np.ndarray
    grids: tuple[tuple[int, int, int], ...]
    key: bytes

    @classmethod
    def of(cls, images: list[tuple[np.ndarray, tuple]]) -> PromptImages:
        """Vision.read's (patches, grid) of each image."""
        pixels = np.concatenate([p for p, _ in images])
        return cls(pixels, tuple(g for _, g in images), hashlib.blake2b(pixels.tobytes(), digest_size=16).digest())


class Vision:
    """What the SFT and prompt pipelines need of the vision-language checkpoint at load_parameters_path
    (its HF folder, or the one its run started from: config.vision_language_folder): its image
    processor, the tower's patch sizes, the image-pad token, the row budget (max_image_patches)."""

    def __init__(self, cfg):
        import transformers  # here: only runs with images pay for it

        from unitrain.adapters import hf_config
        from unitrain.config import vision_language_folder

        folder = vision_language_folder(cfg.load_parameters_path)
        keys, tower = hf_config.vision_language_keys(folder)
        self.cfg = qwen2_5_vl.VisionConfig(**tower)
        self.pad_id, self.budget = keys["image_token_id"], cfg.max_image_patches
        self.patch_dim = self.cfg.in_channels * self.cfg.temporal_patch_size * self.cfg.patch_size**2
        # The PIL backend: the torchvision one (Qwen2_5_VLProcessor's default) is no dependency.
        self.processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")

    def check(self, records) -> None:
        """Fail before training on a record whose image is missing or not an image, or whose images
        make more patches than the budget: the sizes come from the files' headers, the patches from
        the processor's own count, nothing decoded."""
        for i in range(len(records)):
            record = records[i]
            if "images" not in record:
                continue
            patches = sum(self.processor.get_number_of_image_patches(h, w, {}) for w, h in self._sizes(record))
            if patches > self.budget:
                raise DataError(
                    f"{record['where']}: the record's {len(record['images'])} images make {patches} patches, more "
                    f"than max_image_patches={self.budget}"
                )

    def _sizes(self, record: dict):
        for k, file in enumerate(record["images"]):
            yield _opened(file, k, record["where"], lambda image: image.size)

    def read(self, record: dict) -> list[tuple[np.ndarray, tuple]]:
        """The record's images as (patches [n, patch_dim], grid (t, h, w)), in the order of its image
        parts (a checked record's)."""
        out = []
        for k, file in enumerate(record["images"]):
            processed = _opened(file, k, record["where"], lambda image: self.processor(images=[image.convert("RGB")]))
            out.append(
                (np.asarray(processed["pixel_values"], np.float32), tuple(map(int, processed["image_grid_thw"][0])))
            )
        return out

    def expand(self, segments, images, where: str):
        """The (token ids, trained on) `segments` with each image's one pad (the chat template's) made
        as many pads as the image makes decoder tokens."""
        pads = sum(ids.count(self.pad_id) for ids, _ in segments)
        if pads != len(images):
            raise DataError(f"{where}: the chat template wrote {pads} image pads for the record's {len(images)} images")
        sizes = iter(qwen2_5_vl.image_tokens(grid, self.cfg) for _, grid in images)
        expand = lambda ids: [t for i in ids for t in ([i] * next(sizes) if i == self.pad_id else [i])]  # noqa: E731
        return [(expand(ids), on) for ids, on in segments]

    def prompt(self, ids: list[int], record: dict) -> tuple[list[int], PromptImages]:
        """A prompt record's rendered ids with its images' pads expanded, and its images."""
        images = self.read(record)
        return self.expand([(ids, False)], images, record["where"])[0][0], PromptImages.of(images)

    def with_pixels(self, example: dict, images) -> dict:
        """example_arrays' example with its images' `pixels` [n, patch_dim] and `image_grids` [k, 3];
        dropped (as over-long) where truncation cut into an image's pads."""
        tokens = sum(qwen2_5_vl.image_tokens(grid, self.cfg) for _, grid in images)
        if "inputs" in example and np.count_nonzero(example["inputs"] == self.pad_id) != tokens:
            return {"num_truncated": np.int32(1)}
        pixels = np.concatenate([p for p, _ in images]) if images else np.zeros((0, self.patch_dim), np.float32)
        grids = np.asarray([g for _, g in images], np.int32).reshape(-1, 3)
        return {**example, "pixels": pixels, "image_grids": grids}

    def batch_fields(self, packed: dict) -> dict:
        """The IMAGE_FIELDS of a packed batch: its rows' pixels, the tower's RowLayout of each row's
        images, and M-RoPE's positions of each segment's tokens."""
        grids = [
            [tuple(g) for g, segment in zip(row, segments) if segment > 0]
            for row, segments in zip(packed["image_grids"], packed["image_grids_segment_ids"])
        ]
        layouts = [qwen2_5_vl.row_layout(row, self.cfg, self.budget) for row in grids]
        positions, windows, images = (np.stack(part) for part in zip(*layouts))
        rope = qwen2_5_vl.mrope_positions(
            packed["inputs"], packed["inputs_segment_ids"], [g for row in grids for g in row], self.pad_id, self.cfg
        )
        return {
            "pixels": packed["pixels"],
            "patch_positions": positions,
            "patch_windows": windows,
            "patch_images": images,
            "rope_positions": rope,
        }


def refuse_images(records) -> None:
    """The first record with images, where the run reads none: one line naming it."""
    for i in range(len(records)):
        if "images" in records[i]:
            raise DataError(f"{records[i]['where']}: {IMAGES_NEED_A_MODEL}")


def _opened(file: str | bytes, k: int, where: str, use):
    """use(the PIL image of `file`, a path or a file's bytes, the record's image k); a missing or
    unreadable file is one line naming the record."""
    from PIL import Image, UnidentifiedImageError

    name = repr(file) if isinstance(file, str) else f"image {k + 1} (bytes)"
    try:
        with Image.open(file if isinstance(file, str) else io.BytesIO(file)) as image:
            return use(image)
    except (FileNotFoundError, IsADirectoryError):
        raise DataError(f"{where}: image {name} does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: {name} is not a readable image ({type(e).__name__})") from None


@check("max_image_patches", "model_family", "mode", "teacher_path", "lora_rank")
def _images(c) -> str | None:
    if not c["max_image_patches"]:
        return None
    if c["model_family"] not in VISION_LANGUAGE_FAMILIES:
        return f"max_image_patches > 0 feeds images to a vision tower; model_family {c['model_family']} has none"
    if c["mode"] not in ("sft", "grpo"):
        return f"max_image_patches: images are read by mode=sft and mode=grpo only so far; mode is {c['mode']}"
    if c["teacher_path"]:
        return "max_image_patches with teacher_path: the teachers would score image pads without the images"
    if c["lora_rank"]:
        return "max_image_patches with lora_rank > 0: the LoRA model does not take images yet"
    if c["max_image_patches"] % 4:
        return f"max_image_patches ({c['max_image_patches']}) must be a multiple of 4 (an image token is 2 x 2 patches)"
    return None


@check("max_image_patches", "mode", "sampler", "workflow", "rollout_decoding", "rl_packing", "rollout_chunk_tokens")
def _rollouts_with_images(c) -> str | None:
    """What GRPO's rollouts with images go through: the colocated sampler's single answers, unpacked rows."""
    if not c["max_image_patches"] or c["mode"] != "grpo":
        return None
    if c["sampler"] != "colocated":
        return f"max_image_patches: prompts with images are sampled by sampler colocated only so far; sampler is {c['sampler']}"
    if c["workflow"] != "single_turn" or c["rollout_decoding"] != "sample":
        return "max_image_patches: prompts with images take single sampled answers only so far (workflow single_turn, rollout_decoding sample)"
    if c["rl_packing"]:
        return "max_image_patches with rl_packing: packed rows do not carry images yet"
    if c["rollout_chunk_tokens"]:
        return "max_image_patches with rollout_chunk_tokens: a turn continued in another call is not re-prefilled with its images yet"
    return None


CONFIG_CHECKS = (_images, _rollouts_with_images)
