"""GRPO on multi-turn episodes end to end: the guessing game (env guess_number) from a tiny model
warm-started on its demonstrations. A run killed with SIGKILL mid-rollout resumes to the same
losses and neither repeats nor skips a record; rollouts a version ahead on a rollout mesh equal
the colocated run ahead; episodes go past their first turn and their metrics reach the logs."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import helpers
from helpers import REPO, cpu_env
from unitrain import train
from unitrain.checks import load_checked

# One worker runs the module: the warm start and the straight run are made once for all three tests.
pytestmark = pytest.mark.xdist_group("episodes_grpo")

WARM_START = [
    "mode=sft",
    "env=guess_number",
    "chat_template_file=templates/tiny_chat.jinja",
    "max_target_length=128",
    "per_device_batch_size=1",
    "steps=30",
    "eval_interval=0",
    "log_period=10",
    "peak_flops_per_device=1e12",
]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """The tiny model after 30 SFT steps on the game's demonstrations: it plays, not yet well."""
    root = tmp_path_factory.mktemp("guess_sft")
    cfg = load_checked([str(REPO / "configs" / "base.yml"), f"base_output_directory={root}", *WARM_START])
    assert train.train(cfg) == 0
    return cfg.checkpoint_dir


def grpo_args(warm_start, tmp_path, name):
    return [
        f"base_output_directory={tmp_path}",
        f"run_name={name}",
        "mode=grpo",
        "workflow=multi_turn",
        "env=helpers:make_logged_game",
        f"load_parameters_path={warm_start}",
        "chat_template_file=templates/tiny_chat.jinja",
        "max_turns=3",
        "rollout_max_response_len=4",
        "episode_max_tokens=48",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "per_device_batch_size=1",
        "eval_interval=0",
        "log_period=1",
        "checkpoint_period=1",
        "learning_rate=1e-3",
        "warmup_steps=0",
        "lr_schedule=constant",
        "kl_coef=0.01",
        "peak_flops_per_device=1e12",  # a process that would measure it takes tens of seconds
    ]


def run_in_process(args, record_log, monkeypatch) -> int:
    monkeypatch.setattr(helpers, "_game_starts", 0)
    monkeypatch.setenv("RECORD_LOG", str(record_log))
    return train.train(load_checked([str(REPO / "configs" / "base.yml"), *args]))


def metrics(run_dir) -> dict:
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {line["step"]: line for line in lines if "loss" in line}


@pytest.fixture(scope="module")
def straight(warm_start, tmp_path_factory):
    """A 4-step GRPO run on the game, uninterrupted: (its metrics by step, the records it started)."""
    root = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(REPO / "tests"))
        assert run_in_process(grpo_args(warm_start, root, "straight") + ["steps=4"], root / "log", monkeypatch) == 0
    return metrics(root / "straight"), (root / "log").read_text().splitlines()


def test_a_run_killed_mid_rollout_resumes_to_the_same_losses_and_records(warm_start, straight, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    straight, straight_records = straight
    assert sorted(straight) == [0, 1, 2, 3]
    assert max(straight[s]["episode_turns_mean"] for s in straight) > 1  # past the first turn
    assert all(0 <= straight[s]["episode_success_rate"] <= 1 for s in straight)
    assert any(straight[s]["grad_norm"] > 0 for s in straight)

    # SIGKILL at the 3rd episode start of step 2's rollout (8 episodes a step).
    args = grpo_args(warm_start, tmp_path, "killed") + ["steps=4"]
    env = {**cpu_env(8), "RECORD_LOG": str(tmp_path / "killed.log"), "KILL_AT": "19"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "unitrain.train", str(REPO / "configs" / "base.yml"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resumed_log = tmp_path / "resumed.log"
    assert run_in_process(args, resumed_log, monkeypatch) == 0
    killed = metrics(tmp_path / "killed")
    assert sorted(killed) == [0, 1, 2, 3]
    for key in ("loss", "reward_mean", "episode_turns_mean", "kl"):
        np.testing.assert_allclose(
            [killed[s][key] for s in range(4)], [straight[s][key] for s in range(4)], rtol=1e-4, atol=1e-6, err_msg=key
        )
    # The resumed run starts the records of the steps after its checkpoint, the straight run's.
    resumed = resumed_log.read_text().splitlines()
    assert 0 < len(resumed) < 32 and resumed == straight_records[-len(resumed) :]


def test_episodes_sampled_ahead_on_a_rollout_mesh_equal_the_colocated_run_ahead(warm_start, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    ahead = ["steps=3", "max_staleness=1", "turn_discount=0.5"]  # per-token advantages too
    split = ["sampler=mesh", "rollout_devices=4", "per_device_batch_size=2"]
    assert (
        run_in_process(grpo_args(warm_start, tmp_path, "split") + ahead + split, tmp_path / "s.log", monkeypatch) == 0
    )
    colocated_args = grpo_args(warm_start, tmp_path, "colocated") + ahead
    assert run_in_process(colocated_args, tmp_path / "c.log", monkeypatch) == 0
    a, b = metrics(tmp_path / "colocated"), metrics(tmp_path / "split")
    assert [b[s]["rollout_staleness_max"] for s in range(3)] == [0, 1, 1]
    for key in ("loss", "reward_mean", "kl", "episode_turns_mean"):
        np.testing.assert_allclose([b[s][key] for s in b], [a[s][key] for s in b], rtol=1e-4, atol=1e-6, err_msg=key)


def test_two_processes_play_the_episodes_of_one(warm_start, straight, tmp_path):
    """Every process runs the same episodes and sampler calls: 2 processes x 4 devices give the
    losses of 1 x 8 (the straight run's first steps: a constant learning rate)."""
    from launch.local import launch  # tools/ is on sys.path (conftest)

    env = {"RECORD_LOG": str(tmp_path / "two.log"), "PYTHONPATH": str(REPO / "tests")}
    args = [str(REPO / "configs" / "base.yml"), *grpo_args(warm_start, tmp_path, "two"), "steps=2"]
    for r in launch(args, processes=2, devices_per_process=4, timeout=600, env=env, echo=False):
        assert r.returncode == 0, r.output[-3000:]
    a, b = straight[0], metrics(tmp_path / "two")
    assert sorted(b) == [0, 1]
    for key in ("loss", "reward_mean", "episode_turns_mean", "kl"):
        np.testing.assert_allclose([b[s][key] for s in b], [a[s][key] for s in b], rtol=1e-4, atol=1e-6, err_msg=key)
