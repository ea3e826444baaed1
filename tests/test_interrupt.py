"""Ctrl-C: the first SIGINT to a run (to its process group, as a terminal sends it) finishes the step,
saves it and exits 130 without a traceback, and the run resumes exactly; a second one ends the
process at once; one during start-up, an eval or between a pipeline's stages stops the run there;
the handlers before the run come back after it."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, SFT_FAST, cpu_env, losses_of
from helpers import sft_config as config
from unitrain import checkpoint, run, train
from unitrain.tasks import sft

BASE = str(REPO / "configs" / "base.yml")
# A schedule that does not depend on `steps`: a run stopped early and resumed with another `steps` is
# the same run as one given those steps from the start.
ENDLESS = [*SFT_FAST, "lr_schedule=constant", "steps=100000"]


def saved_steps(cfg) -> list:
    return checkpoint.Checkpointer(cfg.checkpoint_dir, 1, 3, False).all_steps()


def start_in_own_group(tmp_path, code: str, *args) -> tuple[subprocess.Popen, object]:
    """`python -c code` running unitrain's command line with `args`, in a process group of its own
    (a terminal's job); its stderr in a file, read while it runs."""
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, BASE, f"base_output_directory={tmp_path}", *args],
        env=cpu_env(8),
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    return proc, err


def wait_for(predicate, proc, timeout=240):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None and time.time() < deadline, "the run ended or took too long"
        time.sleep(0.05)


def lines_in(path) -> int:
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


CLI = "from unitrain import train; train.cli()"


def test_ctrl_c_mid_run_saves_the_step_reached_exits_130_and_resumes_exactly(tmp_path):
    cfg = config(tmp_path, *ENDLESS)
    proc, err = start_in_own_group(tmp_path, CLI, *ENDLESS)
    wait_for(lambda: lines_in(cfg.metrics_file) >= 4, proc)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == train.EXIT_SIGINT
    err.seek(0)
    stderr = err.read()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "unitrain: SIGINT: stopping after the step in flight" in stderr and "Ctrl-C again" in stderr
    reached = sorted(losses_of(cfg))
    assert reached == list(range(len(reached))) and saved_steps(cfg) == [len(reached)]

    total = len(reached) + 3
    assert train.main([BASE, f"base_output_directory={tmp_path}", *ENDLESS, f"steps={total}"]) == 0
    straight = config(tmp_path, *ENDLESS, f"steps={total}", "run_name=straight")
    assert train.train(straight) == 0
    assert sorted(losses_of(cfg)) == list(range(total))
    assert losses_of(cfg) == pytest.approx(losses_of(straight), rel=1e-6)


SLOW_SAVE = """
import time
from unitrain import checkpoint, train
save = checkpoint.Checkpointer.save
def slow_save(self, *args, **kwargs):
    time.sleep(300)  # a save nobody waits for
    return save(self, *args, **kwargs)
checkpoint.Checkpointer.save = slow_save
train.cli()
"""


def test_a_second_ctrl_c_ends_the_run_at_once(tmp_path):
    cfg = config(tmp_path, *ENDLESS)
    proc, err = start_in_own_group(tmp_path, SLOW_SAVE, *ENDLESS)
    wait_for(lambda: lines_in(cfg.metrics_file) >= 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "Ctrl-C again" in open(err.name).read(), proc)  # heard: now in its save
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == -signal.SIGINT  # killed by it: a shell says 130
    stderr = open(err.name).read()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert not saved_steps(cfg)


@contextlib.contextmanager
def handlers_kept():
    """The handlers a run found are the handlers it leaves."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_ctrl_c_during_start_up_stops_before_the_first_step(tmp_path, monkeypatch, caplog):
    build = run.build_run

    def build_then_sigint(cfg):
        os.kill(os.getpid(), signal.SIGINT)  # while the run is being built (tokenizer, model)
        return build(cfg)

    monkeypatch.setattr(train, "build_run", build_then_sigint)
    cfg = config(tmp_path, "steps=3")
    with handlers_kept():
        assert train.train(cfg) == train.EXIT_SIGINT
    assert "SIGINT during start-up" in caplog.text and "nothing was trained" in caplog.text
    assert not os.path.exists(cfg.metrics_file) or not losses_of(cfg)
    assert not saved_steps(cfg)


def test_ctrl_c_during_an_eval_saves_that_step(tmp_path, monkeypatch):
    evaluate = sft.SFTTask.evaluate

    def sigint_then_evaluate(self, params, step):
        os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self, params, step)

    monkeypatch.setattr(sft.SFTTask, "evaluate", sigint_then_evaluate)
    cfg = config(tmp_path, "steps=8", "eval_interval=2", "eval_num_samples=2", "eval_steps=1")
    with handlers_kept():
        assert train.train(cfg) == train.EXIT_SIGINT
    assert saved_steps(cfg) == [2] and sorted(losses_of(cfg)) == [0, 1]
    assert any("eval_loss" in json.loads(line) for line in open(cfg.metrics_file))  # the eval finished


def test_ctrl_c_between_a_pipelines_stages_starts_no_other(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yml"
    stages = [{"name": "first", "steps": 2}, {"name": "second", "steps": 2}]
    recipe.write_text(json.dumps({"base_config": BASE, "base_output_directory": str(tmp_path), "stages": stages}))
    sync = train.pipeline.multihost_utils.sync_global_devices

    def sigint_then_sync(name):  # the pipeline's barrier after a finished stage
        os.kill(os.getpid(), signal.SIGINT)
        sync(name)

    monkeypatch.setattr(train.pipeline.multihost_utils, "sync_global_devices", sigint_then_sync)
    with handlers_kept():
        assert train.main([str(recipe), *SFT_FAST]) == train.EXIT_SIGINT
    pipe = tmp_path / "default"
    assert (pipe / "first" / "stage_done").exists() and not (pipe / "second").exists()
    monkeypatch.setattr(train.pipeline.multihost_utils, "sync_global_devices", sync)
    assert train.main([str(recipe), *SFT_FAST]) == 0  # the rest, when asked again
    assert (pipe / "second" / "stage_done").exists()
