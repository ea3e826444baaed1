"""Tunix's model library (google-tunix, the `tunix` extra) behind unitrain's model interface.

    model = unitrain.adapters.tunix.load(path, dtype="float32", mesh=mesh)   # an HF checkpoint dir
    logits, cache = model(tokens, positions, segment_ids)                   # models/base.py

HF model_type llama, qwen2, qwen3, qwen3_moe and gemma3_text become tunix.models.llama3, qwen2,
qwen3 (both Qwen3s; the mixture of experts' per-expert tensors only) and gemma3, their weights read
by Tunix's own safetensors loaders (safetensors only, never pickle). The Tunix
model is the `net` attribute of a thin NNX wrapper, so its parameters are the wrapper's only state.

Tunix is called as `net(tokens, positions, cache, attention_mask)`:
  - positions go through unchanged: Tunix applies RoPE with them;
  - segment_ids and positions become attention_mask[b, q, k]: the same nonzero segment and
    position[k] <= position[q], so packed, left- and right-padded rows all work;
  - Tunix's cache writes each call's tokens at one column shared by all rows (its `end_index`),
    not at their positions, so the cache here also keeps each column's segment and position and
    the mask is built over those (library_model.py).
  - Gemma3's sliding-window layers measure the window in columns (Tunix's own mask), which equals
    the distance in positions wherever a row's tokens are contiguous: packed rows, and the
    sampler's left-padded prefill from an empty cache followed by one-token decode steps.

Parameters carry unitrain's logical axis names (out_sharding metadata, as in our decoder) and are
placed by `logical_axis_rules`; Tunix's own ShardingConfig gets the same names translated to mesh
axes, for its loader and its activation constraints.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file
from tunix.models import safetensors_loader
from tunix.models.gemma3 import model as gemma3
from tunix.models.gemma3 import params_safetensors as gemma3_params
from tunix.models.llama3 import model as llama3
from tunix.models.llama3 import params as llama3_params
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen2 import params as qwen2_params
from tunix.models.qwen3 import model as qwen3
from tunix.models.qwen3 import params as qwen3_params

from unitrain import sharding
from unitrain.adapters import library_model
from unitrain.adapters.hf import open_safetensors, single_device_mesh
from unitrain.adapters.hf_config import read_hf_config
from unitrain.adapters.library_model import Cache
from unitrain.errors import ConfigError

# unitrain remat_policy -> Tunix RematConfig member; Tunix remats a whole layer saving nothing, or not at all.
REMAT = {"none": "NONE", "full": "DECODER"}
# Tunix 0.1.7's Llama3 and Qwen3 apply RoPE with this theta whatever their config says.
_FIXED_ROPE_THETA = 1_000_000.0
# Tunix's Gemma3 repeats five sliding-window layers then one global layer.
_GEMMA3_PATTERN = tuple(
    "full_attention" if t == gemma3.AttentionType.GLOBAL else "sliding_attention"
    for t in gemma3.GEMMA3_ATTENTION_PATTERN
)

# ---------------------------------------------------------------- sharding: logical names per Tunix field

_ACTIVATIONS = {
    "act_btd": ("batch", "length", "activation_embed"),
    "act_btf": ("batch", "length", "mlp"),
    "act_btnh": ("batch", "length", "heads", "kv"),
}
_DENSE = {
    "emb_vd": ("vocab", "embed"),
    "emb_dv": ("embed", "vocab"),
    "q_weight_dnh": ("embed", "heads", "kv"),
    "kv_weight_dnh": ("embed", "kv_heads", "kv"),
    "o_weight_nhd": ("heads", "kv", "embed"),
    "ffw_weight_df": ("embed", "mlp"),
    "ffw_weight_fd": ("mlp", "embed"),
    "rms_norm_weight": ("norm",),
    **_ACTIVATIONS,
}
_NO_EXPERTS = (None, None, None)  # Qwen's mixture-of-experts fields; the dense models have no experts
_QWEN2 = {
    **_DENSE,
    "exp_weight_cdf": _NO_EXPERTS,
    "exp_weight_cfd": _NO_EXPERTS,
    "qkv_bias": (None,),
}  # q/k/v biases are flat [heads * head_dim] and tiny: replicated
_QWEN3 = {**_DENSE, "exp_weight_edf": _NO_EXPERTS, "exp_weight_efd": _NO_EXPERTS}
# Qwen3-MoE: its stacked experts [experts, embed, mlp] on our decoder's names (models/moe.py).
_QWEN3_MOE = {**_DENSE, "exp_weight_edf": ("expert", "embed", "mlp"), "exp_weight_efd": ("expert", "mlp", "embed")}
_GEMMA3 = {
    "emb_vd": ("vocab", "embed"),
    "q_weight_ndh": ("heads", "embed", "kv"),
    "kv_weight_cndh": (None, "kv_heads", "embed", "kv"),
    "qkv_weight_cndh": (None, "heads", "embed", "kv"),
    "o_weight_nhd": ("heads", "kv", "embed"),
    "ffw_weight_df": ("embed", "mlp"),
    "ffw_weight_fd": ("mlp", "embed"),
    "rms_norm_weight": ("norm",),
    **_ACTIVATIONS,
    "vision_proj": (None, None),
    "vision_soft_emb_norm_weight": (None,),
    "siglip": None,
}  # text only
# Tunix's Gemma3 names a mesh axis itself for a single kv head: kv_einsum's embed dim on 'fsdp'.
_MESH_AXIS_AS_LOGICAL = {"fsdp": "embed"}


def _sharding_config(cls, table: dict, rules):
    """Tunix's ShardingConfig from logical names: kept as names (rules None) or translated to mesh axes."""
    translate = lambda axes: axes if rules is None or axes is None else tuple(sharding.logical_to_spec(axes, rules))
    return cls(**{field: translate(axes) for field, axes in table.items()})


