"""The rollout executor (rollout/executor.py) on a scripted sampler and workflow, no model: on-policy
it is the synchronous round; with max_staleness a step takes the groups that finished while a
long-tailed one samples on into the next step (its later turns with the new weights, each token
tagged with its version), none older than the bound; max_concurrent_rollouts caps the groups in
flight; a checkpoint's position brings back exactly the groups no step consumed. A workflow that
raises costs its group (counted, consumed; left out of an evaluation), and a step's worth of groups
raising is one line."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from unitrain.data.prompt_ids import Prompt
from unitrain.engines.base import Completions, SamplingParams
from unitrain.errors import CheckpointError, RunEndedEarly
from unitrain.rollout.driver import Driver
from unitrain.rollout.executor import RolloutExecutor
from unitrain.rollout.workflow import Generate, Score, Transcript, Workflow, WorkflowError

N = 2  # episodes per group


class CountingSampler:
    """One token a turn (the row's index in the call), drawn with the weights version last pushed;
    it records how many groups each call served."""

    def __init__(self):
        self.version, self.calls = -1, []

    def update_weights(self, params, version):
        self.version = version

    def generate(self, prompt_ids, sampling, key):
        rows = len(prompt_ids)
        self.calls.append(rows // N)
        tokens = np.arange(rows, dtype=np.int32)[:, None]
        ones = np.ones((rows, 1), np.int32)
        return Completions(tokens, ones, np.zeros((rows, 1), np.float32), ones[:, 0], self.version)


class Turns(Workflow):
    """A record's episodes take as many turns as its label says, of `tokens` tokens each (None: the
    call's max_new_tokens); reward: the record's index mod 3."""

    def __init__(self, tokens: int | None = 1):
        self.max_tokens, self.tokens = 64, tokens

    def episode(self, record):
        transcript = Transcript(record.ids)
        for _ in range(int(record.label)):
            transcript.add_sampled((yield Generate(transcript.context(), self.tokens)))
        return transcript.trajectory(float(record.ids[0] % 3), "stop")


class Stream:
    """Prompt batches of `size` records; record i takes turns[i % len(turns)] turns."""

    def __init__(self, size, turns):
        self.size, self.turns, self.next_record = size, turns, 0

    def __next__(self):
        first, self.next_record = self.next_record, self.next_record + self.size
        prompts = [Prompt((i,), f"p{i}", str(self.turns[i % len(self.turns)])) for i in range(first, first + self.size)]
        return {"prompts": prompts, "num_dropped": 0}

    def get_state(self):
        return self.next_record

    def set_state(self, state):
        self.next_record = state


class Raising(Turns):
    """Turns whose records named in `bad` (None: every record) raise once their turns are sampled;
    each trajectory's reward is also its task reward (an evaluation's)."""

    def __init__(self, bad: set | None = None):
        super().__init__()
        self.bad = bad

    def episode(self, record):
        trajectory = yield from super().episode(record)
        if self.bad is None or record.text in self.bad:
            raise RuntimeError(f"no verifier for {record.text}")
        return dataclasses.replace(trajectory, per_reward={"task": trajectory.reward})


def executor(sampler, stream, workflow=None, **keys):
    cfg = dict(
        max_staleness=0,
        max_concurrent_rollouts=0,
        over_sampling_batch_size=0,
        rollout_batch_size=stream.size,
        max_sampling_rounds=4,
        steps=100,
        seed=0,
    )
    cfg = types.SimpleNamespace(**(cfg | keys))
    give_up_after = stream.size * cfg.max_sampling_rounds  # as RLTask's driver
    driver = Driver(sampler, workflow or Turns(), N, SamplingParams(1), None, give_up_after=give_up_after)
    return RolloutExecutor(cfg, stream, driver, lambda group: group, keep=None)


def steps(ex, sampler, count, first=0):
    """`count` steps' prepare_batch, each after the step's weights are pushed (as RLTask does)."""
    out = []
    for step in range(first, first + count):
        sampler.update_weights(None, step)
        groups, stats = ex.prepare_batch(step, lambda version: sampler.update_weights(None, version))
        out.append((groups, stats))
    return out


def record(group_or_run) -> int:
    prompt = getattr(group_or_run, "prompt", None) or group_or_run.record
    return prompt.ids[0]


def test_on_policy_a_step_waits_for_its_round_and_trains_on_it_in_record_order():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1, 1, 1, 6]))  # one long-tailed record a round
    for step, (groups, stats) in enumerate(steps(ex, sampler, 3)):
        assert [record(g) for g in groups] == list(range(4 * step, 4 * step + 4))
        assert all(g.version == step for g in groups) and stats["rollouts_in_flight"] == 0
    assert sampler.calls == [4, 1, 1, 1, 1, 1] * 3  # the round waits for its slowest group


def test_with_max_staleness_a_step_takes_what_finished_and_the_long_tail_samples_on():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1, 1, 1, 1, 1, 1, 1, 3]), max_staleness=1)  # 7, 15, 23: 3 turns
    trained, spanning = [], set()
    for step, (groups, _) in enumerate(steps(ex, sampler, 6)):
        trained += [record(g) for g in groups]
        for g in groups:  # each token carries the version that drew it; the group's is its oldest
            versions = np.concatenate([t.versions for t in g.trajectories])
            assert versions.min() == g.version and versions.max() <= step and step - g.version <= 1
            spanning |= {record(g)} if versions.max() > versions.min() else set()
    assert len(trained) == len(set(trained)) == 24  # each record trained on once
    assert spanning == {7, 15, 23}  # the long-tailed records: their last turns sampled after a push
    assert trained.index(7) < trained.index(8)  # in submission order among the finished


class Scored(Turns):
    """One turn a row, then the run's reward on the group (a Score request)."""

    def group(self, record, n):
        turns = yield [Generate(list(record.ids))] * n
        total, _ = yield Score(record, ["x"] * n)
        return [Transcript(record.ids).trajectory(float(r), "stop") for r in total] if turns else None


