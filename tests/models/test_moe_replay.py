"""Routing replay (moe_routing_replay): the colocated sampler records every token's experts, GRPO's
logprob pass and updates route by them. Against independent references: the sampler's own logprobs
(the old policy's equal them once replayed, where a sampler that routes otherwise makes them
differ), the router's top-k of the plain full forward (what the sampler records), the uncompacted
decode (compaction moves the routes with their rows), and the config's one-line refusals."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import GRPO_FAST, MOE_CFG, REPO, TINY_MOE, first_groups, make_step, sharp_moe
from helpers import grpo_config as config
from unitrain import train
from unitrain.engines.base import SamplingParams
from unitrain.engines.colocated import ColocatedSampler
from unitrain.models import moe
from unitrain.tasks import rl as grpo

REPLAY = [*TINY_MOE, "moe_routing_replay=true"]
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 11], [12], [40, 41, 42, 43, 44]]
TOL = 1e-4  # float32: the sampler's cached decode against the trainer's full forward, same experts


def biased_choice(bias):
    """A router that chooses by its logits plus a fixed per-expert bias (as an aux-loss-free
    balancing bias does) while the gate weights stay the softmax's: a sampler that routes otherwise."""
    return lambda logits, k: jax.lax.top_k(logits + bias, k)[1].astype(jnp.int32)


def test_replayed_old_logprobs_equal_the_samplers_where_routing_differs(tmp_path, monkeypatch):
    """GRPO's old-policy pass on rollouts from a sampler whose router chose otherwise: with the
    recorded routes it gives the sampler's logprobs; routing by itself it does not, and it counts
    the tokens it would have routed elsewhere."""
    cfg = config(tmp_path, *REPLAY, "rollout_max_response_len=8", "rollout_temperature=1.0")
    task, graphdef, params, _ = make_step(cfg)
    with monkeypatch.context() as patch:
        patch.setattr(moe, "choose_experts", biased_choice(jnp.asarray([3.0, 0.0, -3.0, 1.0])))
        groups, _ = first_groups(task, params)
    batch = task.to_rows(groups)
    mask = batch["loss_mask"].astype(bool)
    passes = task.logprobs(params, batch)
    np.testing.assert_allclose(passes["old_logprobs"][mask], batch["sampler_logprobs"][mask], atol=TOL, rtol=0)
    own = {k: v for k, v in batch.items() if k != "routes"}
    unreplayed = np.asarray(grpo.token_stats(graphdef, 1.0, 0, params, own).logprobs)
    assert np.abs(unreplayed - batch["sampler_logprobs"])[mask].max() > 100 * TOL
    batch.update(passes)
    changed = task.replay_changed_fraction(batch)
    assert 0.2 < changed <= 1.0 and "replay_changed" not in batch
    # The shared-prompt forward takes the same routes: a group's prompt routed once, as sampled.
    shared = grpo.token_stats(graphdef, 1.0, 0, params, batch, group_rows=cfg.n_samples_per_prompt)
    np.testing.assert_allclose(np.asarray(shared.logprobs)[mask], batch["sampler_logprobs"][mask], atol=TOL, rtol=0)


def own_routes(model, seq) -> np.ndarray:
    """[len(seq), L, k]: the router's top-k of the plain full forward, each token's set sorted."""

    @nnx.jit
    def forward(model, tokens):
        with moe.collect_router_stats() as collected:
            model.hidden_states(tokens[None], jnp.arange(tokens.shape[0])[None], jnp.ones((1, tokens.shape[0]), int))
        return collected[0].experts  # [L, T, k]

    return np.sort(np.moveaxis(np.asarray(forward(model, jnp.asarray(seq))), 0, 1), axis=-1)


