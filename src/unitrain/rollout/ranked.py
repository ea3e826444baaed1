"""`workflow: ranked`: a group is the sampler's ranked sequences of its prompt (rollout/beam.py: the
n_samples_per_prompt best beams, or samples, optionally constrained to the data format's trie), best
first, scored by the run's `reward`, so that a GroupReward sees the ranks (recsys' sid_rank). The data
format says how it ranks (DataFormat.ranked_rollout) and chooses this workflow where it ranks
(rollout_decoding=beam; MiniOneRec's SID index)."""

from __future__ import annotations

from unitrain.data import format_choice
from unitrain.errors import ConfigError
from unitrain.rollout.workflow import Rank, Workflow, scored_answers


class Ranked(Workflow):
    def __init__(self, run):
        super().__init__(run)
        self.max_tokens = run.cfg.rollout_max_response_len
        self.beams = format_choice.data_format(run.cfg).ranked_rollout(run.cfg, run.tokenizer)
        if self.beams is None:
            raise ConfigError(
                f"workflow ranked needs ranked rollouts, which data_format {run.cfg.data_format} gives with "
                "rollout_decoding=beam"
            )

    def group(self, record, n: int):
        turns = yield Rank(list(record.ids), self.beams)
        return (yield from scored_answers(record, turns, self.tokenizer))
