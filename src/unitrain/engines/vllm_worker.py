"""The vLLM worker extension of `vllm_weight_transfer: memory` (engines/vllm_weights.py writes what it
reads). It runs inside the vLLM server, in the engine's own venv: it imports torch and the standard
library only, never JAX or the rest of unitrain.

The server is started with `--worker-extension-cls unitrain.engines.vllm_worker.SharedMemoryWeights`
(vLLM adds the class to its workers' bases), and the trainer calls, through the server's
`/collective_rpc`,

    {"method": "load_shared_weights", "kwargs": {"manifest": "/dev/shm/.../version_3.json"}}

The manifest names one file of raw tensors (in shared memory) and each tensor's HF name, dtype, shape
and byte offset in it. Each worker maps the file (no copy: the tensors are views of the mapping) and
loads them in place through its model runner's in-place reload (vLLM's layerwise reload: the model's
load_weights, then each layer's processing into the kernels' layout, which a CPU build's packed GEMM
weights need). It answers the version the manifest says.
"""

from __future__ import annotations

import json
import math
import mmap
import os

import torch


def shared_tensors(manifest: str) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """The version the manifest at `manifest` describes, and its (HF name, tensor) pairs: views of a
    mapping of its file."""
    with open(manifest) as f:
        described = json.load(f)
    with open(os.path.join(os.path.dirname(manifest), described["file"]), "rb") as f:
        # A private mapping: reads come from the shared pages, nothing is copied unless written.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    pairs = []
    for entry in described["tensors"]:
        dtype, shape = getattr(torch, entry["dtype"]), entry["shape"]
        tensor = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=entry["offset"])
        pairs.append((entry["name"], tensor.view(shape)))
    return described["version"], pairs


class SharedMemoryWeights:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker."""

    def load_shared_weights(self, manifest: str) -> str:
        version, pairs = shared_tensors(manifest)
        self.reload_weights(weights_iterator=pairs)
        return str(version)
