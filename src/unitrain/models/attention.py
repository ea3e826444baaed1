"""Attention of our decoder: the reference (grouped-query einsums with a softmax in float32 and
FlashAttention's backward as a custom VJP), its chunked forms, the decode step's attention over a KV
cache, the fused kernels (cuDNN through jax.nn.dot_product_attention, Pallas splash under shard_map)
and the choice among them by the `attention` key and the model's platform (`attention_kernel`,
`attention_fn`). Inputs are q [B, T, H, D] and k/v [B, K, S, D] with a [B, T, S] mask (or, for
splash, the segment ids the mask comes from).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from unitrain import sharding
from unitrain.config import check


def attention_kernel(choice: str, platform: str, dtype: str, context: int = 1, strategy: str = "auto") -> str:
    """The implementation the `attention` choice runs on `platform` (sharding.target_platform()) at compute
    `dtype` over a sequence split on `context` devices by context_parallel_strategy `strategy`: auto is
    cuDNN on a GPU in 16 bits, splash on a TPU, else xla. Under a split sequence splash runs on keys
    and values gathered whole (context_parallel.py), so the ring takes xla; cuDNN has no split form.
    ValueError where it cannot run."""
    if context > 1 and choice == "cudnn":
        raise ValueError(
            f"attention=cudnn has no context-parallel form (the sequence is split over {context} devices); use xla or auto"
        )
    if context > 1 and choice == "splash" and strategy == "ring":
        raise ValueError(
            "attention=splash runs under context parallelism on keys and values gathered whole: "
            "set context_parallel_strategy to all_gather or auto, not ring"
        )
    fused = {"gpu": "cudnn", "tpu": "splash"}.get(platform)
    if context > 1:
        fused = fused if fused == "splash" and strategy != "ring" else None
    if choice == "auto":
        return fused if fused == "splash" or (fused == "cudnn" and dtype != "float32") else "xla"
    if choice not in ("xla", fused):
        device = "a GPU" if choice == "cudnn" else "a TPU"
        raise ValueError(f"attention={choice} runs on {device}, and this platform is {platform}; use xla or auto")
    if choice == "cudnn" and dtype == "float32":
        raise ValueError("attention=cudnn needs dtype bfloat16 or float16 (cuDNN's fused attention has no float32)")
    return choice


def layer_kinds(cfg) -> tuple:
    """The model configs (cfg: the decoder's ModelConfig) of its kinds of layer, a layer's kind by
    `layer_kind_ids`: one (every layer alike, sliding_window on all if set), or Gemma 3's global
    layers, every sliding_window_pattern-th (the whole row; RoPE of rope_theta with its scaling), and
    local ones (within sliding_window; RoPE of rope_local_base_freq, unscaled)."""
    if not cfg.sliding_window_pattern:
        return (cfg,)
    local_theta = cfg.rope_local_base_freq or cfg.rope_theta
    return (
        dataclasses.replace(cfg, sliding_window=None),
        dataclasses.replace(cfg, rope_theta=local_theta, rope_scaling_type="none"),
    )


def layer_kind_ids(cfg) -> np.ndarray:
    """[layers] int32: each layer's index into `layer_kinds` (0: global, 1: local) where
    sliding_window_pattern sets them."""
    return (np.arange(1, cfg.num_decoder_layers + 1) % cfg.sliding_window_pattern != 0).astype(np.int32)


@check("sliding_window_pattern", "sliding_window", "rope_local_base_freq")
def _layer_kinds(c) -> str | None:
    """Local layers need their window, and the local layers' RoPE base needs local layers."""
    if c["sliding_window_pattern"] and c["sliding_window"] is None:
        return f"sliding_window_pattern={c['sliding_window_pattern']} makes local layers: set their sliding_window"
    if c["rope_local_base_freq"] is not None and not c["sliding_window_pattern"]:
        return "rope_local_base_freq is set but sliding_window_pattern is 0 (no local layers): drop it or set both"
    return None


CONFIG_CHECKS = (_layer_kinds,)


def attention_fns(cfg, segment_ids, positions, prefix=None, image_spans=None) -> tuple:
    """`attention_fn` of each of the layer kinds."""
    return tuple(attention_fn(kind, segment_ids, positions, prefix, image_spans) for kind in layer_kinds(cfg))


def attention_fn(cfg, segment_ids, positions, prefix=None, image_spans=None):
    """attend(q, k, v) of a call without a cache, by the kernel the `attention` key picks on the
    model's platform (cfg: the decoder's ModelConfig). The fused kernels serve training and scoring;
    a cache call (prefill, decode) always takes the reference. The keys are the queries' own
    columns, after a shared prefix's where `prefix` gives its (segment_ids, positions). `image_spans`
    [B, T] (no prefix): the tokens of one nonzero span attend to one another both ways (Gemma 3's
    images), which only a mask says: not splash's kernel."""
    kernel = attention_kernel(cfg.attention, cfg.platform, cfg.dtype)
    if image_spans is not None and kernel == "splash":
        kernel = "xla"  # splash's masks are causal or local only
    keys = (segment_ids, positions)
    if prefix is not None:
        keys = tuple(jnp.concatenate([before, own], axis=1) for before, own in zip(prefix, keys))
    if kernel == "splash":
        return functools.partial(
            splash_attention,
            segment_ids=segment_ids,
            window=cfg.sliding_window,
            rules=cfg.logical_axis_rules,
            key_segment_ids=keys[0],
        )
    mask = attention_mask(segment_ids, positions, *keys, cfg.sliding_window, image_spans)
    if kernel == "cudnn":
        return functools.partial(dot_product_attention, mask=mask, implementation="cudnn")
    causal = prefix is None and image_spans is None  # no query attends to a later column
    return functools.partial(attention, mask=mask, chunk_size=cfg.attention_chunk_size, causal_columns=causal)


def attention_mask(q_segments, q_positions, k_segments, k_positions, sliding_window, spans=None):
    """[B, Tq, Tk] bool: same nonzero segment, causal by position (or, where `spans` [B, T] of the
    queries' own columns are the same nonzero number, both ways), optionally within a window of
    the keys before the query (as transformers' Gemma 3 windows its images' tokens)."""
    same = (q_segments[:, :, None] == k_segments[:, None, :]) & (q_segments[:, :, None] > 0)
    distance = q_positions[:, :, None] - k_positions[:, None, :]
    ordered = distance >= 0
    if spans is not None:
        ordered |= (spans[:, :, None] == spans[:, None, :]) & (spans[:, :, None] > 0)
    allowed = same & ordered
    if sliding_window is not None:
        allowed &= distance < sliding_window
    return allowed


def attention(q, k, v, mask, chunk_size=0, causal_columns=False):
    """Grouped-query attention; q [B,T,H,D], k/v [B,K,S,D], mask [B,T,S]. Softmax in float32.
    With 0 < chunk_size < T the queries go `chunk_size` at a time: `_attend_causal_chunks` where
    `causal_columns` (k and v are the queries' own columns and no query attends a later one, as in
    every row unitrain builds: positions count up along a segment's columns), else `_attend_in_chunks`."""
    B, T, H, D = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    if not chunk_size or chunk_size >= T:
        out = _attend(q, k, v, mask)
    else:
        out = (_attend_causal_chunks if causal_columns else _attend_in_chunks)(q, k, v, mask, chunk_size)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _attend_causal_chunks(q, k, v, mask, size):
    """The chunks of `_attend_in_chunks`, each reading the keys up to its own last query only: the
    blocks above the diagonal (at 2048 tokens in chunks of 256, 7/16 of the scores) are never
    computed, forward or backward. The chunks differ in shape, so they are unrolled, not mapped."""
    T = q.shape[3]
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    outs = [
        _attend_chunk(
            q[:, :, :, start : start + size],
            k32[:, :, : start + size],
            v32[:, :, : start + size],
            mask[:, start : start + size, : start + size],
        )
        for start in range(0, T, size)
    ]
    return jnp.concatenate(outs, axis=3)


def _attend_in_chunks(q, k, v, mask, size):
    """_attend of `size` queries at a time in a `lax.map` of `_attend_chunk`: the largest arrays,
    forward and backward, are one chunk's [B, K, G, size, S] float32 scores, not the whole
    [.., T, S] (gigabytes at thousands of tokens), for one more scores matmul in the
    backward. Padding queries (T not a multiple of `size`) see no key."""
    B, K, G, T, D = q.shape
    n = -(-T // size)
    pad = n * size - T
    queries = jnp.pad(q, [(0, 0)] * 3 + [(0, pad), (0, 0)]).reshape(B, K, G, n, size, D).transpose(3, 0, 1, 2, 4, 5)
    masks = jnp.pad(mask, [(0, 0), (0, pad), (0, 0)]).reshape(B, n, size, -1).swapaxes(0, 1)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    out = jax.lax.map(lambda xs: _attend_chunk(xs[0], k32, v32, xs[1]), (queries, masks))  # [n, B, K, G, size, D]
    return out.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, n * size, D)[:, :, :, :T]


@jax.checkpoint
def _attend_chunk(q, k32, v32, mask):
    """_attend of one chunk of queries, recomputed in the backward. Keys and values come in as
    float32 so that their gradients, summed over the chunks, are summed in float32."""
    return _attend(q, k32.astype(q.dtype), v32.astype(q.dtype), mask)


def cached_attention(q, k_t, v, mask, chunk_size=0, matmuls=True):
    """attention over a KV cache, whose keys are transposed: k_t [B,K,D,S], v [B,K,S,D]: `attention`
    on the keys transposed back, except for a decode step (T = 1) with `matmuls` off (XLA:CPU).

    That one is two fused multiply-and-sums, over D and then over S, each reducing a middle axis of
    a cache array in its stored order. As matmuls, XLA:CPU runs B*K tiny [G, D] x [D, S] and
    [G, S] x [S, D] products on one thread, slower the longer the cache. On a GPU it is the other
    way round (docs/PERFORMANCE.md has both)."""
    B, T, H, D = q.shape
    K = v.shape[1]
    if T > 1 or matmuls:
        return attention(q, k_t.swapaxes(2, 3), v, mask, chunk_size)
    q = q.reshape(B, K, H // K, D, 1).astype(jnp.float32)
    scores = jnp.sum(q * k_t[:, :, None].astype(jnp.float32), axis=-2) / math.sqrt(D)  # [B,K,G,S]
    probs = jax.nn.softmax(_masked(scores, mask[:, None]), axis=-1).astype(v.dtype)
    out = jnp.sum(probs[..., None] * v[:, :, None], axis=-2)
    return out.reshape(B, 1, H, D)


def _masked(scores, mask):
    # A finite minimum: a query with no key at all (padding) gets a uniform softmax, not NaN.
    return jnp.where(mask, scores, jnp.finfo(jnp.float32).min)


def masked_scores(q, k, mask):
    """[B,K,G,T,S] float32 scaled scores of q [B,K,G,T,D] and k [B,K,S,D], masked (`_masked`)."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    return _masked(scores, mask[:, None, None])


@jax.custom_vjp
def _attend(q, k, v, mask):
    """softmax(q k^T / sqrt(D)) v of q [B,K,G,T,D], k/v [B,K,S,D], mask [B,T,S]; its VJP is
    attention's own backward (see _attend_bwd) instead of autodiff's of the softmax."""
    return _attend_fwd(q, k, v, mask)[0]


def _attend_fwd(q, k, v, mask):
    """The output and, as FlashAttention keeps, each query's row maximum and log-sum-exp relative
    to it [B,K,G,T] instead of its [.., T, S] probabilities: the backward recomputes them with one
    more scores matmul, where keeping them costs writing, holding (a float32 [B, H, T, T] per layer
    until the backward) and reading them again. (The two parts stay apart: for a query with no key
    the maximum is the float32 minimum, which would absorb the sum's log.)"""
    scores = masked_scores(q, k, mask)
    top = jnp.max(scores, axis=-1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(scores - top), axis=-1, keepdims=True))
    probs = jnp.exp(scores - top - log_sum)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v)
    return out, (q, k, v, mask, top, log_sum, out)


def _attend_bwd(residuals, d_out):
    q, k, v, mask, top, log_sum, out = residuals
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    live = jnp.any(mask, axis=-1)[:, None, None, :]
    return *softmax_grads(q, k, v, mask, top, log_sum, row, live, d_out), None


def softmax_grads(q, k, v, mask, top, log_sum, row, live, d_out):
    """(d_q, d_k, d_v) of softmax(q k^T / sqrt(D)) v over these keys, given each query's softmax
    row maximum and log-sum (`top`, `log_sum` [..., T, 1], over all the keys it attends to, which
    may be more than these) and rowsum(d_out * out) (`row`). The softmax's gradient as
    FlashAttention's backward writes it, p * (dp - row): the row sums come from [.., T, D] arrays,
    where autodiff's reduces the [.., T, S] product p * dp (in XLA:CPU inside the dp matmul's
    fusion, at several times the matmul's cost) and masks it again. Masked entries have p = 0, so
    they need no mask; only a query with no key at all (uniform p over the masked scores) is
    zeroed, by its flag `live` (broadcast to [B, K, G, T])."""
    probs = jnp.exp(masked_scores(q, k, mask) - top - log_sum)
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out, v).astype(jnp.float32)
    scale = jnp.where(live[..., None], 1 / math.sqrt(q.shape[-1]), 0.0)
    d_scores = (probs * (d_probs - row) * scale).astype(q.dtype)
    d_q = jnp.einsum("bkgts,bksd->bkgtd", d_scores, k)
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_scores, q)
    d_v = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(d_out.dtype), d_out)
    return d_q, d_k, d_v


