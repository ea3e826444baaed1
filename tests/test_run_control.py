"""Run control and round trips: the architecture from the checkpoint, the tokenizer and first-batch
guards, --help, eval-only and export-only runs, resume from a chosen step, the config history."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx

from helpers import REPO, RL_FAST, SFT_FAST, make_cfg
from unitrain import checkpoint, modes, run, run_dir, sharding, train
from unitrain.checks import load_checked
from unitrain.config import MODEL_KEYS
from unitrain.errors import ConfigError
from unitrain.models import sources

BASE = str(REPO / "configs" / "base.yml")


def argv(tmp_path, *overrides):
    return [BASE, f"base_output_directory={tmp_path}", *SFT_FAST, *overrides]


def lines_of(path):
    return [json.loads(line) for line in open(path)]


def logits_of(model, tokens):
    t = jnp.asarray(tokens)
    out, _ = model(t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), jnp.ones_like(t))
    return np.asarray(out)


# ---------------------------------------------------------------- silent wrong results


def test_a_folder_without_tokenizer_files_stops_the_run(tmp_path, tiny_checkpoint, capsys):
    bare = tmp_path / "export"
    bare.mkdir()
    shutil.copy(tiny_checkpoint("qwen2") / "config.json", bare)  # what a weights-only export folder holds
    capsys.readouterr()
    assert train.main(argv(tmp_path, f"tokenizer_path={bare}", "steps=2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tokenizer_path" in err and "no tokens" in err
    assert not (tmp_path / "default" / "config.yml").exists()  # a failed command writes no config.yml


def test_a_first_batch_without_loss_tokens_stops_the_run(tmp_path):
    cfg = load_checked(argv(tmp_path, "steps=1"))
    r, state = run.build_run(cfg)
    task = modes.create(r)
    batch = next(task.data_iterator)
    batch["targets_segmentation"] = np.zeros_like(batch["targets_segmentation"])
    task.data_iterator = iter([batch])
    with pytest.raises(ConfigError, match="no completion tokens"):
        task.step(state, 0)


def test_the_architecture_of_an_hf_checkpoint_is_the_runs(tmp_path, tiny_checkpoint):
    """config.json's rope_theta, rms_norm_eps, rope scaling, vocab... become the config's, so the run's
    own orbax checkpoint, reloaded from its config.yml, is the same model as the HF checkpoint."""
    ckpt = tiny_checkpoint("llama", rope_scaling="llama3", rope_theta=5e5, vocab_size=384)
    hf_cfg = transformers.AutoConfig.from_pretrained(ckpt)
    cfg = make_cfg(load_parameters_path=str(ckpt))
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.vocab_size, cfg.rope_scaling_type) == (
        hf_cfg.rope_parameters["rope_theta"],
        hf_cfg.rms_norm_eps,
        384,
        "llama3",
    )
    assert cfg.rope_scaling_factor == hf_cfg.rope_parameters["factor"]

    # learning_rate 0: the saved parameters are the checkpoint's, so logits must equal transformers'.
    assert (
        train.main(
            argv(
                tmp_path,
                f"load_parameters_path={ckpt}",
                f"tokenizer_path={ckpt}",
                "steps=1",
                "learning_rate=0",
                "dataset_path=builtin",
            )
        )
        == 0
    )
    run_cfg = tmp_path / "default" / "config.yml"
    assert yaml.safe_load(run_cfg.read_text())["rope_theta"] == 5e5
    reloaded = load_checked([str(run_cfg), f"load_parameters_path={tmp_path / 'default' / 'checkpoints'}"])
    tokens = np.arange(1, 25)[None] % 384
    ours = logits_of(sources.build(reloaded, sharding.trainer_mesh(reloaded, sharding.layout_for(reloaded))), tokens)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)(torch.tensor(tokens)).logits
    np.testing.assert_allclose(ours, ref.numpy(), atol=2e-4)


def test_an_explicit_key_that_contradicts_the_checkpoint_is_one_line(tmp_path, tiny_checkpoint, capsys):
    ckpt = tiny_checkpoint("qwen2")
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"rope_theta.*config\.json"):
        make_cfg(load_parameters_path=str(ckpt), rope_theta=1234.0)
    assert train.main(argv(tmp_path, f"load_parameters_path={ckpt}", "model_name=qwen2.5-0.5b")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config.json" in err and "add `model_name=` (empty)" in err
    # the same value, stated explicitly, is fine
    assert make_cfg(load_parameters_path=str(ckpt), qkv_bias=True).qkv_bias


def test_a_unitrain_checkpoint_brings_its_model_shape(tmp_path):
    assert (
        train.main(
            argv(
                tmp_path,
                "run_name=a",
                "steps=1",
                "emb_dim=32",
                "mlp_dim=48",
                "num_query_heads=2",
                "num_kv_heads=1",
                "vocab_size=128",
            )
        )
        == 0
    )
    for path in (tmp_path / "a", tmp_path / "a" / "checkpoints", tmp_path / "a" / "checkpoints" / "1"):
        cfg = make_cfg(load_parameters_path=str(path))
        assert (cfg.emb_dim, cfg.mlp_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.head_dim) == (
            32,
            48,
            2,
            1,
            128,
            16,
        )
    with pytest.raises(ConfigError, match=r"emb_dim.*a/config\.yml"):
        make_cfg(load_parameters_path=str(tmp_path / "a" / "checkpoints"), emb_dim=64)
    # and the model built from it holds the checkpoint's parameters
    cfg = make_cfg(load_parameters_path=str(tmp_path / "a"))  # the run directory itself
    model = sources.build(cfg, sharding.trainer_mesh(cfg, sharding.layout_for(cfg)))
    saved = checkpoint.load_params(str(tmp_path / "a" / "checkpoints"), nnx.to_pure_dict(nnx.state(model)))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)), saved)


def test_a_model_source_that_reads_config_json_itself_refuses_architecture_keys(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2_5_vl")  # a model type hf_config reads no text model's keys of
    with pytest.raises(ConfigError, match="emb_dim.*model_source tunix"):
        make_cfg(model_source="tunix", load_parameters_path=str(ckpt), emb_dim=64)


# ---------------------------------------------------------------- run control


def test_help_lists_every_key_of_base_yml_with_its_default(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    for key, value in yaml.safe_load(open(BASE)).items():
        line = next((line for line in out.splitlines() if line.strip().startswith(f"{key}:")), None)
        assert line is not None, key
        if not isinstance(value, list):
            assert yaml.safe_load(line.strip().split("  ")[0]) == {key: value}, line
    assert train.main(["--help", "rope"]) == 0
    some = capsys.readouterr().out
    assert "rope_theta: 10000.0" in some and "RoPE base frequency" in some and "learning_rate" not in some


def test_help_into_a_pipe_closed_early_is_no_error():
    """`unitrain --help | head`: the reader leaves before the text is written; no BrokenPipeError."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unitrain.train", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # gone before the first line: the child is still importing
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and err == ""


