"""What the sampler's compiled programs (generate in colocated.py, beam search in beam.py) share:
the left-padded prompt block they prefill and its place on the mesh, the model's KV cache under
the mesh's shardings (and a choice of its rows), the compaction of a decode's running rows into
smaller row buckets as rows end, each row's sampling noise by its index in the call, and the XLA
options of a program that decodes few rows a device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from unitrain import sharding
from unitrain.sharding import full_rows_to_global

FEW_ROWS = 32


def compiler_options(rows_per_device: int) -> dict | None:
    """XLA options of a sampler program whose decode steps run `rows_per_device` rows (None: XLA's
    defaults). On CPU with at most FEW_ROWS rows, the dots go to XLA's own emitter instead of
    YNNPACK's library fusions (reductions stay with YNNPACK): faster up to FEW_ROWS rows, slower
    above (measured by rows in docs/PERFORMANCE.md). Same tokens either way."""
    if sharding.target_platform() != "cpu" or rows_per_device > FEW_ROWS:
        return None
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}


@struct.dataclass
class PromptBlock:
    """The prompts a program prefills, left-padded so that each ends in the last column: the
    prefill rows [R, P], and per decoded row [B] its prompt's length (0: a padding row, which never
    emits) and, where a prompt's rows share its prefill, its row of the block."""

    tokens: np.ndarray  # [R, P] int32, pad_id before each prompt and in the padding rows
    positions: np.ndarray  # [R, P] int32, 0.. along each prompt
    segments: np.ndarray  # [R, P] int32, 1 on the prompt, 0 on padding
    prompt_lens: np.ndarray  # [B] int32
    source: np.ndarray | None = None  # [B] int32: each row's prefill row; None: the prefill rows are the B rows

    def on_mesh(self, mesh, rules, place=full_rows_to_global) -> PromptBlock:
        """The block as global arrays, its rows split over the logical `batch` axis (every process
        holds it whole); `place` sharding.abstract_rows gives abstract ones."""
        rows2d = sharding.batch_sharding(mesh, rules)
        rows = sharding.batch_sharding(mesh, rules, ("batch",))
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        return self.replace(**place(arrays, {k: rows2d if v.ndim == 2 else rows for k, v in arrays.items()}))


def left_padded(prompt_ids: list[list[int]], rows: int, columns: int, pad_id: int) -> PromptBlock:
    """The prompt block of these prompts, one row each; rows past the prompts are all padding."""
    block = PromptBlock(
        tokens=np.full((rows, columns), pad_id, np.int32),
        positions=np.zeros((rows, columns), np.int32),
        segments=np.zeros((rows, columns), np.int32),
        prompt_lens=np.zeros((rows,), np.int32),
    )
    for b, p in enumerate(prompt_ids):
        n = len(p)
        block.tokens[b, columns - n :] = p
        block.positions[b, columns - n :] = np.arange(n)
        block.segments[b, columns - n :] = 1
        block.prompt_lens[b] = n
    return block


def sharded_cache(model, batch: int, length: int, rules):
    """The model's empty KV cache, constrained to the shardings its logical axes get under `rules`
    (None: unconstrained). Call inside a jitted function."""
    return constrain_cache(model, model.init_cache(batch, length), rules)


def constrain_cache(model, cache, rules):
    """`cache` constrained to the shardings its logical axes get under `rules` (None: as it is)."""
    if rules is None:
        return cache
    specs = jax.tree.map(
        lambda axes: sharding.logical_to_spec(axes, rules), model.cache_axes(), is_leaf=lambda x: isinstance(x, tuple)
    )
    return jax.lax.with_sharding_constraint(cache, specs)


def cache_rows(model, cache, rows, rules):
    """The cache rows `rows` [B] (indices along the `batch` axis), constrained as `constrain_cache`."""
    take = lambda x, axes: jnp.take(x, rows, axis=axes.index("batch"))
    return constrain_cache(model, jax.tree.map(take, cache, model.cache_axes()), rules)


