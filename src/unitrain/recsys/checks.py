"""The config checks of `data_format: minionerec` (format.MiniOneRec.checks), run by
plugins.check_config right after the config loads: each returns None or what is wrong, and the
entry prints it as one line and exits 2, before anything compiles."""

from __future__ import annotations


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


CHECKS = (beam_covers_k, alignment_has_info, grpo_has_no_title_records, sid_rank_is_ranked)