_attend.defvjp(_attend_fwd, _attend_bwd)


def dot_product_attention(q, k, v, mask, implementation):
    """jax.nn.dot_product_attention (cuDNN's fused kernel on a GPU) on the reference's inputs:
    q [B,T,H,D], k/v [B,K,S,D], mask [B,T,S]. The mask carries segments, causality and the window,
    so any positions work."""
    kv = lambda a: a.transpose(0, 2, 1, 3)
    return jax.nn.dot_product_attention(q, kv(k), kv(v), mask=mask[:, None], implementation=implementation)


SPLASH_BLOCK = 128  # the length splash attention's blocks divide


def splash_attention(q, k, v, segment_ids, window, rules=(), interpret=False, key_segment_ids=None):
    """JAX's Pallas splash attention (TPU; `interpret` runs it anywhere): q [B,T,H,D], k/v [B,K,S,D].

    The keys are the queries' own columns (S = T), or those after S - T shared columns
    (`key_segment_ids` [B, S]: a shared prefix's, then the queries'). Causality and the window are
    read from the token order within each segment, which equals the positions' order in every row
    unitrain builds (packed, left- or right-padded: positions count up by one inside a segment);
    padding is segment 0. Both lengths are padded to a multiple of SPLASH_BLOCK, the keys so that
    every padding query finds its own column. Under a mesh the kernel runs per shard of the batch
    and heads (shard_map)."""
    T = q.shape[1]
    key_segment_ids = segment_ids if key_segment_ids is None else key_segment_ids
    offset = k.shape[2] - T
    up = lambda n: -(-n // SPLASH_BLOCK) * SPLASH_BLOCK
    Tp = up(T)
    Sp = up(offset + Tp)
    pad = lambda a, axis, n: jnp.pad(a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])
    args = (pad(q, 1, Tp), pad(k, 2, Sp), pad(v, 2, Sp), pad(segment_ids, 1, Tp), pad(key_segment_ids, 1, Sp))
    run = functools.partial(splash_rows, window=window, offset=offset, interpret=interpret)
    if not jax.sharding.get_abstract_mesh().empty and rules:
        heads = sharding.logical_to_spec(("batch", None, "heads", None), rules)
        kv_heads = sharding.logical_to_spec(("batch", "kv_heads", None, None), rules)
        rows = sharding.logical_to_spec(("batch", None), rules)
        run = jax.shard_map(run, in_specs=(heads, kv_heads, kv_heads, rows, rows), out_specs=heads, check_vma=False)
    return run(*args)[:, :T]


