"""LoRA and QLoRA (lora_rank > 0): the adapters start as the identity (logits of the HF reference),
only they train, the merged export and the PEFT export give the LoRA model's logits in transformers
and peft, a resume equals an uninterrupted run, and GRPO / DPO take their reference from the one
copy of the base."""

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import REPO, make_cfg, write_jsonl
from unitrain import checkpoint, lora, modes, run, train
from unitrain.errors import CheckpointError, ConfigError

TOKENS = np.random.default_rng(0).integers(1, 200, (8, 12)).astype(np.int32)  # a row per device


def _logits(graphdef, params, mesh):
    positions = np.broadcast_to(np.arange(TOKENS.shape[1], dtype=np.int32), TOKENS.shape)
    with jax.set_mesh(mesh):
        logits, _ = nnx.merge(graphdef, params)(jnp.asarray(TOKENS), jnp.asarray(positions), jnp.ones_like(TOKENS))
    return np.asarray(logits)


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.float().numpy()


def _sft_cfg(tmp_path, ckpt=None, **keys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Q: {i}+1=", "completion": f" {i + 1}"} for i in range(8)])
    src = dict(load_parameters_path=ckpt, tokenizer_path=ckpt) if ckpt else {}
    keys = {
        **dict(
            eval_interval=0,
            checkpoint_period=1000,
            log_period=1,
            peak_flops_per_device=1e12,
            learning_rate=1e-2,
            warmup_steps=0,
            lora_rank=4,
        ),
        **src,
        **keys,
    }
    return make_cfg(
        base_output_directory=tmp_path, dataset_path=data, max_target_length=32, per_device_batch_size=1, **keys
    )


def _train_steps(r, state, n):
    task = modes.create(r)
    with jax.set_mesh(r.mesh):
        for s in range(n):
            state, _ = task.step(state, s)
    return state


@pytest.mark.parametrize("base_dtype", ["", "int8", "nf4"])
def test_zero_b_gives_the_base_logits_and_only_adapters_train(tmp_path, tiny_checkpoint, base_dtype):
    ckpt = tiny_checkpoint("llama")
    r, state = run.build_run(_sft_cfg(tmp_path, ckpt, lora_base_dtype=base_dtype))
    hf = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    ours = _logits(r.graphdef, state["params"], r.mesh)
    if base_dtype:  # a quantised base: near the HF logits, not at them; 256 levels nearer than 16
        error = np.abs(ours - hf).mean() / np.abs(hf).mean()
        assert {"int8": 1e-4 < error < 0.06, "nf4": 0.06 < error < 0.6}[base_dtype], error
    else:
        np.testing.assert_allclose(ours, hf, atol=2e-4, rtol=1e-4)
    # Only the adapters are in the optimizer; after steps the base is bit for bit the same.
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    assert size(state["opt_state"]) <= 2 * size(state["params"]["lora"]) + 8  # Adam's two moments and counts
    base = jax.tree.map(np.asarray, state["params"]["base"])
    state = _train_steps(r, state, 3)
    assert all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(state["params"]["base"]))
    )
    assert all(
        np.abs(np.asarray(b)).max() > 0
        for b in jax.tree.leaves(
            jax.tree_util.tree_map_with_path(lambda k, x: x if k[-1].key == "b" else None, state["params"]["lora"])
        )
    )
    assert not np.allclose(_logits(r.graphdef, state["params"], r.mesh), ours, atol=1e-5)


def test_merged_and_peft_exports_give_the_lora_logits(tmp_path, tiny_checkpoint):
    import peft

    ckpt = tiny_checkpoint("llama")
    export = tmp_path / "default" / "export"  # inside the run's directory, beside its config.yml
    cfg = _sft_cfg(
        tmp_path,
        ckpt,
        steps=4,
        export_hf_path=export,
        lora_export_adapters=True,
        lora_alpha=8.0,
        lora_target="layers/(wq|wo|w_down)|lm_head",
    )
    assert train.train(cfg) == 0
    r, state = run.build_run(cfg)
    _, state = checkpoint.Checkpointer(cfg.checkpoint_dir, 1, 3, False, adapters_only=True).restore(4, state, _NoData())
    ours = _logits(r.graphdef, state["params"], r.mesh)
    base = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    assert np.abs(ours - base).max() > 1e-3  # the adapters changed the model
    merged = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32))
    np.testing.assert_allclose(merged, ours, atol=2e-4, rtol=1e-4)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(hf_base, export / "lora_adapter")
    np.testing.assert_allclose(_hf_logits(with_adapters), ours, atol=2e-4, rtol=1e-4)
    # The run's checkpoint (its adapters alone) as a model's parameters: rebuilt from the run's
    # config.yml (its base, its lora_* keys) and merged, the export's model.
    # The export, an HF folder in that run's directory, is read as itself.
    for source in (cfg.run_dir, export):
        plain = _sft_cfg(tmp_path, ckpt, lora_rank=0, run_name="from_lora", load_parameters_path=source)
        r, state = run.build_run(plain)
        np.testing.assert_allclose(_logits(r.graphdef, state["params"], r.mesh), merged, atol=2e-4, rtol=1e-4)


