"""Beam search (and W-way sampling) as a decoding strategy of the colocated sampler, optionally
constrained to a prefix trie of valid sequences (rollout/trie.py: the SIDs of a recommender).

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import sharding
from unitrain.rollout.base import Completions
from unitrain.rollout.colocated import compiler_options, constrain_cache, sharded_cache
from unitrain.rollout.trie import Trie
from unitrain.step import full_rows_to_global, to_host

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


def _build(graphdef, B: int, P: int, N: int, W: int, pad_id: int, sample: bool, constrained: bool, cache_rules):
    R = B * W

    def run(
        params,
        decode,
        tokens,
        positions,
        segments,
        prompt_lens,
        trie_tokens,
        trie_children,
        stop_ids,
        temperature,
        length_penalty,
        rng,
    ):
        model = nnx.merge(graphdef, params).for_decoding(decode)  # prefill and steps on the decode weights
        axes = model.cache_axes()
        hidden, cache = model.hidden_states(tokens, positions, segments, sharded_cache(model, B, P + N, cache_rules))
        # Left padding: the last column holds every prompt's last token, the only one decoded from.
        logits = model.logits(hidden[:, -1:])[:, 0]
        # The prompt is prefilled once; its beams share copies of its cache rows.
        constrain = lambda c: constrain_cache(model, c, cache_rules)
        cache = constrain(_rows(cache, axes, lambda x, a: jnp.repeat(x, W, axis=a)))
        lens = jnp.repeat(prompt_lens, W)
        real = lens > 0  # batch-padding rows never emit
        first = (jnp.arange(R) % W == 0) | sample  # beam mode: W copies of one prefix, only one is a beam yet
        score = jnp.where(real & first, 0.0, -jnp.inf)
        V = logits.shape[-1]

        def select(logits, i, node, score, done):
            lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
            cand = jnp.where(_allowed(trie_tokens, node, V), lp, -jnp.inf) if constrained else lp
            if sample:
                token = jax.random.categorical(jax.random.fold_in(rng, i), cand, axis=-1).astype(jnp.int32)
                token = jnp.where(done, pad_id, token)
                token_lp = jnp.where(done, 0.0, jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0])
                return jnp.arange(R), token, token_lp, score + token_lp
            return _beam_select(cand, score, done, B, W, pad_id)

        def advance(carry, logits, i):
            cache, node, score, done, out_tokens, out_lps, lengths, _, _ = carry
            parent, token, token_lp, score = select(logits, i, node, score, done)
            if not sample:  # beams move to their parent's row, cache included; samples never move
                take = lambda a: jnp.take(a, parent, axis=0)
                cache = constrain(_rows(cache, axes, lambda x, a: jnp.take(x, parent, axis=a)))
                node, done, out_tokens, out_lps, lengths = map(take, (node, done, out_tokens, out_lps, lengths))
            emitted = ~done & jnp.isfinite(score)  # a -inf pick (fewer valid extensions than W) is no sequence
            token = jnp.where(emitted, token, pad_id)
            if constrained:
                j = jnp.argmax(trie_tokens[node] == token[:, None], axis=-1)
                node = jnp.where(emitted, trie_children[node, j], node)
            col = lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v[:, None].astype(a.dtype), i, axis=1)
            out_tokens, out_lps = col(out_tokens, token), col(out_lps, jnp.where(emitted, token_lp, 0.0))
            leaf = trie_tokens[node, 0] < 0 if constrained else False
            done = done | jnp.any(token[:, None] == stop_ids[None, :], axis=-1) | leaf | ~jnp.isfinite(score)
            return cache, node, score, done, out_tokens, out_lps, lengths + emitted, token, emitted

        zeros = jnp.zeros((R,), jnp.int32)
        carry = (
            cache,
            zeros,
            score,
            ~jnp.isfinite(score),
            jnp.full((R, N), pad_id, jnp.int32),
            jnp.zeros((R, N), jnp.float32),
            zeros,
            zeros,
            jnp.zeros((R,), bool),
        )
        carry = advance(carry, jnp.repeat(logits, W, axis=0), 0)

        def body(loop):
            i, carry = loop
            cache, last, emitted = carry[0], carry[7], carry[8]
            logits, cache = model(last[:, None], (lens + i - 1)[:, None], emitted[:, None].astype(jnp.int32), cache)
            return i + 1, advance((cache, *carry[1:]), logits[:, 0], i)

        cond = lambda loop: (loop[0] < N) & ~jnp.all(loop[1][3])
        _, carry = jax.lax.while_loop(cond, body, (jnp.int32(1), carry))
        _, _, score, _, out_tokens, out_lps, lengths, _, _ = carry
        # Best first by the length-normalised score; no-sequence rows (-inf) last.
        rank = jnp.where(jnp.isfinite(score), score / jnp.maximum(lengths, 1) ** length_penalty, -jnp.inf)
        order = (jnp.argsort(-rank.reshape(B, W), axis=1, stable=True) + jnp.arange(B)[:, None] * W).reshape(-1)
        shape = lambda a: jnp.take(a, order, axis=0).reshape(B, W, *a.shape[1:])
        return {
            "tokens": shape(out_tokens),
            "logprobs": shape(out_lps),
            "lengths": shape(lengths),
            "scores": shape(score),
        }

    return jax.jit(run)


def search(sampler, block: dict, n_real: int, beams: BeamParams, key) -> Ranked:
    """Runs the program for a left-padded prompt block (the sampler's own layout and buckets) and
    returns the first n_real prompts' ranked sequences. Compiled through the sampler's CompileCache."""
    B, P = block["tokens"].shape
    N, W = beams.max_new_tokens, beams.width
    trie = beams.trie or _NO_TRIE
    stop = np.asarray(beams.stop_token_ids, np.int32).reshape(-1)
    runtime = {"trie_tokens": trie.tokens, "trie_children": trie.children, "stop": stop}
    if sampler.mesh is not None:
        rows2d = sharding.batch_sharding(sampler.mesh, sampler.rules)
        block = full_rows_to_global(
            block,
            {
                "tokens": rows2d,
                "positions": rows2d,
                "segments": rows2d,
                "prompt_lens": sharding.batch_sharding(sampler.mesh, sampler.rules, ("batch",)),
            },
        )
        runtime = full_rows_to_global(runtime, sharding.replicated(sampler.mesh))
    static = (sampler.graphdef, B, P, N, W, sampler.pad_id, beams.sample, beams.trie is not None, sampler.rules)
    args = (
        sampler.params,
        sampler.decode_weights(),
        block["tokens"],
        block["positions"],
        block["segments"],
        block["prompt_lens"],
        runtime["trie_tokens"],
        runtime["trie_children"],
        runtime["stop"],
        np.float32(beams.temperature),
        np.float32(beams.length_penalty),
        key,
    )
    kind = "sample" if beams.sample else "beam"
    out = sampler.programs(
        f"{kind} search (batch={B} prompt={P} new={N} width={W})",
        None,
        *args,
        static=static,
        build=lambda: _build(*static),
        options=compiler_options(B * W // sampler.parallelism),
    )
    out = {k: to_host(v)[:n_real] for k, v in out.items()}
    return Ranked(out["tokens"], out["logprobs"], out["lengths"], out["scores"], sampler.version)
