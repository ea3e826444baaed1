"""Gemma 3's vision: its SigLIP tower and multimodal projector, and the vision-language model that puts
their features into our decoder (models/decoder.py, model_family gemma3: Gemma 3's text model whose
images' tokens attend to one another both ways, `Family.bidirectional_images`).

    features = model.encode_images(pixels)     # [images * mm_tokens_per_image, emb_dim]
    logits, _ = model(tokens, positions, segment_ids, image_features=features)

The tower (a ViT at one image size): the processor's pixel_values [N, C, S, S] cut into p x p
patches, embedded by one matmul (the Conv2d of kernel = stride = p) plus a learned embedding per
patch position; blocks of pre-LayerNorm bidirectional attention and a gelu-tanh MLP, all with
biases; a last LayerNorm. The projector averages each k x k patches into one of the
mm_tokens_per_image tokens of an image, RMS-norms them (Gemma's 1 + weight) and projects them to the
decoder's width. Each image's tokens replace a run of mm_tokens_per_image image pads.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain.models import decoder
from unitrain.models.attention import attention


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The tower's dimensions (transformers' SiglipVisionConfig fields under their HF names) and the
    projector's token count; the image-boundary tokens config.json names, kept for the export."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    boi_token_id: int = -1
    eoi_token_id: int = -1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """Patches along each side of the square one image token averages."""
        return self.patches_per_side // math.isqrt(self.mm_tokens_per_image)


class VisionBlocks(nnx.Module):
    """The tower's blocks, each parameter stacked on a leading `layers` axis."""

    def __init__(self, cfg: VisionConfig, text: decoder.ModelConfig, *, rngs: nnx.Rngs):
        L, E, M, H, D = (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.head_dim,
        )
        p = lambda init, shape, axes: decoder._param(rngs, init, (L, *shape), ("layers", *axes), text.weight_dtype)
        normal, zeros, ones = decoder._normal, decoder._zeros, decoder._ones
        self.attn_norm, self.attn_norm_bias = p(ones, (E,), ("norm",)), p(zeros, (E,), ("norm",))
        for name in ("q", "k", "v"):
            setattr(self, f"w{name}", p(normal, (E, H, D), ("embed", "heads", "kv")))
            setattr(self, f"b{name}", p(zeros, (H, D), ("heads", "kv")))
        self.wo = p(normal, (H, D, E), ("heads", "kv", "embed"))
        self.bo = p(zeros, (E,), ("norm",))
        self.mlp_norm, self.mlp_norm_bias = p(ones, (E,), ("norm",)), p(zeros, (E,), ("norm",))
        self.w_up, self.b_up = p(normal, (E, M), ("embed", "mlp")), p(zeros, (M,), ("mlp",))
        self.w_down, self.b_down = p(normal, (M, E), ("mlp", "embed")), p(zeros, (E,), ("norm",))


class VisionTower(nnx.Module):
    """Pixels [N, C, S, S] -> mm_tokens_per_image features [emb_dim] per image."""

    def __init__(self, cfg: VisionConfig, text: decoder.ModelConfig, *, rngs: nnx.Rngs):
        self.cfg, self.text = cfg, text
        E, C, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        param = lambda init, shape, axes: decoder._param(rngs, init, shape, axes, text.weight_dtype)
        self.patch_embed = param(decoder._normal, (C, p, p, E), (None, None, None, "embed"))
        self.patch_bias = param(decoder._zeros, (E,), ("norm",))
        self.position_embed = param(decoder._normal, (cfg.patches_per_side**2, E), (None, "embed"))
        self.blocks = VisionBlocks(cfg, text, rngs=rngs)
        self.post_norm = param(decoder._ones, (E,), ("norm",))
        self.post_norm_bias = param(decoder._zeros, (E,), ("norm",))
        self.soft_norm = param(decoder._zeros, (E,), ("norm",))  # Gemma's norm: 1 + weight
        self.projection = param(decoder._normal, (E, text.emb_dim), ("mlp", "embed"))

    def __call__(self, pixels):
        cfg, dt = self.cfg, self.text.dtype
        N, C, P, p = pixels.shape[0], cfg.num_channels, cfg.patches_per_side, cfg.patch_size
        patches = pixels.reshape(N, C, P, p, P, p).transpose(0, 2, 4, 1, 3, 5).reshape(N, P * P, C * p * p)
        x = patches.astype(dt) @ self.patch_embed[...].reshape(C * p * p, -1).astype(dt)
        x = x + self.patch_bias[...].astype(dt) + self.position_embed[...].astype(dt)
        params = {name: var[...] for name, var in nnx.state(self.blocks, nnx.Param).items()}
        norm = functools.partial(layer_norm, eps=cfg.layer_norm_eps)
        everything = jnp.ones((N, P * P, P * P), bool)

        def block(x, p):
            h = norm(x, p["attn_norm"], p["attn_norm_bias"])
            q, k, v = (
                jnp.einsum("npe,ehd->nphd", h, p[f"w{n}"].astype(dt)) + p[f"b{n}"].astype(dt) for n in ("q", "k", "v")
            )
            out = attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), everything)
            x = x + jnp.einsum("nphd,hde->npe", out, p["wo"].astype(dt)) + p["bo"].astype(dt)
            h = norm(x, p["mlp_norm"], p["mlp_norm_bias"])
            h = jax.nn.gelu(h @ p["w_up"].astype(dt) + p["b_up"].astype(dt), approximate=True)
            return x + h @ p["w_down"].astype(dt) + p["b_down"].astype(dt), None

        if self.text.remat_policy != "none":
            block = jax.checkpoint(block, policy=decoder.REMAT_POLICIES[self.text.remat_policy])
        x, _ = jax.lax.scan(block, x, params)
        x = norm(x, self.post_norm[...], self.post_norm_bias[...])
        t, k = P // cfg.pool, cfg.pool  # the k x k patches of each token, averaged
        x = x.reshape(N, t, k, t, k, -1).mean(axis=(2, 4)).reshape(N * t * t, -1)
        x = decoder.rms_norm(x, self.soft_norm[...], cfg.layer_norm_eps, offset=1.0)
        return x @ self.projection[...].astype(dt)


def layer_norm(x, weight, bias, eps):
    """LayerNorm computed in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class VisionLanguageModel(decoder.Decoder):
    """Our decoder (model_family gemma3, its ModelConfig with `image_token_id`) with Gemma 3's vision
    tower and projector beside it, under `vision`."""

    no_decay = (
        *decoder.Decoder.no_decay,
        *("attn_norm_bias", "mlp_norm_bias", "bo", "b_up", "b_down", "patch_bias", "post_norm", "post_norm_bias"),
        "soft_norm",
    )

    def __init__(self, cfg: decoder.ModelConfig, vision: VisionConfig, *, rngs: nnx.Rngs, hf_writer=None):
        super().__init__(cfg, rngs=rngs, hf_writer=hf_writer)
        self.vision = VisionTower(vision, cfg, rngs=rngs)

    def encode_images(self, pixels):
        """The features [images * mm_tokens_per_image, emb_dim] of the processor's pixel_values
        [images, C, S, S], an image's tokens one after the other."""
        return self.vision(pixels)


def create(cfg: decoder.ModelConfig, vision: VisionConfig, seed: int = 0, hf_writer=None) -> VisionLanguageModel:
    """A randomly initialised model (unsharded)."""
    return VisionLanguageModel(cfg, vision, rngs=nnx.Rngs(params=seed), hf_writer=hf_writer)
