"""Run a multi-process (multi-host) JAX job on this one machine, on CPU: N processes x D simulated devices.

    python tools/launch/local.py --processes 2 --devices-per-process 4 -- configs/base.yml steps=4
    python tools/launch/local.py -n 2 -d 4 --port 12355 --timeout 600 -- configs/base.yml key=value ...

Process i runs `python -m unitrain.train <args> coordinator_address=127.0.0.1:<port> num_processes=N
process_id=i` (another module with `--module pkg.mod`) with `JAX_PLATFORMS=cpu` and
`XLA_FLAGS=--xla_force_host_platform_device_count=D`, so the job sees N processes and N*D devices and
talks through a real `jax.distributed` coordinator (unitrain turns on gloo CPU collectives itself). The
coordinator binds to 127.0.0.1 only (`JAX_COORDINATOR_BIND_ADDRESS`). Every output line is prefixed
with `[p<i>]`. SIGINT/SIGTERM are forwarded to all processes (a second SIGINT kills them). The exit
status is the first non-zero child status (the others are then killed), 124 on --timeout, else 0.

Importable: `launch(args, processes, devices_per_process, ...)` returns one `ProcessResult` per process
(`returncode`, `output`) and `exit_code(results)` gives the status the command line would exit with.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
HOST = "127.0.0.1"


@dataclasses.dataclass
class ProcessResult:
    """What one child did; shaped like subprocess.CompletedProcess (`args`, `returncode`, `stdout`)."""

    process_id: int
    args: list[str]
    returncode: int
    output: str  # stdout and stderr interleaved, without the [p<i>] prefixes ("" if not kept)
    killed: str | None = None  # why the launcher killed it: "peer_failed" | "timeout" | None
    end_time: float = 0.0  # time.monotonic() when its exit was noticed

    @property
    def stdout(self) -> str:
        return self.output


def free_port(host: str = HOST) -> int:
    """A TCP port that nothing listens on right now (the OS picks it; a tiny race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def with_device_count(xla_flags: str, devices: int) -> str:
    """`xla_flags` with the CPU device count forced to `devices` (any earlier
    --xla_force_host_platform_device_count, e.g. the 8 of the test suite, is replaced)."""
    flags = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices}"])


