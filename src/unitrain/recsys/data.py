"""MiniOneRec-style recommendation data (the records of `data_format: minionerec`): CSV rows of a
user's history of items, each named by its semantic ID (SID, e.g. <a_1><b_2><c_3>), and the next
item's SID, as the prompt records the SFT and GRPO-prompt pipelines render (with or without the
chat template).

CSV columns: `history_item_sid` (a Python list literal of SIDs), `item_sid`, `user_id`, and with
`rec_history_titles` also `history_item_title` (a list literal of titles, one per history SID).
The info file (`rec_info_path`) has `sid<TAB>title<TAB>item_id` lines. Malformed rows stop the run
with their file:line.

Tasks, mixed by `rec_task_weights` (records per CSV row, drawn round-robin in a fixed shuffled order):
  next-SID   "The user has interacted with items <sid>, <sid>, ... in chronological order. ..." -> <sid>
  title->SID "Which item has the title: <title>?" -> <sid>          (alignment, from the info file)
  SID->title "What is the title of item <sid>?" -> <title>           (alignment, SFT only)
SFT gets {prompt, completion}; GRPO prompts get {prompt, label} with the SID as the label.
"""

from __future__ import annotations

import ast
import re

import numpy as np

from unitrain.data.sources import iter_rows
from unitrain.errors import DataError

_SID = re.compile(r"^(<[^<>\s]+>)+$")


def _literal_list(row: dict, key: str, where: str) -> list[str]:
    if key not in row:
        raise DataError(f"{where}: the row has no column {key!r} (it has {sorted(row)})")
    try:
        value = ast.literal_eval(row[key]) if isinstance(row[key], str) else row[key]
    except (ValueError, SyntaxError):
        raise DataError(f"{where}: column {key!r} is not a Python list literal: {str(row[key])[:80]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: column {key!r} must be a list of strings, got {str(row[key])[:80]!r}")
    return value


def _sid(value, where: str, key: str) -> str:
    if not isinstance(value, str) or not _SID.match(value.strip()):
        raise DataError(f"{where}: column {key!r} holds {str(value)[:80]!r}, not a SID such as <a_1><b_2><c_3>")
    return value.strip()


def read_examples(spec: str, with_titles: bool) -> list[dict]:
    """Every CSV row as {user, history: [SID], titles: [title] or None, target: SID}."""
    out = []
    for where, row in iter_rows(spec):
        if not isinstance(row, dict):
            raise DataError(f"{where}: a record must be a row of named columns")
        history = [_sid(s, where, "history_item_sid") for s in _literal_list(row, "history_item_sid", where)]
        if not history:
            raise DataError(f"{where}: column 'history_item_sid' is empty; a history needs at least one item")
        titles = _literal_list(row, "history_item_title", where) if with_titles else None
        if titles is not None and len(titles) != len(history):
            raise DataError(f"{where}: {len(titles)} history titles for {len(history)} history SIDs")
        target = _sid(row.get("item_sid"), where, "item_sid")
        out.append({"user": str(row.get("user_id", "")), "history": history, "titles": titles, "target": target})
    if not out:
        raise DataError(f"dataset path {spec!r} holds no rows")
    return out


def read_info(path: str) -> list[tuple[str, str]]:
    """(SID, title) of every line of an info file (sid<TAB>title<TAB>item_id)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise DataError(f"rec_info_path {path!r}: {e.strerror}") from None
    items = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3 or not fields[1].strip():
            raise DataError(f"{path}:{lineno}: expected sid<TAB>title<TAB>item_id, got {len(fields)} field(s)")
        items.append((_sid(fields[0], f"{path}:{lineno}", "sid"), fields[1].strip()))
    if not items:
        raise DataError(f"rec_info_path {path!r} holds no items")
    return items


def history_prompt(example: dict) -> str:
    items = (
        example["history"]
        if example["titles"] is None
        else [f'{sid} "{title}"' for sid, title in zip(example["history"], example["titles"])]
    )
    return (
        f"The user has interacted with items {', '.join(items)} in chronological order. "
        "Can you predict the next possible item that the user may expect?\n"
    )


def title_prompt(title: str) -> str:
    return f'Which item has the title: "{title}"?\n'


def sid_prompt(sid: str) -> str:
    return f"What is the title of item {sid}?\n"


def _cycle(n: int, count: int, rng) -> list[int]:
    """`count` indices into n items: whole shuffled passes, round-robin."""
    order = rng.permutation(n)
    return [int(order[i % n]) for i in range(count)]


def _mixed(cfg, path: str, sft: bool) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of the three tasks in the proportions of rec_task_weights."""
    examples = read_examples(path, cfg.rec_history_titles)
    w_next, w_title, w_sid = cfg.rec_task_weights
    rng = np.random.default_rng(cfg.seed)
    n = len(examples)
    pairs = [(history_prompt(examples[i]), examples[i]["target"]) for i in _cycle(n, round(w_next * n), rng)]
    if w_title or (sft and w_sid):
        info = read_info(cfg.rec_info_path)
        pairs += [(title_prompt(info[i][1]), info[i][0]) for i in _cycle(len(info), round(w_title * n), rng)]
        if sft:
            pairs += [(sid_prompt(info[i][0]), info[i][1]) for i in _cycle(len(info), round(w_sid * n), rng)]
    if not pairs:
        raise DataError(f"rec_task_weights {cfg.rec_task_weights} make no records of {path!r}")
    return pairs


def sft_records(cfg, path: str) -> list[dict]:
    """The SFT records ({prompt, completion}) of the CSVs at `path`."""
    return [{"prompt": p, "completion": a} for p, a in _mixed(cfg, path, sft=True)]


def prompt_records(cfg, path: str) -> list[dict]:
    """The GRPO prompt records ({prompt, label}: the label is the SID to generate)."""
    return [{"prompt": p, "label": a} for p, a in _mixed(cfg, path, sft=False)]
