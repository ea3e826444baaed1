"""mode=ppo: GAE over the sampled tokens, the clipped value loss, and PPO runs with a critic."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from helpers import PPO_FAST as FAST
from helpers import REPO, sigterm_after_step
from unitrain import losses, modes, run, train
from unitrain.checks import load_checked

GAMMA, LAM = 0.97, 0.9


def random_batch(seed, rows=6, columns=12, interior_gaps=True):
    """Rewards [rows], values [rows, columns] (junk off the mask) and a mask of sampled tokens: each row's
    tokens from column 0 up to a random length, with (interior_gaps) spans of environment tokens inside."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, columns), np.int32)
    for r in range(rows):
        length = rng.integers(1, columns + 1) if r else columns  # row 0 fills every column
        mask[r, :length] = 1
        if interior_gaps and length > 4:
            start = rng.integers(1, length - 2)
            mask[r, start : start + rng.integers(1, length - start - 1)] = 0
    mask[-1] = 0  # a row with no sampled token (padding)
    values = rng.normal(size=(rows, columns)).astype(np.float32)
    rewards = rng.normal(size=rows).astype(np.float32)
    kl = np.abs(rng.normal(size=(rows, columns))).astype(np.float32)
    return rewards, values, mask, kl


def np_token_rewards(rewards, mask, kl=None, kl_coef=0.0):
    out = np.zeros(mask.shape, np.float64)
    for r in range(len(mask)):
        sampled = np.flatnonzero(mask[r])
        if len(sampled):
            out[r, sampled[-1]] = rewards[r]
        if kl is not None:
            out[r, sampled] -= kl_coef * kl[r, sampled]
    return out


