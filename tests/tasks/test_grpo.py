"""mode=grpo: rollout rows, dynamic sampling, first-iteration gradient, pass@k, resume, GSM8K path."""

import json
import logging
import math
from itertools import combinations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import GRPO_FAST, GSM8K, REPO, first_groups, grpo_config, make_step, sigterm_after_step
from unitrain import evals, lora, losses, modes, run, train
from unitrain.errors import RunEndedEarly
from unitrain.rollout.groups import Group, nonzero_std, select_groups
from unitrain.tasks import rl as grpo


def test_rollout_rows_put_the_loss_on_completion_tokens(tmp_path):
    cfg = grpo_config(tmp_path)
    step, graphdef, params, mesh = make_step(cfg)
    groups, stats = first_groups(step, params)
    assert len(groups) == 4 and stats["sampling_rounds"] == 1
    rows = step.to_rows(groups)
    P = rows["inputs"].shape[1] - rows["targets"].shape[1]  # the prompts end at column P
    r = 0
    for g in groups:
        prompt = list(g.prompt.ids)
        for t in g.trajectories:
            tokens, length, logprobs = t.ids, len(t.ids), t.logprobs
            seq = prompt + list(tokens[:length])
            mask = rows["loss_mask"][r].astype(bool)
            real = rows["inputs_segmentation"][r] > 0
            assert list(rows["inputs"][r][real]) == seq and list(rows["inputs_position"][r][real]) == list(
                range(len(seq))
            )
            assert list(rows["inputs"][r, P - len(prompt) : P]) == prompt
            assert list(rows["targets"][r][mask]) == list(tokens[:length])  # exactly the sampled tokens
            np.testing.assert_array_equal(rows["sampler_logprobs"][r][mask], logprobs[:length])
            r += 1
    # The trainer's recomputed logprobs equal the sampler's (same params, no top-k/top-p).
    old = np.asarray(jax.jit(step.stats)(params, rows).logprobs)
    np.testing.assert_allclose(old[rows["loss_mask"] > 0], rows["sampler_logprobs"][rows["loss_mask"] > 0], atol=2e-4)


def test_select_groups_drops_exactly_the_zero_std_groups():
    rewards_ = ([1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.5], [1, 0, 0], [2, 3, 2])
    sampled = [
        Group(prompt=i, trajectories=(), rewards=np.asarray(r, np.float32), per_reward={})
        for i, r in enumerate(rewards_)
    ]
    kept = [g for g in sampled if nonzero_std(g)]
    dropped = [g for g in sampled if not nonzero_std(g)]
    assert [g.prompt for g in kept] == [1, 4, 5] and [g.prompt for g in dropped] == [0, 2, 3]
    groups, discarded, refilled = select_groups(kept, dropped, 3)
    assert [g.prompt for g in groups] == [1, 4, 5] and (discarded, refilled) == (3, 0)
    groups, discarded, refilled = select_groups(kept, dropped, 4)  # rounds ran out: top up
    assert [g.prompt for g in groups] == [1, 4, 5, 0] and (discarded, refilled) == (2, 1)
    with pytest.raises(RunEndedEarly):
        select_groups(kept, dropped, 7)


def test_dynamic_sampling_in_a_real_rollout(tmp_path, monkeypatch):
    # Reward 1 for odd answers' first completion character being a digit, else 0: many groups agree.
    plugin = tmp_path / "parity_reward.py"
    plugin.write_text("def score(prompt, completion, label):\n    return float(len(completion) % 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = grpo_config(
        tmp_path,
        "reward=parity_reward:score",
        "dynamic_sampling_filter=nonzero_std",
        "over_sampling_batch_size=8",
        "max_sampling_rounds=3",
        "rollout_temperature=2.0",
    )
    step, graphdef, params, mesh = make_step(cfg)
    groups, stats = first_groups(step, params)
    kept = [g for g in groups if np.std(g.rewards) > 0]
    assert len(groups) == 4
    assert stats["groups_refilled"] == 4 - len(kept)
    total = stats["sampling_rounds"] * 8
    assert stats["groups_discarded"] + stats["groups_refilled"] + len(kept) <= total


