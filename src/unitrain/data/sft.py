"""The SFT pipeline: records -> shard -> shuffle -> repeat -> tokenize -> pack -> batch (grain).

The records are split into `data_shards` virtual shards, each its own pipeline; a global batch is
their rows side by side, whatever the process count (see unitrain.data.shards).
One batch is a dict of int32 [B, T] numpy arrays for this process's share of the global batch:
  inputs, inputs_position, inputs_segmentation, targets, targets_segmentation
plus `num_truncated`, an int32 scalar: how many over-long examples were truncated or dropped while
this batch was assembled (sum it over steps for a total; the trainer pops it before the step;
at the end of a finite stream, drops after the last kept example are not counted). It is summed
over this process's shards; a shard shared by several processes (data_shards < process count) is
counted on the first process of its group only, so a sum over processes counts each example once.
Segments start at 1 per example in a row (0 = padding), positions restart at 0 per segment,
targets are the next token within the segment, and targets_segmentation keeps the segment id only
where the target is a completion token (the EOS included), so prompts and padding carry no loss.

Over-long examples (more than max_target_length tokens): `truncation=truncate` cuts them on the
right (the prompt is kept whole, the completion is cut); an example whose prompt alone fills the
row is dropped, since nothing of it would be learned. `truncation=drop` skips every over-long one.
"""

from __future__ import annotations

import grain
import numpy as np

from unitrain.data import format_choice
from unitrain.data.builtin import NUM_PROBLEMS, builtin_problem, max_builtin_length
from unitrain.data.images import Vision, refuse_images
from unitrain.data.shards import ShardedIterator, shard_records, shard_seed, sharded_iterator
from unitrain.data.sources import file_records, split_path
from unitrain.errors import ConfigError, DataError

BATCH_FIELDS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_segmentation")
# Per-example features the packer lays out in rows. num_truncated is a scalar per example: the
# packer places it like a 1-token sequence, so a row's sum counts its over-long examples.
_PACKED = ("inputs", "targets", "loss_mask", "num_truncated")


def example_arrays(segments, max_len: int, truncation: str, pad_id: int) -> dict:
    """One example's unpacked arrays from its consecutive (token ids, trained on) segments; a dict
    without "inputs" marks a dropped over-long example."""
    tokens = [t for ids, _ in segments for t in ids]
    trained = np.asarray([on for ids, on in segments for _ in ids], bool)
    context = int(np.argmax(trained)) if trained.any() else len(tokens)  # the tokens before the first trained one
    overlong = len(tokens) > max_len
    if overlong:
        if truncation == "drop" or context >= max_len:
            return {"num_truncated": np.int32(1)}
        tokens, trained = tokens[:max_len], trained[:max_len]
    n = len(tokens)
    inputs = np.asarray(tokens, np.int32)
    targets = np.full(n, pad_id, np.int32)
    targets[:-1] = inputs[1:]
    loss_mask = np.zeros(n, np.int32)
    loss_mask[:-1] = trained[1:]  # position i predicts token i+1
    return {"inputs": inputs, "targets": targets, "loss_mask": loss_mask, "num_truncated": np.int32(overlong)}


