"""Meshes, logical axis rules and sharded parameters on 8 simulated devices."""

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import REPO
from unitrain import pipeline, sharding
from unitrain.adapters import hf
from unitrain.checks import load_checked
from unitrain.errors import ConfigError
from unitrain.models import decoder as model_lib

CFG = model_lib.ModelConfig(
    vocab_size=512,
    emb_dim=64,
    mlp_dim=128,
    num_decoder_layers=2,
    num_query_heads=4,
    num_kv_heads=2,
    head_dim=16,
    platform=sharding.target_platform(),
    qkv_bias=True,
    logical_axis_rules=sharding.DEFAULT_RULES,
)
MESHES = {
    "fsdp8": dict(data=1, fsdp=8, tensor=1),
    "fsdp4_tensor2": dict(data=1, fsdp=4, tensor=2),
    "data2_fsdp4": dict(data=2, fsdp=4, tensor=1),
}
ONES = dict(data=1, fsdp=1, tensor=1)


def mesh_of(shape):
    return sharding.create_mesh(shape, ONES)


def batch(rng, b=8, t=32):
    tokens = rng.integers(0, 512, (b, t)).astype(np.int32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    segments = np.ones((b, t), np.int32)
    segments[1, t // 2 :] = 2  # one packed row
    positions[1, t // 2 :] -= t // 2
    segments[2, -5:] = 0  # padding
    return tokens, positions, segments


def sharded_forward(model, mesh, arrays):
    graphdef, state = nnx.split(model)
    data = sharding.batch_sharding(mesh, sharding.DEFAULT_RULES)
    param_shardings = jax.tree.map(lambda a: a.sharding, state)
    fn = jax.jit(lambda s, *xs: nnx.merge(graphdef, s)(*xs)[0], in_shardings=(param_shardings, data, data, data))
    with jax.set_mesh(mesh):
        return np.asarray(fn(state, *[jax.device_put(a, data) for a in arrays]))


def layout(*overrides) -> sharding.Layout:
    return sharding.layout_for(load_checked([str(REPO / "configs" / "base.yml"), *overrides]))


def layout_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        layout(*overrides)
    return str(e.value)


@pytest.mark.parametrize(
    "args, mesh, dcn",
    [
        ([], (1, 8, 1, 1), (1, 1, 1, 1)),
        (["ici_data_parallelism=2"], (2, 4, 1, 1), (1, 1, 1, 1)),
        (["ici_tensor_parallelism=2", "dcn_data_parallelism=2"], (1, 2, 1, 2), (2, 1, 1, 1)),
        (["ici_fsdp_parallelism=4", "dcn_fsdp_parallelism=-1"], (1, 4, 1, 1), (1, 2, 1, 1)),
        (["ici_fsdp_parallelism=2", "ici_data_parallelism=4"], (4, 2, 1, 1), (1, 1, 1, 1)),
        (["ici_fsdp_parallelism=2", "ici_context_parallelism=4"], (1, 2, 4, 1), (1, 1, 1, 1)),
        (["ici_context_parallelism=2", "dcn_context_parallelism=2"], (1, 2, 2, 1), (1, 1, 2, 1)),
    ],
)
def test_mesh_fill(args, mesh, dcn):
    got = layout(*args)
    assert tuple(got.mesh_shape.values()) == mesh and tuple(got.dcn_mesh_shape.values()) == dcn
    assert list(got.mesh_shape) == ["data", "fsdp", "context", "tensor"]


def test_layout_errors_name_the_sizes_and_the_devices():
    assert "multiply to 3 but there are 8 devices" in layout_error("ici_fsdp_parallelism=3")
    assert "ici_fsdp_parallelism=-1 cannot fill the mesh" in layout_error("ici_data_parallelism=3")
    grpo = ["mode=grpo", "rollout_batch_size=3", "n_samples_per_prompt=2"]
    assert "rollout_batch_size * n_samples_per_prompt (6) must be a multiple of" in layout_error(*grpo)


def test_batch_sizes_and_updates_per_step():
    sft = layout("per_device_batch_size=2", "gradient_accumulation_steps=3", "steps=5")
    assert (sft.global_batch_size, sft.rows_per_update, sft.updates_per_step, sft.optimizer_steps) == (16, 48, 1, 5)
    grpo = ["mode=grpo", "per_device_batch_size=1", "rollout_batch_size=8", "n_samples_per_prompt=4"]
    grpo += ["num_iterations=2", "steps=5"]  # 32 rollout rows, 8 per update
    assert (layout(*grpo).updates_per_step, layout(*grpo).optimizer_steps) == (4 * 2, 5 * 4 * 2)
    # The context axis' devices share their rows: 8 devices, 4 of them on every row's sequence.
    context = layout("per_device_batch_size=2", "ici_context_parallelism=4", "max_target_length=64")
    assert (context.global_batch_size, context.rows_per_update) == (2 * 8 // 4, 2 * 8 // 4)


def test_rollout_devices_split_the_mesh():
    got = layout(
        "mode=grpo", "sampler=mesh", "rollout_devices=4", "rollout_tensor_parallelism=2", "per_device_batch_size=4"
    )
    assert got.mesh_shape == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1} and got.global_batch_size == 4 * 4
    assert got.rollout_mesh_shape == {"data": 2, "fsdp": 1, "context": 1, "tensor": 2}
    assert layout().rollout_mesh_shape == {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}
    # rollout_meshes splits them: each of 2 meshes lays out 2 devices
    two = layout("mode=grpo", "sampler=mesh", "rollout_devices=4", "rollout_meshes=2", "per_device_batch_size=4")
    assert two.rollout_mesh_shape == {"data": 2, "fsdp": 1, "context": 1, "tensor": 1}
    cfg = load_checked(
        [str(REPO / "configs" / "base.yml"), "mode=grpo", "sampler=mesh", "rollout_devices=4", "rollout_meshes=2"]
    )
    meshes = sharding.rollout_meshes(cfg, two)
    assert [[d.id for d in m.devices.flat] for m in meshes] == [[4, 5], [6, 7]]


def test_rollout_device_layout_errors():
    mesh = ["mode=grpo", "sampler=mesh"]
    assert "rollout_devices (8) must be below the 8 devices" in layout_error(*mesh, "rollout_devices=8")
    assert "rollout_*_parallelism sizes multiply to 3 but there are 4 devices" in layout_error(
        *mesh, "rollout_devices=4", "rollout_data_parallelism=3"
    )


def test_every_stage_is_laid_out_before_the_first_runs(tmp_path):
    recipe = tmp_path / "stages.yml"
    recipe.write_text(
        f"base_config: {REPO / 'configs' / 'base.yml'}\n"
        "stages: [{name: sft, steps: 2}, {name: wide, ici_fsdp_parallelism: 3}]\n"
    )
    with pytest.raises(ConfigError, match=r"stage 'wide' \(stage 2 of 2\): .*multiply to 3 but there are 8 devices"):
        pipeline.stage_configs(load_checked([str(recipe)]))


def test_default_rules_match_base_yml():
    base = yaml.safe_load((REPO / "configs" / "base.yml").read_text())
    assert sharding.rules_from_config(base["logical_axis_rules"]) == sharding.DEFAULT_RULES


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_forward_equals_one_device(name):
    arrays = batch(np.random.default_rng(0))
    one_device = sharding.create_mesh(ONES, ONES, jax.devices()[:1])
    reference = sharded_forward(
        sharding.init_sharded(lambda: model_lib.create(CFG), one_device, CFG.logical_axis_rules), one_device, arrays
    )
    mesh = mesh_of(MESHES[name])
    model = sharding.init_sharded(lambda: model_lib.create(CFG), mesh, CFG.logical_axis_rules)
    f, t = MESHES[name]["fsdp"], MESHES[name]["tensor"]
    assert model.layers.wq[...].sharding.spec == P(None, "fsdp", "tensor", None)
    assert model.layers.wq[...].addressable_shards[0].data.shape == (2, 64 // f, 4 // t, 16)
    assert model.layers.w_down[...].addressable_shards[0].data.shape == (2, 128 // t, 64 // f)
    assert model.embed[...].addressable_shards[0].data.shape == (512 // t, 64 // f)
    assert model.lm_head[...].addressable_shards[0].data.shape == (64 // f, 512 // t)
    np.testing.assert_allclose(sharded_forward(model, mesh, arrays), reference, atol=2e-5, rtol=1e-5)


def test_fsdp8_splits_parameter_bytes_eightfold():
    model = sharding.init_sharded(lambda: model_lib.create(CFG), mesh_of(MESHES["fsdp8"]), CFG.logical_axis_rules)
    params = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    per_device = sharding.bytes_per_device(params)
    assert len(per_device) == 8
    for nbytes in per_device.values():  # norms and biases (no `embed` axis, tiny) stay replicated
        assert nbytes == pytest.approx(total / 8, rel=0.03)


def test_hf_load_places_parameters_in_their_shardings(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    mesh = mesh_of(MESHES["fsdp4_tensor2"])
    sharded = hf.load(path, mesh=mesh)
    plain = hf.load(path)
    assert sharded.layers.wk[...].sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded.layers.bq[...].sharding.spec == P(None, "tensor", None)
    for (path_a, a), (_, b) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(plain))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path_a))
        if a[...].ndim >= 2 and "norm" not in str(path_a[-1]):
            assert not a[...].sharding.is_fully_replicated, path_a


def test_indivisible_dimension_is_a_clear_error():
    cfg = model_lib.ModelConfig(**{**CFG.__dict__, "num_kv_heads": 1, "num_query_heads": 4})
    with pytest.raises(ValueError, match=r"layers.*b?k.*dimension \d \(size 1\).*tensor"):
        sharding.init_sharded(lambda: model_lib.create(cfg), mesh_of(MESHES["fsdp4_tensor2"]), cfg.logical_axis_rules)


def test_unknown_logical_axis_is_a_clear_error():
    with pytest.raises(ConfigError, match="'logical_axis_rules': logical axis 'vocab' has no entry"):
        sharding.logical_to_spec(("vocab", "embed"), (("embed", "fsdp"),))
