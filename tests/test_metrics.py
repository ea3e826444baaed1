"""metrics.py: jsonl + TensorBoard writing, rank-0 gating, resume, progress line, FLOPs, peak, profiler;
tools/plot_metrics.py."""
import json
import math
import struct
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from unitrain import metrics
from unitrain.models import decoder as model
from unitrain.config import load_config

REPO = Path(__file__).resolve().parents[1]


def read_events(tb_dir: Path) -> list:
    """Every Event in the tfevents files under tb_dir, read by hand: TFRecord framing is
    uint64 length, uint32 crc, payload, uint32 crc (tensorboardX ships the proto but no reader)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            events.append(Event.FromString(data[i + 12:i + 12 + length]))
            i += 12 + length + 4
    return events


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_jsonl_and_tensorboard(tmp_path):
    cfg = load_config([str(REPO / "configs/base.yml"), f"base_output_directory={tmp_path}", "run_name=r"])
    with metrics.MetricsWriter.from_config(cfg, total_steps=3, is_primary=True) as w:
        for step in range(3):
            w.write(step, {"loss": jnp.float32(2.0 - step), "num_truncated": 7})
        w.text(2, "samples", "1+1=2")
    rows = read_jsonl(Path(cfg.metrics_file))
    assert rows == [{"step": s, "loss": 2.0 - s, "num_truncated": 7} for s in range(3)]
    events = read_events(Path(cfg.tensorboard_dir))
    scalars = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value if v.tag == "loss"}
    assert scalars == {(s, "loss"): 2.0 - s for s in range(3)}
    texts = [v.tensor.string_val[0] for e in events for v in e.summary.value if v.tag.startswith("samples")]
    assert texts == [b"1+1=2"]


def test_non_primary_writes_nothing(tmp_path):
    w = metrics.MetricsWriter(tmp_path / "run/metrics.jsonl", tmp_path / "run/tb", 5, 1, is_primary=False,
                              resume_step=0)
    w.write(0, {"loss": 1.0})
    w.text(0, "samples", "x")
    w.close()
    p = metrics.Profiler(tmp_path / "run/tb", "xplane", 0, 1, is_primary=False)
    p.maybe_start(0)
    p.maybe_stop(0)
    assert list(tmp_path.iterdir()) == []


def test_resume_drops_later_steps_and_appends(tmp_path):
    file, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    with metrics.MetricsWriter(file, tb, 10, 100, is_primary=True) as w:
        for step in range(8):
            w.write(step, {"loss": 1.0})
    with open(file, "a") as f:
        f.write('{"step": 8, "lo')  # killed mid-line
    with metrics.MetricsWriter(file, tb, 10, 100, is_primary=True, resume_step=5) as w:
        w.write(5, {"loss": 0.5})
    assert [r["step"] for r in read_jsonl(file)] == [0, 1, 2, 3, 4, 5]
    assert read_jsonl(file)[-1]["loss"] == 0.5
    # Without resume_step the file is appended to as is; a torn last line must not swallow the next.
    with open(file, "a") as f:
        f.write('{"step": 6, "lo')
    with metrics.MetricsWriter(file, tb, 10, 100, is_primary=True) as w:
        w.write(7, {"loss": 0.25})
    assert json.loads(file.read_text().splitlines()[-1]) == {"step": 7, "loss": 0.25}


def test_progress_line_every_log_period_with_eta(tmp_path, capsys, monkeypatch):
    now = [0.0]  # a fake clock: each step takes one second
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    scalars = {"loss": 1.23456, "learning_rate": 3e-4, "tokens_per_sec": 12345.0, "mfu": 0.031,
               "step_time": 0.2111, "grad_norm": 5.0}
    with metrics.MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb", 6, 2, is_primary=True) as w:
        for step in range(6):
            now[0] = float(step)
            w.write(step, scalars if step else {"loss": 2.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0/6 | loss 2.0000"  # no ETA yet: nothing measured
    body = "loss 1.2346 | lr 3.0e-04 | 12.3k tok/s | MFU 3.1% | 0.21 s/step"
    assert lines[1:] == [f"step 2/6 | {body} | ETA 0:00:03",  # 1 s/step, steps 3, 4, 5 left
                         f"step 4/6 | {body} | ETA 0:00:01",
                         f"step 5/6 | {body} | ETA 0:00:00"]  # the last step always prints


def test_flops_match_parameter_count():
    for tie in (False, True):
        cfg = model.ModelConfig(vocab_size=96, emb_dim=32, mlp_dim=80, num_decoder_layers=3, num_query_heads=4,
                                num_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm=True, tie_word_embeddings=tie)
        abstract = nnx.eval_shape(lambda: model.create(cfg))  # shapes only: nothing to compute
        params = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
        names = {"/".join(map(str, path)): v.get_value() for path, v in params}
        matmul = sum(a.size for n, a in names.items()
                     if not n.endswith("norm") and n.split("/")[-1] not in ("bq", "bk", "bv", "embed"))
        matmul += cfg.emb_dim * cfg.vocab_size if tie else 0  # tied: the embedding is the lm_head matmul
        T = 40
        expected = 6 * matmul + 12 * cfg.num_decoder_layers * cfg.num_query_heads * cfg.head_dim * T
        assert abstract.flops_per_token(T) == expected


def test_flops_match_xla_cost_analysis():
    # Unrolled layers: XLA's cost analysis counts a scan body once, not once per layer.
    cfg = model.ModelConfig(vocab_size=512, emb_dim=128, mlp_dim=384, num_decoder_layers=2, num_query_heads=4,
                            num_kv_heads=2, head_dim=48, scan_layers=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.create(cfg)))  # lowering needs shapes only
    T = 64
    tokens = jnp.arange(T, dtype=jnp.int32)[None] % cfg.vocab_size
    positions, segments = jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), jnp.int32)

    def forward(state):
        return nnx.merge(graphdef, state)(tokens, positions, segments)[0]

    def loss(state):  # a real cross-entropy: XLA cannot simplify the lm_head gradient away
        return -jnp.take_along_axis(jax.nn.log_softmax(forward(state)), tokens[..., None], -1).sum()

    fwd = jax.jit(forward).lower(state).compile().cost_analysis()["flops"] / T
    train = jax.jit(jax.grad(loss)).lower(state).compile().cost_analysis()["flops"] / T
    # Elementwise work (norms, RoPE, softmax, SwiGLU) is uncounted by design: a few percent here.
    flops = nnx.merge(graphdef, state).flops_per_token(T)
    assert fwd == pytest.approx(flops / 3, rel=0.03)  # forward: one third of forward + backward
    assert train == pytest.approx(flops, rel=0.05)


def test_mfu_and_peak(tmp_path):
    peak = metrics.measure_matmul_peak("float32", n=256, iters=3)
    assert peak > 0 and math.isfinite(peak)
    assert metrics.mfu(tokens_per_sec=1000.0, flops_per_token=1e6, peak_flops_per_device=1e9, num_devices=4) == 0.25
    cfg = load_config([str(REPO / "configs/base.yml"), "peak_flops_per_device=2.5e12"])
    assert metrics.peak_flops_per_device(cfg) == 2.5e12
    assert metrics.peak_flops_per_device(cfg.replace(peak_flops_per_device=None, matmul_peak_size=128)) > 0


def test_profiler_writes_xplane(tmp_path):
    tb = tmp_path / "tb"
    profiler = metrics.Profiler(tb, "xplane", start_step=1, num_steps=2, is_primary=True)
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    active = []
    for step in range(4):
        profiler.maybe_start(step)
        active.append(profiler.active)
        x = f(x)
        profiler.maybe_stop(step, x)
    profiler.close()
    assert active == [False, True, True, False]
    assert list(tb.glob("plugins/profile/*/*.xplane.pb"))


def test_plot_metrics(tmp_path, capsys):
    from plot_metrics import main

    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 3.0 / (s + 1), "learning_rate": 1e-3 * s}) for s in range(20)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 20, "lo')
    out = tmp_path / "curves.png"
    assert main([str(run), "--out", str(out), "--keys", "loss,learning_rate"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(run)]) == 0 and (run / "curves.png").is_file()
    capsys.readouterr()
    assert main([str(run), "--keys", "loss,los"]) == 2
    assert capsys.readouterr().err.strip() == \
        f"plot_metrics: unknown key 'los' in --keys; {run / 'metrics.jsonl'} has: loss, learning_rate"
    assert main([str(tmp_path)]) == 2  # a directory without metrics.jsonl
    result = subprocess.run([sys.executable, str(REPO / "tools/plot_metrics.py"), str(tmp_path / "missing")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"plot_metrics: no run directory {tmp_path / 'missing'}"
