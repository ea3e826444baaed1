"""Hugging Face checkpoints (config.json + safetensors) <-> unitrain's decoder (models/decoder.py).

    model = unitrain.adapters.hf.load(path, dtype="bfloat16", mesh=mesh)
    unitrain.adapters.hf.save(model, out_dir)      # loads with AutoModelForCausalLM.from_pretrained

Loading never materialises a whole parameter per device: every device's slice is read from the
safetensors file(s) on its own (safetensors reads lazily), transposed into unitrain's layout and
placed with `jax.make_array_from_callback`. Weights are read from safetensors only, never pickle.

A mixture of experts' weights come in either layout transformers writes: a tensor per expert (the
published checkpoints and transformers' save_pretrained: Qwen3-MoE's `mlp.experts.{j}.gate_proj`,
Mixtral's `block_sparse_moe.experts.{j}.w1`) or the fused tensors of transformers 5's modules
(`mlp.experts.gate_up_proj` [experts, 2 * moe_mlp_dim, emb], `mlp.experts.down_proj`); `save`
writes the per-expert one, which transformers, vLLM and older readers all load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import transformers
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from unitrain import sharding
from unitrain.adapters import hf_config
from unitrain.errors import CheckpointError, ConfigError
from unitrain.models import decoder as model_lib
from unitrain.models import gemma3_vision, qwen2_5_vl

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """How one unitrain parameter (per layer) is laid out in the HF tensor.

    The HF tensor is viewed with axis `split[0]` split into (outer, split[1]) (heads x head_dim),
    then transposed by `perm` into unitrain's layout: unitrain axis u is view axis perm[u].
    `experts`: hf_key names one tensor per expert ({j}), stacked on the parameter's leading axis
    (perm and split then describe one expert's tensor). `part` = (axis, index, count): the parameter
    is the index-th of `count` equal blocks of the HF tensor along that axis (a fused gate_up, the
    vision tower's fused qkv), the split, if on that axis, inside the block.
    """

    hf_key: str
    perm: tuple[int, ...]
    split: tuple[int, int] | None = None
    experts: bool = False
    part: tuple[int, int, int] | None = None


def _expert_mappings(cfg: model_lib.ModelConfig, fused: bool) -> dict[str, _Mapping]:
    """The sparse MLP's parameters: per-expert tensors [out, in] (each expert's [in, out] here), or
    transformers 5's fused ones, gate_up [X, 2M, E] (gate first) and down [X, E, M]."""
    if fused:
        return {
            "layers.router": _Mapping("model.layers.{i}.mlp.gate.weight", (1, 0)),
            "layers.moe_gate": _Mapping(FUSED_EXPERTS, (0, 2, 1), part=(1, 0, 2)),
            "layers.moe_up": _Mapping(FUSED_EXPERTS, (0, 2, 1), part=(1, 1, 2)),
            "layers.moe_down": _Mapping("model.layers.{i}.mlp.experts.down_proj", (0, 2, 1)),
        }
    if cfg.model_family == "mixtral":
        block = "model.layers.{i}.block_sparse_moe."
        names = {"router": block + "gate", "moe_gate": block + "experts.{j}.w1", "moe_up": block + "experts.{j}.w3"}
        names["moe_down"] = block + "experts.{j}.w2"
    else:
        mlp = "model.layers.{i}.mlp."
        names = {
            "router": mlp + "gate",
            "moe_gate": mlp + "experts.{j}.gate_proj",
            "moe_up": mlp + "experts.{j}.up_proj",
        }
        names["moe_down"] = mlp + "experts.{j}.down_proj"
    return {f"layers.{name}": _Mapping(hf + ".weight", (1, 0), experts=name != "router") for name, hf in names.items()}


# A tensor only transformers 5's fused expert layout has: its presence says which layout to read.
FUSED_EXPERTS = "model.layers.{i}.mlp.experts.gate_up_proj"


def _mappings(cfg: model_lib.ModelConfig, fused_experts: bool = False) -> dict[str, _Mapping]:
    """unitrain parameter path -> HF tensor name ({i} = layer index, {j} = expert) and layout;
    `fused_experts`: a sparse MLP in transformers 5's fused tensors."""
    D = cfg.head_dim
    attn, mlp = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    m = {
        "embed": _Mapping("model.embed_tokens.weight", (0, 1)),
        "final_norm": _Mapping("model.norm.weight", (0,)),
        "layers.attn_norm": _Mapping("model.layers.{i}.input_layernorm.weight", (0,)),
        "layers.mlp_norm": _Mapping("model.layers.{i}.post_attention_layernorm.weight", (0,)),
        # q/k/v: HF [heads*head_dim, emb] -> view [heads, head_dim, emb] -> unitrain [emb, heads, head_dim]
        "layers.wq": _Mapping(attn + "q_proj.weight", (2, 0, 1), (0, D)),
        "layers.wk": _Mapping(attn + "k_proj.weight", (2, 0, 1), (0, D)),
        "layers.wv": _Mapping(attn + "v_proj.weight", (2, 0, 1), (0, D)),
        # o: HF [emb, heads*head_dim] -> view [emb, heads, head_dim] -> unitrain [heads, head_dim, emb]
        "layers.wo": _Mapping(attn + "o_proj.weight", (1, 2, 0), (1, D)),
    }
    if cfg.num_experts:
        m.update(_expert_mappings(cfg, fused_experts))
    else:
        m["layers.w_gate"] = _Mapping(mlp + "gate_proj.weight", (1, 0))
        m["layers.w_up"] = _Mapping(mlp + "up_proj.weight", (1, 0))
        m["layers.w_down"] = _Mapping(mlp + "down_proj.weight", (1, 0))
    if cfg.qkv_bias:
        for name, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            m[f"layers.{name}"] = _Mapping(attn + proj + ".bias", (0, 1), (0, D))
    if cfg.qk_norm:
        m["layers.q_norm"] = _Mapping(attn + "q_norm.weight", (0,))
        m["layers.k_norm"] = _Mapping(attn + "k_norm.weight", (0,))
    if cfg.family.post_norms:  # Gemma 3's post_attention_layernorm norms the attention's output
        layer = "model.layers.{i}."
        m["layers.attn_post_norm"] = _Mapping(layer + "post_attention_layernorm.weight", (0,))
        m["layers.mlp_norm"] = _Mapping(layer + "pre_feedforward_layernorm.weight", (0,))
        m["layers.mlp_post_norm"] = _Mapping(layer + "post_feedforward_layernorm.weight", (0,))
    if cfg.output_head and not cfg.tie_word_embeddings:
        m["lm_head"] = _Mapping("lm_head.weight", (1, 0))
    prefix = _TEXT_PREFIX.get(cfg.model_family, "")
    return {name: dataclasses.replace(v, hf_key=prefix + v.hf_key) for name, v in m.items()}


# Where a vision-language checkpoint keeps its text model's tensors (Gemma 3's `language_model.model.*`,
# as the published checkpoints and transformers' save_pretrained name them).
_TEXT_PREFIX = {"gemma3": "language_model."}


def _gemma3_vision_mappings(cfg: gemma3_vision.VisionConfig, tower: str) -> dict[str, _Mapping]:
    """Gemma 3's SigLIP tower (models/gemma3_vision.py) under `tower` and its projector: the patch
    embedding's Conv2d kernel [E, C, p, p], q/k/v and out as the decoder's with biases."""
    D, block = cfg.head_dim, tower + "encoder.layers.{i}."
    attn, projector = block + "self_attn.", "multi_modal_projector."
    m = {
        "vision.patch_embed": _Mapping(tower + "embeddings.patch_embedding.weight", (1, 2, 3, 0)),
        "vision.patch_bias": _Mapping(tower + "embeddings.patch_embedding.bias", (0,)),
        "vision.position_embed": _Mapping(tower + "embeddings.position_embedding.weight", (0, 1)),
        "vision.post_norm": _Mapping(tower + "post_layernorm.weight", (0,)),
        "vision.post_norm_bias": _Mapping(tower + "post_layernorm.bias", (0,)),
        "vision.soft_norm": _Mapping(projector + "mm_soft_emb_norm.weight", (0,)),
        "vision.projection": _Mapping(projector + "mm_input_projection_weight", (0, 1)),
        "vision.blocks.wo": _Mapping(attn + "out_proj.weight", (1, 2, 0), (1, D)),
        "vision.blocks.bo": _Mapping(attn + "out_proj.bias", (0,)),
        "vision.blocks.w_up": _Mapping(block + "mlp.fc1.weight", (1, 0)),
        "vision.blocks.b_up": _Mapping(block + "mlp.fc1.bias", (0,)),
        "vision.blocks.w_down": _Mapping(block + "mlp.fc2.weight", (1, 0)),
        "vision.blocks.b_down": _Mapping(block + "mlp.fc2.bias", (0,)),
    }
    for ours, theirs in (("attn_norm", "layer_norm1"), ("mlp_norm", "layer_norm2")):
        m[f"vision.blocks.{ours}"] = _Mapping(block + f"{theirs}.weight", (0,))
        m[f"vision.blocks.{ours}_bias"] = _Mapping(block + f"{theirs}.bias", (0,))
    for name in "qkv":
        m[f"vision.blocks.w{name}"] = _Mapping(attn + f"{name}_proj.weight", (2, 0, 1), (0, D))
        m[f"vision.blocks.b{name}"] = _Mapping(attn + f"{name}_proj.bias", (0, 1), (0, D))
    return m


# Gemma 3's tower as transformers 5 saves it, and as the published checkpoints name it.
GEMMA3_TOWERS = ("vision_tower.", "vision_tower.vision_model.")


def _tower_mappings(vision, tensors=()) -> dict[str, _Mapping]:
    """The vision tower's mappings of either family; Gemma 3's under the prefix among `tensors` (the
    checkpoint's names; none: the one save writes)."""
    if isinstance(vision, qwen2_5_vl.VisionConfig):
        return _vision_mappings(vision)
    tower = next((t for t in GEMMA3_TOWERS[1:] if t + "post_layernorm.weight" in tensors), GEMMA3_TOWERS[0])
    return _gemma3_vision_mappings(vision, tower)


def _vision_mappings(cfg: qwen2_5_vl.VisionConfig) -> dict[str, _Mapping]:
    """Qwen2.5-VL's vision tower (models/qwen2_5_vl.py) in `visual.*`: its fused qkv [3 * E, E] one
    third per projection, the patch embedding's Conv3d kernel [E, C, t, p, p] as it is."""
    D, block = cfg.head_dim, "visual.blocks.{i}."
    m = {
        "vision.patch_embed": _Mapping("visual.patch_embed.proj.weight", (1, 2, 3, 4, 0)),
        "vision.merge_norm": _Mapping("visual.merger.ln_q.weight", (0,)),
        "vision.merge_w1": _Mapping("visual.merger.mlp.0.weight", (1, 0)),
        "vision.merge_b1": _Mapping("visual.merger.mlp.0.bias", (0,)),
        "vision.merge_w2": _Mapping("visual.merger.mlp.2.weight", (1, 0)),
        "vision.merge_b2": _Mapping("visual.merger.mlp.2.bias", (0,)),
        "vision.blocks.attn_norm": _Mapping(block + "norm1.weight", (0,)),
        "vision.blocks.mlp_norm": _Mapping(block + "norm2.weight", (0,)),
        "vision.blocks.wo": _Mapping(block + "attn.proj.weight", (1, 2, 0), (1, D)),
        "vision.blocks.bo": _Mapping(block + "attn.proj.bias", (0,)),
    }
    for j, name in enumerate("qkv"):
        m[f"vision.blocks.w{name}"] = _Mapping(block + "attn.qkv.weight", (2, 0, 1), (0, D), part=(0, j, 3))
        m[f"vision.blocks.b{name}"] = _Mapping(block + "attn.qkv.bias", (0, 1), (0, D), part=(0, j, 3))
    for name in ("gate", "up", "down"):
        m[f"vision.blocks.w_{name}"] = _Mapping(block + f"mlp.{name}_proj.weight", (1, 0))
        m[f"vision.blocks.b_{name}"] = _Mapping(block + f"mlp.{name}_proj.bias", (0,))
    return m


# The parameters stacked on a leading layer axis, by the prefix of their path.
_STACKED = ("layers.", "vision.blocks.")


def tensor_names(cfg: model_lib.ModelConfig) -> dict[str, str]:
    """unitrain parameter path ('.'-joined) -> its HF tensor name ({i} = layer index, {j} = expert)."""
    return {name: m.hf_key for name, m in _mappings(cfg).items()}


def _hf_names(m: _Mapping, cfg: model_lib.ModelConfig, layer: int | None) -> list[str]:
    """The HF tensors holding one parameter (of `layer`: None for one outside the stack)."""
    experts = range(cfg.num_experts) if m.experts else [None]
    return [m.hf_key.format(i=layer, j=j) for j in experts]


# ---------------------------------------------------------------- config.json <-> ModelConfig


def model_config_from_hf(path: str | Path, trust_remote_code: bool = False, **execution) -> model_lib.ModelConfig:
    """ModelConfig from an HF checkpoint dir; `execution` sets dtype, weight_dtype, remat_policy, ..."""
    keys = _vision_language_keys(path, trust_remote_code)
    keys = hf_config.model_keys(path, trust_remote_code) if keys is None else keys[0]
    return model_lib.ModelConfig(**keys, **execution)


def vision_config_from_hf(
    path: str | Path, trust_remote_code: bool = False
) -> qwen2_5_vl.VisionConfig | gemma3_vision.VisionConfig | None:
    """The vision tower of an HF vision-language checkpoint dir; None for a text model's."""
    keys = _vision_language_keys(path, trust_remote_code)
    if keys is None:
        return None
    return (gemma3_vision if "mm_tokens_per_image" in keys[1] else qwen2_5_vl).VisionConfig(**keys[1])


def _vision_language_keys(path, trust_remote_code: bool) -> tuple[dict, dict] | None:
    """(decoder keys, tower keys) of a vision-language checkpoint; None for a text model's."""
    model_type = hf_config.read_hf_config(path, trust_remote_code).model_type
    if model_type == hf_config.GEMMA3_VISION_TYPE:
        return hf_config.gemma3_vision_keys(path)
    return hf_config.vision_language_keys(path) if model_type in hf_config.VISION_LANGUAGE_TYPES else None


def _vision_language_config(
    cfg: model_lib.ModelConfig, vision: qwen2_5_vl.VisionConfig
) -> transformers.PreTrainedConfig:
    """config.json of a Qwen2.5-VL: the decoder's as its text config (M-RoPE's sections in its
    rope parameters), the tower's, the special tokens."""
    text = hf_config_from_model(dataclasses.replace(cfg, model_family="qwen2")).to_dict()
    text["rope_parameters"]["mrope_section"] = list(cfg.mrope_section)
    fields = {f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)}
    tokens = {name: fields.pop(name) for name in ("video_token_id", "vision_start_token_id", "vision_end_token_id")}
    rope_theta = fields.pop("rope_theta")
    return transformers.Qwen2_5_VLConfig(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type", "tie_word_embeddings")},
        vision_config=dict(
            fields,
            fullatt_block_indexes=list(vision.fullatt_block_indexes),
            hidden_act="silu",
            rope_parameters={"rope_type": "axial", "rope_theta": rope_theta},
        ),
        image_token_id=cfg.image_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        dtype=str(np.dtype(cfg.weight_dtype)),
        **tokens,
    )