@functools.cache
def _hashable(config_cls):
    """Tunix's Qwen and Gemma configs are mutable dataclasses, hence unhashable; nnx keeps the config
    in the model's graph, and unitrain keys its compiled programs by that graph."""
    value_hash = lambda self: hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
    return type(config_cls.__name__, (config_cls,), {"__hash__": value_hash})


# ---------------------------------------------------------------- config.json -> Tunix ModelConfig


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes the interface needs (cache, FLOPs) whatever the family calls them."""

    vocab: int
    emb: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0  # a mixture of experts: its experts per layer, k of them per token, each of moe_mlp
    experts_per_tok: int = 0
    moe_mlp: int = 0


def _dims(hf) -> Dims:
    heads = hf.num_attention_heads
    return Dims(
        vocab=hf.vocab_size,
        emb=hf.hidden_size,
        mlp=hf.intermediate_size,
        layers=hf.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        experts=getattr(hf, "num_experts", None) or 0,
        experts_per_tok=getattr(hf, "num_experts_per_tok", None) or 0,
        moe_mlp=getattr(hf, "moe_intermediate_size", None) or 0,
    )


def _require(ok: bool, where, field: str, value, why: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: field '{field}' is {value!r}; {why}")


def _rope(rope: dict | None, where, field: str, types=("default",)) -> tuple[float, float]:
    """(theta, linear factor) of one RoPE parameter set (HF's defaults: theta 1e4, unscaled)."""
    rope = rope or {}
    rope_type = rope.get("rope_type", "default")
    _require(
        rope_type in types,
        where,
        f"{field}.rope_type",
        rope_type,
        f"Tunix's model takes rope_type {' or '.join(types)} here",
    )
    return float(rope.get("rope_theta", 10000.0)), float(rope.get("factor", 1.0))


# config.json fields Tunix's models have no code for: (field, accepted value, why), per kind of model.
_LLAMA_LIKE = (
    ("hidden_act", lambda v: v == "silu", "Tunix's MLP is SwiGLU (silu)"),
    ("mlp_bias", lambda v: not v, "Tunix's MLP has no biases"),
    ("use_sliding_window", lambda v: not v, "Tunix's model of this family has no sliding window"),
)
_NO_ATTENTION_BIAS = (("attention_bias", lambda v: not v, "Tunix's attention of this family has no biases"),)
_GEMMA3_FIELDS = (
    ("hidden_activation", lambda v: v == "gelu_pytorch_tanh", "Tunix's Gemma3 uses tanh-approximated GELU"),
    ("rms_norm_eps", lambda v: v == 1e-6, "Tunix's Gemma3 norms use 1e-6"),
    ("attn_logit_softcapping", lambda v: v is None, "Tunix's Gemma3 has no soft-capping"),
    ("final_logit_softcapping", lambda v: v is None, "Tunix's Gemma3 has no soft-capping"),
    ("use_bidirectional_attention", lambda v: not v, "Tunix's Gemma3 attends causally"),
    ("attention_bias", lambda v: not v, "Tunix's Gemma3 has no attention biases"),
    ("tie_word_embeddings", bool, "Tunix's Gemma3 ties its lm_head to the embedding"),
)


def _check_fields(hf, where, fields) -> None:
    for field, accepted, why in fields:
        value = getattr(hf, field, None)
        _require(accepted(value), where, field, value, why)


def _check_fixed_theta(hf, where, name: str) -> None:
    theta, _ = _rope(hf.rope_parameters, where, "rope_parameters")
    _require(
        theta == _FIXED_ROPE_THETA,
        where,
        "rope_parameters.rope_theta",
        theta,
        f"tunix 0.1.7's {name} applies RoPE with theta {_FIXED_ROPE_THETA:g} whatever its config says",
    )


def _llama3_config(hf, where, d: Dims, shd, weight_dtype, compute_dtype, remat):
    _check_fields(hf, where, _LLAMA_LIKE + _NO_ATTENTION_BIAS)
    _check_fixed_theta(hf, where, "Llama3")
    return llama3.ModelConfig(
        num_layers=d.layers,
        vocab_size=d.vocab,
        embed_dim=d.emb,
        hidden_dim=d.mlp,
        num_heads=d.heads,
        head_dim=d.head_dim,
        num_kv_heads=d.kv_heads,
        rope_theta=_FIXED_ROPE_THETA,
        norm_eps=hf.rms_norm_eps,
        shd_config=_sharding_config(llama3.ShardingConfig, _DENSE, shd),
        weight_tying=bool(hf.tie_word_embeddings),
        remat_config=llama3.RematConfig[remat],
    )


def _qwen_config(module, table, hf, d: Dims, shd, weight_dtype, compute_dtype, remat, rope_theta, **experts):
    return _hashable(module.ModelConfig)(
        **experts,
        num_layers=d.layers,
        vocab_size=d.vocab,
        embed_dim=d.emb,
        hidden_dim=d.moe_mlp if experts else d.mlp,
        num_heads=d.heads,
        head_dim=d.head_dim,
        num_kv_heads=d.kv_heads,
        rope_theta=rope_theta,
        norm_eps=hf.rms_norm_eps,
        use_tied_embedding=bool(hf.tie_word_embeddings),
        shd_config=_sharding_config(module.ShardingConfig, table, shd),
        remat_config=module.RematConfig[remat],
        dtype=jnp.dtype(compute_dtype),
        param_dtype=jnp.dtype(weight_dtype),
    )


def _qwen2_config(hf, where, d: Dims, shd, weight_dtype, compute_dtype, remat):
    _check_fields(hf, where, _LLAMA_LIKE)  # Qwen2 always has q/k/v biases, as has Tunix's
    theta, _ = _rope(hf.rope_parameters, where, "rope_parameters")
    return _qwen_config(qwen2, _QWEN2, hf, d, shd, weight_dtype, compute_dtype, remat, theta)


def _qwen3_config(hf, where, d: Dims, shd, weight_dtype, compute_dtype, remat):
    _check_fields(hf, where, _LLAMA_LIKE + _NO_ATTENTION_BIAS)
    _check_fixed_theta(hf, where, "Qwen3")
    return _qwen_config(qwen3, _QWEN3, hf, d, shd, weight_dtype, compute_dtype, remat, _FIXED_ROPE_THETA)


_QWEN3_MOE_FIELDS = (
    ("norm_topk_prob", bool, "Tunix's Qwen3-MoE renormalises the top-k router weights"),
    ("mlp_only_layers", lambda v: not v, "every layer of Tunix's Qwen3-MoE is sparse"),
    ("decoder_sparse_step", lambda v: v in (None, 1), "every layer of Tunix's Qwen3-MoE is sparse"),
)


def _qwen3_moe_config(hf, where, d: Dims, shd, weight_dtype, compute_dtype, remat):
    _check_fields(hf, where, _LLAMA_LIKE + _NO_ATTENTION_BIAS + _QWEN3_MOE_FIELDS)
    _check_fixed_theta(hf, where, "Qwen3-MoE")
    return _qwen_config(
        qwen3,
        _QWEN3_MOE,
        hf,
        d,
        shd,
        weight_dtype,
        compute_dtype,
        remat,
        _FIXED_ROPE_THETA,
        num_experts=d.experts,
        num_experts_per_tok=d.experts_per_tok,
    )


def _gemma3_config(hf, where, d: Dims, shd, weight_dtype, compute_dtype, remat):
    _check_fields(hf, where, _GEMMA3_FIELDS)
    expected = [_GEMMA3_PATTERN[i % len(_GEMMA3_PATTERN)] for i in range(d.layers)]
    _require(
        list(hf.layer_types) == expected,
        where,
        "layer_types",
        hf.layer_types,
        "Tunix's Gemma3 repeats 5 sliding-window layers then 1 global layer",
    )
    norms = {
        d.head_dim: gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        d.emb // d.heads: gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
    }
    scalar = hf.query_pre_attn_scalar
    _require(
        scalar in norms, where, "query_pre_attn_scalar", scalar, "Tunix's Gemma3 takes head_dim or hidden_size / heads"
    )
    rope = hf.rope_parameters
    local_theta, local_factor = _rope(
        rope["sliding_attention"], where, "rope_parameters.sliding_attention", ("default", "linear")
    )
    global_theta, global_factor = _rope(
        rope["full_attention"], where, "rope_parameters.full_attention", ("default", "linear")
    )
    return _hashable(gemma3.ModelConfig)(
        num_layers=d.layers,
        num_embed=d.vocab,
        embed_dim=d.emb,
        hidden_dim=d.mlp,
        num_heads=d.heads,
        head_dim=d.head_dim,
        num_kv_heads=d.kv_heads,
        sliding_window_size=hf.sliding_window,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_factor,
        global_scale_factor=global_factor,
        query_pre_attn_norm=norms[scalar],
        shd_config=_sharding_config(gemma3.ShardingConfig, _GEMMA3, shd),
        remat_config=gemma3.RematConfig[remat],
        param_dtype=jnp.dtype(weight_dtype),
    )


@dataclasses.dataclass(frozen=True)
class _Family:
    model_class: type
    config: Callable  # (hf config, config.json path, Dims, rules or None, weight dtype, compute dtype, remat) -> config
    loader: Any  # Tunix's module with create_model_from_safe_tensors and the HF key mapping


FAMILIES = {
    "llama": _Family(llama3.Llama3, _llama3_config, llama3_params),
    "qwen2": _Family(qwen2.Qwen2, _qwen2_config, qwen2_params),
    "qwen3": _Family(qwen3.Qwen3, _qwen3_config, qwen3_params),
    "qwen3_moe": _Family(qwen3.Qwen3, _qwen3_moe_config, qwen3_params),
    "gemma3_text": _Family(gemma3.Gemma3, _gemma3_config, gemma3_params),
}


def _read_hf_config(path: Path, trust_remote_code: bool):
    config_file = path / "config.json"
    hf = read_hf_config(path, trust_remote_code)
    why = f"model_source tunix supports {', '.join(FAMILIES)}"
    if hf.model_type == "gemma3":
        why += " (multimodal Gemma3 is not supported: use a text-only Gemma3ForCausalLM checkpoint)"
    _require(hf.model_type in FAMILIES, config_file, "model_type", hf.model_type, why)
    return hf


# ---------------------------------------------------------------- the model


class _PassThrough(nnx.Module):
    """Stands in for a Tunix model's output head (its lm_head, or its embedder's decode) and hands
    the final-normed hidden states through: Tunix's models have no hidden-state output of their own
    in every family, and the losses compute the logits from them chunk by chunk."""

    def __init__(self, embedder: nnx.Module | None = None):
        self.embedder = embedder

    def encode(self, *args, **kwargs):
        return self.embedder.encode(*args, **kwargs)

    def decode(self, x):
        return x

    def __call__(self, x):
        return x


def _headless(net: nnx.Module) -> nnx.Module:
    """A copy of `net` (same arrays) whose forward returns hidden states instead of logits."""
    copy = nnx.merge(*nnx.split(net))
    copy.embedder = _PassThrough(copy.embedder)
    if "lm_head" in vars(copy):
        copy.lm_head = _PassThrough()
    return copy


class TunixModel(library_model.LibraryModel):
    """A Tunix model with unitrain's model interface (models/base.py)."""

    def __init__(
        self, net: nnx.Module, family: str, dims: Dims, dtype: str, weight_dtype: str, hf_config: str, hf_tensors: tuple
    ):
        self.net = net
        self.family, self.dims, self.vocab_size = family, dims, dims.vocab
        self.dtype, self.weight_dtype = dtype, weight_dtype
        # What save_hf writes back: the source config.json and the source tensors' names and shapes.
        self.hf_config, self.hf_tensors = hf_config, hf_tensors

    def __call__(self, tokens, positions, segment_ids, cache: Cache | None = None):
        return self._forward(self._compute_net(), tokens, positions, segment_ids, cache)

    def hidden_states(self, tokens, positions, segment_ids, cache: Cache | None = None):
        hidden, new_cache = self._forward(_headless(self._compute_net()), tokens, positions, segment_ids, cache)
        return hidden if cache is None else (hidden, new_cache)

    def _forward(self, net, tokens, positions, segment_ids, cache):
        """net's output in the compute dtype and the updated cache (None without one)."""
        if cache is None:
            mask = library_model.attention_mask(segment_ids, positions, segment_ids, positions)
            out, _ = net(tokens, positions, None, mask)
            return out.astype(self.dtype), None
        # Tunix writes this call's keys and values at column end_index (mod the cache length); so do we.
        start = cache.layers["layer_0"]["end_index"][0] % cache.segment_ids.shape[1]
        cache, mask = library_model.written(cache, start, segment_ids, positions)
        out, layers = net(tokens, positions, cache.layers, mask)
        return out.astype(self.dtype), cache.replace(layers=layers)

    def logits(self, hidden):
        net = self._compute_net()
        head = net.lm_head if "lm_head" in vars(net) else net.embedder.decode  # only untied models have an lm_head
        return head(hidden).astype(self.dtype)

    def _compute_net(self) -> nnx.Module:
        """Tunix's Llama3 and Gemma3 compute in their parameters' dtype: parameters stored wider than
        the compute dtype (mixed precision) run as a cast copy (Qwen would cast them itself)."""
        if self.weight_dtype == self.dtype:
            return self.net
        graphdef, state = nnx.split(self.net)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(self.dtype), state))

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        d = self.dims
        kv = jnp.zeros((batch_size, max_length, d.kv_heads, d.head_dim), self.dtype)
        layer = {"k": kv, "v": kv, "end_index": jnp.zeros((batch_size,), jnp.int32)}
        return library_model.empty(layer, d.layers, batch_size, max_length)

    def cache_axes(self) -> Cache:
        return library_model.axes(("batch", "length", "kv_heads", "kv"), self.dims.layers)

    def flops_per_token(self, seq_len: int) -> float:
        """As metrics.train_flops_per_token counts them: 6 * matmul parameters per token (q, k, v, o,
        the three MLP matrices per layer, the lm_head once, tied or not) plus 12*L*H*D*T of attention;
        a mixture of experts' MLP as the k experts a token runs and the router (as our decoder's)."""
        d = self.dims
        mlp = d.experts_per_tok * 3 * d.emb * d.moe_mlp + d.emb * d.experts if d.experts else 3 * d.emb * d.mlp
        per_layer = d.emb * d.heads * d.head_dim * 2 + 2 * d.emb * d.kv_heads * d.head_dim + mlp
        matmul_params = d.layers * per_layer + d.emb * d.vocab
        return float(6 * matmul_params + 12 * d.layers * d.heads * d.head_dim * seq_len)

    def save_hf(self, path: str) -> None:
        """Writes the source checkpoint's tensors from the current parameters, by inverting Tunix's key
        mapping (one model.safetensors), and its config.json; every process calls it."""
        params = {
            ".".join(map(str, p)): np.asarray(multihost_utils.process_allgather(v.get_value(), tiled=True))
            for p, v in nnx.to_flat_state(nnx.state(self.net, nnx.Param))
        }
        if jax.process_index() != 0:
            return
        key_map = FAMILIES[self.family].loader._get_key_and_transform_mapping(self.net.config)
        tensors = {}
        for name, shape in self.hf_tensors:
            try:
                key, transform = safetensors_loader.torch_key_to_jax_key(key_map, name)
            except ValueError:
                continue  # not a parameter (Tunix's loader skips it too)
            if key.startswith("tmp."):
                tensor = _gemma3_projection(params, key)
            else:
                tensor = params.get(key, _expert(params, key))
            if tensor is not None:  # None: "unused." tensors, a tied model's stored lm_head copy
                tensors[name] = _to_hf(tensor, transform, shape)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(self.hf_config)


