"""The colocated JAX sampler: samples with the training parameters themselves (no copy), prefill
of a left-padded prompt block, then decode in `lax.while_loop`s.

    sampler = ColocatedSampler(model, pad_id=tok.pad_id, mesh=mesh, rules=rules)
    sampler.update_weights(state["params"], version=step)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0), key)
    out.tokens, out.mask, out.logprobs, out.lengths, out.version   # numpy, one row per prompt

Everything from prefill to the last token runs inside one jitted function (no Python loop over
tokens, no host sync). Shapes are bucketed so that a run compiles a bounded number of times:

  - prompt block P: the longest prompt rounded up to a power of two, at least `MIN_PROMPT_BUCKET`;
  - batch B: the number of prompts rounded up to a power of two, then (under a mesh) up to a
    multiple of the number of devices the `batch` axis is split over; pad rows are dropped;
  - N = max_new_tokens is used as given.

A prompt given several times (GRPO's n samples of a prompt) is prefilled once: the prefill runs
on the distinct prompts, its rows bucketed like B, and each of the B rows then decodes from a copy
of its prompt's cache row and first-token logits (every row still draws its own noise).

Programs are compiled through the run's CompileCache, keyed by the graph, B, P, N, the static
sampling choices and the parameter shapes and shardings; every compile is logged. Temperature,
top-p and the stop ids are runtime values: changing them does not recompile (only greedy vs
sampling, top-k, top-p on/off and the number of stop ids are static). The model is used only
through the model interface (call, hidden_states with a cache, logits, decode_weights,
for_decoding, init_cache, cache_axes).

The model's `decode_weights` (our decoder's layer weights sliced out of their stacks) are made by a
program of their own at a weight version's first call and kept for its later ones, until the next
update_weights or `release`: evaluations and rounds of rollouts sample many times per version. Made
inside every call instead they cost the Tunix benchmark's call (16 x 64 + 128, CPU) about 7%: the
copy, and faulting in the fresh pages XLA:CPU allocates a call's temporaries in.

The decode runs in `cache_phases` loops over near-equal spans of the N tokens, the KV cache grown
by empty columns at each one's start: attention reads the prompt and the tokens so far rounded up
to the phase's end, not all P + N columns (the sampler 1.05x faster at 16 x 64 prompt tokens + 128,
1.19x at + 512, with 4 phases on the Tunix benchmark's checkpoint, CPU). Each phase compiles its own
loop body, so compile time grows with their number.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import sharding
from unitrain.rollout.base import Completions, SamplingParams
from unitrain.step import CompileCache, full_rows_to_global, in_mesh, to_host

log = logging.getLogger("unitrain")

MIN_PROMPT_BUCKET = 16


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


FEW_ROWS = 32


def compiler_options(rows_per_device: int) -> dict | None:
    """XLA options of a sampler program whose decode steps run `rows_per_device` rows (None: XLA's
    defaults). On CPU with at most FEW_ROWS rows, the dots go to XLA's own emitter instead of
    YNNPACK's library fusions (reductions stay with YNNPACK): the generate call's time on the Tunix
    benchmark's checkpoint, 64 prompt tokens + 128, 2-core CPU, by rows: 8 1.28x, 16 1.19-1.22x,
    32 1.10x faster; 64 1.00x; 128 0.87x, the reason for the bound. Same tokens in every case."""
    if sharding.target_platform() != "cpu" or rows_per_device > FEW_ROWS:
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


# ---------------------------------------------------------------------------------------------
# Sampling from one step's logits


def _sample(logits, key, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool):
    """-> (token [B] int32, logprob [B] float32) of the token under the distribution it came from."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = _argmax(logits)
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
        # jax.random.categorical's Gumbel-max draw, with its noise and a faster argmax.
        token = _argmax(scaled + _gumbel(key, scaled.shape))
    return token, _logprob(logits if greedy else scaled, token)


