"""SFT of a vision-language model (a tiny random Qwen2.5-VL HF folder) through the entry: the run takes
the checkpoint as its model, its loss is transformers' on the same rows, and freeze_vision_tower
leaves the tower as loaded while the decoder trains."""

import numpy as np
import pytest
import torch
import transformers

from helpers import metrics_by_step, run_config, write_jsonl
from unitrain import train
from unitrain.data.sft import make_sft_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import ConfigError

CONVO = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "four"}]
# Float32 on both sides; the sums run in another order: the mean NLL (~8) agrees to ~1e-5.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def vl_run(tmp_path, ckpt, *overrides):
    return run_config(
        tmp_path,
        "mode=sft",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={write_jsonl(tmp_path / 'chat.jsonl', [{'messages': CONVO}] * 8)}",
        "max_target_length=64",
        "per_device_batch_size=1",
        "eval_interval=0",
        "peak_flops_per_device=1e12",
        "log_period=1",
        "steps=2",
        "learning_rate=1e-2",
        "warmup_steps=0",
        "weight_decay=0.1",
        f"export_hf_path={tmp_path / 'export'}",
        *overrides,
    )


def torch_model(path):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def weights(path) -> dict:
    """The HF folder's tensors under transformers' names, whatever names the files use."""
    return {name: t.numpy() for name, t in torch_model(path).state_dict().items()}


def transformers_loss(ckpt, batch) -> float:
    """The mean NLL of the batch's trained targets under transformers' float32 model, each packed
    segment run on its own."""
    model = torch_model(ckpt)
    total, count = 0.0, 0
    for b in range(batch["inputs"].shape[0]):
        for segment in set(batch["inputs_segmentation"][b][batch["inputs_segmentation"][b] > 0]):
            columns = batch["inputs_segmentation"][b] == segment
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(batch["inputs"][b][columns][None], dtype=torch.long)).logits[0]
            logp = torch.log_softmax(logits, -1).numpy()
            targets, trained = batch["targets"][b][columns], batch["targets_segmentation"][b][columns] > 0
            total -= logp[np.arange(len(targets)), targets][trained].sum()
            count += trained.sum()
    return total / count


@pytest.mark.parametrize("frozen", [True, False])
def test_sft_on_a_qwen2_5_vl_checkpoint(tmp_path, tiny_checkpoint, frozen):
    """The first step's loss is transformers' on the first batch; after two steps (weight decay on)
    the decoder moved and the tower moved only when trained."""
    ckpt = tiny_checkpoint("qwen2_5_vl")
    cfg = vl_run(tmp_path, ckpt, f"freeze_vision_tower={str(frozen).lower()}")
    assert cfg.model_family == "qwen2_5_vl"
    assert train.train(cfg) == 0
    if frozen:
        batch = next(iter(make_sft_iterator(cfg, load_tokenizer(str(ckpt)), 8)))
        np.testing.assert_allclose(metrics_by_step(cfg.run_dir)[0]["loss"], transformers_loss(ckpt, batch), **LOSS_TOL)
    before, after = weights(ckpt), weights(tmp_path / "export")
    moved = {name for name in before if not np.array_equal(before[name], after[name])}
    tower = {name for name in before if name.startswith("model.visual.")}
    assert "model.language_model.layers.0.mlp.up_proj.weight" in moved
    assert (moved & tower == set()) if frozen else ("model.visual.blocks.0.mlp.up_proj.weight" in moved)


def test_vision_keys_need_a_vision_language_checkpoint(tmp_path, tiny_checkpoint):
    with pytest.raises(ConfigError, match="freeze_vision_tower is true but model_family llama has no vision tower"):
        run_config(tmp_path, "freeze_vision_tower=true")
    with pytest.raises(ConfigError, match="model_family qwen2_5_vl .* is read from an HF folder only"):
        run_config(tmp_path, "model_family=qwen2_5_vl")
    ckpt = tiny_checkpoint("qwen2_5_vl")
    with pytest.raises(ConfigError, match="mode=rm exports a sequence classifier, which transformers has none of"):
        run_config(tmp_path, "mode=rm", f"load_parameters_path={ckpt}", f"export_hf_path={tmp_path / 'out'}")
