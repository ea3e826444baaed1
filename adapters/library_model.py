"""What the adapters of other model libraries (Tunix's, MLLM_JAX's) share.

The KV cache: both libraries' calls write their tokens at one column shared by all rows (their
`end_index`), not at their positions. Beside the library's per-layer cache, Cache keeps each
column's segment and position per row and the attention mask is built over those, so a row's
tokens may sit at any columns (left- or right-padded prompts, the sampler's one-token steps) and
padding stays masked. The cache holds `max_length` columns: calls' widths add up, padding included.

LibraryModel: the model interface's methods that do not depend on the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from unitrain import sharding


@struct.dataclass
class Cache:
    """The library's per-layer cache ({"layer_i": ...}), with the segment (0 = empty) and position
    of every column per row."""

    layers: dict
    segment_ids: jax.Array  # [batch, max_length]
    positions: jax.Array  # [batch, max_length]


def empty(layer: dict, num_layers: int, batch_size: int, max_length: int) -> Cache:
    """An empty cache of `num_layers` copies of the library's empty `layer` cache."""
    columns = jnp.zeros((batch_size, max_length), jnp.int32)
    return Cache(layers={f"layer_{i}": layer for i in range(num_layers)}, segment_ids=columns, positions=columns)


def axes(kv: tuple, num_layers: int) -> Cache:
    """cache_axes of a Cache whose layers are {k, v: `kv` axes, end_index: [batch]}, as both libraries'."""
    layer = {"k": kv, "v": kv, "end_index": ("batch",)}
    return Cache(
        layers={f"layer_{i}": layer for i in range(num_layers)},
        segment_ids=("batch", "length"),
        positions=("batch", "length"),
    )


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


class LibraryModel(nnx.Module):
    """The interface methods (models/base.py) of a library's model held as NNX parameters."""

    def decode_weights(self):
        return None  # the libraries' layers are separate modules: no stacked weight to slice

    def for_decoding(self, weights):
        return self

    def param_axes(self) -> dict:
        return sharding.param_axes(nnx.state(self, nnx.Param))

    def decay_mask(self) -> dict:
        """Every matrix decays; the 1-D parameters (norm scales, biases) do not."""
        return jax.tree.map(lambda p: p.ndim > 1, nnx.to_pure_dict(nnx.state(self, nnx.Param)))
