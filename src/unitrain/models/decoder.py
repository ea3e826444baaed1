"""unitrain's own decoder: one Flax NNX module for the Llama, Qwen2/2.5, Qwen3, Mistral and Gemma 3
families and the mixture-of-experts Qwen3-MoE and Mixtral (every layer's MLP sparse: models/moe.py), implementing the model interface of models/base.py (`model_source: unitrain`, the default).

Every caller (train step, sampler, losses) sees only the common call signature:

    logits, cache = model(tokens, positions, segment_ids, cache=None)

Attention is driven by `segment_ids` (0 = padding, attend only within the same segment) and
`positions` (causal order and RoPE), so packed, right-padded and left-padded rows all work.

Layer parameters are stored stacked on a leading `layers` axis whatever `scan_layers` says, so a
checkpoint does not depend on how the stack is executed. Its attention is attention.py's, its KV
cache kv_cache.py's; models/source.py builds it from the config (random init, HF safetensors or a
unitrain checkpoint) with the platform its programs are built for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import sharding
from unitrain.models import context_parallel, kv_cache, moe, quant
from unitrain.models.attention import (
    attention_fns,
    attention_mask,
    cached_attention,
    layer_kind_ids,
    layer_kinds,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe", "mixtral", "qwen2_5_vl", "gemma3")
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family's blocks do that no config key says (the same for every model of the family)."""

    norm_offset: float = 0.0  # every RMSNorm scales by offset + weight (Gemma stores the weight less one)
    post_norms: bool = False  # the attention's and the MLP's outputs normed before the residual adds (Gemma 3)
    embed_scale: bool = False  # the embeddings times sqrt(emb_dim)
    activation: Callable = jax.nn.silu  # of the gated MLP's gate
    # An image's tokens (a run of image pads) attend to one another both ways, not causally (Gemma 3).
    bidirectional_images: bool = False


