"""tools/make_shapes.py: each picture holds as many shapes as its label says (counted here as the
connected non-white regions), the counts are balanced, the held-out pictures are not the training
ones, the blank split's pictures are blank, and both modes read the files as their records."""

import json

import numpy as np
from PIL import Image
from scipy import ndimage

from make_shapes import COUNTS, make_shapes
from unitrain.data.sources import read_prompt_records, read_records


def test_pictures_hold_their_labels_count_of_shapes(tmp_path):
    out = make_shapes(tmp_path / "shapes", train=16, eval_=8, size=84)
    splits = {
        s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "eval")
    }
    pixels = {}
    for split, records in splits.items():
        labels = [int(r["label"]) for r in records]
        assert sorted(labels) == sorted(COUNTS * (len(records) // len(COUNTS)))  # balanced
        for r in records:
            image = np.asarray(Image.open(out / r["prompt"][0]["image"]).convert("RGB"))
            assert image.shape == (84, 84, 3)
            assert ndimage.label((image < 250).any(axis=-1))[1] == int(r["label"])
            assert r["messages"][1]["content"] == r["label"] and r["messages"][0]["content"] == r["prompt"]
            pixels.setdefault(split, []).append(image.tobytes())
    assert not set(pixels["train"]) & set(pixels["eval"])
    blank = [json.loads(line) for line in (out / "eval_blank.jsonl").read_text().splitlines()]
    assert [r["label"] for r in blank] == [r["label"] for r in splits["eval"]]
    assert (np.asarray(Image.open(out / blank[0]["prompt"][0]["image"])) == 255).all()

    sft = read_records(str(out / "train.jsonl"), "prompt", "completion", "messages")
    assert sft[0]["images"] == [str(out / splits["train"][0]["prompt"][0]["image"])]
    prompts = read_prompt_records(str(out / "eval.jsonl"), "prompt", "label")
    assert prompts[0]["images"] == [str(out / splits["eval"][0]["prompt"][0]["image"])]
    assert prompts[0]["label"] == splits["eval"][0]["label"]
