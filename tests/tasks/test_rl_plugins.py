"""The RL seams taken by plugins outside the package, end to end: a fourth rollout shape (a verifier
that re-prompts after a wrong answer, tests/plugin_verifier.py), workflows that raise
(tests/plugin_flaky.py), an advantage estimator (tests/plugin_estimator.py) and a model source
serving as PPO's policy and critic (tests/plugin_model_source.py)."""

import json

import jax
import numpy as np

from helpers import GRPO_FAST, REPO, make_cfg
from unitrain import train
from unitrain.data.prompt_ids import Prompt
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines.base import Completions, SamplingParams
from unitrain.rollout.driver import run_groups

FAST = [*GRPO_FAST, "steps=2"]
TOK = load_tokenizer("")


def train_lines(tmp_path, *overrides) -> list[dict]:
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides]) == 0
    return [json.loads(line) for line in open(tmp_path / "default" / "metrics.jsonl")]


class AnswerSampler:
    """Answers row i of every call with `answers[call][i]` + EOS; counts the calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, prompt_ids, sampling, key):
        rows = [TOK.encode(a) + [TOK.eos_id] for a in self.answers[len(self.calls)]]
        self.calls.append(prompt_ids)
        n = sampling.max_new_tokens
        tokens = np.zeros((len(rows), n), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        lengths = np.asarray([len(r) for r in rows], np.int32)
        mask = (np.arange(n)[None] < lengths[:, None]).astype(np.int32)
        return Completions(tokens, mask, -0.5 * mask.astype(np.float32), lengths, 7)


def test_the_verifier_reprompts_a_wrong_answer_and_learns_on_both_answers():
    from plugin_verifier import FEEDBACK, Verifier
    from unitrain import rewards

    cfg = make_cfg(mode="grpo", workflow="plugin_verifier:Verifier", max_turns=2, rollout_max_response_len=6)
    run = type("Run", (), {"cfg": cfg, "tokenizer": TOK})()
    sampler = AnswerSampler([["5", "4"], ["5"]])  # row 1 wrong, then right
    record = Prompt(tuple(TOK.encode("2+3=")), "2+3=", "5")
    (group,) = run_groups(
        sampler,
        Verifier(run),
        [record],
        2,
        SamplingParams(6, stop_token_ids=(TOK.eos_id,)),
        jax.random.key(0),
        rewards.make_reward_fn(cfg),
    )
    assert [len(c) for c in sampler.calls] == [2, 1]  # the second call re-prompts the wrong row only
    right, retried = group.trajectories
    assert group.rewards.tolist() == [1.0, 1.0] and (right.turns, retried.turns) == (1, 2)
    feedback = TOK.encode(FEEDBACK)
    four, five = TOK.encode("4") + [TOK.eos_id], TOK.encode("5") + [TOK.eos_id]
    assert retried.ids.tolist() == four + feedback + five
    assert retried.loss_mask.tolist() == [1] * len(four) + [0] * len(feedback) + [1] * len(five)
    assert sampler.calls[1][0] == [*record.ids, *four, *feedback]  # the wrong answer and the feedback are its context


def test_a_plugin_workflow_trains_end_to_end(tmp_path):
    lines = train_lines(tmp_path, "workflow=plugin_verifier:Verifier", "max_turns=2")
    assert len(lines) == 2 and all(np.isfinite(line["loss"]) for line in lines)
    # The untrained model never answers right: every trajectory is two answers and the feedback.
    assert all(line["response_length_mean"] > 6 for line in lines)
    assert "wrong, try again" in (tmp_path / "default" / "samples.txt").read_text()


def test_a_workflow_that_raises_on_some_groups_is_counted_and_the_run_goes_on(tmp_path, capsys):
    lines = train_lines(tmp_path, "workflow=plugin_flaky:Flaky")
    assert len(lines) == 2 and all(np.isfinite(line["loss"]) for line in lines)
    # Rounds of 4 records whose second group raises: 3 groups a round, so two rounds a step.
    assert [(line["rollout_workflow_errors"], line["sampling_rounds"]) for line in lines] == [(2, 2), (2, 2)]
    warnings = [l for l in capsys.readouterr().out.splitlines() if "its group left out" in l]
    assert len(warnings) == 4
    assert all(
        "workflow plugin_flaky:Flaky raised on prompt " in l and "RuntimeError: the verifier" in l for l in warnings
    )


def test_a_workflow_that_always_raises_stops_with_one_line(tmp_path, capsys):
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *FAST,
        "workflow=plugin_flaky:Broken",
    ]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (  # a step's worth: 4 rounds (max_sampling_rounds) of 4 records
        "unitrain: workflow plugin_flaky:Broken raised on 16 groups in a row, so no group comes out; the first "
        "error: ConnectionError: the verifier at localhost:9 refused the connection"
    )


def test_a_plugin_advantage_estimator_trains_end_to_end(tmp_path):
    import plugin_estimator

    plugin_estimator.SEEN.clear()
    lines = train_lines(
        tmp_path,
        "advantage_estimator=plugin_estimator:rank_advantages",
        "reward=format",
        "format_reward_pattern=[13579]",
    )
    assert len(plugin_estimator.SEEN) == 2
    for line, (rewards, group_ids, advantages) in zip(lines, plugin_estimator.SEEN):
        for g in np.unique(group_ids):  # ranks in NumPy: 1 + the rewards below, ties averaged
            r = rewards[group_ids == g]
            ranks = np.array([1 + (r < x).sum() + ((r == x).sum() - 1) / 2 for x in r])
            np.testing.assert_allclose(advantages[group_ids == g], (ranks - 2.5) / 1.5)
        assert line["rank/positive_fraction"] == np.mean(advantages > 0)


def test_a_plugin_model_source_serves_as_the_policy_and_the_critic(tmp_path):
    import plugin_model_source

    plugin_model_source.BUILT.clear()
    lines = train_lines(tmp_path, "mode=ppo", "model_source=plugin_model_source:source", "model_name=tiny")
    assert plugin_model_source.BUILT == [True, False]  # the policy, then the critic's headless backbone
    assert len(lines) == 2 and all(np.isfinite(line["critic/value_loss"]) for line in lines)
    assert lines[1]["critic/value_loss"] != lines[0]["critic/value_loss"]  # the critic trains