def _example_fn(cfg, tokenizer, vision=None):
    """record -> example_arrays(...); the BOS/EOS and chat policy of each record kind lives here.
    With `vision` (a _Vision: max_image_patches > 0) every example carries its images' pixels and
    grids, none for a text record."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [tokenizer.eos_id]
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    last_only = cfg.chat_loss_on == "last_assistant"

    def to_example(record: dict) -> dict:
        return to_arrays(record, vision.read(record) if "images" in record else [])

    def to_arrays(record: dict, images: list) -> dict:
        if "ids" in record:  # synthetic: the whole row is trained on
            segments = [(record["ids"], True)]
        elif "messages" in record or cfg.chat_template:  # the chat template owns BOS and end-of-turn tokens
            messages = record.get("messages") or [
                *system,
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
            pieces = tokenizer.chat_segments(messages, last_only, tools=record.get("tools"))
            segments = [(tokenizer.encode(text), on) for text, on in pieces]
            if images:
                segments = vision.expand(segments, images, record["where"])
        else:  # plain texts, concatenated verbatim: separators belong in the data
            segments = [
                (bos + tokenizer.encode(record["prompt"]), False),
                (tokenizer.encode(record["completion"]) + eos, True),
            ]
        example = example_arrays(segments, cfg.max_target_length, cfg.truncation, tokenizer.pad_id)
        return example if vision is None else vision.with_pixels(example, images)

    return to_example


class CountDropped(grain.IterDataset):
    """Skips the elements a pipeline marked as dropped and hands their count to the next kept one,
    so the count reaches a batch. `dropped(e)` is the count an element stands for when it is
    dropped, None when it is kept; `keep(e, n)` returns the kept element carrying n.

    Stateless between elements, so checkpoints stay exact: its state is its parent's.
    """

    def __init__(self, parent, dropped, keep):
        super().__init__(parent)
        self.dropped, self.keep = dropped, keep

    def __iter__(self):
        return _CountDroppedIterator(self._parent.__iter__(), self.dropped, self.keep)


class _CountDroppedIterator(grain.DatasetIterator):
    def __init__(self, parent, dropped, keep):
        super().__init__(parent)
        self.dropped, self.keep = dropped, keep

    def __next__(self):
        count = 0
        while (n := self.dropped(element := next(self._parent))) is not None:
            count += n
        return self.keep(element, count)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(state)


def _to_batch(packed: dict) -> dict:
    """grain's packer field names -> the trainer's batch fields."""
    segmentation = packed["inputs_segment_ids"]
    return {
        "inputs": packed["inputs"],
        "inputs_position": packed["inputs_positions"],
        "inputs_segmentation": segmentation,
        "targets": packed["targets"],
        "targets_segmentation": segmentation * packed["loss_mask"],
        "num_truncated": np.asarray(packed["num_truncated"].sum(), np.int32),
    }


def _records(cfg, tokenizer, split: str, path: str, demonstration=None) -> grain.MapDataset:
    """The split's raw records: {prompt, completion}, {messages} (the data format's), {ids}
    (synthetic), or the built-in task's problems as `demonstration(prompt, answer)` makes them (an
    environment's, envs/factory.py) when given."""
    if path == "builtin":
        digits, ops, stream = cfg.builtin_task_digits, cfg.builtin_task_ops, split

        def problem(i):
            prompt, answer = builtin_problem(int(i), stream, digits, ops)
            return demonstration(prompt, answer) if demonstration else {"prompt": prompt, "completion": answer}

        return grain.MapDataset.range(NUM_PROBLEMS).map(problem)
    if path == "synthetic":
        length, vocab, seed = cfg.max_target_length, tokenizer.vocab_size, (cfg.seed, 0 if split == "train" else 1)
        return grain.MapDataset.range(NUM_PROBLEMS).map(
            lambda i: {"ids": np.random.default_rng([*seed, int(i)]).integers(0, vocab, length).tolist()}
        )
    return grain.MapDataset.source(format_choice.data_format(cfg).sft_records(cfg, tokenizer, path))


def eval_prompt_records(cfg, tokenizer) -> list[dict]:
    """The eval files as {prompt, label, completion} records for generation evals (data.eval_prompts):
    the prompt is the prompt text, or the conversation before its last assistant turn; the label is the
    record's label_key field when it has one, else its completion (the last assistant turn)."""
    out = []
    for record in file_records(cfg, tokenizer, split_path(cfg, "eval"), cfg.label_key):
        images = {k: record[k] for k in ("images", "where") if "images" in record}
        if images and [m["role"] for m in record["messages"]] != ["user", "assistant"]:
            raise DataError(
                f"{record['where']}: answers are generated for image records of one user turn and its answer only; "
                "set eval_num_samples=0"
            )
        if images:  # the user turn's parts, a prompt with images (data/prompt_ids.py)
            prompt, completion = record["messages"][0]["content"], record["messages"][-1]["content"]
        elif "messages" in record:
            prompt, completion = record["messages"][:-1], record["messages"][-1]["content"]
        else:
            prompt, completion = record["prompt"], record["completion"]
        out.append({"prompt": prompt, "label": record.get("label", completion), "completion": completion, **images})
    return out