def _to_hf(tensor: np.ndarray, transform, hf_shape) -> np.ndarray:
    """Undoes Tunix's loader transform (transpose by `permute`, then reshape)."""
    if transform is None:
        return tensor
    permute, reshape = transform
    if reshape:
        tensor = tensor.reshape([hf_shape[i] for i in permute] if permute else hf_shape)
    if permute:
        tensor = tensor.transpose(np.argsort(permute))
    return np.ascontiguousarray(tensor)


def _expert(params: dict, key: str) -> np.ndarray | None:
    """One expert's projection out of Qwen3-MoE's stacked ones (Tunix's loader stacks
    "layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.kernel" into "layers.{i}.mlp.{..}_proj"), or
    None for a key that names no expert."""
    match = re.fullmatch(r"(layers\.\d+\.mlp\.)experts\.(\d+)\.(\w+_proj)\.kernel", key)
    return None if match is None else params[match[1] + match[3]][int(match[2])]


def _gemma3_projection(params: dict, key: str) -> np.ndarray:
    """Undoes Tunix's Gemma3 preprocessing of "tmp.layers.{i}.attn.{q,k,v}": it stores them
    [heads, embed, head_dim] in q_einsum / kv_einsum (stacked k, v) or qkv_einsum (fused)."""
    _, _, layer, _, which = key.split(".")
    attn = f"layers.{layer}.attn."
    if attn + "qkv_einsum.w" in params:
        w = params[attn + "qkv_einsum.w"]["qkv".index(which)]
    elif which == "q":
        w = params[attn + "q_einsum.w"]
    else:
        w = params[attn + "kv_einsum.w"]["kv".index(which)]
    return w.transpose(1, 0, 2)  # [embed, heads, head_dim]: the layout of Tunix's key mapping