class _NoData:
    def set_state(self, state):
        pass


def test_resume_with_lora_equals_an_uninterrupted_run(tmp_path):
    def run_to(where, steps):
        where.mkdir(exist_ok=True)
        cfg = _sft_cfg(
            where, steps=steps, checkpoint_period=2, lr_schedule="constant"
        )  # the same schedule for 2 and 4 steps
        assert train.train(cfg) == 0
        return cfg

    whole = run_to(tmp_path / "whole", 4)
    run_to(tmp_path / "split", 2)
    split = run_to(tmp_path / "split", 4)
    # The checkpoint holds the adapters, not the base.
    stored = checkpoint.ocp.StandardCheckpointer().metadata(f"{split.checkpoint_dir}/4/params").item_metadata
    assert set(stored) == {"layers"} and set(stored["layers"]["wq"]) == {"a", "b"}
    params = []
    for cfg in (whole, split):
        r, state = run.build_run(cfg)
        _, state = checkpoint.Checkpointer(cfg.checkpoint_dir, 1, 3, False, adapters_only=True).restore(
            4, state, _NoData()
        )
        params.append(jax.tree.map(np.asarray, state["params"]))
    jax.tree.map(np.testing.assert_array_equal, params[0], params[1])
    # As a plain model's parameters (a teacher_path, a load_parameters_path) it is one line naming the export.
    with pytest.raises(CheckpointError, match="holds a LoRA run's adapters alone.*export_hf_path"):
        checkpoint.load_params(f"{split.checkpoint_dir}/4", lora.without_adapters(state["params"]))
    last = [json.loads(open(c.metrics_file).read().splitlines()[-1]) for c in (whole, split)]
    assert last[0]["step"] == last[1]["step"] and last[0]["loss"] == last[1]["loss"]


WQ = (4, 64, 4, 16)  # the default (demo) model's stacked query projection: [layers, embed, heads, head_dim]
GRPO = dict(
    mode="grpo",
    per_device_batch_size=2,
    rollout_batch_size=4,
    n_samples_per_prompt=4,
    rollout_max_response_len=6,
    builtin_task_digits=1,
    max_prompt_length=16,
    kl_coef=0.1,
)
DPO = dict(mode="dpo", max_target_length=16, per_device_batch_size=1, dpo_beta=0.5)


@pytest.mark.parametrize("mode", ["grpo", "dpo"])
def test_reference_model_is_the_one_copy_of_the_base(tmp_path, mode):
    """A KL term (GRPO) or DPO keeps a second copy of the parameters without LoRA; with LoRA the
    reference is the base itself: one live array of a base weight's shape after a step."""
    keys = GRPO if mode == "grpo" else DPO
    counts = {}
    for rank in (0, 4):
        r, state = run.build_run(
            make_cfg(
                base_output_directory=tmp_path / str(rank),
                eval_interval=0,
                learning_rate=1e-2,
                warmup_steps=0,
                lora_rank=rank,
                **keys,
            )
        )
        state = _train_steps(r, state, 2)
        gc.collect()
        counts[rank] = sum(1 for x in jax.live_arrays() if x.shape == WQ and not x.is_deleted())
        del r, state
    assert counts[0] >= 2 and counts[4] == 1, counts  # the train state's and the reference's; then the one


@pytest.mark.parametrize(
    "keys, words",
    [
        (dict(lora_rank=-1), "lora_rank"),
        (dict(lora_rank=4, lora_target="layers/(wq"), "lora_target"),
        (dict(lora_rank=4, lora_base_dtype="int4"), "lora_base_dtype"),
        (dict(lora_base_dtype="int8"), "need lora_rank > 0"),
        (dict(lora_rank=4, lora_export_adapters=True), "lora_export_adapters"),
    ],
)
def test_bad_lora_keys_are_one_line(keys, words):
    with pytest.raises(ConfigError, match=words):
        make_cfg(**keys)


def test_a_target_that_matches_nothing_or_no_projection_is_refused(tmp_path):
    for target, words in (("layers/nothing", "matches no parameter"), ("layers/attn_norm", "not a projection")):
        with pytest.raises(ConfigError, match=words):
            run.build_run(make_cfg(base_output_directory=tmp_path, lora_rank=2, lora_target=target))


def test_bad_key_exits_2_from_the_command_line(capsys):
    assert train.main([str(REPO / "configs" / "base.yml"), "lora_rank=-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora_rank" in err[0]