def _gemma3_vision_config(
    cfg: model_lib.ModelConfig, vision: gemma3_vision.VisionConfig
) -> transformers.PreTrainedConfig:
    """config.json of a Gemma 3 vision-language model: the decoder's as its text config, the tower's,
    the image tokens."""
    text = hf_config_from_model(dataclasses.replace(cfg, model_family="gemma3_text")).to_dict()
    fields = {f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)}
    tokens = {name: fields.pop(name) for name in ("mm_tokens_per_image", "boi_token_id", "eoi_token_id")}
    return transformers.Gemma3Config(
        text_config={k: v for k, v in text.items() if k not in ("architectures", "model_type")},
        vision_config=dict(fields, hidden_act="gelu_pytorch_tanh", vision_use_head=False),
        mm_tokens_per_image=tokens["mm_tokens_per_image"],
        boi_token_index=tokens["boi_token_id"],
        eoi_token_index=tokens["eoi_token_id"],
        image_token_index=cfg.image_token_id,
        tie_word_embeddings=cfg.tie_word_embeddings,
        architectures=["Gemma3ForConditionalGeneration"],
        dtype=str(np.dtype(cfg.weight_dtype)),
    )


def hf_config_from_model(cfg: model_lib.ModelConfig) -> transformers.PreTrainedConfig:
    rope = {
        "rope_type": "default" if cfg.rope_scaling_type == "none" else cfg.rope_scaling_type,
        "rope_theta": cfg.rope_theta,
    }
    if cfg.rope_scaling_type != "none":
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    extra = dict(hidden_act="silu", **_expert_fields(cfg))
    if cfg.model_family in ("mistral", "mixtral"):
        extra["sliding_window"] = cfg.sliding_window
    if cfg.model_family == "gemma3_text":
        rope, extra = _gemma3_fields(cfg, rope)
    return transformers.AutoConfig.for_model(
        cfg.model_family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_dim,
        num_hidden_layers=cfg.num_decoder_layers,
        num_attention_heads=cfg.num_query_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=max(cfg.rope_original_max_position, 4096),
        dtype=str(np.dtype(cfg.weight_dtype)),
        architectures=hf_config.causal_lm_architectures(cfg.model_family),
        **extra,
    )