def test_a_step_takes_its_scored_groups_before_sending_another_call():
    """The groups a step needs are scored after their call: the step ends there, and the call for the
    round sampled ahead is sent after, to sample while the trainer updates (not waited on first)."""
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1]), Scored(), max_staleness=1)
    ex.driver.reward_fn = lambda prompts, texts, labels, group_size: (np.ones(len(texts), np.float32), {})
    trained = [[record(g) for g in groups] for groups, _ in steps(ex, sampler, 3)]
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # Step 2 took round 2 once it was scored; round 3's call was sent then, and is still in flight.
    assert sampler.calls == [8, 4, 4] and ex.driver.pending is not None


def test_a_call_ahead_of_a_push_that_interrupts_it_asks_for_whole_turns():
    """chunk_tokens bounds the calls a step waits on; a call made ahead of an update on a sampler whose
    pushes interrupt it (vllm_interrupt) asks for whole turns: the push ends it."""

    class Interrupted(CuttingSampler):
        interrupts = True

        def submit(self, prompt_ids, sampling, key):
            return types.SimpleNamespace(result=lambda: self.generate(prompt_ids, sampling, key))

    for ahead, budgets in ((False, (3, 3)), (True, (8, 8))):
        sampler = Interrupted(cut=3)
        driver = Driver(sampler, Turns(tokens=None), 2, SamplingParams(max_new_tokens=8), None, chunk_tokens=3)
        driver.start([Prompt((3, 4), "p", "1")], jax.random.key(0))
        driver.dispatch(ahead=ahead)
        driver.collect()
        assert sampler.calls == [budgets]


def test_max_concurrent_rollouts_caps_the_groups_in_flight():
    free, capped = CountingSampler(), CountingSampler()
    steps(executor(free, Stream(2, turns=[1, 4]), max_staleness=3), free, 5)
    steps(executor(capped, Stream(2, turns=[1, 4]), max_staleness=3, max_concurrent_rollouts=2), capped, 5)
    assert max(free.calls) > 2 and max(capped.calls) <= 3  # a round starts below the cap: at most one over


