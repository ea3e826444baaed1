"""Writes the shapes task: "How many shapes?" over pictures of 1 to 4 shapes drawn with Pillow, a task
a vision-language model answers only by looking (configs/shapes_vl.yml trains on it).

    python tools/make_shapes.py runs/shapes [--train 2000 --eval 200 --size 84]

OUT_DIR/train.jsonl and eval.jsonl hold one record a picture, read by both modes: SFT's `messages`
(the user turn's image and question, the count as the answer) and GRPO's `prompt` (the same user
turn) with its `label`; the pictures are PNGs in OUT_DIR/images, named relative to the files.
eval_blank.jsonl is eval.jsonl with every picture replaced by a blank one: a model that reads the
image scores near chance (1 in 4) there. Each split draws from its own seeded stream, so the
pictures are the same on every machine and the held-out ones are not the training ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

QUESTION = "How many shapes are in the picture? Answer with a number."
COUNTS = (1, 2, 3, 4)
COLOURS = ("red", "green", "blue", "orange", "purple", "black")
SPLITS = {"train": 0, "eval": 1}
GRID = 3  # the shapes sit in distinct cells of a GRID x GRID grid, so they never overlap


def picture(rng: np.random.Generator, count: int, size: int) -> Image.Image:
    """`count` shapes (circles, squares, triangles of random colours) in distinct cells, jittered."""
    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    cell = size // GRID
    side = cell * 3 // 4  # a shape fills most of its cell (one image token at 84 pixels)
    for place in rng.choice(GRID * GRID, size=count, replace=False):
        row, col = divmod(int(place), GRID)
        x = col * cell + int(rng.integers(1, cell - side))  # a gap of 2+ pixels to the next cell
        y = row * cell + int(rng.integers(1, cell - side))
        box, colour = [x, y, x + side - 1, y + side - 1], COLOURS[int(rng.integers(len(COLOURS)))]
        kind = int(rng.integers(3))
        if kind == 0:
            pen.ellipse(box, fill=colour)
        elif kind == 1:
            pen.rectangle(box, fill=colour)
        else:
            pen.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=colour)
    return image


def record(image: str, count: int) -> dict:
    """One picture's record: SFT's conversation and GRPO's prompt and label."""
    question = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(count)}],
        "prompt": question,
        "label": str(count),
    }


def write_split(out: Path, split: str, n: int, size: int) -> list[dict]:
    """n pictures of the split, their counts balanced (n // 4 of each, the rest in order)."""
    rng = np.random.default_rng([SPLITS[split], size])
    counts = [COUNTS[i % len(COUNTS)] for i in range(n)]
    rng.shuffle(counts)
    records = []
    for i, count in enumerate(counts):
        name = f"images/{split}_{i:05d}.png"
        picture(rng, count, size).save(out / name)
        records.append(record(name, count))
    _write_jsonl(out / f"{split}.jsonl", records)
    return records


def make_shapes(out_dir: str | Path, train: int = 2000, eval_: int = 200, size: int = 84) -> Path:
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    write_split(out, "train", train, size)
    held_out = write_split(out, "eval", eval_, size)
    Image.new("RGB", (size, size), "white").save(out / "images" / "blank.png")
    _write_jsonl(out / "eval_blank.jsonl", [record("images/blank.png", int(r["label"])) for r in held_out])
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=2000, help="training pictures")
    p.add_argument("--eval", type=int, default=200, help="held-out pictures")
    p.add_argument("--size", type=int, default=84, help="pixels a side (84: 6 x 6 patches, 9 image tokens)")
    args = p.parse_args()
    print(make_shapes(args.out_dir, args.train, args.eval, args.size))


if __name__ == "__main__":
    main()
