"""Run logs: metrics.jsonl + TensorBoard scalars/text (+ W&B, wandb_sink.py), the progress line, MFU (the model counts its own FLOPs), profiling.

The text TensorBoard gets (sampled completions, eval answers) also goes to samples.txt beside
metrics.jsonl, each under a `==== step N: tag` line, so it can be read without TensorBoard.

Only the primary process (jax.process_index() == 0) writes anything; the others accept the same calls
and do nothing, so the training loop needs no `if primary:` branches.

MFU (the project's rule) = achieved model FLOP/s per device / the FLOP/s that `jnp.dot` reaches on the
same machine at the run's start (`measure_matmul_peak`), unless `peak_flops_per_device` gives a number.
The measured peak moves with the machine's load (12x on a shared CPU), so each invocation records the
one it used (`peak_flops_per_device` in metrics.jsonl, with its first step) and the progress line names it.

A progress line reports the interval since the previous line: s/step is the steps' mean time, tokens/s
the steps' tokens over their summed time, MFU that rate's; evals and checkpoints are no step's time
(train.py times the steps), the first line's interval includes compilation.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# TensorBoard tags allow only these characters and rewrite any other to "_" on their own.
_UNSAFE_IN_TAG = re.compile(r"[^-/\w.]")


def _primary(is_primary: bool | None) -> bool:
    return jax.process_index() == 0 if is_primary is None else is_primary


def metric_name(key: str) -> str:
    """The one name of a metric in every sink: what TensorBoard would make of it (e.g. a reward plugin's
    `reward_pkg.mod:fn_mean` -> `reward_pkg.mod_fn_mean`), so metrics.jsonl, TensorBoard and W&B agree."""
    return _UNSAFE_IN_TAG.sub("_", key)


class MetricsWriter:
    """Writes one JSON line and TensorBoard scalars per step, and a progress line every `log_period`.

    Steps are 0-based (the last one is total_steps - 1) in metrics.jsonl and TensorBoard; what a person
    reads (progress lines, samples.txt) counts the steps done, as checkpoints do: step s's line says
    step s + 1. `resume_step` (pass the step the run starts
    at, 0 for a fresh run) drops the lines of steps >= resume_step from an existing metrics.jsonl, so
    a run resumed from an older checkpoint does not log those steps twice; TensorBoard hides them via
    purge_step.
    """

    def __init__(
        self,
        metrics_file: str | os.PathLike,
        tensorboard_dir: str | os.PathLike,
        total_steps: int,
        log_period: int = 1,
        *,
        is_primary: bool | None = None,
        resume_step: int | None = None,
        wandb=None,
    ):
        self.total_steps, self.log_period = total_steps, log_period
        self.is_primary = _primary(is_primary)
        self._file = self._tb = None
        self._wandb = wandb  # a wandb_sink.WandbSink, or None
        self._interval, self._first_line = _Interval(), True
        self._peak = None  # the MFU denominator, from the metric peak_flops_per_device
        self._flat = (0, 0)  # (GRPO steps, those whose groups all had zero reward spread) since that line
        if not self.is_primary:
            return
        path = Path(metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and path.exists():
            _keep_steps_before(path, resume_step)
        self._samples = path.with_name("samples.txt")
        if resume_step is not None and self._samples.exists():
            _keep_samples_before(self._samples, resume_step)
        broken = _ends_mid_line(path)
        self._file = open(path, "a")
        if broken:
            self._file.write("\n")  # a run killed mid-write left half a line; don't glue the next one to it
        from tensorboardX import SummaryWriter  # here: non-primary processes never need it

        self._tb = SummaryWriter(str(tensorboard_dir), purge_step=resume_step, flush_secs=30)

    @classmethod
    def from_config(
        cls, cfg, total_steps: int, *, is_primary: bool | None = None, resume_step: int | None = None
    ) -> MetricsWriter:
        wandb = None
        if cfg.wandb_project and _primary(is_primary):
            from unitrain.wandb_sink import WandbSink  # here: runs without W&B never import it

            wandb = WandbSink(cfg)
        return cls(
            cfg.metrics_file,
            cfg.tensorboard_dir,
            total_steps,
            cfg.log_period,
            is_primary=is_primary,
            resume_step=resume_step,
            wandb=wandb,
        )

    def write(self, step: int, scalars: dict) -> None:
        """Logs `scalars` (python/numpy/jax numbers) for `step`; prints a progress line when it is due."""
        if not self.is_primary:
            return
        step = int(step)
        # int stays int, jax scalars -> python
        values = {metric_name(k): np.asarray(v).item() for k, v in scalars.items()}
        self._interval.add(values)
        self._peak = values.get("peak_flops_per_device", self._peak)
        if "zero_std_group_fraction" in values:  # GRPO: 1.0 = every advantage 0, nothing learnt...
            # ...unless a teacher's per-token KL is in them (distillation)
            flat = values["zero_std_group_fraction"] == 1.0 and "distill/teacher_kl" not in values
            self._flat = (self._flat[0] + 1, self._flat[1] + flat)
        try:
            self._file.write(json.dumps({"step": step, **values}) + "\n")
            self._file.flush()  # a killed run keeps every line written so far
        except OSError as e:  # a full disk: name the file
            raise OSError(e.errno, e.strerror, self._file.name) from None
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(step, values)
        is_eval = any(k.startswith("eval_") for k in values)  # evals are rare: always shown
        if step % self.log_period == 0 or step == self.total_steps - 1 or is_eval:
            print(self._progress_line(step, values), flush=True)
            self._tb.flush()

    def _progress_line(self, step: int, v: dict) -> str:
        if "step_time" in v:  # a training step's line: its interval's figures, not the step's alone
            v = {**v, **self._interval.figures()}
        parts = [f"step {step + 1}/{self.total_steps}"]
        if "loss" in v:
            parts.append(f"loss {v['loss']:.4f}")
        if "reward_mean" in v:  # grpo
            parts.append(f"reward {v['reward_mean']:.3f}")
        if "learning_rate" in v:
            parts.append(f"lr {v['learning_rate']:.1e}")
        if "tokens_per_sec" in v:
            parts.append(f"{_si(v['tokens_per_sec'])} tok/s")
        if "mfu" in v:
            of = f" of {_si(self._peak)}FLOP/s" if self._peak else ""  # per device
            parts.append(f"MFU {100 * v['mfu']:.1f}%{of}")  # mfu is logged as a fraction
        if "step_time" in v:
            parts.append(f"{v['step_time']:.2f} s/step")
        if evals := _eval_parts(v):
            return " | ".join([*parts, "eval " + ", ".join(evals)])
        if self._flat[1]:
            parts.append(f"{self._flat[1]} of {self._flat[0]} steps trained on nothing (no reward spread in any group)")
        self._flat = (0, 0)
        # ETA from the step times since the previous progress line: data loading is in them, evals,
        # checkpoints and the first line's interval (compilation) are not.
        if self._interval.steps and not self._first_line:
            per_step, remaining = self._interval.seconds / self._interval.steps, max(0, self.total_steps - 1 - step)
            parts.append(f"ETA {datetime.timedelta(seconds=round(per_step * remaining))}")
        self._interval, self._first_line = _Interval(), False
        return " | ".join(parts)

    def text(self, step: int, tag: str, text: str) -> None:
        """A TensorBoard text summary (and a W&B panel, and a block of samples.txt), e.g. sampled completions."""
        if self.is_primary:
            self._tb.add_text(tag, text, int(step))
            with open(self._samples, "a") as f:
                f.write(f"==== step {int(step) + 1}: {tag}\n{text.rstrip()}\n\n")
        if self._wandb is not None:
            self._wandb.text(step, tag, text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_EVAL_NAMES = {"eval_episode_success_rate": "success rate"}  # the console's words where the key's read badly


def _eval_parts(v: dict) -> list[str]:
    """The eval_* metrics, compactly and in the order given: "loss 1.2346", "accuracy 45.3%",
    "pass@4 60.0%", "hr@10 0.0870", "rewards/margin 0.1234" (rates and accuracies as percentages).
    Of the episodes' breakdown (turns, tool calls, ends) only the success rate: the rest is in
    metrics.jsonl and TensorBoard."""
    parts = []
    for key, value in v.items():
        if key.startswith("eval_") and (not key.startswith("eval_episode_") or key == "eval_episode_success_rate"):
            name = _EVAL_NAMES.get(key, key.removeprefix("eval_").replace("_at_", "@"))
            percent = name.startswith("pass@") or name.endswith(("accuracy", "rate"))
            parts.append(f"{name} {100 * value:.1f}%" if percent else f"{name} {_number(value)}")
    return parts


def _number(x: float) -> str:
    """4 decimals as the loss shows them; 3 significant digits where those would hide the value."""
    return f"{x:.4f}" if x == 0 or 1e-3 <= abs(x) < 1e5 else f"{x:.3g}"


class _Interval:
    """The training steps since the previous progress line: their number, their summed step_time and
    each rate's amount (rate x step_time: tokens for tokens/s), so the line's rate is amount / time."""

    RATES = ("tokens_per_sec", "mfu")

    def __init__(self):
        self.steps, self.seconds, self.amounts = 0, 0.0, {}

    def add(self, values: dict) -> None:
        if "step_time" not in values:
            return
        self.steps += 1
        self.seconds += values["step_time"]
        for key in self.RATES:
            if key in values:
                self.amounts[key] = self.amounts.get(key, 0.0) + values[key] * values["step_time"]

    def figures(self) -> dict:
        """s/step, tokens/s and MFU of the interval (nothing before its first step)."""
        if not self.steps:
            return {}
        return {"step_time": self.seconds / self.steps, **{k: a / self.seconds for k, a in self.amounts.items()}}


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.1f}"


def _ends_mid_line(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _keep_steps_before(path: Path, resume_step: int) -> None:
    """Rewrites `path` with only the lines of steps < resume_step; atomic, so a crash here loses nothing."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < resume_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # half a line from a killed run
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


