"""Preference pairs for DPO: records -> shard -> shuffle -> repeat -> tokenize -> batch (grain).

One row is one pair: its chosen and its rejected sequence, each right-padded to max_target_length
(no packing), so splitting rows into micro-batches keeps every pair together. One batch is a dict of
int32 [pairs, T] numpy arrays for this process's share of the global batch,
  chosen_inputs, chosen_inputs_position, chosen_inputs_segmentation, chosen_targets,
  chosen_targets_segmentation, and the same five with the rejected_ prefix,
laid out like an unpacked SFT row (data/sft.py: segment 1 on the sequence, 0 on padding; targets
are the next token; targets_segmentation is 1 only where the target is a completion token, the EOS
included, so the prompt and the padding carry no loss), plus `num_truncated`, an int32 scalar
counted like the SFT pipeline's: pairs truncated or dropped while the batch was assembled, a pair
counted once whichever of its sequences was over-long; with rm_margin_key (mode=rm), `margin`, float32
[pairs], the record's margin; with dpo_loss_type=kto, `label`, float32 [pairs] (below). The records are split into `data_shards`
virtual shards (unitrain.data.shards), so the global batches do not depend on the process count.

Records (any format of data/sources.py; errors name file:line), TRL's formats:
  standard:        {prompt_key: str, chosen_key: str, rejected_key: str}; the sequences are
                   [BOS] + prompt + completion + [EOS], the texts concatenated verbatim (like SFT); mode=rm's
                   BOS only where transformers' tokenizer(text) adds one (TRL's RewardTrainer, the reward scorer);
  conversational:  chosen_key and rejected_key hold [{role, content}] messages, the prompt either
                   under prompt_key (a message list: TRL's explicit prompt) or the messages chosen and
                   rejected share before they differ (TRL's implicit prompt); what follows the prompt
                   must be one assistant message. Rendered by the tokenizer's chat template, which owns
                   every special token; the prompt is the conversation up to the generation prompt.
  dataset_path=builtin:  the arithmetic task, chosen = the right answer, rejected = a wrong one.

dpo_loss_type=kto reads unpaired records instead (TRL's unpaired preference format):
{prompt_key: str, completion_key: str, kto_label_key: bool}, or the prompt a message list and the
completion a list of one assistant message; the built-in task's records alternate a right answer
(desirable) and a wrong one. A row is still two sequences: chosen_* the record's prompt and
completion, rejected_* its prompt with the previous record's completion (the first record: the
last's), the mismatched pair whose log-ratio KTO's reference point averages (TRL's KL dataset pairs
each prompt with its neighbour's completion the same way); `label` is 1.0 where the record's
completion is desirable.

Over-long sequences (more than max_target_length tokens): `truncation=truncate` cuts the completion
on the right (the prompt is kept whole); a pair whose prompt alone fills the row is dropped.
`truncation=drop` drops every pair with an over-long sequence.
"""

from __future__ import annotations

import grain
import numpy as np

from unitrain.data.builtin import NUM_PROBLEMS, SPLITS, builtin_problem, max_builtin_length
from unitrain.data.sft import BATCH_FIELDS, CountDropped, example_arrays
from unitrain.data.shards import ShardedIterator, shard_records, shard_seed, sharded_iterator
from unitrain.data.sources import iter_rows, split_path
from unitrain.errors import ConfigError, DataError

SIDES = ("chosen", "rejected")
PAIR_FIELDS = tuple(f"{side}_{field}" for side in SIDES for field in BATCH_FIELDS)
MARGIN = "margin"  # float32 [pairs], with rm_margin_key: the pair's margin in mode=rm's loss
LABEL = "label"  # float32 [pairs], with dpo_loss_type=kto: 1.0 where the record's completion is desirable


# ---------------------------------------------------------------- records


