"""unitrain's own decoder: one Flax NNX module for the Llama, Qwen2/2.5, Qwen3 and Mistral families,
implementing the model interface of models/base.py (`model_source: unitrain`, the default).

Every caller (train step, sampler, losses) sees only the common call signature:

    logits, cache = model(tokens, positions, segment_ids, cache=None)

Attention is driven by `segment_ids` (0 = padding, attend only within the same segment) and
`positions` (causal order and RoPE), so packed, right-padded and left-padded rows all work.

Layer parameters are stored stacked on a leading `layers` axis whatever `scan_layers` says, so a
checkpoint does not depend on how the stack is executed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from unitrain import checkpoint, sharding

log = logging.getLogger("unitrain")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# The `attention` key: the reference einsums (xla), a platform's fused kernel, or auto.
ATTENTION = ("auto", "xla", "cudnn", "splash")


def attention_kernel(choice: str, platform: str, dtype: str) -> str:
    """The implementation the `attention` choice runs on `platform` (sharding.target_platform()) at compute
    `dtype`: auto is cuDNN on a GPU in 16 bits, splash on a TPU, else xla. ValueError where it cannot run."""
    fused = {"gpu": "cudnn", "tpu": "splash"}.get(platform)
    if choice == "auto":
        return fused if fused == "splash" or (fused == "cudnn" and dtype != "float32") else "xla"
    if choice not in ("xla", fused):
        device = "a GPU" if choice == "cudnn" else "a TPU"
        raise ValueError(f"attention={choice} runs on {device}, and this platform is {platform}; use xla or auto")
    if choice == "cudnn" and dtype == "float32":
        raise ValueError("attention=cudnn needs dtype bfloat16 or float16 (cuDNN's fused attention has no float32)")
    return choice


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model dimensions and execution choices; field names are the config keys of base.yml."""

    vocab_size: int
    emb_dim: int
    mlp_dim: int
    num_decoder_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    model_family: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_type: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    dtype: str = "float32"
    weight_dtype: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = True
    attention: str = "xla"
    attention_chunk_size: int = 256  # as base.yml: models built outside a run config (HF adapter, tools) chunk alike
    logical_axis_rules: tuple = ()

    @classmethod
    def from_config(cls, cfg: Any) -> ModelConfig:
        """Takes the model fields out of a unitrain Config (or any mapping with those keys)."""
        values = {f.name: cfg[f.name] for f in dataclasses.fields(cls)}
        values["logical_axis_rules"] = sharding.rules_from_config(cfg["logical_axis_rules"])
        return cls(**values)


@struct.dataclass
class KVCache:
    """Keys and values of every layer by column. A call writes its T tokens, padding included, at
    columns [end, end + T) of every row, so a decode step writes one column for the whole batch (a
    dynamic_update_slice, no scatter); each column's segment (0 = empty or padding) and position
    drive the mask. One sequence per row; the widths of a cache's calls add up to at most max_length.
    One array per layer, heads before length: a decode step updates each in place and reads it as
    its attention wants it, with no slice or transpose of the whole cache. Keys are kept transposed,
    length last, so that a decode step's scores, like its values' sum, reduce over a middle axis with
    the minor one contiguous (`cached_attention`).
    """

    k: list  # per layer [batch, kv_heads, head_dim, max_length]
    v: list  # per layer [batch, kv_heads, max_length, head_dim]
    segment_ids: jax.Array  # [batch, max_length]
    positions: jax.Array  # [batch, max_length]
    end: jax.Array  # [batch] int32: the next column, the same in every row


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int) -> KVCache:
    k = jnp.zeros((batch_size, cfg.num_kv_heads, cfg.head_dim, max_length), cfg.dtype)
    v = jnp.zeros((batch_size, cfg.num_kv_heads, max_length, cfg.head_dim), cfg.dtype)
    columns = jnp.zeros((batch_size, max_length), jnp.int32)
    L = cfg.num_decoder_layers
    return KVCache(
        k=[k] * L, v=[v] * L, segment_ids=columns, positions=columns, end=jnp.zeros((batch_size,), jnp.int32)
    )


