"""The mixture-of-experts MLP block of our decoder (Qwen3-MoE, Mixtral): the router, the dropless
expert computation, and the router's training terms (load-balancing loss, z-loss, expert load).

A token's router logits pick its k experts (`choose_experts`, the one place the choice is made: a
caller may give precomputed indices instead) and weigh them (`gate_weights`: softmax over all
experts, the k taken, renormalised over the k where the family does; Mixtral's softmax over the
top-k logits is that renormalisation). The token-slots (token, choice) are sorted by expert and
each expert's SwiGLU runs on its contiguous group with `jax.lax.ragged_dot`: every slot is computed,
none dropped, no capacity factor, whatever the number of tokens (a decode step's few included).

The router's terms leave a forward by a side channel rather than through the model interface's
return values: a forward without a cache `report`s each layer's `RouterStats`, and a loss that
trains the model collects them around its forward (`collect_router_stats`, which step.py's train
step opens) and turns them into `router_losses`. Nothing is reported when no one collects, so the
samplers, scoring passes and the model interface are unchanged, and a model wrapped by another
(LoRA's merged model, a scalar head's backbone) reports through the wrapper. The same channel
carries the experts each token ran (`RouterStats.experts`), which the colocated sampler collects
around its prefill and decode steps for routing replay (`moe_routing_replay`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from unitrain import sharding
from unitrain.adapters.hf_config import MOE_TYPES
from unitrain.config import check

# The layer parameters of a sparse MLP: the router [embed, experts] and each expert's SwiGLU
# stacked on a leading `expert` axis.
EXPERT_PARAMS = ("moe_gate", "moe_up", "moe_down")
ROUTER = "router"


class RouterStats(NamedTuple):
    """One forward's routing summed over its real tokens (segment > 0), per MoE layer: each field
    has a leading layers axis once the stack has run."""

    counts: jax.Array  # [..., experts] token-slots routed to each expert
    probs: jax.Array  # [..., experts] the router's softmax probabilities, summed over tokens
    z: jax.Array  # [...] logsumexp(router logits)^2, summed over tokens
    tokens: jax.Array  # [...] real tokens counted
    experts: jax.Array  # [..., N, k] int32 the experts each token ran (routing replay records them)
    changed: jax.Array  # [..., N] bool: a replayed token whose own top-k would differ (False unreplayed)


def choose_experts(router_logits: jax.Array, k: int) -> jax.Array:
    """The routing decision: the k experts of highest router logit per token, [N, k] int32. Both
    families take the top k of the softmax, which is monotone: the same experts. Routing replay
    replaces this call by the sampler's recorded indices."""
    return jax.lax.top_k(router_logits, k)[1].astype(jnp.int32)


def gate_weights(router_logits: jax.Array, experts: jax.Array, normalise: bool) -> jax.Array:
    """The weight of each chosen expert, [N, k] float32: its softmax probability over all experts
    (Qwen3-MoE), renormalised over the k chosen when `normalise` (Qwen3-MoE's norm_topk_prob;
    always for Mixtral, whose softmax over the top-k logits it equals)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    return weights / jnp.sum(weights, axis=-1, keepdims=True) if normalise else weights


def grouped_swiglu(x, experts, weights, w_gate, w_up, w_down):
    """sum_j weights[n, j] * SwiGLU_{experts[n, j]}(x[n]) for every token n, [N, E].

    x [N, E]; experts, weights [N, k]; w_gate, w_up [X, E, M]; w_down [X, M, E]. The N*k slots are
    sorted by expert so that each expert's rows are contiguous, the three projections are ragged
    matmuls over those groups, and each result is added, weighted, to its token. A slot whose
    expert is outside [0, X) (another device's, under expert parallelism) sorts last and adds
    nothing; since a token's k experts differ, at most N * min(k, X) slots are this device's, and
    only that many rows are gathered and computed (Qwen3-30B-A3B split over 64 devices: 2 of a
    token's 8 slots at most, a quarter of the rows of every slot)."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    here = (experts >= 0) & (experts < num_experts)
    flat = jnp.where(here, experts, num_experts).reshape(-1)
    order = jnp.argsort(flat)[: n * min(k, num_experts)]  # slot s = token s // k, choice s % k
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes)) * jax.lax.ragged_dot(rows, w_up, group_sizes)
    out = jax.lax.ragged_dot(hidden, w_down, group_sizes)
    # where, not a product: the rows outside every group are never computed, so never trusted.
    local = jnp.take(here.reshape(-1), order)[:, None]
    out = jnp.where(local, out, 0) * jnp.take(weights.reshape(-1), order)[:, None].astype(out.dtype)
    return jnp.zeros((n, out.shape[-1]), out.dtype).at[order // k].add(out)


def expert_parallel(x, experts, weights, w_gate, w_up, w_down, rules) -> jax.Array:
    """grouped_swiglu with the experts split over the mesh axes that `rules` give the `expert`
    axis (expert parallelism), under the active mesh: each device computes only its own experts.

    Per device (shard_map): the tokens of the devices that share its rows' expert axes are
    all-gathered (their routes and weights with them), the slots routed to its experts run through
    its ragged matmuls, and the partial outputs go back to their tokens' devices summed
    (psum_scatter; a psum over expert or mlp axes the tokens are not split on). Every slot is
    computed once, on the device that owns its expert; no expert weight moves but for the FSDP
    gather of its `embed` axis. GSPMD left alone would gather every expert onto every device."""
    mesh = jax.sharding.get_abstract_mesh()
    ep, mlp = _expert_axes(rules, mesh)
    rows = [a for a in _spec_axes(sharding.logical_to_spec(("batch",), rules)[0]) if mesh.shape[a] > 1]
    if x.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = []  # a few rows (a decode step) that do not split: every device sees them all
    mlp = tuple(a for a in mlp if a not in rows)
    gather = tuple(a for a in rows if a in ep)
    reduce = tuple(a for a in (*ep, *mlp) if a not in gather)
    tokens = P(tuple(rows) or None, None)

    def local(x, experts, weights, w_gate, w_up, w_down):
        if gather:
            x, experts, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, experts, weights))
        first = _linear_index(ep, mesh) * w_gate.shape[0]
        y = grouped_swiglu(x, experts - first, weights, w_gate, w_up, w_down)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, reduce) if reduce else y

    up = P(ep, None, mlp or None)
    down = P(ep, mlp or None, None)
    # check_vma off: with it, JAX 0.10 gets the tokens' gradient wrong where an expert axis does not
    # split the tokens (EP over tensor); tests/models/test_moe_sharding.py compares every layout's gradients.
    run = jax.shard_map(local, in_specs=(tokens, tokens, tokens, up, up, down), out_specs=tokens, check_vma=False)
    return run(x, experts, weights, w_gate, w_up, w_down)


