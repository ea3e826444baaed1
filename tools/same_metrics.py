"""Whether two sets of runs logged the same metrics: each run directory's metrics.jsonl in A against
the one of the same name in B, line by line and key by key, exact, leaving out the wall-time figures
(times, rates, MFU, the measured peak). A refactor that must not change behaviour shows it this way
(tools/fixed_runs.sh makes the runs).

    python tools/same_metrics.py runs_before/ runs_after/     # exit 0: all the same; 1: differences listed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOLATILE = ("time_", "_per_sec", "step_time", "mfu", "peak_flops", "eta")


def lines(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not any(part in k for part in VOLATILE)}
        for line in path.read_text().splitlines()
    ]


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two metrics.jsonl files: a line each, empty when they agree."""
    x, y = lines(a), lines(b)
    out = [f"{len(x)} lines -> {len(y)}"] if len(x) != len(y) else []
    for i, (p, q) in enumerate(zip(x, y)):
        out += [f"line {i} {k}: {p.get(k)} -> {q.get(k)}" for k in sorted(set(p) | set(q)) if p.get(k) != q.get(k)]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    same = True
    for path in sorted(args.before.glob("*/metrics.jsonl")):
        other = args.after / path.parent.name / "metrics.jsonl"
        found = differences(path, other) if other.exists() else ["missing"]
        status = "identical" if not found else f"{len(found)} differences"
        print(f"{path.parent.name}: {status}", *(f"  {line}" for line in found[:8]), sep="\n")
        same &= not found
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
