"""Our decoder's KV cache: its structure (one key and one value array per layer, plus each column's
segment and position and the next free column), an empty one, its logical axes, and the writes a
call with a cache makes at the next columns. The model config it is shaped by (`cfg`) is the
decoder's ModelConfig.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Keys and values of every layer by column. A call writes its T tokens, padding included, at
    columns [end, end + T) of every row, so a decode step writes one column for the whole batch (a
    dynamic_update_slice, no scatter); each column's segment (0 = empty or padding) and position
    drive the mask. One sequence per row; the widths of a cache's calls add up to at most max_length.
    One array per layer, heads before length: a decode step updates each in place and reads it as
    its attention wants it, with no slice or transpose of the whole cache. Keys are kept transposed,
    length last, so that a decode step's scores, like its values' sum, reduce over a middle axis with
    the minor one contiguous (`attention.cached_attention`).
    """

    k: list  # per layer [batch, kv_heads, head_dim, max_length]
    v: list  # per layer [batch, kv_heads, max_length, head_dim]
    segment_ids: jax.Array  # [batch, max_length]
    positions: jax.Array  # [batch, max_length]
    end: jax.Array  # [batch] int32: the next column, the same in every row


def init_cache(cfg, batch_size: int, max_length: int) -> KVCache:
    k = jnp.zeros((batch_size, cfg.num_kv_heads, cfg.head_dim, max_length), cfg.dtype)
    v = jnp.zeros((batch_size, cfg.num_kv_heads, max_length, cfg.head_dim), cfg.dtype)
    columns = jnp.zeros((batch_size, max_length), jnp.int32)
    L = cfg.num_decoder_layers
    return KVCache(
        k=[k] * L, v=[v] * L, segment_ids=columns, positions=columns, end=jnp.zeros((batch_size,), jnp.int32)
    )


def cache_axes(cfg) -> KVCache:
    L = cfg.num_decoder_layers
    return KVCache(
        k=[("batch", "kv_heads", "kv", "length")] * L,
        v=[("batch", "kv_heads", "length", "kv")] * L,
        segment_ids=("batch", "length"),
        positions=("batch", "length"),
        end=("batch",),
    )


def _put(cache: KVCache, array, new, axis: int):
    """`array` with `new` written at the cache's next columns along `axis`."""
    return jax.lax.dynamic_update_slice_in_dim(array, new.astype(array.dtype), cache.end[0], axis)


def write_columns(cache: KVCache, segment_ids, positions) -> tuple:
    """The cache's segment ids and positions [B, max_length] with a call's [B, T] at its next
    columns: what the call's mask reads."""
    return _put(cache, cache.segment_ids, segment_ids, 1), _put(cache, cache.positions, positions, 1)


def write(cache: KVCache, layer: int, k, v) -> tuple:
    """Layer `layer`'s key and value arrays with a call's keys and values [B, K, T, D] at the
    cache's next columns (the keys transposed, as the cache keeps them)."""
    return _put(cache, cache.k[layer], k.swapaxes(2, 3), 3), _put(cache, cache.v[layer], v, 2)


def written(cache: KVCache, k: list, v: list, columns: tuple, width: int) -> KVCache:
    """The cache after a call of `width` columns: its layers' arrays (`write`) and columns
    (`write_columns`), and the next column moved past them."""
    return KVCache(k=k, v=v, segment_ids=columns[0], positions=columns[1], end=cache.end + width)