def np_gae(token_rewards, values, mask, gamma, lam):
    """The recursion written out: over each row's sampled tokens only, last to first."""
    adv = np.zeros(mask.shape, np.float64)
    for r in range(len(mask)):
        next_value = next_adv = 0.0
        for t in reversed(np.flatnonzero(mask[r])):
            delta = token_rewards[r, t] + gamma * next_value - values[r, t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[r, t]
            adv[r, t] = next_adv
    return adv, (adv + values) * mask


def verl_gae_carry(token_rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return as of its multi-turn support (values and TD error carried
    through columns of mask 0), in NumPy; its advantages before masked_whiten."""
    rows, columns = mask.shape
    next_values, last = np.zeros(rows), np.zeros(rows)
    reversed_adv = []
    for t in reversed(range(columns)):
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        reversed_adv.append(last)
    adv = np.stack(reversed_adv[::-1], axis=1)
    return adv, adv + values


def verl_gae_columns(token_rewards, values, gamma, lam):
    """verl's earlier compute_gae_advantage_return: every column a step, V(t+1) the next column's."""
    columns = values.shape[1]
    last, reversed_adv = 0.0, []
    for t in reversed(range(columns)):
        next_values = values[:, t + 1] if t < columns - 1 else 0.0
        delta = token_rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    adv = np.stack(reversed_adv[::-1], axis=1)
    return adv, adv + values


def np_whiten(x, mask):
    """verl's masked_whiten: unbiased masked variance, the mean not added back."""
    sel = x[mask > 0]
    return (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)


@pytest.mark.parametrize("seed", range(4))
def test_token_rewards_put_the_reward_on_the_last_sampled_token(seed):
    rewards, _, mask, kl = random_batch(seed)
    got = np.asarray(losses.token_rewards(rewards, mask, kl, kl_coef=0.05))
    np.testing.assert_allclose(got, np_token_rewards(rewards, mask, kl, 0.05), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(losses.token_rewards(rewards, mask)), np_token_rewards(rewards, mask))


@pytest.mark.parametrize("seed", range(4))
def test_gae_skips_unsampled_tokens_as_the_plain_loop(seed):
    rewards, values, mask, kl = random_batch(seed)
    per_token = np_token_rewards(rewards, mask, kl, 0.1)
    adv, ret = (np.asarray(x) for x in losses.gae(per_token, values, mask, GAMMA, LAM))
    want_adv, want_ret = np_gae(per_token, values, mask, GAMMA, LAM)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
    assert not adv[mask == 0].any() and not ret[mask == 0].any()
    # verl's carry through mask-0 columns agrees on the sampled tokens (the rewards are 0 off them).
    verl_adv, verl_ret = verl_gae_carry(per_token, values, mask, GAMMA, LAM)
    on = mask > 0
    np.testing.assert_allclose(adv[on], verl_adv[on], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[on], verl_ret[on], rtol=1e-5, atol=1e-5)
    whitened = np.asarray(losses.masked_whiten(adv, mask))
    np.testing.assert_allclose(whitened[on], np_whiten(verl_adv, mask)[on], rtol=1e-4, atol=1e-5)


def test_gae_equals_verls_column_recursion_on_rows_without_gaps():
    rewards, values, mask, _ = random_batch(7, rows=8, interior_gaps=False)
    values = values * mask  # verl's critic values are masked after the response
    per_token = np_token_rewards(rewards, mask)
    adv, ret = (np.asarray(x) for x in losses.gae(per_token, values, mask, 1.0, 0.95))
    verl_adv, verl_ret = verl_gae_columns(per_token, values, 1.0, 0.95)
    on = mask > 0
    np.testing.assert_allclose(adv[on], verl_adv[on], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[on], verl_ret[on], rtol=1e-5, atol=1e-5)
    # gamma = lambda = 1 and values 0: every sampled token's advantage is the row's reward (Monte Carlo).
    mc, _ = losses.gae(per_token, np.zeros_like(values), mask, 1.0, 1.0)
    np.testing.assert_allclose(np.asarray(mc), rewards[:, None] * mask, rtol=1e-6)


def np_value_loss(values, old, returns, mask, clip, mode, horizon):
    rows = []
    for r in range(len(mask)):
        per_token = []
        for t in np.flatnonzero(mask[r]):
            v = values[r, t]
            v_clip = v if clip is None else min(max(v, old[r, t] - clip), old[r, t] + clip)
            per_token.append((0.5 * max((v - returns[r, t]) ** 2, (v_clip - returns[r, t]) ** 2), v_clip))
        rows.append(per_token)
    tokens = [loss for row in rows for loss, _ in row]
    if mode == "token-mean":
        loss = np.mean(tokens)
    elif mode == "seq-mean-token-mean":
        loss = np.mean([np.mean([x for x, _ in row]) for row in rows if row])
    elif mode == "seq-mean-token-sum":
        loss = np.mean([np.sum([x for x, _ in row]) for row in rows if row])
    else:
        loss = np.mean([np.sum([x for x, _ in row]) / horizon for row in rows if row])
    return loss


def verl_vf_clipfrac(values, old, returns, clip):
    """verl's compute_value_loss (and TRL's) per token in float32: v clamped into [old - c, old + c], clipped where
    that error is the larger."""
    if clip is None:
        return np.zeros(values.shape, bool)
    clip = np.float32(clip)
    clipped = np.clip(values, old - clip, old + clip)
    return (clipped - returns) ** 2 > (values - returns) ** 2


def test_vf_clipfrac_counts_no_clip_where_the_clamp_returns_v():
    # old + clip(v - old) is 0.060000002 in float32, not v: counted clipped before; the clamp gives v itself.
    values, old, returns = (np.array([[x]], np.float32) for x in (0.06, 0.42, 0.0))
    assert not verl_vf_clipfrac(values, old, returns, 0.5).any()
    _, _, metrics = losses.value_loss(values, old, returns, np.ones((1, 1)), 0.5)
    assert float(metrics["vf_clipfrac"][0]) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_equals_the_plain_loop(mode, clip):
    _, old, mask, _ = random_batch(3)
    rng = np.random.default_rng(11)
    values = (old + rng.normal(scale=0.4, size=old.shape)).astype(np.float32)
    returns = rng.normal(size=old.shape).astype(np.float32)
    loss_sum, denom, metrics = losses.value_loss(values, old, returns, mask, clip, mode, horizon=12)
    want = np_value_loss(values, old, returns, mask, clip, mode, 12)
    np.testing.assert_allclose(float(loss_sum / denom), want, rtol=1e-5)
    on = mask > 0
    frac = verl_vf_clipfrac(values, old, returns, clip)[on].mean()
    np.testing.assert_allclose(float(metrics["vf_clipfrac"][0] / metrics["vf_clipfrac"][1]), frac, rtol=1e-6)
    if clip is not None:
        assert 0 < frac < 1  # the clip is active on some tokens, not all
    np.testing.assert_allclose(float(metrics["vpred_mean"][0] / metrics["vpred_mean"][1]), values[on].mean(), rtol=1e-5)


def test_explained_variance_as_verl():
    _, values, mask, _ = random_batch(5)
    returns = values + np.random.default_rng(2).normal(scale=0.5, size=values.shape).astype(np.float32)
    on = mask > 0
    want = 1 - np.var(returns[on] - values[on], ddof=1) / (np.var(returns[on], ddof=1) + 1e-5)
    np.testing.assert_allclose(float(losses.explained_variance(returns, values, mask)), want, rtol=1e-5)


# ---------------------------------------------------------------- the PPO task


def config(tmp_path, *overrides):
    return load_checked([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides])


def make_task(cfg):
    built, state = run.build_run(cfg)
    task = modes.create(built)
    return task, task.train_state(state)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def test_the_critic_starts_as_the_policys_backbone_and_values_the_state_before_each_token(tmp_path):
    task, state = make_task(config(tmp_path))
    policy, critic = host(state["params"]), host(state["critic"]["params"])
    assert set(critic["backbone"]) == set(policy) - {"lm_head"}
    for a, b in zip(jax.tree.leaves(critic["backbone"]), jax.tree.leaves({k: policy[k] for k in critic["backbone"]})):
        np.testing.assert_array_equal(a, b)
    task.sampler.update_weights(state["params"], 0)
    groups, _ = task.rollouts.prepare_batch(0, lambda version: None)
    rows = task.to_rows(groups)
    values = task.rollout_passes(state, rows)["values"]
    # The value of token t's state is the critic's output at the last position of prompt + completion[:t].
    model = nnx.merge(task.critic.graphdef, state["critic"]["params"])
    g = groups[1]
    prompt, tokens, length = list(g.prompt.ids), g.trajectories[0].ids, len(g.trajectories[0].ids)
    for t in range(length):
        ids = np.asarray([prompt + list(tokens[:t])], np.int32)
        direct = model(ids, np.arange(ids.shape[1])[None], np.ones_like(ids))[0, -1, 0]
        np.testing.assert_allclose(values[4, t], float(direct), rtol=1e-4, atol=1e-5)


def test_critic_warmup_trains_the_critic_alone(tmp_path):
    task, state = make_task(config(tmp_path, "critic_warmup_steps=1", "steps=2"))
    policy0, critic0 = host(state["params"]), host(state["critic"]["params"])
    state, m = task.step(state, 0)
    assert "loss" not in m and "pg_clipfrac" not in m and np.isfinite(m["critic/value_loss"])
    for a, b in zip(jax.tree.leaves(host(state["params"])), jax.tree.leaves(policy0)):
        np.testing.assert_array_equal(a, b)
    assert int(state["step"]) == 0 and int(state["critic"]["step"]) == 1  # 16 rows: one mini-batch
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(host(state["critic"]["params"])), jax.tree.leaves(critic0))
    )
    state, m = task.step(state, 1)
    assert np.isfinite(m["loss"]) and int(state["step"]) == 1 and int(state["critic"]["step"]) == 2
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host(state["params"])), jax.tree.leaves(policy0))
    )


