"""The in-process sampler: prefill a left-padded prompt block, then decode in one `lax.while_loop`.

    out = generate(model, prompts, SamplingParams(max_new_tokens=64, temperature=1.0), rng)
    out["tokens"], out["mask"], out["logprobs"], out["lengths"]   # numpy, one row per prompt

Everything from prefill to the last token runs inside one jitted function (no Python loop over
tokens, no host sync). Shapes are bucketed so that a run compiles a bounded number of times:

  - prompt block P: the longest prompt rounded up to a power of two, at least `MIN_PROMPT_BUCKET`;
  - batch B: the number of prompts rounded up to a power of two, then (under a mesh) up to a
    multiple of the number of devices the `batch` axis is split over; pad rows are dropped;
  - N = max_new_tokens is used as given.

Compiled functions live in a module-level cache keyed by (graphdef, parameter shapes/shardings, B,
P, N, static sampling choices, mesh, rules); every new compile is logged on the `unitrain` logger.
Temperature, top-p and the stop ids are runtime values: changing them does not recompile (only
greedy vs sampling, top-k, top-p on/off and the number of stop ids are static).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import model as model_lib
from unitrain import sharding

log = logging.getLogger("unitrain")

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0.0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    stop_token_ids: tuple[int, ...] = ()  # EOS and other stop ids; a row stops after emitting one

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def bucket_prompt_length(n: int) -> int:
    """Smallest power of two >= n, at least MIN_PROMPT_BUCKET."""
    return max(MIN_PROMPT_BUCKET, _next_pow2(n))


def bucket_batch_size(n: int, multiple: int = 1) -> int:
    """Smallest power of two >= n, then rounded up to a multiple of `multiple` (data-parallel size)."""
    b = _next_pow2(n)
    return -(-b // multiple) * multiple


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def batch_parallelism(mesh, rules) -> int:
    """How many devices the logical `batch` axis is split over under these rules."""
    axes = sharding.logical_to_spec(("batch",), rules)[0]
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in axes]))


# ---------------------------------------------------------------------------------------------
# Sampling from one step's logits


def _sample(logits, key, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool):
    """-> (token [B] int32, logprob [B] float32) of the token under the distribution it came from."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = jnp.argmax(logits, axis=-1)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        if top_k:
            kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        if use_top_p:
            ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
            probs = jax.nn.softmax(ordered, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            # Keep the smallest prefix whose mass reaches top_p; the top-1 always has mass_before 0.
            keep = (mass_before < top_p).at[:, 0].set(True)
            threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
            scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
        logprobs = jax.nn.log_softmax(scaled, axis=-1)
        token = jax.random.categorical(key, scaled, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


# ---------------------------------------------------------------------------------------------
# The jitted program


def _build(graphdef, cfg, B: int, P: int, N: int, pad_id: int, greedy: bool, top_k: int, use_top_p: bool,
           cache_rules):
    def run(state, tokens, positions, segments, prompt_lens, stop_ids, temperature, top_p, rng):
        model = nnx.merge(graphdef, state)
        cache = model_lib.init_cache(cfg, B, P + N)
        if cache_rules is not None:
            specs = jax.tree.map(lambda axes: sharding.logical_to_spec(axes, cache_rules), model_lib.CACHE_AXES,
                                 is_leaf=lambda x: isinstance(x, tuple))
            cache = jax.lax.with_sharding_constraint(cache, specs)
        sample = lambda logits, i: _sample(logits, jax.random.fold_in(rng, i), temperature, top_p,
                                           greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        is_stop = lambda t: jnp.any(t[:, None] == stop_ids[None, :], axis=-1)

        logits, cache = model(tokens, positions, segments, cache)
        # Left padding: every real row's last prompt token sits in the last column.
        token, logprob = sample(logits[:, -1], 0)
        done = prompt_lens == 0  # batch-padding rows never emit
        emit = ~done
        out_tokens = jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(jnp.where(emit, token, pad_id))
        out_mask = jnp.zeros((B, N), jnp.int32).at[:, 0].set(emit.astype(jnp.int32))
        out_logprobs = jnp.zeros((B, N), jnp.float32).at[:, 0].set(jnp.where(emit, logprob, 0.0))
        done = done | is_stop(token)

        def cond(carry):
            i, _, _, _, _, done, _ = carry
            return (i < N) & ~jnp.all(done)

        def body(carry):
            i, cache, out_tokens, out_mask, out_logprobs, done, last = carry
            pos = (prompt_lens + i - 1)[:, None]
            logits, cache = model(last[:, None], pos, jnp.ones((B, 1), jnp.int32), cache)
            token, logprob = sample(logits[:, 0], i)
            emit = ~done
            token = jnp.where(emit, token, pad_id)
            col = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v[:, None].astype(a.dtype), i, axis=1)
            out_tokens = col(out_tokens, token)
            out_mask = col(out_mask, emit)
            out_logprobs = col(out_logprobs, jnp.where(emit, logprob, 0.0))
            done = done | is_stop(token)
            return i + 1, cache, out_tokens, out_mask, out_logprobs, done, token

        carry = (jnp.int32(1), cache, out_tokens, out_mask, out_logprobs, done, jnp.where(emit, token, pad_id))
        _, _, out_tokens, out_mask, out_logprobs, _, _ = jax.lax.while_loop(cond, body, carry)
        return {"tokens": out_tokens, "mask": out_mask, "logprobs": out_logprobs,
                "lengths": out_mask.sum(axis=1, dtype=jnp.int32)}

    return jax.jit(run)


_COMPILED: dict[Any, Any] = {}


def clear_cache() -> None:
    _COMPILED.clear()


def _signature(tree) -> tuple:
    return tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(tree))


def generate(model, prompts: list[list[int]], params: SamplingParams, rng: jax.Array, *, pad_id: int = 0,
             mesh=None, rules=None) -> dict[str, np.ndarray]:
    """Samples `params.max_new_tokens` tokens after each prompt.

    Returns numpy arrays, one row per prompt: `tokens` [B, N] int32 (pad_id after the stop),
    `mask` [B, N] int32 (1 for generated tokens up to and including the stop token), `logprobs`
    [B, N] float32 (log-prob of each sampled token under the temperature-scaled, top-k/top-p
    filtered distribution it was drawn from; greedy: log-softmax of the raw logits; 0 where mask
    is 0) and `lengths` [B] int32.

    Under a mesh the parameters must already be sharded; the prompt block is split over the
    logical `batch` axis of `rules` (default: the model's rules). With several processes every
    process passes the same prompts and gets the whole result back.
    Top-k keeps every token tied with the k-th largest logit.
    """
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    lens = np.asarray([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    cfg = model.cfg
    if mesh is not None:
        rules = sharding.rules_from_config(rules or cfg.logical_axis_rules or sharding.DEFAULT_RULES)
    n_real, N = len(prompts), params.max_new_tokens
    B = bucket_batch_size(n_real, batch_parallelism(mesh, rules) if mesh is not None else 1)
    P = bucket_prompt_length(int(lens.max()))

    tokens = np.full((B, P), pad_id, np.int32)
    positions = np.zeros((B, P), np.int32)
    segments = np.zeros((B, P), np.int32)
    prompt_lens = np.zeros((B,), np.int32)
    for b, p in enumerate(prompts):  # left padding: the prompt ends in the last column
        n = len(p)
        tokens[b, P - n:] = p
        positions[b, P - n:] = np.arange(n)
        segments[b, P - n:] = 1
        prompt_lens[b] = n

    greedy = params.temperature == 0.0
    top_k = 0 if greedy or params.top_k >= cfg.vocab_size else params.top_k
    use_top_p = not greedy and params.top_p < 1.0
    stop_ids = np.asarray(params.stop_token_ids, np.int32).reshape(-1)
    temperature = np.float32(params.temperature if not greedy else 1.0)
    top_p = np.float32(params.top_p)

    graphdef, state = nnx.split(model)
    if mesh is not None:
        data = sharding.batch_sharding(mesh, rules)
        rows = sharding.batch_sharding(mesh, rules, ("batch",))
        rep = sharding.replicated(mesh)
        put = lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])
        tokens, positions, segments = (put(a, data) for a in (tokens, positions, segments))
        prompt_lens, stop_ids = put(prompt_lens, rows), put(stop_ids, rep)
    args = (tokens, positions, segments, prompt_lens, stop_ids, temperature, top_p, rng)

    key = (graphdef, _signature(state), B, P, N, pad_id, greedy, top_k, use_top_p, len(stop_ids),
           jax.typeof(rng) if hasattr(jax, "typeof") else (rng.shape, rng.dtype), mesh, rules)
    fn = _COMPILED.get(key)
    if fn is None:
        log.info(f"compiling generate for batch={B} prompt={P} new={N}")
        fn = _build(graphdef, cfg, B, P, N, pad_id, greedy, top_k, use_top_p, rules if mesh is not None else None)
        _COMPILED[key] = fn

    if mesh is not None:
        with jax.set_mesh(mesh):
            out = fn(state, *args)
    else:
        out = fn(state, *args)
    return {k: _to_host(v)[:n_real] for k, v in out.items()}


def _to_host(x) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)
