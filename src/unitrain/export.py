"""Export of a run's model as an HF checkpoint folder that transformers loads as is."""

from __future__ import annotations

from flax import nnx


def export_hf(run, params, path: str) -> None:
    """Writes the model with `params` to `path` (every process must call it: gathering is a collective)."""
    nnx.merge(run.graphdef, params).save_hf(path)