def cache_axes(cfg: ModelConfig) -> KVCache:
    L = cfg.num_decoder_layers
    return KVCache(
        k=[("batch", "kv_heads", "kv", "length")] * L,
        v=[("batch", "kv_heads", "length", "kv")] * L,
        segment_ids=("batch", "length"),
        positions=("batch", "length"),
        end=("batch",),
    )


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    # eager_sharding off: the module stays mesh-agnostic; sharding.py places the state.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)
_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros


class DecoderLayers(nnx.Module):
    """All transformer blocks, each parameter stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, E, M, H, K, D = (
            cfg.num_decoder_layers,
            cfg.emb_dim,
            cfg.mlp_dim,
            cfg.num_query_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        p = lambda init, shape, axes: _param(rngs, init, (L, *shape), ("layers", *axes), cfg.weight_dtype)
        self.attn_norm = p(_ones, (E,), ("norm",))
        self.wq = p(_normal, (E, H, D), ("embed", "heads", "kv"))
        self.wk = p(_normal, (E, K, D), ("embed", "kv_heads", "kv"))
        self.wv = p(_normal, (E, K, D), ("embed", "kv_heads", "kv"))
        self.wo = p(_normal, (H, D, E), ("heads", "kv", "embed"))
        if cfg.qkv_bias:
            self.bq = p(_zeros, (H, D), ("heads", "kv"))
            self.bk = p(_zeros, (K, D), ("kv_heads", "kv"))
            self.bv = p(_zeros, (K, D), ("kv_heads", "kv"))
        if cfg.qk_norm:
            self.q_norm = p(_ones, (D,), ("norm",))
            self.k_norm = p(_ones, (D,), ("norm",))
        self.mlp_norm = p(_ones, (E,), ("norm",))
        self.w_gate = p(_normal, (E, M), ("embed", "mlp"))
        self.w_up = p(_normal, (E, M), ("embed", "mlp"))
        self.w_down = p(_normal, (M, E), ("mlp", "embed"))


# Norms and biases are spared weight decay.
_NO_DECAY = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "bq", "bk", "bv")


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, _normal, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), cfg.weight_dtype)
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = _param(rngs, _ones, (cfg.emb_dim,), ("norm",), cfg.weight_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, _normal, (cfg.emb_dim, cfg.vocab_size), ("embed", "vocab"), cfg.weight_dtype)

    # -- the model interface beside the call (models/base.py)
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        return init_cache(self.cfg, batch_size, max_length)

    def cache_axes(self) -> KVCache:
        return cache_axes(self.cfg)

    def param_axes(self) -> dict:
        return sharding.param_axes(nnx.state(self, nnx.Param))

    def decay_mask(self) -> dict:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: path[-1].key not in _NO_DECAY, nnx.to_pure_dict(nnx.state(self, nnx.Param))
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training step (forward + backward) per token, as MaxText and PaLM count them.

        Matmuls: a [tokens, n] x [n, m] product costs 2*n*m FLOPs per token forward and twice that
        backward (input and weight gradients), so 6 * (matmul parameters) per token. Per layer those
        parameters are q: E*H*D, k and v: E*K*D each, o: H*D*E, SwiGLU gate, up and down: 3*E*M,
        plus the lm_head E*V once, tied or not: the logits matmul runs either way. The embedding
        lookup is a gather and norms, RoPE, biases and softmax are elementwise: none are counted.
        Attention: QK^T and PV each cost 2*H*D*T FLOPs per query token forward, times 3 for
        fwd+bwd = 12*L*H*D*T; T is the full sequence length (no halving for the causal mask, no
        reduction for a sliding window).
        """
        c = self.cfg
        E, M, H, K, D = c.emb_dim, c.mlp_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
        per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * M
        matmul_params = c.num_decoder_layers * per_layer + E * c.vocab_size
        return float(6 * matmul_params + 12 * c.num_decoder_layers * H * D * seq_len)

    def save_hf(self, path: str) -> None:
        from unitrain.adapters import hf  # the adapter imports this module

        hf.save(self, path)

    def decode_weights(self):
        """Where a stacked weight's slices are copies (`copies_weight_slices`), what a `Decoding`
        runs on: each layer's `_decode_weights` sliced out of the stacked ones, and the head in the
        compute dtype (a tied embedding transposed); elsewhere None, the slices costing nothing."""
        cfg = self.cfg
        if not copies_weight_slices(sharding.target_platform()):
            return None
        params = self._stacked_layers()
        return {
            "layers": [
                _decode_weights(cfg, jax.tree.map(lambda a: a[i], params)) for i in range(cfg.num_decoder_layers)
            ],
            "head": self._head(),
        }

    def for_decoding(self, weights):
        return self if weights is None else Decoding(self, weights)

    def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
        hidden, new_cache = self._hidden(tokens, positions, segment_ids, cache)
        return self.logits(hidden), new_cache

    def hidden_states(self, tokens, positions, segment_ids, cache: KVCache | None = None):
        hidden, new_cache = self._hidden(tokens, positions, segment_ids, cache)
        return hidden if cache is None else (hidden, new_cache)

    def logits(self, hidden):
        return self._apply_head(hidden, self._head())

    def _head(self):
        """The output head [E, V] in the compute dtype (a tied embedding transposed)."""
        cfg = self.cfg
        return (self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]).astype(cfg.dtype)

    def _apply_head(self, hidden, head):
        return _constrain(self.cfg, jnp.einsum("bte,ev->btv", hidden, head), ("batch", "length", "vocab"))

    def _stacked_layers(self) -> dict:
        """The layer parameters by name, each stacked on its leading `layers` axis."""
        return {name: var[...] for name, var in nnx.state(self.layers, nnx.Param).items()}

    def _hidden(self, tokens, positions, segment_ids, cache, layers=None):
        """The final-normed hidden states [B, T, E] and the updated cache; `layers`: see `_run_cached`."""
        cfg = self.cfg
        x = self._embed(tokens)
        cos, sin = rope_tables(cfg, positions)
        params = self._stacked_layers()
        if cache is None:
            attend = _attention_fn(cfg, segment_ids, positions)
            x, new_cache = _run_stack(cfg, x, params, lambda x, p: _layer(cfg, p, x, cos, sin, attend)[0]), None
        else:
            x, new_cache = _run_cached(cfg, x, params, cos, sin, segment_ids, positions, cache, layers)
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return x, new_cache

    def hidden_states_shared_prefix(self, tokens, positions, segment_ids, prefix_len: int, group_rows: int):
        """hidden_states(tokens, positions, segment_ids) of rows that come in runs of `group_rows`
        sharing their first `prefix_len` columns (a GRPO group's prompt): the prefix is computed once
        per run, and the later columns attend to their run's prefix keys and values and their own
        (`_attention_fn` with those keys: any kernel; splash with its causal mask offset by the prefix)."""
        cfg = self.cfg
        R, T = tokens.shape
        # A reshape and a repeat, not a strided slice and a gather: with the rows split over devices
        # in whole runs, each device finds its runs' prefixes on itself.
        cut = lambda a: (
            jnp.reshape(a, (R // group_rows, group_rows, T))[:, 0, :prefix_len],
            jnp.asarray(a)[:, prefix_len:],
        )
        copies = lambda a: jnp.repeat(a, group_rows, axis=0)
        (tok_p, tok_c), (pos_p, pos_c), (seg_p, seg_c) = cut(tokens), cut(positions), cut(segment_ids)
        rope_p, rope_c = rope_tables(cfg, pos_p), rope_tables(cfg, pos_c)
        attend_p = _attention_fn(cfg, seg_p, pos_p)
        attend_c = _attention_fn(cfg, seg_c, pos_c, prefix=(copies(seg_p), copies(pos_p)))

        def layer(xs, p):
            (q_p, k_p, v_p), (q_c, k_c, v_c) = (
                _attention_inputs(cfg, p, x, *rope) for x, rope in zip(xs, (rope_p, rope_c))
            )
            k, v = (
                jnp.concatenate([copies(a_p), a_c], axis=2).astype(cfg.dtype) for a_p, a_c in ((k_p, k_c), (v_p, v_c))
            )
            return (
                _block_output(cfg, p, xs[0], attend_p(q_p, k_p, v_p)),
                _block_output(cfg, p, xs[1], attend_c(q_c, k, v)),
            )

        x_p, x_c = _run_stack(cfg, (self._embed(tok_p), self._embed(tok_c)), self._stacked_layers(), layer)
        return rms_norm(jnp.concatenate([copies(x_p), x_c], axis=1), self.final_norm[...], cfg.rms_norm_eps)

    def _embed(self, tokens):
        cfg = self.cfg
        # FSDP gathers a weight before use: an fsdp-sharded table gathered by fsdp-sharded tokens
        # would otherwise make XLA rematerialise the whole lookup.
        table = _constrain(cfg, self.embed[...], ("vocab", "activation_embed"))
        x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)
        return _constrain(cfg, x, ("batch", "length", "activation_embed"))


def _run_stack(cfg, x, params, layer):
    """Applies the layers in order: one `lax.scan` step per layer, or an unrolled Python loop."""
    if cfg.remat_policy != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        return jax.lax.scan(lambda x, p: (layer(x, p), None), x, params)[0]
    for i in range(cfg.num_decoder_layers):
        x = layer(x, jax.tree.map(lambda a: a[i], params))
    return x


def copies_weight_slices(platform: str) -> bool:
    """Whether XLA on `platform` copies a slice of a stacked weight wherever it is used: XLA:CPU
    and XLA:GPU do, XLA:TPU reads it in place. In the sampler's token loop the copies would be every
    layer weight on every step (on an H100, 1.3 ms of a 3.9 ms Llama-3.2-1B decode step, 64 rows,
    bfloat16), so there `Decoder.decode_weights` makes them once per weight version instead (that
    step 3.3 -> 1.9 ms; XLA:GPU does not hoist them out of the loop by itself). That is a second
    copy of every layer weight while the sampler keeps them, which a TPU does without: Qwen2.5-1.5B's
    generate program (bf16, 16 x 256 + 512) needs 0.71 GiB of temporaries there, 2.98 GiB with it."""
    return platform in ("cpu", "gpu")


class Decoding:
    """A Decoder as the sampler's token loop calls it (`Decoder.for_decoding`), on its
    `decode_weights`: each layer's weights and the head made once per weight version, outside the
    sampler's programs, so that no decode step copies a weight. Its calls give the decoder's
    outputs."""

    def __init__(self, model: Decoder, weights: dict):
        self.model, self.layers, self.head = model, weights["layers"], weights["head"]

    def __getattr__(self, name):  # the rest of the model interface: the decoder's own
        return getattr(self.model, name)

    def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
        hidden, new_cache = self.hidden_states(tokens, positions, segment_ids, cache)
        return self.logits(hidden), new_cache

    def hidden_states(self, tokens, positions, segment_ids, cache: KVCache | None = None):
        return self.model._hidden(tokens, positions, segment_ids, cache, self.layers)

    def logits(self, hidden):
        return self.model._apply_head(hidden, self.head)


def _run_cached(cfg, x, params, cos, sin, segment_ids, positions, cache: KVCache, layers=None):
    """The layers over a KV cache, unrolled: each writes this call's keys and values at the cache's
    next columns and attends over the whole cache, the cache being one array per layer. They run on
    `layers` (a `Decoding`'s decode weights, which the samplers prefill and decode on) if given,
    else on slices of the stacked weights."""
    column = cache.end[0]
    put = lambda a, new, axis: jax.lax.dynamic_update_slice_in_dim(a, new.astype(a.dtype), column, axis)
    segments, slot_positions = put(cache.segment_ids, segment_ids, 1), put(cache.positions, positions, 1)
    mask = attention_mask(segment_ids, positions, segments, slot_positions, cfg.sliding_window)
    attend = functools.partial(
        cached_attention, mask=mask, chunk_size=cfg.attention_chunk_size, matmuls=sharding.target_platform() != "cpu"
    )
    ks, vs = [], []
    for i in range(cfg.num_decoder_layers):
        p = layers[i] if layers is not None else jax.tree.map(lambda a: a[i], params)
        write = lambda k, v, i=i: (put(cache.k[i], k.swapaxes(2, 3), 3), put(cache.v[i], v, 2))
        x, (k, v) = _layer(cfg, p, x, cos, sin, attend, write)
        ks.append(k)
        vs.append(v)
    return x, KVCache(k=ks, v=vs, segment_ids=segments, positions=slot_positions, end=cache.end + x.shape[1])


_MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _decode_weights(cfg: ModelConfig, p: dict) -> dict:
    """One layer's parameters as a decode step applies them: every matmul weight in the compute
    dtype, and wq, wk, wv as one weight `wqkv` [embed, kv_heads, group + 2, head_dim]: each KV
    head's query heads, key and value together, so that it splits over the kv_heads axis as they
    do. One projection instead of three saves two passes over the input (the sampler 1.03-1.07x
    faster). The weights keep their inputs-first layout: XLA:CPU streams a few rows through it
    faster than through its transpose (the decode step 1.1-1.3x faster than with the transposes,
    on the Tunix benchmark's checkpoint and at Qwen2.5-0.5B in float32)."""
    p = {name: w.astype(cfg.dtype) if name in _MATMUL_WEIGHTS else w for name, w in p.items()}
    E, K, D = cfg.emb_dim, cfg.num_kv_heads, cfg.head_dim
    by_kv_head = lambda name: p.pop(name).reshape(E, K, -1, D)
    p["wqkv"] = jnp.concatenate([by_kv_head("wq"), by_kv_head("wk"), by_kv_head("wv")], axis=2)
    return p


def _project_qkv(cfg: ModelConfig, p, h):
    """The queries [B, T, H, D], keys and values [B, T, K, D] of the normed input h."""
    if "wqkv" not in p:
        return tuple(_dense(h, p[name].astype(cfg.dtype)) for name in ("wq", "wk", "wv"))
    qkv = _dense(h, p["wqkv"])  # [B, T, K, G + 2, D]
    q = qkv[..., :-2, :].reshape(*qkv.shape[:2], cfg.num_query_heads, cfg.head_dim)
    return q, qkv[..., -2, :], qkv[..., -1, :]


def _layer(cfg: ModelConfig, p, x, cos, sin, attend, write=None):
    """One pre-norm block: x + attend(q, k, v) of norm(x), then x + SwiGLU(norm(x)). With a cache,
    `write(k, v)` stores this call's keys and values [B, K, T, D] and returns the cache's.
    p holds the layer's parameters or its `_decode_weights`. Returns the new x and the keys and
    values attended to."""
    q, k, v = _attention_inputs(cfg, p, x, cos, sin)
    if write is not None:
        k, v = write(k, v)
    return _block_output(cfg, p, x, attend(q, k.astype(cfg.dtype), v.astype(cfg.dtype))), (k, v)


def _attention_inputs(cfg: ModelConfig, p, x, cos, sin):
    """The block's queries [B, T, H, D] and keys and values [B, K, T, D] of norm(x)."""
    dt = cfg.dtype
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = _project_qkv(cfg, p, h)
    if cfg.qkv_bias:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = _constrain(cfg, q, ("batch", "length", "heads", "kv"))
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _block_output(cfg: ModelConfig, p, x, attn):
    """The rest of the block from the attention's output: x + its projection, then the MLP."""
    dt = cfg.dtype
    # One contracted axis (heads x head_dim): with two, XLA may pick their order by the attention
    # output's layout and transpose the weight to match, on every decode step.
    x = x + _dense(attn, p["wo"].astype(dt), n_in=2)
    x = _constrain(cfg, x, ("batch", "length", "activation_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    hidden = jax.nn.silu(_dense(h, p["w_gate"].astype(dt))) * _dense(h, p["w_up"].astype(dt))
    hidden = _constrain(cfg, hidden, ("batch", "length", "mlp"))
    x = x + _dense(hidden, p["w_down"].astype(dt))
    return _constrain(cfg, x, ("batch", "length", "activation_embed"))


def _dense(x, w, n_in=1):
    """x's last `n_in` axes contracted with w's first: one matmul of the rows flattened to one axis
    by the weight flattened to two (both reshapes are bitcasts). The weight gradient then contracts
    a single row axis; over batch and length XLA:CPU would first copy the activation or its gradient
    into a transposed layout, for every projection of every layer (a third of the SFT step)."""
    rows = x.shape[: x.ndim - n_in]
    y = x.reshape(math.prod(rows), -1) @ w.reshape(math.prod(w.shape[:n_in]), -1)
    return y.reshape(*rows, *w.shape[n_in:])


def attention_mask(q_segments, q_positions, k_segments, k_positions, sliding_window):
    """[B, Tq, Tk] bool: same nonzero segment, causal by position, optionally within a window."""
    same = (q_segments[:, :, None] == k_segments[:, None, :]) & (q_segments[:, :, None] > 0)
    distance = q_positions[:, :, None] - k_positions[:, None, :]
    allowed = same & (distance >= 0)
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
    [.., T, S] (3 GiB at 4096 tokens for a 1.5B model's heads), for one more scores matmul in the
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
    [G, S] x [S, D] products on one thread: attention with its projections measured alone was
    1.4-1.8x slower, more the longer the cache. On an H100 it is the other way round: the
    multiply-and-sums made Llama-3.2-1B's decode step (64 rows, bfloat16) 1.28x slower."""
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


def _masked_scores(q, k, mask):
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
    scores = _masked_scores(q, k, mask)
    top = jnp.max(scores, axis=-1, keepdims=True)
    log_sum = jnp.log(jnp.sum(jnp.exp(scores - top), axis=-1, keepdims=True))
    probs = jnp.exp(scores - top - log_sum)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v)
    return out, (q, k, v, mask, top, log_sum, out)


def _attend_bwd(residuals, d_out):
    """The softmax's gradient as FlashAttention's backward writes it, p * (dp - rowsum(d_out * out)):
    the row sums come from [.., T, D] arrays, where autodiff's reduces the [.., T, S] product p * dp
    (in XLA:CPU inside the dp matmul's fusion, at several times the matmul's cost) and masks it
    again. Masked entries have p = 0, so they need no mask; only a query with no key at all
    (uniform p over the masked scores) is zeroed, by its row's flag `live`."""
    q, k, v, mask, top, log_sum, out = residuals
    probs = jnp.exp(_masked_scores(q, k, mask) - top - log_sum)
    live = jnp.any(mask, axis=-1)
    d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out, v).astype(jnp.float32)
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    scale = jnp.where(live[:, None, None, :, None], 1 / math.sqrt(q.shape[-1]), 0.0)
    d_scores = (probs * (d_probs - row) * scale).astype(q.dtype)
    d_q = jnp.einsum("bkgts,bksd->bkgtd", d_scores, k)
    d_k = jnp.einsum("bkgts,bkgtd->bksd", d_scores, q)
    d_v = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(d_out.dtype), d_out)
    return d_q, d_k, d_v, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _attention_fn(cfg: ModelConfig, segment_ids, positions, prefix=None):
    """attend(q, k, v) of a call without a cache, by the kernel the `attention` key picks. The fused
    kernels serve training and scoring; a cache call (prefill, decode) always takes the reference.
    The keys are the queries' own columns, after a shared prefix's where `prefix` gives its
    (segment_ids, positions)."""
    kernel = attention_kernel(cfg.attention, sharding.target_platform(), cfg.dtype)
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
    mask = attention_mask(segment_ids, positions, *keys, cfg.sliding_window)
    if kernel == "cudnn":
        return functools.partial(dot_product_attention, mask=mask, implementation="cudnn")
    return functools.partial(attention, mask=mask, chunk_size=cfg.attention_chunk_size, causal_columns=prefix is None)


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
    B, T, H, D = q.shape
    key_segment_ids = segment_ids if key_segment_ids is None else key_segment_ids
    offset = k.shape[2] - T
    up = lambda n: -(-n // SPLASH_BLOCK) * SPLASH_BLOCK
    Tp = up(T)
    Sp = up(offset + Tp)
    pad = lambda a, axis, n: jnp.pad(a, [(0, n - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])
    q = pad(q.transpose(0, 2, 1, 3) / jnp.asarray(math.sqrt(D), q.dtype), 2, Tp)
    args = (q, pad(k, 2, Sp), pad(v, 2, Sp), pad(segment_ids, 1, Tp), pad(key_segment_ids, 1, Sp))
    run = functools.partial(_splash, window=window, offset=offset, interpret=interpret)
    if not jax.sharding.get_abstract_mesh().empty and rules:
        heads = sharding.logical_to_spec(("batch", "heads", None, None), rules)
        kv_heads = sharding.logical_to_spec(("batch", "kv_heads", None, None), rules)
        rows = sharding.logical_to_spec(("batch", None), rules)
        run = jax.shard_map(run, in_specs=(heads, kv_heads, kv_heads, rows, rows), out_specs=heads, check_vma=False)
    return run(*args)[:, :, :T].transpose(0, 2, 1, 3)


def _splash(q, k, v, q_segments, kv_segments, window, offset, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU kernels: only when chosen

    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    causal = (
        splash.CausalMask((T, S), offset=offset)
        if window is None
        else splash.LocalMask((T, S), (window - 1, 0), offset=offset)
    )
    block = max(b for b in (512, 256, SPLASH_BLOCK) if T % b == 0 and S % b == 0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([causal] * H), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    return jax.vmap(kernel)(q, k, v, splash.SegmentIds(q=q_segments, kv=kv_segments))


def rms_norm(x, weight, eps):
    """RMSNorm computed in float32, then cast back, as the HF reference does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of RoPE (float32, as HF computes them), with linear or llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    if cfg.rope_scaling_type == "linear":
        return inv / np.float32(cfg.rope_scaling_factor)
    if cfg.rope_scaling_type == "llama3":
        factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_tables(cfg: ModelConfig, positions):
    """cos/sin [B, T, head_dim] for the rotate-half RoPE layout used by HF checkpoints."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(cfg.dtype), jnp.sin(angles).astype(cfg.dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _constrain(cfg: ModelConfig, x, logical_axes):
    """Pins an activation's sharding when a mesh is active; a no-op in mesh-less calls."""
    if jax.sharding.get_abstract_mesh().empty or not cfg.logical_axis_rules:
        return x
    return jax.lax.with_sharding_constraint(x, sharding.logical_to_spec(logical_axes, cfg.logical_axis_rules))


def create(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised model (unsharded); see sharding.init_sharded for the sharded path."""
    return Decoder(cfg, rngs=nnx.Rngs(params=seed))


# ---------------------------------------------------------------- the model source


def source(cfg, mesh) -> Decoder:
    """The decoder of the config with its parameters placed in their shardings: random init, HF
    weights, or the parameters of a unitrain checkpoint (`load_parameters_path`)."""
    model_cfg = ModelConfig.from_config(cfg)
    platform = sharding.target_platform()
    kernel = attention_kernel(model_cfg.attention, platform, model_cfg.dtype)
    log.info("attention: %s%s", kernel, f" (auto on {platform})" if model_cfg.attention == "auto" else "")
    rules = model_cfg.logical_axis_rules
    # Checked on the abstract model, before any parameter is materialised.
    sharding.check_not_replicated(
        nnx.state(nnx.eval_shape(lambda: create(model_cfg))), mesh, rules, cfg.max_replicated_param_mib
    )
    path = cfg.load_parameters_path
    if path and os.path.isfile(os.path.join(path, "config.json")):
        from unitrain.adapters import hf

        return hf.load(path, mesh=mesh, model_cfg=model_cfg)
    model = sharding.init_sharded(lambda: create(model_cfg, cfg.seed), mesh, rules)
    if path:
        graphdef, params = nnx.split(model)
        model = nnx.merge(graphdef, checkpoint.load_params(path, nnx.to_pure_dict(params)))
    return model