def _gemma3_fields(cfg: model_lib.ModelConfig, rope: dict) -> tuple[dict, dict]:
    """Gemma 3's rope_parameters (`rope` the global layers', the local ones' unscaled) and its
    fields beyond Llama's: hf_config's _gemma3_keys read back."""
    local_theta = cfg.rope_local_base_freq or cfg.rope_theta
    rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    return rope, dict(
        intermediate_size=cfg.mlp_dim,
        hidden_activation=hf_config.ACTIVATIONS["gemma3_text"][1],
        sliding_window=cfg.sliding_window,
        layer_types=hf_config.gemma3_layer_types(cfg.sliding_window_pattern, cfg.num_decoder_layers),
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
        final_logit_softcapping=cfg.final_logit_softcapping,
    )


def _expert_fields(cfg: model_lib.ModelConfig) -> dict:
    """config.json's MLP fields: hf_config.model_keys read back (every layer sparse)."""
    if cfg.model_family == "qwen3_moe":
        return dict(
            intermediate_size=cfg.mlp_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_mlp_dim,
            norm_topk_prob=cfg.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if cfg.model_family == "mixtral":
        return dict(
            intermediate_size=cfg.moe_mlp_dim,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
        )
    return dict(intermediate_size=cfg.mlp_dim)


# ---------------------------------------------------------------- load


class _TensorIndex:
    """Tensor name -> safetensors file, for single-file and sharded (index.json) checkpoints."""

    def __init__(self, path: Path):
        index_file = path / INDEX
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self.files = {name: path / f for name, f in weight_map.items()}
        elif (path / "model.safetensors").is_file():
            with open_safetensors(path / "model.safetensors") as f:
                self.files = {name: path / "model.safetensors" for name in f.keys()}
        else:
            raise ConfigError(
                f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors weights are loaded)"
            )
        self.path = path
        self._handles = {}

    def slice(self, name: str):
        if name not in self.files:
            raise ConfigError(f"{self.path}: tensor '{name}' is missing from the checkpoint")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = open_safetensors(file)
        return self._handles[file].get_slice(name)