def test_rerunning_a_finished_run_says_so_and_how_to_go_on(tmp_path, capsys):
    evals = ("eval_interval=2", "eval_num_samples=2", "eval_n_samples=0")
    assert train.main(argv(tmp_path, "steps=2", *evals)) == 0
    run_path = tmp_path / "default"
    record = {name: (run_path / name).read_text() for name in ("metrics.jsonl", "config.yml", "samples.txt")}
    assert record["samples.txt"].startswith("==== step 2: samples\n**prompt** ")  # the eval's answers after step 2
    capsys.readouterr()
    assert train.main(argv(tmp_path, "steps=2", *evals)) == 0
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.endswith(
        f"unitrain: {run_path} is finished: its checkpoint is at step 2 and steps=2, so there is nothing to "
        "train; raise steps (e.g. steps=4) to train on from it, or give another run_name to start afresh"
    )
    assert {name: (run_path / name).read_text() for name in record} == record
    assert train.main(argv(tmp_path, "steps=3", *evals)) == 0  # the way on it names
    assert [line["step"] for line in lines_of(run_path / "metrics.jsonl") if "loss" in line] == [0, 1, 2]
    assert (run_path / "samples.txt").read_text().startswith(record["samples.txt"] + "==== step 3: samples\n")


def test_a_command_that_fails_before_its_run_starts_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "out"
    failing = [BASE, f"base_output_directory={out}", *SFT_FAST, f"dataset_path={tmp_path / 'absent.jsonl'}"]
    assert train.main(failing) == 2
    assert "absent.jsonl" in capsys.readouterr().err and not out.exists()
    (out / "other").mkdir(parents=True)  # what was there before stays
    assert train.main(failing) == 2
    assert os.listdir(out) == ["other"]


