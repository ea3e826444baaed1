"""The vLLM worker extension of `vllm_weight_transfer: memory` (engines/vllm_weights.py writes what it
reads). It runs inside the vLLM server, in the engine's own venv: it imports torch and the standard
library only, never JAX or the rest of unitrain.

The server is started with `--worker-extension-cls unitrain.engines.vllm_worker.SharedMemoryWeights`
(vLLM adds the class to its workers' bases), and the trainer calls, through the server's
`/collective_rpc`,

    {"method": "load_shared_weights", "kwargs": {"manifest": "/dev/shm/.../version_3.json"}}

The manifest names one file of raw tensors (in shared memory) and each tensor's HF name, dtype, shape
and byte offset in it. Each worker maps the file (no copy: the tensors are views of the mapping; the
mapping is kept for the next versions written into the same file) and loads them in place through its model runner's in-place reload (vLLM's layerwise reload: the model's
load_weights, then each layer's processing into the kernels' layout, which a CPU build's packed GEMM
weights need). It answers the version the manifest says.
"""

from __future__ import annotations

import json
import math
import mmap
import os


def shared_tensors(manifest: str, buffers: dict) -> tuple[int, list]:
    """The version the manifest at `manifest` describes, and its (HF name, tensor) pairs: views of a
    mapping of its buffer file. `buffers` keeps the mappings (file -> mmap) from call to call: the
    trainer writes the next versions into the same files, and a mapping read before reads again
    without a page fault; one of a file since removed is dropped (its memory freed)."""
    import torch  # the engine's venv has it; unitrain's own requirements need not

    with open(manifest) as f:
        described = json.load(f)
    for path in [path for path in buffers if not os.path.exists(path)]:
        del buffers[path]
    path = os.path.join(os.path.dirname(manifest), described["file"])
    if path not in buffers:
        with open(path, "r+b") as f:
            buffers[path] = mmap.mmap(f.fileno(), 0)  # shared: it sees what the trainer writes
    pairs = []
    for entry in described["tensors"]:
        dtype, shape = getattr(torch, entry["dtype"]), entry["shape"]
        tensor = torch.frombuffer(buffers[path], dtype=dtype, count=math.prod(shape), offset=entry["offset"])
        pairs.append((entry["name"], tensor.view(shape)))
    return described["version"], pairs


class SharedMemoryWeights:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker."""

    def load_shared_weights(self, manifest: str) -> str:
        if not hasattr(self, "shared_buffers"):
            self.unitrain_buffers = {}
        version, pairs = shared_tensors(manifest, self.unitrain_buffers)
        self.reload_weights(weights_iterator=pairs)
        return str(version)
