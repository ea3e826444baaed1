"""tools/same_metrics.py: runs that logged the same metrics agree, a changed value or a missing line
is reported, and wall-time figures are left out."""

import json

from same_metrics import main


def write(root, name, rows):
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_same_metrics_tells_equal_runs_from_changed_ones(tmp_path, capsys):
    rows = [{"step": 0, "loss": 1.5, "time_rollout": 3.0, "rollout_tokens_per_sec": 9.0}, {"step": 1, "loss": 1.25}]
    write(tmp_path / "a", "grpo", rows)
    write(tmp_path / "b", "grpo", [{**rows[0], "time_rollout": 4.0, "rollout_tokens_per_sec": 7.0}, rows[1]])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0  # only the wall-time figures differ
    write(tmp_path / "c", "grpo", [rows[0], {"step": 1, "loss": 1.2500001}])
    assert main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "line 1 loss: 1.25 -> 1.2500001" in capsys.readouterr().out
    write(tmp_path / "d", "grpo", rows[:1])
    assert main([str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    assert "2 lines -> 1" in capsys.readouterr().out
