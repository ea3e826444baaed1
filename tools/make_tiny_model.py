"""Writes a random tiny HF checkpoint (config.json + safetensors + tokenizer) for tests and demos.

    python tools/make_tiny_model.py OUT_DIR --family qwen2 [--emb-dim 64 ...] [--corpus file.txt]

The weights come from transformers' own initialisation of the family's *ForCausalLM; the tokenizer
is a byte-level BPE trained locally (on --corpus when given, else on a built-in text), with a
ChatML chat template, so nothing is downloaded. qwen2_5_vl is a Qwen2.5-VL (its
*ForConditionalGeneration) with a tiny vision tower (TINY_VISION), its image-pad and vision
tokens in the tokenizer (its template writes image parts as Qwen2.5-VL's does), and the image processor's config beside it.
gemma3_vision is a Gemma 3 (Gemma3ForConditionalGeneration: gemma3's text model) with a tiny SigLIP
tower (TINY_SIGLIP: 28-pixel images, 4 tokens each), its image tokens in the tokenizer and its image
processor's config beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "mixtral", "qwen2_5_vl", "gemma3_vision")
MODEL_TYPES = {"gemma3": "gemma3_text"}  # the HF model_type where it is not the family name
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5-VL's template writes a user's image part as one pad between the vision tokens (the data
# pipeline makes it the image's many pads), its text parts as they are.
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = {  # config.json's field for each of Qwen2.5-VL's special tokens
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# Qwen2.5-VL's tower at a test's size: 3 blocks (the middle one attending within the whole image),
# windows of 2 x 2 merged tokens (56 pixels); images of a few hundred pixels a side make a few dozen
# patches.
TINY_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    fullatt_block_indexes=[1],
    window_size=56,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
# Gemma 3's SigLIP at a test's size: 28 x 28 pixels in 7 x 7 patches (4 x 4), pooled 2 x 2 into 4
# image tokens; its special tokens, by config.json's field.
TINY_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=7,
    vision_use_head=False,
    layer_norm_eps=1e-6,
)
GEMMA3_IMAGE_TOKENS = {
    "boi_token_index": "<start_of_image>",
    "image_token_index": "<image_soft_token>",
    "eoi_token_index": "<end_of_image>",
}
BUILTIN_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) <<48/2=24>>",
]


def build_tokenizer(vocab_size: int, corpus: list[str]):
    """A byte-level BPE PreTrainedTokenizerFast: every string encodes, whatever the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def hf_config(
    family: str,
    vocab_size: int,
    emb_dim: int,
    mlp_dim: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tie: bool,
    rope_scaling: str,
    sliding_window: int | None,
    rope_theta: float | None = None,
    experts: tuple[int, int, int] = (4, 2, 32),
):
    """`experts`: (experts, experts per token, expert MLP size) of the mixture-of-experts families."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    elif rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    if rope_theta is not None:
        rope["rope_theta"] = float(rope_theta)
    extra = {"sliding_window": sliding_window} if family in ("mistral", "mixtral") else {}
    num_experts, per_token, expert_mlp = experts
    if family == "qwen3_moe":
        extra.update(num_experts=num_experts, num_experts_per_tok=per_token, moe_intermediate_size=expert_mlp)
        extra.update(norm_topk_prob=True)
    if family == "mixtral":  # its experts are intermediate_size wide
        extra.update(num_local_experts=num_experts, num_experts_per_tok=per_token)
        mlp_dim = expert_mlp
    if family == "gemma3":
        rope, extra = gemma3_fields(rope, rope_scaling, rope_theta, sliding_window, head_dim)
    if family == "qwen2_5_vl":
        if emb_dim != heads * head_dim:
            raise ValueError("qwen2_5_vl's heads are emb_dim / heads wide: set --head-dim to that")
        half = head_dim // 2  # Qwen's sections (16, 24, 24) of 64 frequencies, scaled
        rope["mrope_section"] = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
        extra["vision_config"] = dict(TINY_VISION, out_hidden_size=emb_dim)
    return transformers.AutoConfig.for_model(
        MODEL_TYPES.get(family, family),
        vocab_size=vocab_size,
        hidden_size=emb_dim,
        intermediate_size=mlp_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie,
        rope_parameters=rope,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        **extra,
    )


def gemma3_fields(
    rope: dict, rope_scaling: str, rope_theta: float | None, sliding_window: int | None, head_dim: int
) -> tuple[dict, dict]:
    """(rope_parameters, other fields) of Gemma3. Its layers alternate (HF's default layer_types:
    every 6th is global, the rest slide over `sliding_window`), each kind with its own RoPE: `rope`
    (theta 1e6 unless given) is the global layers', the sliding ones keep theta 1e4 unscaled.
    Queries are scaled by 1/sqrt(head_dim)."""
    if rope_scaling == "llama3":
        raise ValueError("--rope-scaling llama3 does not apply to gemma3 (none or linear)")
    rope_parameters = {
        "full_attention": dict(rope, rope_theta=float(rope_theta or 1e6)),
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    extra = {"query_pre_attn_scalar": head_dim}
    if sliding_window is not None:
        extra["sliding_window"] = sliding_window
    return rope_parameters, extra


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    vocab_size: int = 512,
    emb_dim: int = 64,
    mlp_dim: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    tie: bool = False,
    rope_scaling: str = "none",
    sliding_window: int | None = None,
    corpus: list[str] | None = None,
    init_std: float = 0.02,
    seed: int = 0,
    rope_theta: float | None = None,
    extra_tokens: str | None = None,
    num_labels: int = 0,
    experts: tuple[int, int, int] = (4, 2, 32),
) -> Path:
    """Saves the checkpoint and tokenizer to `out_dir` and returns it. `extra_tokens` (a SID index .json
    or a token list, as the config key) are added to the tokenizer and the vocabulary holds them.
    `num_labels` > 0 makes a *ForSequenceClassification of that many labels (a reward model's form)
    instead of the causal LM. `experts`: (experts, experts per token, expert MLP size) of qwen3_moe
    and mixtral."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {FAMILIES}, got '{family}'")
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size, corpus or BUILTIN_CORPUS)
    if family in ("qwen2_5_vl", "gemma3_vision"):
        added = VISION_TOKENS if family == "qwen2_5_vl" else GEMMA3_IMAGE_TOKENS
        tokenizer.add_special_tokens({"additional_special_tokens": list(added.values())})
        if family == "qwen2_5_vl":
            tokenizer.chat_template = VISION_CHAT_TEMPLATE
        vocab_size = max(vocab_size, len(tokenizer))
    if extra_tokens:
        from unitrain.vocab import read_tokens

        tokenizer.add_tokens(read_tokens(extra_tokens))
        vocab_size = max(vocab_size, len(tokenizer))
    config = hf_config(
        "gemma3" if family == "gemma3_vision" else family,
        vocab_size,
        emb_dim,
        mlp_dim,
        layers,
        heads,
        kv_heads,
        head_dim,
        tie,
        rope_scaling,
        sliding_window,
        rope_theta,
        experts,
    )
    if family == "gemma3_vision":
        tokens = {field: tokenizer.convert_tokens_to_ids(token) for field, token in GEMMA3_IMAGE_TOKENS.items()}
        text_fields = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
        config = transformers.Gemma3Config(
            text_config=text_fields, vision_config=TINY_SIGLIP, mm_tokens_per_image=4, tie_word_embeddings=tie, **tokens
        )
    text = config.get_text_config()  # a multimodal config's text part, else the config itself
    for sub in {id(c): c for c in (config, text)}.values():
        sub.eos_token_id = tokenizer.eos_token_id
        sub.pad_token_id = tokenizer.pad_token_id
        sub.bos_token_id = None
    for sub in {id(c): c for c in (config, text, getattr(config, "vision_config", config))}.values():
        sub.initializer_range = init_std
    torch.manual_seed(seed)
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        for field, token in VISION_TOKENS.items():
            setattr(config, field, tokenizer.convert_tokens_to_ids(token))
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        # Images up to 28 x 28 x 64 pixels: at most 256 patches, 64 image tokens.
        Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(out_dir)
    elif family == "gemma3_vision":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
        size = TINY_SIGLIP["image_size"]
        Gemma3ImageProcessorPil(size={"height": size, "width": size}).save_pretrained(out_dir)
    elif num_labels:
        config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF zero-initialises biases and Gemma 3's image projection and ones norms; randomise them so tests see them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name or "mm_input_projection" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from unitrain.engines.vllm import CPU_HEAD_DIMS

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("out_dir")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="the HF model family")
    p.add_argument("--vocab-size", type=int, default=512, help="the BPE tokenizer's vocabulary")
    p.add_argument("--emb-dim", type=int, default=64, help="hidden size")
    p.add_argument("--mlp-dim", type=int, default=128, help="MLP intermediate size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument(
        "--head-dim",
        type=int,
        default=16,
        help=f"16 suits the tests; sampler=vllm on vLLM's CPU build needs one of {', '.join(map(str, CPU_HEAD_DIMS))}",
    )
    p.add_argument("--tie", action="store_true", help="tie lm_head to the token embedding")
    p.add_argument("--num-labels", type=int, default=0, help="> 0: a *ForSequenceClassification (reward model)")
    p.add_argument("--rope-scaling", default="none", choices=("none", "linear", "llama3"), help="RoPE scaling type")
    p.add_argument("--sliding-window", type=int, default=None, help="mistral and gemma3 (its sliding layers)")
    p.add_argument("--rope-theta", type=float, default=None, help="RoPE base (gemma3: of its global layers)")
    p.add_argument("--corpus", help="text file the tokenizer is trained on (one example per line)")
    p.add_argument(
        "--init-std",
        type=float,
        default=0.02,
        help="weight init std; ~0.25 makes attention sharp enough for parity tests to see RoPE/masks",
    )
    p.add_argument("--seed", type=int, default=0, help="of the weights")
    p.add_argument("--extra-tokens", help="tokens to add: a SID index .json (all its SID tokens) or one token a line")
    a = p.parse_args(argv)
    corpus = Path(a.corpus).read_text().splitlines() if a.corpus else None
    out = make_tiny_model(
        a.out_dir,
        a.family,
        vocab_size=a.vocab_size,
        emb_dim=a.emb_dim,
        mlp_dim=a.mlp_dim,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        tie=a.tie,
        rope_scaling=a.rope_scaling,
        sliding_window=a.sliding_window,
        corpus=corpus,
        init_std=a.init_std,
        seed=a.seed,
        rope_theta=a.rope_theta,
        extra_tokens=a.extra_tokens,
        num_labels=a.num_labels,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