def test_the_checkpoint_position_brings_back_exactly_the_groups_not_consumed():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1, 2, 5, 1]), max_staleness=2)
    trained = [record(g) for groups, _ in steps(ex, sampler, 3) for g in groups]
    state = ex.get_state()
    position, open_rounds = state["position"], state["consumed"]
    assert open_rounds and len(set(trained)) == len(trained)
    assert set(range(position)) <= set(trained)  # before the position: every record trained on
    resumed = executor(sampler, Stream(4, turns=[1, 2, 5, 1]), max_staleness=2)
    resumed.set_state(state)
    for _ in open_rounds:
        resumed.submit(3, lambda version: None)
    again = sorted(record(run) for run in resumed.driver.runs)
    expected = [position + 4 * j + i for j, done in enumerate(open_rounds) for i in range(4) if i not in done]
    assert again == expected and not set(again) & set(trained)  # none skipped, none twice
    assert set(trained) | set(again) == set(range(position + 4 * len(open_rounds)))
    with pytest.raises(CheckpointError, match="not the rollout executor's"):
        executor(sampler, Stream(4, turns=[1])).set_state(position)  # an earlier unitrain's bare position


def test_an_interrupted_turn_keeps_its_tokens_and_continues_under_the_new_weights():
    """rollout_chunk_tokens: a weight update between two calls of a turn keeps the tokens drawn
    before it bit for bit and draws the rest from the new weights, re-prefilled from the whole
    prefix: each continuation token's logprob is the new model's full forward over that prefix
    (float32, 1e-5), and each token's version says which weights drew it."""
    from flax import nnx

    import helpers
    from helpers import full_logits, log_softmax, scaled, tiny_model
    from unitrain.engines.colocated import ColocatedSampler
    from unitrain.models import decoder

    old, new = tiny_model(), scaled(decoder.create(helpers.ROLLOUT_CFG, 1))  # another seed: other weights
    sampler = ColocatedSampler(old)
    driver = Driver(sampler, Turns(tokens=None), 1, SamplingParams(max_new_tokens=8), None, chunk_tokens=3)
    prompt = (3, 4, 5)
    (run,) = driver.start([Prompt(prompt, "p", "1")], jax.random.key(0))
    driver.dispatch()
    driver.collect()
    before = run.rows[0].context()[len(prompt) :]
    sampler.update_weights(nnx.to_pure_dict(nnx.state(new)), 1)
    while driver.pending is not None or run.request is not None:
        driver.dispatch()
        if driver.pending is not None:
            driver.collect()
    (trajectory,) = run.result
    assert list(trajectory.ids[:3]) == before and len(trajectory.ids) == 8
    assert list(trajectory.versions) == [0] * 3 + [1] * 5
    seq = [*prompt, *(int(t) for t in trajectory.ids)]
    for k, model in enumerate([old] * 3 + [new] * 5):
        at = len(prompt) + k
        expected = log_softmax(full_logits(model, seq[:at])[-1])[seq[at]]
        np.testing.assert_allclose(trajectory.logprobs[k], expected, rtol=1e-5, atol=1e-5)
    stale = log_softmax(full_logits(old, seq[: len(prompt) + 3])[-1])[seq[len(prompt) + 3]]
    assert abs(stale - trajectory.logprobs[3]) > 1e-3  # the old weights would have drawn it otherwise


class CuttingSampler:
    """Samples token 7 + the version; its first call is interrupted after `cut` tokens of each row
    (an engine's abort at a weight update, vllm_interrupt), row 1's before it was sent (none)."""

    def __init__(self, cut: int):
        self.version, self.cut, self.calls = 0, cut, []

    def update_weights(self, params, version):
        self.version = version

    def generate(self, prompt_ids, sampling, key):
        rows, first = len(prompt_ids), not self.calls
        self.calls.append(sampling.row_budgets)
        lengths = np.array([0 if first and r == 1 else self.cut if first else sampling.budget(r) for r in range(rows)])
        width = max(int(lengths.max()), 1)
        mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
        tokens = np.where(mask, 7 + self.version, 0).astype(np.int32)
        interrupted = np.full(rows, first)
        return Completions(
            tokens, mask, -mask.astype(np.float32), lengths.astype(np.int32), self.version, interrupted=interrupted
        )


