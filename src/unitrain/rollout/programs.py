"""What the sampler's compiled programs (generate in colocated.py, beam search in beam.py) share:
the left-padded prompt block they prefill and its place on the mesh, the model's KV cache under
the mesh's shardings, and the XLA options of a program that decodes few rows a device.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import struct

from unitrain import sharding
from unitrain.step import full_rows_to_global

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

    def on_mesh(self, mesh, rules) -> PromptBlock:
        """The block as global arrays, its rows split over the logical `batch` axis (every process
        holds it whole)."""
        rows2d = sharding.batch_sharding(mesh, rules)
        rows = sharding.batch_sharding(mesh, rules, ("batch",))
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        return self.replace(
            **full_rows_to_global(arrays, {k: rows2d if v.ndim == 2 else rows for k, v in arrays.items()})
        )


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
