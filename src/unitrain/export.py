"""Export of a run's model as an HF checkpoint folder that transformers loads as is: the weights and
config.json (the model's save_hf, its `architectures` named as transformers names them, so that an
inference engine builds the causal LM class), the run's tokenizer with its chat template, the
tokenizer's special ids in config.json, and generation_config.json (a vision-language model: its image processor), so that
`AutoTokenizer.from_pretrained` and `model.generate` need nothing else and stop where unitrain's
sampler stops (at EOS). With lora_export_adapters, the adapters alone in PEFT's format as well
(<path>/lora_adapter).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection

import jax
from flax import nnx

from unitrain.adapters import hf_config
from unitrain.config import VISION_LANGUAGE_FAMILIES, check, vision_language_folder

POLICY_VERSION_FILE = "unitrain_version.json"  # beside an export_policy folder's weights: {"version": v}


def export_hf(run, params, path: str) -> None:
    """Writes the model with `params` and the run's tokenizer to `path` (every process must call it:
    gathering is a collective; process 0 writes)."""
    model = nnx.merge(run.graphdef, params)
    model.save_hf(path)  # with LoRA: the merged model (base + scaled adapters)
    if run.cfg.lora_export_adapters:
        from unitrain.adapters import hf

        model.save_peft(os.path.join(path, "lora_adapter"), hf.tensor_names(model.base.cfg))
    if jax.process_index() == 0:
        describe(run, path)


def describe(run, path: str) -> None:
    """What export_hf writes beside the model's config.json and weights in `path` (process 0): the
    run's tokenizer, its special ids in config.json (and `architectures` where the source's config
    has none), generation_config.json."""
    import transformers

    tokenizer = run.tokenizer
    tokenizer.save(path)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    # The model's config.json knows nothing of the tokenizer (a source checkpoint's ids may even
    # belong to another one): the run's tokenizer decides.
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    if not config.get("architectures"):  # a source's config.json without it (Tunix, a plugin model)
        config["architectures"] = hf_config.causal_lm_architectures(config.get("model_type", ""))
    with open(config_file, "w") as f:
        json.dump({**config, **ids}, f, indent=2, sort_keys=True)
    transformers.GenerationConfig(**ids).save_pretrained(path)
    if run.cfg.model_family in VISION_LANGUAGE_FAMILIES:  # its image processor, as an HF folder of the family has
        folder = vision_language_folder(run.cfg.load_parameters_path)
        transformers.AutoImageProcessor.from_pretrained(folder, backend="pil").save_pretrained(path)


def export_policy(run, params, version: int, root: str) -> str:
    """The policy of `version` as an HF folder an inference engine (vLLM, SGLang) loads as it loads any
    model: export_hf of `params` into <root>/version_<version>, with POLICY_VERSION_FILE saying the
    version. An engine's Sampler calls this from update_weights (every process must: gathering is a
    collective; process 0 writes), and prune_versions once its servers have loaded it; returns the
    folder."""
    path = os.path.join(root, f"version_{version}")
    export_hf(run, params, path)
    if jax.process_index() == 0:
        with open(os.path.join(path, POLICY_VERSION_FILE), "w") as f:
            json.dump({"version": version}, f)
    return path


def export_adapters(run, params, version: int, root: str) -> str:
    """A LoRA policy's `version` as its adapters alone, in PEFT's format (what vLLM's runtime LoRA
    loads onto the base), in <root>/version_<version> with POLICY_VERSION_FILE; every process calls
    it (a collective), process 0 writes; returns the folder."""
    from unitrain.adapters import hf

    path = os.path.join(root, f"version_{version}")
    model = nnx.merge(run.graphdef, params)
    model.save_peft(path, hf.tensor_names(model.base.cfg))
    if jax.process_index() == 0:
        with open(os.path.join(path, POLICY_VERSION_FILE), "w") as f:
            json.dump({"version": version}, f)
    return path


def prune_versions(root: str, keep: Collection[str]) -> None:
    """Removes the version_* folders under `root` but those in `keep` (the newest, and any a server is
    still starting from), so that a long run keeps one copy on disk."""
    kept = {os.path.basename(p) for p in keep}
    for name in os.listdir(root):
        if name.startswith("version_") and name not in kept:
            shutil.rmtree(os.path.join(root, name))


@check("action", "export_hf_path")
def _export_path(c) -> str | None:
    return None if c["action"] != "export" or c["export_hf_path"] else "action=export needs export_hf_path"


@check("export_hf_path", "tokenizer_path")
def _exported_tokenizer(c) -> str | None:
    if not (c["export_hf_path"] and c["tokenizer_path"].endswith(".model")):
        return None
    return (
        f"export_hf_path writes the run's tokenizer beside the model, but tokenizer_path ({c['tokenizer_path']}) is a "
        "SentencePiece .model file, which transformers does not load as a tokenizer folder; use an HF tokenizer "
        'directory or export_hf_path=""'
    )


CONFIG_CHECKS = (_export_path, _exported_tokenizer)
