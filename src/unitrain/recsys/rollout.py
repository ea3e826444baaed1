"""Beam search over the SIDs (engines/beam.py): the settings of every SID search, constrained to the
trie of `sid_index_path`'s SIDs when it is set, and GRPO's ranked rollouts: the n_samples_per_prompt
beams (rollout_decoding=beam) or samples constrained to the SIDs, best first, so that a group's
rewards (sid_rank) see the ranks."""

from __future__ import annotations

import functools

from unitrain.engines.beam import BeamParams
from unitrain.recsys.trie import sid_trie


@functools.lru_cache(maxsize=4)
def _trie(index_path: str, tokenizer):
    return sid_trie(index_path, tokenizer)[0]


def sid_beams(cfg, tokenizer, width: int, sample: bool = False, temperature: float = 1.0) -> BeamParams:
    """Beam (or sampling) settings over the run's SIDs: constrained to sid_index_path when set (then
    as long as a SID plus EOS), else `rollout_max_response_len` tokens, stopping at EOS."""
    trie = _trie(cfg.sid_index_path, tokenizer) if cfg.sid_index_path else None
    return BeamParams(
        width,
        trie.depth if trie else cfg.rollout_max_response_len,
        trie,
        cfg.beam_length_penalty,
        sample,
        temperature,
        (tokenizer.eos_id,),
    )


def ranked_rollout(cfg, tokenizer) -> BeamParams:
    """GRPO's ranked rollouts (beams, or samples constrained to the SIDs)."""
    return sid_beams(
        cfg,
        tokenizer,
        cfg.n_samples_per_prompt,
        sample=cfg.rollout_decoding == "sample",
        temperature=cfg.rollout_temperature,
    )
