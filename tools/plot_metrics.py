"""Plot a run's metrics.jsonl: one subplot per key against step, saved as a PNG.

    python tools/plot_metrics.py runs/<name> [--out curves.png] [--keys loss,learning_rate]

Without --keys every numeric key in the file is plotted; --out defaults to <run dir>/curves.png.
A missing run directory or metrics file, or an unknown key, prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # half a line from a killed run
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def plot(rows: list[dict], keys: list[str], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = sorted((r["step"], r[key]) for r in rows if _is_number(r.get(key)))
        ax.plot([s for s, _ in points], [v for _, v in points], linewidth=1)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        values = [v for _, v in points if math.isfinite(v)]
        if key in ("loss", "learning_rate") and values and min(values) > 0 and max(values) / min(values) > 100:
            ax.set_yscale("log")  # losses and schedules spanning decades read better on a log axis
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run_dir>/curves.png)")
    parser.add_argument("--keys", help="comma-separated keys to plot (default: every numeric key)")
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"plot_metrics: {message}", file=sys.stderr)
        return 2

    if not args.run_dir.is_dir():
        return fail(f"no run directory {args.run_dir}")
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        return fail(f"no metrics file {path}")
    rows = read_metrics(path)
    available = list(dict.fromkeys(k for r in rows for k, v in r.items() if k != "step" and _is_number(v)))
    if not available:
        return fail(f"{path} holds no numeric metrics")
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else available
    if unknown := [k for k in keys if k not in available]:
        return fail(f"unknown key '{unknown[0]}' in --keys; {path} has: {', '.join(available)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("matplotlib is not installed; pip install matplotlib")
    out = args.out or args.run_dir / "curves.png"
    plot(rows, keys, out)
    print(f"wrote {out} ({len(keys)} keys, {len(rows)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
