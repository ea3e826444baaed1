"""Export of a run's model as an HF checkpoint folder that transformers loads as is: the weights and
config.json (the model's save_hf), the run's tokenizer with its chat template, the tokenizer's
special ids in config.json, and generation_config.json, so that `AutoTokenizer.from_pretrained` and
`model.generate` need nothing else and stop where unitrain's sampler stops (at EOS). With
lora_export_adapters, the adapters alone in PEFT's format as well (<path>/lora_adapter).
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx


def export_hf(run, params, path: str) -> None:
    """Writes the model with `params` and the run's tokenizer to `path` (every process must call it:
    gathering is a collective; process 0 writes)."""
    model = nnx.merge(run.graphdef, params)
    model.save_hf(path)  # with LoRA: the merged model (base + scaled adapters)
    if run.cfg.lora_export_adapters:
        from unitrain.adapters import hf

        model.save_peft(os.path.join(path, "lora_adapter"), hf.tensor_names(model.base.cfg))
    if jax.process_index() != 0:
        return
    import transformers

    tokenizer = run.tokenizer
    tokenizer.save(path)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    # The model's config.json knows nothing of the tokenizer (a source checkpoint's ids may even
    # belong to another one): the run's tokenizer decides.
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, **ids}, f, indent=2, sort_keys=True)
    transformers.GenerationConfig(**ids).save_pretrained(path)
