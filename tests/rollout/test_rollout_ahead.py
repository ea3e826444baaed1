"""Rollouts on devices of their own (sampler: mesh) and ahead of the trainer (max_staleness): the
split is the colocated run when nothing runs ahead, every sample is at most max_staleness versions
old (from its version tag), and a run stopped with groups in flight resumes with each prompt trained on once."""

import json
import os

import jax
import numpy as np
import pytest

from helpers import GRPO_FAST, REPO
from unitrain import run, sharding, train
from unitrain.checks import load_checked
from unitrain.engines.mesh import push
from unitrain.tasks.rl import RLTask

GRPO = [*GRPO_FAST, "rollout_batch_size=2", "lr_schedule=constant", "kl_coef=0.01", "reward=scored_prompts:score"]
SPLIT = ["sampler=mesh", "rollout_devices=4", "per_device_batch_size=2"]  # 8 rows per update, as colocated on 8

# The reward: varied (so advantages are not all zero) and a log of every prompt it scores, which is
# every prompt a step trains on, in order; SIGTERM after KILL_AFTER scored samples.
REWARD = """
import os, signal
calls = 0
def score(prompt, completion, label):
    global calls
    calls += 1
    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(prompt.replace("\\n", " ") + "\\n")
    if calls == int(os.environ.get("KILL_AFTER", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return float(sum(map(ord, completion)) % 3)
"""