def test_eval_only_and_export_only_runs_from_a_checkpoint(tmp_path):
    assert train.main(argv(tmp_path, "steps=2", "eval_interval=2", "eval_num_samples=4")) == 0
    run_path = tmp_path / "default"
    trained = lines_of(run_path / "metrics.jsonl")
    config_text = (run_path / "config.yml").read_text()

    assert train.main(argv(tmp_path, "steps=2", "action=eval", "eval_num_samples=4")) == 0
    (evaluated,) = lines_of(run_path / "evals.jsonl")
    in_training = next(line for line in trained if "eval_loss" in line)
    assert evaluated["step"] == 2 and evaluated["eval_loss"] == pytest.approx(in_training["eval_loss"], rel=1e-6)
    assert evaluated["eval_accuracy"] == in_training["eval_accuracy"]
    assert lines_of(run_path / "metrics.jsonl") == trained and (run_path / "config.yml").read_text() == config_text

    export = tmp_path / "export"
    assert train.main(argv(tmp_path, "steps=2", "action=export", f"export_hf_path={export}")) == 0
    cfg = make_cfg(load_parameters_path=str(export))
    exported = nnx.to_pure_dict(nnx.state(sources.build(cfg, sharding.trainer_mesh(cfg, sharding.layout_for(cfg)))))
    saved = checkpoint.load_params(str(run_path / "checkpoints"), exported)
    jax.tree.map(np.testing.assert_array_equal, exported, saved)


def test_eval_only_without_parameters_is_one_line(tmp_path, capsys):
    assert train.main(argv(tmp_path, "action=eval")) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_from_a_chosen_step(tmp_path):
    common = ("steps=4", "checkpoint_period=1", "max_to_keep=5", "async_checkpointing=false")
    assert train.main(argv(tmp_path, "run_name=whole", *common)) == 0
    assert train.main(argv(tmp_path, "run_name=again", *common)) == 0
    assert train.main(argv(tmp_path, "run_name=again", *common, "resume_step=2")) == 0
    whole, again = lines_of(tmp_path / "whole" / "metrics.jsonl"), lines_of(tmp_path / "again" / "metrics.jsonl")
    assert [line["step"] for line in again] == [0, 1, 2, 3]
    assert [line["loss"] for line in again] == [line["loss"] for line in whole]
    assert sorted(os.listdir(tmp_path / "again" / "checkpoints.set_aside")) == ["3", "4"]


def test_a_resume_step_that_was_not_saved_is_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    common = ("steps=2", "checkpoint_period=1", "async_checkpointing=false")
    assert train.main(argv(tmp_path, *common)) == 0
    monkeypatch.setattr(train, "build_run", lambda cfg: pytest.fail("the run was built"))
    assert train.main(argv(tmp_path, *common, "steps=4", "resume_step=3")) == 2
    assert "resume_step=3 is not a saved step" in capsys.readouterr().err


def test_a_resumed_run_reports_changed_keys_and_keeps_the_earlier_config(tmp_path, caplog):
    assert train.main(argv(tmp_path, "steps=1")) == 0
    first = (tmp_path / "default" / "config.yml").read_text()
    assert train.main(argv(tmp_path, "steps=2", "tokenizer_path=/nonexistent")) == 2  # fails: leaves it alone
    assert (tmp_path / "default" / "config.yml").read_text() == first
    assert train.main(argv(tmp_path, "steps=2", "learning_rate=0.001")) == 0
    assert (tmp_path / "default" / "config.1.yml").read_text() == first
    assert yaml.safe_load((tmp_path / "default" / "config.yml").read_text())["learning_rate"] == 0.001
    assert not (tmp_path / "default" / "config.2.yml").exists()
    assert train.main(argv(tmp_path, "steps=3", "learning_rate=0.001")) == 0  # only steps changed: nothing kept
    assert not (tmp_path / "default" / "config.2.yml").exists()


