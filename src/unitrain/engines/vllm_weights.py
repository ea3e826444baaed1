"""`vllm_weight_transfer: memory`: each policy version of `sampler: vllm` written once into shared
memory, in the layout the server's model loads, for the server's worker extension
(engines/vllm_worker.py) to map and load in place: no safetensors file and no HF folder per version.

    weights = SharedWeights(run)                   # a folder of its own in /dev/shm (process 0)
    weights.write_model_folder(path)               # config.json (untied) the server starts from
    manifest = weights.write(params, version)      # every process (a collective); process 0 writes
    weights.prune(keep); weights.close()

A version is two files: version_<v>.bin, its tensors at page-aligned offsets in the dtype the server
serves (`dtype`), and version_<v>.json, the manifest: the version, that file, and each tensor's HF
name, dtype, shape and offset. A tied embedding is written once and named twice (lm_head.weight at
the embedding's offset): the server's model is untied, as vLLM's in-place reload leaves a tied
lm_head at the weights it started with. The server starts from the model folder with dummy weights
(--load-format dummy) and loads the newest version before it serves.

Several processes: each gathers its share of every parameter (a collective), process 0 writes, on
its own host: the servers that read it run there.
"""

from __future__ import annotations

import dataclasses
import json
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
        # killed outright: by the servers' supervisors, engines/vllm_server.py).
        self.close = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)

    def write_model_folder(self, path: str) -> None:
        """config.json (tie_word_embeddings false), the tokenizer and generation_config.json: the
        folder the servers start from, written once (process 0)."""
        cfg = dataclasses.replace(decoder_config(self.run.model), tie_word_embeddings=False)
        hf.hf_config_from_model(cfg).save_pretrained(path)
        export.describe(self.run, path)

    def python_path(self) -> str:
        """A folder holding unitrain's package alone (a link), for the server's PYTHONPATH: the
        worker extension is imported from it, and nothing else of the trainer's environment is."""
        folder = os.path.join(self.root, "python")
        os.makedirs(folder, exist_ok=True)
        link = os.path.join(folder, "unitrain")
        if not os.path.islink(link):
            os.symlink(os.path.dirname(unitrain.__file__), link)
        return folder

    def write(self, params, version: int) -> str:
        """`params` as version `version`; -> its manifest's path (every process calls it, process 0 writes)."""
        model = nnx.merge(self.run.graphdef, params)
        tensors = hf.hf_tensors(model.merged() if isinstance(model, lora.LoraModel) else model)
        if not self.leader:
            for _ in tensors:  # this process's part of each gather
                pass
            return ""
        name = f"version_{version}"
        entries, end = [], 0
        with open(os.path.join(self.root, name + ".bin"), "wb+") as f:
            for hf_name, tensor in tensors:
                offset = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
                end = offset + tensor.size * self.dtype.itemsize
                f.truncate(end)
                slot = np.memmap(f, self.dtype, "r+", offset, tensor.shape)
                np.copyto(slot, tensor, casting="same_kind")  # the one copy, cast to the served dtype
                del slot
                entries.append(
                    {"name": hf_name, "dtype": self.dtype.name, "shape": list(tensor.shape), "offset": offset}
                )
        if decoder_config(self.run.model).tie_word_embeddings:
            embedding = next(e for e in entries if e["name"] == "model.embed_tokens.weight")
            entries.append({**embedding, "name": "lm_head.weight"})
        manifest = os.path.join(self.root, name + ".json")
        with open(manifest, "w") as f:
            json.dump({"version": version, "file": name + ".bin", "tensors": entries}, f)
        return manifest

    def prune(self, keep: set[str]) -> None:
        """Removes the versions but those whose manifests are in `keep`."""
        kept = {os.path.basename(p).removesuffix(".json") for p in keep}
        for file in os.listdir(self.root):
            if file.startswith("version_") and file.rsplit(".", 1)[0] not in kept:
                os.remove(os.path.join(self.root, file))


def decoder_config(model):
    """The ModelConfig of unitrain's decoder `model` (a LoRA model's base)."""
    return (model.base if isinstance(model, lora.LoraModel) else model).cfg