# ---------------------------------------------------------------- load


def _logical_state(family: _Family, config):
    """The abstract parameters with their logical axis names (the config's ShardingConfig holds names)."""
    state = nnx.state(nnx.eval_shape(lambda: family.model_class(config, rngs=nnx.Rngs(0))))
    rename = lambda var: var.replace(
        out_sharding=tuple(_MESH_AXIS_AS_LOGICAL.get(a, a) for a in sharding.logical_axes_of(var))
    )
    return jax.tree.map(rename, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _tensor_shapes(path: Path) -> tuple:
    """(name, shape) of every tensor of the checkpoint's safetensors files (headers only)."""
    shapes = []
    for file in sorted(path.glob("*.safetensors")):
        with open_safetensors(file) as f:
            shapes += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    if not shapes:
        raise ConfigError(f"{path}: no *.safetensors files (only safetensors weights are loaded)")
    return tuple(shapes)


def load(
    path: str | Path,
    dtype: str = "float32",
    mesh=None,
    *,
    rules=sharding.DEFAULT_RULES,
    trust_remote_code: bool = False,
    max_replicated_param_mib: float | None = None,
    weight_dtype: str | None = None,
    remat_policy: str = "none",
    vocab_size: int = 0,
    output_head: bool = True,
) -> TunixModel:
    """An HF checkpoint dir as a Tunix model whose parameters are placed in their shardings.

    `dtype` is the compute dtype, `weight_dtype` (default: dtype) the parameters'. Dimensions that
    do not divide their mesh axes, and (with max_replicated_param_mib) a large parameter left fully
    replicated on several devices, are ConfigErrors before anything is read. A `vocab_size` above the
    checkpoint's grows its embedding and LM head (extra_tokens, unitrain.vocab). Without
    `output_head` the model is a scalar head's backbone (models/scalar_head.py): an untied LM head
    is dropped (a classifier checkpoint has none), and only hidden_states is called.
    """
    path = Path(path)
    if remat_policy not in REMAT:
        raise ConfigError(
            f"remat_policy '{remat_policy}' is not available with model_source tunix: Tunix remats "
            f"whole layers or nothing ({', '.join(REMAT)})"
        )
    hf = _read_hf_config(path, trust_remote_code)
    family, dims, weight_dtype = FAMILIES[hf.model_type], _dims(hf), weight_dtype or dtype
    configure = functools.partial(family.config, hf, path / "config.json", dims)
    execution = (weight_dtype, dtype, REMAT[remat_policy])
    logical = _logical_state(family, configure(None, *execution))
    mesh = mesh or single_device_mesh()
    try:
        shardings = sharding.state_shardings(logical, mesh, rules)
        config = configure(rules, *execution)
    except ValueError as e:  # an indivisible dimension, a logical name the rules lack
        raise ConfigError(f"{path}: {e}") from None
    if max_replicated_param_mib is not None:
        sharding.check_not_replicated(logical, mesh, rules, max_replicated_param_mib)
    hf_tensors = _tensor_shapes(path)
    if not hf.tie_word_embeddings and "lm_head.weight" not in dict(hf_tensors):
        raise ConfigError(
            f"{path}: untied embeddings and no lm_head.weight (an untied classifier has no lm_head.weight), "
            "which Tunix's loader requires; use model_source unitrain"
        )
    net = family.loader.create_model_from_safe_tensors(str(path), config, mesh=mesh, dtype=jnp.dtype(weight_dtype))
    if not output_head and "lm_head" in vars(net):
        net.lm_head = _PassThrough()
    model = TunixModel(
        _with_logical_axes(net, logical, shardings),
        hf.model_type,
        dims,
        dtype,
        weight_dtype,
        (path / "config.json").read_text(),
        hf_tensors,
    )
    if vocab_size > dims.vocab:
        wide = dataclasses.replace(dims, vocab=vocab_size)
        configure = functools.partial(family.config, hf, path / "config.json", wide)
        model = _with_vocab(model, family, configure, execution, mesh, rules)
    return model


def _with_vocab(model: TunixModel, family: _Family, configure, execution, mesh, rules) -> TunixModel:
    """The model with its vocabulary widened to the Dims behind `configure` (new rows: unitrain.vocab),
    and its HF config and tensor shapes to match, so save_hf writes the wider checkpoint."""
    from unitrain import vocab

    old, new = model.dims.vocab, configure.args[2].vocab
    config = json.loads(model.hf_config)
    config["vocab_size"] = new
    tensors = tuple((name, tuple(new if d == old else d for d in shape)) for name, shape in model.hf_tensors)
    abstract = nnx.eval_shape(
        lambda: TunixModel(
            family.model_class(configure(rules, *execution), rngs=nnx.Rngs(0)),
            model.family,
            configure.args[2],
            model.dtype,
            model.weight_dtype,
            json.dumps(config, indent=2),
            tensors,
        )
    )
    graphdef, _ = nnx.split(abstract)
    logical = _logical_state(family, configure(None, *execution))
    placed = nnx.to_pure_dict(sharding.state_shardings(logical, mesh, rules))
    targets = {"net": jax.tree.map(lambda s, p: (s, p), nnx.to_pure_dict(logical), placed)}
    return vocab.grown(model, graphdef, targets)


def _with_logical_axes(net: nnx.Module, logical, shardings) -> nnx.Module:
    """The loaded model with unitrain's logical names as its parameters' metadata, each parameter in
    the sharding they give: Tunix's loader placed them by the translated names already (no copy then),
    but for Gemma3's hard-coded single-kv-head axis under rules other than the default."""
    graphdef, loaded = nnx.split(net)
    loaded, placement = dict(nnx.to_flat_state(loaded)), dict(nnx.to_flat_state(shardings))
    placed = {  # a headless net (output_head off) lacks the logical state's lm_head
        p: var.replace(jax.device_put(loaded[p].get_value(), placement[p].get_value()))
        for p, var in nnx.to_flat_state(logical)
        if p in loaded
    }
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def source(cfg, mesh, output_head: bool = True) -> TunixModel:
    """`model_source: tunix`: the HF checkpoint at load_parameters_path through Tunix's model library;
    without `output_head`, a scalar head's backbone (load's output_head; its vocabulary the checkpoint's)."""
    path = cfg.load_parameters_path
    if not path or not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"model_source tunix loads an HF checkpoint directory (config.json + safetensors); "
            f"load_parameters_path is '{path}'" + ("" if path else " (it initialises no model at random)")
        )
    return load(
        path,
        cfg.dtype,
        mesh,
        rules=sharding.rules_from_config(cfg.logical_axis_rules),
        trust_remote_code=cfg.trust_remote_code,
        max_replicated_param_mib=cfg.max_replicated_param_mib,
        weight_dtype=cfg.weight_dtype,
        remat_policy=cfg.remat_policy,
        vocab_size=cfg.vocab_size if cfg.extra_tokens and output_head else 0,
        output_head=output_head,
    )
