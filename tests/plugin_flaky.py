"""Workflow plugins that raise, for the faults of tests/tasks/test_rl_plugins.py: `Flaky` is
single_turn whose every fourth group raises once its answers are sampled (a verifier that fails on
some records: each failure is a recorded group end, the run goes on); `Broken` raises on every
group (a plugin that cannot work: the run stops with one line)."""

from __future__ import annotations

from unitrain.rollout.single_turn import SingleTurn
from unitrain.rollout.workflow import Generate, scored_answers


class Flaky(SingleTurn):
    def __init__(self, run):
        super().__init__(run)
        self.started = 0  # groups started: the driver starts them in the same order on every process

    def group(self, record, n: int):
        self.started += 1
        number = self.started
        turns = yield [Generate(list(record.ids))] * n
        if number % 4 == 2:
            raise RuntimeError(f"the verifier has no answer for {record.text!r}")
        return (yield from scored_answers(record, turns, self.tokenizer))


class Broken(SingleTurn):
    def group(self, record, n: int):
        raise ConnectionError("the verifier at localhost:9 refused the connection")
        yield  # a generator, as every group is
