"""Beam search (and W-way sampling) as a decoding strategy of the colocated sampler, optionally
constrained to a prefix trie of valid sequences (engines/trie.py: the SIDs of a recommender).

    ranked = sampler.beam_search(prompt_ids, BeamParams(width=16, max_new_tokens=trie.depth, trie=trie), key)
    ranked.tokens [B, W, N], ranked.scores [B, W]     # per prompt, best first; scores = total logprob

One jitted program per bucketed shape does everything on device: the B prompts are prefilled once,
their KV cache is repeated into B*W rows (beam w of prompt b is row b*W + w, along the cache's
logical `batch` axis from `model.cache_axes()`), and a `lax.while_loop` extends every beam by one
token per step, reordering the cache rows by parent beam. The trie is a runtime input (arrays
padded to powers of two), so another trie does not recompile.

Beam mode: each step keeps the W best (beam, token) extensions of each prompt by total logprob;
a finished beam (it emitted a stop token or reached a trie leaf) stays as one candidate with its
score, so the search ends when all W beams are finished. With a beam at least as wide as the trie's
widest level nothing is ever pruned, so the result is the exact top-W of all valid sequences.
Sample mode: the W rows of a prompt are independent samples at `temperature` from the allowed
tokens, ranked by total logprob at the end.

Scores and per-token logprobs are the model's own log-softmax (at `temperature` when sampling):
the constraint removes choices but does not renormalise, so a score equals the teacher-forced
logprob of the sequence. The returned order is by score / length**length_penalty.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from unitrain import sharding
from unitrain.engines.base import Completions
from unitrain.engines.programs import (
    PromptBlock,
    argmax,
    compacted,
    compiler_options,
    constrain_cache,
    first_bucket_done,
    gumbel_noise,
    sharded_cache,
)
from unitrain.engines.trie import Trie
from unitrain.sharding import full_rows_to_global, to_host

# Stand-in trie of an unconstrained search: one node, no tokens (the program ignores it).
_NO_TRIE = Trie(np.full((1, 1), -1, np.int32), np.zeros((1, 1), np.int32), 0, 0)


@dataclasses.dataclass(frozen=True)
class BeamParams:
    width: int  # beams (or samples) per prompt: W
    max_new_tokens: int  # N; constrained: at least the trie's depth
    trie: Trie | None = None  # None = unconstrained
    length_penalty: float = 0.0  # final order by total logprob / length**length_penalty; 0 = by total logprob
    sample: bool = False  # W independent samples instead of beams
    temperature: float = 1.0  # sample mode only
    stop_token_ids: tuple[int, ...] = ()  # a beam finishes after emitting one (also: a trie leaf)

    def __post_init__(self):
        if self.width < 1:
            raise ValueError(f"beam width must be >= 1, got {self.width}")
        if self.trie is not None and self.max_new_tokens < self.trie.depth:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) is shorter than the trie's sequences ({self.trie.depth})"
            )
        if self.max_new_tokens < 1 or self.temperature <= 0:
            raise ValueError("max_new_tokens must be >= 1 and temperature > 0")


@dataclasses.dataclass(frozen=True)
class Ranked:
    """W sequences per prompt, best first; numpy on every process."""

    tokens: np.ndarray  # [B, W, N] int32, pad after the stop token
    logprobs: np.ndarray  # [B, W, N] float32, each token's logprob (0 past the end)
    lengths: np.ndarray  # [B, W] int32
    scores: np.ndarray  # [B, W] float32 total logprob; -inf: no sequence (fewer valid ones than W)
    version: int

    def completions(self) -> Completions:
        """The B*W sequences as sampler rows (prompt b's beams at rows b*W .. b*W + W-1)."""
        B, W, N = self.tokens.shape
        mask = (np.arange(N)[None, None] < self.lengths[..., None]).astype(np.int32)
        return Completions(
            self.tokens.reshape(B * W, N),
            mask.reshape(B * W, N),
            self.logprobs.reshape(B * W, N),
            self.lengths.reshape(B * W),
            self.version,
        )


def _rows(cache, axes, fn):
    """Applies fn(array, batch axis) to every cache array (the cache's logical axes say where `batch` is)."""
    return jax.tree.map(lambda x, a: fn(x, a.index("batch")), cache, axes)


def _allowed(trie_tokens, node, V: int):
    """[R, V] bool: the tokens the trie allows after each row's node."""
    ids = trie_tokens[node]  # [R, F]
    ids = jnp.where(ids < 0, V, ids)  # out of range: dropped by the scatter
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], V), bool).at[rows, ids].set(True, mode="drop")


