"""Plot a run's metrics.jsonl as a PNG: a dashboard of grouped panels, or the metrics named, one panel each.

    python tools/plot_metrics.py runs/<name> [-o curves.png] [--smoothing 0.6]
    python tools/plot_metrics.py runs/<name> loss learning_rate [-o curves.png]
    python tools/plot_metrics.py runs/<pipeline> grpo/rm/score_mean grpo/reward_exact_match_mean

The dashboard's panels: loss (train and eval overlaid), reward (GRPO, DPO), eval (accuracy, pass@k),
throughput (tokens/s, s/step), optimizer (grad norm, learning rate) and policy (GRPO entropy, response
length); a panel without data is left out. Dense train series are drawn raw (faint) and smoothed (an
exponential moving average, weight --smoothing, stated in the picture); sparse ones (evals) as points
joined by lines. Metrics that never change and exact copies of another metric are left out (named
under the picture). Metrics named on the command line get a panel each, in that order. A `stages:`
pipeline's run directory (its pipeline.yml) holds no metrics of its own: its stages' are named
`<stage>/<metric>`.
-o defaults to <run dir>/curves.png. A missing run directory or metrics file, or an unknown metric
(the line lists the known ones), prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import yaml


class Panel(NamedTuple):
    title: str
    left: tuple[str, ...]  # regexes (full match) of the keys on the left axis, drawn in this order
    right: tuple[str, ...] = ()  # keys on a right axis of their own scale
    robust: bool = False  # clip the y range to the bulk of the data (timings spike at compiles and evals)


PANELS = (
    Panel("loss", ("loss", "eval_loss", "nll", "eval_nll")),
    Panel("reward", ("reward_mean", r"reward_.+_mean", r"(eval_)?rewards/(chosen|rejected|margin)")),
    Panel("eval", ("eval_accuracy", r"eval_pass_at_\d+", r"(eval_)?rewards/accuracy")),
    Panel("throughput", ("tokens_per_sec", "rollout_tokens_per_sec"), right=("step_time",), robust=True),
    Panel("optimizer", ("grad_norm",), right=("learning_rate",)),
    Panel("policy", ("entropy",), right=("response_length_mean",)),
)
SCHEDULES = {"learning_rate"}  # set by the config, not measured: never smoothed
SPARSE_POINTS = 30  # a series with at most this many points (or a fifth of the densest) is drawn with markers


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


def stage_dirs(run_dir: Path) -> list[Path]:
    """The stage directories with metrics of a `stages:` pipeline's run directory (the one holding
    its pipeline.yml), in the order that lists them; [] for any other directory."""
    recipe = run_dir / "pipeline.yml"
    if not recipe.is_file():
        return []
    names = [stage["name"] for stage in yaml.safe_load(recipe.read_text()).get("stages", [])]
    return [run_dir / name for name in names if (run_dir / name / "metrics.jsonl").is_file()]


def run_series(run_dir: Path) -> tuple[dict[str, list[tuple[float, float]]], int]:
    """(series, lines read) of a run directory: its metrics.jsonl's, or a pipeline's stages' with
    each key prefixed by its stage's name ("grpo/reward_mean")."""
    stages = stage_dirs(run_dir)
    if not stages:
        rows = read_metrics(run_dir / "metrics.jsonl")
        return series(rows), len(rows)
    data, lines = {}, 0
    for stage in stages:
        rows = read_metrics(stage / "metrics.jsonl")
        data.update({f"{stage.name}/{key}": values for key, values in series(rows).items()})
        lines += len(rows)
    return data, lines


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def series(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{key: [(step, value), ...]} of every numeric key, by step, finite values only."""
    out: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and _is_number(value) and math.isfinite(value):
                out.setdefault(key, []).append((row["step"], float(value)))
    return {k: sorted(v) for k, v in out.items()}


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so it starts at the data."""
    out, last = [], 0.0
    for i, v in enumerate(values):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** (i + 1)))
    return out