def read_preference_records(
    spec: str, prompt_key: str, chosen_key: str, rejected_key: str, margin_key: str = ""
) -> list[dict]:
    """All records of the files named by `spec`, checked eagerly (file:line on error), each reduced to
    {prompt, chosen, rejected} texts or {prompt_messages, chosen_message, rejected_message}, with
    `margin` (a number) where `margin_key` names the field holding it."""
    records = [
        _with_margin(_normalize(row, where, prompt_key, chosen_key, rejected_key), row, where, margin_key)
        for where, row in iter_rows(spec)
    ]
    if not records:
        raise DataError(f"dataset path {spec!r} holds no records")
    return records


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _normalize(row, where: str, prompt_key: str, chosen_key: str, rejected_key: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    if chosen_key not in row or rejected_key not in row:
        raise DataError(
            f"{where}: record lacks {chosen_key!r} or {rejected_key!r} (it has {sorted(row)}); "
            "set chosen_key and rejected_key"
        )
    chosen, rejected, prompt = row[chosen_key], row[rejected_key], row.get(prompt_key)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise DataError(
                f"{where}: field {prompt_key!r} must be a string beside string {chosen_key!r} and "
                f"{rejected_key!r}, got {type(prompt).__name__}; set prompt_key"
            )
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if not (_is_messages(chosen) and _is_messages(rejected)):
        raise DataError(
            f"{where}: fields {chosen_key!r} and {rejected_key!r} must both be strings or both lists "
            "of {role, content} messages"
        )
    chosen, rejected = [_message(m) for m in chosen], [_message(m) for m in rejected]
    if prompt is None:  # implicit prompt: the messages both share
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif _is_messages(prompt):
        prompt = [_message(m) for m in prompt]
    else:
        raise DataError(
            f"{where}: field {prompt_key!r} must be a list of {{role, content}} messages beside "
            f"conversational {chosen_key!r} and {rejected_key!r}"
        )
    for key, tail in ((chosen_key, chosen), (rejected_key, rejected)):
        if len(tail) != 1 or tail[0]["role"] != "assistant":
            raise DataError(
                f"{where}: after the prompt, {key!r} must hold exactly one assistant message, it holds "
                f"{[m['role'] for m in tail]}"
            )
    return {"prompt_messages": prompt, "chosen_message": chosen[0], "rejected_message": rejected[0]}


def _with_margin(record: dict, row: dict, where: str, margin_key: str) -> dict:
    """The record with the pair's margin (mode=rm's rm_margin_key, TRL's `margin` field)."""
    if not margin_key:
        return record
    value = row.get(margin_key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise DataError(f"{where}: field {margin_key!r} (rm_margin_key) must be a finite number, got {value!r}")
    return {**record, "margin": float(value)}


def _message(m: dict) -> dict:
    return {"role": m["role"], "content": m["content"]}


def read_kto_records(spec: str, prompt_key: str, completion_key: str, label_key: str) -> list[dict]:
    """All unpaired records of the files named by `spec` (file:line on error) as pair records: the
    record's completion as chosen, the previous record's as rejected (module docstring), its label
    as `label`."""
    records = [_normalize_unpaired(row, where, prompt_key, completion_key, label_key) for where, row in iter_rows(spec)]
    if not records:
        raise DataError(f"dataset path {spec!r} holds no records")
    if len({"prompt" in r for r in records}) > 1:
        raise DataError(f"{spec}: KTO records must be all plain texts or all messages, not a mix")
    kl_side = "rejected" if "prompt" in records[0] else "rejected_message"
    own = kl_side.replace("rejected", "chosen")
    return [{**r, kl_side: previous[own]} for r, previous in zip(records, records[-1:] + records[:-1])]


def _normalize_unpaired(row, where: str, prompt_key: str, completion_key: str, label_key: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    label = row.get(label_key)
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: a KTO record needs the boolean field {label_key!r} (is the completion desirable?), "
            f"got {label!r}; set kto_label_key"
        )
    prompt, completion = row.get(prompt_key), row.get(completion_key)
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": prompt, "chosen": completion, LABEL: label}
    if _is_messages(prompt) and _is_messages(completion) and [m["role"] for m in completion] == ["assistant"]:
        return {
            "prompt_messages": [_message(m) for m in prompt],
            "chosen_message": _message(completion[0]),
            LABEL: label,
        }
    raise DataError(
        f"{where}: fields {prompt_key!r} and {completion_key!r} must be strings, or a list of {{role, content}} "
        "messages and a list of one assistant message"
    )


def builtin_pair(index: int, split: str, digits: int, ops: str) -> dict:
    """Problem `index` of the built-in task as a pair: the right answer and a wrong one near it."""
    prompt, answer = builtin_problem(index, split, digits, ops)
    rng = np.random.default_rng([SPLITS[split], index, 1 << 20])
    wrong = int(answer) + int(rng.integers(1, 10)) * (1 if rng.integers(0, 2) else -1)
    return {"prompt": prompt, "chosen": answer, "rejected": str(wrong)}


def builtin_unpaired(index: int, split: str, digits: int, ops: str) -> dict:
    """Problem `index` of the built-in task as a KTO record (read_kto_records' form): the right answer
    (desirable) at an even index, a wrong one at an odd index; rejected: the previous problem's."""

    def completion(i: int) -> str:
        pair = builtin_pair(i, split, digits, ops)
        return pair["chosen"] if i % 2 == 0 else pair["rejected"]

    prompt = builtin_pair(index, split, digits, ops)["prompt"]
    return {
        "prompt": prompt,
        "chosen": completion(index),
        "rejected": completion((index - 1) % NUM_PROBLEMS),
        LABEL: index % 2 == 0,
    }


def _records(cfg, tokenizer, split: str, path: str) -> grain.MapDataset:
    if path == "builtin":
        digits = cfg.builtin_task_digits
        if cfg.max_target_length < max_builtin_length(digits):  # the wrong answers fit the same bound
            raise ConfigError(
                f"max_target_length={cfg.max_target_length} is too short for the built-in task with "
                f"builtin_task_digits={digits}; it needs {max_builtin_length(digits)}"
            )
        record = builtin_unpaired if kto(cfg) else builtin_pair
        return grain.MapDataset.range(NUM_PROBLEMS).map(lambda i: record(int(i), split, digits, cfg.builtin_task_ops))
    if path == "synthetic":
        key = "dataset_path" if split == "train" else "eval_dataset_path"
        raise ConfigError(
            f"{key}=synthetic has no preference pairs; use builtin or data files with "
            "prompt_key, chosen_key and rejected_key"
        )
    if kto(cfg):
        records = read_kto_records(path, cfg.prompt_key, cfg.completion_key, cfg.kto_label_key)
    else:
        records = read_preference_records(path, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key, cfg.rm_margin_key)
    if not tokenizer.has_chat_template and any("prompt_messages" in r for r in records):
        tokenizer.apply_chat_template([])  # raises the ConfigError naming tokenizer_path
    return grain.MapDataset.source(records)


# ---------------------------------------------------------------- tokenize and lay out


def _row(ex: dict, max_len: int, pad_id: int) -> dict:
    """example_arrays' unpacked arrays -> one right-padded row of the five batch fields."""
    n = len(ex["inputs"])
    out = {
        "inputs": np.full(max_len, pad_id, np.int32),
        "inputs_position": np.zeros(max_len, np.int32),
        "inputs_segmentation": np.zeros(max_len, np.int32),
        "targets": np.full(max_len, pad_id, np.int32),
        "targets_segmentation": np.zeros(max_len, np.int32),
    }
    out["inputs"][:n], out["targets"][:n] = ex["inputs"], ex["targets"]
    out["inputs_position"][:n] = np.arange(n)
    out["inputs_segmentation"][:n] = 1
    out["targets_segmentation"][:n] = ex["loss_mask"]
    return out


def _plain_bos(cfg, tokenizer) -> list[int]:
    """The BOS before a plain-text prompt: a reward model reads what the scorer gives it (transformers'
    tokenizer(text)), DPO's policy what SFT gave it."""
    if cfg.mode == "rm":
        return tokenizer.text_bos
    return [] if tokenizer.bos_id is None else [tokenizer.bos_id]


def pair_fn(tokenizer, max_len: int, truncation: str, bos: list[int]):
    """record -> one pair row {chosen_*, rejected_*, num_truncated}; without "chosen_inputs" when dropped."""
    eos = [tokenizer.eos_id]

    def to_pair(record: dict) -> dict:
        if "prompt_messages" in record:  # the chat template owns BOS and end-of-turn tokens
            texts = [
                tokenizer.apply_chat_template([*record["prompt_messages"], record[f"{side}_message"]]) for side in SIDES
            ]
            prompt = tokenizer.encode(texts[0][0])  # the same prompt text for both sides
            completions = [tokenizer.encode(completion) for _, completion in texts]
        else:  # plain texts, concatenated verbatim: separators belong in the data
            prompt = bos + tokenizer.encode(record["prompt"])
            completions = [tokenizer.encode(record[side]) + eos for side in SIDES]
        examples = [
            example_arrays([(prompt, False), (c, True)], max_len, truncation, tokenizer.pad_id) for c in completions
        ]
        truncated = np.int32(any(int(e["num_truncated"]) for e in examples))
        if not all("inputs" in e for e in examples):
            return {"num_truncated": truncated}
        rows = {
            f"{side}_{k}": v for side, e in zip(SIDES, examples) for k, v in _row(e, max_len, tokenizer.pad_id).items()
        }
        rows.update({k: np.float32(record[k]) for k in (MARGIN, LABEL) if k in record})
        return {**rows, "num_truncated": truncated}

    return to_pair


def kto(cfg) -> bool:
    """Whether the data are KTO's unpaired records (mode=dpo's dpo_loss_type=kto)."""
    return cfg.mode == "dpo" and cfg.dpo_loss_type == "kto"


def per_pair_fields(cfg) -> tuple[str, ...]:
    """The float32 [pairs] fields a batch carries beside PAIR_FIELDS."""
    return ((MARGIN,) if cfg.rm_margin_key else ()) + ((LABEL,) if kto(cfg) else ())


def _kept(element: dict) -> bool:
    return "chosen_inputs" in element


def _sum_counts(batch: dict) -> dict:
    return {**batch, "num_truncated": np.asarray(batch["num_truncated"].sum(), np.int32)}


def _check_not_empty(pairs: grain.MapDataset, where: str, max_len: int) -> None:
    """Fail now, not mid-run, when no pair fits: scan until the first one that does."""
    for i in range(len(pairs)):
        if _kept(pairs[i]):
            return
    raise DataError(
        f"no preference pair of {where} fits in max_target_length={max_len}; raise it or use truncation=truncate"
    )


# ---------------------------------------------------------------- pipelines


def make_preference_dataset(cfg, tokenizer, rows: int, shard: int = 0, num_shards: int = 1) -> grain.IterDataset:
    """The grain pipeline of one virtual data shard of the train split: records[shard::num_shards],
    shuffled with the shard's seed (when `shuffle`), repeated `num_epochs` times, `rows` pairs a batch."""
    max_len, path = cfg.max_target_length, split_path(cfg, "train")
    records_of_shard, where = shard_records(_records(cfg, tokenizer, "train", path), path, shard, num_shards)
    to_pair = pair_fn(tokenizer, max_len, cfg.truncation, _plain_bos(cfg, tokenizer))
    _check_not_empty(records_of_shard.map(to_pair), where, max_len)

    ds = records_of_shard
    if cfg.shuffle:
        ds = ds.shuffle(seed=shard_seed(cfg.seed, shard))  # reshuffled every epoch
    ds = ds.repeat(cfg.num_epochs)  # None = forever
    it = CountDropped(
        ds.map(to_pair).to_iter_dataset(grain.ReadOptions(num_threads=0)),
        dropped=lambda e: None if _kept(e) else int(e["num_truncated"]),
        keep=lambda e, n: {**e, "num_truncated": np.int32(e["num_truncated"] + n)},
    )
    return it.batch(rows, drop_remainder=True).map(_sum_counts)


def make_preference_iterator(
    cfg, tokenizer, global_batch_size: int, process_index: int = 0, process_count: int = 1
) -> ShardedIterator:
    """This process's rows (pairs) of each global batch of `global_batch_size` pairs, drawn from
    cfg.data_shards virtual shards: the same global batches for any process count, and
    get_state()/set_state() restore the position exactly (as make_sft_iterator)."""
    return sharded_iterator(
        cfg.data_shards,
        global_batch_size,
        process_index,
        process_count,
        lambda rows, s: make_preference_dataset(cfg, tokenizer, rows, s, cfg.data_shards),
    )


def eval_pair_batches(cfg, tokenizer, rows: int, max_batches: int) -> list[dict]:
    """Up to `max_batches` batches of `rows` pairs of the eval split, in the file's (or stream's)
    order, every process the same full batches (not sharded, not shuffled, no num_truncated). The
    last batch is filled with padding rows (all segmentation 0) when the pairs run out; dropped pairs
    are skipped. Fewer batches when the eval data holds fewer pairs; none when the run does not
    evaluate or its files have no eval split."""
    if not cfg.evaluates or (not cfg.eval_dataset_path and cfg.dataset_path != "builtin"):
        return []
    path = split_path(cfg, "eval")
    records = _records(cfg, tokenizer, "eval", path)
    to_pair = pair_fn(tokenizer, cfg.max_target_length, cfg.truncation, _plain_bos(cfg, tokenizer))
    fields = PAIR_FIELDS + per_pair_fields(cfg)
    pairs = []
    for i in range(len(records)):
        if len(pairs) == rows * max_batches:
            break
        element = to_pair(records[i])
        if _kept(element):
            pairs.append({k: element[k] for k in fields})
    if not pairs:
        raise DataError(
            f"no eval preference pair of {path!r} fits in max_target_length={cfg.max_target_length}; "
            "raise it or use truncation=truncate"
        )
    padding = {k: np.zeros_like(v) for k, v in pairs[0].items()}
    pairs += [padding] * (-len(pairs) % rows)
    return [{k: np.stack([p[k] for p in pairs[b : b + rows]]) for k in fields} for b in range(0, len(pairs), rows)]
