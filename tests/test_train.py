"""The SFT path end to end: loss, exact accumulation, resume, signals, sharding, NaN, CLI errors."""

import json
import os
import re
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import GSM8K, REPO, SFT_FAST, losses_of, run_cli, sigterm_after_step
from helpers import sft_config as config
from unitrain import checkpoint, compile_cache, modes, run, train
from unitrain import step as step_lib
from unitrain.adapters import hf
from unitrain.checks import load_checked
from unitrain.data.sft import make_sft_iterator


def saved_params(cfg, step, like):
    return checkpoint.load_params(os.path.join(cfg.checkpoint_dir, str(step)), like)


def setup(cfg):
    built, _ = run.build_run(cfg)
    return built.mesh, built.graphdef, built.init_params, built.tokenizer


def test_builtin_run_evaluates_logs_and_checkpoints(tmp_path, caplog):
    caplog.set_level("INFO", logger="unitrain")
    compile_cache.report("the tests before")  # the process's compiles so far
    cfg = config(tmp_path, "steps=4", "eval_interval=2", "eval_num_samples=8", "eval_steps=2", "checkpoint_period=2")
    assert train.train(cfg) == 0
    # the console: one line a phase that compiled; the run's log: each program with its memory too
    assert re.search(r"step 1: compiled 1 program \(train_step\) in [\d.]+ s", caplog.text)
    assert re.search(r"eval at step 2: compiled \d+ programs \(eval_step, .*\) in [\d.]+ s", caplog.text)
    assert "memory per device" not in caplog.text
    run_log = (tmp_path / "default" / train.RUN_LOG).read_text()
    assert re.search(r"compiled train_step in [\d.]+ s; memory per device: arguments [\d.]+ MiB", run_log)
    assert "step 1: compiled 1 program (train_step)" in run_log
    lines = [json.loads(l) for l in open(cfg.metrics_file)]
    evals = [l for l in lines if "eval_loss" in l]
    assert [l["step"] for l in evals] == [1, 3]
    assert all(0.0 <= l["eval_accuracy"] <= 1.0 and np.isfinite(l["eval_loss"]) for l in evals)
    assert sorted(p.name for p in (tmp_path / "default" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert list((tmp_path / "default" / "tensorboard").glob("events.out.tfevents.*"))
    assert load_checked([str(tmp_path / "default" / "config.yml")]) == cfg


def test_loss_equals_numpy_on_a_packed_batch(tmp_path):
    cfg = config(tmp_path, "z_loss_weight=0.01")
    built, state = run.build_run(cfg)
    graphdef, params = built.graphdef, state["params"]
    batch = next(make_sft_iterator(cfg, built.tokenizer, 8))
    batch.pop("num_truncated")
    assert (batch["inputs_segmentation"].max(axis=1) > 1).any(), "the batch must hold packed rows"
    loss_sum, (count, aux) = jax.jit(modes.create(built).loss)(params, batch)
    nll_sum = aux["nll"][0]
    logits, _ = nnx.merge(graphdef, params)(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits = np.asarray(logits, np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = log_z - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    w = batch["targets_segmentation"] > 0
    assert count == w.sum()
    np.testing.assert_allclose(nll_sum, nll[w].sum(), rtol=1e-5)
    np.testing.assert_allclose(loss_sum, (nll + 0.01 * log_z**2)[w].sum(), rtol=1e-5)


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    big = config(tmp_path, "per_device_batch_size=2", "gradient_accumulation_steps=1")
    small = config(tmp_path, "per_device_batch_size=1", "gradient_accumulation_steps=2")
    results = []
    for cfg in (big, small):
        built, state = run.build_run(cfg)
        batch = next(make_sft_iterator(big, built.tokenizer, 16))
        batch.pop("num_truncated")
        loss_fn = modes.create(built).loss
        with jax.set_mesh(built.mesh):
            settings = step_lib.StepConfig.from_config(cfg, built.learning_rate)
            state, m = jax.jit(lambda s, b: step_lib.train_step(loss_fn, settings, built.optimizer, s, b))(state, batch)
        results.append((state, m))
    (a, ma), (b, mb) = results
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5)


def test_sigterm_then_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    straight = config(tmp_path, "run_name=straight", "steps=10")
    assert train.train(straight) == 0
    interrupted = config(tmp_path, "run_name=interrupted", "steps=10")
    with sigterm_after_step(monkeypatch, 4):
        assert train.train(interrupted) == train.EXIT_SIGTERM
    stopped_at = checkpoint.Checkpointer(interrupted.checkpoint_dir, 1, 3, False).latest_step()
    assert 5 <= stopped_at < 10
    assert train.train(interrupted) == 0
    assert losses_of(interrupted) == pytest.approx(losses_of(straight), rel=1e-6)
    assert sorted(losses_of(interrupted)) == list(range(10))
    _, _, like, _ = setup(straight)
    for x, y in zip(
        jax.tree.leaves(saved_params(straight, 10, like)), jax.tree.leaves(saved_params(interrupted, 10, like))
    ):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_sigkill_during_saves_resumes_from_a_complete_checkpoint(tmp_path):
    args = [f"base_output_directory={tmp_path}", *SFT_FAST, "steps=100000", "checkpoint_period=1", "max_to_keep=2"]
    proc = run_cli(*args)
    ckpts = tmp_path / "default" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and len([p for p in ckpts.glob("*") if p.name.isdigit()]) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # saves run back to back: this lands in or next to one
    proc.wait()
    latest = checkpoint.Checkpointer(str(ckpts), 1, 2, False).latest_step()
    assert latest is not None
    resumed = run_cli(*args[:-3], f"steps={latest + 2}", "checkpoint_period=1", "max_to_keep=2")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert f"resumed from {ckpts} at step {latest}" in out


def test_nan_loss_stops_with_a_checkpoint_whose_weights_gave_a_finite_loss(tmp_path, capsys, caplog):
    # Step 0 runs at lr 0, so checkpoint 1 holds the initial weights and gives a finite loss; step 1's
    # update explodes them: checkpoint 2 is bad although the loss of step 1 (its weights: 1's) was fine.
    # max_to_keep=1 would delete checkpoint 1 when 2 is saved, were it not the known good one.
    args = [
        "steps=50",
        "learning_rate=1e30",
        "warmup_steps=2",
        "checkpoint_period=1",
        "max_to_keep=1",
        "max_grad_norm=0",
    ]
    cfg = config(tmp_path, *args)
    assert train.train(cfg) == train.EXIT_NAN
    assert "the newest checkpoint whose weights gave a finite loss is step 1" in caplog.text
    assert checkpoint.Checkpointer(cfg.checkpoint_dir, 1, 3, False).all_steps() == [1]
    assert os.path.isdir(cfg.checkpoint_dir + ".set_aside/2")  # the bad one, kept aside
    _, _, like, _ = setup(cfg)
    good = jax.tree.leaves(saved_params(cfg, 1, like))
    assert all(np.isfinite(x).all() and np.abs(x).max() < 10 for x in good)
    caplog.clear()
    caplog.set_level("INFO", logger="unitrain")
    assert train.train(config(tmp_path, *args)) == train.EXIT_NAN  # a rerun resumes from it (and diverges again)
    assert f"resumed from {cfg.checkpoint_dir} at step 1" in caplog.text


@pytest.mark.parametrize(
    "args, message",
    [
        (["lerning_rate=0.1"], "did you mean 'learning_rate'"),
        (["dataset_path=/nonexistent/train.jsonl"], "/nonexistent/train.jsonl"),
        (["learning_rate=-1"], "learning_rate"),
        (["ici_fsdp_parallelism=3"], "parallelism"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert train.main([str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *SFT_FAST, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_malformed_jsonl_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": oops}\n')
    assert (
        train.main(
            [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", *SFT_FAST, f"dataset_path={bad}"]
        )
        == 2
    )
    assert f"{bad}:2" in capsys.readouterr().err


def test_cli_exit_status_for_a_user_error(tmp_path):
    proc = run_cli(f"base_output_directory={tmp_path}", "steps=abc")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.strip().count("\n") == 0 and "steps" in err


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_sft_with_a_tiny_hf_model_then_export(tmp_path, tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2")
    cfg = config(
        tmp_path,
        "model_family=qwen2",
        "qkv_bias=true",
        "tie_word_embeddings=true",
        "steps=12",
        f"load_parameters_path={ckpt}",
        f"tokenizer_path={ckpt}",
        f"dataset_path={GSM8K}",
        "prompt_key=question",
        "completion_key=answer",
        "max_target_length=128",
        "learning_rate=3e-3",
        "rms_norm_eps=1e-6",
        f"export_hf_path={tmp_path / 'export'}",
    )
    assert train.train(cfg) == 0
    losses = losses_of(cfg)
    assert np.mean([losses[s] for s in (9, 10, 11)]) < np.mean([losses[s] for s in (0, 1, 2)]) - 0.5
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    tokens = np.arange(20)[None]
    with torch.no_grad():
        ref = exported(torch.tensor(tokens)).logits[0].numpy()
    ours, _ = hf.load(tmp_path / "export")(jnp.asarray(tokens), jnp.arange(20)[None], jnp.ones((1, 20), jnp.int32))
    np.testing.assert_allclose(np.asarray(ours[0]), ref, atol=1e-4)
