"""tools/bench.py as a user runs it: a subprocess on the 8 simulated devices conftest.py sets up."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from unitrain import metrics
from unitrain import model as model_lib
from unitrain.config import load_config

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["model_name=tiny", "per_device_batch_size=2", "max_target_length=32", "matmul_peak_size=128"]


def run_bench(*args):
    return subprocess.run([sys.executable, str(REPO / "tools" / "bench.py"), *args], cwd=REPO, env=os.environ,
                          capture_output=True, text=True, timeout=300)


def test_bench_tiny_prints_json_with_mfu(tmp_path):
    out_file = tmp_path / "bench.json"
    proc = run_bench("configs/base.yml", *OVERRIDES, "--steps", "2", "--warmup", "1", "--out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == result
    for key in ("tokens_per_sec", "mfu", "matmul_peak_flops_per_device", "step_time_median"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["step_time_min"] <= result["step_time_median"] <= result["step_time_max"]
    cfg = load_config(["configs/base.yml", *OVERRIDES])
    expected = metrics.train_flops_per_token(model_lib.ModelConfig.from_config(cfg), 32)
    assert result["model_flops_per_token"] == expected
    assert result["config"]["num_devices"] == 8 and result["config"]["global_batch_rows"] == 16
    assert result["num_params"] > 0


def test_bench_bad_key_is_exit_2_with_one_line():
    proc = run_bench("configs/base.yml", "model_name=tiny", "emb_dimm=64")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench: unknown config key 'emb_dimm'"), proc.stderr