def _gumbel(key, shape):
    """jax.random.gumbel(key, shape) of a threefry key, bit for bit, with the hash unrolled: XLA:CPU
    runs JAX's threefry as a loop over whole uint32 arrays, 2-3x slower than this one fused pass."""
    k1, k2 = jax.random.key_data(key)
    count = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)  # < 2**32: the high word is 0
    bits = _threefry2x32(k1, k2, jnp.zeros_like(count), count)
    unit = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
    tiny = jnp.finfo(jnp.float32).tiny
    return -jnp.log(-jnp.log(jnp.maximum(tiny, unit * (1.0 - tiny) + tiny)))


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x0, x1):
    """Threefry-2x32, 20 rounds, of the counter words (x0, x1) under the key (k1, k2): the xor of
    the two output words, as jax.random's bits."""
    u = np.uint32
    ks = (k1, k2, k1 ^ k2 ^ u(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for n in range(5):
        for r in _ROTATIONS[n % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u(r)) | (x1 >> u(32 - r))) ^ x0
        x0, x1 = x0 + ks[(n + 1) % 3], x1 + ks[(n + 2) % 3] + u(n + 1)
    return x0 ^ x1


def _argmax(x):
    """jnp.argmax over the last axis (the first maximum) as two plain reductions: XLA:CPU runs
    argmax's (value, index) reduction unvectorised, about 3x slower over a row of logits."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _logprob(logits, token):
    """log_softmax(logits)[token] without the [B, V] log_softmax."""
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


# ---------------------------------------------------------------------------------------------
# The jitted program


def sharded_cache(model, batch: int, length: int, rules):
    """The model's empty KV cache, constrained to the shardings its logical axes get under `rules`
    (None: unconstrained). Call inside a jitted function."""
    return constrain_cache(model, model.init_cache(batch, length), rules)


def constrain_cache(model, cache, rules):
    """`cache` constrained to the shardings its logical axes get under `rules` (None: as it is)."""
    if rules is None:
        return cache
    specs = jax.tree.map(
        lambda axes: sharding.logical_to_spec(axes, rules), model.cache_axes(), is_leaf=lambda x: isinstance(x, tuple)
    )
    return jax.lax.with_sharding_constraint(cache, specs)


def cache_rows(model, cache, rows, rules):
    """The cache rows `rows` [B] (indices along the `batch` axis), constrained as `constrain_cache`."""
    take = lambda x, axes: jnp.take(x, rows, axis=axes.index("batch"))
    return constrain_cache(model, jax.tree.map(take, cache, model.cache_axes()), rules)


def grown_cache(model, cache, columns: int, rules):
    """`cache` with `columns` more empty columns: every array zero-padded along its `length` axis
    (the model interface's promise, models/base.py), constrained as `constrain_cache`."""
    pad = lambda x, axes: jnp.pad(x, [(0, columns if name == "length" else 0) for name in axes])
    return constrain_cache(model, jax.tree.map(pad, cache, model.cache_axes()), rules)


def phase_ends(new_tokens: int, phases: int) -> list[int]:
    """The token counts at which the decode loop's phases end: `phases` near-equal spans of
    `new_tokens` (fewer when there are fewer tokens than phases)."""
    return sorted({-(-new_tokens * (j + 1) // phases) for j in range(phases)})


def _build(
    graphdef,
    B: int,
    P: int,
    N: int,
    pad_id: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    cache_rules,
    cache_phases: int,
):
    ends = phase_ends(N, cache_phases)

    def run(params, decode, tokens, positions, segments, prompt_lens, source, stop_ids, temperature, top_p, rng):
        """decode: the model's decode_weights; tokens, positions, segments: the prefill block of the
        distinct prompts; prompt_lens [B]; source [B]: each row's prefill row (None: the block is the
        B rows themselves)."""
        # Prefill and decode steps alike run on the decode weights: no layer's slices copied.
        model = nnx.merge(graphdef, params).for_decoding(decode)
        cache = sharded_cache(model, tokens.shape[0], P + ends[0], cache_rules)
        sample = lambda logits, i: _sample(
            logits, jax.random.fold_in(rng, i), temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p
        )
        is_stop = lambda t: jnp.any(t[:, None] == stop_ids[None, :], axis=-1)

        hidden, cache = model.hidden_states(tokens, positions, segments, cache)
        # Left padding: every real row's last prompt token sits in the last column, the only one
        # sampled from, so the output head runs on it alone.
        logits = model.logits(hidden[:, -1:])[:, 0]
        if source is not None:
            logits, cache = logits[source], cache_rows(model, cache, source, cache_rules)
        token, logprob = sample(logits, 0)
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
        # Token i writes cache column P + i - 1, so the phase of the tokens before `end` fits in P + end
        # columns (the last spare, as in one loop's P + N) and attends over those alone.
        for start, end in zip([0, *ends], ends):
            if start:
                i, cache, *rest = carry
                carry = (i, grown_cache(model, cache, end - start, cache_rules), *rest)
            carry = jax.lax.while_loop(lambda c, end=end: cond(c) & (c[0] < end), body, carry)
        _, _, out_tokens, out_mask, out_logprobs, _, _ = carry
        return {
            "tokens": out_tokens,
            "mask": out_mask,
            "logprobs": out_logprobs,
            "lengths": out_mask.sum(axis=1, dtype=jnp.int32),
        }

    return jax.jit(run)


class ColocatedSampler:
    """The sampler interface (rollout/base.py) over parameters that live where training keeps them.

    Under a mesh the parameters must already be sharded; the prompt block is split over the
    logical `batch` axis of `rules`. With several processes every process passes the same prompts
    and gets the whole result back. Top-k keeps every token tied with the k-th largest logit.
    `cache_phases` (config rollout_cache_phases): the decode loop's phases (module docstring).
    """

    def __init__(
        self,
        model,
        *,
        pad_id: int = 0,
        mesh=None,
        rules=None,
        programs: CompileCache | None = None,
        cache_phases: int = 1,
    ):
        self.graphdef, params = nnx.split(model)
        self.params, self.version, self.decode = nnx.to_pure_dict(params), 0, None
        self.vocab_size, self.pad_id, self.mesh, self.cache_phases = model.vocab_size, pad_id, mesh, cache_phases
        self.rules = sharding.rules_from_config(rules or sharding.DEFAULT_RULES) if mesh is not None else None
        self.parallelism = batch_parallelism(mesh, self.rules) if mesh is not None else 1  # devices the rows split over
        self.programs = programs if programs is not None else CompileCache(mesh)

    def update_weights(self, params, version: int) -> None:
        self.params, self.version = params, version  # colocated: the trainer's own arrays, no copy
        self.release()

    def release(self) -> None:
        """Drops the decode weights made from the current parameters (a copy of the layer weights
        where `copies_weight_slices`); the next call makes them again. The trainer calls it when it
        will not sample before its next update, so that they do not add to the update's memory."""
        self.decode = None

    def decode_weights(self):
        """The model's `decode_weights` of the current parameters, made once (module docstring).
        Of abstract parameters (bench's --compile-only), their abstract arrays."""
        if self.decode is None:
            graphdef = self.graphdef
            make = self.programs.compiled(
                "decode weights",
                None,
                self.params,
                static=(graphdef,),
                build=lambda: jax.jit(lambda p: nnx.merge(graphdef, p).decode_weights()),
            )
            abstract = isinstance(jax.tree.leaves(self.params)[0], jax.ShapeDtypeStruct)
            self.decode = make.out_info if abstract else make(self.params)
        return self.decode

    def block_shape(self, n_prompts: int, longest: int) -> tuple[int, int]:
        """(rows, prompt columns) of the left-padded block that generate and beam_search run for
        `n_prompts` prompts of at most `longest` tokens: both bucketed, the rows to a multiple of
        the mesh's batch parallelism."""
        return bucket_batch_size(n_prompts, self.parallelism), bucket_prompt_length(longest)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array) -> Completions:
        """`logprobs` is each sampled token's log-prob under the temperature-scaled, top-k/top-p
        filtered distribution it was drawn from (greedy: log-softmax of the raw logits)."""
        return self.submit(prompt_ids, sampling, key).result()

    def submit(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array) -> Pending:
        """generate, dispatched: returns at once while the devices sample; `.result()` waits for the
        Completions. Later calls (a train step on other devices) run meanwhile."""
        program, args = self.program(prompt_ids, sampling, key)
        return Pending(program(*args), len(prompt_ids), self.version, self.mesh)

    def program(self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array):
        """(the compiled generate program, its arguments) for these prompts: compiled once per bucket
        and static choice (module docstring). The weights may be abstract (jax.ShapeDtypeStruct with
        their shardings): tools/bench.py sizes the program's memory that way without running it."""
        if self.params is None:
            raise RuntimeError("the sampler has no weights yet: call update_weights first")
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt")
        lens = np.asarray([len(p) for p in prompt_ids], np.int32)
        if lens.min() < 1:
            raise ValueError("every prompt needs at least one token")
        N = sampling.max_new_tokens
        B, P = self.block_shape(len(prompt_ids), int(lens.max()))
        distinct, source = _distinct(prompt_ids, B)
        R = self.block_shape(len(distinct), int(lens.max()))[0]
        if R < B:
            block = _left_padded(distinct, R, P, self.pad_id)
            block["prompt_lens"], block["source"] = np.pad(lens, (0, B - len(lens))), source
        else:
            block = _left_padded(prompt_ids, B, P, self.pad_id)
        greedy = sampling.temperature == 0.0
        top_k = 0 if greedy or sampling.top_k >= self.vocab_size else sampling.top_k
        use_top_p = not greedy and sampling.top_p < 1.0
        stop_ids = np.asarray(sampling.stop_token_ids, np.int32).reshape(-1)
        if self.mesh is not None:
            rows2d = sharding.batch_sharding(self.mesh, self.rules)
            rows = sharding.batch_sharding(self.mesh, self.rules, ("batch",))
            block = full_rows_to_global(block, {k: rows2d if v.ndim == 2 else rows for k, v in block.items()})
            stop_ids = full_rows_to_global({"stop": stop_ids}, sharding.replicated(self.mesh))["stop"]
            # The key may come from another mesh (the trainer's) or another process's device: its bits
            # are placed like any other input.
            bits = full_rows_to_global({"key": np.asarray(jax.random.key_data(key))}, sharding.replicated(self.mesh))
            key = jax.random.wrap_key_data(bits["key"])
        args = (
            self.params,
            self.decode_weights(),
            block["tokens"],
            block["positions"],
            block["segments"],
            block["prompt_lens"],
            block.get("source"),
            stop_ids,
            np.float32(sampling.temperature if not greedy else 1.0),
            np.float32(sampling.top_p),
            key,
        )
        static = (self.graphdef, B, P, N, self.pad_id, greedy, top_k, use_top_p, self.rules, self.cache_phases)
        batch = f"batch={B} prefill rows={R}" if R < B else f"batch={B}"
        program = self.programs.compiled(
            f"generate ({batch} prompt={P} new={N} cache phases={len(phase_ends(N, self.cache_phases))})",
            None,
            *args,
            static=static,
            build=lambda: _build(*static),
            options=compiler_options(B // self.parallelism),
        )
        return program, args

    def beam_search(self, prompt_ids: list[list[int]], beams, key: jax.Array):
        """The `beams.width` best sequences of each prompt with their total logprobs (rollout/beam.py:
        beam search or W-way sampling, optionally constrained to a trie), from the same bucketed
        prompt block and compile cache as generate."""
        from unitrain.rollout import beam  # beam.py builds on this module

        lens = [len(p) for p in prompt_ids]
        if not lens or min(lens) < 1:
            raise ValueError("beam_search needs prompts of at least one token")
        block = _left_padded(prompt_ids, *self.block_shape(len(lens), max(lens)), self.pad_id)
        with in_mesh(self.mesh):
            return beam.search(self, block, len(lens), beams, key)


class Pending:
    """A dispatched generate: its device arrays and the version of the weights it samples with."""

    def __init__(self, out: dict, n_real: int, version: int, mesh):
        self.out, self.n_real, self.version, self.mesh = out, n_real, version, mesh

    def result(self) -> Completions:
        with in_mesh(self.mesh):  # gathering them runs on their mesh, which may not be the caller's
            out = {k: to_host(v)[: self.n_real] for k, v in self.out.items()}
        return Completions(out["tokens"], out["mask"], out["logprobs"], out["lengths"], self.version)


def _distinct(prompt_ids: list[list[int]], B: int) -> tuple[list[list[int]], np.ndarray]:
    """(the distinct prompts in order of first appearance, [B] int32: each row's index among them;
    rows past the prompts point at the first)."""
    index: dict[tuple, int] = {}
    source = np.zeros((B,), np.int32)
    for b, p in enumerate(prompt_ids):
        source[b] = index.setdefault(tuple(p), len(index))
    return [list(p) for p in index], source


def _left_padded(prompt_ids: list[list[int]], B: int, P: int, pad_id: int) -> dict:
    """The prompt block: each prompt ends in the last column; rows past the prompts are all padding."""
    block = {
        "tokens": np.full((B, P), pad_id, np.int32),
        "positions": np.zeros((B, P), np.int32),
        "segments": np.zeros((B, P), np.int32),
        "prompt_lens": np.zeros((B,), np.int32),
    }
    for b, p in enumerate(prompt_ids):
        n = len(p)
        block["tokens"][b, P - n :] = p
        block["positions"][b, P - n :] = np.arange(n)
        block["segments"][b, P - n :] = 1
        block["prompt_lens"][b] = n
    return block


def from_run(run) -> ColocatedSampler:
    """The sampler factory of `sampler: colocated`."""
    return ColocatedSampler(
        run.model,
        pad_id=run.tokenizer.pad_id,
        mesh=run.mesh,
        rules=run.rules,
        programs=run.programs,
        cache_phases=run.cfg.rollout_cache_phases,
    )