def make_sft_dataset(
    cfg, tokenizer, rows: int, split: str = "train", shard: int = 0, num_shards: int = 1, demonstration=None
) -> grain.IterDataset:
    """The grain pipeline of one virtual data shard (see unitrain.data.shards): it reads
    records[shard::num_shards] and yields batches of `rows` rows (see the module docstring)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    max_len, path = cfg.max_target_length, split_path(cfg, split)
    if path == "builtin" and max_len < max_builtin_length(cfg.builtin_task_digits):
        raise ConfigError(
            f"max_target_length={max_len} is too short for the built-in task with builtin_task_digits="
            f"{cfg.builtin_task_digits}; it needs {max_builtin_length(cfg.builtin_task_digits)}"
        )

    records_of_shard, where = shard_records(
        _records(cfg, tokenizer, split, path, demonstration), path, shard, num_shards
    )
    vision = Vision(cfg) if cfg.max_image_patches else None
    to_example = _example_fn(cfg, tokenizer, vision)
    if vision is not None:
        vision.check(records_of_shard)
    elif path not in ("builtin", "synthetic"):  # generated records hold no images
        refuse_images(records_of_shard)
    _check_not_empty(records_of_shard.map(to_example), where, max_len)

    seed = shard_seed(cfg.seed, shard)
    ds = records_of_shard
    if split == "train" and cfg.shuffle:
        ds = ds.shuffle(seed=seed)  # reshuffled every epoch: grain folds the epoch into the seed
    if split == "train":
        ds = ds.repeat(cfg.num_epochs)  # None = forever
    # Records are in memory and tokenizing holds the GIL: reader threads would only contend (grain
    # recommends num_threads=0 for in-memory data).
    it = CountDropped(
        ds.map(to_example).to_iter_dataset(grain.ReadOptions(num_threads=0)),
        dropped=lambda e: None if "inputs" in e else int(e["num_truncated"]),
        keep=lambda e, n: {**e, "num_truncated": np.int32(e["num_truncated"] + n)},
    )
    lengths = {k: max_len for k in _PACKED}
    padding = {"inputs": tokenizer.pad_id, "targets": tokenizer.pad_id, "loss_mask": 0, "num_truncated": 0}
    if vision is not None:  # a row's images: at most the budget's patches, each image at least one token's
        lengths.update(pixels=vision.budget, image_grids=vision.budget // vision.cfg.merge_unit)
        padding.update(pixels=0.0, image_grids=0)
    it = grain.experimental.FirstFitPackIterDataset(
        it,
        length_struct=lengths,
        num_packing_bins=rows,
        seed=seed,
        max_sequences_per_bin=None if cfg.packing else 1,  # packing=false: one example per row
        padding_struct=padding,
    )
    to_batch = _to_batch if vision is None else lambda packed: {**_to_batch(packed), **vision.batch_fields(packed)}
    return it.batch(rows, drop_remainder=True).map(to_batch)


def make_sft_iterator(
    cfg,
    tokenizer,
    global_batch_size: int,
    split: str = "train",
    process_index: int = 0,
    process_count: int = 1,
    demonstration=None,
) -> ShardedIterator:
    """This process's rows of each global batch of `global_batch_size` rows, drawn from
    cfg.data_shards virtual shards (unitrain.data.shards): the global batch does not depend on the
    process count. `demonstration` makes the built-in task's records (see _records). get_state()/set_state() save and restore the position exactly, and the state
    of every shard, merged over processes (shards.merge_states), restores on any process count."""
    return sharded_iterator(
        cfg.data_shards,
        global_batch_size,
        process_index,
        process_count,
        lambda rows, s: make_sft_dataset(cfg, tokenizer, rows, split, s, cfg.data_shards, demonstration),
    )


def _check_not_empty(examples: grain.MapDataset, where: str, max_len: int) -> None:
    """Fail now, not mid-run, when no example fits: scan until the first one that does."""
    for i in range(len(examples)):
        if "inputs" in examples[i]:
            return
    raise DataError(f"no example of {where} fits in max_target_length={max_len}; raise it or use truncation=truncate")