def expert_parallelism(rules) -> int:
    """The devices the experts are split over under the active mesh (1: none, or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not rules:
        return 1
    return math.prod(mesh.shape[a] for a in _expert_axes(rules, mesh)[0])


def _expert_axes(rules, mesh) -> tuple[tuple, tuple]:
    """The mesh axes (of size > 1) of an expert weight's `expert` and `mlp` dimensions."""
    spec = sharding.logical_to_spec(("expert", "embed", "mlp"), rules)
    pick = lambda axes: tuple(a for a in _spec_axes(axes) if mesh.shape[a] > 1)  # noqa: E731
    return pick(spec[0]), pick(spec[2])


def _spec_axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _linear_index(axes, mesh):
    """This device's index along the mesh axes `axes` taken together, the first the major one (as
    a PartitionSpec splits a dimension over them)."""
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + jax.lax.axis_index(a)
    return index


def moe_mlp(
    h, p: dict, valid, *, k: int, normalise: bool, dtype, rules=(), routes=None
) -> tuple[jax.Array, RouterStats]:
    """The sparse MLP of one layer: h [B, T, E] (normed) -> [B, T, E], and the layer's RouterStats
    over the tokens where `valid` [B, T] (padding is routed and computed, but not counted). Under
    a mesh whose `rules` split the experts, the experts run expert-parallel (`expert_parallel`).
    `routes` (routing replay): per token its k experts, [B, T, k] int32, replacing the router's
    choice where given (a token whose first entry is negative is routed by its own logits); the
    gate weights are still this router's softmax at those experts."""
    B, T, E = h.shape
    x = h.reshape(B * T, E)
    logits = (x @ p[ROUTER].astype(dtype)).astype(jnp.float32)  # [N, X]
    own = choose_experts(logits, k)
    experts, changed = own, jnp.zeros((B * T,), bool)
    if routes is not None:
        routes = routes.reshape(B * T, k).astype(jnp.int32)
        replayed = routes[:, 0] >= 0
        experts = jnp.where(replayed[:, None], routes, own)
        # The same k experts in another order route alike: compared as sets.
        changed = replayed & jnp.any(jnp.sort(routes, axis=-1) != jnp.sort(own, axis=-1), axis=-1)
    weights = gate_weights(logits, experts, normalise)
    w_gate, w_up, w_down = (p[name].astype(dtype) for name in EXPERT_PARAMS)
    if expert_parallelism(rules) > 1:
        y = expert_parallel(x, experts, weights, w_gate, w_up, w_down, rules)
    else:
        y = grouped_swiglu(x, experts, weights, w_gate, w_up, w_down)
    return y.reshape(B, T, E), router_stats(logits, experts, valid.reshape(-1), changed)


def router_stats(logits, experts, valid, changed) -> RouterStats:
    """RouterStats of one layer's router logits [N, X] and choices [N, k] over the tokens where
    `valid` [N]; `changed` [N]: the replayed tokens the router would have sent elsewhere."""
    mask = valid.astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.float32), axis=1)  # [N, X]
    lse = jax.nn.logsumexp(logits, axis=-1)
    return RouterStats(
        counts=mask @ chosen,
        probs=mask @ jax.nn.softmax(logits, axis=-1),
        z=jnp.sum(mask * lse * lse),
        tokens=jnp.sum(mask),
        experts=experts,
        changed=changed & valid,
    )