def test_the_samplers_decode_weights_are_released_before_an_update_and_after_an_eval(tmp_path, monkeypatch):
    """The sampler keeps a decode copy of the weights for a version's calls (engines/colocated.py):
    the greedy and the sampled evaluation share one, and neither the update nor what follows an
    evaluation holds one."""
    built, state = run.build_run(
        grpo_config(tmp_path, "eval_interval=1", "eval_num_samples=4", "eval_n_samples=2", "eval_pass_k=2")
    )
    task = modes.create(built)
    update, seen = task.update, []
    monkeypatch.setattr(
        task, "update", lambda state, batch, step: (seen.append(task.sampler.decode), update(state, batch, step))[1]
    )
    made = []
    decode_weights = task.sampler.decode_weights
    monkeypatch.setattr(
        task.sampler, "decode_weights", lambda: made.append(task.sampler.decode is None) or decode_weights()
    )
    state, _ = task.step(state, 0)
    assert made == [True] and seen == [None]
    made.clear()
    assert "eval_accuracy" in task.evaluate(state["params"], 1)
    assert made == [True, False] and task.sampler.decode is None


def test_first_iteration_ratio_is_one_and_gradient_is_plain_policy_gradient(tmp_path):
    # Two iterations: the old logprobs come from their own forward pass.
    cfg = grpo_config(tmp_path, "rollout_temperature=1.0", "loss_agg_mode=token-mean", "num_iterations=2")
    step, graphdef, params, mesh = make_step(cfg)
    assert step.separate_old
    groups, _ = first_groups(step, params)
    batch = step.to_rows(groups)
    batch.update(step.logprobs(params, batch))
    rewards_ = np.concatenate([g.rewards for g in groups]) + np.arange(16) * 0.1  # nonzero advantages
    group_ids = np.repeat(np.arange(4), 4)
    batch["advantages"] = np.asarray(losses.compute_advantages(rewards_, group_ids, 4, "grpo"))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    (loss, (denom, m)), grads = jax.value_and_grad(step.loss, has_aux=True)(params, batch)
    assert float(m["ratio"][0] / m["ratio"][1]) == pytest.approx(1.0, abs=1e-6)
    assert float(m["pg_clipfrac"][0]) == 0.0

    def plain_pg(p):
        logp = step.stats(p, batch).logprobs
        mask = batch["loss_mask"].astype(jnp.float32)
        return -(batch["advantages"][:, None] * logp * mask).sum()

    expected = jax.grad(plain_pg)(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(g) / float(denom), np.asarray(e) / float(denom), atol=1e-6, rtol=1e-4)