def test_resume_in_the_middle_of_ppo_continues_identically(tmp_path, monkeypatch):
    overrides = ("steps=3", "kl_coef=0.05", "use_kl_in_reward=true", "critic_warmup_steps=1", "num_iterations=2")
    straight = config(tmp_path, "run_name=straight", *overrides)
    assert train.train(straight) == 0
    interrupted = config(tmp_path, "run_name=interrupted", *overrides)
    with sigterm_after_step(monkeypatch, 1):
        assert train.train(interrupted) == train.EXIT_SIGTERM
    assert train.train(interrupted) == 0

    def saved(cfg, item):
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(os.path.join(cfg.checkpoint_dir, "3", item))

    for item in ("params", "critic", "train"):
        a, b = saved(straight, item), saved(interrupted, item)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    lines = [json.loads(l) for l in open(interrupted.metrics_file)]
    assert [l["step"] for l in lines if "critic/value_loss" in l] == [0, 1, 2]
    assert {"critic/vf_clipfrac", "critic/values_mean", "critic/explained_var", "critic/lr"} <= set(lines[-1])


def test_a_ppo_run_raises_the_reward(tmp_path):
    """From random weights, a reward for any digit in the completion (about one in sixteen at the
    start) is learnt within a few steps: the policy loss, GAE and the critic pull the same way."""
    cfg = config(
        tmp_path,
        "steps=12",
        "rollout_batch_size=8",
        "lr_schedule=constant",
        "learning_rate=1e-2",
        "critic_learning_rate=1e-2",
        "reward=format",
        r"format_reward_pattern=\d",
    )
    assert train.train(cfg) == 0
    rewards = [json.loads(l)["reward_mean"] for l in open(cfg.metrics_file) if "reward_mean" in l]
    assert len(rewards) == 12
    assert np.mean(rewards[:3]) < 0.3 and np.mean(rewards[-3:]) > 0.8, rewards


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["gae_gamma=1.5"], "gae_gamma"),
        (["gae_lambda=-0.1"], "gae_lambda"),
        (["value_clip=0"], "value_clip"),
        (["critic_warmup_steps=-1"], "critic_warmup_steps"),
        (["mode=grpo", "critic_path=/tmp/x"], "critic_path"),
        (["rollout_decoding=beam"], "rollout_decoding=beam"),
        (["workflow=multi_turn", "env=calculator", "turn_discount=0.5"], "turn_discount"),
        (["advantage_estimator=rloo"], "ppo estimates advantages by GAE"),
    ],
)
def test_bad_ppo_keys_stop_with_one_line(tmp_path, capsys, overrides, named):
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1
