"""Faults and bad inputs: kill -9 around saves, failing and damaged checkpoints, bad weights files,
a full disk, SIGTERM during start-up, and step times that leave evals and checkpoints out."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO, SFT_FAST, cpu_env, losses_of, run_cli
from helpers import sft_config as config
from unitrain import checkpoint, metrics, run, train
from unitrain.errors import CheckpointError


def metric_lines(cfg):
    return [json.loads(l) for l in open(cfg.metrics_file) if l.strip()]


def wait_for(predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and not predicate():
        time.sleep(0.05)
    assert predicate(), "timed out"


def one_line_exit_2(capsys, *args):
    assert train.main([str(REPO / "configs" / "base.yml"), *SFT_FAST, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_kill_9_around_sync_and_async_saves_loses_no_metrics_line(tmp_path):
    steps = ["steps=24", "checkpoint_period=3", "max_to_keep=2"]
    straight = config(tmp_path, "run_name=straight", *steps)
    assert train.train(straight) == 0
    killed = config(tmp_path, "run_name=killed", *steps)
    ckpts = Path(killed.checkpoint_dir)
    args = [f"base_output_directory={tmp_path}", "run_name=killed", *SFT_FAST, *steps]
    # A step directory appearing: a sync save just committed (the line of every step it covers must
    # be on disk already); a tmp directory: an async save in flight.
    for mode, marker in (("false", "6"), ("true", "12.orbax-checkpoint-tmp"), ("false", "18")):
        proc = run_cli(*args, f"async_checkpointing={mode}")
        wait_for(lambda: (ckpts / marker).exists() or proc.poll() is not None)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc = run_cli(*args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    steps_logged = [l["step"] for l in metric_lines(killed) if "loss" in l]
    assert steps_logged == list(range(24))  # exactly one line per step
    assert losses_of(killed) == pytest.approx(losses_of(straight), rel=1e-6)


def cannot_write_read_only(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").touch()
        return False  # root with CAP_DAC_OVERRIDE: chmod does not bite
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)


def test_read_only_checkpoint_dir_stops_in_seconds_with_one_line(tmp_path):
    if not cannot_write_read_only(tmp_path):
        pytest.skip("this user writes into read-only directories (root)")
    args = [f"base_output_directory={tmp_path}", *SFT_FAST, "steps=100000", "checkpoint_period=5"]
    proc = run_cli(*args)
    ckpts = tmp_path / "default" / "checkpoints"
    wait_for(lambda: (ckpts / "5").exists() or proc.poll() is not None)
    ckpts.chmod(0o555)  # the next save (step 10) fails in the background
    try:
        began = time.time()
        _, err = proc.communicate(timeout=60)
        took = time.time() - began
    finally:
        ckpts.chmod(0o755)
    assert proc.returncode == 2 and took < 30, (proc.returncode, took)
    ours = [line for line in err.splitlines() if line.startswith("unitrain: ")]
    assert len(ours) == 1 and "Permission denied" in ours[0] and str(ckpts) in ours[0], err[-3000:]
    assert checkpoint.Checkpointer(str(ckpts), 5, 3, False).latest_step() == 5
    assert train.main([str(REPO / "configs" / "base.yml"), *args[:-2], "steps=7", "checkpoint_period=5"]) == 0


def test_unwritable_output_directory_is_one_line(tmp_path, capsys):
    if not cannot_write_read_only(tmp_path):
        pytest.skip("this user writes into read-only directories (root)")
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        err = one_line_exit_2(capsys, f"base_output_directory={out}", "steps=2")
    finally:
        out.chmod(0o755)
    assert "Permission denied" in err and str(out) in err


def test_full_disk_is_one_line_and_keeps_saved_checkpoints(tmp_path):
    # A real write failure from the OS: a file-size limit (EFBIG, like ENOSPC a failed write)
    # that the first checkpoint's files exceed, set in the child process only.
    args = [
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={tmp_path}",
        *SFT_FAST,
        "steps=4",
        "checkpoint_period=2",
    ]
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
        f"sys.argv = ['unitrain', *{args!r}]; from unitrain.train import cli; cli()"
    )
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("unitrain: ")]
    assert len(ours) == 1 and "File too large" in ours[0] and "checkpoints" in ours[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_metrics_write_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, path, mode):
            self.name = str(path)

        def write(self, text):
            raise OSError(28, os.strerror(28))

        def close(self):
            pass

    monkeypatch.setattr(metrics, "open", FullDisk, raising=False)
    writer = metrics.MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb", 2, is_primary=True)
    with pytest.raises(OSError) as raised:
        writer.write(0, {"loss": 1.0})
    assert checkpoint.reason(raised.value) == f"No space left on device: {tmp_path / 'm.jsonl'}"


def test_truncated_safetensors_is_one_line(tmp_path, capsys, tiny_checkpoint):
    ckpt = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint("qwen2"), ckpt)
    weights = ckpt / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    capsys.readouterr()  # the fixture's progress bar
    for source in ("unitrain", "tunix"):
        err = one_line_exit_2(
            capsys,
            f"base_output_directory={tmp_path}",
            f"model_source={source}",
            f"load_parameters_path={ckpt}",
            f"tokenizer_path={ckpt}",
            "steps=1",
        )
        assert str(weights) in err


def test_other_dimensions_than_the_checkpoint_are_one_line(tmp_path, capsys):
    base = [f"base_output_directory={tmp_path}", "steps=2", "checkpoint_period=2"]
    assert train.main([str(REPO / "configs" / "base.yml"), *SFT_FAST, *base]) == 0
    capsys.readouterr()
    err = one_line_exit_2(capsys, *base, "steps=4", "mlp_dim=96")
    assert "mlp_dim=128 (its config.yml) and this command sets mlp_dim=96" in err  # before anything is built
    (tmp_path / "default" / "config.yml").unlink()  # without the record, the restore itself says it
    err = one_line_exit_2(capsys, *base, "steps=4", "mlp_dim=96")
    assert "['layers']['w_down']" in err and "[4, 96, 64]" in err  # the first parameter that differs
    _, state = run.build_run(config(tmp_path, "run_name=other", "mlp_dim=96"))
    with pytest.raises(CheckpointError, match=r"\['layers'\]\['w_down'\]"):
        checkpoint.load_params(str(tmp_path / "default" / "checkpoints"), state["params"])
    with pytest.raises(CheckpointError, match=r"^load_parameters_path \S*nope does not exist$"):
        checkpoint.load_params(str(tmp_path / "nope"), state["params"])


def damage(step_dir: Path, how: str) -> None:
    if how == "truncated":
        for data in (step_dir / "params").glob("**/d/*"):
            os.truncate(data, data.stat().st_size // 2)
    else:
        (step_dir / "params" / "_METADATA").unlink()


@pytest.mark.parametrize("how", ["truncated", "metadata deleted"])
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog, how):
    cfg = config(tmp_path, "steps=4", "checkpoint_period=2")
    assert train.train(cfg) == 0
    damage(Path(cfg.checkpoint_dir) / "4", how)
    built, state = run.build_run(cfg)
    ckpt = checkpoint.Checkpointer(cfg.checkpoint_dir, 2, 3, False)
    step, restored = ckpt.restore(4, state, _NoIterator())
    ckpt.close()
    assert step == 2 and f"{cfg.checkpoint_dir}/4 is damaged" in caplog.text
    assert (Path(cfg.checkpoint_dir + ".set_aside") / "4").is_dir()  # kept, not deleted
    reference = checkpoint.load_params(os.path.join(cfg.checkpoint_dir, "2"), state["params"])
    for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(a, b)


class _NoIterator:
    def set_state(self, state):
        pass


def test_a_second_writer_of_the_same_checkpoints_is_refused_and_the_first_save_survives(tmp_path, monkeypatch):
    """Two runs on one checkpoint directory: a save of a step removes the other run's unfinished
    <step>.orbax-checkpoint-tmp (No such file or directory: .../array_metadatas/process_0 in the
    other's background save). A delay in orbax's array-metadata write keeps the first save in flight."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    write = array_metadata_store.Store.write

    async def slow_write(self, *args, **kwargs):
        await asyncio.sleep(1.0)
        return await write(self, *args, **kwargs)

    monkeypatch.setattr(array_metadata_store.Store, "write", slow_write)
    state = {"params": {"w": jnp.ones((4, 4))}, "opt_state": {"m": jnp.zeros((4, 4))}, "step": jnp.int32(1)}
    first = checkpoint.Checkpointer(str(tmp_path / "ckpt"), 1, 3, True)
    first.save(1, state, _Position(), force=True)
    second = checkpoint.Checkpointer(str(tmp_path / "ckpt"), 1, 3, True)
    with pytest.raises(CheckpointError, match="another process is saving checkpoints in .*ckpt"):
        second.save(1, state, _Position(), force=True)
        second.wait()
    first.close()
    assert first.all_steps() == [1] and sorted(os.listdir(tmp_path / "ckpt")) == ["1"]


class _Position:
    def get_state(self):
        return {"position": 0}


def test_damaged_checkpoint_without_fallback_refuses_in_one_line(tmp_path, capsys):
    base = [f"base_output_directory={tmp_path}", "steps=4", "checkpoint_period=2"]
    assert train.main([str(REPO / "configs" / "base.yml"), *SFT_FAST, *base]) == 0
    capsys.readouterr()
    damage(tmp_path / "default" / "checkpoints" / "4", "truncated")
    proc = run_cli(*SFT_FAST, *base, "steps=6", "checkpoint_fallback=false")  # a new process: nothing cached
    _, err = proc.communicate(timeout=300)
    ours = [line for line in err.splitlines() if line.startswith("unitrain: ")]
    assert proc.returncode == 2 and len(ours) == 1, err[-3000:]
    assert "checkpoints/4 is damaged" in ours[0] and "checkpoint_fallback=true" in err
    assert (tmp_path / "default" / "checkpoints" / "4").is_dir()  # left where it was


def test_sigterm_during_start_up_exits_cleanly_having_trained_nothing(tmp_path, monkeypatch, caplog):
    build = run.build_run

    def build_then_sigterm(cfg):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the run is being built
        return build(cfg)

    monkeypatch.setattr(train, "build_run", build_then_sigterm)
    cfg = config(tmp_path, "steps=3")
    assert train.train(cfg) == train.EXIT_SIGTERM
    assert "nothing was trained" in caplog.text
    assert not os.path.exists(cfg.metrics_file) or not metric_lines(cfg)
    assert not checkpoint.Checkpointer(cfg.checkpoint_dir, 1, 3, False).all_steps()


def test_eval_and_checkpoint_time_is_no_steps_time(tmp_path, monkeypatch, capsys):
    from unitrain.tasks import sft

    slow = 3.0
    evaluate = sft.SFTTask.evaluate

    def slow_evaluate(self, params, step):
        time.sleep(slow)
        return evaluate(self, params, step)

    monkeypatch.setattr(sft.SFTTask, "evaluate", slow_evaluate)
    cfg = config(tmp_path, "steps=12", "eval_interval=4", "eval_num_samples=4", "eval_steps=1", "log_period=1")
    assert train.train(cfg) == 0
    times = {l["step"]: l["step_time"] for l in metric_lines(cfg) if "step_time" in l}
    typical = np.median([times[s] for s in range(1, 12)])
    for s in (3, 4, 7, 8):  # the steps before and after each eval
        assert times[s] < slow / 3 and times[s] < 10 * typical + 0.2, (s, times)
    etas = [line for line in capsys.readouterr().out.splitlines() if "ETA" in line]
    seconds = [
        sum(int(x) * 60**i for i, x in enumerate(reversed(line.rsplit("ETA ", 1)[1].split(":")))) for line in etas
    ]
    assert max(seconds) < slow  # three slow evals and not one of them in an ETA
