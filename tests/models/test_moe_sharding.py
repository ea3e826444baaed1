"""Expert parallelism (models/moe.py's expert_parallel under the `expert` rule) on 8 CPU devices:
the layer and its gradients on every layout against one device, the expert weights split and
never gathered, and SFT and GRPO updates on the expert-parallel mesh against the 1-device run."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from helpers import SFT_FAST, fixed_grpo_batch, grpo_update, only_first_device
from helpers import run_config as config
from unitrain import modes, run, sharding
from unitrain.errors import ConfigError
from unitrain.models import moe

X, E, M, K = 8, 16, 8, 2
WEIGHT_AXES = {
    "router": ("embed", None),
    "moe_gate": ("expert", "embed", "mlp"),
    "moe_up": ("expert", "embed", "mlp"),
    "moe_down": ("expert", "mlp", "embed"),
}


def rules_with(expert):
    return tuple(dict(sharding.DEFAULT_RULES, expert=expert).items())


def layer_inputs(rows):
    keys = jax.random.split(jax.random.key(0), 6)
    p = {
        "router": jax.random.normal(keys[0], (E, X)),
        "moe_gate": jax.random.normal(keys[1], (X, E, M)) / 4,
        "moe_up": jax.random.normal(keys[2], (X, E, M)) / 4,
        "moe_down": jax.random.normal(keys[3], (X, M, E)) / 3,
    }
    return p, jax.random.normal(keys[4], (rows, 6, E)), jax.random.normal(keys[5], (rows, 6, E))


def layer_loss(h, p, probe, rules):
    y, _ = moe.moe_mlp(h, p, jnp.ones(h.shape[:2], bool), k=K, normalise=True, dtype=jnp.float32, rules=rules)
    return jnp.sum(probe * y)


def placed(mesh, rules, p, h):
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(axes, rules)))  # noqa: E731
    rows = ("batch", "length", None) if h.shape[0] % mesh.size == 0 else (None, None, None)
    return {n: put(w, WEIGHT_AXES[n]) for n, w in p.items()}, put(h, rows)


def mesh_of(data=1, fsdp=1, tensor=1):
    return sharding.create_mesh(dict(data=data, fsdp=fsdp, tensor=tensor), dict(data=1, fsdp=1, tensor=1))


@pytest.mark.parametrize(
    "shape, expert, rows",
    [
        (dict(fsdp=8), "fsdp", 8),  # EP over fsdp: tokens gathered over the 8, each device 1 expert
        (dict(data=2, fsdp=2, tensor=2), "fsdp", 8),  # EP over fsdp beside data and tensor (mlp split)
        (dict(fsdp=4, tensor=2), "tensor", 8),  # EP over tensor, which does not split the tokens
        (dict(fsdp=4, tensor=2), ["fsdp", "tensor"], 8),  # over two axes, the first the major
        (dict(fsdp=8), "fsdp", 3),  # 3 rows do not split over 8 devices (a decode step): not gathered
    ],
    ids=["fsdp8", "data2_fsdp2_tensor2", "tensor2", "fsdp4xtensor2", "uneven_rows"],
)
def test_expert_parallel_layer_and_gradients_equal_one_device(shape, expert, rows):
    """The MoE layer's value and its gradients (tokens, router, every expert weight) under the mesh
    equal the single-device ragged path (float32; summation order only: 2e-5 of values ~1)."""
    rules = rules_with(tuple(expert) if isinstance(expert, list) else expert)
    p, h, probe = layer_inputs(rows)
    want = jax.jit(jax.value_and_grad(lambda h, p: layer_loss(h, p, probe, ()), argnums=(0, 1)))(h, p)
    mesh = mesh_of(**shape)
    ps, hs = placed(mesh, rules, p, h)
    with jax.set_mesh(mesh):
        assert moe.expert_parallelism(rules) in (2, 4, 8)
        got = jax.jit(jax.value_and_grad(lambda h, p: layer_loss(h, p, probe, rules), argnums=(0, 1)))(hs, ps)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5), got, want)
    assert float(jnp.abs(got[1][0]).max()) > 1e-2  # the tokens' gradient is not vacuous


def test_a_wrong_expert_offset_breaks_the_equality(monkeypatch):
    """Negative control: each device running its neighbour's experts must be caught."""
    rules = rules_with("fsdp")
    p, h, probe = layer_inputs(8)
    want = layer_loss(h, p, probe, ())
    mesh = mesh_of(fsdp=8)
    ps, hs = placed(mesh, rules, p, h)
    index = moe._linear_index
    monkeypatch.setattr(moe, "_linear_index", lambda axes, mesh: (index(axes, mesh) + 1) % 8)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda h, p: layer_loss(h, p, probe, rules))(hs, ps)
    assert abs(float(got) - float(want)) > 1e-2


