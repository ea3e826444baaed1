"""The entry point: config -> run (mesh, model, optimizer, state) -> mode -> loop.

    unitrain [CONFIG.yml] [key=value ...]    (or python -m unitrain.train; no yml: configs/base.yml)

Read top to bottom: `main` turns user mistakes into one line and exit status 2; `run.build_run`
builds everything a mode needs once; `tasks.create` looks the mode up; `loop` runs it, fetching the
metrics of step s while step s+1 runs, so the host never waits on the device except at checkpoints
and evals. Nothing imports this module but the command line.

Timing: a thread waits for each step's outputs in turn and notes when they were ready, so the loop
itself never waits to date a step. A step's `step_time` runs from the completion of the step before
(or the end of start-up, an eval or a checkpoint) to its own: the device's time for it when the
device is the bottleneck, more when the host is; never less, so its MFU is never above the device's.
Stopping: SIGTERM and the first SIGINT (Ctrl-C) are a request the loop honours after the step in
flight (a checkpoint, exit 143 or 130); a second SIGINT ends the process at once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax

from unitrain import checkpoint, checks, compile_cache, distributed, export, metrics, modes, pipeline, run_dir
from unitrain.config import DEFAULT_CONFIG, describe_keys, load_config, root_config
from unitrain.context import RunContext
from unitrain.errors import ConfigError, RunEndedEarly, UserError
from unitrain.run import build_run, device_layout
from unitrain.tasks.base import Task

log = logging.getLogger("unitrain")

EXIT_USER_ERROR, EXIT_NAN, EXIT_SIGINT, EXIT_SIGTERM = 2, 3, 130, 143
RUN_LOG = "unitrain.log"  # in the run directory: unitrain's log lines, debug ones too (each compile)


class NonFiniteLoss(RuntimeError):
    pass


def train(cfg) -> int:
    """One run (or one stage of a pipeline); the exit status. SIGINT/SIGTERM from its start on are a
    stop request (_StopRequest): the status is 130/143 whenever one came, so a pipeline stops."""
    with _StopRequest.installed() as stop:
        if stop.raised:  # between the stages of a pipeline: the next one does not start
            return stop.exit_code
        status = _train(cfg, stop)
        return stop.exit_code if stop.raised and status == 0 else status


def _train(cfg, stop: _StopRequest) -> int:
    layout = device_layout(cfg)  # a config these devices cannot run stops before the run directory is read
    previous = run_dir.previous_config(cfg.run_dir)
    checkpointer = checkpoint.Checkpointer(
        cfg.checkpoint_dir,
        cfg.checkpoint_period,
        cfg.max_to_keep,
        cfg.async_checkpointing,
        adapters_only=cfg.lora_rank > 0,
    )
    if previous is not None:
        has_checkpoint = bool(checkpointer.all_steps())
        run_dir.check_resumable(cfg, previous, has_checkpoint)
        cfg = run_dir.keep_global_batch(cfg, layout.global_batch_size, previous, has_checkpoint)
    if (done := run_dir.finished_step(cfg, checkpointer)) is not None:  # before minutes of building
        checkpointer.close()
        log.info(
            "%s is finished: its checkpoint is at step %d and steps=%d, so there is nothing to train; "
            "raise steps (e.g. steps=%d) to train on from it, or give another run_name to start afresh",
            cfg.run_dir,
            done,
            cfg.steps,
            2 * done,
        )
        return 0
    run_dir.check_resume_step(cfg, checkpointer.all_steps())
    run, state = build_run(cfg)
    log.info(
        "mode %s; model %s; mesh %s over %d devices (%d processes)",
        cfg.mode,
        cfg.model_source,
        dict(run.mesh.shape),
        run.mesh.size,
        jax.process_count(),
    )
    with contextlib.closing(modes.create(run)) as task:
        return _start(run, task, task.train_state(state), checkpointer, previous, stop)


def _start(run: RunContext, task: Task, state: dict, checkpointer, previous, stop: _StopRequest) -> int:
    """Resumes or starts the run, then evaluates, exports or trains."""
    cfg = run.cfg
    if stop.raised:  # during start-up: nothing is restored, written or trained
        log.warning("%s during start-up: stopping before the first step; nothing was trained", stop.name)
        checkpointer.close()
        return stop.exit_code
    start = run_dir.resume_step(cfg, checkpointer)
    if start:
        start, state = checkpointer.restore(start, state, task.data_iterator, cfg.checkpoint_fallback)
        log.info("resumed from %s at step %d", cfg.checkpoint_dir, start)
    if not start and cfg.load_optimizer_state:
        state["opt_state"] = checkpoint.load_opt_state(cfg.load_parameters_path, state)
        log.info("took the optimizer state of %s", cfg.load_parameters_path)
    if cfg.action != "train":
        with jax.set_mesh(run.mesh):
            return evaluate_or_export(run, task, state, start)
    if jax.process_index() == 0:  # only now: a command that failed above leaves the run's config.yml alone
        run_dir.save_config(cfg, run.layout, previous)
    writer = metrics.MetricsWriter.from_config(cfg, cfg.steps, resume_step=start)
    with jax.set_mesh(run.mesh), _run_log(cfg.run_dir):
        return loop(run, task, state, start, checkpointer, writer, stop)


@contextlib.contextmanager
def _run_log(path: str):
    """Every line of unitrain's log, debug ones too (each compiled program with its memory), also in
    <run_dir>/unitrain.log, which a resume appends to (process 0, a local run directory)."""
    if jax.process_index() != 0 or "://" in path:
        yield
        return
    handler = logging.FileHandler(os.path.join(path, RUN_LOG))
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)  # the console's handler stays at INFO
    try:
        yield
    finally:
        log.setLevel(logging.INFO)
        log.removeHandler(handler)
        handler.close()


def evaluate_or_export(run: RunContext, task: Task, state: dict, start: int) -> int:
    """action=eval | export: the parameters of the run's checkpoint (or load_parameters_path) once,
    evaluated into <run_dir>/evals.jsonl or exported to export_hf_path; nothing is trained or saved."""
    cfg = run.cfg
    if not start and not cfg.load_parameters_path:
        raise ConfigError(
            f"action={cfg.action} needs parameters: {cfg.checkpoint_dir} has no checkpoint and "
            "load_parameters_path is empty"
        )
    source = f"{cfg.checkpoint_dir} step {start}" if start else cfg.load_parameters_path
    if cfg.action == "export":
        export.export_hf(run, state["params"], cfg.export_hf_path)
        log.info("exported %s to %s", source, cfg.export_hf_path)
        return 0
    results = task.evaluate(state["params"], start)
    compile_cache.report("the evaluation")
    if not results:
        raise ConfigError(
            f"mode {cfg.mode} has nothing to evaluate with this config (set eval_dataset_path or eval keys)"
        )
    metrics.append_eval(os.path.join(cfg.run_dir, "evals.jsonl"), start, source, results)
    log.info("evaluated %s: %s", source, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return 0


# ---------------------------------------------------------------- the loop


def _fetch(step: int, step_metrics: dict) -> dict:
    """Host copy of a step's metrics; a non-finite loss or gradient (of any model the step trained:
    `loss`, `critic/loss`, ...) means the state after it is bad."""
    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}  # numbers pass through
    for key in (k for k in values if k.rsplit("/", 1)[-1] in ("loss", "grad_norm")):
        if not math.isfinite(values[key]):
            raise NonFiniteLoss(f"{key} is {values[key]} at step {step + 1}")  # counted as checkpoints are
    return values


class _StopRequest:
    """SIGTERM (preemption, `kill`) and SIGINT (Ctrl-C) as a request the loop checks after each step:
    it saves a checkpoint and returns 128 + the signal (143, 130). Installed before start-up (a request
    then stops the run before its first step) and once per process (`installed`: a pipeline's stages
    share the pipeline's, so no later stage starts); the handlers before it come back when it ends.

    After the first signal, SIGINT has its default action again: a second Ctrl-C ends the process at
    once, even inside a compile, without a traceback (a shell shows 130); a save it cuts short is
    never a checkpoint (orbax commits a step by renaming it at the end)."""

    _active: _StopRequest | None = None
    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal: int | None = None

    @property
    def raised(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        return EXIT_SIGINT if self.signal == signal.SIGINT else EXIT_SIGTERM

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name

    @classmethod
    @contextlib.contextmanager
    def installed(cls):
        if cls._active is not None:
            yield cls._active
            return
        request = cls()
        previous = {sig: signal.signal(sig, request._received) for sig in cls._SIGNALS}
        cls._active = request
        try:
            yield request
        finally:
            cls._active = None
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _received(self, signum, _frame) -> None:
        if self.raised:
            return
        self.signal = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        again = " again" if signum == signal.SIGINT else ""
        # os.write, not print or log: the handler may run in the middle of either's own write
        os.write(
            sys.stderr.fileno(),
            f"unitrain: {self.name}: stopping after the step in flight (or start-up) with a checkpoint of it; "
            f"Ctrl-C{again} stops at once without one\n".encode(),
        )


class _Throughput:
    """A step's figures from its time: tokens/s and MFU (SFT: every position of the batch counts),
    and with an invocation's first step the MFU denominator it used, so runs can be compared."""

    def __init__(self, cfg, model, num_devices: int, tokens_per_step: int | None):
        self.tokens_per_step, self.num_devices = tokens_per_step, num_devices
        self.first = {}
        if tokens_per_step:
            self.flops_per_token = model.flops_per_token(cfg.max_target_length)
            self.peak = metrics.peak_flops_per_device(cfg)
            self.first = {"peak_flops_per_device": self.peak}
            log.info(
                "MFU = model FLOP/s per device (%.3g FLOP per token) / %.3g FLOP/s: %s",
                self.flops_per_token,
                self.peak,
                metrics.describe_peak(cfg),
            )

    def __call__(self, step_time: float) -> dict:
        figures, self.first = {"step_time": step_time, **self.first}, {}
        if self.tokens_per_step:
            figures["tokens_per_sec"] = self.tokens_per_step / step_time
            figures["mfu"] = metrics.mfu(figures["tokens_per_sec"], self.flops_per_token, self.peak, self.num_devices)
        return figures


def _ready_at(outputs: dict) -> float:
    """When a step's outputs were ready, noted on the step clock's thread. A failed step fails where
    the loop fetches its outputs, not here."""
    with contextlib.suppress(Exception):
        jax.block_until_ready([x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)])
    return time.perf_counter()


