"""Packed rows of RL updates (`rl_packing`): the sequences of an update placed side by side in rows
of a fixed width by first-fit-decreasing, each its own segment (ids 1, 2, ... within a row, 0 on
padding) with its positions from 0, so attention stays inside it and the model sees it exactly as in
a row of its own. This module owns the packer and the host-side index arrays that move a batch's
fields between the unpacked layout of the modes (GRPO's [rows, P + C] inputs with [rows, C]
completion fields; DPO's chosen/rejected pair rows) and packed [rows, width] arrays. In packed rows
every field is aligned with `inputs`: column t holds what concerns the token predicted from column
t (its target, loss mask, logprobs, advantage), so a completion token's fields sit one column
before the token itself. Row counts and widths come from engines/buckets.py's rule (bounded
compiles; the tasks bucket them). NumPy only: no loop over tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from unitrain.config import check


def first_fit_decreasing(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Bins of `capacity` tokens for items of `lengths` [N] (each <= capacity): the longest first,
    each into the first bin with room. Returns (bin [N], start column inside the bin [N], bins);
    a bin's items follow each other in the order they were placed."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"an item of {int(lengths.max())} tokens does not fit a bin of {capacity}")
    bins, starts = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    used = np.zeros(len(lengths), np.int64)  # at most one bin per item
    count = 0
    for i in np.argsort(-lengths, kind="stable"):
        b = int(np.argmax(used[:count] + lengths[i] <= capacity)) if count else 0
        if not count or used[b] + lengths[i] > capacity:
            b, count = count, count + 1
        bins[i], starts[i] = b, used[b]
        used[b] += lengths[i]
    return bins, starts, count


def _spans(lengths) -> tuple[np.ndarray, np.ndarray]:
    """(item, offset) of every token of items of `lengths`, item by item."""
    lengths = np.asarray(lengths, np.int64)
    item = np.repeat(np.arange(len(lengths)), lengths)
    offset = np.arange(len(item)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return item, offset


def _segment_ids(bins, starts) -> np.ndarray:
    """1, 2, ... for the items of each bin in column order."""
    order = np.lexsort((starts, bins))
    first = np.r_[0, np.flatnonzero(np.diff(bins[order])) + 1]
    rank = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
    out = np.zeros(len(bins), np.int64)
    out[order] = rank + 1
    return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the tokens of N sequences go in `rows` packed rows of `width` columns: `dst` flat
    indices into [rows, width] of every token, sequence by sequence, with their segment ids and positions."""

    rows: int
    width: int
    dst: np.ndarray
    segment: np.ndarray
    position: np.ndarray

    def put(self, values, fill, dtype) -> np.ndarray:
        out = np.full(self.rows * self.width, fill, dtype)
        out[self.dst] = values
        return out.reshape(self.rows, self.width)


def place(lengths, width: int, rows: int) -> Placement:
    """first_fit_decreasing of sequences of `lengths` into `rows` rows of `width` (at least what they need)."""
    bins, starts, used = first_fit_decreasing(lengths, width)
    if used > rows:
        raise ValueError(f"{used} packed rows do not fit in {rows}")
    item, offset = _spans(lengths)
    return Placement(rows, width, bins[item] * width + starts[item] + offset, _segment_ids(bins, starts)[item], offset)


def packed_rows_needed(lengths, width: int) -> int:
    """How many rows of `width` first_fit_decreasing fills with sequences of `lengths`."""
    return first_fit_decreasing(lengths, width)[2]


# ---------------------------------------------------------------- GRPO's rows


def completion_rows(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(prompt length, completion length) [rows] of GRPO's unpacked rows (tasks/rl.py's layout)."""
    C = batch["targets"].shape[1]
    real = batch["inputs_segmentation"] > 0
    return real[:, :-C].sum(axis=1), real[:, -C:].sum(axis=1)


@dataclasses.dataclass(frozen=True)
class RolloutPacking:
    """GRPO's unpacked rows [N, P + C] (completion fields [N, C]) <-> packed rows [rows, width]."""

    placement: Placement
    src_inputs: np.ndarray  # flat indices into [N, P + C] of every packed token
    dst_targets: np.ndarray  # flat indices into [rows, width] of every completion token's fields
    src_targets: np.ndarray  # flat indices into [N, C] of the same
    columns: int  # C

    @classmethod
    def plan(cls, batch: dict, width: int, rows: int) -> RolloutPacking:
        """The packing of the batch's sequences into `rows` rows of `width` (the caller buckets them)."""
        prompt, completion = completion_rows(batch)
        N, PC = batch["inputs"].shape
        C = batch["targets"].shape[1]
        placement = place(prompt + completion, width, rows)
        item, offset = _spans(prompt + completion)
        src_inputs = item * PC + (PC - C - prompt[item]) + offset
        starts = placement.dst[np.r_[0, np.cumsum(prompt + completion)[:-1]]] if N else np.zeros(0, np.int64)
        item, k = _spans(completion)
        return cls(placement, src_inputs, starts[item] + prompt[item] - 1 + k, item * C + k, C)

    def pack(self, key: str, values: np.ndarray, pad_id: int = 0) -> np.ndarray:
        """A field of the unpacked batch as packed [rows, width]: the input fields ([N, P + C]) token
        by token, the completion fields ([N, C], or [N] per sequence: spread over its completion)
        at the columns that predict their tokens; 0 (inputs: `pad_id`) elsewhere."""
        p = self.placement
        if key == "inputs_position":
            return p.put(p.position, 0, np.int32)
        if key == "inputs_segmentation":
            return p.put(p.segment, 0, np.int32)
        if key == "inputs":
            return p.put(values.reshape(-1)[self.src_inputs], pad_id, values.dtype)
        if values.ndim == 1:  # per sequence
            values = np.repeat(values[:, None], self.columns, axis=1)
        fill = pad_id if key == "targets" else 0
        out = np.full(p.rows * p.width, fill, values.dtype)
        out[self.dst_targets] = values.reshape(-1)[self.src_targets]
        return out.reshape(p.rows, p.width)

    def unpack(self, packed: np.ndarray, sequences: int) -> np.ndarray:
        """A packed completion field [rows, width] -> [N, C] (0 off the completions)."""
        out = np.zeros(sequences * self.columns, packed.dtype)
        out[self.src_targets] = packed.reshape(-1)[self.dst_targets]
        return out.reshape(sequences, self.columns)