@pytest.mark.parametrize(
    "other, says",
    [
        (["mode=grpo", "steps=2001"], "mode=sft (its config.yml) and this command sets mode=grpo"),
        (["mode=dpo"], "mode=sft (its config.yml) and this command sets mode=dpo"),
        (["num_decoder_layers=3"], "num_decoder_layers=4 (its config.yml) and this command sets num_decoder_layers=3"),
    ],
)
def test_a_command_that_cannot_resume_the_run_directory_says_so_in_one_line(tmp_path, capsys, other, says):
    """Another mode, data pipeline or model on a run directory with checkpoints stops before anything is
    built (it was grain's KeyError 'next_index' from the restore), naming the two ways on."""
    assert train.main(argv(tmp_path, "steps=1")) == 0
    capsys.readouterr()
    config_before = (tmp_path / "default" / "config.yml").read_text()
    assert train.main(argv(tmp_path, *other)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err and "another run_name" in err
    weights = f"load_parameters_path={tmp_path / 'default' / 'checkpoints'}"
    assert (weights in err) == ("num_decoder_layers=3" not in other)  # another model cannot start from them
    assert (tmp_path / "default" / "config.yml").read_text() == config_before
    if weights in err:  # the way on it names trains (GRPO's step on the suite's small rollouts)
        small = RL_FAST if other[0] == "mode=grpo" else []
        assert train.main(argv(tmp_path, *other[:1], *small, weights, "run_name=next", "steps=1")) == 0


def test_a_resume_on_another_device_count_keeps_the_global_batch(tmp_path):
    cfg = load_checked(argv(tmp_path, "per_device_batch_size=1"))
    now = sharding.layout_for(cfg).global_batch_size  # 8 devices here: 8 rows
    kept = run_dir.keep_global_batch(cfg, now, {"global_batch_size": 16, "per_device_batch_size": 1}, True)
    assert (kept.per_device_batch_size, sharding.layout_for(kept).global_batch_size) == (2, 16)
    assert (
        run_dir.keep_global_batch(cfg, now, {"global_batch_size": 16, "per_device_batch_size": 1}, False) is cfg
    )  # nothing saved yet: nothing to continue
    with pytest.raises(ConfigError, match="global batch of 16 rows.*per_device_batch_size=2"):
        run_dir.keep_global_batch(cfg, now, {"global_batch_size": 16, "per_device_batch_size": 4}, True)
    with pytest.raises(ConfigError, match="cannot split evenly"):
        run_dir.keep_global_batch(cfg, now, {"global_batch_size": 12, "per_device_batch_size": 1}, True)


def test_the_global_batch_is_read_back_from_the_written_config(tmp_path):
    assert train.main(argv(tmp_path, "steps=1", "per_device_batch_size=2")) == 0
    previous = run_dir.previous_config(str(tmp_path / "default"))
    assert previous["global_batch_size"] == 2 * jax.device_count() and previous["per_device_batch_size"] == 2
    assert set(MODEL_KEYS) <= set(previous)


def test_load_optimizer_state_continues_the_adam_moments(tmp_path, tiny_checkpoint):
    assert train.main(argv(tmp_path, "run_name=a", "steps=3")) == 0
    for run_name, load in (("fresh", "false"), ("continued", "true")):
        assert (
            train.main(
                argv(
                    tmp_path,
                    f"run_name={run_name}",
                    "steps=1",
                    f"load_parameters_path={tmp_path / 'a'}",
                    f"load_optimizer_state={load}",
                )
            )
            == 0
        )
    cfg = make_cfg(load_parameters_path=str(tmp_path / "a"))
    _, state = run.build_run(cfg)

    def adam_count(name):
        opt_state = checkpoint.load_opt_state(str(tmp_path / name), state)
        return {
            int(np.asarray(x))
            for x in jax.tree.leaves(opt_state)
            if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)
        }

    assert adam_count("a") >= {3} and adam_count("fresh") >= {1} and adam_count("continued") >= {4}
    with pytest.raises(ConfigError, match="load_optimizer_state"):
        make_cfg(load_parameters_path=str(tiny_checkpoint("qwen2")), load_optimizer_state=True)