def test_skipping_the_old_logprob_pass_leaves_the_update_unchanged(tmp_path):
    """One update per step: the loss's own logprobs under stop_gradient stand in for the old pass and
    the parameters after the update equal those of an update fed the old pass's logprobs. With several
    iterations, several mini-batches or KL in the reward, the old pass runs and the loss reads it."""
    # adam_eps >> |gradient|: the first update is about learning_rate * gradient, so it shows any
    # difference in the gradient instead of Adam's sign.
    overrides = ("rollout_temperature=1.0", "lr_schedule=constant", "kl_coef=0.1", "adam_eps=1.0", "learning_rate=1.0")
    skip, _, params, _ = make_step(grpo_config(tmp_path, *overrides))
    assert not skip.separate_old and "old_logprobs" not in skip.batch_shardings()
    separate, _, _, _ = make_step(grpo_config(tmp_path, *overrides, "num_iterations=2"))
    groups, _ = first_groups(skip, params)
    rows = skip.to_rows(groups)
    rows["advantages"] = np.linspace(-1, 1, 16).astype(np.float32)
    fed = {**rows, **separate.logprobs(params, rows)}
    assert set(fed) - set(rows) == {"old_logprobs", "ref_logprobs"}
    state = lambda: {
        "params": jax.tree.map(jnp.copy, params),
        "opt_state": skip.run.optimizer.init(params),
        "step": jnp.int32(0),
    }
    skipped, m_skip = skip.update(state(), {**rows, "ref_logprobs": fed["ref_logprobs"]}, 0)
    full, m_full = separate.update_fn(state(), fed)
    for a, b, p in zip(*(jax.tree.leaves(x) for x in (skipped["params"], full["params"], params))):
        a, b, p = (np.asarray(x) for x in (a, b, p))
        np.testing.assert_allclose(a - p, b - p, atol=1e-4 * np.abs(b - p).max(), rtol=1e-4)
    assert m_skip["ratio"] == 1.0 and float(m_full["loss"]) == pytest.approx(m_skip["loss"], abs=1e-5)
    # Where the old policy differs from the updated one, the loss reads the old pass.
    shifted = {**fed, "old_logprobs": fed["old_logprobs"] - 0.1}
    _, m_shifted = separate.update_fn(state(), shifted)
    assert float(m_shifted["ratio"]) > 1.05
    for extra in ("num_iterations=2", "per_device_batch_size=1", "use_kl_in_reward=true"):
        task, _, _, _ = make_step(grpo_config(tmp_path, *overrides, extra))
        assert task.separate_old and "old_logprobs" in task.batch_shardings(), extra


@pytest.mark.parametrize("rank", [0, 4])
def test_a_groups_prompt_is_computed_once_leaving_logprobs_and_update_unchanged(tmp_path, rank, caplog):
    """Each group's prompt columns are computed once per pass: 4 rows a group in the logprob pass,
    2 in each of the 2 micro-batches of the update (rows j, j+2, ...), each of the 8 devices holding
    whole groups; the logprobs and the parameters after one update (LoRA: the adapters') equal those
    of the passes over every row's own prompt."""
    caplog.set_level(logging.INFO, logger="unitrain")
    overrides = (
        "rollout_batch_size=8",
        "gradient_accumulation_steps=2",
        "rollout_temperature=1.0",
        "lr_schedule=constant",
        "kl_coef=0.1",
        "adam_eps=1.0",
        "learning_rate=1.0",
        f"lora_rank={rank}",
    )
    shared, graphdef, params, _ = make_step(grpo_config(tmp_path, *overrides))
    plain, _, _, _ = make_step(grpo_config(tmp_path, *overrides))
    assert shared.group_rows == {"logprobs": 4, "update": 2}
    assert "prompt computed once per 4 rows in the logprob pass and per 2 in the update" in caplog.text
    plain.group_rows = {"logprobs": 1, "update": 1}  # read when the update is first traced
    rows = shared.to_rows(first_groups(shared, params)[0])
    assert (rows["inputs"][0::4, :16] == rows["inputs"][3::4, :16]).all()  # the prompt columns of a group
    stats = lambda group_rows: grpo.token_stats(graphdef, 1.0, 0, params, rows, True, group_rows)
    for got, want in zip(stats(4), stats(1)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rows.update(shared.logprobs(params, rows), advantages=np.linspace(-1, 1, 32).astype(np.float32))
    state = lambda: {
        "params": jax.tree.map(jnp.copy, params),
        "opt_state": shared.run.optimizer.init(lora.trainable(params, rank > 0)),
        "step": jnp.int32(0),
    }
    (a_state, a), (b_state, b) = shared.update(state(), rows, 0), plain.update(state(), rows, 0)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for x, y, p in zip(*(jax.tree.leaves(s["params"]) for s in (a_state, b_state, {"params": params}))):
        x, y, p = (np.asarray(v) for v in (x, y, p))
        np.testing.assert_allclose(x - p, y - p, atol=1e-4 * np.abs(y - p).max(), rtol=1e-4)
    uneven, _, _, _ = make_step(
        grpo_config(
            tmp_path,
            "per_device_batch_size=1",
            "n_samples_per_prompt=2",
            "rollout_batch_size=16",
            "gradient_accumulation_steps=4",
        )
    )
    assert uneven.group_rows == {"logprobs": 2, "update": 1}  # 4 micro-batches split a group of 2
    spread, _, _, _ = make_step(grpo_config(tmp_path))
    assert spread.group_rows == {"logprobs": 1, "update": 1}  # 16 rows: 2 a device, half a group


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (8, 0, 4), (8, 8, 2), (6, 3, 6)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(combinations(outcomes, k))
        assert evals.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_resume_in_the_middle_of_grpo_continues_identically(tmp_path, monkeypatch):
    straight = grpo_config(tmp_path, "run_name=straight", "steps=4", "kl_coef=0.01")
    assert train.train(straight) == 0
    interrupted = grpo_config(tmp_path, "run_name=interrupted", "steps=4", "kl_coef=0.01")
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
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *GRPO_FAST,
        "steps=2",
        "model_family=qwen2",
        "qkv_bias=true",
        "tie_word_embeddings=true",
        "rms_norm_eps=1e-6",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={GSM8K}",
        "prompt_key=question",
        "label_key=answer",
        "chat_template=true",
        "max_prompt_length=512",
        "reward=gsm8k,format",
        "reward_weights=[1.0, 0.1]",
        "rollout_max_response_len=16",
        "eval_interval=2",
        f"eval_dataset_path={GSM8K.parent / 'test.jsonl'}",
        "eval_num_samples=4",
        "eval_n_samples=2",
        "eval_pass_k=2",
    ]
    assert train.main(argv) == 0
    lines = [json.loads(l) for l in open(tmp_path / "default" / "metrics.jsonl")]
    steps = [l for l in lines if "loss" in l]
    assert len(steps) == 2 and all(math.isfinite(l["reward_mean"]) for l in steps)
    assert {
        "reward_gsm8k_mean",
        "reward_format_mean",
        "pg_clipfrac",
        "entropy",
        "response_length_mean",
        "sampler_trainer_logprob_gap",
        "time_rollout",
        "rollout_tokens_per_sec",
    } <= set(steps[0])
    assert steps[0]["sampler_trainer_logprob_gap"] < 1e-3
    evals = [l for l in lines if "eval_accuracy" in l]
    assert len(evals) == 1 and "eval_pass_at_2" in evals[0]