def open_safetensors(file: Path):
    """A safetensors file opened lazily; a truncated or garbled one is a one-line ConfigError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{file}: not a readable safetensors file ({e})") from None


def _read_layer(index: _TensorIndex, key: str, m: _Mapping, view_shape, u_index, dtype) -> np.ndarray:
    """The block `u_index` (slices in unitrain's per-tensor layout) of one HF tensor, read lazily."""
    view_index = [None] * len(view_shape)
    for u_axis, v_axis in enumerate(m.perm):
        view_index[v_axis] = slice(*u_index[u_axis].indices(view_shape[v_axis]))
    hf_index, post_index, block_shape, v = [], [], [], 0
    hf_ndim = len(view_shape) - (1 if m.split else 0)
    for hf_axis in range(hf_ndim):
        if m.split and m.split[0] == hf_axis:
            outer, inner = view_index[v], view_index[v + 1]
            offset = m.part[1] * view_shape[v] * m.split[1] if m.part and m.part[0] == hf_axis else 0
            hf_index.append(slice(outer.start * m.split[1] + offset, outer.stop * m.split[1] + offset))
            block_shape += [outer.stop - outer.start, m.split[1]]
            post_index += [slice(None), inner]
            v += 2
        else:
            axis_slice = view_index[v]
            if m.part and m.part[0] == hf_axis:  # the part's block of the fused axis
                offset = m.part[1] * view_shape[v]
                axis_slice = slice(axis_slice.start + offset, axis_slice.stop + offset)
            hf_index.append(axis_slice)
            block_shape.append(view_index[v].stop - view_index[v].start)
            post_index.append(slice(None))
            v += 1
    block = np.asarray(index.slice(key)[tuple(hf_index)]).reshape(block_shape)
    return block[tuple(post_index)].transpose(m.perm).astype(dtype)


def _view_shape(u_shape, m: _Mapping):
    view = [0] * len(u_shape)
    for u_axis, v_axis in enumerate(m.perm):
        view[v_axis] = u_shape[u_axis]
    return tuple(view)


def _load_param(index: _TensorIndex, m: _Mapping, stacked: bool, var: nnx.Variable, sharding_) -> jax.Array:
    shape, dtype = var.shape, var.dtype
    per_layer_shape = shape[1:] if stacked else shape
    view_shape = _view_shape(per_layer_shape[1:] if m.experts else per_layer_shape, m)
    expected = [s for s in view_shape]
    if m.split:
        a = m.split[0]
        expected = expected[:a] + [expected[a] * expected[a + 1]] + expected[a + 2 :]
    if m.part:
        expected[m.part[0]] *= m.part[2]
    probe_key = m.hf_key.format(i=0, j=0)
    actual = list(index.slice(probe_key).get_shape())
    if actual != expected:
        raise ConfigError(f"tensor '{probe_key}' has shape {actual} but config.json implies {expected}")

    def read_layer(i, idx):
        if not m.experts:
            return _read_layer(index, m.hf_key.format(i=i), m, view_shape, idx, dtype)
        experts = range(*idx[0].indices(per_layer_shape[0]))
        return np.stack([_read_layer(index, m.hf_key.format(i=i, j=j), m, view_shape, idx[1:], dtype) for j in experts])

    def read(idx):
        if not stacked:
            return read_layer(None, idx)
        return np.stack([read_layer(i, idx[1:]) for i in range(*idx[0].indices(shape[0]))])

    return jax.make_array_from_callback(shape, sharding_, read)


def single_device_mesh():
    ones = {a: 1 for a in sharding.MESH_AXES}
    return sharding.create_mesh(ones, ones, devices=jax.devices()[:1])


def load(
    path: str | Path,
    dtype: str = "float32",
    mesh=None,
    *,
    rules=sharding.DEFAULT_RULES,
    trust_remote_code: bool = False,
    model_cfg: model_lib.ModelConfig | None = None,
    other_tensors: tuple[str, ...] = (),
    **execution,
) -> model_lib.Decoder:
    """An HF checkpoint dir as a unitrain Decoder whose parameters are placed in their shardings.

    The architecture is `model_cfg` (a run's, already reconciled with config.json by the config
    loader) or else read from config.json with `dtype`, `rules` and the ModelConfig execution fields
    in `execution` (weight_dtype, remat_policy, scan_layers; platform: the one programs are built for).
    `other_tensors`: tensors of the checkpoint the decoder does not hold and that are not an error
    (a classifier's score.weight, which its caller reads; a causal LM's lm_head under a scalar head).
    """
    path = Path(path)
    if model_cfg is None:
        execution.setdefault("weight_dtype", dtype)
        execution.setdefault("platform", sharding.target_platform())
        model_cfg = model_config_from_hf(path, trust_remote_code, dtype=dtype, logical_axis_rules=rules, **execution)
    cfg, rules = model_cfg, model_cfg.logical_axis_rules
    vision = vision_config_from_hf(path, trust_remote_code)
    mesh = mesh or single_device_mesh()
    index = _TensorIndex(path)
    rows = index.slice(_mappings(cfg)["embed"].hf_key).get_shape()[0]
    if rows < cfg.vocab_size:  # extra_tokens: the checkpoint's vocabulary, then grown (unitrain.vocab)
        from unitrain import vocab

        narrow = load(path, mesh=mesh, model_cfg=dataclasses.replace(cfg, vocab_size=rows), other_tensors=other_tensors)
        return vocab.grown(
            narrow, *vocab.wider(nnx.eval_shape(lambda: model_lib.create(cfg, hf_writer=save)), mesh, rules)
        )
    family = gemma3_vision if isinstance(vision, gemma3_vision.VisionConfig) else qwen2_5_vl
    create = model_lib.create if vision is None else functools.partial(family.create, vision=vision)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create(cfg, hf_writer=save)))
    shardings = sharding.state_shardings(abstract, mesh, rules)
    mappings = _mappings(cfg, fused_experts=FUSED_EXPERTS.format(i=0) in index.files)
    if vision is not None:
        mappings.update(_tower_mappings(vision, index.files))
    flat_vars = {".".join(str(k) for k in key_path): var for key_path, var in nnx.to_flat_state(abstract)}
    _check_no_unknown_tensors(path, index, cfg, mappings, flat_vars, other_tensors)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    loaded = {}
    for key_path, var in nnx.to_flat_state(abstract):
        name = ".".join(str(k) for k in key_path)
        array = _load_param(index, mappings[name], name.startswith(_STACKED), var, flat_shardings[key_path].get_value())
        loaded[key_path] = var.replace(array)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _check_no_unknown_tensors(path, index: _TensorIndex, cfg, mappings, flat_vars, other_tensors=()) -> None:
    """A tensor the model does not use means the config and weights disagree: say so, never drop it."""
    known = set(other_tensors)
    for name, m in mappings.items():
        layers = range(flat_vars[name].shape[0]) if name.startswith(_STACKED) else [None]
        known |= {hf_name for i in layers for hf_name in _hf_names(m, cfg, i)}
    if cfg.tie_word_embeddings:
        known.add("lm_head.weight")  # some tied checkpoints store a copy; the embedding is used
    unknown = sorted(n for n in index.files if n not in known and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ConfigError(
            f"{path}: checkpoint has tensors this config does not use, e.g. '{unknown[0]}' ({len(unknown)} in all)"
        )


def read_tensor(path: str | Path, name: str, shape: tuple, dtype, sharding_, perm: tuple = (1, 0)) -> jax.Array:
    """The HF tensor `name` of HF shape `shape` in the checkpoint at `path`, its axes in the order
    `perm` (by default a 2-D [out, in] transposed to unitrain's [in, out]), placed in `sharding_`
    (each device reads its slice). A missing one is a CheckpointError naming it, another shape a
    ConfigError."""
    index = _TensorIndex(Path(path))
    if name not in index.files:
        raise CheckpointError(f"{path}: the checkpoint has no tensor '{name}', which its config.json's class needs")
    var = jax.ShapeDtypeStruct(tuple(shape[p] for p in perm), dtype)
    return _load_param(index, _Mapping(name, perm), False, var, sharding_)


# ---------------------------------------------------------------- save


def _to_hf(array: np.ndarray, m: _Mapping) -> np.ndarray:
    """`array` in the HF tensor's layout: a view where numpy can give one (q/k/v/o's heads merge
    without a copy), else a copy."""
    view = array.transpose(np.argsort(m.perm))
    if m.split:
        a = m.split[0]
        view = view.reshape(view.shape[:a] + (view.shape[a] * view.shape[a + 1],) + view.shape[a + 2 :])
    return view


def _gathered(array: jax.Array) -> np.ndarray:
    """A parameter's whole host copy (a collective: every process gathers)."""
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _stand_in(array: jax.Array) -> np.ndarray:
    """A parameter's shape and no data: one zero broadcast (no memory; views of it stay views)."""
    return np.broadcast_to(np.zeros((), np.int8), array.shape)


def _vision(model: model_lib.Decoder):
    return model.vision.cfg if hasattr(model, "vision") else None


def hf_tensors(model: model_lib.Decoder, host=_gathered) -> Iterator[tuple[str, np.ndarray]]:
    """(HF tensor name, the tensor in HF's layout, a view of its host copy where it can be) of every
    parameter, one parameter brought to host (`host`) at a time; a tensor fused from several
    parameters once it has them all. Every process must run it to the end: gathering a sharded
    parameter is a collective."""
    cfg, vision = model.cfg, _vision(model)
    mappings = {**_mappings(cfg), **(_tower_mappings(vision) if vision else {})}
    parts: dict[str, dict[int, np.ndarray]] = {}  # a fused tensor's blocks until it has them all
    for key_path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(k) for k in key_path)
        full = host(var.get_value())
        m = mappings[name]
        for i in range(full.shape[0]) if name.startswith(_STACKED) else [None]:
            per_layer = full if i is None else full[i]
            for j, hf_name in enumerate(_hf_names(m, cfg, i)):
                tensor = _to_hf(per_layer[j] if m.experts else per_layer, m)
                if not m.part:
                    yield hf_name, tensor
                    continue
                blocks = parts.setdefault(hf_name, {})
                blocks[m.part[1]] = tensor
                if len(blocks) == m.part[2]:
                    del parts[hf_name]
                    yield hf_name, np.concatenate([blocks[k] for k in range(m.part[2])], axis=m.part[0])


