"""tools/plot_metrics.py: the dashboard, the metrics named one panel each (a single run's or a `stages:`
pipeline's as <stage>/<metric>), the smoothing drawn, and one line with exit 2 for bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO

pytest.importorskip("matplotlib")


def write_metrics(run, rows) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def ema(values, weight):
    """TensorBoard's debiased moving average as its weighted sum: the reference for the drawn lines."""
    return [
        sum(weight ** (i - j) * (1 - weight) * values[j] for j in range(i + 1)) / (1 - weight ** (i + 1))
        for i in range(len(values))
    ]


def test_plot_metrics(tmp_path, capsys):
    from plot_metrics import main

    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 3.0 / (s + 1), "learning_rate": 1e-3 * s}) for s in range(20)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 20, "lo')
    out = tmp_path / "curves.png"
    assert main([str(run), "loss", "learning_rate", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(run)]) == 0 and (run / "curves.png").is_file()
    capsys.readouterr()
    assert main([str(run), "loss", "los"]) == 2
    assert capsys.readouterr().err.strip() == f"plot_metrics: unknown metric 'los'; {run} has: loss, learning_rate"
    assert main([str(tmp_path)]) == 2  # a directory without metrics.jsonl
    assert capsys.readouterr().err.strip() == f"plot_metrics: no metrics file {tmp_path / 'metrics.jsonl'}"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools/plot_metrics.py"), str(tmp_path / "missing"), "loss"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"plot_metrics: no run directory {tmp_path / 'missing'}"
    assert main([str(run), "--smoothing", "1"]) == 2
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "pg_clipfrac": 0.1}) + "\n")
    capsys.readouterr()
    assert (
        main([str(run)]) == 2 and "none of the dashboard's metrics; name some (pg_clipfrac)" in capsys.readouterr().err
    )


def pipeline_run(tmp_path, steps=60):
    """A fabricated `stages:` run directory: sft and grpo stages with metrics, pipeline.yml naming them
    (grpo first, to show its order is the one kept), and a stage that never wrote metrics. The sft
    stage has many more steps than grpo's (as a mode=rm stage has): grpo's series are still dense."""
    rng = np.random.default_rng(0)
    run = tmp_path / "pipe"
    write_metrics(run / "sft", [{"step": s, "loss": 2.0 - s / 1000} for s in range(400)])
    grpo = [
        {
            "step": s,
            "rm/score_mean": s / steps + 0.2 * rng.standard_normal(),
            "reward_exact_match_mean": 0.3 + 0.5 * s / steps + 0.1 * rng.standard_normal(),
        }
        for s in range(steps)
    ]
    write_metrics(run / "grpo", grpo + [{"step": s, "eval_accuracy": s / steps} for s in (19, 39, 59)])
    (run / "export").mkdir()
    (run / "pipeline.yml").write_text("stages:\n- {name: grpo}\n- {name: sft}\n- {name: export}\n")
    return run, grpo


def test_a_pipelines_stages_are_read_as_stage_slash_metric(tmp_path):
    from plot_metrics import run_series, stage_dirs

    run, grpo = pipeline_run(tmp_path)
    assert stage_dirs(run) == [run / "grpo", run / "sft"]  # pipeline.yml's order; export wrote no metrics
    assert stage_dirs(run / "grpo") == []  # a stage is a run of its own
    data, lines = run_series(run)
    assert lines == 400 + 60 + 3
    assert list(data) == [
        "grpo/rm/score_mean",
        "grpo/reward_exact_match_mean",
        "grpo/eval_accuracy",
        "sft/loss",
    ]
    assert data["grpo/rm/score_mean"] == [(r["step"], r["rm/score_mean"]) for r in grpo]