_GEMMA3 = Family(
    norm_offset=1.0, post_norms=True, embed_scale=True, activation=functools.partial(jax.nn.gelu, approximate=True)
)
_FAMILIES = {"gemma3_text": _GEMMA3, "gemma3": dataclasses.replace(_GEMMA3, bidirectional_images=True)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model dimensions and execution choices; field names are the config keys of base.yml, but for
    `platform`, which the model's source gives."""

    vocab_size: int
    emb_dim: int
    mlp_dim: int
    num_decoder_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    # The platform the model's programs are built for (sharding.target_platform() where the source
    # builds it): its kernel and layout choices follow it. A static field, as the config is.
    platform: str
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
    # Gemma 3: every sliding_window_pattern-th layer global, the others local (layer_kinds); the
    # scores scaled by 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head_dim); the logits
    # soft-capped to (-cap, cap) by cap * tanh(logits / cap).
    sliding_window_pattern: int = 0
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: int | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (0: dense): every layer's MLP is num_experts SwiGLUs of moe_mlp_dim, of
    # which each token takes num_experts_per_tok (models/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_mlp_dim: int = 128
    moe_norm_topk_prob: bool = True
    dtype: str = "float32"
    weight_dtype: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = True
    attention: str = "xla"
    attention_chunk_size: int = 256  # as base.yml: models built outside a run config (HF adapter, tools) chunk alike
    context_parallel_strategy: str = "auto"
    context_load_balance: bool = True
    logical_axis_rules: tuple = ()
    # False: no LM head, the backbone of a scalar-head model (models/scalar_head.py), which reads only
    # hidden_states; an unused head would hold memory, be decayed and find no tensor in an HF
    # *ForSequenceClassification checkpoint. Not a config key: the scalar-head builder sets it.
    output_head: bool = True
    # Multimodal rotary positions (Qwen2.5-VL's M-RoPE): the head's frequencies in sections turning
    # with the temporal, height and width position ids of a call's `rope_positions` (without them,
    # the 1D RoPE of `positions`, which equals M-RoPE on text); and the image-pad token whose
    # embeddings a call's `image_features` replace. Not config keys: an HF vision-language folder's
    # config.json sets them (adapters/hf.py, models/qwen2_5_vl.py).
    mrope_section: tuple[int, ...] = ()
    image_token_id: int = -1

    @property
    def family(self) -> Family:
        return _FAMILIES.get(self.model_family, Family())

    @classmethod
    def from_config(cls, cfg: Any, platform: str, output_head: bool = True) -> ModelConfig:
        """Takes the model fields out of a unitrain Config (or any mapping with those keys)."""
        own = ("platform", "output_head", "mrope_section", "image_token_id")
        values = {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name not in own}
        values["logical_axis_rules"] = sharding.rules_from_config(cfg["logical_axis_rules"])
        return cls(**values, platform=platform, output_head=output_head)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    # eager_sharding off: the module stays mesh-agnostic; sharding.py places the state.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


_normal = jax.nn.initializers.normal(0.02)
_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros


def _norm_init(cfg: ModelConfig):
    """A norm's weight at init: the identity scale (norm_offset + weight = 1)."""
    return _zeros if cfg.family.norm_offset else _ones


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
        norm = _norm_init(cfg)
        self.attn_norm = p(norm, (E,), ("norm",))
        self.wq = p(_normal, (E, H, D), ("embed", "heads", "kv"))
        self.wk = p(_normal, (E, K, D), ("embed", "kv_heads", "kv"))
        self.wv = p(_normal, (E, K, D), ("embed", "kv_heads", "kv"))
        self.wo = p(_normal, (H, D, E), ("heads", "kv", "embed"))
        if cfg.qkv_bias:
            self.bq = p(_zeros, (H, D), ("heads", "kv"))
            self.bk = p(_zeros, (K, D), ("kv_heads", "kv"))
            self.bv = p(_zeros, (K, D), ("kv_heads", "kv"))
        if cfg.qk_norm:
            self.q_norm = p(norm, (D,), ("norm",))
            self.k_norm = p(norm, (D,), ("norm",))
        self.mlp_norm = p(norm, (E,), ("norm",))
        if cfg.family.post_norms:
            self.attn_post_norm = p(norm, (E,), ("norm",))
            self.mlp_post_norm = p(norm, (E,), ("norm",))
        if cfg.num_experts:
            X, M = cfg.num_experts, cfg.moe_mlp_dim
            # The router's expert axis stays unsharded: it is small, and `embed` may share a mesh
            # axis with `expert`.
            self.router = p(_normal, (E, X), ("embed", None))
            self.moe_gate = p(_normal, (X, E, M), ("expert", "embed", "mlp"))
            self.moe_up = p(_normal, (X, E, M), ("expert", "embed", "mlp"))
            self.moe_down = p(_normal, (X, M, E), ("expert", "mlp", "embed"))
        else:
            self.w_gate = p(_normal, (E, M), ("embed", "mlp"))
            self.w_up = p(_normal, (E, M), ("embed", "mlp"))
            self.w_down = p(_normal, (M, E), ("mlp", "embed"))


class Decoder(nnx.Module):
    """The model. `hf_writer(model, path)` is what `save_hf` writes with: adapters.hf.save, given by
    the sources (models/source.py, adapters.hf.load), since the adapter imports this module."""

    # Norms and biases are spared weight decay.
    no_decay = (
        *("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "final_norm", "q_norm", "k_norm"),
        *("bq", "bk", "bv"),
    )

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, hf_writer: Callable | None = None):
        self.cfg = cfg
        self.hf_writer = hf_writer
        self.embed = _param(rngs, _normal, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), cfg.weight_dtype)
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = _param(rngs, _norm_init(cfg), (cfg.emb_dim,), ("norm",), cfg.weight_dtype)
        if cfg.output_head and not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, _normal, (cfg.emb_dim, cfg.vocab_size), ("embed", "vocab"), cfg.weight_dtype)

    # -- the model interface beside the call (models/base.py)
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def init_cache(self, batch_size: int, max_length: int) -> kv_cache.KVCache:
        return kv_cache.init_cache(self.cfg, batch_size, max_length)

    def cache_axes(self) -> kv_cache.KVCache:
        return kv_cache.cache_axes(self.cfg)

    def param_axes(self) -> dict:
        return sharding.param_axes(nnx.state(self, nnx.Param))

    def decay_mask(self) -> dict:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: path[-1].key not in self.no_decay, nnx.to_pure_dict(nnx.state(self, nnx.Param))
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training step (forward + backward) per token, as MaxText and PaLM count them.

        Matmuls: a [tokens, n] x [n, m] product costs 2*n*m FLOPs per token forward and twice that
        backward (input and weight gradients), so 6 * (matmul parameters) per token. Per layer those
        parameters are q: E*H*D, k and v: E*K*D each, o: H*D*E, SwiGLU gate, up and down: 3*E*M
        (a sparse MLP: the k experts a token runs, 3*E*M_moe each, and the router E*X), plus the lm_head E*V once, tied or not: the logits matmul runs either way (not without an
        output head: a scalar-head model counts its own head). The embedding
        lookup is a gather and norms, RoPE, biases and softmax are elementwise: none are counted.
        Attention: QK^T and PV each cost 2*H*D*T FLOPs per query token forward, times 3 for
        fwd+bwd = 12*L*H*D*T; T is the full sequence length (no halving for the causal mask, no
        reduction for a sliding window).
        """
        c = self.cfg
        E, M, H, K, D = c.emb_dim, c.mlp_dim, c.num_query_heads, c.num_kv_heads, c.head_dim
        mlp = c.num_experts_per_tok * 3 * E * c.moe_mlp_dim + E * c.num_experts if c.num_experts else 3 * E * M
        per_layer = E * H * D + 2 * E * K * D + H * D * E + mlp
        matmul_params = c.num_decoder_layers * per_layer + (E * c.vocab_size if c.output_head else 0)
        return float(6 * matmul_params + 12 * c.num_decoder_layers * H * D * seq_len)

    def save_hf(self, path: str) -> None:
        if self.hf_writer is None:
            raise NotImplementedError("this decoder was built without an HF writer: build it with its model source")
        self.hf_writer(self, path)

    def decode_weights(self, quantization: str = "none"):
        """Where a stacked weight's slices are copies (`copies_weight_slices`) or the sampler's weights
        are quantised, what a `Decoding` runs on: each layer's `_decode_weights` sliced out of the
        stacked ones, and the head in the compute dtype (a tied embedding transposed); elsewhere
        None, the slices costing nothing. `quantization` (rollout_quantization: int8 | fp8): every
        matmul weight of the layers and the head weight-only quantised, one scale per output
        channel (models/quant.py); norms, biases and the embedding table stay as they are."""
        cfg = self.cfg
        if quantization == "none" and not copies_weight_slices(cfg.platform):
            return None
        if quantization != "none" and cfg.num_experts:  # the config refuses it (engines/factory.py)
            raise ValueError("the quantised decode serves dense models: its experts' ragged_dot takes no QArray")
        params = self._stacked_layers()
        params.pop("layer_kind", None)  # the unrolled layers know theirs when tracing
        layers = [_decode_weights(cfg, jax.tree.map(lambda a: a[i], params)) for i in range(cfg.num_decoder_layers)]
        head = self._head()
        if quantization != "none":
            layers = [
                {
                    name: quant.quantise(w, _IN_AXES[name], quantization) if name in _IN_AXES else w
                    for name, w in p.items()
                }
                for p in layers
            ]
            head = quant.quantise(head, (0,), quantization)
        return {"layers": layers, "head": head}

    def for_decoding(self, weights):
        return self if weights is None else Decoding(self, weights)

    def __call__(self, tokens, positions, segment_ids, cache: kv_cache.KVCache | None = None, routes=None, **images):
        hidden, new_cache = self._hidden(tokens, positions, segment_ids, cache, routes=routes, **images)
        return self.logits(hidden), new_cache

    def hidden_states(
        self, tokens, positions, segment_ids, cache: kv_cache.KVCache | None = None, routes=None, **images
    ):
        """`routes` [B, T, L, k] int32 (routing replay, without a cache): each token's experts in
        every MoE layer, replacing the router's choice (moe.moe_mlp; negative: the router's own).
        `images`: a vision-language model's `image_features` and `rope_positions` (see `_hidden`)."""
        hidden, new_cache = self._hidden(tokens, positions, segment_ids, cache, routes=routes, **images)
        return hidden if cache is None else (hidden, new_cache)

    def logits(self, hidden):
        return self._apply_head(hidden, self._head())

    def _head(self):
        """The output head [E, V] in the compute dtype (a tied embedding transposed)."""
        cfg = self.cfg
        if not cfg.output_head:
            raise ValueError("this decoder has no output head (a scalar-head model's backbone): use hidden_states")
        return (self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]).astype(cfg.dtype)

    def _apply_head(self, hidden, head):
        cap = self.cfg.final_logit_softcapping
        logits = quant.einsum("bte,ev->btv", hidden, head)
        if cap:
            logits = cap * jnp.tanh(logits / cap)
        return _constrain(self.cfg, logits, ("batch", "length", "vocab"))

    def _stacked_layers(self) -> dict:
        """The layer parameters by name, each stacked on its leading `layers` axis, and where the
        layers are of several kinds (attention.layer_kinds) each one's kind, `layer_kind` [layers]:
        data the scan hands each layer with its weights."""
        params = {name: var[...] for name, var in nnx.state(self.layers, nnx.Param).items()}
        if len(layer_kinds(self.cfg)) > 1:
            params["layer_kind"] = layer_kind_ids(self.cfg)
        return params

    def _hidden(
        self,
        tokens,
        positions,
        segment_ids,
        cache,
        layers=None,
        routes=None,
        image_features=None,
        rope_positions=None,
        image_mask=None,
    ):
        """The final-normed hidden states [B, T, E] and the updated cache; `layers`: see `_run_cached`;
        `routes`: see `hidden_states`. `image_features` [N, E]: the embeddings of the image pads
        (tokens `image_token_id`, or where `image_mask` [B, T] says: a pad a sampler drew after the
        prompt is text), in row-major order (or [B, N, E], each row's: _with_image_features);
        `rope_positions` [B, T, 3]: M-RoPE's position ids (`mrope_section`); `positions` still order
        the attention and the cache."""
        cfg = self.cfg
        x = self._embed(tokens)
        if image_features is not None:
            is_image = tokens == cfg.image_token_id if image_mask is None else image_mask
            x = _with_image_features(x, is_image, image_features)
        rope = positions if rope_positions is None else rope_positions
        if image_features is not None and cfg.family.bidirectional_images:
            return self._bidirectional_images(x, positions, segment_ids, rope, routes, cache, is_image), None
        if cache is None:
            return context_parallel.forward(cfg, self._uncached, x, positions, segment_ids, rope, routes), None
        if x.shape[1] > 1 and context_parallel.shards(cfg) > 1:
            return self._split_prefill(x, positions, segment_ids, rope, cache, layers)
        x, new_cache = _run_cached(
            cfg, x, self._stacked_layers(), rope_tables(cfg, rope), segment_ids, positions, cache, layers
        )
        return _norm(cfg, x, self.final_norm[...]), new_cache

    def _uncached(self, x, positions, segment_ids, rope, routes, attend):
        """The final-normed hidden states of a call without a cache from its embeddings x, `rope`
        the positions RoPE reads (`positions` or M-RoPE's) and `attend` its attention."""
        cfg = self.cfg
        ropes = rope_tables(cfg, rope)
        params = _with_routes(self._stacked_layers(), routes)

        def layer(x, p):
            x, _, routed = _layer(cfg, p, x, ropes, attend, segment_ids)
            return x, routed

        x, routed = _run_stack(cfg, x, params, layer)
        moe.report(routed)
        return _norm(cfg, x, self.final_norm[...])

    def _bidirectional_images(self, x, positions, segment_ids, rope, routes, cache, is_image):
        """`_uncached` of a family whose images' tokens attend to one another both ways: each run of
        image pads (`is_image` [B, T]) a span of its own, numbered from 1 along the row."""
        if cache is not None or context_parallel.shards(self.cfg) > 1:
            raise ValueError(
                f"model_family {self.cfg.model_family}: images attend within themselves both ways only in a "
                "call without a cache and without context parallelism"
            )
        starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
        spans = jnp.where(is_image, jnp.cumsum(starts, axis=1), 0)
        attend = attention_fns(self.cfg, segment_ids, positions, image_spans=spans)
        return self._uncached(x, positions, segment_ids, rope, routes, attend)

    def _split_prefill(self, x, positions, segment_ids, rope, cache, layers):
        """A cached call of several columns over rows split on the context axis: the samplers'
        prefill, of an empty cache. Its columns attend to one another as a call without a cache
        does (context_parallel.forward: the ring or the gathered keys, load-balanced), so no
        device holds the prompt's keys whole or scores all its queries; each layer's keys and
        values, back in the columns' order, then fill the cache's first columns, which stay split
        along the context axis as the decode steps read them (`kv_cache.cache_axes`)."""
        cfg = self.cfg
        params = self._stacked_layers()

        def run(x, positions, segment_ids, rope, routes, attend):
            x, ks, vs, _ = _run_unrolled(cfg, x, params, layers, rope_tables(cfg, rope), attend, segment_ids)
            # [B, K, T, D] -> [B, T, K, D]: the columns on the axis whose order forward restores.
            kv = [(k.swapaxes(1, 2), v.swapaxes(1, 2)) for k, v in zip(ks, vs)]
            return _norm(cfg, x, self.final_norm[...]), kv

        hidden, kv = context_parallel.forward(cfg, run, x, positions, segment_ids, rope, None)
        written = [kv_cache.write(cache, i, k.swapaxes(1, 2), v.swapaxes(1, 2)) for i, (k, v) in enumerate(kv)]
        columns = kv_cache.write_columns(cache, segment_ids, positions)
        return hidden, kv_cache.written(cache, *map(list, zip(*written)), columns, x.shape[1])

    def hidden_states_shared_prefix(
        self,
        tokens,
        positions,
        segment_ids,
        prefix_len: int,
        group_rows: int,
        routes=None,
        image_features=None,
        rope_positions=None,
    ):
        """hidden_states(tokens, positions, segment_ids) of rows that come in runs of `group_rows`
        sharing their first `prefix_len` columns (a GRPO group's prompt): the prefix is computed once
        per run, and the later columns attend to their run's prefix keys and values and their own
        (`attention_fn` with those keys: any kernel; splash with its causal mask offset by the prefix).
        A vision-language model's `image_features` [runs, N, E] are each run's prefix's images (the
        image pads after it are text), `rope_positions` [R, T, 3] its M-RoPE positions."""
        cfg = self.cfg
        R, T = tokens.shape
        # A reshape and a repeat, not a strided slice and a gather: with the rows split over devices
        # in whole runs, each device finds its runs' prefixes on itself.
        cut = lambda a: (
            jnp.reshape(a, (R // group_rows, group_rows, *a.shape[1:]))[:, 0, :prefix_len],
            jnp.asarray(a)[:, prefix_len:],
        )
        copies = lambda a: jnp.repeat(a, group_rows, axis=0)
        (tok_p, tok_c), (pos_p, pos_c), (seg_p, seg_c) = cut(tokens), cut(positions), cut(segment_ids)
        # A group's rows share their prompt's recorded routes too (the same prefill in the sampler).
        routes_p, routes_c = None, None
        if routes is not None:
            routes = jnp.asarray(routes)
            routes_p = routes.reshape(R // group_rows, group_rows, *routes.shape[1:])[:, 0, :prefix_len]
            routes_c = routes[:, prefix_len:]
        rope_p, rope_c = (
            rope_tables(cfg, a) for a in ((pos_p, pos_c) if rope_positions is None else cut(rope_positions))
        )
        attend_p = attention_fns(cfg, seg_p, pos_p)
        attend_c = attention_fns(cfg, seg_c, pos_c, prefix=(copies(seg_p), copies(pos_p)))

        def layer(xs, p):
            (q_p, k_p, v_p), (q_c, k_c, v_c) = (
                _attention_inputs(cfg, p, x, _of_kind(p, rope)) for x, rope in zip(xs, (rope_p, rope_c))
            )
            k, v = (
                jnp.concatenate([copies(a_p), a_c], axis=2).astype(cfg.dtype) for a_p, a_c in ((k_p, k_c), (v_p, v_c))
            )
            (x_p, routed_p), (x_c, routed_c) = (
                _block_output(cfg, p, xs[0], _of_kind(p, attend_p)(q_p, k_p, v_p), seg_p, p.get("routes_p")),
                _block_output(cfg, p, xs[1], _of_kind(p, attend_c)(q_c, k, v), seg_c, p.get("routes")),
            )
            return (x_p, x_c), (routed_p, routed_c)

        params = _with_routes(_with_routes(self._stacked_layers(), routes_p, "routes_p"), routes_c)
        x_p = self._embed(tok_p)
        if image_features is not None:
            if cfg.family.bidirectional_images:
                raise ValueError(f"model_family {cfg.model_family}: images in a shared prefix are not supported")
            x_p = _with_image_features(x_p, tok_p == cfg.image_token_id, image_features)
        (x_p, x_c), routed = _run_stack(cfg, (x_p, self._embed(tok_c)), params, layer)
        for part in routed:  # each prompt's tokens count once, as they are computed once
            moe.report(part)
        return _norm(cfg, jnp.concatenate([copies(x_p), x_c], axis=1), self.final_norm[...])

    def _embed(self, tokens):
        cfg = self.cfg
        # FSDP gathers a weight before use: an fsdp-sharded table gathered by fsdp-sharded tokens
        # would otherwise make XLA rematerialise the whole lookup.
        table = _constrain(cfg, self.embed[...], ("vocab", "activation_embed"))
        x = jnp.take(table, tokens, axis=0).astype(cfg.dtype)
        if cfg.family.embed_scale:  # the factor rounded to the weights' dtype, as Gemma's reference
            x = x * jnp.asarray(math.sqrt(cfg.emb_dim), cfg.weight_dtype).astype(cfg.dtype)
        return _constrain(cfg, x, ("batch", "length", "activation_embed"))


def _with_image_features(x, is_image, features):
    """x [B, T, E] with its image-pad rows replaced by `features` [N, E], the n-th pad (row-major)
    by the n-th feature, or by a row's own `features` [B, N, E] (a training batch's, each row's
    images padded to the same budget): a gather of each pad's feature, no scatter."""
    if features.ndim == 3:
        order = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
        gathered = jnp.take_along_axis(features, order[..., None], axis=1)
    else:
        order = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, features.shape[0] - 1).reshape(is_image.shape)
        gathered = jnp.take(features, order, axis=0)
    return jnp.where(is_image[..., None], gathered.astype(x.dtype), x)


def _with_routes(params: dict, routes, name: str = "routes") -> dict:
    """The stacked layer parameters with `routes` [B, T, L, k] beside them as `name` [L, B, T, k],
    so that the scan (or the unrolled loop) hands each layer its own slice."""
    return params if routes is None else {**params, name: jnp.moveaxis(jnp.asarray(routes), 2, 0)}


def _run_stack(cfg, x, params, layer):
    """Applies the layers in order: one `lax.scan` step per layer, or an unrolled Python loop.
    layer(x, p) -> (x, its RouterStats or None); returns x and the stats stacked over the layers."""
    if cfg.remat_policy != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        return jax.lax.scan(layer, x, params)
    routed = []
    for i in range(cfg.num_decoder_layers):
        x, stats = layer(x, jax.tree.map(lambda a: a[i], params))
        routed.append(stats)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *routed)


def copies_weight_slices(platform: str) -> bool:
    """Whether XLA on `platform` copies a slice of a stacked weight wherever it is used: XLA:CPU
    and XLA:GPU do, XLA:TPU reads it in place. In the sampler's token loop the copies would be every
    layer weight on every step, so there `Decoder.decode_weights` makes them once per weight version
    instead (XLA:GPU does not hoist them out of the loop by itself). That is a second copy of every
    layer weight while the sampler keeps them, which a TPU does without."""
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

    def __call__(self, tokens, positions, segment_ids, cache: kv_cache.KVCache | None = None, **images):
        hidden, new_cache = self.hidden_states(tokens, positions, segment_ids, cache, **images)
        return self.logits(hidden), new_cache

    def hidden_states(self, tokens, positions, segment_ids, cache: kv_cache.KVCache | None = None, **images):
        return self.model._hidden(tokens, positions, segment_ids, cache, self.layers, **images)

    def logits(self, hidden):
        return self.model._apply_head(hidden, self.head)


def _run_cached(cfg, x, params, ropes, segment_ids, positions, cache: kv_cache.KVCache, layers=None):
    """The layers over a KV cache, unrolled: each writes this call's keys and values at the cache's
    next columns and attends over the whole cache, the cache being one array per layer. They run on
    `layers` (a `Decoding`'s decode weights, which the samplers prefill and decode on) if given,
    else on slices of the stacked weights."""
    columns = kv_cache.write_columns(cache, segment_ids, positions)
    attend = tuple(
        functools.partial(
            cached_attention,
            mask=attention_mask(segment_ids, positions, *columns, kind.sliding_window),
            chunk_size=cfg.attention_chunk_size,
            matmuls=cfg.platform != "cpu",
        )
        for kind in layer_kinds(cfg)
    )
    write = functools.partial(kv_cache.write, cache)
    x, ks, vs, routed = _run_unrolled(cfg, x, params, layers, ropes, attend, segment_ids, write)
    # The sampler's routes (routing replay) are the experts of these calls: reported for it to collect.
    moe.report(routed)
    return x, kv_cache.written(cache, ks, vs, columns, x.shape[1])


def _run_unrolled(cfg, x, params, layers, ropes, attend, segment_ids, write=None):
    """The layers in order, unrolled, on `layers` (decode weights) if given, else on slices of the
    stacked weights `params`; `write(i, k, v)` stores layer i's keys and values in a cache and
    returns the cache's, which the layer attends to. Returns x, each layer's keys and values (the
    call's own without `write`) and the layers' RouterStats stacked (None when dense)."""
    ks, vs, routed = [], [], []
    kinds = layer_kind_ids(cfg) if len(ropes) > 1 else None
    for i in range(cfg.num_decoder_layers):
        p = layers[i] if layers is not None else jax.tree.map(lambda a: a[i], params)
        if kinds is not None:  # known when tracing: `_of_kind` picks, no switch runs
            p = {**p, "layer_kind": int(kinds[i])}
        store = None if write is None else functools.partial(write, i)
        x, (k, v), stats = _layer(cfg, p, x, ropes, attend, segment_ids, store)
        ks.append(k)
        vs.append(v)
        routed.append(stats)
    return x, ks, vs, jax.tree.map(lambda *a: jnp.stack(a), *routed) if cfg.num_experts else None


_MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", moe.ROUTER, *moe.EXPERT_PARAMS)
# The input axes of a dense layer's decode weights: what a quantised decode weight's scale reduces.
_IN_AXES = {"wqkv": (0,), "wo": (0, 1), "w_gate": (0,), "w_up": (0,), "w_down": (0,)}


def _decode_weights(cfg: ModelConfig, p: dict) -> dict:
    """One layer's parameters as a decode step applies them: every matmul weight in the compute
    dtype, and wq, wk, wv as one weight `wqkv` [embed, kv_heads, group + 2, head_dim]: each KV
    head's query heads, key and value together, so that it splits over the kv_heads axis as they
    do. One projection instead of three saves two passes over the input. The weights keep their
    inputs-first layout: XLA:CPU streams a few rows through it faster than through its transpose."""
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


def _layer(cfg: ModelConfig, p, x, ropes, attends, segment_ids, write=None):
    """One pre-norm block: x + attend(q, k, v) of norm(x), then x + SwiGLU(norm(x)) (or the sparse
    MLP), `ropes` and `attends` holding each layer kind's RoPE tables and attention (`_of_kind`).
    With a cache, `write(k, v)` stores this call's keys and values [B, K, T, D] and returns the
    cache's. p holds the layer's parameters or its `_decode_weights`. Returns the new x, the keys
    and values attended to, and the layer's RouterStats (None when dense)."""
    q, k, v = _attention_inputs(cfg, p, x, _of_kind(p, ropes))
    if write is not None:
        k, v = write(k, v)
    attn = _of_kind(p, attends)(q, k.astype(cfg.dtype), v.astype(cfg.dtype))
    x, routed = _block_output(cfg, p, x, attn, segment_ids, p.get("routes"))
    return x, (k, v), routed


def _of_kind(p, per_kind: tuple):
    """The entry of `per_kind` (one per attention.layer_kinds: RoPE tables, or attention functions)
    for the layer of parameters p, by its `layer_kind` (`Decoder._stacked_layers`; a traced index
    in a scan, among functions a switch)."""
    if len(per_kind) == 1:
        return per_kind[0]
    kind = p["layer_kind"]
    if not isinstance(kind, jax.core.Tracer):
        return per_kind[int(kind)]
    if callable(per_kind[0]):
        return lambda *args: jax.lax.switch(kind, per_kind, *args)
    return jax.tree.map(lambda *tables: jnp.stack(tables)[kind], *per_kind)


def _attention_inputs(cfg: ModelConfig, p, x, rope):
    """The block's queries [B, T, H, D] and keys and values [B, K, T, D] of norm(x); `rope`: its
    (cos, sin)."""
    dt = cfg.dtype
    h = _norm(cfg, x, p["attn_norm"])
    q, k, v = _project_qkv(cfg, p, h)
    if cfg.qkv_bias:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    if cfg.qk_norm:
        q, k = _norm(cfg, q, p["q_norm"]), _norm(cfg, k, p["k_norm"])
    if cfg.query_pre_attn_scalar:  # the attention divides the scores by sqrt(head_dim)
        q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), dt)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    q = _constrain(cfg, q, ("batch", "length", "heads", "kv"))
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _block_output(cfg: ModelConfig, p, x, attn, segment_ids, routes=None):
    """The rest of the block from the attention's output: x + its projection, then the MLP. Returns
    the new x and the layer's RouterStats over the real tokens (segment > 0; None when dense).
    `routes` [B, T, k]: the layer's replayed experts (moe.moe_mlp)."""
    dt = cfg.dtype
    # One contracted axis (heads x head_dim): with two, XLA may pick their order by the attention
    # output's layout and transpose the weight to match, on every decode step.
    x = x + _post_norm(cfg, _dense(attn, p["wo"].astype(dt), n_in=2), p, "attn_post_norm")
    x = _constrain(cfg, x, ("batch", "length", "activation_embed"))
    h = _norm(cfg, x, p["mlp_norm"])
    if cfg.num_experts:
        y, routed = moe.moe_mlp(
            h,
            p,
            segment_ids > 0,
            k=cfg.num_experts_per_tok,
            normalise=cfg.moe_norm_topk_prob,
            dtype=dt,
            rules=cfg.logical_axis_rules,
            routes=routes,
        )
    else:
        hidden = cfg.family.activation(_dense(h, p["w_gate"].astype(dt))) * _dense(h, p["w_up"].astype(dt))
        hidden = _constrain(cfg, hidden, ("batch", "length", "mlp"))
        y, routed = _dense(hidden, p["w_down"].astype(dt)), None
    y = _post_norm(cfg, y, p, "mlp_post_norm")
    return _constrain(cfg, x + y, ("batch", "length", "activation_embed")), routed