def child_env(devices_per_process: int, port: int, env: dict | None = None) -> dict[str, str]:
    """os.environ + env, its XLA flags `with_device_count(devices_per_process)`."""
    merged = {**os.environ, **(env or {})}
    merged["XLA_FLAGS"] = with_device_count(merged.get("XLA_FLAGS", ""), devices_per_process)
    if "JAX_PLATFORMS" not in (env or {}):
        merged["JAX_PLATFORMS"] = "cpu"
    merged["JAX_COORDINATOR_BIND_ADDRESS"] = f"{HOST}:{port}"  # not [::]: keep the coordinator local
    merged["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, not at exit
    return {k: str(v) for k, v in merged.items()}


def child_command(module: str, args: list[str], processes: int, process_id: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        module,
        *args,
        f"coordinator_address={HOST}:{port}",
        f"num_processes={processes}",
        f"process_id={process_id}",
    ]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send sig to the child's process group (it leads its own session), so its own children get it too."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(i: int, stream, sink, keep: list[str] | None, lock: threading.Lock) -> None:
    prefix = f"[p{i}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        if keep is not None:
            keep.append(line)
        if sink is not None:
            with lock:
                sink.write(prefix + line)
                sink.flush()
    stream.close()


def launch(
    args: list[str],
    processes: int,
    devices_per_process: int,
    port: int = 0,
    timeout: float | None = None,
    module: str = "unitrain.train",
    env: dict | None = None,
    *,
    echo=True,
    keep_output: bool = True,
    grace: float = 5.0,
) -> list[ProcessResult]:
    """Start `processes` copies of `python -m module args... coordinator_address=127.0.0.1:<port>
    num_processes=N process_id=i` and wait for them.

    port 0 picks a free port. echo: True prints the prefixed lines to sys.stdout, a file object prints
    them there, False prints nothing. When a child exits non-zero the others get SIGTERM, and SIGKILL
    after `grace` seconds; the same on timeout. Called from the main thread, SIGINT/SIGTERM received
    meanwhile are forwarded to every child (a second SIGINT sends SIGKILL), also those started after
    the signal came, and the launcher then waits for all of them (still bounded by timeout). Returns
    one ProcessResult per process, in process_id order.
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError("processes and devices_per_process must be >= 1")
    if port == 0:
        port = free_port()
    elif not port_is_free(port):
        raise OSError(f"port {port} on {HOST} is already in use; pick another or use --port 0")
    sink = sys.stdout if echo is True else (echo or None)
    environment = child_env(devices_per_process, port, env)
    lock = threading.Lock()
    commands = [child_command(module, list(args), processes, i, port) for i in range(processes)]
    procs: list[subprocess.Popen] = []
    outputs: list[list[str] | None] = []
    pumps: list[threading.Thread] = []
    ended: dict[int, float] = {}
    killed: dict[int, str] = {}
    # The handler only records: the wait loop forwards, so no Popen call runs inside a handler that
    # may have interrupted one on the same child, and a signal that came during the start-up reaches
    # the children started after it too.
    signals_seen: list[int] = []
    forwarded = 0
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: signals_seen.append(signum))
    try:
        for i, cmd in enumerate(commands):
            proc = subprocess.Popen(
                cmd,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs.append(proc)
            keep: list[str] | None = [] if keep_output else None
            outputs.append(keep)
            t = threading.Thread(target=_pump, args=(i, proc.stdout, sink, keep, lock), daemon=True)
            t.start()
            pumps.append(t)

        deadline = None if timeout is None else time.monotonic() + timeout
        stop_reason = None
        while len(ended) < len(procs):
            while forwarded < len(signals_seen):
                forwarded += 1
                _forward(procs, signals_seen[:forwarded])
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic()
                    # After a forwarded SIGINT/SIGTERM every child is already stopping (e.g. saving a
                    # checkpoint): let them finish instead of signalling them a second time.
                    if p.returncode != 0 and stop_reason is None and not signals_seen:
                        stop_reason = "peer_failed"
            if stop_reason is None and deadline is not None and time.monotonic() > deadline:
                stop_reason = "timeout"
            if stop_reason is not None:
                _stop(procs, ended, killed, stop_reason, grace)
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # an exception above (or a KeyboardInterrupt when not in main) leaves no orphans
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for t in pumps:
        t.join(timeout=5)
    return [
        ProcessResult(
            i, commands[i], p.returncode, "".join(outputs[i] or []), killed.get(i), ended.get(i, time.monotonic())
        )
        for i, p in enumerate(procs)
    ]


def _forward(procs, signals: list[int]) -> None:
    """Send the last of `signals` to every child still running; SIGKILL for a second SIGINT."""
    signum = signals[-1]
    hard = signum == signal.SIGINT and signals.count(signal.SIGINT) > 1
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL if hard else signum)


def _stop(procs, ended, killed, reason, grace):
    """SIGTERM every child still running, SIGKILL those still alive after `grace` seconds."""
    alive = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in alive:
        killed[i] = reason
        _signal_group(procs[i], signal.SIGTERM)
    end = time.monotonic() + grace
    for i in alive:
        try:
            procs[i].wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(procs[i], signal.SIGKILL)
            procs[i].wait()
    for i in range(len(procs)):
        if i not in ended:
            ended[i] = time.monotonic()


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128+N, like a shell


def exit_code(results: list[ProcessResult]) -> int:
    """The first non-zero status of a child the launcher did not kill itself; 124 after a timeout; else 0."""
    failed = sorted((r for r in results if r.returncode != 0 and r.killed is None), key=lambda r: r.end_time)
    if failed:
        return _status(failed[0].returncode)
    if any(r.killed == "timeout" for r in results):
        return 124
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, rest = argv[:split], argv[split + 1 :]
    else:
        own, rest = argv, []
    parser = argparse.ArgumentParser(
        prog="tools/launch/local.py",
        description="Run N local processes of a multi-host JAX job on CPU (args after -- go to the module).",
        allow_abbrev=False,
    )
    parser.add_argument("-n", "--processes", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument(
        "-d", "--devices-per-process", type=int, default=4, help="simulated CPU devices per process (default 4)"
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument("--module", default="unitrain.train", help="module to run (default unitrain.train)")
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping the others (default 5)",
    )
    opts, unknown = parser.parse_known_args(own)
    rest = unknown + rest  # `local.py configs/base.yml steps=2` without -- works too
    if opts.processes < 1 or opts.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    try:
        results = launch(
            rest,
            opts.processes,
            opts.devices_per_process,
            port=opts.port,
            timeout=opts.timeout,
            module=opts.module,
            keep_output=False,
            grace=opts.grace,
        )
    except OSError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    code = exit_code(results)
    if code != 0:
        parts = [f"p{r.process_id}: {r.returncode}" + (f" (killed: {r.killed})" if r.killed else "") for r in results]
        print(f"launch: exit {code}; " + ", ".join(parts), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
