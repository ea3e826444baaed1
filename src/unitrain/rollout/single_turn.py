"""`workflow: single_turn` (the default): one sampled answer per row, scored by the run's `reward`."""

from __future__ import annotations

from unitrain.rollout.workflow import Generate, Workflow, scored_answers


class SingleTurn(Workflow):
    def __init__(self, run):
        super().__init__(run)
        self.max_tokens = run.cfg.rollout_max_response_len

    def group(self, record, n: int):
        turns = yield [Generate(list(record.ids), images=record.images)] * n
        return (yield from scored_answers(record, turns, self.tokenizer))
