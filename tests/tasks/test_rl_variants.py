"""GRPO past the synchronous baseline, end to end: GSPO, rollout/trainer mismatch correction, DAPO's
overlong handling. The formulas themselves are checked against NumPy in test_rl_losses.py and
test_rewards.py; here each option runs in a real GRPO loop and its config checks refuse nonsense."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import GRPO_FAST as FAST
from helpers import REPO, make_step
from helpers import grpo_config as config
from unitrain import train
from unitrain.data.prompt_ids import Prompt
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines.base import Completions
from unitrain.errors import ConfigError
from unitrain.rollout.driver import _row
from unitrain.rollout.groups import Group
from unitrain.rollout.shaping import overlong_filter
from unitrain.rollout.workflow import scored_answers


def metrics(cfg) -> list[dict]:
    return [json.loads(line) for line in open(cfg.metrics_file) if '"loss"' in line]


@pytest.fixture
def varied_reward(tmp_path, monkeypatch) -> str:
    """A reward that differs between completions of the untrained model (exact_match is 0 for all)."""
    (tmp_path / "varied_reward.py").write_text(
        "def score(prompt, completion, label):\n    return float(sum(map(ord, completion)) % 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reward=varied_reward:score"


def test_gspo_trains_and_clips_sequences(tmp_path, varied_reward):
    # GSPO's own clip range (3e-4 / 4e-4): the second pass over the rollout moves sequences past it.
    cfg = config(
        tmp_path,
        varied_reward,
        "steps=2",
        "policy_loss=gspo",
        "loss_agg_mode=seq-mean-token-mean",
        "num_iterations=2",
        "eps_clip=3e-4",
        "eps_clip_high=4e-4",
    )
    assert train.train(cfg) == 0
    lines = metrics(cfg)
    assert len(lines) == 2 and all(math.isfinite(l["loss"]) for l in lines)
    assert all(l["pg_clipfrac"] > 0 for l in lines)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (("policy_loss=gspo",), "loss_agg_mode"),
        (("policy_loss=gspo", "loss_agg_mode=seq-mean-token-mean", "eps_clip_c=3.0"), "eps_clip_c"),
        (("rollout_is_threshold_lower=0.5",), "rollout_is_threshold_lower"),
        (("rollout_is=true", "rollout_decoding=beam"), "rollout_is"),
        (("rollout_is_threshold=0.5",), "rollout_is_threshold"),
        (("overlong_buffer_len=6",), "overlong_buffer_len"),
    ],
)
def test_nonsense_combinations_stop_with_one_line(tmp_path, capsys, overrides, named):
    with pytest.raises(ConfigError, match=named):
        config(tmp_path, *overrides)
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "Traceback" not in err[0]


# With top-p the sampler draws from a renormalised nucleus, so its logprobs exceed the trainer's:
# every token's weight exp(old - sampler) is the nucleus' mass, below 1 (an untrained model puts
# no token above 0.9).
def test_rollout_is_truncate_sees_the_nucleus(tmp_path, varied_reward):
    cfg = config(tmp_path, varied_reward, "steps=2", "rollout_top_p=0.9", "rollout_is=true")
    assert train.train(cfg) == 0
    for line in metrics(cfg):
        assert 0.5 < line["rollout_is_mean"] < 1 and line["rollout_is_max"] < 1
        assert line["rollout_is_fraction_high"] == 0 and line["rollout_is_fraction_low"] == 0
        assert "rollout_is_masked_fraction" not in line and math.isfinite(line["loss"])


def test_rollout_is_mask_rejects_what_is_out_of_range(tmp_path, varied_reward):
    # The old pass runs (two iterations); every geometric weight is below 0.999: all rows are rejected,
    # so nothing is left to train on.
    cfg = config(
        tmp_path,
        varied_reward,
        "steps=1",
        "rollout_top_p=0.9",
        "rollout_is=true",
        "num_iterations=2",
        "rollout_is_level=geometric",
        "rollout_is_mode=mask",
        "rollout_is_threshold_lower=0.999",
    )
    assert train.train(cfg) == 0
    (line,) = metrics(cfg)
    assert line["rollout_is_masked_fraction"] == 1 and line["rollout_is_seq_masked_fraction"] == 1
    assert line["loss"] == 0 and line["grad_norm"] == 0
    # Sequence level with the default range: the product over 6 tokens of ~0.9 straddles 1/2.
    cfg = config(
        tmp_path,
        varied_reward,
        "run_name=seq",
        "steps=1",
        "rollout_top_p=0.9",
        "rollout_is=true",
        "rollout_is_level=sequence",
        "rollout_is_mode=mask",
    )
    assert train.train(cfg) == 0
    (line,) = metrics(cfg)
    assert 0 <= line["rollout_is_masked_fraction"] <= 1 and line["rollout_is_max"] < 1 and math.isfinite(line["loss"])


# ------------------------------------------------------------------ DAPO overlong handling


def test_the_overlong_filter_drops_the_answers_without_a_stop_token():
    prompt = Prompt((1,), "p", "")
    turns = [[5, 2], [5, 6, 7], [5, 6, 2], []]  # 2 = EOS; the last row sampled nothing
    out = Completions(
        np.array([t + [0] * (3 - len(t)) for t in turns], np.int32),
        np.array([[1] * len(t) + [0] * (3 - len(t)) for t in turns], np.int32),
        np.zeros((4, 3), np.float32),
        np.array([len(t) for t in turns], np.int32),
        0,
    )
    sampled = [_row(out, r, None, (2,)) for r in range(4)]
    answers = scored_answers(prompt, sampled, load_tokenizer(""))
    next(answers)  # the Score request
    with pytest.raises(StopIteration) as done:
        answers.send((np.zeros(4, np.float32), {}))
    group = Group(prompt, tuple(done.value.value), np.zeros(4, np.float32), {})
    keep, metrics = overlong_filter([group, group])
    assert list(keep) == [True, False, True, False] * 2 and metrics == {"overlong_filtered_fraction": 0.5}


def _step_seeing(task, params):
    """Runs task.step(0) and returns (its metrics, the groups it sampled, the batch its update got)."""
    seen = {}
    take, update = task.rollouts.prepare_batch, task.update

    def record_take(step, push):
        seen["groups"], stats = take(step, push)
        return seen["groups"], stats

    def record_update(state, rows, step):
        seen["batch"] = dict(rows.batch)  # the step's StepRows: its host batch as the update sees it
        return update(state, rows, step)

    task.rollouts.prepare_batch, task.update = record_take, record_update
    state = {"params": params, "opt_state": task.run.optimizer.init(params), "step": jnp.int32(0)}
    _, m = task.step(state, 0)
    return m, seen["groups"], seen["batch"]


def test_overlong_penalty_and_filter_in_a_grpo_step(tmp_path, varied_reward):
    cfg = config(
        tmp_path, varied_reward, "overlong_buffer_len=3", "overlong_penalty_factor=0.5", "overlong_filter=true"
    )
    task, _, params, _ = make_step(cfg)
    m, groups, batch = _step_seeing(task, params)
    eos = task.run.tokenizer.eos_id
    for g in groups:  # the reward is the plugin's plus DAPO's penalty, by the formula, from the lengths
        lengths = np.asarray([len(t.ids) for t in g.trajectories], np.float64)
        want = np.where(lengths <= 6 - 3, 0.0, -0.5 * (lengths - 3) / 3)
        np.testing.assert_allclose(g.per_reward["overlong"], want, rtol=1e-6)
        np.testing.assert_allclose(g.rewards, g.per_reward["varied_reward:score"] + want, rtol=1e-6)
    lengths = np.asarray([len(t.ids) for g in groups for t in g.trajectories])
    cut = np.asarray([len(t.ids) == 0 or t.ids[-1] != eos for g in groups for t in g.trajectories])
    assert cut.any()  # the untrained model rarely stops within 6 tokens
    want_mask = (np.arange(batch["loss_mask"].shape[1]) < lengths[:, None]) & ~cut[:, None]
    np.testing.assert_array_equal(batch["loss_mask"], want_mask)
    assert m["overlong_filtered_fraction"] == pytest.approx(cut.mean())
    assert m["reward_overlong_min"] == pytest.approx(-0.5 * (lengths.max() - 3) / 3)
    assert m["loss_denominator"] == max(1.0, float(want_mask.sum()))


# ------------------------------------------------------------------ what an external engine gets


def test_export_policy_writes_the_given_weights_and_version(tmp_path):
    import torch
    import transformers
    from flax import nnx

    from unitrain import export, run

    built, state = run.build_run(config(tmp_path))
    root = tmp_path / "engine"
    export.export_policy(built, state["params"], 1, str(root))
    # Version 2 = other weights: the folder must hold exactly these, and version 1 is gone.
    params = jax.tree.map(lambda x: x * 1.5, state["params"])
    path = export.export_policy(built, params, 2, str(root))
    export.prune_versions(str(root), [path])
    assert sorted(p.name for p in root.iterdir()) == ["version_2"] and path == str(root / "version_2")
    assert json.load(open(root / "version_2" / export.POLICY_VERSION_FILE)) == {"version": 2}
    tokens = np.array([[3, 17, 42, 9, 100]], np.int32)
    ours, _ = nnx.merge(built.graphdef, params)(tokens, np.arange(5)[None], np.ones_like(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.detach().numpy()
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4, rtol=1e-4)