@pytest.fixture
def reward_log(tmp_path, monkeypatch):
    (tmp_path / "scored_prompts.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))

    def use(name):
        monkeypatch.setenv("PROMPT_LOG", str(tmp_path / f"{name}.log"))
        return tmp_path / f"{name}.log"

    return use


def run_grpo(tmp_path, name, *overrides) -> int:
    import scored_prompts  # a fresh count of calls for each run

    scored_prompts.calls = 0
    cfg = load_checked(
        [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", f"run_name={name}", *GRPO, *overrides]
    )
    return train.train(cfg)


def metrics(tmp_path, name) -> dict:
    lines = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")]
    return {l["step"]: l for l in lines if "loss" in l}


def test_staleness_zero_on_rollout_meshes_equals_the_colocated_run(tmp_path, reward_log):
    """One rollout mesh of 4 devices, and two of 2 (rollout_meshes: each row samples the tokens it
    would on one), train as the colocated run does."""
    reward_log("colocated")
    assert run_grpo(tmp_path, "colocated", "steps=3", "per_device_batch_size=1") == 0
    a = metrics(tmp_path, "colocated")
    for name, meshes in (("split", 1), ("meshes", 2)):
        reward_log(name)
        assert run_grpo(tmp_path, name, "steps=3", *SPLIT, f"rollout_meshes={meshes}") == 0
        b = metrics(tmp_path, name)
        assert sorted(b) == [0, 1, 2]
        for key in ("loss", "reward_mean", "kl", "response_length_mean", "grad_norm"):
            got, want = [b[s][key] for s in b], [a[s][key] for s in b]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"{name} {key}")
        assert all(b[s]["rollout_staleness_max"] == 0 and b[s]["rollouts_in_flight"] == 0 for s in b)
        assert all(b[s]["time_weight_push"] > 0 for s in b)
    # 2 prompts x 4 samples a step, 4 rows a mesh: both sampled
    assert all(0 < b[s]["rollout_mesh_tokens_min"] <= b[s]["rollout_mesh_tokens_max"] for s in b)


def test_rollouts_run_ahead_by_at_most_max_staleness_versions(tmp_path, reward_log):
    reward_log("ahead")
    assert run_grpo(tmp_path, "ahead", "steps=4", *SPLIT, "max_staleness=1") == 0
    m = metrics(tmp_path, "ahead")
    # From the samples' version tags: step s trains on samples of version s - 1 (step 0: its own).
    assert [m[s]["rollout_staleness_max"] for s in range(4)] == [0, 1, 1, 1]
    assert [m[s]["rollout_staleness_mean"] for s in range(4)] == [0, 1, 1, 1]
    assert [m[s]["rollouts_in_flight"] for s in range(4)] == [2, 2, 2, 0]  # a round's groups; none beyond the last step
    assert "rollout_tokens_per_sec" not in m[1]  # sampled ahead, their time is not time_rollout
    assert all(np.isfinite(m[s]["loss"]) and m[s]["grad_norm"] > 0 for s in m)
    assert len(set(m[s]["kl"] for s in m)) > 1  # the policy moves away from the reference
    # Ahead on the trainer's own devices: the call in flight reads the weights the next update
    # donates, and still samples from them (the same samples, so the same losses).
    reward_log("colocated_ahead")
    assert run_grpo(tmp_path, "colocated_ahead", "steps=4", "per_device_batch_size=1", "max_staleness=1") == 0
    c = metrics(tmp_path, "colocated_ahead")
    for key in ("loss", "reward_mean", "kl", "rollout_staleness_max"):
        np.testing.assert_allclose([c[s][key] for s in m], [m[s][key] for s in m], rtol=1e-4, atol=1e-6, err_msg=key)


def test_a_run_stopped_with_groups_in_flight_resumes_with_each_prompt_trained_on_once(
    tmp_path, reward_log, monkeypatch
):
    """Groups in flight or waiting at a stop are sampled again after the resume: the prompts the
    steps train on are those of the uninterrupted run, in its order, none skipped, none twice."""
    trained = []
    to_rows = RLTask.to_rows
    monkeypatch.setattr(
        RLTask, "to_rows", lambda self, groups: trained.extend(g.prompt.text for g in groups) or to_rows(self, groups)
    )
    reward_log("straight")
    assert run_grpo(tmp_path, "straight", "steps=5", *SPLIT, "max_staleness=2") == 0
    straight, trained[:] = list(trained), []
    reward_log("stopped")
    os.environ["KILL_AFTER"] = "28"  # SIGTERM while a later step scores its samples: it finishes, saves and stops
    try:
        assert run_grpo(tmp_path, "stopped", "steps=5", *SPLIT, "max_staleness=2") == train.EXIT_SIGTERM
    finally:
        del os.environ["KILL_AFTER"]
    done = metrics(tmp_path, "stopped")
    assert sorted(done) == list(range(len(done))) and len(done) < 5
    assert done[len(done) - 1]["rollouts_in_flight"] > 0  # groups sampled ahead, not trained on
    assert run_grpo(tmp_path, "stopped", "steps=5", *SPLIT, "max_staleness=2") == 0
    assert sorted(metrics(tmp_path, "stopped")) == [0, 1, 2, 3, 4]
    assert len(straight) == 5 * 2 and len(set(straight)) == len(straight)
    assert trained == straight  # neither repeated nor skipped


def test_interrupted_generations_span_two_versions_and_are_logged(tmp_path, reward_log):
    """rollout_chunk_tokens with max_staleness 1: a round started before an update samples its first
    chunk with the old weights and the rest with the new ones; its trajectories span two versions.
    Without chunks the same round is sampled whole before the update (a spread of 0)."""
    reward_log("chunked")
    assert (
        run_grpo(tmp_path, "chunked", "steps=4", "per_device_batch_size=1", "max_staleness=1", "rollout_chunk_tokens=2")
        == 0
    )
    m = metrics(tmp_path, "chunked")
    # Step 1 trains on step 0's second round (sampled whole with the first weights), step 2 on the
    # round step 1 started before its update.
    assert [m[s]["rollout_version_spread_max"] for s in range(3)] == [0, 0, 1]
    assert [m[s]["rollout_staleness_max"] for s in range(4)] == [0, 1, 1, 1]
    assert all(np.isfinite(m[s]["loss"]) for s in m)
    reward_log("whole")
    assert run_grpo(tmp_path, "whole", "steps=4", "per_device_batch_size=1", "max_staleness=1") == 0
    assert [metrics(tmp_path, "whole")[s]["rollout_version_spread_max"] for s in range(4)] == [0, 0, 0, 0]


def test_push_places_the_weights_on_the_rollout_mesh():
    cfg = load_checked([str(REPO / "configs" / "base.yml"), "mode=grpo", *SPLIT, "rollout_fsdp_parallelism=2"])
    built, state = run.build_run(cfg)
    from unitrain.engines.mesh import from_run

    sampler = from_run(built)
    sampler.update_weights(state["params"], 7)
    rollout_devices = set(sharding.split_devices(4)[1])
    (pushed_params,) = [s.params for s in sampler.samplers]
    assert sampler.version == 7 and sampler.samplers[0].version == 7 and sampler.push_seconds > 0
    for pushed, trained in zip(jax.tree.leaves(pushed_params), jax.tree.leaves(state["params"])):
        assert (
            set(pushed.sharding.device_set) == rollout_devices
            and not set(trained.sharding.device_set) & rollout_devices
        )
        np.testing.assert_array_equal(np.asarray(pushed), np.asarray(trained))
    embed = pushed_params["embed"]
    assert embed.sharding.spec == sharding.logical_to_spec(("vocab", "embed"), built.rules)
    assert embed.addressable_shards[0].data.shape[1] == embed.shape[1] // 2  # fsdp over 2 on the rollout mesh
    (mesh,) = built.rollout_meshes
    (replicated,) = push(state["params"], [jax.tree.map(lambda _: sharding.replicated(mesh), state["params"])])
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(replicated))


def test_a_stream_that_runs_out_ends_the_run_at_the_step_that_lacks_prompts(tmp_path, reward_log, capsys):
    """Rounds sampled ahead stop where the prompts do: the steps that have prompts train, the first
    that has none stops the run with one line (exit 2)."""
    reward_log("short")
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    argv = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        "run_name=short",
        *GRPO,
        f"dataset_path={data}",
        "num_epochs=1",
        "steps=5",
        *SPLIT,
        "max_staleness=2",
    ]
    import scored_prompts

    scored_prompts.calls = 0
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "prompt stream ran out" in err and "num_epochs" in err
    assert sorted(metrics(tmp_path, "short")) == [0, 1, 2]  # 6 prompts, 2 a step
    assert len((tmp_path / "short.log").read_text().splitlines()) == 6 * 4
