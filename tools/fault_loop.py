"""Fault loop: kill -9 a run at random moments until it finishes, then compare it with a run that
was never interrupted. Prints one JSON line: kills survived, records lost or repeated, steps whose
loss differs.

    python tools/fault_loop.py --mode sft --steps 200 --kills 10 --checkpointing async
    python tools/fault_loop.py --mode grpo --steps 40 --kills 6 --checkpointing sync

Each attempt is `python -m unitrain.train` on one CPU device with the tiny model on the built-in
task; it is killed (SIGKILL, no chance to save) after a random delay, and the next attempt resumes
from whatever checkpoint is complete. A kill that lands after the run finished counts as none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "max_target_length=32",
    "per_device_batch_size=1",
    "eval_interval=0",
    "log_period=1000",
    "peak_flops_per_device=1e12",
    "checkpoint_period=5",
]
MODES = {
    "sft": ["mode=sft", "learning_rate=1e-3"],
    "grpo": [
        "mode=grpo",
        "per_device_batch_size=8",
        "rollout_batch_size=2",
        "n_samples_per_prompt=4",
        "rollout_max_response_len=4",
        "learning_rate=1e-4",
        "reward=format",
        "format_reward_pattern=[0-9]",
    ],
}


def command(out: Path, mode: str, steps: int, checkpointing: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unitrain.train",
        str(REPO / "configs" / "base.yml"),
        f"base_output_directory={out}",
        *COMMON,
        *MODES[mode],
        f"steps={steps}",
        f"async_checkpointing={checkpointing == 'async'}",
    ]


def run(cmd: list[str], kill_after: float | None) -> int | None:
    """The exit status, or None when the process was killed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    if proc.returncode != 0:
        sys.stderr.write(err.decode()[-2000:])
    return proc.returncode


def losses(path: Path) -> tuple[dict, int]:
    """{step: loss} of a metrics.jsonl and the number of loss lines (more than steps = repeats)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [line for line in lines if "loss" in line]
    return {line["step"]: line["loss"] for line in train}, len(train)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="sft")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=10, help="kill -9 this many attempts before letting one finish")
    parser.add_argument("--checkpointing", choices=("sync", "async"), default="async")
    parser.add_argument("--min-delay", type=float, default=4.0, help="seconds after start of the earliest kill")
    parser.add_argument("--max-delay", type=float, default=20.0, help="seconds after start of the latest kill")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    with tempfile.TemporaryDirectory() as tmp:
        straight, killed = Path(tmp) / "straight", Path(tmp) / "killed"
        if run(command(straight, opts.mode, opts.steps, opts.checkpointing), None) != 0:
            return 1
        kills = attempts = 0
        status = None
        while status is None:
            attempts += 1
            delay = rng.uniform(opts.min_delay, opts.max_delay) if kills < opts.kills else None
            status = run(command(killed, opts.mode, opts.steps, opts.checkpointing), delay)
            kills += status is None
            if status not in (None, 0):
                return 1
        reference, _ = losses(straight / "default" / "metrics.jsonl")
        ours, lines = losses(killed / "default" / "metrics.jsonl")
    differ = [s for s in reference if s in ours and abs(ours[s] - reference[s]) > 1e-6 * max(1.0, abs(reference[s]))]
    print(
        json.dumps(
            {
                "mode": opts.mode,
                "checkpointing": opts.checkpointing,
                "steps": opts.steps,
                "kills_survived": kills,
                "attempts": attempts,
                "records_lost": len(set(reference) - set(ours)),
                "records_repeated": lines - len(ours),
                "steps_whose_loss_differs": len(differ),
                "first_differing_steps": differ[:5],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
