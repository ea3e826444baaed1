"""A fourth rollout shape, written as a plugin outside the package (`workflow: plugin_verifier:Verifier`):
the model answers, the run's reward checks the answer, and a wrong answer gets another try after a
feedback line, up to `max_turns` answers. A trajectory's reward is its last answer's; its loss is on
every answer, not on the feedback."""

from __future__ import annotations

from unitrain.rollout.workflow import Generate, Score, Transcript, Workflow

FEEDBACK = " wrong, try again:"


class Verifier(Workflow):
    def __init__(self, run):
        super().__init__(run)
        self.feedback = run.tokenizer.encode(FEEDBACK)
        self.attempts, self.answer_tokens = run.cfg.max_turns, run.cfg.rollout_max_response_len
        self.max_tokens = self.attempts * self.answer_tokens + (self.attempts - 1) * len(self.feedback)

    def group(self, record, n: int):
        transcripts = [Transcript(record.ids) for _ in range(n)]
        last = [None] * n  # (reward, per_reward, text, stopped) of each row's latest answer
        live = list(range(n))
        for attempt in range(self.attempts):
            turns = yield [Generate(transcripts[i].context(), self.answer_tokens) for i in live]
            texts = [self.tokenizer.decode(t.tokens) for t in turns]
            total, per_reward = yield Score(record, texts)
            for j, (i, turn) in enumerate(zip(live, turns)):
                transcripts[i].add_sampled(turn)
                last[i] = (float(total[j]), {k: float(v[j]) for k, v in per_reward.items()}, texts[j], turn.stopped)
            live = [i for i in live if last[i][0] < 1.0] if attempt + 1 < self.attempts else []
            for i in live:
                transcripts[i].add_context(self.feedback)
            if not live:
                break
        return [
            t.trajectory(reward, _end(reward, stopped), per_reward=per, text=self.tokenizer.decode(t.ids))
            for t, (reward, per, _, stopped) in zip(transcripts, last)
        ]


def _end(reward: float, stopped: bool) -> str:
    if not stopped:
        return "length"
    return "stop" if reward >= 1.0 else "max_turns"