# ---------------------------------------------------------------- DPO's pairs


def pack_pairs(
    batch: dict, sides: tuple[str, str], fields: tuple[str, ...], width: int, rows: int, pad_id: int = 0
) -> dict:
    """DPO's pair rows ({side}_{field} [pairs, T], right-padded) -> packed rows [rows, width] of the
    same `fields`: each pair's two sequences side by side in one row (chosen first), so that the
    segments of pair q of a row are 2q + 1 (chosen) and 2q + 2 (rejected). Pairs without a real token
    (eval padding) are left out."""
    lengths = [(batch[f"{side}_inputs_segmentation"] > 0).sum(axis=1) for side in sides]
    pair_lengths = lengths[0] + lengths[1]
    kept = np.flatnonzero(pair_lengths > 0)
    bins, starts, used = first_fit_decreasing(pair_lengths[kept], width)
    if used > rows:
        raise ValueError(f"{used} packed rows do not fit in {rows}")
    pair_segment = _segment_ids(bins, starts)
    out = {}
    for field in fields:
        pieces, dst = [], []
        for s, side in enumerate(sides):
            n = lengths[s][kept]
            item, offset = _spans(n)
            first = starts[item] + (lengths[0][kept][item] if s else 0)
            dst.append(bins[item] * width + first + offset)
            T = batch[f"{side}_{field}"].shape[1]
            if field == "inputs_segmentation":
                pieces.append(2 * pair_segment[item] - 1 + s)
            elif field == "inputs_position":
                pieces.append(offset)
            else:
                pieces.append(batch[f"{side}_{field}"].reshape(-1)[kept[item] * T + offset])
        packed = np.full(rows * width, pad_id if field in ("inputs", "targets") else 0, np.int32)
        packed[np.concatenate(dst)] = np.concatenate(pieces)
        out[field] = packed.reshape(rows, width)
    return out


def pair_rows_needed(batch: dict, sides: tuple[str, str], width: int) -> int:
    """How many rows of `width` pack_pairs fills with the batch's pairs."""
    pair_lengths = sum((batch[f"{side}_inputs_segmentation"] > 0).sum(axis=1) for side in sides)
    return packed_rows_needed(pair_lengths[pair_lengths > 0], width)


@check(
    "rl_packing",
    "rl_packing_row_tokens",
    "mode",
    "max_target_length",
    "max_prompt_length",
    "workflow",
    "episode_max_tokens",
    "rollout_max_response_len",
)
def _rl_packing(c) -> str | None:
    """Packed RL rows serve the RL modes and DPO, and hold the longest sequence the config allows."""
    if not c["rl_packing"]:
        return (
            "rl_packing_row_tokens sizes rl_packing's rows; set rl_packing=true" if c["rl_packing_row_tokens"] else None
        )
    if c["mode"] in ("sft", "rm"):
        hint = " (sft packs with packing=true)" if c["mode"] == "sft" else ""
        return f"rl_packing packs the updates of grpo, ppo and dpo; mode={c['mode']} has none{hint}"
    if c["mode"] == "dpo":
        longest, what = 2 * c["max_target_length"], "2 x max_target_length (a pair)"
    else:
        completion = "episode_max_tokens" if c["workflow"] != "single_turn" else "rollout_max_response_len"
        longest, what = c["max_prompt_length"] + c[completion], f"max_prompt_length + {completion}"
    if 0 < c["rl_packing_row_tokens"] < longest:
        return f"rl_packing_row_tokens ({c['rl_packing_row_tokens']}) must hold the longest sequence, {what} = {longest} (or 0)"
    return None


CONFIG_CHECKS = (_rl_packing,)
