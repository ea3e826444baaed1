"""Qwen2.5-VL: its vision tower and the vision-language model that puts the tower's features into our
decoder (models/decoder.py, whose multimodal rotary positions and image-pad embeddings are its own).

    layout = image_layout(grids, vision_cfg)                 # host: per image (t, h, w) patches
    features = model.encode_images(pixels, layout)          # [image tokens, emb_dim], once per prompt
    logits, _ = model(tokens, positions, segment_ids, image_features=features,
                      rope_positions=mrope_positions(tokens, segment_ids, grids, ...))

The tower (a ViT): the processor's patches [N, C * t * p * p] (transformers' image processor makes
them) embedded by one matmul (the Conv3d of kernel = stride = one patch), blocks of pre-norm
attention and SwiGLU with 2D rotary positions (a patch's row and column), most of them attending
within windows of `window_size` pixels and those at `fullatt_block_indexes` within the whole image,
then the merger: every 2 x 2 patches (consecutive in the processor's order) to one token of the
decoder's width. Attention runs on blocks: the tokens of each window (or image) gathered into a row
of their own, padded to the longest, so that no [N, N] mask is ever built; the index arrays come
from the image sizes on the host (`image_layout`), and the tokens stay in the processor's order
throughout (attention within a block does not depend on the order of its tokens).

Encoding the images is a call of its own (`encode_images`), apart from the decoder's forward: a
prompt's images are encoded once and their features serve every sample of its group.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain.models import decoder
from unitrain.models.attention import attention

# HF's RMSNorms of the vision tower have this epsilon whatever the config says.
VISION_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The tower's dimensions: transformers' Qwen2_5_VLVisionConfig fields under their HF names."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    fullatt_block_indexes: tuple[int, ...]
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    in_channels: int = 3
    rope_theta: float = 10000.0
    # The other special tokens config.json names, kept for the export (the tokenizer's facts).
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per decoder token."""
        return self.spatial_merge_size**2


class Blocks(NamedTuple):
    """Tokens gathered into rows that attend only within themselves: `index` [S, L] the token in each
    slot (N, one past the last token: an empty slot), `slots` [N] each token's slot in the flattened
    [S * L] rows."""

    index: np.ndarray
    slots: np.ndarray


class ImageLayout(NamedTuple):
    """What the tower needs of a set of images besides their pixels, made on the host from their
    patch grids (`image_layout`): each patch's (row, column) in its image [N, 2], the windows' blocks
    and the whole images' blocks (one per image and frame)."""

    positions: np.ndarray
    windows: Blocks
    images: Blocks


def image_tokens(grid, cfg: VisionConfig) -> int:
    """The decoder tokens (image pads) of an image of `grid` = (t, h, w) patches."""
    t, h, w = grid
    return t * h * w // cfg.merge_unit


def image_layout(grids, cfg: VisionConfig) -> ImageLayout:
    """The layout of images of patch grids `grids` [(t, h, w), ...], their patches in the processor's
    order: frame by frame, merge unit by merge unit (row-major), the unit's patches row-major."""
    positions, windows, images = _patch_keys(grids, cfg)
    return ImageLayout(positions, _blocks(windows), _blocks(images))


class RowLayout(NamedTuple):
    """The layout of rows of a training batch, each holding its images' patches then padding up to
    the same budget of P patches: each patch's (row, column) in its image [B * P, 2], and the
    window [B, P] and the image (and frame) [B, P] each patch attends within, numbered from 1 in
    each row; 0 = a padding patch, which attends to itself alone. Fixed shapes whatever the images:
    one compiled program; attention is over each row's P patches under the mask these numbers make."""

    positions: np.ndarray
    windows: np.ndarray
    images: np.ndarray


