"""An HF checkpoint's config.json as unitrain's architecture keys (the model section of base.yml).

A leaf beside config.py (it imports no JAX, no model and of unitrain only the errors): config loading
uses it to take a checkpoint's architecture as the run's, so the model that is built, the
`config.yml` that is written and the checkpoint agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from unitrain.errors import ConfigError

DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
MOE_TYPES = ("qwen3_moe", "mixtral")
MODEL_TYPES = DENSE_TYPES + MOE_TYPES
# Vision-language checkpoints: our decoder (its keys those of the text model) with a vision tower
# whose dimensions stay in the checkpoint's config.json (models/qwen2_5_vl.py, adapters/hf.py).
VISION_LANGUAGE_TYPES = ("qwen2_5_vl",)
# Gemma 3's (model_type gemma3): our decoder and models/gemma3_vision.py's tower, read and written by
# the HF adapter; not yet a run's model (its images have no data path: config loading refuses it).
GEMMA3_VISION_TYPE = "gemma3"
ROPE_TYPES = ("default", "linear", "llama3")


def read_hf_config(path: str | Path, trust_remote_code: bool = False):
    """An HF checkpoint dir's config.json; a missing or unreadable one is a one-line ConfigError."""
    import transformers  # here: only runs that load an HF checkpoint pay for the import

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path}: not an HF checkpoint directory (no config.json)")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"{config_file}: cannot be read as an HF config ({str(e).splitlines()[0]})") from None


def causal_lm_architectures(model_type: str) -> list[str]:
    """config.json's `architectures` for a causal LM of `model_type` as transformers' save_pretrained
    writes it, the class an inference engine builds (vLLM guesses one without it): e.g.
    ["Qwen2ForCausalLM"]; [] for a type transformers has no causal LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return [name] if name else []


def write_classifier_config(path: str | Path, num_labels: int, pad_token_id: int | None) -> None:
    """Makes the causal LM config.json at `path` a `<Family>ForSequenceClassification` one of
    `num_labels` labels (transformers' own label maps) and pad_token_id, by which transformers
    finds each row's last token."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = read_hf_config(path)
    config.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[config.model_type]]
    config.num_labels = num_labels
    config.pad_token_id = pad_token_id
    config.save_pretrained(str(path))


def _field(hf, name, config_file):
    value = getattr(hf, name, None)
    if value is None:
        raise ConfigError(f"{config_file}: config.json has no '{name}' field, which a {hf.model_type} model needs")
    return value


def _check_supported(hf, config_file, types=MODEL_TYPES) -> None:
    if hf.model_type not in types:
        raise ConfigError(f"{config_file}: field 'model_type' is '{hf.model_type}'; supported: {', '.join(types)}")
    if getattr(hf, "mlp_bias", False):
        raise ConfigError(f"{config_file}: field 'mlp_bias' is true; MLP biases are not supported")
    if hf.model_type != "qwen2" and getattr(hf, "attention_bias", False):
        raise ConfigError(f"{config_file}: field 'attention_bias' is true; only Qwen2 has attention biases here")
    if hf.model_type == "qwen3_moe" and (
        getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", [])
    ):
        raise ConfigError(
            f"{config_file}: fields 'decoder_sparse_step'/'mlp_only_layers' make some layers dense; only every layer "
            "sparse (decoder_sparse_step 1, mlp_only_layers []) is supported"
        )
    if getattr(hf, "router_jitter_noise", 0.0):
        raise ConfigError(f"{config_file}: field 'router_jitter_noise' is nonzero; router jitter is not supported")


def _expert_keys(hf, config_file) -> dict:
    """The mixture-of-experts keys: num_experts 0 alone for a dense model."""
    if hf.model_type == "qwen3_moe":
        return dict(
            num_experts=_field(hf, "num_experts", config_file),
            num_experts_per_tok=_field(hf, "num_experts_per_tok", config_file),
            moe_mlp_dim=_field(hf, "moe_intermediate_size", config_file),
            moe_norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        )
    if hf.model_type == "mixtral":  # every expert as wide as the dense MLP would be; always renormalised
        return dict(
            num_experts=_field(hf, "num_local_experts", config_file),
            num_experts_per_tok=_field(hf, "num_experts_per_tok", config_file),
            moe_mlp_dim=_field(hf, "intermediate_size", config_file),
            moe_norm_topk_prob=True,
        )
    return dict(num_experts=0)