def rolling_median(values: list[float], weight: float) -> list[float]:
    """A centred running median as wide as the moving average's reach, (1 + w) / (1 - w) points: it
    follows the level of a series with spikes (compiles, evals, checkpoints) without echoing them."""
    half = round((1 + weight) / (1 - weight)) // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def dashboard(data: dict[str, list]) -> tuple[list[tuple[Panel, list[str], list[str]]], list[str]]:
    """The panels that have data, each with its left and right keys, and the keys left out as
    constant or as a copy of an earlier key ("name=value" / "name=other")."""
    kept, left_out, seen = [], [], {}
    for panel in PANELS:
        sides = []
        for patterns in (panel.left, panel.right):
            keys = []
            for key in [k for p in patterns for k in sorted(data) if re.fullmatch(p, k)]:
                values = tuple(v for _, v in data[key])
                if len(set(values)) == 1:
                    left_out.append(f"{key}={values[0]:g}")
                elif (copy := seen.get(tuple(data[key]))) is not None:
                    left_out.append(f"{key}={copy}")
                else:
                    seen[tuple(data[key])] = key
                    keys.append(key)
            sides.append(keys)
        if sides[0] or sides[1]:
            kept.append((panel, *sides))
    return kept, left_out


def _draw(ax, data: dict, keys: list[str], smoother, densest: int, colors, linestyle="-") -> dict:
    """Sparse series as points joined by lines; dense ones raw (faint) under `smoother(values)`.
    Returns {key: (steps, the values of its labelled line)}: what the picture shows of each key."""
    drawn = {}
    for key in keys:
        steps, values = zip(*data[key])
        color = next(colors)
        if len(steps) <= max(SPARSE_POINTS, densest // 5):
            ax.plot(steps, values, linestyle, marker="o", markersize=4, color=color, label=key)
        elif key in SCHEDULES:
            ax.plot(steps, values, linestyle, color=color, linewidth=1.6, label=key)
        else:
            ax.plot(steps, values, linestyle, color=color, alpha=0.25, linewidth=0.8)
            values = smoother(list(values))
            ax.plot(steps, values, linestyle, color=color, linewidth=1.6, label=key)
        drawn[key] = (list(steps), list(values))
    return drawn


def _robust_ylim(ax, data: dict, keys: list[str], smoother) -> None:
    """The y range of the smoothed (spike-free) series, widened by half: a compile's first step or an
    eval's would otherwise flatten the rest."""
    values = [v for k in keys if len(data[k]) > SPARSE_POINTS for v in smoother([v for _, v in data[k]])]
    if values:
        lo, hi = min(values), max(values)
        pad = 0.5 * (hi - lo) or 0.1 * abs(hi) or 1.0
        ax.set_ylim(max(lo - pad, 0) if lo >= 0 else lo - pad, hi + pad)  # rates and times are never negative


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    _pyplot().close(fig)


def plot_dashboard(data: dict, panels: list, left_out: list[str], out: Path, title: str, smoothing: float) -> None:
    """Writes the dashboard PNG of `panels` (from `dashboard`)."""
    plt = _pyplot()
    import matplotlib.ticker

    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.6 * rows), squeeze=False)
    densest = max(len(v) for v in data.values())
    for ax, (panel, left, right) in zip(axes.flat, panels):
        colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
        smoother = functools.partial(rolling_median if panel.robust else smooth, weight=smoothing)
        _draw(ax, data, left, smoother, densest, colors)
        handles, labels = ax.get_legend_handles_labels()
        if panel.robust:
            _robust_ylim(ax, data, left, smoother)
        values = [v for k in left for _, v in data[k]]
        if panel.title == "loss" and min(values, default=0) > 0 and max(values) / min(values) > 5:
            ax.set_yscale("log")  # a loss that falls several-fold: its later progress stays visible
            for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 2, 3, not 2 x 10^0
        if right:
            twin = ax.twinx()
            _draw(twin, data, right, smoother, densest, colors, linestyle="--")
            if panel.robust:
                _robust_ylim(twin, data, right, smoother)
            more_handles, more_labels = twin.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + [f"{l} (right)" for l in more_labels]
        ax.set_title(panel.title, loc="left", fontweight="bold")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(handles, labels, fontsize=8, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}; {_smoothing_note(smoothing)}", fontsize=11)
    if left_out:
        fig.text(0.01, 0.005, "left out (constant or a copy): " + ", ".join(left_out), fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.03 if left_out else 0, 1, 1))
    _save(fig, out)


