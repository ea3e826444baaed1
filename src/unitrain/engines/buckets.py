"""The bucketing rule: how many rows and columns the programs over rollouts are compiled for. The
sampler's prompt block and GRPO's train rows round their lengths and row counts up by it, so
that a run compiles a bounded number of times:

  - a prompt (or completion) length: up to a power of two, at least `MIN_PROMPT_BUCKET`;
  - a row count: up to a power of two, then (under a mesh) up to a multiple of the number of
    devices the logical `batch` axis is split over (`batch_parallelism`);
  - a count of packed rows (rl_packing): up to a power of two or one and a half times one (two
    shapes an octave: packing exists to save rows, which a doubling would give back), then up to
    a multiple of the devices and micro-batches.
"""

from __future__ import annotations

import numpy as np

from unitrain import sharding

MIN_PROMPT_BUCKET = 16


def bucket_prompt_length(n: int) -> int:
    """Smallest power of two >= n, at least MIN_PROMPT_BUCKET."""
    return max(MIN_PROMPT_BUCKET, _next_pow2(n))


def bucket_batch_size(n: int, multiple: int = 1) -> int:
    """Smallest power of two >= n, then rounded up to a multiple of `multiple` (data-parallel size)."""
    b = _next_pow2(n)
    return -(-b // multiple) * multiple


def row_buckets(rows: int, multiple: int = 1) -> list[int]:
    """Every row bucket of at most `rows` rows (a bucket itself), largest first: the shapes a decode
    of `rows` rows compacts its live rows into."""
    sizes = {bucket_batch_size(n, multiple) for n in range(1, rows + 1)}
    return sorted({rows} | {b for b in sizes if b <= rows}, reverse=True)


def bucket_packed_rows(n: int, multiple: int = 1) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^(k-1)) >= n, then rounded up to a
    multiple of `multiple`."""
    b = _next_pow2(n)
    if b >= 4 and 3 * b // 4 >= n:
        b = 3 * b // 4
    return -(-b // multiple) * multiple


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def batch_parallelism(mesh, rules) -> int:
    """How many devices the logical `batch` axis is split over under these rules."""
    axes = sharding.logical_to_spec(("batch",), rules)[0]
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in axes]))