def model_keys(path: str | Path, trust_remote_code: bool = False) -> dict:
    """The architecture keys of base.yml (config.MODEL_KEYS) that describe the checkpoint at `path`:
    of a vision-language one, its decoder's (vision_language_keys)."""
    config_file = Path(path) / "config.json"
    hf = read_hf_config(path, trust_remote_code)
    if hf.model_type in VISION_LANGUAGE_TYPES:
        keys = vision_language_keys(path)[0]
        return {k: v for k, v in keys.items() if k not in ("mrope_section", "image_token_id")}
    _check_supported(hf, config_file)
    return _decoder_keys(hf, hf.model_type, config_file)


def vision_language_keys(path: str | Path) -> tuple[dict, dict]:
    """(the decoder's keys, the vision tower's) of the vision-language checkpoint at `path`: the
    architecture keys of its text model with the multimodal RoPE's `mrope_section` and the
    `image_token_id` whose embeddings the images' features replace, and the fields of
    models/qwen2_5_vl.py's VisionConfig."""
    config_file = Path(path) / "config.json"
    hf = read_hf_config(path)
    _check_supported(hf, config_file, VISION_LANGUAGE_TYPES)
    text, vision = hf.text_config, hf.vision_config
    if vision.hidden_act != "silu":
        raise ConfigError(f"{config_file}: field 'vision_config.hidden_act' is '{vision.hidden_act}'; only 'silu'")
    keys = _decoder_keys(text, hf.model_type, config_file)
    keys.update(
        mrope_section=tuple(text.rope_parameters["mrope_section"]),
        image_token_id=hf.image_token_id,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )
    vision_keys = dict(
        depth=vision.depth,
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        num_heads=vision.num_heads,
        out_hidden_size=vision.out_hidden_size,
        fullatt_block_indexes=tuple(vision.fullatt_block_indexes),
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        spatial_merge_size=vision.spatial_merge_size,
        window_size=vision.window_size,
        in_channels=vision.in_channels,
        rope_theta=float(vision.rope_parameters["rope_theta"]),
        video_token_id=hf.video_token_id,
        vision_start_token_id=hf.vision_start_token_id,
        vision_end_token_id=hf.vision_end_token_id,
    )
    return keys, vision_keys


# Gemma 3's keys (_gemma3_keys) in every other family.
_NOT_GEMMA = dict(
    sliding_window_pattern=0, rope_local_base_freq=None, query_pre_attn_scalar=None, final_logit_softcapping=None
)
# The gated MLP's activation of each family: the config.json field naming it and its one value here.
ACTIVATIONS = {"gemma3_text": ("hidden_activation", "gelu_pytorch_tanh")}
_SILU = ("hidden_act", "silu")


def gemma3_vision_keys(path: str | Path) -> tuple[dict, dict]:
    """(the decoder's keys, the tower's) of the Gemma 3 vision-language checkpoint at `path`: its
    text model's keys as model_family gemma3 (Gemma 3 text whose images attend within themselves
    both ways) with the `image_token_id` its images' features replace, and the fields of
    models/gemma3_vision.py's VisionConfig."""
    config_file = Path(path) / "config.json"
    hf = read_hf_config(path)
    _check_supported(hf, config_file, (GEMMA3_VISION_TYPE,))
    vision = hf.vision_config
    if vision.hidden_act != "gelu_pytorch_tanh" or getattr(vision, "vision_use_head", False):
        raise ConfigError(
            f"{config_file}: fields 'vision_config.hidden_act'/'vision_use_head' are '{vision.hidden_act}'/"
            f"{vision.vision_use_head}; only gelu_pytorch_tanh without the pooling head (Gemma 3's SigLIP)"
        )
    keys = _decoder_keys(hf.text_config, "gemma3_text", config_file)
    keys.update(
        model_family=GEMMA3_VISION_TYPE,
        image_token_id=hf.image_token_id,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        final_logit_softcapping=None,  # transformers' Gemma3ForConditionalGeneration caps no logits
    )
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size")
    vision_keys = {name: getattr(vision, name) for name in (*fields, "patch_size", "num_channels")}
    vision_keys.update(
        layer_norm_eps=float(vision.layer_norm_eps),
        mm_tokens_per_image=hf.mm_tokens_per_image,
        boi_token_id=hf.boi_token_id,
        eoi_token_id=hf.eoi_token_id,
    )
    return keys, vision_keys