def test_rows_an_engine_interrupted_go_on_from_their_tokens_in_the_next_call():
    """An engine that interrupts generation (vllm_interrupt) marks the rows a weight update cut short:
    whole turns (no chunk_tokens) then go on in the next call, for the tokens they have left, under
    the new weights; the turn keeps the tokens drawn before, each token tagged with its version."""
    sampler = CuttingSampler(cut=3)
    driver = Driver(sampler, Turns(tokens=None), 2, SamplingParams(max_new_tokens=8), None)
    (run,) = driver.start([Prompt((3, 4), "p", "1")], jax.random.key(0))
    driver.dispatch()
    sampler.update_weights(None, 1)
    while driver.pending is not None:
        driver.collect()
        driver.dispatch()
    assert sampler.calls == [(8, 8), (5, 8)]  # the rest of row 0's budget; all of row 1's
    a, b = run.result
    assert a.ids.tolist() == [7] * 3 + [8] * 5 and a.versions.tolist() == [0] * 3 + [1] * 5
    assert b.ids.tolist() == [8] * 8 and b.versions.tolist() == [1] * 8


def test_a_group_whose_workflow_raises_is_counted_and_consumed_like_a_rejected_one():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1, 2]), Raising({"p1", "p6"}))
    ((groups, stats),) = steps(ex, sampler, 1)
    # Each round of 4 loses a group: a second round fills the step's 4.
    assert [record(g) for g in groups] == [0, 2, 3, 4] and stats["sampling_rounds"] == 2
    assert stats["rollout_workflow_errors"] == 2
    assert ex.get_state() == {"position": 8, "consumed": []}  # both rounds consumed: p1 and p6 never come back


def test_a_steps_worth_of_groups_raising_in_a_row_is_one_line():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[2]), Raising(), max_sampling_rounds=2)
    with pytest.raises(WorkflowError) as e:
        steps(ex, sampler, 1)
    assert str(e.value) == (
        "workflow test_executor:Raising raised on 8 groups in a row, so no group comes out; "
        "the first error: RuntimeError: no verifier for p0"
    )


def test_an_evaluation_leaves_out_and_counts_the_prompts_whose_workflow_raised():
    from helpers import make_cfg
    from unitrain.data.tokenizer import load_tokenizer
    from unitrain.evals import TaskEvaluator

    cfg = make_cfg(mode="grpo", eval_num_samples=4, eval_n_samples=2, eval_pass_k=1)
    records = [{"prompt": f"p{i}", "label": "1"} for i in range(4)]
    evaluator = TaskEvaluator(cfg, load_tokenizer(""), CountingSampler(), None, Raising({"p1"}), records)
    metrics = evaluator(None, 0)
    assert metrics["eval_workflow_errors"] == 2  # p1 in the greedy pass and in the sampled one
    assert [g.prompt.text for g in evaluator.correct(1, SamplingParams(1), jax.random.key(0))[1]] == ["p0", "p2", "p3"]
    with pytest.raises(WorkflowError, match="raised on 4 groups in a row"):
        TaskEvaluator(cfg, load_tokenizer(""), CountingSampler(), None, Raising(), records)(None, 0)


class Rejecting(Turns):
    """Leaves out every record (as a multi-turn episode whose first prompt is too long)."""

    def episode(self, record):
        yield from ()
        return None


def test_a_step_whose_rounds_give_too_few_groups_says_so_not_that_the_prompts_ran_out():
    sampler = CountingSampler()
    ex = executor(sampler, Stream(4, turns=[1]), Rejecting(), max_sampling_rounds=2)
    with pytest.raises(RunEndedEarly, match="^2 sampling rounds .max_sampling_rounds. gave 0 of the 4 groups"):
        steps(ex, sampler, 1)


def test_an_evaluation_whose_prompts_are_all_left_out_is_one_line():
    from helpers import make_cfg
    from unitrain.data.tokenizer import load_tokenizer
    from unitrain.errors import DataError
    from unitrain.evals import TaskEvaluator

    cfg = make_cfg(mode="grpo", eval_num_samples=4, eval_n_samples=0)
    records = [{"prompt": f"p{i}", "label": "1"} for i in range(4)]
    with pytest.raises(DataError, match="^the evaluation has no answer to score: workflow .*Rejecting left out all 4"):
        TaskEvaluator(cfg, load_tokenizer(""), CountingSampler(), None, Rejecting(), records)(None, 0)