class _Pending:
    """The metrics of the step in flight: written one step late, so the host never waits for the
    device in the loop, or flushed before an eval or a checkpoint, so that a checkpoint never covers a
    step whose line is not on disk.

    A step's time runs from when the device could start it (the step before completed, or an eval or
    checkpoint ended, whichever is last) to its own completion, which a thread (the step clock) notes
    as it happens; the loop waits for a step only to fetch its metrics, a step later. The times of a
    run's steps add up to its wall time less start-up, evals and checkpoints.
    """

    def __init__(self, writer, throughput):
        self.writer, self.throughput = writer, throughput
        self.entry: tuple[int, dict, Future] | None = None
        self.free_at = time.perf_counter()
        self.clock = ThreadPoolExecutor(1, thread_name_prefix="unitrain-step-clock")  # one: in step order

    def push(self, step: int, step_metrics: dict) -> int | None:
        """Holds this step and writes the one before (returns its number, or None)."""
        held = (step, step_metrics, self.clock.submit(_ready_at, step_metrics))
        written = self.flush()
        self.entry = held
        return written

    def flush(self) -> int | None:
        if self.entry is None:
            return None
        (step, step_metrics, ready), self.entry = self.entry, None
        values = _fetch(step, step_metrics)
        completed = ready.result()
        step_time, self.free_at = completed - self.free_at, max(self.free_at, completed)
        self.writer.write(step, {**values, **self.throughput(max(step_time, 1e-9))})
        return step

    def idle(self) -> None:
        """Work that is no step's (eval, checkpoint) ended now."""
        self.free_at = time.perf_counter()

    def close(self) -> None:
        self.clock.shutdown(wait=False, cancel_futures=True)


