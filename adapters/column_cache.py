"""The KV cache of a model library whose calls write their tokens at one column shared by all rows
(Tunix's and MLLM_JAX's `end_index`), not at their positions: beside the library's per-layer cache
it keeps each column's segment and position per row, and the attention mask is built over those,
so a row's tokens may sit at any columns (left- or right-padded prompts, the sampler's one-token
steps) and padding stays masked. The cache holds `max_length` columns: calls' widths add up,
padding included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Cache:
    """The library's per-layer cache ({"layer_i": ...}), with the segment (0 = empty) and position
    of every column per row."""

    layers: dict
    segment_ids: jax.Array  # [batch, max_length]
    positions: jax.Array  # [batch, max_length]


def empty(layers: dict, batch_size: int, max_length: int) -> Cache:
    columns = jnp.zeros((batch_size, max_length), jnp.int32)
    return Cache(layers=layers, segment_ids=columns, positions=columns)


def axes(layers: dict) -> Cache:
    """cache_axes of a Cache over the library's per-layer axes."""
    return Cache(layers=layers, segment_ids=("batch", "length"), positions=("batch", "length"))


def attention_mask(q_segments, q_positions, k_segments, k_positions) -> jax.Array:
    """[B, Tq, Tk]: a query sees the keys of its own nonzero segment at positions up to its own."""
    same = (q_segments[:, :, None] == k_segments[:, None, :]) & (q_segments[:, :, None] > 0)
    return same & (k_positions[:, None, :] <= q_positions[:, :, None])


def written(cache: Cache, start, segment_ids, positions) -> tuple[Cache, jax.Array]:
    """The cache's columns with a call's tokens written from column `start` (where the library writes
    its keys and values; its `layers` as before), and the call's attention mask over them."""
    segments = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids.astype(jnp.int32), (0, start))
    slot_positions = jax.lax.dynamic_update_slice(cache.positions, positions.astype(jnp.int32), (0, start))
    mask = attention_mask(segment_ids, positions, segments, slot_positions)
    return cache.replace(segment_ids=segments, positions=slot_positions), mask
