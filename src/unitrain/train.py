"""The entry point: config -> run (mesh, model, optimizer, state) -> mode -> loop.

    python -m unitrain.train configs/base.yml [key=value ...]

Read top to bottom: `main` turns user mistakes into one line and exit status 2; `run.build_run`
builds everything a mode needs once; `tasks.create` looks the mode up; `loop` runs it, fetching the
metrics of step s while step s+1 runs, so the host never waits on the device except at checkpoints
and evals. Nothing imports this module but the command line.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import traceback

import jax

from unitrain import checkpoint, distributed, export, metrics, tasks
from unitrain.config import ConfigError, load_config, write_config
from unitrain.run import RunContext, build_run
from unitrain.tasks.base import Task

log = logging.getLogger("unitrain")

EXIT_USER_ERROR, EXIT_NAN, EXIT_SIGTERM = 2, 3, 143


class NonFiniteLoss(RuntimeError):
    pass


def train(cfg) -> int:
    if jax.process_index() == 0:
        write_config(cfg, os.path.join(cfg.run_dir, "config.yml"))
    run, state = build_run(cfg)
    log.info("mode %s; model %s; mesh %s over %d devices (%d processes)", cfg.mode, cfg.model_source,
             dict(run.mesh.shape), run.mesh.size, jax.process_count())
    task = tasks.create(run)
    checkpointer = checkpoint.Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_period, cfg.max_to_keep,
                                           cfg.async_checkpointing)
    start = checkpointer.latest_step() or 0
    if start:
        state = checkpointer.restore(start, state, task.data_iterator)
        log.info("resumed from %s at step %d", cfg.checkpoint_dir, start)
    writer = metrics.MetricsWriter.from_config(cfg, cfg.steps, resume_step=start)
    with jax.set_mesh(run.mesh):
        return loop(run, task, state, start, checkpointer, writer)


# ---------------------------------------------------------------- the loop

def _fetch(step_metrics: dict) -> dict:
    """Host copy of a step's metrics; a non-finite loss or gradient means the state after it is bad."""
    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}  # numbers pass through
    for key in ("loss", "grad_norm"):
        if not math.isfinite(values[key]):
            raise NonFiniteLoss(f"{key} is {values[key]}")
    return values


class _SigtermFlag:
    """Turns SIGTERM (preemption, `kill`) into a flag the loop checks after each step."""

    def __init__(self):
        self.raised = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, *_):
        self.raised = True


class _Throughput:
    """tokens/s and MFU of a step from its wall time (SFT: every position of the batch counts)."""

    def __init__(self, cfg, model, num_devices: int, tokens_per_step: int | None):
        self.tokens_per_step, self.num_devices = tokens_per_step, num_devices
        if tokens_per_step:
            self.flops_per_token = model.flops_per_token(cfg.max_target_length)
            self.peak = metrics.peak_flops_per_device(cfg)
            log.info("MFU denominator: %.3g FLOP/s per device (jnp.dot); model: %.3g FLOP per token",
                     self.peak, self.flops_per_token)

    def __call__(self, step_time: float) -> dict:
        if not self.tokens_per_step:
            return {"step_time": step_time}
        tokens_per_sec = self.tokens_per_step / step_time
        return {"step_time": step_time, "tokens_per_sec": tokens_per_sec,
                "mfu": metrics.mfu(tokens_per_sec, self.flops_per_token, self.peak, self.num_devices)}


def loop(run: RunContext, task: Task, state: dict, start: int, checkpointer, writer) -> int:
    """The shared loop. Metrics of step s are written while step s+1 runs (no host sync for them)."""
    cfg = run.cfg
    throughput = _Throughput(cfg, run.model, run.mesh.size, task.tokens_per_step)
    profiler, sigterm = metrics.Profiler.from_config(cfg), _SigtermFlag()
    pending = None  # (step, metrics, dispatch time) of the step not yet written
    last_good = start
    try:
        for step in range(start, cfg.steps):
            profiler.maybe_start(step)
            dispatched = time.perf_counter()
            state, step_metrics = task.step(state, step)
            profiler.maybe_stop(step, block_on=step_metrics)
            if pending is not None:
                _write(writer, pending, dispatched, throughput)
            pending = (step, step_metrics, dispatched)
            if text := task.samples_text(step):
                writer.text(step, "samples", text)
            done = step + 1
            if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.steps):
                if eval_metrics := task.evaluate(state["params"], done):
                    writer.write(step, eval_metrics)
            if done % cfg.checkpoint_period == 0 or done == cfg.steps or sigterm.raised:
                _fetch(step_metrics)  # never save a state that came from a non-finite loss
                checkpointer.save(done, state, task.data_iterator, force=True)
                last_good = done
            if sigterm.raised:
                break
        if pending is not None:
            _write(writer, pending, time.perf_counter(), throughput)
        if sigterm.raised:
            log.warning("SIGTERM: saved a checkpoint at step %d; stopping", last_good)
            return EXIT_SIGTERM
        if cfg.export_hf_path:
            export.export_hf(run, state["params"], cfg.export_hf_path)
            log.info("exported the model to %s", cfg.export_hf_path)
        return 0
    except NonFiniteLoss as e:
        log.error("stopping: %s; the last good checkpoint is step %d", e, last_good)
        return EXIT_NAN
    finally:
        profiler.close()
        checkpointer.wait()
        checkpointer.close()
        writer.close()


def _write(writer, pending, now, throughput) -> None:
    step, step_metrics, dispatched = pending
    writer.write(step, {**_fetch(step_metrics), **throughput(max(now - dispatched, 1e-9))})


def _setup_logging() -> None:
    """unitrain's own handler: libraries (absl via orbax) configure the root logger their way."""
    for old in list(log.handlers):  # a second main() in one process (tests) gets today's stdout
        log.removeHandler(old)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s unitrain: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    try:
        cfg = load_config(argv, before_derive=distributed.maybe_initialize)
        if jax.process_index() != 0:  # only after jax.distributed has started
            log.setLevel(logging.WARNING)
        return train(cfg)
    except ConfigError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return _exit(EXIT_USER_ERROR)
    except Exception:
        traceback.print_exc()
        return _exit(1)


def _exit(code: int) -> int:
    """A failed process of a multi-process job leaves at once: a normal exit would wait in
    jax.distributed's shutdown barrier for peers that are stuck in a collective."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