def test_int8_rollouts_train_with_rollout_is_and_log_the_logprob_gap(tmp_path):
    """rollout_quantization=int8: the sampler samples (and records the logprobs of) its int8 copy of
    the weights, the trainer its full-precision ones; rollout_is weighs the gap, which the step logs.
    Measured: a gap of 1.6e-3 a token against 1.5e-7 at full precision (the same run, none)."""
    cfg = grpo_config(tmp_path, "steps=2", "rollout_quantization=int8", "rollout_is=true")
    assert train.train(cfg) == 0
    steps = [json.loads(l) for l in open(cfg.metrics_file) if '"loss"' in l]
    assert len(steps) == 2 and all(math.isfinite(l["loss"]) for l in steps)
    for line in steps:
        assert 1e-4 < line["sampler_trainer_logprob_gap"] < 1e-2
        assert line["rollout_is_mean"] != 1.0 and 0.9 < line["rollout_is_mean"] < 1.1


@pytest.mark.parametrize("in_reward", [False, True])
def test_kl_as_loss_term_or_in_reward_with_an_offloaded_reference(tmp_path, in_reward):
    cfg = grpo_config(
        tmp_path, "steps=1", "kl_coef=0.1", f"use_kl_in_reward={str(in_reward).lower()}", "ref_params_host_offload=true"
    )
    assert train.train(cfg) == 0
    (line,) = [json.loads(l) for l in open(cfg.metrics_file) if '"loss"' in l]
    assert math.isfinite(line["loss"])
    assert ("kl" in line) == (not in_reward)  # in the reward, the loss carries no KL term