def test_the_named_metrics_are_drawn_smoothed_or_as_points(tmp_path, capsys):
    import matplotlib.image

    from plot_metrics import main, plot_keys, run_series

    run, grpo = pipeline_run(tmp_path)
    data, _ = run_series(run)
    keys = ["grpo/rm/score_mean", "grpo/reward_exact_match_mean", "grpo/eval_accuracy"]
    drawn = plot_keys(data, keys, tmp_path / "out.png", 0.8, "pipe")
    steps = list(range(60))
    for key, metric in zip(keys, ["rm/score_mean", "reward_exact_match_mean"]):
        assert drawn[key][0] == steps
        np.testing.assert_allclose(drawn[key][1], ema([r[metric] for r in grpo], 0.8), rtol=1e-12)
    assert drawn["grpo/eval_accuracy"] == ([19, 39, 59], [19 / 60, 39 / 60, 59 / 60])  # sparse: as measured
    # Three panels of 8 x 2.4 inches plus the title's half inch, at 100 dpi.
    assert matplotlib.image.imread(tmp_path / "out.png").shape[:2] == (770, 800)

    assert main([str(run), *keys, "-o", str(tmp_path / "cli.png"), "--smoothing", "0.8"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'cli.png'} (3 metrics, 463 lines)"


def test_a_pipelines_bad_input_is_one_line(tmp_path, capsys):
    from plot_metrics import main

    run, _ = pipeline_run(tmp_path)
    known = "grpo/rm/score_mean, grpo/reward_exact_match_mean, grpo/eval_accuracy, sft/loss"
    assert main([str(run), "rm/score_mean"]) == 2  # a stage's metric needs its stage's name
    assert capsys.readouterr().err.strip() == f"plot_metrics: unknown metric 'rm/score_mean'; {run} has: {known}"
    assert main([str(run)]) == 2  # no dashboard of several runs at once
    assert capsys.readouterr().err.strip() == (
        f"plot_metrics: {run} is a pipeline of stages grpo, sft: name metrics as <stage>/<metric> ({known}), "
        f"or plot a stage's dashboard ({run / 'sft'})"
    )
    assert not (run / "curves.png").exists()


def grpo_like_rows(steps=200, eval_every=50):
    """Metrics lines shaped like a GRPO run's: noisy train series, sparse evals, a copy and a constant."""
    rng = np.random.default_rng(0)
    rows = []
    for s in range(steps):
        reward = min(1.0, s / steps + 0.1 * rng.standard_normal())
        rows.append(
            {
                "step": s,
                "loss": 0.1 * rng.standard_normal(),
                "reward_mean": reward,
                "reward_exact_match_mean": reward,
                "response_length_mean": 4,
                "entropy": 2 - s / steps,
                "grad_norm": 1 + rng.random(),
                "learning_rate": 1e-5,
                "step_time": 0.1 + (s % eval_every == 0),
                "rollout_tokens_per_sec": 1000 * (1 + 0.1 * rng.random()),
                "pg_clipfrac": 0.01,
            }
        )
        if (s + 1) % eval_every == 0:
            rows.append({"step": s, "eval_accuracy": s / steps, "eval_pass_at_4": min(1.0, 2 * s / steps)})
    return rows


def test_dashboard_groups_panels_and_leaves_out_constants_and_copies(tmp_path, capsys):
    import matplotlib.image

    from plot_metrics import dashboard, main, series

    panels, left_out = dashboard(series(grpo_like_rows()))
    assert [(p.title, left, right) for p, left, right in panels] == [
        ("loss", ["loss"], []),
        ("reward", ["reward_mean"], []),
        ("eval", ["eval_accuracy", "eval_pass_at_4"], []),
        ("throughput", ["rollout_tokens_per_sec"], ["step_time"]),
        ("optimizer", ["grad_norm"], []),
        ("policy", ["entropy"], []),
    ]
    assert left_out == ["reward_exact_match_mean=reward_mean", "learning_rate=1e-05", "response_length_mean=4"]

    run = tmp_path / "run"
    write_metrics(run, grpo_like_rows())
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {run / 'curves.png'} (panels: loss, reward, eval, throughput, optimizer, policy)",
        "not in the dashboard (name them to plot them): pg_clipfrac",
    ]
    # Six panels in two columns of 7 x 3.6 inches at 100 dpi.
    assert matplotlib.image.imread(run / "curves.png").shape[:2] == (1080, 1400)


def test_dashboard_draws_smoothed_dense_and_marked_sparse_series():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plot_metrics import _draw, rolling_median, series, smooth

    rng = np.random.default_rng(1)
    values = list(rng.standard_normal(100))
    w = 0.6  # references: the moving average's weighted sum, and numpy's median per window
    np.testing.assert_allclose(smooth(values, w), ema(values, w), rtol=1e-12)
    np.testing.assert_allclose(
        rolling_median(values, w), [np.median(values[max(0, i - 2) : i + 3]) for i in range(100)]
    )

    data = series(grpo_like_rows())
    fig, ax = plt.subplots()
    drawn = _draw(ax, data, ["loss", "eval_accuracy", "learning_rate"], lambda v: smooth(v, w), 200, iter("rgb"))
    raw, smoothed, evals, schedule = ax.get_lines()
    assert raw.get_alpha() == 0.25 and smoothed.get_label() == "loss"
    np.testing.assert_allclose(smoothed.get_ydata(), smooth([v for _, v in data["loss"]], w))
    np.testing.assert_allclose(drawn["loss"][1], smoothed.get_ydata())
    assert evals.get_marker() == "o" and list(evals.get_xdata()) == [49, 99, 149, 199]
    assert schedule.get_label() == "learning_rate" and schedule.get_alpha() is None  # a schedule is never smoothed
    plt.close(fig)