def plot_keys(data: dict, keys: list[str], out: Path, smoothing: float, title: str) -> dict:
    """One panel per key, in the order given; returns {key: (steps, values drawn)} (`_draw`). Sparse
    is judged against the densest key drawn: a pipeline's other stages (a long mode=rm stage) may
    have many more steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.4 * len(keys) + 0.5), squeeze=False)
    densest = max(len(data[k]) for k in keys)
    drawn = {}
    for ax, key in zip(axes[:, 0], keys):
        colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
        drawn.update(_draw(ax, data, [key], functools.partial(smooth, weight=smoothing), densest, colors))
        ax.set_ylabel(key, fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{title}; {_smoothing_note(smoothing)}", fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    return drawn


def _smoothing_note(weight: float) -> str:
    reach = (1 + weight) / (1 - weight)  # the number of points an EMA of this weight averages over, in effect
    return f"faint: raw, bold: moving average of weight {weight:g} (about {reach:.0f} steps)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl (or a pipeline's stages)")
    parser.add_argument("metrics", nargs="*", help="metrics to plot, one panel each (default: the dashboard)")
    parser.add_argument("-o", "--out", type=Path, help="PNG to write (default: <run_dir>/curves.png)")
    parser.add_argument(
        "--smoothing", type=float, default=0.6, help="moving-average weight in [0, 1) (default 0.6, as TensorBoard)"
    )
    args = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"plot_metrics: {message}", file=sys.stderr)
        return 2

    run = args.run_dir
    if not run.is_dir():
        return fail(f"no run directory {run}")
    stages = stage_dirs(run)
    if not stages and not (run / "metrics.jsonl").is_file():
        return fail(f"no metrics file {run / 'metrics.jsonl'}")
    if not 0 <= args.smoothing < 1:
        return fail(f"--smoothing must be in [0, 1), got {args.smoothing}")
    data, lines = run_series(run)
    if not data:
        return fail(f"{run} holds no numeric metrics")
    if unknown := [k for k in args.metrics if k not in data]:
        return fail(f"unknown metric '{unknown[0]}'; {run} has: {', '.join(data)}")
    if stages and not args.metrics:
        return fail(
            f"{run} is a pipeline of stages {', '.join(s.name for s in stages)}: name metrics as <stage>/<metric> "
            f"({', '.join(data)}), or plot a stage's dashboard ({run / stages[-1].name})"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("matplotlib is not installed; pip install 'unitrain[plot]'")
    out = args.out or run / "curves.png"
    if args.metrics:
        plot_keys(data, args.metrics, out, args.smoothing, f"{run.name}: {lines} lines")
        print(f"wrote {out} ({len(args.metrics)} metrics, {lines} lines)")
        return 0
    panels, left_out = dashboard(data)
    if not panels:
        return fail(f"{run} has none of the dashboard's metrics; name some ({', '.join(data)})")
    last = max(int(step) for values in data.values() for step, _ in values)
    plot_dashboard(data, panels, left_out, out, f"{run.name}: {lines} lines, steps 0..{last}", args.smoothing)
    print(f"wrote {out} (panels: {', '.join(panel.title for panel, _, _ in panels)})")
    shown = {k for _, left, right in panels for k in left + right}
    if others := [k for k in data if k not in shown and not any(entry.startswith(f"{k}=") for entry in left_out)]:
        print(f"not in the dashboard (name them to plot them): {', '.join(others)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
