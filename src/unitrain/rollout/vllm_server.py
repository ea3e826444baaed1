"""The vLLM server process of `sampler: vllm` (rollout/vllm.py): started on 127.0.0.1 from the engine's
own interpreter, watched, and ended with everything it started.

    server = Server(python, model_path, server_args, log_path)
    server.wait_ready(timeout)          # EngineError with the last lines of its log if it never comes up
    server.alive(); server.tail()       # is it running; the last lines of its log
    server.stop()                       # the whole process group, within seconds

vLLM runs several processes (the API server, its engine core, workers). They are started under a
supervisor, this file run as a script by the trainer's interpreter (it imports nothing heavy): it
leads a process group of its own, and ends the whole group when the trainer stops it, when the
server exits, or when the trainer is gone (a `kill -9` of the trainer re-parents the supervisor,
which it sees within half a second).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from unitrain.errors import UserError

STOP_GRACE_SECONDS = 15  # SIGTERM to the group, then SIGKILL


class EngineError(UserError):
    """The inference engine failed (never came up, died, kept failing requests, refused a reload)."""


class Server:
    """One vLLM OpenAI-compatible server under its supervisor; its output goes to `log_path` (appended)."""

    def __init__(self, python: str, server_args: list[str], log_path: str, env: dict):
        self.log_path, self.port = log_path, int(server_args[server_args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        command = [python, "-m", "vllm.entrypoints.openai.api_server", *server_args]
        with open(log_path, "a") as log:
            log.write(f"\n==== unitrain: {' '.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(os.getpid()), *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() ends everything in it
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 6) -> str:
        """The last lines of the server's log, joined with ' | ' (for a one-line error)."""
        try:
            with open(self.log_path, errors="replace") as f:
                last = collections.deque((line.strip() for line in f if line.strip()), maxlen=lines)
        except OSError as e:
            return f"(its log {self.log_path} is unreadable: {e.strerror})"
        return " | ".join(last)

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


def supervise(trainer_pid: int, command: list[str]) -> int:
    """The supervisor: runs `command`, and ends the process group when asked to (SIGTERM, SIGINT), when
    the command exits, or when the trainer `trainer_pid` is no longer its parent."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    child = subprocess.Popen(command)
    while child.poll() is None and not stopping and os.getppid() == trainer_pid:
        time.sleep(0.5)
    if child.poll() is None:
        child.terminate()
        os.killpg(0, signal.SIGTERM)  # vLLM's engine core and workers too (this process ignores it)
        try:
            child.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    code = child.wait() if child.poll() is not None else -signal.SIGKILL
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # whatever is left, this supervisor last
    return code


if __name__ == "__main__":
    sys.exit(supervise(int(sys.argv[1]), sys.argv[2:]))
