"""The colocated JAX sampler: samples with the training parameters themselves (no copy), prefill
of a left-padded prompt block, then decode in `lax.while_loop`s.

    sampler = ColocatedSampler(model, pad_id=tok.pad_id, mesh=mesh, rules=rules)
    sampler.update_weights(state["params"], version=step)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=64, temperature=1.0), key)
    out.tokens, out.mask, out.logprobs, out.lengths, out.version   # numpy, one row per prompt

Everything from prefill to the last token runs inside one jitted function (no Python loop over
tokens, no host sync). Shapes are bucketed (engines/buckets.py) so that a run compiles a bounded
number of times:

  - prompt block P: the longest prompt rounded up to a power of two, at least `MIN_PROMPT_BUCKET`;
  - batch B: the number of prompts rounded up to a power of two, then (under a mesh) up to a
    multiple of the number of devices the `batch` axis is split over; pad rows are dropped;
  - N = max_new_tokens is used as given.

A prompt given several times (GRPO's n samples of a prompt) is prefilled once: the prefill runs
on the distinct prompts, its rows bucketed like B, and each of the B rows then decodes from a copy
of its prompt's cache row and first-token logits (every row still draws its own noise).

Programs are compiled through the run's CompileCache, keyed by a GenerateKey (the graph, B, the
prefill rows, P, N, the cache phases, the static sampling choices) and the shapes and shardings of
the GenerateInputs (parameters, prompt block, ...); every compile is logged. Temperature,
top-p and the stop ids are runtime values: changing them does not recompile (only greedy vs
sampling, top-k, top-p on/off and the number of stop ids are static). The model is used only
through the model interface (call, hidden_states with a cache, logits, decode_weights,
for_decoding, init_cache, cache_axes).

The model's `decode_weights` (our decoder's layer weights sliced out of their stacks) are made by a
program of their own at a weight version's first call and kept for its later ones, until the next
update_weights or `release`: evaluations and rounds of rollouts sample many times per version. Made
inside every call instead they would cost every call the copy, and faulting in the fresh pages
XLA:CPU allocates a call's temporaries in.

The decode runs in `cache_phases` loops over near-equal spans of the N tokens, the KV cache grown
by empty columns at each one's start: attention reads the prompt and the tokens so far rounded up
to the phase's end, not all P + N columns (the more new tokens, the more it saves). Each phase
compiles its own loop body, so compile time grows with their number.

A row ends at a stop token or at its budget (SamplingParams.row_budgets, else N). With compaction
(`rollout_compaction`: the fewest rows it compacts into) the phases stop once the rows still running
fit the next smaller row bucket, and from there the running rows decode in ever smaller buckets
(programs.compacted), so that ended rows stop costing: one more loop body per bucket. Each row's
noise is drawn by its index in the call, so a compacted row draws the tokens it would have drawn
uncompacted. Figures: docs/PERFORMANCE.md.

With `quantization` (rollout_quantization: int8 | fp8) the decode weights are the model's weight-only
quantised ones (models/quant.py, qwix: one scale per output channel), made at a version's first call
as above: the sampler samples from, and records the logprobs of, the quantised model, while the
trainer keeps its full-precision parameters; `rollout_is` corrects for the gap, which the RL step
logs as sampler_trainer_logprob_gap. Prefill, decode, beam search and the generation evals all run
on them.

With `SamplingParams.record_routes` (routing replay) the program also returns the experts every
token ran in each MoE layer, collected from the model's reports (models/moe.py) around the prefill
and each decode step; they are per-row fields, so compaction moves them with their rows.

Prompts with images (a vision-language model's, `images`: a data.images.PromptImages per prompt or
None): a prompt is one prefill row per distinct ids and images, whose images the tower encodes in
the program, once, for every row sampled from it (the prefill rows' patches padded to the
`image_patches` budget, qwen2_5_vl.image_rows: one compiled shape); the prefill takes M-RoPE's
positions (made on the host), and each decode step rotates its token at its position plus its row's
rope delta on all three axes, as transformers' generate does. The decode steps never see pixels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from unitrain import sharding
from unitrain.compile_cache import CompileCache, in_mesh
from unitrain.engines import beam
from unitrain.engines.base import Completions, SamplingParams
from unitrain.engines.buckets import batch_parallelism, bucket_batch_size, bucket_prompt_length, row_buckets
from unitrain.engines.programs import (
    PromptBlock,
    argmax,
    cache_rows,
    compacted,
    compiler_options,
    constrain_cache,
    first_bucket_done,
    gumbel_noise,
    left_padded,
    sharded_cache,
)
from unitrain.models import moe, qwen2_5_vl
from unitrain.sharding import full_rows_to_global, to_host

# ---------------------------------------------------------------------------------------------
# Sampling from one step's logits


def _sample(logits, key, rows, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool):
    """-> (token [B] int32, logprob [B] float32) of the token under the distribution it came from;
    `rows` [B]: each row's index in the call, which picks its noise."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = argmax(logits)
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
        token = argmax(scaled + gumbel_noise(key, rows, scaled.shape[-1]))
    return token, _logprob(logits if greedy else scaled, token)


