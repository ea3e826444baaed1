"""Learning-rate schedules, the weight-decay mask, and AdamW's decoupled decay, by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import REPO
from unitrain import sharding
from unitrain.checks import load_checked
from unitrain.models import decoder
from unitrain.optimizer import learning_rate_schedule, make_optimizer


def cfg(*overrides):
    return load_checked(
        [
            str(REPO / "configs" / "base.yml"),
            "steps=110",
            "warmup_steps=10",
            "learning_rate=1e-2",
            "lr_final_fraction=0.1",
            *overrides,
        ]
    )


def schedule_of(c):
    return learning_rate_schedule(c, sharding.layout_for(c).optimizer_steps)  # SFT: one update per step


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_by_hand(kind):
    schedule = schedule_of(cfg(f"lr_schedule={kind}"))
    peak, end = 1e-2, 1e-3
    for step in (0, 5, 10):
        assert float(schedule(step)) == pytest.approx(peak * step / 10)
    for step in (35, 60, 109):
        t = (step - 10) / 100
        expected = {
            "cosine": end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t)),
            "linear": peak + (end - peak) * t,
            "constant": peak,
        }[kind]
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)


def test_weight_decay_spares_norms_and_biases():
    model = decoder.create(
        decoder.ModelConfig(
            vocab_size=4,
            emb_dim=2,
            mlp_dim=2,
            num_decoder_layers=1,
            num_query_heads=1,
            num_kv_heads=1,
            head_dim=2,
            platform=sharding.target_platform(),
            qkv_bias=True,
            qk_norm=True,
        )
    )
    mask = model.decay_mask()
    assert mask == {
        "embed": True,
        "final_norm": False,
        "lm_head": True,
        "layers": {
            "wq": True,
            "wk": True,
            "wv": True,
            "wo": True,
            "w_gate": True,
            "w_up": True,
            "w_down": True,
            "attn_norm": False,
            "mlp_norm": False,
            "q_norm": False,
            "k_norm": False,
            "bq": False,
            "bk": False,
            "bv": False,
        },
    }
    params = jax.tree.map(jnp.ones_like, nnx.to_pure_dict(nnx.state(model)))
    c = cfg("warmup_steps=0", "lr_schedule=constant", "weight_decay=0.5", "max_grad_norm=0")
    optimizer = make_optimizer(c, mask, schedule_of(c))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    new = optax.apply_updates(params, updates)  # zero gradients: only the decoupled decay moves params
    np.testing.assert_allclose(new["embed"], 1 - 1e-2 * 0.5)
    np.testing.assert_allclose(new["layers"]["wq"], 1 - 1e-2 * 0.5)
    for untouched in (new["final_norm"], new["layers"]["attn_norm"], new["layers"]["bq"]):
        np.testing.assert_array_equal(untouched, 1.0)


def test_gradient_clipping_caps_the_global_norm():
    c = cfg("warmup_steps=0", "lr_schedule=constant", "weight_decay=0", "max_grad_norm=1.0", "adam_b1=0")
    optimizer = make_optimizer(c, {"embed": True}, schedule_of(c))
    params = {"embed": jnp.zeros(3)}
    grads = {"embed": jnp.asarray([30.0, 40.0, 0.0])}  # norm 50 -> clipped to norm 1
    clipped, _ = optax.clip_by_global_norm(1.0).update(grads, optax.clip_by_global_norm(1.0).init(params))
    np.testing.assert_allclose(clipped["embed"], [0.6, 0.8, 0.0], rtol=1e-6)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert np.all(np.isfinite(updates["embed"]))


def test_the_streamed_update_equals_the_whole_one():
    """step.streamed_update (the optimizer state in host memory, a parameter at a time) against
    optimizer.update over the whole tree: clipped by the global norm, weight decay masked, a frozen
    parameter (no moments), three steps so the moments and counts carry."""
    from unitrain.step import streamed_update

    c = cfg("warmup_steps=0", "lr_schedule=constant", "weight_decay=0.1", "max_grad_norm=1.0")
    frozen = {"embed": False, "norm": False, "frozen": True, "layers": {"w": False}}
    decay = {"embed": True, "norm": False, "frozen": True, "layers": {"w": True}}
    optimizer = make_optimizer(c, decay, schedule_of(c), frozen)
    keys = iter(jax.random.split(jax.random.key(0), 3))
    params = {
        "embed": jax.random.normal(next(keys), (5, 3)),
        "norm": jnp.ones(3),
        "frozen": jax.random.normal(next(keys), (4,)),
        "layers": {"w": jax.random.normal(next(keys), (2, 3, 3))},
    }
    whole_params, whole_state = params, optimizer.init(params)
    host_state = sharding.with_memory_kind(optimizer.init(params), "pinned_host")
    streamed_params = params
    for step in range(3):
        key = jax.random.key(step + 1)
        grads = jax.tree.map(lambda p: 10.0 * jax.random.normal(key, p.shape), params)
        updates, whole_state = optimizer.update(grads, whole_state, whole_params)
        whole_params = optax.apply_updates(whole_params, updates)
        streamed_params, host_state = jax.jit(streamed_update, static_argnums=(0, 4))(
            optimizer, grads, host_state, streamed_params, 1.0
        )
    for a, b in zip(jax.tree.leaves(streamed_params), jax.tree.leaves(whole_params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(streamed_params["frozen"], params["frozen"])
    assert jax.tree.structure(host_state) == jax.tree.structure(whole_state)
    for a, b in zip(jax.tree.leaves(host_state), jax.tree.leaves(whole_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state)} == {"pinned_host"}
