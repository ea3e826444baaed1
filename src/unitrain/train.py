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
from pathlib import Path

import jax

from unitrain import checkpoint, distributed, export, metrics, pipeline, run_dir, tasks
from unitrain.config import DEFAULT_CONFIG, ConfigError, describe_keys, load_config, root_config
from unitrain.run import RunContext, build_run
from unitrain.tasks.base import Task

log = logging.getLogger("unitrain")

EXIT_USER_ERROR, EXIT_NAN, EXIT_SIGTERM = 2, 3, 143


class NonFiniteLoss(RuntimeError):
    pass


def train(cfg) -> int:
    previous = run_dir.previous_config(cfg.run_dir)
    checkpointer = checkpoint.Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_period, cfg.max_to_keep,
                                           cfg.async_checkpointing)
    if previous is not None:
        cfg = run_dir.keep_global_batch(cfg, previous, has_checkpoint=bool(checkpointer.all_steps()))
    run, state = build_run(cfg)
    log.info("mode %s; model %s; mesh %s over %d devices (%d processes)", cfg.mode, cfg.model_source,
             dict(run.mesh.shape), run.mesh.size, jax.process_count())
    task = tasks.create(run)
    start = run_dir.resume_step(cfg, checkpointer)
    if start:
        state = checkpointer.restore(start, state, task.data_iterator)
        log.info("resumed from %s at step %d", cfg.checkpoint_dir, start)
    if cfg.action != "train":
        with jax.set_mesh(run.mesh):
            return evaluate_or_export(run, task, state, start)
    if jax.process_index() == 0:  # only now: a command that failed above leaves the run's config.yml alone
        run_dir.save_config(cfg, previous)
    writer = metrics.MetricsWriter.from_config(cfg, cfg.steps, resume_step=start)
    with jax.set_mesh(run.mesh):
        return loop(run, task, state, start, checkpointer, writer)


def evaluate_or_export(run: RunContext, task: Task, state: dict, start: int) -> int:
    """action=eval | export: the parameters of the run's checkpoint (or load_parameters_path) once,
    evaluated into <run_dir>/evals.jsonl or exported to export_hf_path; nothing is trained or saved."""
    cfg = run.cfg
    if not start and not cfg.load_parameters_path:
        raise ConfigError(f"action={cfg.action} needs parameters: {cfg.checkpoint_dir} has no checkpoint and "
                          "load_parameters_path is empty")
    source = f"{cfg.checkpoint_dir} step {start}" if start else cfg.load_parameters_path
    if cfg.action == "export":
        export.export_hf(run, state["params"], cfg.export_hf_path)
        log.info("exported %s to %s", source, cfg.export_hf_path)
        return 0
    results = task.evaluate(state["params"], start)
    if not results:
        raise ConfigError(f"mode {cfg.mode} has nothing to evaluate with this config (set eval_dataset_path or eval keys)")
    metrics.append_eval(os.path.join(cfg.run_dir, "evals.jsonl"), start, source, results)
    log.info("evaluated %s: %s", source, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return 0


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
            done = step + 1
            if cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.steps):
                if eval_metrics := task.evaluate(state["params"], done):
                    writer.write(step, eval_metrics)
            if text := task.samples_text(step):  # after the eval: a mode may show its answers
                writer.text(step, "samples", text)
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
    if "--help" in argv or "-h" in argv:
        return _help(argv)
    _setup_logging()
    try:
        cfg = load_config(argv, before_derive=distributed.maybe_initialize)
        if jax.process_index() != 0:  # only after jax.distributed has started
            log.setLevel(logging.WARNING)
        return pipeline.run(cfg, train) if cfg.stages else train(cfg)
    except ConfigError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return _exit(EXIT_USER_ERROR)
    except Exception:
        traceback.print_exc()
        return _exit(1)


def _help(argv: list[str]) -> int:
    """`--help [KEYWORD]`: the keys of the root base.yml (of the yml given first, else configs/base.yml)."""
    at = argv.index("--help") if "--help" in argv else argv.index("-h")
    keyword = argv[at + 1] if at + 1 < len(argv) else ""
    first = Path(argv[0]) if at > 0 and argv[0].endswith((".yml", ".yaml")) else DEFAULT_CONFIG
    print(__doc__.split("\n\n")[1].strip() + "\n")
    try:
        print(describe_keys(root_config(first), keyword))
    except ConfigError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


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
