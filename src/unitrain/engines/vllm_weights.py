"""`vllm_weight_transfer: memory`: each policy version of `sampler: vllm` written once into shared
memory, in the layout the server's model loads, for the server's worker extension
(engines/vllm_worker.py) to map and load in place: no safetensors file and no HF folder per version.

    weights = SharedWeights(run)                   # a folder of its own in /dev/shm (process 0)
    weights.write_model_folder(path)               # config.json (untied) the server starts from
    manifest = weights.write(params, version)      # every process (a collective); process 0 writes
    weights.prune(keep); weights.close()

A version is a manifest, version_<v>.json (the version, its buffer, and each tensor's HF name, dtype,
shape and page-aligned offset), and a buffer, weights_<k>.bin, its tensors in the dtype the server
serves (`dtype`). Buffers are reused: the one of the version before the last loaded is the spare the
next version is written into, kept mapped (a new file's first touch of each page costs more than the
copy), so that the shared memory holds two copies of the model at most. A tied embedding is written
once and named twice (lm_head.weight at the embedding's offset): the server's model is untied, as
vLLM's in-place reload leaves a tied lm_head at the weights it started with. The server starts from
the model folder with dummy weights (--load-format dummy) and loads the newest version before it
serves.

Several processes: each gathers its share of every parameter (a collective), process 0 writes, on
its own host: the servers that read it run there.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import tempfile
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import unitrain
from unitrain import export, lora
from unitrain.adapters import hf

EXTENSION = "unitrain.engines.vllm_worker.SharedMemoryWeights"  # --worker-extension-cls
LOAD_METHOD = "load_shared_weights"  # its method, called through /collective_rpc
SHARED_MEMORY = "/dev/shm"  # tmpfs: files there are memory pages


class SharedWeights:
    def __init__(self, run):
        self.run, self.leader = run, jax.process_index() == 0
        self.dtype = jnp.dtype(run.cfg.dtype)  # what the server serves (--dtype)
        shared = SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
        self.root = tempfile.mkdtemp(prefix=f"unitrain_vllm_{os.getpid()}_", dir=shared) if self.leader else ""
        # Removed by close(), else when the sampler is collected or the trainer exits (a trainer
        # killed outright: by the servers' supervisors, engines/server.py).
        self.close = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self.entries, self.aliases, self.size = [], [], 0  # every version's layout (_plan)
        self.buffers: dict[str, np.memmap] = {}  # the buffer files and their mappings, kept
        self.holds: dict[str, str] = {}  # a version's manifest -> the buffer it describes
        self.made = 0  # buffers made

    def write_model_folder(self, path: str) -> None:
        """config.json (tie_word_embeddings false), the tokenizer and generation_config.json: the
        folder the servers start from, written once (process 0)."""
        model = self.run.model
        config = hf.hf_config_of(model.base if isinstance(model, lora.LoraModel) else model)
        config.tie_word_embeddings = False
        config.save_pretrained(path)
        export.describe(self.run, path)

    def python_path(self) -> str:
        """A folder holding unitrain's package alone (a link), for the server's PYTHONPATH: the
        worker extension is imported from it, and nothing else of the trainer's environment is."""
        folder = os.path.join(self.root, "python")
        os.makedirs(folder, exist_ok=True)
        try:
            os.symlink(os.path.dirname(unitrain.__file__), os.path.join(folder, "unitrain"))
        except FileExistsError:  # another server's start made it: they start at once, from threads
            pass
        return folder

    def write(self, params, version: int) -> str:
        """`params` as version `version`; -> its manifest's path (every process calls it, process 0 writes)."""
        model = nnx.merge(self.run.graphdef, params)
        model = model.merged() if isinstance(model, lora.LoraModel) else model
        tensors = hf.hf_tensors(model)
        if not self.leader:
            for _ in tensors:  # this process's part of each gather
                pass
            return ""
        if not self.entries:
            self._plan(model)
        file = self._free_buffer()
        buffer = self.buffers[file]
        for entry, (_, tensor) in zip(self.entries, tensors, strict=True):
            start = entry["offset"]
            slot = buffer[start : start + tensor.size * self.dtype.itemsize].view(self.dtype).reshape(tensor.shape)
            np.copyto(slot, tensor, casting="same_kind")  # the one copy, cast to the served dtype
        manifest = os.path.join(self.root, f"version_{version}.json")
        with open(manifest, "w") as f:
            json.dump({"version": version, "file": file, "tensors": self.entries + self.aliases}, f)
        self.holds[manifest] = file
        return manifest

    def _plan(self, model) -> None:
        """Where each tensor goes in a buffer (the same for every version: the same model), and the
        tied lm_head's alias."""
        end = 0
        for name, shape in hf.hf_shapes(model):
            offset = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
            end = offset + math.prod(shape) * self.dtype.itemsize
            self.entries.append({"name": name, "dtype": self.dtype.name, "shape": list(shape), "offset": offset})
        self.size = end
        if model.cfg.tie_word_embeddings:
            embedding = next(e for e in self.entries if e["name"] == "model.embed_tokens.weight")
            self.aliases = [{**embedding, "name": "lm_head.weight"}]

    def _free_buffer(self) -> str:
        """A buffer that holds no version kept: the spare one (mapped, its pages there: written again
        at memory speed, where a new file's first touch of each page costs more than the copy), else
        a new one. Names are never reused: a server keeps its mapping of each."""
        spare = [file for file in self.buffers if file not in self.holds.values()]
        if spare:
            return spare[0]
        file = f"weights_{self.made}.bin"
        self.made += 1
        with open(os.path.join(self.root, file), "wb+") as f:
            f.truncate(self.size)
        self.buffers[file] = np.memmap(os.path.join(self.root, file), np.uint8, "r+", shape=(self.size,))
        return file

    def prune(self, keep: set[str]) -> None:
        """Removes the versions but those whose manifests are in `keep`; of the buffers they free, one
        stays as the spare the next version is written into, the others are removed."""
        for manifest in [m for m in self.holds if m not in keep]:
            os.remove(manifest)
            del self.holds[manifest]
        for file in [file for file in self.buffers if file not in self.holds.values()][1:]:
            del self.buffers[file]
            os.remove(os.path.join(self.root, file))
