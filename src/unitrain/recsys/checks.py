"""The config checks of `data_format: minionerec` (format.MiniOneRec.checks), run by
unitrain.checks right after the config loads: each returns None or what is wrong, and the
entry prints it as one line and exits 2, before anything compiles."""

from __future__ import annotations

import math


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The recommendation keys' values (config.py's RULES check the other keys' values as they load).
KEY_RULES = {
    "rec_task_weights": (
        lambda v: len(v) == 3 and all(isinstance(w, (int, float)) and 0 <= w < math.inf for w in v) and sum(v) > 0,
        "a list of 3 finite numbers >= 0, not all 0 (next-SID, title->SID, SID->title)",
    ),
    "rec_eval_k": (lambda v: len(v) > 0 and all(_is_int(k) and k > 0 for k in v), "a non-empty list of positive ints"),
    "rec_eval_batch_size": (lambda v: _is_int(v) and v > 0, "a positive int"),
}


def keys_have_valid_values(c) -> str | None:
    for key, (test, expected) in KEY_RULES.items():
        if not test(c[key]):
            shown = list(c[key]) if isinstance(c[key], tuple) else c[key]  # a frozen config holds lists as tuples
            return f"config key '{key}' expects {expected}, got '{shown}'"
    return None


def beam_covers_k(c) -> str | None:
    if c["beam_width"] >= max(c["rec_eval_k"]):
        return None
    return f"beam_width ({c['beam_width']}) must be at least the largest rec_eval_k ({max(c['rec_eval_k'])})"


def alignment_has_info(c) -> str | None:
    if c["rec_info_path"] or not any(c["rec_task_weights"][1:]):
        return None
    return "rec_task_weights gives the alignment tasks (title->SID, SID->title) a weight but rec_info_path is empty"


def grpo_has_no_title_records(c) -> str | None:
    if c["mode"] != "grpo" or c["rec_task_weights"][2] == 0:
        return None
    return "mode=grpo cannot score SID->title records (rewards compare SIDs); set the third rec_task_weights entry to 0"


def sid_rank_is_ranked(c) -> str | None:
    if (
        "sid_rank" not in [r.strip() for r in c["reward"].split(",")]
        or c["rollout_decoding"] == "beam"
        or c["sid_index_path"]
    ):
        return None
    return "reward sid_rank scores a group by rank: it needs ranked rollouts (rollout_decoding=beam or sid_index_path)"


CHECKS = (keys_have_valid_values, beam_covers_k, alignment_has_info, grpo_has_no_title_records, sid_rank_is_ranked)
