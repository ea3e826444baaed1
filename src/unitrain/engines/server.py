"""An inference engine's server process (vLLM's of `sampler: vllm`, SGLang's of `sampler: sglang`):
started on 127.0.0.1 from the engine's own interpreter, watched, and ended with everything it started.

    server = Server("vLLM", command, log_path, env, leftover)   # command: the engine's, with --port
    server.wait_ready(timeout, "vllm_startup_timeout")  # EngineError with its log's end if it never comes up
    server.alive(); server.tail()       # is it running; the last lines of its log
    server.stop()                       # the whole process group, within seconds

An engine runs several processes (vLLM: the API server, its engine core, workers; SGLang: the HTTP
server, its tokenizer manager, scheduler and detokenizer). They are started under a supervisor,
this file run as a script by the trainer's interpreter (it imports nothing heavy): it leads a
process group of its own, and ends the whole group when the trainer stops it, when the server
exits, or when the trainer is gone (a `kill -9` of the trainer re-parents the supervisor, which it
sees within half a second). A trainer gone that way also leaves `leftover` behind (vLLM's
shared-memory weights, engines/vllm_weights.py): the supervisor removes it.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from unitrain.errors import UserError

STOP_GRACE_SECONDS = 15  # SIGTERM to the group, then SIGKILL
SUPERVISOR_NOTICE_SECONDS = 2.0  # a server's supervisor sees its child's end within 0.5 s
START_HEADER = "==== unitrain:"  # the log line before each start's output
# A line that raises: "ValueError: ...", or vLLM's "(Worker pid=1) ERROR 11-26 05:34:01 [file.py:1] ValueError: ..."
ERROR_LINE = re.compile(r"^(\([^)]*\) ERROR [^\]]*\] )?[A-Z]\w*(Error|Exception): ")


class EngineError(UserError):
    """The inference engine failed (never came up, died, kept failing requests, refused a reload)."""


class Server:
    """One engine's HTTP server (`command`, which names its --port) under its supervisor; its output
    goes to `log_path` (appended). `engine` names it in errors."""

    def __init__(self, engine: str, command: list[str], log_path: str, env: dict, leftover: str = ""):
        self.engine, self.log_path = engine, log_path
        self.port = int(command[command.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)  # a tool's sampler runs before the run's
        with open(log_path, "a") as log:
            log.write(f"\n{START_HEADER} {' '.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(os.getpid()), leftover, *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() ends everything in it
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self) -> str:
        return log_tail(self.log_path)

    def wait_ready(self, timeout: float, timeout_key: str) -> None:
        """Returns once /health answers; EngineError if the server exits or `timeout` s (the config's
        `timeout_key`) pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(
                    f"the {self.engine} server exited while starting (status {self.process.returncode}); "
                    f"the end of {self.log_path}: {self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise EngineError(
            f"the {self.engine} server did not come up within {timeout_key}={timeout:g} s; "
            f"the end of {self.log_path}: {self.tail()}"
        )

    def stop_unanswering(self) -> str:
        """Stops a server that stopped answering: -> "died" if it had exited by itself (its supervisor
        sees its child's end within half a second), else "stopped answering"."""
        try:
            self.process.wait(SUPERVISOR_NOTICE_SECONDS)
            how = "died"
        except subprocess.TimeoutExpired:
            how = "stopped answering"
        self.stop()
        return how

    def stop(self) -> None:
        """Ends the server's whole process group (the supervisor does it; SIGKILL if it cannot)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_SECONDS + 5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # what is left of the group, if anything
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def interrupt_refused(c, sampler: str, engine: str) -> str | None:
    """The config check of `<sampler>_interrupt`: it aborts the rows in flight at a weight update,
    and there are some only with that sampler sampling rollouts ahead (max_staleness)."""
    if c[f"{sampler}_interrupt"] and (c["sampler"] != sampler or not c["max_staleness"]):
        return (
            f"{sampler}_interrupt aborts the {engine} rows in flight at a weight update; there are some only with "
            f"sampler {sampler} and max_staleness >= 1 (sampler {c['sampler']}, max_staleness {c['max_staleness']})"
        )
    return None


def log_tail(path: str, lines: int = 4) -> str:
    """The first error line of the server's last start in the log at `path` (a traceback's root
    cause) and the log's last lines, joined with ' | ' (for a one-line error)."""
    first_error, last = None, collections.deque(maxlen=lines)
    try:
        with open(path, errors="replace") as f:
            for line in filter(None, map(str.strip, f)):
                if line.startswith(START_HEADER):
                    first_error = None
                elif first_error is None and ERROR_LINE.search(line):
                    first_error = line[:500]
                last.append(line[:300])
    except OSError as e:
        return f"(its log {path} is unreadable: {e.strerror})"
    head = [first_error, "..."] if first_error and first_error[:300] not in last else []
    return " | ".join([*head, *last])


def supervise(trainer_pid: int, leftover: str, command: list[str]) -> int:
    """The supervisor: runs `command`, and ends the process group when asked to (SIGTERM, SIGINT), when
    the command exits, or when the trainer `trainer_pid` is no longer its parent (then it removes the
    folder `leftover` too, if one is named: the trainer cannot)."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    child = subprocess.Popen(command)
    while child.poll() is None and not stopping and os.getppid() == trainer_pid:
        time.sleep(0.5)
    if leftover and os.getppid() != trainer_pid:
        shutil.rmtree(leftover, ignore_errors=True)
    if child.poll() is None:
        child.terminate()
        os.killpg(0, signal.SIGTERM)  # the engine's other processes too (this process ignores it)
        try:
            child.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    for pid in group_members(os.getpgid(0)):  # whatever is left, so that the status is the server's
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return child.wait() if child.poll() is not None else -signal.SIGKILL


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (Linux: from /proc)."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(pid))
    return members


if __name__ == "__main__":
    sys.exit(supervise(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
