"""mode=grpo: rollout rows, dynamic sampling, first-iteration gradient, pass@k, resume, GSM8K path."""

import json
import math
from itertools import combinations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unitrain import evals, losses, run, tasks, train
from unitrain.rollout.groups import Group, nonzero_std, select_groups
from unitrain.tasks import grpo
from unitrain.config import ConfigError, load_config

from conftest import REPO, sigterm_after_step

FAST = ["mode=grpo", "per_device_batch_size=2", "rollout_batch_size=4", "n_samples_per_prompt=4",
        "rollout_max_response_len=6", "eval_interval=0", "log_period=1", "builtin_task_digits=1",
        "max_prompt_length=16", "learning_rate=1e-3", "warmup_steps=0"]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def config(tmp_path, *overrides):
    return load_config([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides])


def make_step(cfg):
    built, state = run.build_run(cfg)
    task = tasks.create(built)
    task.sampler.update_weights(state["params"], 0)
    return task, built.graphdef, state["params"], built.mesh


def test_rollout_rows_put_the_loss_on_completion_tokens(tmp_path):
    cfg = config(tmp_path)
    step, graphdef, params, mesh = make_step(cfg)
    groups, stats = step.sample_groups(0)
    assert len(groups) == 4 and stats["sampling_rounds"] == 1
    rows = step.to_rows(groups)
    r = 0
    for g in groups:
        prompt = list(g.prompt.ids)
        c = g.completions
        for tokens, length, logprobs in zip(c.tokens, c.lengths, c.logprobs):
            seq = prompt + list(tokens[:length])
            mask = rows["loss_mask"][r].astype(bool)
            assert list(rows["inputs"][r, :len(seq)]) == seq and rows["inputs_segmentation"][r, len(seq):].sum() == 0
            assert list(rows["targets"][r][mask]) == list(tokens[:length])  # exactly the sampled tokens
            np.testing.assert_array_equal(rows["sampler_logprobs"][r][mask], logprobs[:length])
            r += 1
    # The trainer's recomputed logprobs equal the sampler's (same params, no top-k/top-p).
    batch = {k: v for k, v in rows.items() if k != "sampler_logprobs"}
    old = step.logprobs(step.logprob_fn, params, batch)
    np.testing.assert_allclose(old[rows["loss_mask"] > 0], rows["sampler_logprobs"][rows["loss_mask"] > 0], atol=2e-4)