def router_losses(collected: list[RouterStats]) -> dict[str, jax.Array]:
    """The training terms of the RouterStats a loss collected (every MoE layer of every forward):

    aux_loss: transformers' load_balancing_loss_func (Switch Transformer): num_experts * sum_e f_e
      * P_e, with f_e the token-slots routed to expert e and P_e its summed router probability,
      each over all layers' real tokens pooled (as transformers concatenates the layers' logits).
    z_loss: ST-MoE's router z-loss, the mean over layers and real tokens of logsumexp(logits)^2.
    max_load, mean_load: token-slots of the busiest expert in any layer, and per expert on average
      (k * tokens / num_experts): their ratio is the imbalance a capacity factor would have cut.
    """
    counts = jnp.concatenate([s.counts.reshape(-1, s.counts.shape[-1]) for s in collected])
    probs = jnp.concatenate([s.probs.reshape(-1, s.probs.shape[-1]) for s in collected])
    tokens = sum(jnp.sum(s.tokens) for s in collected)
    z = sum(jnp.sum(s.z) for s in collected)
    denom = jnp.maximum(tokens, 1.0)
    num_experts = counts.shape[-1]
    return {
        "aux_loss": num_experts * jnp.sum(jnp.sum(counts, axis=0) / denom * jnp.sum(probs, axis=0) / denom),
        "z_loss": z / denom,
        "max_load": jnp.max(counts),
        "mean_load": jnp.mean(counts),
    }


_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("router_stats", default=None)


@contextlib.contextmanager
def collect_router_stats() -> Iterator[list[RouterStats]]:
    """`with collect_router_stats() as collected:` around a forward (in the same trace): the
    RouterStats its MoE layers report, in call order ([] for a dense model)."""
    collected: list[RouterStats] = []
    token = _collector.set(collected)
    try:
        yield collected
    finally:
        _collector.reset(token)


def report(stats: RouterStats | None) -> None:
    """A forward's RouterStats to the innermost open collector (nothing when none is open)."""
    collected = _collector.get()
    if collected is not None and stats is not None:
        collected.append(stats)


@check("model_family", "num_experts", "num_experts_per_tok", "moe_norm_topk_prob")
def _experts(c) -> str | None:
    """Experts belong to the mixture-of-experts families (and they to experts); a token takes at
    most all of them; Mixtral always renormalises its top-k weights."""
    family, experts = c["model_family"], c["num_experts"]
    if family in MOE_TYPES and not experts:
        return f"model_family {family} is a mixture of experts: set num_experts > 0"
    if experts and family not in MOE_TYPES:
        return f"num_experts={experts} needs a mixture-of-experts model_family ({' | '.join(MOE_TYPES)}); {family} is dense"
    if experts and c["num_experts_per_tok"] > experts:
        return f"num_experts_per_tok ({c['num_experts_per_tok']}) must be at most num_experts ({experts})"
    if family == "mixtral" and not c["moe_norm_topk_prob"]:
        return "model_family mixtral renormalises its top-k router weights: moe_norm_topk_prob must be true"
    return None


@check(
    "moe_routing_replay",
    "num_experts",
    "mode",
    "sampler",
    "model_source",
    "rl_packing",
    "lora_rank",
    "workflow",
    "rollout_decoding",
)
def _routing_replay(c) -> str | None:
    """Routing replay takes the routes the in-process JAX sampler records into GRPO's forwards of
    our decoder; what carries no routes (vLLM, episodes, beams, packed rows, LoRA's forward) is refused."""
    if not c["moe_routing_replay"]:
        return None
    unsupported = [
        (not c["num_experts"], "replays a mixture of experts' routes; this model is dense (num_experts=0)"),
        (c["mode"] != "grpo", f"replays the sampler's routes in grpo's passes; mode={c['mode']} has none"),
        (
            c["sampler"] not in ("colocated", "mesh"),
            f"needs the JAX sampler's recorded routes (sampler colocated | mesh); sampler {c['sampler']} reports none",
        ),
        (
            c["model_source"] != "unitrain",
            f"needs model_source unitrain (our decoder takes the routes), not {c['model_source']}",
        ),
        (
            c["rl_packing"],
            "is not supported with rl_packing yet (the packed rows do not carry the routes): set rl_packing=false",
        ),
        (c["lora_rank"] > 0, "is not supported with LoRA yet (its forward takes no routes): set lora_rank=0"),
        (
            c["workflow"] != "single_turn",
            f"replays single-turn rollouts; workflow {c['workflow']}'s episodes carry no routes",
        ),
        (c["rollout_decoding"] != "sample", "replays sampled rollouts; rollout_decoding=beam carries no routes"),
    ]
    return next((f"moe_routing_replay {why}" for bad, why in unsupported if bad), None)


CONFIG_CHECKS = (_experts, _routing_replay)
