"""GRPO past the synchronous baseline, end to end: GSPO, rollout/trainer mismatch correction, DAPO's
overlong handling. The formulas themselves are checked against NumPy in test_rl_losses.py and
test_rewards.py; here each option runs in a real GRPO loop and its config checks refuse nonsense."""

import json
import math

import pytest

from unitrain import train
from unitrain.config import ConfigError

from conftest import REPO
from test_grpo import FAST, config


def metrics(cfg) -> list[dict]:
    return [json.loads(line) for line in open(cfg.metrics_file) if '"loss"' in line]


@pytest.fixture
def varied_reward(tmp_path, monkeypatch) -> str:
    """A reward that differs between completions of the untrained model (exact_match is 0 for all)."""
    (tmp_path / "varied_reward.py").write_text(
        "def score(prompt, completion, label):\n    return float(sum(map(ord, completion)) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reward=varied_reward:score"


def test_gspo_trains_and_clips_sequences(tmp_path, varied_reward):
    # GSPO's own clip range (3e-4 / 4e-4): the second pass over the rollout moves sequences past it.
    cfg = config(tmp_path, varied_reward, "steps=2", "policy_loss=gspo", "loss_agg_mode=seq-mean-token-mean", "num_iterations=2",
                 "eps_clip=3e-4", "eps_clip_high=4e-4")
    assert train.train(cfg) == 0
    lines = metrics(cfg)
    assert len(lines) == 2 and all(math.isfinite(l["loss"]) for l in lines)
    assert all(l["pg_clipfrac"] > 0 for l in lines)


@pytest.mark.parametrize("overrides, named", [
    (("policy_loss=gspo",), "loss_agg_mode"),
    (("policy_loss=gspo", "loss_agg_mode=seq-mean-token-mean", "eps_clip_c=3.0"), "eps_clip_c"),
])
def test_nonsense_combinations_stop_with_one_line(tmp_path, capsys, overrides, named):
    with pytest.raises(ConfigError, match=named):
        config(tmp_path, *overrides)
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *FAST, *overrides]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "Traceback" not in err[0]