_SAMPLES_HEADER = re.compile(r"^==== step (\d+): ", re.M)


def _keep_samples_before(path: Path, resume_step: int) -> None:
    """Rewrites samples.txt without the blocks of steps >= resume_step, whose headers say steps done
    (step + 1) (atomic, as _keep_steps_before)."""
    text = path.read_text()
    later = next((m.start() for m in _SAMPLES_HEADER.finditer(text) if int(m.group(1)) > resume_step), len(text))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text[:later])
    os.replace(tmp, path)


# ---------------------------------------------------------------- MFU


def append_eval(path: str, step: int, source: str, results: dict) -> None:
    """One line of an eval-only run (action=eval) in its own file: metrics.jsonl stays the training record."""
    if jax.process_index() != 0:
        return
    line = {
        "step": int(step),
        "parameters": source,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        **{k: np.asarray(v).item() for k, v in results.items()},
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation as a fraction. tokens_per_sec is global and counts every position of the
    batch (padding included: it is computed like any other token)."""
    return tokens_per_sec * flops_per_token / (peak_flops_per_device * num_devices)


def measure_matmul_peak(dtype: str = "float32", n: int = 2048, iters: int = 10) -> float:
    """FLOP/s that a jitted n x n `jnp.dot` reaches on one device of this machine now.

    The MFU denominator: measured, not a datasheet number, so MFU is comparable across machines where
    the achievable matmul rate is what bounds a training step.
    """
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (n, n), dtype)
    b = jax.random.normal(key_b, (n, n), dtype)
    return 2 * n**3 / _seconds_per_call(jax.jit(jnp.dot), (a, b), iters)


def measure_memory_bandwidth(nbytes: int = 2**29, iters: int = 10) -> float:
    """Bytes/s that a jitted sum over an `nbytes` float32 array reads on one device of this machine
    now: the denominator of the sampler's decode bandwidth fraction, measured like the matmul peak
    rather than taken from a datasheet."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    return x.nbytes / _seconds_per_call(jax.jit(jnp.sum), (x,), iters)


def _seconds_per_call(fn, args, iters: int) -> float:
    """Median over 3 rounds of the mean time of `iters` calls queued back to back: on an accelerator
    one blocked call also times the dispatch and the wait (tens of microseconds), which is a large
    part of a millisecond kernel."""
    for _ in range(2):  # compile, then one more to settle clocks and caches
        fn(*args).block_until_ready()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        results = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(results)
        rounds.append((time.perf_counter() - start) / iters)
    return statistics.median(rounds)


def peak_flops_per_device(cfg) -> float:
    """cfg.peak_flops_per_device if set, else the jnp.dot rate measured now in the compute dtype."""
    if cfg.peak_flops_per_device is not None:
        return float(cfg.peak_flops_per_device)
    return measure_matmul_peak(cfg.dtype, cfg.matmul_peak_size)


def describe_peak(cfg) -> str:
    """What peak_flops_per_device(cfg) is, for the run's log."""
    if cfg.peak_flops_per_device is not None:
        return "peak_flops_per_device, as set"
    n = cfg.matmul_peak_size
    return (
        f"what a {n}x{n} {cfg.dtype} jnp.dot reached on one device just now; it moves with the machine's "
        "load, so set peak_flops_per_device (e.g. the datasheet peak) to compare runs"
    )


# ---------------------------------------------------------------- profiler


class Profiler:
    """An xplane trace of steps [start_step, start_step + num_steps), written where TensorBoard's profile
    tab looks: <tensorboard_dir>/plugins/profile/<timestamp>/<host>.xplane.pb. Primary process only.

    In the loop: `profiler.maybe_start(step)` before the step, `profiler.maybe_stop(step, outputs)`
    after it; `outputs` are waited for, otherwise the trace would stop before the device finished.
    """

    def __init__(
        self,
        tensorboard_dir: str | os.PathLike,
        mode: str = "",
        start_step: int = 0,
        num_steps: int = 1,
        *,
        is_primary: bool | None = None,
    ):
        if mode not in ("", "xplane"):
            raise ValueError(f"profiler mode '{mode}' is not one of '' | xplane")
        self.tensorboard_dir, self.start_step, self.num_steps = str(tensorboard_dir), start_step, num_steps
        self.enabled = mode == "xplane" and _primary(is_primary)
        self.active = self._done = False

    @classmethod
    def from_config(cls, cfg, *, is_primary: bool | None = None) -> Profiler:
        return cls(
            cfg.tensorboard_dir, cfg.profiler, cfg.profiler_start_step, cfg.profiler_steps, is_primary=is_primary
        )

    def maybe_start(self, step: int) -> None:
        # A window test, not step == start_step: a run resumed inside the window still gets a trace.
        if (
            self.enabled
            and not self.active
            and not self._done
            and self.start_step <= step < self.start_step + self.num_steps
        ):
            jax.profiler.start_trace(self.tensorboard_dir)
            self.active = True

    def maybe_stop(self, step: int, block_on=None) -> None:
        if self.active and step >= self.start_step + self.num_steps - 1:
            self.close(block_on)

    def close(self, block_on=None) -> None:
        """Ends a trace still running (a run that stops inside the window)."""
        if self.active:
            jax.block_until_ready(block_on)
            jax.profiler.stop_trace()
            self.active, self._done = False, True