def _beam_select(cand, score, done, B: int, W: int, pad_id: int):
    """The W best (beam, token) extensions per prompt -> (parent row, token, token logprob, score)."""
    vals, ids = jax.lax.top_k(cand, W)  # [R, W] per beam
    finished = jnp.arange(W)[None] == 0  # a finished beam: one candidate, its own score, a pad token
    vals = jnp.where(done[:, None], jnp.where(finished, 0.0, -jnp.inf), vals)
    ids = jnp.where(done[:, None], pad_id, ids)
    total = (score[:, None] + vals).reshape(B, W * W)
    new_score, flat = jax.lax.top_k(total, W)  # [B, W]
    parent = (jnp.arange(B)[:, None] * W + flat // W).reshape(-1)
    pick = lambda a: a.reshape(B, W * W)[jnp.arange(B)[:, None], flat].reshape(-1)
    return parent, pick(ids), pick(vals), new_score.reshape(-1)


@dataclasses.dataclass(frozen=True)
class BeamKey:
    """What one beam (or sample) search program is compiled for (its key in the compile cache,
    beside the inputs' shapes): the model, the block's shape, the width and the static choices."""

    graphdef: Any
    cache_rules: Any  # the sampler's sharding rules under a mesh; None: no mesh
    pad_id: int
    rows: int  # B: the prompts, bucketed
    prompt_columns: int  # P
    new_tokens: int  # N
    width: int  # W
    sample: bool
    constrained: bool  # to a trie
    # The row counts (B*W first) the rows of the prompts still searching are compacted into; () or (B*W,): none.
    row_buckets: tuple[int, ...] = ()

    def name(self) -> str:
        """The program's name in the compile log."""
        kind = "sample" if self.sample else "beam"
        compaction = f" compacted into rows {'/'.join(map(str, self.row_buckets[1:]))}" if self.row_buckets[1:] else ""
        return (
            f"{kind} search (batch={self.rows} prompt={self.prompt_columns} new={self.new_tokens} width={self.width}"
            f"{compaction})"
        )


@struct.dataclass
class BeamInputs:
    """The search program's runtime inputs: other values of these (another trie of the same padded
    size included) do not recompile it."""

    params: Any  # the model's pure dict of parameters
    decode: Any  # the model's decode_weights of them
    block: PromptBlock  # one row per prompt
    trie_tokens: Any  # Trie.tokens (a one-node stand-in when unconstrained)
    trie_children: Any  # Trie.children
    stop_ids: Any  # [S] int32
    temperature: Any  # float32 scalar
    length_penalty: Any  # float32 scalar
    rng: Any  # the call's key (sample mode)


@struct.dataclass
class BeamState:
    """The search loop's state: B*W rows, beam w of prompt b at row b*W + w. Compaction gathers the
    rows of the prompts still searching (all their W rows, in order), so each row carries its index
    in the call (`rows`) and its prompt's length."""

    i: jax.Array  # the index of the token the next step picks
    cache: Any
    node: jax.Array  # [R] int32: each row's trie node
    score: jax.Array  # [R] float32: total logprob; -inf: no sequence
    done: jax.Array  # [R] bool: finished (stop token, trie leaf, or no sequence)
    tokens: jax.Array  # [R, N] int32, pad_id where nothing was emitted
    logprobs: jax.Array  # [R, N] float32, 0 where nothing was emitted
    lengths: jax.Array  # [R] int32
    last: jax.Array  # [R] int32: the token the next step reads
    emitted: jax.Array  # [R] bool: whether the last step emitted `last`
    rows: jax.Array  # [R] int32: the row's index in the call (b*W + w); its noise in sample mode
    prompt_lens: jax.Array  # [R] int32


_ROW_FIELDS = ("node", "score", "done", "tokens", "logprobs", "lengths", "last", "emitted", "rows", "prompt_lens")
_OUTPUT_FIELDS = ("tokens", "logprobs", "lengths", "score")


def _pick(key: BeamKey, inputs: BeamInputs, logits, state: BeamState):
    """Each row's (parent row, token, token logprob, new score) at step state.i."""
    R = state.done.shape[0]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / inputs.temperature, axis=-1)
    cand = lp
    if key.constrained:
        cand = jnp.where(_allowed(inputs.trie_tokens, state.node, logits.shape[-1]), lp, -jnp.inf)
    if not key.sample:
        return _beam_select(cand, state.score, state.done, R // key.width, key.width, key.pad_id)
    # jax.random.categorical of the [B*W, V] rows, each row's noise by its index in the call.
    noise = gumbel_noise(jax.random.fold_in(inputs.rng, state.i), state.rows, cand.shape[-1])
    token = argmax(cand + noise)
    token = jnp.where(state.done, key.pad_id, token)
    token_lp = jnp.where(state.done, 0.0, jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0])
    return jnp.arange(R), token, token_lp, state.score + token_lp


