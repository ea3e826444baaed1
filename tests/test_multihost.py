"""Two real JAX processes x 4 CPU devices on 127.0.0.1 (gloo collectives), launched with
tools/launch/local.py: SFT and GRPO runs give the losses of one process with 8 devices, and their
checkpoints resume on 2 processes and on 1."""

import json

import numpy as np

from helpers import GRPO_FAST, REPO, SFT_FAST
from launch.local import launch  # tools/ is on sys.path (conftest)
from unitrain import train
from unitrain.checks import load_checked

SFT = [*SFT_FAST, "warmup_steps=0", "lr_schedule=constant", "checkpoint_period=2", "data_shards=2"]
GRPO = [
    *GRPO_FAST,
    "per_device_batch_size=1",
    "rollout_batch_size=2",
    "lr_schedule=constant",
    "checkpoint_period=1",
    "kl_coef=0.01",
]


def run_two_processes(*args):
    results = launch(
        [str(REPO / "configs" / "base.yml"), *args], processes=2, devices_per_process=4, timeout=600, echo=False
    )
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    return results


def curve(run_dir, key="loss"):
    lines = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
    return {l["step"]: l[key] for l in lines if key in l}


def one_process(tmp_path, run_name, *args):
    cfg = load_checked(
        [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", f"run_name={run_name}", *args]
    )
    assert train.train(cfg) == 0
    return tmp_path / run_name


def test_sft_two_processes_equal_one_and_resume_across_topologies(tmp_path):
    straight = one_process(tmp_path, "one", *SFT, "steps=6")
    two = tmp_path / "two"
    out = run_two_processes(f"base_output_directory={tmp_path}", "run_name=two", *SFT, "steps=4")
    assert "over 8 devices (2 processes)" in out[0].output
    assert sorted(p.name for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    # Resume the 2-process checkpoint on 1 process with 8 devices: the data position comes along.
    one_process(tmp_path, "two", *SFT, "steps=6")
    expected = curve(straight)
    assert sorted(curve(two)) == list(range(6))
    np.testing.assert_allclose([curve(two)[s] for s in range(6)], [expected[s] for s in range(6)], rtol=2e-5)


def test_grpo_two_processes_equal_one_and_resume(tmp_path):
    straight = one_process(tmp_path, "one", *GRPO, "steps=3")
    two = tmp_path / "two"
    run_two_processes(f"base_output_directory={tmp_path}", "run_name=two", *GRPO, "steps=2")
    out = run_two_processes(f"base_output_directory={tmp_path}", "run_name=two", *GRPO, "steps=3")
    assert "resumed from" in out[0].output and "at step 2" in out[0].output
    for key in ("loss", "reward_mean", "kl"):
        a, b = curve(straight, key), curve(two, key)
        assert sorted(b) == [0, 1, 2]
        np.testing.assert_allclose([b[s] for s in range(3)], [a[s] for s in range(3)], rtol=1e-4, atol=1e-6)


def test_grpo_split_meshes_two_processes_equal_one(tmp_path):
    """Each process gives 2 of its 4 devices to the rollout mesh (or one to each of 2 meshes); rollouts
    run one version ahead."""
    split = ["sampler=mesh", "rollout_devices=4", "per_device_batch_size=2", "max_staleness=1", "steps=3"]
    straight = one_process(tmp_path, "one", *GRPO, *split)
    out = run_two_processes(f"base_output_directory={tmp_path}", "run_name=two", *GRPO, *split)
    assert (
        "rollouts on 1 mesh(es) of their own, each {'data': 4, 'fsdp': 1, 'context': 1, 'tensor': 1} over 4 devices"
        in out[0].output
    )
    for key in ("loss", "reward_mean", "kl"):
        a, b = curve(straight, key), curve(tmp_path / "two", key)
        assert sorted(b) == [0, 1, 2]
        np.testing.assert_allclose([b[s] for s in range(3)], [a[s] for s in range(3)], rtol=1e-4, atol=1e-6)
    assert curve(tmp_path / "two", "rollout_staleness_max") == {0: 0, 1: 1, 2: 1}
    # Two rollout meshes, each a device of every process (the push through the hosts onto both): the
    # rows spread over them draw what one mesh draws, so the run is the same.
    out = run_two_processes(f"base_output_directory={tmp_path}", "run_name=meshes", *GRPO, *split, "rollout_meshes=2")
    assert (
        "rollouts on 2 mesh(es) of their own, each {'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 1}" in out[0].output
    )
    for key in ("loss", "reward_mean", "kl"):
        a, b = curve(straight, key), curve(tmp_path / "meshes", key)
        np.testing.assert_allclose([b[s] for s in range(3)], [a[s] for s in range(3)], rtol=1e-4, atol=1e-6)