def _logprob(logits, token):
    """log_softmax(logits)[token] without the [B, V] log_softmax."""
    picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


# ---------------------------------------------------------------------------------------------
# The jitted program


def grown_cache(model, cache, columns: int, rules):
    """`cache` with `columns` more empty columns: every array zero-padded along its `length` axis
    (the model interface's promise, models/base.py), constrained as `constrain_cache`."""
    pad = lambda x, axes: jnp.pad(x, [(0, columns if name == "length" else 0) for name in axes])
    return constrain_cache(model, jax.tree.map(pad, cache, model.cache_axes()), rules)


def phase_ends(new_tokens: int, phases: int) -> list[int]:
    """The token counts at which the decode loop's phases end: `phases` near-equal spans of
    `new_tokens` (fewer when there are fewer tokens than phases)."""
    return sorted({-(-new_tokens * (j + 1) // phases) for j in range(phases)})


@dataclasses.dataclass(frozen=True)
class GenerateKey:
    """What one generate program is compiled for (its key in the compile cache, beside the inputs'
    shapes): the model, the block's shape and the static sampling choices."""

    graphdef: Any
    cache_rules: Any  # the sampler's sharding rules under a mesh; None: no mesh
    pad_id: int
    rows: int  # B: the prompts, bucketed
    prefill_rows: int  # R: the distinct prompts, bucketed as B; R == B: every row prefills its own
    prompt_columns: int  # P
    new_tokens: int  # N
    cache_phases: int  # as configured (phase_ends: the phases the program runs)
    greedy: bool
    top_k: int  # 0: off
    use_top_p: bool
    # The row counts the decode compacts its running rows into, B first; () or (B,): no compaction.
    row_buckets: tuple[int, ...] = ()
    record_routes: bool = False  # routing replay: each token's experts per MoE layer (SamplingParams)
    images: bool = False  # the prompts carry images (GenerateInputs.images)

    def phase_ends(self) -> list[int]:
        return phase_ends(self.new_tokens, self.cache_phases)

    def name(self) -> str:
        """The program's name in the compile log."""
        batch = f"batch={self.rows}" + (f" prefill rows={self.prefill_rows}" if self.prefill_rows < self.rows else "")
        phases = len(self.phase_ends())
        compaction = ""
        if len(self.row_buckets) > 1:
            compaction = f" compacted into rows {'/'.join(map(str, self.row_buckets[1:]))}"
        images = " with images" if self.images else ""
        return f"generate ({batch} prompt={self.prompt_columns}{images} new={self.new_tokens} cache phases={phases}{compaction})"


@struct.dataclass
class GenerateInputs:
    """The generate program's runtime inputs: other values of these do not recompile it."""

    params: Any  # the model's pure dict of parameters
    decode: Any  # the model's decode_weights of them
    block: PromptBlock  # the prefill rows of the distinct prompts (source: each row's), B rows' lengths
    budgets: Any  # [B] int32: the most tokens each row samples (N unless the call says less)
    stop_ids: Any  # [S] int32
    temperature: Any  # float32 scalar (1 when greedy)
    top_p: Any  # float32 scalar
    rng: Any  # the call's key
    # [B] int32, replicated: each row's index in the sampler call this one is a share of, which picks
    # its noise (engines/mesh.py spreads a call's rows over meshes; they draw as in one call)
    noise_rows: Any
    # Prompts with images: the prefill rows' qwen2_5_vl.image_rows fields, `rope_positions` [R, P, 3]
    # and `rope_deltas` [R] (qwen2_5_vl.prompt_rope); None: text prompts.
    images: Any = None


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    """One generate call: the key of the program it runs and that program's inputs."""

    key: GenerateKey
    inputs: GenerateInputs


@struct.dataclass
class DecodeState:
    """The decode loop's state: the outputs so far and what the next step starts from. Per row
    (along the cache's `batch` axis): every field but `i`. Compaction moves rows, so each carries
    its index in the call (`rows`: its noise, its place in the output) and its own lengths."""

    i: jax.Array  # the index of the token the next step samples
    cache: Any
    tokens: jax.Array  # [B, N] int32, pad_id where nothing was emitted
    mask: jax.Array  # [B, N] int32, 1 on the emitted tokens
    logprobs: jax.Array  # [B, N] float32, 0 where nothing was emitted
    done: jax.Array  # [B] bool: the row emitted a stop token or its budget, or is batch padding
    last: jax.Array  # [B] int32: the token the next step reads (pad_id once done)
    rows: jax.Array  # [B] int32: the row's index in the call
    prompt_lens: jax.Array  # [B] int32
    budgets: jax.Array  # [B] int32
    # With record_routes (else None): [B, N, L, k] int32, each sampled token's experts (Completions.routes),
    # and [B, P, L, k] the prompt's, set by the prefill (it rides along uncompacted: no step writes it).
    routes: Any = None
    prompt_routes: Any = None
    rope_deltas: Any = None  # [B] int32 with images: the row's M-RoPE shift of every sampled position


_ROW_FIELDS = ("tokens", "mask", "logprobs", "done", "last", "rows", "prompt_lens", "budgets")
_OUTPUT_FIELDS = ("tokens", "mask", "logprobs")


def _fields(key: GenerateKey, fields: tuple[str, ...]) -> tuple[str, ...]:
    """The per-row fields (or outputs) of the decode state: with routes recorded, `routes` too."""
    return (*fields, "routes") if key.record_routes else fields


def _routed(model, call):
    """call() -> (its result, the experts [B, T, L, k] int32 of the model's MoE layers in it): the
    forward's reported RouterStats (models/moe.py), the last report being the call's."""
    with moe.collect_router_stats() as collected:
        out = call()
    experts = collected[-1].experts  # [L, B * T, k]
    return out, jnp.moveaxis(experts.reshape(experts.shape[0], *out[0].shape[:2], -1), 0, 2)


def _draw(key: GenerateKey, inputs: GenerateInputs, logits, i, rows):
    """The token of step `i` of every row and its logprob: noise of the step and of the row's index
    (`rows`: in this call; its noise: in the call it is a share of)."""
    rng = jax.random.fold_in(inputs.rng, i)
    return _sample(
        logits,
        rng,
        inputs.noise_rows[rows],
        inputs.temperature,
        inputs.top_p,
        greedy=key.greedy,
        top_k=key.top_k,
        use_top_p=key.use_top_p,
    )


def _ended(token, i, budgets, stop_ids):
    """[B] bool: a row that emitted `token` as its token `i` ends (a stop id, or its budget reached)."""
    return jnp.any(token[:, None] == stop_ids[None, :], axis=-1) | (i + 1 >= budgets)


def _first_token(model, key: GenerateKey, inputs: GenerateInputs, columns: int) -> DecodeState:
    """The prefill of the block into a cache of `columns` columns past the prompt, and the first
    token drawn from its last column."""
    block, B, N, pad_id = inputs.block, key.rows, key.new_tokens, key.pad_id
    cache = sharded_cache(model, block.tokens.shape[0], key.prompt_columns + columns, key.cache_rules)
    images, deltas = {}, None
    if key.images:  # each prefill row's images encoded once, for every row sampled from its prompt
        images = {"image_features": model.encode_rows(inputs.images), "rope_positions": inputs.images["rope_positions"]}
        deltas = inputs.images["rope_deltas"]
    prefill = lambda: model.hidden_states(block.tokens, block.positions, block.segments, cache, **images)  # noqa: E731
    prompt_routes = None
    if key.record_routes:
        (hidden, cache), prompt_routes = _routed(model, prefill)
        prompt_routes = jnp.where(block.segments[:, :, None, None] > 0, prompt_routes, -1)
    else:
        hidden, cache = prefill()
    # Left padding: every real row's last prompt token sits in the last column, the only one
    # sampled from, so the output head runs on it alone.
    logits = model.logits(hidden[:, -1:])[:, 0]
    if block.source is not None:
        logits, cache = logits[block.source], cache_rows(model, cache, block.source, key.cache_rules)
        prompt_routes = None if prompt_routes is None else prompt_routes[block.source]
        deltas = None if deltas is None else deltas[block.source]
    rows = jnp.arange(B, dtype=jnp.int32)
    token, logprob = _draw(key, inputs, logits, 0, rows)
    done = block.prompt_lens == 0  # batch-padding rows never emit
    emit = ~done
    return DecodeState(
        i=jnp.int32(1),
        cache=cache,
        tokens=jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(jnp.where(emit, token, pad_id)),
        mask=jnp.zeros((B, N), jnp.int32).at[:, 0].set(emit.astype(jnp.int32)),
        logprobs=jnp.zeros((B, N), jnp.float32).at[:, 0].set(jnp.where(emit, logprob, 0.0)),
        done=done | _ended(token, 0, inputs.budgets, inputs.stop_ids),
        last=jnp.where(emit, token, pad_id),
        rows=rows,
        prompt_lens=block.prompt_lens,
        budgets=inputs.budgets,
        routes=None if prompt_routes is None else jnp.full((B, N, *prompt_routes.shape[2:]), -1, jnp.int32),
        prompt_routes=prompt_routes,
        rope_deltas=deltas,
    )


def _next_token(model, key: GenerateKey, inputs: GenerateInputs, state: DecodeState) -> DecodeState:
    """One decode step: every row's next token from the cache and its last token."""
    i, B = state.i, state.done.shape[0]
    pos = (state.prompt_lens + i - 1)[:, None]
    # With images the token's M-RoPE position: its position shifted by its row's delta on every axis.
    rope = (
        {}
        if state.rope_deltas is None
        else {"rope_positions": jnp.repeat((pos + state.rope_deltas[:, None])[..., None], 3, -1)}
    )
    forward = lambda: model(state.last[:, None], pos, jnp.ones((B, 1), jnp.int32), state.cache, **rope)  # noqa: E731
    emit = ~state.done
    routes = state.routes
    if key.record_routes:
        # The routes of token i - 1, read as this step's input; kept only while its row runs on (a
        # row's last token is never read on a compacted decode, so nowhere).
        (logits, cache), read = _routed(model, forward)
        routes = jax.lax.dynamic_update_slice_in_dim(routes, jnp.where(emit[:, None, None, None], read, -1), i - 1, 1)
    else:
        logits, cache = forward()
    token, logprob = _draw(key, inputs, logits[:, 0], i, state.rows)
    token = jnp.where(emit, token, key.pad_id)
    col = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v[:, None].astype(a.dtype), i, axis=1)
    return state.replace(
        routes=routes,
        i=i + 1,
        cache=cache,
        tokens=col(state.tokens, token),
        mask=col(state.mask, emit),
        logprobs=col(state.logprobs, jnp.where(emit, logprob, 0.0)),
        done=state.done | _ended(token, i, state.budgets, inputs.stop_ids),
        last=token,
    )


def _build(key: GenerateKey):
    """The jitted generate program of `key`: GenerateInputs -> {tokens, mask, logprobs, lengths}."""
    ends = key.phase_ends()

    def run(inputs: GenerateInputs) -> dict:
        # Prefill and decode steps alike run on the decode weights: no layer's slices copied.
        model = nnx.merge(key.graphdef, inputs.params).for_decoding(inputs.decode)
        state = _first_token(model, key, inputs, ends[0])
        step = lambda s: _next_token(model, key, inputs, s)
        # Token i writes cache column P + i - 1, so the phase of the tokens before `end` fits in P + end
        # columns (the last spare, as in one loop's P + N) and attends over those alone.
        # With compaction the phases end early, once the running rows fit the next row bucket;
        # the buckets' loops attend over the whole cache (one loop body each, not one per phase).
        running = lambda s: ~s.done
        for start, end in zip([0, *ends], ends):
            if start:
                state = state.replace(cache=grown_cache(model, state.cache, end - start, key.cache_rules))
            more = lambda s, end=end: (s.i < end) & ~first_bucket_done(s, key.row_buckets, 1, running)
            state = jax.lax.while_loop(more, step, state)
        state = compacted(
            model,
            state,
            step,
            buckets=key.row_buckets,
            group=1,
            running=running,
            stop=key.new_tokens,
            fields=(*_fields(key, _ROW_FIELDS), *("rope_deltas",) * key.images),
            outputs=_fields(key, _OUTPUT_FIELDS),
            rules=key.cache_rules,
        )
        routes = {"routes": state.routes, "prompt_routes": state.prompt_routes} if key.record_routes else {}
        return {
            "tokens": state.tokens,
            "mask": state.mask,
            "logprobs": state.logprobs,
            "lengths": state.mask.sum(axis=1, dtype=jnp.int32),
            **routes,
        }

    return jax.jit(run)


class ColocatedSampler:
    """The sampler interface (engines/base.py) over parameters that live where training keeps them.

    Under a mesh the parameters must already be sharded; the prompt block is split over the
    logical `batch` axis of `rules`. With several processes every process passes the same prompts
    and gets the whole result back. Top-k keeps every token tied with the k-th largest logit.
    `cache_phases` (config rollout_cache_phases): the decode loop's phases (module docstring).
    `compaction` (config rollout_compaction): as rows end, the decode gathers the rows still running
    into smaller row buckets, down to this many rows; 0: off (module docstring). Decodes of fewer
    than `compaction_min_tokens` new tokens are not compacted: their buckets' compiles would cost
    more than the ended rows do. `quantization` (config rollout_quantization, int8 | fp8): the
    sampler's copy of the weights, its decode weights, weight-only quantised (module docstring).
    `image_patches` (config max_image_patches): the patches a prefill row's images fill at most.
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
        compaction: int = 0,
        compaction_min_tokens: int = 0,
        quantization: str = "none",
        image_patches: int = 0,
    ):
        self.graphdef, params = nnx.split(model)
        # With images: the tower's config and the image pad, which the host-made inputs need.
        self.image_patches, self.vision = image_patches, None
        if image_patches:
            self.vision = (model.vision.cfg, model.cfg.image_token_id)
        self.quantization = quantization
        self.params, self.version, self.decode = nnx.to_pure_dict(params), 0, None
        self.vocab_size, self.pad_id, self.mesh, self.cache_phases = model.vocab_size, pad_id, mesh, cache_phases
        self.compaction, self.compaction_min_tokens = compaction, compaction_min_tokens
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
        """The model's `decode_weights` of the current parameters, made once (module docstring),
        quantised as `quantization` says. Of abstract parameters (bench's --compile-only), their
        abstract arrays."""
        if self.decode is None:
            graphdef, quantised = self.graphdef, () if self.quantization == "none" else (self.quantization,)
            make = self.programs.compiled(
                "decode weights",
                None,
                self.params,
                static=(graphdef, *quantised),
                build=lambda: jax.jit(lambda p: nnx.merge(graphdef, p).decode_weights(*quantised)),
            )
            abstract = isinstance(jax.tree.leaves(self.params)[0], jax.ShapeDtypeStruct)
            self.decode = make.out_info if abstract else make(self.params)
        return self.decode

    def block_shape(self, n_prompts: int, longest: int) -> tuple[int, int]:
        """(rows, prompt columns) of the left-padded block that generate and beam_search run for
        `n_prompts` prompts of at most `longest` tokens: both bucketed, the rows to a multiple of
        the mesh's batch parallelism."""
        return bucket_batch_size(n_prompts, self.parallelism), bucket_prompt_length(longest)

    def row_buckets(self, rows: int, new_tokens: int, group: int = 1) -> tuple[int, ...]:
        """The row counts a decode of `rows` rows and `new_tokens` tokens compacts into, `rows` first:
        buckets.py's rule, down to `compaction` rows (just `rows` without compaction, or for a decode
        shorter than compaction_min_tokens). Counted in groups of `group` rows that move together
        (beam search: a prompt's beams)."""
        if new_tokens < self.compaction_min_tokens:
            return (rows,)
        fits = lambda b: self.compaction and self.compaction <= b * group and b < rows
        return (rows, *[b for b in row_buckets(rows, self.parallelism) if fits(b)])

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array, images=None
    ) -> Completions:
        """`logprobs` is each sampled token's log-prob under the temperature-scaled, top-k/top-p
        filtered distribution it was drawn from (greedy: log-softmax of the raw logits). `images`:
        each prompt's data.images.PromptImages or None (module docstring)."""
        return self.submit(prompt_ids, sampling, key, images).result()

    def submit(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array, images=None, rows=None
    ) -> Pending:
        """generate, dispatched: returns at once while the devices sample; `.result()` waits for the
        Completions. Later calls (a train step on other devices) run meanwhile. `rows`: the prompts'
        indices in a larger call they are a share of (their noise); default 0, 1, ..."""
        call = self.generate_call(prompt_ids, sampling, key, images, rows)
        return Pending(self.generate_program(call)(call.inputs), len(prompt_ids), self.version, self.mesh)

    def generate_call(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, key: jax.Array, images=None, rows=None
    ) -> GenerateCall:
        """The key of the generate program these prompts run (bucketed, module docstring) and its
        inputs, placed on the mesh. The weights may be abstract (jax.ShapeDtypeStruct with their
        shardings): tools/bench.py sizes the program's memory that way without running it."""
        if self.params is None:
            raise RuntimeError("the sampler has no weights yet: call update_weights first")
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt")
        lens = np.asarray([len(p) for p in prompt_ids], np.int32)
        if lens.min() < 1:
            raise ValueError("every prompt needs at least one token")
        images = images if images is not None and any(i is not None for i in images) else None
        block, firsts = self._prompt_block(prompt_ids, lens, images)
        B, greedy = len(block.prompt_lens), sampling.temperature == 0.0
        if sampling.row_budgets and len(sampling.row_budgets) != len(prompt_ids):
            raise ValueError(f"{len(sampling.row_budgets)} row budgets for {len(prompt_ids)} prompts")
        budgets = np.full((B,), sampling.max_new_tokens, np.int32)  # padding rows never emit anyway
        budgets[: len(prompt_ids)] = [sampling.budget(r) for r in range(len(prompt_ids))]
        noise_rows = np.arange(B, dtype=np.int32)  # padding rows' noise is never used
        if rows is not None:
            noise_rows[: len(prompt_ids)] = rows
        program_key = GenerateKey(
            graphdef=self.graphdef,
            cache_rules=self.rules,
            pad_id=self.pad_id,
            rows=B,
            prefill_rows=len(block.tokens),
            prompt_columns=block.tokens.shape[1],
            new_tokens=sampling.max_new_tokens,
            cache_phases=self.cache_phases,
            greedy=greedy,
            top_k=0 if greedy or sampling.top_k >= self.vocab_size else sampling.top_k,
            use_top_p=not greedy and sampling.top_p < 1.0,
            row_buckets=self.row_buckets(B, sampling.max_new_tokens),
            record_routes=sampling.record_routes,
            images=images is not None,
        )
        inputs = GenerateInputs(
            params=self.params,
            decode=self.decode_weights(),
            block=block,
            budgets=budgets,
            stop_ids=np.asarray(sampling.stop_token_ids, np.int32).reshape(-1),
            temperature=np.float32(sampling.temperature if not greedy else 1.0),
            top_p=np.float32(sampling.top_p),
            rng=key,
            noise_rows=noise_rows,
            images=None if images is None else self._image_inputs(block, [images[i] for i in firsts]),
        )
        return GenerateCall(program_key, inputs if self.mesh is None else self._on_mesh(inputs))

    def _prompt_block(self, prompt_ids: list[list[int]], lens: np.ndarray, images) -> tuple[PromptBlock, list[int]]:
        """The bucketed block of these prompts (`lens`: their lengths) and the prompt of each of its
        prefill rows: where a prompt (its ids and images) is given several times, the prefill rows
        of the distinct prompts and each row's source among them."""
        B, P = self.block_shape(len(prompt_ids), int(lens.max()))
        keys = [
            (tuple(p), None if images is None or images[b] is None else images[b].key) for b, p in enumerate(prompt_ids)
        ]
        firsts, source = _distinct(keys, B)
        R = self.block_shape(len(firsts), int(lens.max()))[0]
        if R == B:
            return left_padded(prompt_ids, B, P, self.pad_id), list(range(len(prompt_ids)))
        block = left_padded([prompt_ids[i] for i in firsts], R, P, self.pad_id)
        return block.replace(prompt_lens=np.pad(lens, (0, B - len(lens))), source=source), firsts

    def _image_inputs(self, block: PromptBlock, images: list) -> dict:
        """GenerateInputs.images of the block's prefill rows, whose prompts' images are `images`."""
        rows = [*images, *[None] * (len(block.tokens) - len(images))]
        vision, pad = self.vision
        rope, deltas = qwen2_5_vl.prompt_rope(block.tokens, block.segments, rows, pad, vision)
        return {
            **qwen2_5_vl.image_rows(rows, vision, self.image_patches),
            "rope_positions": rope,
            "rope_deltas": deltas,
        }

    def _on_mesh(self, inputs: GenerateInputs) -> GenerateInputs:
        """The inputs as global arrays: the block's rows split over the mesh, the rest replicated.
        With abstract weights (bench's --compile-only, maybe for devices that are not here), abstract."""
        abstract = isinstance(jax.tree.leaves(self.params)[0], jax.ShapeDtypeStruct)
        place = sharding.abstract_rows if abstract else full_rows_to_global
        replicated = sharding.replicated(self.mesh)
        replicated_rows = place({"stop": inputs.stop_ids, "noise": inputs.noise_rows}, replicated)
        rows, rows2d = (
            sharding.batch_sharding(self.mesh, self.rules, ("batch",)),
            sharding.batch_sharding(self.mesh, self.rules),
        )
        budgets = place({"budgets": inputs.budgets}, rows)
        images = inputs.images and place(
            inputs.images, {k: rows if v.ndim == 1 else rows2d for k, v in inputs.images.items()}
        )
        return inputs.replace(
            images=images,
            block=inputs.block.on_mesh(self.mesh, self.rules, place),
            budgets=budgets["budgets"],
            stop_ids=replicated_rows["stop"],
            noise_rows=replicated_rows["noise"],
            rng=jax.ShapeDtypeStruct((), inputs.rng.dtype, sharding=replicated) if abstract else self._key(inputs.rng),
        )

    def _key(self, key: jax.Array) -> jax.Array:
        """The key on this mesh. It may come from another mesh (the trainer's) or another process's
        device: its bits are placed like any other input."""
        bits = full_rows_to_global({"key": np.asarray(jax.random.key_data(key))}, sharding.replicated(self.mesh))
        return jax.random.wrap_key_data(bits["key"])

    def generate_program(self, call: GenerateCall):
        """The compiled generate program of `call.key` for inputs shaped as `call.inputs`: compiled
        (and logged) at its first call, from the run's compile cache after."""
        return self.programs.compiled(
            call.key.name(),
            None,
            call.inputs,
            static=call.key,
            build=lambda: _build(call.key),
            options=compiler_options(call.key.rows // self.parallelism),
        )

    def beam_search(self, prompt_ids: list[list[int]], beams: beam.BeamParams, key: jax.Array) -> beam.Ranked:
        """The `beams.width` best sequences of each prompt with their total logprobs (engines/beam.py:
        beam search or W-way sampling, optionally constrained to a trie), from the same bucketed
        prompt block and compile cache as generate."""
        lens = [len(p) for p in prompt_ids]
        if not lens or min(lens) < 1:
            raise ValueError("beam_search needs prompts of at least one token")
        block = left_padded(prompt_ids, *self.block_shape(len(lens), max(lens)), self.pad_id)
        with in_mesh(self.mesh):
            return beam.search(self, block, len(lens), beams, key)


class Pending:
    """A dispatched generate: its device arrays and the version of the weights it samples with."""

    def __init__(self, out: dict, n_real: int, version: int, mesh):
        self.out, self.n_real, self.version, self.mesh = out, n_real, version, mesh

    def result(self) -> Completions:
        with in_mesh(self.mesh):  # gathering them runs on their mesh, which may not be the caller's
            out = {k: to_host(v)[: self.n_real] for k, v in self.out.items()}
        return Completions(
            out["tokens"],
            out["mask"],
            out["logprobs"],
            out["lengths"],
            self.version,
            out.get("routes"),
            out.get("prompt_routes"),
        )


def _distinct(keys: list, B: int) -> tuple[list[int], np.ndarray]:
    """(the first row of each distinct key, in order, [B] int32: each row's index among the distinct
    keys; rows past the keys point at the first)."""
    index: dict = {}
    firsts, source = [], np.zeros((B,), np.int32)
    for b, k in enumerate(keys):
        if k not in index:
            index[k] = len(firsts)
            firsts.append(b)
        source[b] = index[k]
    return firsts, source


def from_run(run) -> ColocatedSampler:
    """The sampler factory of `sampler: colocated`."""
    return ColocatedSampler(
        run.model,
        pad_id=run.tokenizer.pad_id,
        mesh=run.mesh,
        rules=run.rules,
        programs=run.programs,
        cache_phases=run.cfg.rollout_cache_phases,
        compaction=run.cfg.rollout_compaction,
        compaction_min_tokens=run.cfg.rollout_compaction_min_tokens,
        quantization=run.cfg.rollout_quantization,
        image_patches=run.cfg.max_image_patches,
    )
