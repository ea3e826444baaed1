"""mode=rm: the Bradley-Terry loss against TRL's formula in NumPy, exact accumulation, the margin
field, and runs through the entry (held-out accuracy rises, exact resume, LoRA with its export)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import PAIR_E2E, REPO, copy_with_bos, make_cfg, metrics_by_step, write_jsonl
from unitrain import losses, train
from unitrain import step as step_lib
from unitrain.data.preference import make_preference_iterator
from unitrain.data.tokenizer import load_tokenizer
from unitrain.errors import CheckpointError, ConfigError, DataError
from unitrain.models.scalar_head import ScalarHeadModel
from unitrain.run import build_run
from unitrain.tasks.rm import RMTask

TOK = load_tokenizer("")


def numpy_trl_reward_loss(r_c, r_r, margin, center_coef):
    """TRL RewardTrainer.compute_loss written out: -logsigmoid(r_c - r_r - margin).mean() plus
    center_rewards_coefficient * mean((r_c + r_r)^2); its metrics accuracy (strict) and margin."""
    z = r_c - r_r - margin
    loss = np.mean(np.logaddexp(0.0, -z)) + center_coef * np.mean((r_c + r_r) ** 2)
    return loss, {
        "accuracy": np.mean(r_c > r_r),
        "margin": np.mean(r_c - r_r),
        "rewards/chosen": np.mean(r_c),
        "rewards/rejected": np.mean(r_r),
    }


def arithmetic_pairs(n, held_out=False, margin=False):
    """Single-digit sums: chosen the right answer, rejected a wrong one 10, 20 or 30 above it (what a
    tiny model learns to tell apart in a few steps); every fifth (a, b) is held out."""
    problems = [(j // 10, j % 10) for j in range(100) if (j % 5 == 0) == held_out]
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 10 * (1 + i % 3))}
        for i, (a, b) in enumerate(problems[:n])
    ]
    return [{**r, "gap": float(i % 3)} for i, r in enumerate(rows)] if margin else rows


# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize("margin,center", [(False, 0.0), (True, 0.01)])
def test_bt_loss_and_metrics_equal_trl_in_numpy(margin, center):
    rng = np.random.default_rng(0)
    r_c, r_r = rng.normal(0, 2, 12).astype(np.float32), rng.normal(0, 2, 12).astype(np.float32)
    r_r[3] = r_c[3]  # a tie counts as wrong
    m = rng.uniform(0, 1, 12).astype(np.float32) if margin else np.zeros(12, np.float32)
    total, (pairs, metrics) = losses.reward_model_loss(
        r_c, r_r, margin=m if margin else None, center_coef=center, weights=None
    )
    want_loss, want = numpy_trl_reward_loss(r_c.astype(np.float64), r_r.astype(np.float64), m, center)
    assert pairs == 12
    np.testing.assert_allclose(total / pairs, want_loss, rtol=1e-6)
    for name, value in want.items():
        s, c = metrics[name]
        np.testing.assert_allclose(s / c, value, rtol=1e-6, atol=1e-7, err_msg=name)
    # padding pairs (weight 0) count for nothing
    weights = np.r_[np.ones(12), np.zeros(4)].astype(np.float32)
    pad = lambda x: np.r_[x, np.full(4, 7.0, np.float32)]  # noqa: E731
    total_w, (pairs_w, metrics_w) = losses.reward_model_loss(
        pad(r_c), pad(r_r), margin=pad(m), center_coef=center, weights=weights
    )
    assert pairs_w == 12
    np.testing.assert_allclose(total_w, total, rtol=1e-6)
    np.testing.assert_allclose(metrics_w["margin"][0], metrics["margin"][0], rtol=1e-6)


def test_task_loss_is_trl_on_pooled_scores_and_accumulation_is_exact(tmp_path):
    """The task's loss on a real batch equals TRL's formula on the rewards read off the model's
    values at each sequence's last token (NumPy); one step over 16 pairs in one micro-batch equals
    two micro-batches of 8: loss, metrics and the updated parameters."""
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_pairs(32, margin=True))
    big = make_cfg(
        mode="rm",
        model_name="tiny",
        dataset_path=path,
        max_target_length=16,
        eval_interval=0,
        warmup_steps=0,
        learning_rate=1.0,
        adam_eps=1.0,  # the first update ~ learning_rate * gradient: parameters compare the gradients
        rm_margin_key="gap",
        rm_center_coef=0.05,
        per_device_batch_size=2,
        shuffle=False,  # the file's order: the margins are known
    )
    small = big.replace(per_device_batch_size=1, gradient_accumulation_steps=2)
    run, state = build_run(big)
    assert isinstance(run.model, ScalarHeadModel)
    task = RMTask(run)
    batch = next(make_preference_iterator(big, TOK, 16))
    batch.pop("num_truncated")
    np.testing.assert_array_equal(batch["margin"], [r["gap"] for r in arithmetic_pairs(32, margin=True)][:16])

    forward = jax.jit(lambda p, *rows: nnx.merge(run.graphdef, p)(*rows))
    rewards = {}
    for side in ("chosen", "rejected"):
        values = np.asarray(
            forward(
                state["params"], *(batch[f"{side}_{k}"] for k in ("inputs", "inputs_position", "inputs_segmentation"))
            )
        )
        last = batch[f"{side}_inputs_segmentation"].sum(-1) - 1  # right-padded rows: the last real column
        assert (batch[f"{side}_inputs"][np.arange(16), last] == TOK.eos_id).all()
        rewards[side] = values[np.arange(16), last, 0].astype(np.float64)
    want_loss, want = numpy_trl_reward_loss(rewards["chosen"], rewards["rejected"], batch["margin"], 0.05)

    results = []
    for cfg, s in ((big, jax.tree.map(jnp.copy, state)), (small, state)):
        settings = step_lib.StepConfig.from_config(cfg, run.learning_rate)
        with jax.set_mesh(run.mesh):
            new, m = jax.jit(lambda s, b: step_lib.train_step(task.loss, settings, run.optimizer, s, b))(s, batch)
        results.append((jax.device_get(new["params"]), jax.device_get(m)))
    (a, ma), (b, mb) = results
    assert ma["loss_denominator"] == mb["loss_denominator"] == 16
    np.testing.assert_allclose(ma["loss"], want_loss, rtol=1e-5)
    for name, value in want.items():
        np.testing.assert_allclose(ma[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for name in ("loss", "grad_norm", *want):
        np.testing.assert_allclose(ma[name], mb[name], rtol=1e-5, atol=1e-6, err_msg=name)
    start = jax.device_get(run.init_params)
    assert np.abs(a["score"] - start["score"]).max() > 1e-3  # the step moved the head
    for x, y, p in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(start)):
        np.testing.assert_allclose(x - p, y - p, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- config and data errors


@pytest.mark.parametrize("added", [False, True])
def test_pairs_start_with_a_bos_only_where_the_tokenizer_adds_one(tiny_checkpoint, tmp_path, added):
    """As TRL's RewardTrainer and the reward scorer: the prompt as transformers' tokenizer(text) encodes it."""
    path = copy_with_bos(tiny_checkpoint("qwen2"), tmp_path / "tok", added)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    pairs = arithmetic_pairs(4)
    cfg = make_cfg(mode="rm", dataset_path=write_jsonl(tmp_path / "p.jsonl", pairs), shuffle=False)
    batch = next(make_preference_iterator(cfg, load_tokenizer(path), 4))
    for side in ("chosen", "rejected"):
        for row, pair in zip(batch[f"{side}_inputs"], pairs):
            prompt = hf(pair["prompt"])["input_ids"]
            assert row[: len(prompt)].tolist() == prompt and (row[0] == hf.bos_token_id) == added


def test_bad_margins_and_misplaced_keys_are_one_line(tmp_path):
    rows = arithmetic_pairs(4, margin=True)
    rows[2]["gap"] = "big"
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=r"p.jsonl:3: field 'gap' \(rm_margin_key\) must be a finite number"):
        next(make_preference_iterator(make_cfg(mode="rm", dataset_path=path, rm_margin_key="gap"), TOK, 4))
    with pytest.raises(ConfigError, match="shape mode=rm's loss; mode is dpo"):
        make_cfg(mode="dpo", rm_center_coef=0.1)
    with pytest.raises(ConfigError, match="built-in task's pairs have no margin"):
        make_cfg(mode="rm", rm_margin_key="gap")
    with pytest.raises(ConfigError, match="rm_center_coef"):
        make_cfg(mode="rm", rm_center_coef=-1)


def test_a_causal_lm_as_reward_model_start_is_allowed_a_classifier_of_3_labels_is_not(tiny_checkpoint, tmp_path):
    lm = tiny_checkpoint("qwen3")
    run, _ = build_run(make_cfg(mode="rm", model_name="", load_parameters_path=str(lm), tokenizer_path=str(lm)))
    assert isinstance(run.model, ScalarHeadModel) and "lm_head" not in run.init_params["backbone"]
    three = tiny_checkpoint("llama", num_labels=3)
    with pytest.raises(ConfigError, match="num_labels=3"):
        build_run(make_cfg(mode="rm", model_name="", load_parameters_path=str(three), tokenizer_path=str(three)))


# ---------------------------------------------------------------- runs through the entry

E2E = [
    "mode=rm",
    "model_name=tiny",  # the 2-layer model these thresholds were set with
    *PAIR_E2E,
]


def entry_args(tmp_path, *overrides):
    return [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *E2E, *overrides]


def data_args(tmp_path):
    return (
        f"dataset_path={write_jsonl(tmp_path / 'train.jsonl', arithmetic_pairs(80))}",
        f"eval_dataset_path={write_jsonl(tmp_path / 'eval.jsonl', arithmetic_pairs(16, held_out=True))}",
    )


def test_rm_run_raises_held_out_accuracy_and_resumes_exactly(tmp_path, capsys):
    """Single-digit sums, chosen the right answer: held-out accuracy goes from chance to high; a run
    resumed from its step-10 checkpoint repeats steps 10..19 exactly."""
    args = entry_args(
        tmp_path, *data_args(tmp_path), "steps=20", "eval_interval=10", "checkpoint_period=10", "run_name=rm"
    )
    start = make_cfg(**dict(a.split("=", 1) for a in args[1:]))
    run, state = build_run(start)  # the run's start: the same seeded random model
    before = RMTask(run).evaluate(state["params"], 0)
    assert train.main(args) == 0
    straight = metrics_by_step(tmp_path / "rm")
    assert sorted(straight) == list(range(20))
    after = straight[19]
    assert after["eval_accuracy"] >= 0.9 and after["eval_accuracy"] > before["eval_accuracy"] + 0.15
    assert after["eval_loss"] < before["eval_loss"] - 0.2 and after["eval_margin"] > before["eval_margin"]
    assert after["tokens_per_sec"] > 0

    shutil.rmtree(tmp_path / "rm" / "checkpoints" / "20")
    capsys.readouterr()
    assert train.main([*args, "eval_interval=0"]) == 0
    assert f"resumed from {tmp_path / 'rm' / 'checkpoints'} at step 10" in capsys.readouterr().out
    resumed = metrics_by_step(tmp_path / "rm")
    for step in range(10, 20):
        for name in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert resumed[step][name] == pytest.approx(straight[step][name], rel=1e-5, abs=1e-6), (step, name)


def test_lora_rm_run_trains_adapters_and_head_and_exports_a_classifier(tiny_checkpoint, tmp_path):
    """LoRA over an HF causal LM's backbone, the score trained whole; the export is a classifier that
    transformers loads and scores as we do."""
    lm = tiny_checkpoint("llama")
    args = entry_args(
        tmp_path,
        *data_args(tmp_path),
        "model_name=",
        f"load_parameters_path={lm}",
        f"tokenizer_path={lm}",
        "max_target_length=24",
        "steps=3",
        "eval_interval=0",
        "lora_rank=4",
        f"export_hf_path={tmp_path / 'export'}",
        "run_name=lora",
    )
    assert train.main(args) == 0
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export", dtype=torch.float32)
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")("3+4=7<|im_end|>")["input_ids"]
    with torch.no_grad():
        theirs = ref.eval()(torch.tensor([ids])).logits.numpy()

    def scalar_model(path):
        cfg = make_cfg(mode="rm", model_name="", load_parameters_path=str(path), tokenizer_path=str(lm))
        return build_run(cfg)[0].model

    exported, start = scalar_model(tmp_path / "export"), scalar_model(lm)
    values = exported(jnp.asarray([ids]), jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), jnp.int32))
    np.testing.assert_allclose(np.asarray(values[:, -1]), theirs, atol=1e-4)
    # trained: the head (whole) and, through the merged adapters, the backbone's projections
    assert np.abs(np.asarray(exported.score[...]) - np.asarray(start.score[...])).max() > 1e-4
    wq = [np.asarray(m.backbone.layers.wq[...]) for m in (exported, start)]
    assert np.abs(wq[0] - wq[1]).max() > 1e-6
    assert np.array_equal(*(np.asarray(m.backbone.embed[...]) for m in (exported, start)))  # no adapter there


def test_unitrain_checkpoints_start_and_reload_reward_models(tmp_path):
    """An SFT run's checkpoint starts a reward model (its backbone, a fresh head); the reward model's
    own checkpoint reloads whole, and only it passes where a reward model is required."""
    from unitrain.models.scalar_head import build_scalar_model

    base = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", "steps=1", "eval_interval=0"]
    # E2E's model, trained on E2E's small batches (its checkpoint's shapes do not depend on them)
    sft = [
        "model_name=tiny",
        "mode=sft",
        "per_device_batch_size=1",
        "max_target_length=16",
        "peak_flops_per_device=1e12",
    ]
    assert train.main([*base, *sft, "run_name=sft"]) == 0
    assert (
        train.main(
            [
                *base,
                *E2E,
                *data_args(tmp_path),
                f"load_parameters_path={tmp_path / 'sft'}",
                "warmup_steps=0",
                "run_name=rm",
            ]
        )
        == 0
    )
    cfg = make_cfg(mode="rm", model_name="tiny")
    run, _ = build_run(cfg.replace(load_parameters_path=str(tmp_path / "sft")))
    sft_params = jax.device_get(build_run(make_cfg(load_parameters_path=str(tmp_path / "sft")))[0].init_params)
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(jax.device_get(run.init_params["backbone"][name]), sft_params[name])
    with pytest.raises(CheckpointError, match="has no 'score' parameter; it is not a reward model"):
        build_scalar_model(cfg, run.mesh, str(tmp_path / "sft"), require_classifier=True)
    reward_model = build_scalar_model(cfg, run.mesh, str(tmp_path / "rm"), require_classifier=True)
    trained = jax.device_get(nnx.to_pure_dict(nnx.state(reward_model)))
    assert not np.array_equal(trained["score"], jax.device_get(run.init_params["score"]))
    assert not np.array_equal(trained["backbone"]["embed"], sft_params["embed"])  # one rm step moved it
