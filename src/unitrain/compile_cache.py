"""The run's one ahead-of-time compile cache (run.programs): every jitted program of the run (the
train step, eval, the RL passes, the sampler's decode programs, reward-model scoring) is compiled
through it once per signature, inside the run's mesh, and every compilation is logged (with its
memory, at debug level: the run's log file) and counted in one console line a phase (report).

    programs = CompileCache(mesh)
    state, metrics = programs("train_step", update, state, batch)     # compiled once per batch shape
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

from unitrain.errors import ConfigError

log = logging.getLogger("unitrain")


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (getattr(x, "shape", None), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves
    )


class CompileCache:
    """The run's one ahead-of-time compile cache: every jitted program (train step, eval, logprobs,
    the sampler) is lowered and compiled once per (name, static choices, argument shapes, dtypes
    and shardings), inside the run's mesh, and every compilation is logged with its time and
    memory (report() sums them up for the console). Rows are bucketed upstream, so a run compiles a bounded number of times. A program the
    compiler finds too big for the device is a one-line ConfigError (program_too_big).
    """

    def __init__(self, mesh=None):
        self.mesh = mesh
        self._compiled: dict = {}

    def __call__(
        self,
        name: str,
        jitted: Callable | None,
        *args,
        static: Any = (),
        build: Callable | None = None,
        options: dict | None = None,
    ):
        """Runs the program `name` on `args`, compiling it first if this signature is new. `build`
        (called only then) makes the jitted function when it depends on the `static` choices;
        `options` are XLA compiler options for this program alone (jax's `compiler_options`)."""
        return self.compiled(name, jitted, *args, static=static, build=build, options=options)(*args)

    def compiled(
        self,
        name: str,
        jitted: Callable | None,
        *args,
        static: Any = (),
        build: Callable | None = None,
        options: dict | None = None,
    ):
        key = (name, static, _signature(args), tuple(sorted((options or {}).items())))
        program = self._compiled.get(key)
        if program is None:
            program = self._compile(name, build() if build is not None else jitted, args, options)
            self._compiled[key] = program
        return program if self.mesh is None else _in_mesh(program, self.mesh)

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, name, jitted, args, options):
        start = time.perf_counter()
        with in_mesh(self.mesh):
            lowered = jitted.lower(*args)
            try:
                compiled = lowered.compile(compiler_options=options)
            except jax.errors.JaxRuntimeError as e:
                too_big = program_too_big(name, str(e))
                if too_big is None:
                    raise
                raise too_big from None
        seconds = time.perf_counter() - start
        detail = f"compiled {name} in {seconds:.1f} s" + (f" (XLA options {options})" if options else "")
        if (memory := compiled.memory_analysis()) is not None:
            detail += (
                f"; memory per device: arguments {memory.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
                f"{memory.output_size_in_bytes / 2**20:.1f} MiB, temporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB"
            )
        log.debug(detail)
        with _lock:
            _unreported.append((name.split(" (")[0], seconds))
        return compiled


# The programs compiled since the last report(), by any cache of the process (the samplers' and the
# reward model's compile in threads of their own): the console gets one line a phase, the log file
# every program with its memory.
_unreported: list[tuple[str, float]] = []
_lock = threading.Lock()


def report(when: str) -> None:
    """One line for the programs compiled since the last report, e.g. "step 1: compiled 3 programs
    (generate x2, logprobs) in 12.3 s"; nothing when none was."""
    with _lock:
        done = list(_unreported)
        _unreported.clear()
    if done:
        names = Counter(name for name, _ in done)
        shown = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in names.items())
        total = sum(seconds for _, seconds in done)
        log.info("%s: compiled %d program%s (%s) in %.1f s", when, len(done), "s" * (len(done) > 1), shown, total)


# XLA's words when a program does not fit the device's memory at compile time (XLA:TPU):
# "... required for HLO temporaries (476.00G) exceeds available HBM (15.75G)" and
# "... Used 22.54G of 15.48G hbm. Exceeded hbm capacity by 7.06G."; sizes in XLA's binary units.
_SIZE = r"[\d.]+[KMGT]?i?B?"
_XLA_TOO_BIG = (
    re.compile(
        rf"required for (?P<what>[\w ]+?) \((?P<need>{_SIZE})\) exceeds available (?P<mem>\w+) \((?P<have>{_SIZE})\)"
    ),
    re.compile(rf"Used (?P<need>{_SIZE}) of (?P<have>{_SIZE}) (?P<mem>\w+)\b"),
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _xla_bytes(size: str) -> int:
    """XLA's human-readable size ("15.75G", "258.0M", "0B") in bytes."""
    number = re.match(r"[\d.]+", size).group()
    return round(float(number) * _UNITS[size[len(number) :].rstrip("iB")[:1]])


def program_too_big(name: str, message: str) -> ConfigError | None:
    """The one-line error for XLA's compile-time RESOURCE_EXHAUSTED of program `name` (None for any
    other error): the bytes the program needs and the bytes the device has, and what shrinks it."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    found = next(filter(None, (pattern.search(message) for pattern in _XLA_TOO_BIG)), None)
    if found is None:
        detail = " (XLA: " + message.split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0] + ")"
    else:
        need, have = (_xla_bytes(found[k]) for k in ("need", "have"))
        what = found.groupdict().get("what") or "the whole program"
        detail = (
            f": it needs {need:,} bytes ({need / 2**30:.2f} GiB, {what}) of {found['mem']} and the device has "
            f"{have:,} bytes ({have / 2**30:.2f} GiB)"
        )
    return ConfigError(
        f"{name} does not fit the device{detail}; lower per_device_batch_size or max_target_length, "
        "set remat_policy, or shard over more devices"
    )


def in_mesh(mesh):
    """`with in_mesh(mesh):` sets the mesh for what runs inside (None: leaves the caller's)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _in_mesh(program, mesh):
    def call(*args):
        with jax.set_mesh(mesh):
            return program(*args)

    call.memory_analysis, call.cost_analysis, call.out_info = (
        program.memory_analysis,
        program.cost_analysis,
        program.out_info,
    )
    return call
