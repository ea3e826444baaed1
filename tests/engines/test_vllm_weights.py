"""vllm_weight_transfer memory without a server: what the trainer writes into shared memory
(engines/vllm_weights.py), read back as the server's worker extension reads it
(engines/vllm_worker.shared_tensors, torch), against the HF export of the same weights
(export.export_hf's safetensors, cast to the served dtype by torch)."""

import json
import os

import jax
import numpy as np
import safetensors.torch
import torch

from helpers import make_cfg
from unitrain import export
from unitrain.engines import vllm_weights, vllm_worker
from unitrain.run import build_run


def test_each_version_is_the_hf_exports_tensors_in_the_served_dtype_in_reused_buffers(tiny_checkpoint, tmp_path):
    """bfloat16 served from float32 weights; the tied embedding written once and named lm_head.weight
    too; the third version is written into the first one's buffer once the first is pruned; close()
    removes them all."""
    ckpt = tiny_checkpoint("qwen2", tie=True, emb_dim=64, heads=2, kv_heads=1, head_dim=32)
    keys = dict(mode="grpo", load_parameters_path=ckpt, tokenizer_path=ckpt, per_device_batch_size=1)
    run, state = build_run(make_cfg(base_output_directory=tmp_path, dtype="bfloat16", **keys))
    shared = vllm_weights.SharedWeights(run)
    rng = np.random.default_rng(0)
    manifests = []
    for version in range(3):
        params = jax.tree.map(lambda x: x + rng.standard_normal(x.shape).astype(x.dtype), state["params"])
        manifests.append(shared.write(params, version))
        shared.prune({manifests[-1]})
        loaded, pairs = vllm_worker.shared_tensors(manifests[-1], {})
        export.export_hf(run, params, str(tmp_path / f"v{version}"))
        expected = safetensors.torch.load_file(tmp_path / f"v{version}" / "model.safetensors")
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
        assert loaded == version and sorted(name for name, _ in pairs) == sorted(expected)
        for name, tensor in pairs:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name
        files = sorted(os.listdir(shared.root))
        assert files == [f"version_{version}.json", "weights_0.bin", "weights_1.bin"][: 2 + min(version, 1)]
    assert [json.load(open(m))["file"] if os.path.exists(m) else None for m in manifests] == [
        None,
        None,
        "weights_0.bin",
    ]
    shared.close()
    assert not os.path.exists(shared.root)
