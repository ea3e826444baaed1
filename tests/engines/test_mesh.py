"""Several sampler meshes (sampler: mesh, rollout_meshes): a call's rows spread over the meshes
sample the tokens one mesh, and the colocated sampler, sample; every push reaches every mesh (a GRPO run
on two meshes: tests/rollout/test_rollout_ahead.py)."""

import dataclasses
import itertools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from helpers import MOE_CFG, scaled, sharp_moe
from helpers import ROLLOUT_CFG as CFG
from helpers import ROLLOUT_PROMPTS as PROMPTS
from unitrain import sharding
from unitrain.engines import colocated, mesh
from unitrain.engines.base import SamplingParams
from unitrain.engines.beam import BeamParams
from unitrain.models import decoder as model_lib

PROMPTS8 = PROMPTS + PROMPTS[:2] * 2
BUDGETS = (6, 6, 5, 1, 2, 1, 6, 3)  # unequal, so that the spread moves rows off their contiguous run


def model(factor: float):
    cfg = dataclasses.replace(CFG, logical_axis_rules=sharding.DEFAULT_RULES)
    return scaled(model_lib.create(cfg, 0), factor)


def meshes(n: int) -> list[Mesh]:
    """n meshes over devices 4..7 (the trainer's are the others), each with fsdp 2 and data the rest."""
    devices = np.array(jax.devices()[4:]).reshape(n, -1)
    return [Mesh(d.reshape(len(d) // 2, 2, 1, 1), sharding.MESH_AXES) for d in devices]


def mesh_sampler(n: int, weights, version: int = 1) -> mesh.RolloutMeshSampler:
    sampler = mesh.RolloutMeshSampler(weights, pad_id=0, meshes=meshes(n), rules=sharding.DEFAULT_RULES)
    sampler.update_weights(nnx.to_pure_dict(nnx.state(weights)), version)
    return sampler


def assert_same(got, want):
    for k in ("tokens", "mask", "lengths"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_spread_balances_budgets_in_equal_row_counts():
    # Equal budgets (a round of whole groups): contiguous runs, a group's copies together.
    assert [s.tolist() for s in mesh.spread([4] * 7, 2)] == [[0, 1, 2, 3], [4, 5, 6]]
    # Unequal: the least possible larger load of all splits into equal counts (brute force).
    shares = mesh.spread(BUDGETS, 2)
    assert sorted(np.concatenate(shares).tolist()) == list(range(8)) and [len(s) for s in shares] == [4, 4]
    best = min(
        max(sum(BUDGETS[r] for r in half), sum(BUDGETS) - sum(BUDGETS[r] for r in half))
        for half in itertools.combinations(range(8), 4)
    )
    assert max(sum(BUDGETS[r] for r in s) for s in shares) == best == 15
    assert [s.tolist() for s in mesh.spread([3, 1], 4)] == [[0], [1], [], []]


def test_two_meshes_sample_what_one_mesh_and_the_colocated_sampler_sample():
    """Greedy and sampled, on rows with their own budgets: 2 meshes of 2 devices = 1 mesh of 4 = colocated."""
    weights = model(5.0)
    two, one = mesh_sampler(2, weights), mesh_sampler(1, weights)
    alone = colocated.ColocatedSampler(weights, pad_id=0)
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(max_new_tokens=6, temperature=temperature, row_budgets=BUDGETS)
        key = jax.random.key(3)
        want = alone.generate(PROMPTS8, sampling, key)
        np.testing.assert_array_equal(want.lengths, BUDGETS)
        assert_same(one.generate(PROMPTS8, sampling, key), want)
        assert_same(two.generate(PROMPTS8, sampling, key), want)
    # Both meshes sampled, evenly: 15 budgeted tokens each, twice.
    assert two.metrics() == {"rollout_mesh_tokens_max": 30.0, "rollout_mesh_tokens_min": 30.0}
    assert one.metrics() == {} and two.metrics()["rollout_mesh_tokens_max"] == 0.0


def test_a_push_reaches_every_mesh():
    two = mesh_sampler(2, model(5.0))
    new = model(3.0)
    two.update_weights(nnx.to_pure_dict(nnx.state(new)), 4)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0, row_budgets=BUDGETS)
    got = two.generate(PROMPTS8, sampling, jax.random.key(0))
    assert got.version == 4 and [s.version for s in two.samplers] == [4, 4]
    assert_same(got, colocated.ColocatedSampler(new, pad_id=0).generate(PROMPTS8, sampling, jax.random.key(0)))
    for sampler, devices in zip(two.samplers, np.array(jax.devices()[4:]).reshape(2, 2)):
        assert all(x.sharding.device_set == set(devices) for x in jax.tree.leaves(sampler.params))


def test_beam_search_spread_over_two_meshes_ranks_as_one_sampler():
    """Each mesh searches its share of the prompts (contiguous, 2 each); the shares joined in order."""
    weights = model(5.0)
    beams = BeamParams(3, 5)
    got = mesh_sampler(2, weights, version=2).beam_search(PROMPTS, beams, jax.random.key(0))
    want = colocated.ColocatedSampler(weights, pad_id=0).beam_search(PROMPTS, beams, jax.random.key(0))
    assert got.version == 2 and got.tokens.shape == (4, 3, 5)
    for k in ("tokens", "lengths"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-4)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)


def test_routes_of_shares_with_their_own_prompt_blocks_join_as_one_samplers():
    """Routing replay's routes: a share whose prompts are shorter has a narrower prompt block; its
    prompt routes are left-padded (-1) to the call's."""
    weights = sharp_moe(dataclasses.replace(MOE_CFG, logical_axis_rules=sharding.DEFAULT_RULES))
    prompts = [*PROMPTS[:3], list(range(1, 30))]  # the last share's block 32 columns, the first's 16
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0, row_budgets=(5, 2, 4, 3), record_routes=True)
    got = mesh_sampler(2, weights).generate(prompts, sampling, jax.random.key(0))
    want = colocated.ColocatedSampler(weights, pad_id=0).generate(prompts, sampling, jax.random.key(0))
    assert_same(got, want)
    assert got.prompt_routes.shape[1] == 32
    np.testing.assert_array_equal(got.routes, want.routes)
    np.testing.assert_array_equal(got.prompt_routes, want.prompt_routes)


def test_the_multi_process_push_places_each_parameter_on_every_mesh():
    """through_hosts (each parameter gathered once, then placed on every mesh), run in one process."""
    sampler = mesh.RolloutMeshSampler(model(5.0), pad_id=0, meshes=meshes(2), rules=sharding.DEFAULT_RULES)
    params = nnx.to_pure_dict(nnx.state(model(2.0)))
    copies = mesh.through_hosts(params, sampler.shardings)
    for copy, shardings in zip(copies, sampler.shardings):
        for got, want, where in zip(jax.tree.leaves(copy), jax.tree.leaves(params), jax.tree.leaves(shardings)):
            assert got.sharding == where
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