def compacted(model, state, step, *, buckets, group: int, running, stop: int, fields, outputs, rules):
    """The decode loop of `step` after the caller's loops over all its rows, which end once the rows
    still running fit `buckets[1]`: whenever they fit the next smaller bucket, they are gathered into
    it, in their order, and decode on there until token `stop` or their end, so that rows which ended
    stop costing. Rows only ever end, so the buckets follow one another in one straight line of
    loops, each compiled once (and none past `buckets[0]`, the caller's rows, when there is one).

    `state` is a struct of the loop's step index `i`, the KV cache `cache` and per-row arrays along
    axis 0: `fields` (they move with their row), among them `rows` (each row's index in the call)
    and `outputs`, which are written back to those indices of the caller's state as a bucket's rows
    are left behind. `group` rows move together (a prompt's beams); `running(state)` says, per group,
    whether it still runs.
    """
    out = state
    for j, rows in enumerate(buckets[1:], 1):
        order = jnp.argsort((~running(state)).astype(jnp.int32), stable=True)[: rows // group]  # running first
        order = (order[:, None] * group + jnp.arange(group)).reshape(-1)
        state = state.replace(
            cache=cache_rows(model, state.cache, order, rules), **{f: getattr(state, f)[order] for f in fields}
        )
        fewer = (*buckets, 0)[j + 1]
        more = lambda s, fewer=fewer: (s.i < stop) & (jnp.sum(running(s)) * group > fewer)
        state = jax.lax.while_loop(more, step, state)
        out = out.replace(**{f: getattr(out, f).at[state.rows].set(getattr(state, f)) for f in outputs})
    return out


def first_bucket_done(state, buckets, group: int, running):
    """Whether the rows still running fit the second of `buckets` (its compaction's first move):
    where the caller's loops over all its rows hand over to `compacted`. Without compaction, none run."""
    return jnp.sum(running(state)) * group <= (buckets[1] if len(buckets) > 1 else 0)


def gumbel_noise(key, rows, vocab: int):
    """[len(rows), vocab]: row r of jax.random.gumbel(key, (B, vocab)) for each r of `rows` (any B
    past them) of a threefry key, bit for bit. By row index, not place in the batch, so that a row
    draws the same noise however the decode compacts its rows. The hash is unrolled: XLA:CPU runs
    JAX's threefry as a loop over whole uint32 arrays, slower than this one fused pass."""
    k1, k2 = jax.random.key_data(key)
    # Element (r, v)'s counter is r * vocab + v, as in the [B, vocab] draw; < 2**32: the high word is 0.
    count = rows.astype(jnp.uint32)[:, None] * np.uint32(vocab) + jnp.arange(vocab, dtype=jnp.uint32)
    bits = _threefry2x32(k1, k2, jnp.zeros_like(count), count)
    unit = jax.lax.bitcast_convert_type((bits >> 9) | np.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
    tiny = jnp.finfo(jnp.float32).tiny
    return -jnp.log(-jnp.log(jnp.maximum(tiny, unit * (1.0 - tiny) + tiny)))


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1, k2, x0, x1):
    """Threefry-2x32, 20 rounds, of the counter words (x0, x1) under the key (k1, k2): the xor of
    the two output words, as jax.random's bits."""
    u = np.uint32
    ks = (k1, k2, k1 ^ k2 ^ u(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for n in range(5):
        for r in _ROTATIONS[n % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u(r)) | (x1 >> u(32 - r))) ^ x0
        x0, x1 = x0 + ks[(n + 1) % 3], x1 + ks[(n + 2) % 3] + u(n + 1)
    return x0 ^ x1


def argmax(x):
    """jnp.argmax over the last axis (the first maximum) as two plain reductions: XLA:CPU runs
    argmax's (value, index) reduction unvectorised, slower over a row of logits."""
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