@pytest.mark.parametrize("compaction", [0, 1], ids=["uncompacted", "compacted"])
def test_recorded_routes_are_the_full_forwards_and_survive_compaction(compaction):
    """Rows ending at different steps (budgets, stop ids), a prompt given twice: each sampled
    token's recorded experts are those the full forward of its sequence routes it to, the prompt's
    too; the last token (read by no step) and the columns past a row's end hold -1; and compacted
    rows record what the uncompacted decode does."""
    model = sharp_moe(MOE_CFG)
    prompts = [*PROMPTS, PROMPTS[0]]
    sampling = SamplingParams(
        max_new_tokens=10, stop_token_ids=(4, 13), row_budgets=(10, 2, 5, 1, 7), record_routes=True
    )
    out = ColocatedSampler(model, cache_phases=2, compaction=compaction).generate(prompts, sampling, jax.random.key(3))
    reference = ColocatedSampler(model, cache_phases=2).generate(prompts, sampling, jax.random.key(3))
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.routes, reference.routes)
    np.testing.assert_array_equal(out.prompt_routes, reference.prompt_routes)
    assert len(set(out.lengths.tolist())) > 2
    P = out.prompt_routes.shape[1]
    for r, prompt in enumerate(prompts):
        n = out.lengths[r]
        want = own_routes(model, [*prompt, *out.tokens[r, :n]])
        np.testing.assert_array_equal(np.sort(out.prompt_routes[r, P - len(prompt) :], -1), want[: len(prompt)])
        assert (out.prompt_routes[r, : P - len(prompt)] == -1).all()
        np.testing.assert_array_equal(np.sort(out.routes[r, : n - 1], -1), want[len(prompt) : len(prompt) + n - 1])
        assert (out.routes[r, n - 1 :] == -1).all()
    off = ColocatedSampler(model).generate(prompts, SamplingParams(max_new_tokens=4), jax.random.key(3))
    assert off.routes is None and off.prompt_routes is None


def test_replay_rows_lay_out_the_routes_as_the_tokens():
    """replay_routes against the rows' layout written out: the prompt's routes end at column P."""
    L, k, P, C = 2, 2, 4, 3
    routes = np.arange(2 * 3 * L * k).reshape(2, 3, L, k)
    prompt_routes = -np.arange(1, 2 * 5 * L * k + 1).reshape(2, 5, L, k)
    rows = [  # the prompt's routes as the workflow keeps them: the block's last len(prompt) positions
        types.SimpleNamespace(
            prompt_ids=(7, 8), ids=np.zeros(n), routes=routes[r, :n], prompt_routes=prompt_routes[r, 3:]
        )
        for r, n in enumerate((3, 1))
    ]
    got = grpo.replay_routes([types.SimpleNamespace(trajectories=rows)], P, C)
    want = np.full((2, P + C, L, k), -1)
    want[:, 2:4] = prompt_routes[:, 3:5]
    want[0, 4:7] = routes[0]
    want[1, 4:5] = routes[1, :1]
    np.testing.assert_array_equal(got, want)


def test_grpo_with_replay_on_a_tiny_moe_trains_and_logs_the_changed_fraction(tmp_path):
    args = [*GRPO_FAST, *REPLAY, "steps=3", "learning_rate=1e-2"]
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *args]) == 0
    lines = [json.loads(line) for line in open(tmp_path / "default" / "metrics.jsonl")]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 3
    for line in steps:
        assert 0.0 <= line["moe/replay_changed_fraction"] <= 1.0 and np.isfinite(line["loss"])
        assert line["sampler_trainer_logprob_gap"] < 1e-3  # old policy's replayed pass: the sampler's


@pytest.mark.parametrize(
    "args, message",
    [
        (["moe_routing_replay=true"], "moe_routing_replay replays a mixture of experts' routes; this model is dense"),
        ([*REPLAY, "sampler=vllm"], "sampler vllm reports none"),
        ([*REPLAY, "rl_packing=true"], "not supported with rl_packing yet"),
        ([*REPLAY, "mode=ppo"], "mode=ppo has none"),
        ([*REPLAY, "lora_rank=4"], "not supported with LoRA yet"),
    ],
)
def test_replay_config_refusals_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    argv = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *GRPO_FAST, *args]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
