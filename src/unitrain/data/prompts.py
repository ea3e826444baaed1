"""The prompt stream for GRPO rollouts: records -> shard -> shuffle -> repeat -> render -> batch (grain).

One element of the iterator is this process's share of one step's prompts:
  {"prompts": [Prompt, ...],   # prompts_per_batch // process_count of them, ready for the sampler
   "num_dropped": int}         # over-long prompts skipped while this batch was assembled
num_dropped works like the SFT pipeline's num_truncated: sum it over steps for a total (at the end of
a finite stream, drops after the last kept prompt are not counted). Each prompt appears once per
epoch here; the trainer samples its n completions itself.

Sources: `builtin` (the arithmetic task: text "12+3=", label "15"), or data files (data/sources.py) with the
prompt text under `prompt_key` and the gold answer under `label_key` (GSM8K: question / answer, the
label being the whole answer text that ends in "#### 72"; the reward extracts what it needs).

A prompt may be a user turn's text and image parts (SFT's format, data/images.py): rendered by the
chat template, its image pads expanded, its images' pixels on the Prompt (a vision-language model
with max_image_patches).

Rendering: with `chat_template: false`, ids = [BOS] + encode(text) (no BOS when the tokenizer has
none), exactly as the SFT path starts an example; with `chat_template: true` the text becomes a user
message (after a system message when `system_prompt` is set), rendered by the tokenizer's chat
template with the generation prompt, and the template owns every special token. Prompts with more
than `max_prompt_length` ids are dropped and counted.
"""

from __future__ import annotations

import grain

from unitrain.data import format_choice
from unitrain.data.builtin import NUM_PROBLEMS, builtin_problem
from unitrain.data.images import Vision, refuse_images
from unitrain.data.prompt_ids import BUILTIN_SCAN_LIMIT, Prompt, fitting_prompts, prompt_fn
from unitrain.data.sft import CountDropped
from unitrain.data.sources import split_path
from unitrain.errors import ConfigError, DataError


def _records(cfg, split: str, path: str) -> grain.MapDataset:
    """The split's {prompt, label} records (the data format's, for files)."""
    if path == "builtin":
        digits, ops = cfg.builtin_task_digits, cfg.builtin_task_ops

        def problem(i):
            prompt, answer = builtin_problem(int(i), split, digits, ops)
            return {"prompt": prompt, "label": answer}

        return grain.MapDataset.range(NUM_PROBLEMS).map(problem)
    if path == "synthetic":
        key = "dataset_path" if split == "train" else "eval_dataset_path"
        raise ConfigError(
            f"{key}=synthetic has no prompts or labels for rollouts; use builtin or "
            "data files with prompt_key and label_key"
        )
    return grain.MapDataset.source(format_choice.data_format(cfg).prompt_records(cfg, path))


def _check_not_empty(prompts: grain.MapDataset, path: str, max_len: int) -> None:
    """Fail now, not mid-run, when no prompt fits: scan until the first one that does."""
    limit = min(len(prompts), BUILTIN_SCAN_LIMIT if path == "builtin" else len(prompts))
    shortest = None
    for i in range(limit):
        element = prompts[i]
        if element["prompt"] is not None:
            return
        shortest = element["length"] if shortest is None else min(shortest, element["length"])
    scanned = "" if limit == len(prompts) else f" (of the first {limit})"
    raise DataError(
        f"no prompt of {path!r}{scanned} fits in max_prompt_length={max_len}; the shortest has {shortest} tokens"
    )


def _to_batch(elements) -> dict:
    return {"prompts": [e["prompt"] for e in elements], "num_dropped": sum(e["num_dropped"] for e in elements)}


def make_prompt_dataset(
    cfg, tokenizer, prompts_per_batch: int, split: str = "train", process_index: int = 0, process_count: int = 1
) -> grain.IterDataset:
    """The grain pipeline behind `make_prompt_iterator` (see the module docstring for the batch).

    split="train" is shuffled with `seed` (when `shuffle`) and repeated `num_epochs` times (null =
    forever); split="eval" is read once, in order. Each process reads only its own shard.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if prompts_per_batch <= 0:
        raise ConfigError(f"prompts per batch must be positive, got {prompts_per_batch}")
    if prompts_per_batch % process_count:
        raise ConfigError(f"{prompts_per_batch} prompts per batch do not divide among {process_count} processes")
    path = split_path(cfg, split)
    to_prompt = prompt_fn(cfg, tokenizer)
    records = _records(cfg, split, path)
    # Every process keeps an equal, disjoint share of the records (the few left over are skipped),
    # so that all processes see the same number of prompts per epoch.
    usable = len(records) - len(records) % process_count
    shard = records[:usable][process_index::process_count]
    if len(shard) == 0:
        raise DataError(f"dataset {path!r} has {len(records)} records, too few for {process_count} processes")
    if path != "builtin" and cfg.max_image_patches:  # the images checked before training, as SFT's
        Vision(cfg).check(shard)
    elif path != "builtin":
        refuse_images(shard)
    _check_not_empty(shard.map(to_prompt), path, cfg.max_prompt_length)

    ds = shard
    if split == "train" and cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)  # reshuffled every epoch: grain folds the epoch into the seed
    if split == "train":
        ds = ds.repeat(cfg.num_epochs)  # None = forever
    it = CountDropped(
        ds.map(to_prompt).to_iter_dataset(grain.ReadOptions(num_threads=0)),
        dropped=lambda e: 1 if e["prompt"] is None else None,
        keep=lambda e, n: {"prompt": e["prompt"], "num_dropped": n},
    )
    return it.batch(prompts_per_batch // process_count, drop_remainder=True, batch_fn=_to_batch)


def make_prompt_iterator(
    cfg, tokenizer, prompts_per_batch: int, split: str = "train", process_index: int = 0, process_count: int = 1
) -> grain.DatasetIterator:
    """This process's prompt batches, {"prompts": [Prompt, ...], "num_dropped": int}; a grain
    DatasetIterator, so get_state()/set_state() and grain.checkpoint.CheckpointSave/CheckpointRestore
    (orbax) checkpoint its position exactly."""
    return iter(make_prompt_dataset(cfg, tokenizer, prompts_per_batch, split, process_index, process_count))


def eval_prompts(cfg, tokenizer, count: int, records: list[dict] | None = None) -> list[Prompt]:
    """The first `count` eval prompts that fit max_prompt_length, in the file's (or stream's) order.

    The same list on every process and in every run (not sharded, not shuffled); fewer than `count`
    when the eval data holds fewer. The built-in task's eval stream is disjoint from its train stream.
    `records` ({prompt, label}, a prompt being a text or a conversation) replace the eval split's
    prompt records (SFT passes its eval files' records).
    """
    path = split_path(cfg, "eval")
    records = _records(cfg, "eval", path) if records is None else records
    return fitting_prompts(cfg, tokenizer, count, records, path)