def hf_shapes(model: model_lib.Decoder) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, shape) of what hf_tensors yields, in its order; nothing is gathered."""
    return [(name, tensor.shape) for name, tensor in hf_tensors(model, _stand_in)]


def hf_config_of(model: model_lib.Decoder) -> transformers.PreTrainedConfig:
    """The config.json of `model` as an HF checkpoint (what save writes beside the tensors)."""
    vision = _vision(model)
    if vision is None:
        return hf_config_from_model(model.cfg)
    if isinstance(vision, gemma3_vision.VisionConfig):
        return _gemma3_vision_config(model.cfg, vision)
    return _vision_language_config(model.cfg, vision)


def save(model: model_lib.Decoder, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`) on process 0.

    Every process must call it: gathering a sharded parameter to host is a collective.
    """
    path = Path(path)
    writer = _ShardWriter(path, max_shard_bytes) if jax.process_index() == 0 else None
    for hf_name, tensor in hf_tensors(model):
        if writer:
            writer.add(hf_name, np.ascontiguousarray(tensor))
    if writer:
        writer.close()
        hf_config_of(model).save_pretrained(str(path))


INDEX = "model.safetensors.index.json"


def add_tensors(path: str | Path, tensors: dict[str, np.ndarray], file_name: str) -> None:
    """Adds `tensors` to the HF checkpoint at `path` as one more safetensors file joined by the
    index: what a head adds to a backbone's save, whichever library wrote that. A single
    model.safetensors becomes model-00001.safetensors under a new index (transformers reads a
    model.safetensors alone, ignoring an index beside it)."""
    path = Path(path)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    else:
        with open_safetensors(path / "model.safetensors") as f:
            weight_map = {name: "model-00001.safetensors" for name in f.keys()}
        (path / "model.safetensors").rename(path / "model-00001.safetensors")
    save_file(tensors, str(path / file_name), metadata={"format": "pt"})
    weight_map.update({name: file_name for name in tensors})
    total = sum((path / f).stat().st_size for f in set(weight_map.values()))
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


class _ShardWriter:
    """Writes tensors to numbered safetensors files of at most `max_bytes`, then the index."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.pending: dict[str, np.ndarray] = {}
        self.total = 0
        path.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self.pending and sum(t.nbytes for t in self.pending.values()) + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.total += tensor.nbytes

    def _flush(self) -> None:
        file = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.path / file), metadata={"format": "pt"})
        self.files.append(file)
        self.weight_map.update({name: file for name in self.pending})
        self.pending = {}

    def close(self) -> None:
        self._flush()
        if len(self.files) == 1:
            (self.path / self.files[0]).rename(self.path / "model.safetensors")
            return
        # HF's naming says how many shards there are, known only now.
        n = len(self.files)
        renames = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in renames.items():
            (self.path / old).rename(self.path / new)
        weight_map = {name: renames[f] for name, f in self.weight_map.items()}
        (self.path / INDEX).write_text(
            json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2)
        )
