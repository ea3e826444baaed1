"""Scale-out on one process: meshes vs one device, offloading, the replicated-parameter guard,
and the multi-host start decision."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import REPO, SFT_FAST, cpu_env, fixed_grpo_batch, grpo_update, only_first_device
from helpers import run_config as config
from unitrain import distributed, sharding, train
from unitrain import step as step_lib
from unitrain.errors import ConfigError
from unitrain.models import sources

SFT = [*SFT_FAST, "steps=5"]
# One worker runs the module: the 1-device reference curve (a process of its own) is made once.
pytestmark = pytest.mark.xdist_group("scale")
MESHES = {
    "fsdp8": ["ici_fsdp_parallelism=8"],
    "fsdp4_tensor2": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    "data2_fsdp4": ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"],
}


def losses_of(cfg):
    return [json.loads(l)["loss"] for l in open(cfg.metrics_file) if '"loss"' in l]


@pytest.fixture(scope="module")
def one_device_sft_curve(tmp_path_factory):
    """The reference: the same global batch (8 rows) on 1 device, in its own process."""
    out = tmp_path_factory.mktemp("one_device")
    env = cpu_env(1)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "unitrain.train",
            str(REPO / "configs" / "base.yml"),
            f"base_output_directory={out}",
            *SFT,
            "per_device_batch_size=8",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    return losses_of(config(out, "run_name=default"))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sft_loss_curve_on_each_mesh_equals_one_device(tmp_path, mesh, one_device_sft_curve):
    cfg = config(tmp_path, *SFT, "per_device_batch_size=1", *MESHES[mesh])
    assert train.train(cfg) == 0
    np.testing.assert_allclose(losses_of(cfg), one_device_sft_curve, rtol=2e-5)


def test_one_grpo_update_on_each_mesh_equals_one_device(tmp_path):
    batch = fixed_grpo_batch()
    # Two iterations: the update reads the old logprobs (with one, it would use its own).
    common = [
        "mode=grpo",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "kl_coef=0.1",
        "eps_clip_c=3.0",
        "loss_agg_mode=seq-mean-token-sum-norm",
        "rollout_max_response_len=16",
        "num_iterations=2",
    ]
    # The 1-device reference: the same config (8 rows per update) on a mesh of the first device only,
    # where each group's prompt is computed once (on the 8-device meshes every row computes its own).
    with only_first_device():
        reference = grpo_update(config(tmp_path, *common, "per_device_batch_size=1"), batch)
    for mesh in MESHES.values():
        loss, params = grpo_update(config(tmp_path, *common, "per_device_batch_size=1", *mesh), batch)
        assert loss == pytest.approx(reference[0], rel=1e-5)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference[1])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_optimizer_offload_keeps_the_curve_and_lives_on_host(tmp_path):
    plain = config(tmp_path, *SFT, "per_device_batch_size=1", "run_name=plain")
    offloaded = config(tmp_path, *SFT, "per_device_batch_size=1", "run_name=offloaded", "optimizer_host_offload=true")
    assert train.train(plain) == 0 and train.train(offloaded) == 0
    np.testing.assert_allclose(losses_of(offloaded), losses_of(plain), rtol=1e-6)
    mesh = sharding.trainer_mesh(offloaded, sharding.layout_for(offloaded))
    params = {"w": jax.device_put(jnp.ones((8, 4)), sharding.replicated(mesh))}
    state = step_lib.init_state(params, optax.adam(1e-3), mesh)
    moved = sharding.with_memory_kind(state["opt_state"], "pinned_host")
    assert {x.sharding.memory_kind for x in jax.tree.leaves(moved)} == {"pinned_host"}


def test_a_large_replicated_parameter_stops_the_run(tmp_path):
    rules = json.dumps(
        [
            ["batch", ["data", "fsdp"]],
            ["length", None],
            ["embed", None],
            ["mlp", None],
            ["heads", None],
            ["kv_heads", None],
            ["kv", None],
            ["vocab", None],
            ["layers", None],
            ["norm", None],
            ["activation_embed", None],
        ]
    )
    cfg = config(
        tmp_path, *SFT, "per_device_batch_size=1", f"logical_axis_rules={rules}", "max_replicated_param_mib=0.01"
    )
    with pytest.raises(ConfigError, match=r"parameter .* would be fully replicated on all 8 devices"):
        sources.build(cfg, sharding.trainer_mesh(cfg, sharding.layout_for(cfg)))
    ok = config(tmp_path, *SFT, "per_device_batch_size=1", "max_replicated_param_mib=0.01")
    sources.build(ok, sharding.trainer_mesh(ok, sharding.layout_for(ok)))  # the default rules shard every matrix


def test_distributed_start_decision(monkeypatch):
    base = {"distributed_init": "auto", "num_processes": 1, "process_id": 0, "coordinator_address": ""}
    for var in ("TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.maybe_initialize(base) is False
    assert distributed.maybe_initialize({**base, "distributed_init": "off", "num_processes": 2}) is False
    assert distributed.detected_cluster({"TPU_WORKER_HOSTNAMES": "a,b"}) == "TPU pod"
    assert distributed.detected_cluster({"SLURM_NTASKS": "4"}) == "SLURM"
    assert distributed.detected_cluster({"TPU_WORKER_HOSTNAMES": "a", "SLURM_NTASKS": "1"}) is None