class _KnownGood:
    """The newest checkpoint known good: one whose weights gave a finite loss (the loss of step s
    is computed from the weights saved as checkpoint s, before step s's update)."""

    def __init__(self, checkpointer, start: int):
        self.checkpointer, self.step = checkpointer, None
        self.unverified = {start} if start else set()  # saved, their loss not seen yet

    def saved(self, step: int) -> None:
        self.unverified.add(step)

    def finite(self, step: int | None) -> None:
        """The loss of `step` was finite."""
        if step in self.unverified:
            self.unverified.discard(step)
            self.step = step
            self.checkpointer.keep(step)

    def set_aside_bad(self) -> str:
        """After a non-finite loss: moves the unverified checkpoints aside, so that a resumed run
        starts from the known good one; says which that is."""
        self.checkpointer.wait()
        self.checkpointer.set_aside(sorted(self.unverified))
        if self.step is not None:
            return f"the newest checkpoint whose weights gave a finite loss is step {self.step}; a rerun resumes there"
        latest = self.checkpointer.latest_step()
        return (
            f"no checkpoint of this run is known good; a rerun resumes from step {latest}"
            if latest
            else "no checkpoint is left; a rerun starts over"
        )


def loop(run: RunContext, task: Task, state: dict, start: int, checkpointer, writer, stop: _StopRequest) -> int:
    """The shared loop. Metrics of step s are written while step s+1 runs (no host sync for them)."""
    cfg = run.cfg
    throughput = _Throughput(cfg, run.model, run.mesh.size, task.tokens_per_step)
    profiler, pending, good = (
        metrics.Profiler.from_config(cfg),
        _Pending(writer, throughput),
        _KnownGood(checkpointer, start),
    )
    try:
        for step in range(start, cfg.steps):
            profiler.maybe_start(step)
            state, step_metrics = task.step(state, step)
            compile_cache.report(f"step {step + 1}")
            profiler.maybe_stop(step, block_on=step_metrics)
            good.finite(pending.push(step, step_metrics))
            done = step + 1
            evaluate = cfg.eval_interval and (done % cfg.eval_interval == 0 or done == cfg.steps)
            if evaluate:  # its result follows the step's line, and a non-finite loss stops it
                good.finite(pending.flush())
            if evaluate and (eval_metrics := task.evaluate(state["params"], done)):
                compile_cache.report(f"eval at step {done}")
                writer.write(step, eval_metrics)
            if text := task.samples_text(step):  # after the eval: a mode may show its answers
                writer.text(step, "samples", text)
            # after the eval: a stop requested during it saves this step too
            if save := done % cfg.checkpoint_period == 0 or done == cfg.steps or stop.raised:
                good.finite(pending.flush())  # the checkpoint covers this step: its line goes first
                checkpointer.save(done, state, task.data_iterator, force=True)
                good.saved(done)
            if evaluate or save:
                pending.idle()
            if stop.raised:
                log.warning("%s: saved a checkpoint at step %d; stopping", stop.name, done)
                return stop.exit_code
        good.finite(pending.flush())
        if cfg.export_hf_path:
            export.export_hf(run, state["params"], cfg.export_hf_path)
            log.info("exported the model to %s", cfg.export_hf_path)
        return 0
    except NonFiniteLoss as e:
        log.error("stopping: %s; %s", e, good.set_aside_bad())
        return EXIT_NAN
    except RunEndedEarly:  # the step before it trained: its line is written
        good.finite(pending.flush())
        raise
    finally:
        pending.close()
        profiler.close()
        try:
            checkpointer.wait()
        finally:
            checkpointer.close()  # also after a failed save: it releases the directory's lock
            writer.close()


