"""mode=online_dpo: the pairs it makes of sampled answers, a run that raises the reward it is judged
by, and the user errors."""

import json
import types

import numpy as np
import pytest

from helpers import BASE_YML, RL_FAST, make_cfg, run_config
from unitrain import train
from unitrain.errors import ConfigError
from unitrain.tasks.online_dpo import pair_rows


def answer(prompt, ids, loss_mask=None):
    ids = np.asarray(ids, np.int32)
    mask = np.ones_like(ids) if loss_mask is None else np.asarray(loss_mask, np.int32)
    return types.SimpleNamespace(prompt_ids=tuple(prompt), ids=ids, loss_mask=mask)


def test_pairs_take_the_best_and_the_worst_answer_and_only_sampled_tokens_carry_loss():
    groups = [
        # an episode: the environment's tokens (loss mask 0) are context, not loss
        types.SimpleNamespace(
            rewards=np.array([0.0, 2.0, -1.0]),
            trajectories=(answer([1, 5], [7]), answer([1, 5], [8, 30, 31, 9], [1, 0, 0, 1]), answer([1, 5], [6, 6])),
        ),
        # a tie: the first answer is chosen (TRL's scores[0] >= scores[1])
        types.SimpleNamespace(rewards=np.array([1.0, 1.0]), trajectories=(answer([1], [4, 2]), answer([1], [3]))),
    ]
    rows = pair_rows(groups, width=8, pad_id=0)
    assert rows["chosen_inputs"].tolist() == [[1, 5, 8, 30, 31, 9, 0, 0], [1, 4, 2, 0, 0, 0, 0, 0]]
    assert rows["rejected_inputs"].tolist() == [[1, 5, 6, 6, 0, 0, 0, 0], [1, 3, 0, 0, 0, 0, 0, 0]]
    assert rows["chosen_targets"][0].tolist() == [5, 8, 30, 31, 9, 0, 0, 0]
    assert rows["chosen_targets_segmentation"].tolist() == [[0, 1, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert rows["rejected_targets_segmentation"].tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    assert rows["chosen_inputs_position"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert rows["rejected_inputs_segmentation"][1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_an_online_dpo_run_raises_the_reward_it_is_judged_by(tmp_path):
    """From random weights, a reward for any digit in the completion (about one in sixteen at the
    start): each prompt's answer with a digit is chosen over one without, and the policy learns it."""
    cfg = run_config(
        tmp_path,
        *RL_FAST,
        "mode=online_dpo",
        "per_device_batch_size=1",
        "rollout_batch_size=8",
        "steps=16",
        "lr_schedule=constant",
        "learning_rate=1e-2",
        "dpo_beta=0.5",
        "reward=format",
        r"format_reward_pattern=\d",
    )
    assert train.train(cfg) == 0
    lines = [json.loads(line) for line in open(cfg.metrics_file)]
    rewards = [line["reward_mean"] for line in lines if "reward_mean" in line]
    assert len(rewards) == 16 and {"rewards/accuracy", "logps/chosen", "loss", "tied_pair_fraction"} <= set(lines[-1])
    assert lines[0]["loss"] == pytest.approx(np.log(2), rel=1e-5)  # the policy starts as the reference
    assert np.mean(rewards[:3]) < 0.3 and np.mean(rewards[-3:]) > 0.5, rewards


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_samples_per_prompt": 1}, "it needs 2 or more"),
        ({"dpo_loss_type": "kto"}, "dpo_loss_type=kto reads unpaired records"),
        ({"rl_packing": True}, "takes its pairs unpacked"),
        ({"dpo_loss_type": "orpo", "kl_coef": 0.1}, "dpo_loss_type=orpo has no reference model"),
        (
            {"env": "guess_number"},
            "env=guess_number is the environment of workflow multi_turn; workflow is single_turn",
        ),
    ],
)
def test_bad_online_dpo_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(**{"mode": "online_dpo", "n_samples_per_prompt": 2, **overrides})


def test_a_step_of_pairs_that_is_not_one_update_is_exit_2(tmp_path, capsys):
    args = [*RL_FAST, "mode=online_dpo", "rollout_batch_size=4", "per_device_batch_size=1"]
    assert train.main([BASE_YML, f"base_output_directory={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout_batch_size (4) pairs: it must equal" in err and len(err.splitlines()) == 1
