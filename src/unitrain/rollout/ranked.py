"""`workflow: ranked`: a group is the sampler's ranked sequences of its prompt (engines/beam.py: the
n_samples_per_prompt best beams, or samples, optionally constrained to the data format's trie), best
first, scored by the run's `reward`, so that a GroupReward sees the ranks (recsys' sid_rank). The data
format chooses this workflow where it ranks (rollout_decoding=beam; MiniOneRec's SID index) and may
say how it ranks (DataFormat.ranked_rollout); else the group is the plain beams."""

from __future__ import annotations

from unitrain.data import format_choice
from unitrain.engines.beam import BeamParams
from unitrain.rollout.workflow import Rank, Workflow, scored_answers


def plain_beams(cfg, tokenizer) -> BeamParams:
    """The n_samples_per_prompt best beams of rollout_max_response_len tokens, stopping at EOS."""
    return BeamParams(
        cfg.n_samples_per_prompt,
        cfg.rollout_max_response_len,
        length_penalty=cfg.beam_length_penalty,
        temperature=cfg.rollout_temperature,
        stop_token_ids=(tokenizer.eos_id,),
    )


class Ranked(Workflow):
    def __init__(self, run):
        super().__init__(run)
        self.max_tokens = run.cfg.rollout_max_response_len
        ranked = format_choice.data_format(run.cfg).ranked_rollout(run.cfg, run.tokenizer)
        self.beams = ranked or plain_beams(run.cfg, run.tokenizer)

    def group(self, record, n: int):
        turns = yield Rank(list(record.ids), self.beams)
        return (yield from scored_answers(record, turns, self.tokenizer))