def row_layout(grids, cfg: VisionConfig, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row's (positions [P, 2], windows [P], images [P]) of RowLayout for images of patch grids
    `grids` (their patches first, in the processor's order) in a budget of P patches."""
    positions, windows, images = (np.zeros((budget, n), np.int32) for n in (2, 1, 1))
    if len(grids):
        own, window_keys, image_keys = _patch_keys(grids, cfg)
        n = len(own)
        positions[:n] = own
        windows[:n, 0] = np.unique(window_keys, axis=0, return_inverse=True)[1].reshape(-1) + 1
        images[:n, 0] = np.unique(image_keys, axis=0, return_inverse=True)[1].reshape(-1) + 1
    return positions, windows[:, 0], images[:, 0]


def image_rows(rows, cfg: VisionConfig, budget: int) -> dict:
    """The tower's fixed-shape inputs of batch rows each holding one prompt's images (`rows`: per
    row an object with `pixels` [n, patch_dim] and `grids`, or None): `pixels` [R, P, patch_dim]
    (zeros past a row's patches), `patch_positions` [R, P, 2], `patch_windows` and `patch_images`
    [R, P] (RowLayout's, a row each) for a budget of P patches; SFT's batch fields of the same names."""
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    pixels = np.zeros((len(rows), budget, dim), np.float32)
    for r, images in enumerate(rows):
        if images is not None:
            pixels[r, : len(images.pixels)] = images.pixels
    layouts = [row_layout(() if images is None else images.grids, cfg, budget) for images in rows]
    positions, windows, groups = (np.stack(part) for part in zip(*layouts))
    return {"pixels": pixels, "patch_positions": positions, "patch_windows": windows, "patch_images": groups}


def prompt_rope(tokens, segment_ids, rows, image_token_id: int, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """M-RoPE's positions [B, T, 3] of left- or right-padded prompts whose images are `rows` (as
    image_rows'), and each row's rope delta [B]: how far its positions run ahead of its token count,
    so that a token sampled at position p takes p + delta on all three axes (transformers'
    `rope_deltas` in generate)."""
    grids = [g for images in rows if images is not None for g in images.grids]
    rope = mrope_positions(tokens, segment_ids, grids, image_token_id, cfg)
    lengths = np.count_nonzero(np.asarray(segment_ids) > 0, axis=1)
    return rope, np.where(lengths > 0, rope.max(axis=(1, 2)) + 1 - lengths, 0).astype(np.int32)


def _patch_keys(grids, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each patch's (row, column) in its image [N, 2], and the keys of the window [N, 3] and of the
    image and frame [N, 2] it attends within."""
    m = cfg.spatial_merge_size
    per_window = cfg.window_size // m // cfg.patch_size  # merge units along a window's side
    positions, windows, images = [], [], []
    for i, (t, h, w) in enumerate(grids):
        frame, unit_row, unit_col, row_in, col_in = np.unravel_index(np.arange(t * h * w), (t, h // m, w // m, m, m))
        positions.append(np.stack([unit_row * m + row_in, unit_col * m + col_in], axis=-1))
        n_windows = -(-(w // m) // per_window)
        windows.append(
            np.stack([np.full_like(frame, i), frame, unit_row // per_window * n_windows + unit_col // per_window], -1)
        )
        images.append(np.stack([np.full_like(frame, i), frame], -1))
    return np.concatenate(positions).astype(np.int32), np.concatenate(windows), np.concatenate(images)


def _blocks(keys: np.ndarray) -> Blocks:
    """The blocks of tokens sharing a key (a row of `keys` [N, k]), each block in token order."""
    _, block = np.unique(keys, axis=0, return_inverse=True)
    block = block.reshape(-1)
    order = np.argsort(block, kind="stable")
    counts = np.bincount(block)
    rank = np.arange(len(block)) - np.repeat(np.cumsum(counts) - counts, counts)  # rank inside its block, in `order`
    width = counts.max()
    index = np.full((len(counts), width), len(block), np.int32)
    index[block[order], rank] = order
    slots = np.empty(len(block), np.int32)
    slots[order] = block[order] * width + rank
    return Blocks(index, slots)


def mrope_positions(tokens, segment_ids, grids, image_token_id: int, cfg: VisionConfig) -> np.ndarray:
    """Multimodal rotary positions [B, T, 3] (temporal, height, width) of rows of `tokens` whose
    images (runs of image pads) have patch grids `grids`, in row-major order. Each sequence (segment)
    counts from 0: a text token takes the next position on all three axes; an image's tokens take
    the next position plus their (frame, row, column) among the merged tokens, and the text after
    it continues from its start plus its larger side, as transformers' get_rope_index does."""
    tokens, segment_ids = np.asarray(tokens), np.asarray(segment_ids)
    out = np.zeros((*tokens.shape, 3), np.int32)
    images = iter(grids)
    for b in range(tokens.shape[0]):
        for segment in dict.fromkeys(segment_ids[b][segment_ids[b] > 0]):
            columns = np.flatnonzero(segment_ids[b] == segment)
            out[b, columns] = _sequence_positions(tokens[b, columns], images, image_token_id, cfg)
    if next(images, None) is not None:
        raise ValueError("more image grids than images among the tokens")
    return out


def _sequence_positions(ids: np.ndarray, images, image_token_id: int, cfg: VisionConfig) -> np.ndarray:
    m = cfg.spatial_merge_size
    out = np.zeros((len(ids), 3), np.int32)
    column, start = 0, 0
    while column < len(ids):
        if ids[column] != image_token_id:
            pads = np.flatnonzero(ids[column:] == image_token_id)
            end = column + (pads[0] if len(pads) else len(ids) - column)
            out[column:end] = start + np.arange(end - column)[:, None]
            start += end - column
            column = end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError("more images among the tokens than image grids")
        t, h, w = grid[0], grid[1] // m, grid[2] // m
        end = column + t * h * w
        if end > len(ids) or np.any(ids[column:end] != image_token_id):
            raise ValueError(f"an image of {t * h * w} tokens (grid {tuple(grid)}) has fewer image pads")
        out[column:end] = start + np.stack(np.unravel_index(np.arange(t * h * w), (t, h, w)), axis=-1)
        start += max(h, w)
        column = end
    return out


class VisionBlocks(nnx.Module):
    """The tower's blocks, each parameter stacked on a leading `layers` axis."""

    def __init__(self, cfg: VisionConfig, text: decoder.ModelConfig, *, rngs: nnx.Rngs):
        L, E, M, H, D = cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
        p = lambda init, shape, axes: decoder._param(rngs, init, (L, *shape), ("layers", *axes), text.weight_dtype)
        normal, zeros, ones = decoder._normal, decoder._zeros, decoder._ones
        self.attn_norm = p(ones, (E,), ("norm",))
        self.wq = p(normal, (E, H, D), ("embed", "heads", "kv"))
        self.wk = p(normal, (E, H, D), ("embed", "heads", "kv"))
        self.wv = p(normal, (E, H, D), ("embed", "heads", "kv"))
        self.bq = p(zeros, (H, D), ("heads", "kv"))
        self.bk = p(zeros, (H, D), ("heads", "kv"))
        self.bv = p(zeros, (H, D), ("heads", "kv"))
        self.wo = p(normal, (H, D, E), ("heads", "kv", "embed"))
        self.bo = p(zeros, (E,), ("norm",))
        self.mlp_norm = p(ones, (E,), ("norm",))
        self.w_gate = p(normal, (E, M), ("embed", "mlp"))
        self.b_gate = p(zeros, (M,), ("mlp",))
        self.w_up = p(normal, (E, M), ("embed", "mlp"))
        self.b_up = p(zeros, (M,), ("mlp",))
        self.w_down = p(normal, (M, E), ("mlp", "embed"))
        self.b_down = p(zeros, (E,), ("norm",))


class VisionTower(nnx.Module):
    """Pixels [N, C * t * p * p] -> one feature [out_hidden_size] per merged 2 x 2 patches."""

    def __init__(self, cfg: VisionConfig, text: decoder.ModelConfig, *, rngs: nnx.Rngs):
        self.cfg, self.text = cfg, text
        E, merged = cfg.hidden_size, cfg.hidden_size * cfg.merge_unit
        param = lambda init, shape, axes: decoder._param(rngs, init, shape, axes, text.weight_dtype)
        patch = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = param(decoder._normal, (*patch, E), (None, None, None, None, "embed"))
        self.blocks = VisionBlocks(cfg, text, rngs=rngs)
        self.merge_norm = param(decoder._ones, (E,), ("norm",))
        self.merge_w1 = param(decoder._normal, (merged, merged), ("embed", "mlp"))
        self.merge_b1 = param(decoder._zeros, (merged,), ("mlp",))
        self.merge_w2 = param(decoder._normal, (merged, cfg.out_hidden_size), ("mlp", "embed"))
        self.merge_b2 = param(decoder._zeros, (cfg.out_hidden_size,), ("norm",))

    def __call__(self, pixels, layout: ImageLayout | RowLayout):
        cfg, dt = self.cfg, self.text.dtype
        n = pixels.shape[0]
        x = pixels.astype(dt) @ self.patch_embed[...].reshape(-1, cfg.hidden_size).astype(dt)
        cos, sin = _vision_rope(cfg, layout.positions)
        full = np.isin(np.arange(cfg.depth), cfg.fullatt_block_indexes)
        params = {name: var[...] for name, var in nnx.state(self.blocks, nnx.Param).items()}

        def block(x, inputs):
            p, is_full = inputs
            h = decoder.rms_norm(x, p["attn_norm"], VISION_NORM_EPS)
            q, k, v = (
                jnp.einsum("ne,ehd->nhd", h, p[w].astype(dt)) + p[b].astype(dt)
                for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
            )
            q, k = (_rotate(a, cos, sin) for a in (q, k))
            attend = (
                functools.partial(_row_attention, chunk_size=self.text.attention_chunk_size)
                if isinstance(layout, RowLayout)
                else _block_attention
            )
            out = jax.lax.cond(is_full, lambda: attend(q, k, v, layout.images), lambda: attend(q, k, v, layout.windows))
            x = x + jnp.einsum("nhd,hde->ne", out, p["wo"].astype(dt)) + p["bo"].astype(dt)
            h = decoder.rms_norm(x, p["mlp_norm"], VISION_NORM_EPS)
            gate, up = (h @ p[f"w_{n}"].astype(dt) + p[f"b_{n}"].astype(dt) for n in ("gate", "up"))
            x = x + (jax.nn.silu(gate) * up) @ p["w_down"].astype(dt) + p["b_down"].astype(dt)
            return x, None

        if self.text.remat_policy != "none":
            block = jax.checkpoint(block, policy=decoder.REMAT_POLICIES[self.text.remat_policy])
        x, _ = jax.lax.scan(block, x, (params, jnp.asarray(full)))
        x = decoder.rms_norm(x, self.merge_norm[...], VISION_NORM_EPS).reshape(n // cfg.merge_unit, -1)
        x = jax.nn.gelu(x @ self.merge_w1[...].astype(dt) + self.merge_b1[...].astype(dt), approximate=False)
        return x @ self.merge_w2[...].astype(dt) + self.merge_b2[...].astype(dt)


def _vision_rope(cfg: VisionConfig, positions):
    """cos, sin [N, head_dim] float32 of the patches' (row, column): a quarter of the head's
    frequencies turn with the row, a quarter with the column, then the rotate-half copy."""
    quarter = cfg.head_dim // 2
    inv = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, quarter, 2, dtype=np.float32) / np.float32(quarter)))
    angles = (jnp.asarray(positions, jnp.float32)[:, :, None] * inv).reshape(positions.shape[0], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x, cos, sin):
    """RoPE of x [N, heads, D] in float32, as transformers rotates the tower's queries and keys."""
    return decoder.apply_rope(x.astype(jnp.float32)[None], cos[None], sin[None])[0].astype(x.dtype)


def _block_attention(q, k, v, blocks: Blocks):
    """Bidirectional attention of q, k, v [N, heads, D] within each block: the tokens gathered into
    the blocks' rows (an empty slot reads a zero row and is masked), attended, and put back."""
    gather = lambda a: jnp.concatenate([a, jnp.zeros_like(a[:1])])[blocks.index]  # [S, L, heads, D]
    valid = blocks.index < q.shape[0]
    mask = valid[:, :, None] & valid[:, None, :]
    out = attention(gather(q), gather(k).swapaxes(1, 2), gather(v).swapaxes(1, 2), mask)
    return out.reshape(-1, *q.shape[1:])[blocks.slots]


def _row_attention(q, k, v, groups, chunk_size=0):
    """Bidirectional attention of q, k, v [B * P, heads, D] within each row's groups [B, P] of
    patches (the same nonzero number; a padding patch, 0, to itself alone), `chunk_size` queries at a
    time (the decoder's attention_chunk_size: a row's scores are P x P)."""
    B, P = groups.shape
    rows = lambda a: a.reshape(B, P, *a.shape[1:])  # noqa: E731
    mask = ((groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] > 0)) | jnp.eye(P, dtype=bool)
    return attention(rows(q), rows(k).swapaxes(1, 2), rows(v).swapaxes(1, 2), mask, chunk_size).reshape(q.shape)


class VisionLanguageModel(decoder.Decoder):
    """Our decoder (its ModelConfig with `mrope_section` and `image_token_id`) with Qwen2.5-VL's
    vision tower beside it, under `vision`."""

    no_decay = (*decoder.Decoder.no_decay, "b_gate", "b_up", "b_down", "bo", "merge_norm", "merge_b1", "merge_b2")

    def __init__(self, cfg: decoder.ModelConfig, vision: VisionConfig, *, rngs: nnx.Rngs, hf_writer=None):
        super().__init__(cfg, rngs=rngs, hf_writer=hf_writer)
        self.vision = VisionTower(vision, cfg, rngs=rngs)

    def encode_images(self, pixels, layout: ImageLayout | RowLayout):
        """The features [image tokens, emb_dim] of the images whose patches are `pixels` (the
        processor's pixel_values, the images' patches one after the other; with a RowLayout each
        row's, padded to its budget: a padding patch's features are never read)."""
        return self.vision(pixels, layout)

    def encode_rows(self, rows: dict):
        """The features [R, P / 4, emb_dim] of rows' images laid out as `image_rows` lays them out
        (its fields in `rows`, or SFT's batch fields: the same), each row's in its own slots."""
        pixels = rows["pixels"]
        R, P = pixels.shape[:2]
        layout = RowLayout(rows["patch_positions"].reshape(R * P, 2), rows["patch_windows"], rows["patch_images"])
        return self.encode_images(pixels.reshape(R * P, -1), layout).reshape(R, -1, self.cfg.emb_dim)


def tower_mask(tree: dict) -> dict:
    """A bool per leaf of the pure dict `tree` (the model's parameters, or a mask like them): True
    under the vision tower (freeze_vision_tower's optimizer mask)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "vision" for k in path), tree
    )


def create(cfg: decoder.ModelConfig, vision: VisionConfig, seed: int = 0, hf_writer=None) -> VisionLanguageModel:
    """A randomly initialised model (unsharded)."""
    return VisionLanguageModel(cfg, vision, rngs=nnx.Rngs(params=seed), hf_writer=hf_writer)