def expert_weight_gathers(hlo: str) -> list:
    """The all-gathers of the HLO whose result is an expert weight of all X experts."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather", hlo)
    return [s for s in shapes if s in (f"{X},{E},{M}", f"{X},{M},{E}")]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install libtpu)")
def test_on_a_tpu_slice_gspmd_gathers_every_expert_and_expert_parallel_does_not():
    """Compiled for a v5e:2x4 slice (XLA:TPU keeps ragged_dot an op): GSPMD left with the
    expert-sharded weights all-gathers all of them onto every chip; expert_parallel moves tokens."""
    from bench import tpu_topology

    rules = rules_with("fsdp")
    gathers = {}
    with sharding.compile_for(tpu_topology("v5e:2x4")):
        mesh = mesh_of(fsdp=8)
        spec = lambda shape, axes: jax.ShapeDtypeStruct(  # noqa: E731
            shape, jnp.float32, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, rules))
        )
        p, h, probe = layer_inputs(8)
        ps = {n: spec(w.shape, WEIGHT_AXES[n]) for n, w in p.items()}
        for name, use in (("gspmd", ()), ("expert_parallel", rules)):
            step = jax.jit(jax.grad(lambda h, p, use=use: layer_loss(h, p, probe, use), argnums=1))
            with jax.set_mesh(mesh):
                gathers[name] = expert_weight_gathers(
                    step.lower(spec(h.shape, ("batch", "length", None)), ps).compile().as_text()
                )
    assert gathers["gspmd"] and not gathers["expert_parallel"], gathers


TINY_MOE = [
    "model_family=qwen3_moe",
    "qk_norm=true",
    f"num_experts={X}",
    "num_experts_per_tok=2",
    "moe_mlp_dim=16",
    "moe_aux_loss_coef=0.01",
    "moe_z_loss_coef=0.001",
]
EP_RULES = (
    "logical_axis_rules=[[batch,[data,fsdp]],[length,null],[embed,fsdp],[mlp,tensor],[heads,tensor],"
    "[kv_heads,tensor],[kv,null],[vocab,tensor],[layers,null],[expert,fsdp],[norm,null],[activation_embed,null]]"
)
SFT = [*SFT_FAST, "warmup_steps=20"]  # base.yml's warmup: both runs take the same two small steps


def sft_steps(cfg, steps=2):
    built, state = run.build_run(cfg)
    task = modes.create(built)
    losses = []
    for s in range(steps):
        state, metrics = task.step(state, s)
        losses.append(float(metrics["loss"]))
    gate = state["params"]["layers"]["moe_gate"]  # [layers, experts, embed, mlp]: experts per device
    return gate.addressable_shards[0].data.shape[1], losses, jax.device_get(state["params"])


def assert_same_params(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_expert_parallel_sft_steps_equal_one_device(tmp_path):
    """Two SFT steps (8 rows; the router losses on) with each of 8 devices holding one expert of
    every layer: losses (rtol 2e-5) and the parameters after them (rtol 1e-4) equal one device's."""
    common = [*SFT, *TINY_MOE, EP_RULES, "per_device_batch_size=1"]
    with only_first_device():
        _, want_losses, want_params = sft_steps(config(tmp_path, *common, "run_name=one"))
    shards, losses, params = sft_steps(config(tmp_path, *common, "run_name=ep"))
    assert shards == X // 8
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    assert_same_params(params, want_params)


def test_expert_parallel_grpo_update_equals_one_device(tmp_path):
    """One GRPO optimizer update (test_scale's fixed rollout batch, two iterations) on the
    expert-parallel mesh: loss and parameters equal the 1-device update's."""
    common = [
        *TINY_MOE,
        EP_RULES,
        "mode=grpo",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "kl_coef=0.1",
        "rollout_max_response_len=16",
        "num_iterations=2",
        "per_device_batch_size=1",
    ]
    with only_first_device():
        want_loss, want_params = grpo_update(config(tmp_path, *common), fixed_grpo_batch())
    loss, params = grpo_update(config(tmp_path, *common), fixed_grpo_batch())
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert_same_params(params, want_params)


def test_experts_that_do_not_divide_over_their_axes_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"num_experts \(4\) must be a multiple of the 8 devices of mesh axes fsdp"):
        sharding.layout_for(config(tmp_path, *TINY_MOE, "num_experts=4", EP_RULES))


def test_a_mesh_axis_splits_one_dimension_of_an_array():
    rules = rules_with("fsdp")
    assert sharding.logical_to_spec(("layers", "expert", "embed", "mlp"), rules) == jax.P(None, "fsdp", None, "tensor")
    assert sharding.logical_to_spec(("embed", None), rules) == jax.P("fsdp", None)
    two = (("batch", ("data", "fsdp")), ("expert", ("fsdp", "tensor")), ("mlp", "tensor"))
    assert sharding.logical_to_spec(("batch", "expert", "mlp"), two) == jax.P(("data", "fsdp"), "tensor", None)