def _post_norm(cfg: ModelConfig, y, p, name: str):
    """A sublayer's output y normed by p[name] where the family norms them (Family.post_norms)."""
    return _norm(cfg, y, p[name]) if cfg.family.post_norms else y


def _dense(x, w, n_in=1):
    """x's last `n_in` axes contracted with w's first: one matmul of the rows flattened to one axis
    by the weight flattened to two (both reshapes are bitcasts). The weight gradient then contracts
    a single row axis; over batch and length XLA:CPU would first copy the activation or its gradient
    into a transposed layout, for every projection of every layer (a third of the SFT step).
    Rows split along the sequence (context parallelism) are contracted as they are: flattened, a
    device's part of each row would not be one block of the flat axis, and every activation would
    be gathered whole to make it one."""
    if sharding.sequence_shards() > 1:
        return jnp.tensordot(x, w, axes=n_in)
    rows = x.shape[: x.ndim - n_in]
    flat = w.reshape(math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:]))  # a QArray's reshape takes no -1
    y = quant.matmul(x.reshape(math.prod(rows), -1), flat)
    return y.reshape(*rows, *w.shape[n_in:])


def _norm(cfg: ModelConfig, x, weight):
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.family.norm_offset)


def rms_norm(x, weight, eps, offset=0.0):
    """RMSNorm computed in float32, then cast back, as the HF reference does: scaled by `weight`
    in x's dtype, or by `offset` + weight in float32 (Gemma's order)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
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


def rope_tables(cfg: ModelConfig, positions) -> tuple:
    """(cos, sin) of each layer kind (attention.layer_kinds): `kind_rope_tables`."""
    return tuple(kind_rope_tables(kind, positions) for kind in layer_kinds(cfg))


def kind_rope_tables(cfg: ModelConfig, positions):
    """cos/sin [B, T, head_dim] for the rotate-half RoPE layout used by HF checkpoints, of positions
    [B, T], or of M-RoPE's [B, T, 3]: each frequency turns with the axis its `mrope_section` names."""
    if positions.ndim == 3:
        axis_of_frequency = np.repeat(np.arange(len(cfg.mrope_section)) % 3, cfg.mrope_section)
        positions = jnp.take(positions, jnp.asarray(axis_of_frequency), axis=-1)  # [B, T, head_dim / 2]
    else:
        positions = positions[..., None]
    angles = positions.astype(jnp.float32) * jnp.asarray(rope_inv_freq(cfg))
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


def create(cfg: ModelConfig, seed: int = 0, hf_writer: Callable | None = None) -> Decoder:
    """A randomly initialised model (unsharded); see sharding.init_sharded for the sharded path."""
    return Decoder(cfg, rngs=nnx.Rngs(params=seed), hf_writer=hf_writer)