def _setup_logging() -> None:
    """unitrain's own handler: libraries (absl via orbax) configure the root logger their way."""
    for old in list(log.handlers):  # a second main() in one process (tests) gets today's stdout
        log.removeHandler(old)
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s unitrain: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    # orbax logs a failed save or restore from its threads; it reaches main, which says it in one line
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # orbax's failed write tasks, the same failure


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        return _help(argv)
    if not argv or "=" in argv[0]:  # no yml named: the built-in run, the shipped base.yml
        argv = [str(DEFAULT_CONFIG), *argv]
    _setup_logging()
    with _StopRequest.installed():  # first: a Ctrl-C from here on is a stop request, never a traceback
        return _run_command(argv)


def _run_command(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        distributed.maybe_initialize(cfg)  # before anything counts devices
        checks.check_config(cfg)
        if jax.process_index() != 0:  # only after jax.distributed has started
            log.setLevel(logging.WARNING)
        with run_dir.no_empty_dirs_left(cfg.run_dir):  # a command that failed early leaves no run directory
            return pipeline.run(cfg, train) if cfg.stages else train(cfg)
    except UserError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return _exit(EXIT_USER_ERROR)
    except OSError as e:  # the environment's fault (a read-only or full disk): the path and the OS reason
        print(f"unitrain: {checkpoint.reason(e)}", file=sys.stderr)
        return _exit(EXIT_USER_ERROR)
    except Exception:
        traceback.print_exc()
        return _exit(1)


def _help(argv: list[str]) -> int:
    """`--help [KEYWORD]`: the keys of the root base.yml (of the yml given first, else the shipped one)."""
    at = argv.index("--help") if "--help" in argv else argv.index("-h")
    keyword = argv[at + 1] if at + 1 < len(argv) else ""
    first = Path(argv[0]) if at > 0 and argv[0].endswith((".yml", ".yaml")) else DEFAULT_CONFIG
    try:
        keys = describe_keys(root_config(first), keyword)
    except UserError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        print(__doc__.split("\n\n")[1].strip() + "\n\n" + keys, flush=True)
    except BrokenPipeError:  # a reader that stopped early (`--help | head`) has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush finds no pipe
    return 0


def _exit(code: int) -> int:
    """A failed process of a multi-process job leaves at once: a normal exit would wait in
    jax.distributed's shutdown barrier for peers that are stuck in a collective."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _library_callback_failed(unraisable) -> None:
    """An exception Python could not raise anywhere: tensorstore's callbacks into an event loop that
    orbax already closed after a failed save. The failure itself is the run's one line; this detail
    goes to the debug log instead of a traceback on stderr."""
    log.debug("ignored in %r: %r", unraisable.object, unraisable.exc_value)


def cli() -> None:
    """The command line. A run that failed leaves without the interpreter's shutdown, where libraries
    would wait or print: orbax's save threads wait for a signal that never comes after a failed save,
    and tensorstore's event loops complain. Everything of ours is written and closed by then."""
    sys.unraisablehook = _library_callback_failed
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    cli()