def splash_rows(q, k, v, q_segments, kv_segments, window, offset, interpret=False):
    """The splash kernel over q [B, T, H, D] and k/v [B, K, S, D], T and S multiples of SPLASH_BLOCK,
    query t at key column t + offset (causality and the window by column, as splash_attention
    says): -> [B, T, H, D]."""
    D = q.shape[-1]
    q = q.transpose(0, 2, 1, 3) / jnp.asarray(math.sqrt(D), q.dtype)
    return _splash(q, k, v, q_segments, kv_segments, window, offset, interpret).transpose(0, 2, 1, 3)


def _splash(q, k, v, q_segments, kv_segments, window, offset, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU kernels: only when chosen

    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    causal = (
        splash.CausalMask((T, S), offset=offset)
        if window is None
        else splash.LocalMask((T, S), (window - 1, 0), offset=offset)
    )
    block = max(b for b in (512, 256, SPLASH_BLOCK) if T % b == 0 and S % b == 0)
    # The separate dq kernel, as MaxText's default: the fused backward keeps a dq partial per key
    # block, [S / block, H, T, D] (1.5 GiB of a 16k-token row of Qwen2.5-1.5B, docs/PERFORMANCE.md).
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([causal] * H), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    return jax.vmap(kernel)(q, k, v, splash.SegmentIds(q=q_segments, kv=kv_segments))