def test_select_groups_drops_exactly_the_zero_std_groups():
    rewards_ = ([1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [1, 0, 0], [2, 3, 2])
    sampled = [Group(prompt=i, completions=None, texts=[], rewards=np.asarray(r, np.float32), per_reward={})
               for i, r in enumerate(rewards_)]
    kept = [g for g in sampled if nonzero_std(g)]
    dropped = [g for g in sampled if not nonzero_std(g)]
    assert [g.prompt for g in kept] == [1, 4, 5] and [g.prompt for g in dropped] == [0, 2, 3]
    groups, discarded, refilled = select_groups(kept, dropped, 3)
    assert [g.prompt for g in groups] == [1, 4, 5] and (discarded, refilled) == (3, 0)
    groups, discarded, refilled = select_groups(kept, dropped, 4)  # rounds ran out: top up
    assert [g.prompt for g in groups] == [1, 4, 5, 0] and (discarded, refilled) == (2, 1)
    with pytest.raises(ConfigError):
        select_groups(kept, dropped, 7)


def test_dynamic_sampling_in_a_real_rollout(tmp_path, monkeypatch):
    # Reward 1 for odd answers' first completion character being a digit, else 0: many groups agree.
    plugin = tmp_path / "parity_reward.py"
    plugin.write_text("def score(prompt, completion, label):\n    return float(len(completion) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config(tmp_path, "reward=parity_reward:score", "dynamic_sampling_filter=nonzero_std",
                 "over_sampling_batch_size=8", "max_sampling_rounds=3", "rollout_temperature=2.0")
    step, graphdef, params, mesh = make_step(cfg)
    groups, stats = step.sample_groups(0)
    kept = [g for g in groups if np.std(g.rewards) > 0]
    assert len(groups) == 4
    assert stats["groups_refilled"] == 4 - len(kept)
    total = stats["sampling_rounds"] * 8
    assert stats["groups_discarded"] + stats["groups_refilled"] + len(kept) <= total


def test_first_iteration_ratio_is_one_and_gradient_is_plain_policy_gradient(tmp_path):
    cfg = config(tmp_path, "rollout_temperature=1.0", "loss_agg_mode=token-mean")
    step, graphdef, params, mesh = make_step(cfg)
    groups, _ = step.sample_groups(0)
    rows = step.to_rows(groups)
    batch = {k: v for k, v in rows.items() if k != "sampler_logprobs"}
    batch["old_logprobs"] = step.logprobs(step.logprob_fn, params, batch)
    rewards_ = np.concatenate([g.rewards for g in groups]) + np.arange(16) * 0.1  # nonzero advantages
    group_ids = np.repeat(np.arange(4), 4)
    batch["advantages"] = np.asarray(losses.compute_advantages(rewards_, group_ids, 4, "grpo"))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    (loss, (denom, m)), grads = jax.value_and_grad(step.loss, has_aux=True)(
        params, batch)
    assert float(m["ratio"][0] / m["ratio"][1]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["pg_clipfrac"][0]) == 0.0

    def plain_pg(p):
        logp = grpo.token_logprobs(graphdef, 1.0, p, batch)
        mask = batch["loss_mask"].astype(jnp.float32)
        return -(batch["advantages"][:, None] * logp * mask).sum()

    expected = jax.grad(plain_pg)(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(g) / float(denom), np.asarray(e) / float(denom), atol=1e-6, rtol=1e-4)


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (8, 0, 4), (8, 8, 2), (6, 3, 6)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(combinations(outcomes, k))
        assert evals.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_resume_in_the_middle_of_grpo_continues_identically(tmp_path, monkeypatch):
    straight = config(tmp_path, "run_name=straight", "steps=4", "kl_coef=0.01")
    assert train.train(straight) == 0
    interrupted = config(tmp_path, "run_name=interrupted", "steps=4", "kl_coef=0.01")
    with sigterm_after_step(monkeypatch, 0):
        assert train.train(interrupted) == train.EXIT_SIGTERM
    assert train.train(interrupted) == 0

    def curve(cfg):
        lines = [json.loads(l) for l in open(cfg.metrics_file)]
        return [(l["step"], l["loss"], l["reward_mean"], l["kl"]) for l in lines if "loss" in l]

    a, b = curve(straight), curve(interrupted)
    assert [s for s, *_ in a] == [s for s, *_ in b] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_grpo_with_a_tiny_qwen2_model(tmp_path, tiny_checkpoint, capsys):
    ckpt = tiny_checkpoint("qwen2")
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, "steps=2",
            "model_family=qwen2", "qkv_bias=true", "tie_word_embeddings=true", "rms_norm_eps=1e-6",
            f"load_parameters_path={ckpt}", f"tokenizer_path={ckpt}", f"dataset_path={GSM8K}",
            "prompt_key=question", "label_key=answer", "chat_template=true", "max_prompt_length=512",
            "reward=gsm8k,format", "reward_weights=[1.0, 0.1]", "rollout_max_response_len=16",
            "eval_interval=2", f"eval_dataset_path={GSM8K.parent / 'test.jsonl'}", "eval_num_samples=4",
            "eval_n_samples=2", "eval_pass_k=2"]
    assert train.main(argv) == 0
    lines = [json.loads(l) for l in open(tmp_path / "default" / "metrics.jsonl")]
    steps = [l for l in lines if "loss" in l]
    assert len(steps) == 2 and all(math.isfinite(l["reward_mean"]) for l in steps)
    assert {"reward_gsm8k_mean", "reward_format_mean", "pg_clipfrac", "entropy", "response_length_mean",
            "sampler_trainer_logprob_gap", "time_rollout", "rollout_tokens_per_sec"} <= set(steps[0])
    assert steps[0]["sampler_trainer_logprob_gap"] < 1e-3
    evals = [l for l in lines if "eval_accuracy" in l]
    assert len(evals) == 1 and "eval_pass_at_2" in evals[0]


@pytest.mark.parametrize("in_reward", [False, True])
def test_kl_as_loss_term_or_in_reward_with_an_offloaded_reference(tmp_path, in_reward):
    cfg = config(tmp_path, "steps=1", "kl_coef=0.1", f"use_kl_in_reward={str(in_reward).lower()}",
                 "ref_params_host_offload=true")
    assert train.train(cfg) == 0
    (line,) = [json.loads(l) for l in open(cfg.metrics_file) if '"loss"' in l]
    assert math.isfinite(line["loss"])
    assert ("kl" in line) == (not in_reward)  # in the reward, the loss carries no KL term