def _advance(model, key: BeamKey, inputs: BeamInputs, state: BeamState, logits) -> BeamState:
    """Every row extended by the token of step state.i picked from `logits` (beam mode: the rows
    first move to their parents', cache included)."""
    i, trie_tokens = state.i, inputs.trie_tokens
    parent, token, token_lp, score = _pick(key, inputs, logits, state)
    if not key.sample:  # beams move to their parent's row, cache included; samples never move
        take = lambda a: jnp.take(a, parent, axis=0)
        cache = _rows(state.cache, model.cache_axes(), lambda x, a: jnp.take(x, parent, axis=a))
        state = state.replace(
            cache=constrain_cache(model, cache, key.cache_rules),
            **{f: take(getattr(state, f)) for f in ("node", "done", "tokens", "logprobs", "lengths")},
        )
    emitted = ~state.done & jnp.isfinite(score)  # a -inf pick (fewer valid extensions than W) is no sequence
    token = jnp.where(emitted, token, key.pad_id)
    node = state.node
    if key.constrained:
        j = jnp.argmax(trie_tokens[node] == token[:, None], axis=-1)
        node = jnp.where(emitted, inputs.trie_children[node, j], node)
    col = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v[:, None].astype(a.dtype), i, axis=1)
    leaf = trie_tokens[node, 0] < 0 if key.constrained else False
    stop = jnp.any(token[:, None] == inputs.stop_ids[None, :], axis=-1)
    return state.replace(
        i=i + 1,
        node=node,
        score=score,
        done=state.done | stop | leaf | ~jnp.isfinite(score),
        tokens=col(state.tokens, token),
        logprobs=col(state.logprobs, jnp.where(emitted, token_lp, 0.0)),
        lengths=state.lengths + emitted,
        last=token,
        emitted=emitted,
    )


def _prefilled(model, key: BeamKey, inputs: BeamInputs) -> tuple[BeamState, jax.Array]:
    """The prompts prefilled once, their cache rows repeated into W beams each: (the state before
    the first token, the last prompt column's logits per row)."""
    block, B, W, N = inputs.block, key.rows, key.width, key.new_tokens
    R = B * W
    cache = sharded_cache(model, B, key.prompt_columns + N, key.cache_rules)
    hidden, cache = model.hidden_states(block.tokens, block.positions, block.segments, cache)
    # Left padding: the last column holds every prompt's last token, the only one decoded from.
    logits = model.logits(hidden[:, -1:])[:, 0]
    # The prompt is prefilled once; its beams share copies of its cache rows.
    cache = _rows(cache, model.cache_axes(), lambda x, a: jnp.repeat(x, W, axis=a))
    real = jnp.repeat(block.prompt_lens, W) > 0  # batch-padding rows never emit
    first = (jnp.arange(R) % W == 0) | key.sample  # beam mode: W copies of one prefix, only one is a beam yet
    score = jnp.where(real & first, 0.0, -jnp.inf)
    zeros = jnp.zeros((R,), jnp.int32)
    state = BeamState(
        i=jnp.int32(0),
        cache=constrain_cache(model, cache, key.cache_rules),
        node=zeros,
        score=score,
        done=~jnp.isfinite(score),
        tokens=jnp.full((R, N), key.pad_id, jnp.int32),
        logprobs=jnp.zeros((R, N), jnp.float32),
        lengths=zeros,
        last=zeros,
        emitted=jnp.zeros((R,), bool),
        rows=jnp.arange(R, dtype=jnp.int32),
        prompt_lens=jnp.repeat(block.prompt_lens, W),
    )
    return state, jnp.repeat(logits, W, axis=0)


