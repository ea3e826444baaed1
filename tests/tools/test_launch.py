"""tools/launch/local.py: real 2-process jax.distributed runs on 127.0.0.1 (gloo CPU collectives)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "tools" / "launch"))

from local import child_env, exit_code, launch  # noqa: E402

# A stand-in for unitrain.train: reads the three distributed keys from argv key=values, initializes,
# gathers each process index across processes, prints one JSON line. fail_process=i makes i exit 3
# right after initialize (os._exit, like a crash: sys.exit would first wait up to shutdown_timeout_seconds
# in jax.distributed's atexit shutdown barrier for the peers), while the others block in the gather.
PROBE = textwrap.dedent("""
    import json, os, sys
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    kv = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(kv["coordinator_address"], int(kv["num_processes"]), int(kv["process_id"]))
    if int(kv.get("fail_process", -1)) == jax.process_index():
        print("failing on purpose", flush=True)
        os._exit(3)
    gathered = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
    print("RESULT " + json.dumps(dict(
        index=jax.process_index(), count=jax.process_count(), devices=jax.device_count(),
        local=len(jax.local_devices()), gathered=[int(x) for x in gathered.reshape(-1)])), flush=True)
""")


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "launch_probe.py").write_text(PROBE)
    return dict(module="launch_probe", env={"PYTHONPATH": str(tmp_path)})


def result_line(output: str) -> dict:
    # stdout and stderr share one pipe: native (gloo) log text may share the JSON's line.
    found = [line[line.index("RESULT ") + len("RESULT ") :] for line in output.splitlines() if "RESULT " in line]
    assert len(found) == 1, output
    return json.JSONDecoder().raw_decode(found[0])[0]


def test_two_processes_four_devices_each_gather(probe, capsys):
    results = launch(["some/config.yml", "x=1"], processes=2, devices_per_process=4, timeout=120, **probe)
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    assert exit_code(results) == 0
    for i, r in enumerate(results):
        assert r.args[-5:] == ["some/config.yml", "x=1", r.args[-3], "num_processes=2", f"process_id={i}"]
        assert r.args[-3].startswith("coordinator_address=127.0.0.1:")
        assert result_line(r.output) == dict(index=i, count=2, devices=8, local=4, gathered=[0, 1])
    printed = capsys.readouterr().out.splitlines()
    for i in (0, 1):  # each echoed line carries its process's prefix (native log text may share it)
        assert any(line.startswith(f"[p{i}] ") and "RESULT " in line for line in printed)


def test_one_child_fails_the_other_is_killed(probe):
    start = time.monotonic()
    results = launch(["fail_process=1"], processes=2, devices_per_process=4, timeout=120, grace=2, echo=False, **probe)
    assert time.monotonic() - start < 60
    assert results[1].returncode == 3 and results[1].killed is None
    assert "failing on purpose" in results[1].output
    assert results[0].killed == "peer_failed" and results[0].returncode != 0
    assert exit_code(results) == 3


def test_timeout_kills_all_and_is_124(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    results = launch(
        [],
        processes=2,
        devices_per_process=1,
        timeout=1.0,
        grace=1,
        echo=False,
        module="sleeper",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert [r.killed for r in results] == ["timeout", "timeout"]
    assert all(r.returncode < 0 for r in results)
    assert exit_code(results) == 124


def test_child_env_replaces_device_count_and_binds_locally():
    env = child_env(4, 1234, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"})
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"


def test_command_line_prefixes_lines_and_returns_first_failure(tmp_path):
    (tmp_path / "echoer.py").write_text(
        textwrap.dedent("""
        import sys
        kv = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
        print("hello", kv["process_id"], "of", kv["num_processes"], flush=True)
        sys.exit(int(kv.get("code", 0)) if kv["process_id"] == "1" else 0)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cmd = [
        sys.executable,
        str(REPO / "tools" / "launch" / "local.py"),
        "-n",
        "2",
        "-d",
        "1",
        "--module",
        "echoer",
        "--",
    ]
    ok = subprocess.run([*cmd, "code=0"], env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == ["[p0] hello 0 of 2", "[p1] hello 1 of 2"]
    bad = subprocess.run([*cmd, "code=5"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 5
    assert "launch: exit 5" in bad.stderr


TRAPPER = textwrap.dedent("""
    import signal, sys, time
    def on_term(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    print("up", flush=True)
    time.sleep(60)
""")


def signal_state(pid: int) -> str:
    """State and signal masks of `pid` and its children from /proc: what a hung forwarding test shows."""
    lines = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            lines.append(signal_state(int(child)))
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    keep = [
        line
        for line in status
        if line.split(":")[0] in ("Name", "State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    ]
    return f"pid {pid}: " + "; ".join(keep) + "".join("\n" + line for line in lines)


def test_sigterm_is_forwarded_to_every_child(tmp_path):
    (tmp_path / "trapper.py").write_text(TRAPPER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "launch" / "local.py"), "-n", "2", "-d", "1", "--module", "trapper"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    seen = set()
    while len(seen) < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended before both children were up"
        if line.strip().endswith("up"):
            seen.add(line.split()[0])
    proc.send_signal(signal.SIGTERM)
    try:
        rest, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        state = signal_state(proc.pid)
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            os.killpg(int(child), signal.SIGKILL)
        proc.kill()
        pytest.fail(f"a child did not end 30 s after the SIGTERM:\n{state}")
    assert sorted(line for line in rest.splitlines() if "SIGTERM" in line) == ["[p0] got SIGTERM", "[p1] got SIGTERM"]
    assert proc.returncode == 7


def test_a_signal_during_start_up_reaches_the_children_started_after_it(tmp_path, monkeypatch):
    """The SIGTERM comes right after the first child is started: the second, started after it, gets it
    too (ends by it, or by its handler if that is installed by then) instead of running on."""
    import local

    (tmp_path / "trapper.py").write_text(TRAPPER)
    started, popen = [], subprocess.Popen

    def popen_then_sigterm(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return started[-1]

    monkeypatch.setattr(local.subprocess, "Popen", popen_then_sigterm)
    results = launch(
        [],
        processes=2,
        devices_per_process=1,
        timeout=30,
        grace=1,
        echo=False,
        module="trapper",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert [r.killed for r in results] == [None, None], [r.output for r in results]
    assert all(r.returncode in (7, -signal.SIGTERM) for r in results), [r.returncode for r in results]


def test_a_second_sigint_kills_children_that_outlive_the_first(tmp_path):
    """Children that ignore SIGINT (e.g. busy saving) are SIGKILLed by a second Ctrl-C."""
    (tmp_path / "stubborn.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    )

    class InterruptTwiceWhenUp:
        up = 0

        def write(self, line):
            self.up += line.strip().endswith("up")
            if self.up == 2:
                self.up += 1
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # two signals at once are one to Python's handler, like a double key press
                os.kill(os.getpid(), signal.SIGINT)

        def flush(self):
            pass

    start = time.monotonic()
    results = launch(
        [],
        processes=2,
        devices_per_process=1,
        timeout=30,
        echo=InterruptTwiceWhenUp(),
        module="stubborn",
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert time.monotonic() - start < 25
    assert [(r.returncode, r.killed) for r in results] == [(-signal.SIGKILL, None)] * 2