def _decoder_keys(hf, family: str, config_file) -> dict:
    """The architecture keys of the (text) model config `hf`, a decoder of `family`."""
    field, activation = ACTIVATIONS.get(family, _SILU)
    if getattr(hf, field, activation) != activation:
        raise ConfigError(f"{config_file}: field '{field}' is '{getattr(hf, field)}'; only '{activation}' is supported")
    if getattr(hf, "use_sliding_window", False):
        raise ConfigError(
            f"{config_file}: field 'use_sliding_window' is true; Qwen's per-layer sliding window is not supported"
        )
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    gemma = _gemma3_keys(hf, rope, config_file) if family == "gemma3_text" else dict(_NOT_GEMMA)
    rope = rope.get("full_attention", rope)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{config_file}: field 'rope_scaling.rope_type' is '{rope_type}'; supported: {', '.join(ROPE_TYPES)}"
        )
    heads = _field(hf, "num_attention_heads", config_file)
    emb = _field(hf, "hidden_size", config_file)
    return dict(
        model_family=family,
        vocab_size=_field(hf, "vocab_size", config_file),
        emb_dim=emb,
        mlp_dim=_field(hf, "intermediate_size", config_file),
        num_decoder_layers=_field(hf, "num_hidden_layers", config_file),
        num_query_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or emb // heads,
        rms_norm_eps=float(_field(hf, "rms_norm_eps", config_file)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling_type="none" if rope_type == "default" else rope_type,
        rope_scaling_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        qkv_bias=family in ("qwen2", "qwen2_5_vl"),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=getattr(hf, "sliding_window", None) if family in ("mistral", "mixtral", "gemma3_text") else None,
        **_expert_keys(hf, config_file),
        **gemma,
    )


def _gemma3_keys(hf, rope: dict, config_file) -> dict:
    """Gemma 3's keys beyond Llama's: its local and global layers (HF layer_types, which must follow
    one sliding_window_pattern), the local layers' RoPE base, the query scale, the logit cap.
    `rope` (its rope_parameters) has an entry per kind of layer; the local one is unscaled."""
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf, name, None):
            raise ConfigError(f"{config_file}: field '{name}' is set; Gemma 3 without it only is supported")
    local = rope.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{config_file}: field 'rope_parameters.sliding_attention.rope_type' is '{local['rope_type']}'; only default"
        )
    kinds = list(_field(hf, "layer_types", config_file))
    pattern = kinds.index("full_attention") + 1 if "full_attention" in kinds else len(kinds) + 1
    if kinds != gemma3_layer_types(pattern, len(kinds)):
        raise ConfigError(
            f"{config_file}: field 'layer_types' does not repeat {pattern - 1} sliding_attention layers and one "
            "full_attention layer; only such a pattern is supported"
        )
    softcap = getattr(hf, "final_logit_softcapping", None)
    return dict(
        sliding_window_pattern=pattern,
        rope_local_base_freq=float(local.get("rope_theta", 10000.0)),
        query_pre_attn_scalar=int(_field(hf, "query_pre_attn_scalar", config_file)),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def gemma3_layer_types(pattern: int, layers: int) -> list[str]:
    """HF layer_types of `layers` layers, every `pattern`-th global (sliding_window_pattern)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