def _build(key: BeamKey):
    """The jitted search program of `key`: BeamInputs -> {tokens, logprobs, lengths, scores}, [B, W, ...]."""
    B, W = key.rows, key.width

    def run(inputs: BeamInputs) -> dict:
        # Prefill and steps alike run on the decode weights.
        model = nnx.merge(key.graphdef, inputs.params).for_decoding(inputs.decode)
        state, logits = _prefilled(model, key, inputs)
        state = _advance(model, key, inputs, state, logits)

        def step(state: BeamState) -> BeamState:
            positions = (state.prompt_lens + state.i - 1)[:, None]
            logits, cache = model(state.last[:, None], positions, state.emitted[:, None].astype(jnp.int32), state.cache)
            return _advance(model, key, inputs, state.replace(cache=cache), logits[:, 0])

        # A prompt searches until all its W beams are finished; then its rows can leave (compaction).
        searching = lambda s: ~s.done.reshape(-1, W).all(axis=1)
        more = lambda s: (s.i < key.new_tokens) & ~first_bucket_done(s, key.row_buckets, W, searching)
        state = jax.lax.while_loop(more, step, state)
        state = compacted(
            model,
            state,
            step,
            buckets=key.row_buckets,
            group=W,
            running=searching,
            stop=key.new_tokens,
            fields=_ROW_FIELDS,
            outputs=_OUTPUT_FIELDS,
            rules=key.cache_rules,
        )
        # Best first by the length-normalised score; no-sequence rows (-inf) last.
        score, lengths = state.score, state.lengths
        rank = jnp.where(jnp.isfinite(score), score / jnp.maximum(lengths, 1) ** inputs.length_penalty, -jnp.inf)
        order = (jnp.argsort(-rank.reshape(B, W), axis=1, stable=True) + jnp.arange(B)[:, None] * W).reshape(-1)
        shape = lambda a: jnp.take(a, order, axis=0).reshape(B, W, *a.shape[1:])
        return {
            "tokens": shape(state.tokens),
            "logprobs": shape(state.logprobs),
            "lengths": shape(lengths),
            "scores": shape(score),
        }

    return jax.jit(run)


def search(sampler, block: PromptBlock, n_real: int, beams: BeamParams, key) -> Ranked:
    """Runs the program for a left-padded prompt block (the sampler's own layout and buckets) and
    returns the first n_real prompts' ranked sequences. Compiled through the sampler's CompileCache."""
    B, P = block.tokens.shape
    program_key = BeamKey(
        graphdef=sampler.graphdef,
        cache_rules=sampler.rules,
        pad_id=sampler.pad_id,
        rows=B,
        prompt_columns=P,
        new_tokens=beams.max_new_tokens,
        width=beams.width,
        sample=beams.sample,
        constrained=beams.trie is not None,
        row_buckets=tuple(b * beams.width for b in sampler.row_buckets(B, beams.max_new_tokens, beams.width)),
    )
    trie = beams.trie or _NO_TRIE
    inputs = BeamInputs(
        params=sampler.params,
        decode=sampler.decode_weights(),
        block=block,
        trie_tokens=trie.tokens,
        trie_children=trie.children,
        stop_ids=np.asarray(beams.stop_token_ids, np.int32).reshape(-1),
        temperature=np.float32(beams.temperature),
        length_penalty=np.float32(beams.length_penalty),
        rng=key,
    )
    if sampler.mesh is not None:
        runtime = {
            "trie_tokens": inputs.trie_tokens,
            "trie_children": inputs.trie_children,
            "stop_ids": inputs.stop_ids,
        }
        runtime = full_rows_to_global(runtime, sharding.replicated(sampler.mesh))
        inputs = inputs.replace(block=block.on_mesh(sampler.mesh, sampler.rules), **runtime)
    out = sampler.programs(
        program_key.name(),
        None,
        inputs,
        static=program_key,
        build=lambda: _build(program_key),
        options=compiler_options(B * program_key.width // sampler.parallelism),
    )
    out = {k: to_host(v)[:n_real] for k, v in out.items()}
    return Ranked(out["tokens"], out["logprobs"], out["lengths"], out["scores"], sampler.version)
