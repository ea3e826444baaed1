"""metrics.py: jsonl + TensorBoard writing, rank-0 gating, resume, progress line, FLOPs, peak, profiler
(tools/plot_metrics.py: tests/tools/test_plot_metrics.py)."""

import json
import math
import struct
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import REPO, read_events
from unitrain import metrics, sharding
from unitrain.checks import load_checked
from unitrain.models import decoder as model


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_jsonl_and_tensorboard(tmp_path):
    cfg = load_checked([str(REPO / "configs/base.yml"), f"base_output_directory={tmp_path}", "run_name=r"])
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
    w = metrics.MetricsWriter(
        tmp_path / "run/metrics.jsonl", tmp_path / "run/tb", 5, 1, is_primary=False, resume_step=0
    )
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


def test_progress_line_every_log_period_with_eta(tmp_path, capsys):
    scalars = {
        "loss": 1.23456,
        "learning_rate": 3e-4,
        "tokens_per_sec": 12345.0,
        "mfu": 0.031,
        "step_time": 1.0,
        "grad_norm": 5.0,
    }
    with metrics.MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb", 6, 2, is_primary=True) as w:
        for step in range(6):
            w.write(step, scalars if step else {"loss": 2.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 1/6 | loss 2.0000"  # no ETA yet: nothing measured
    body = "loss 1.2346 | lr 3.0e-04 | 12.3k tok/s | MFU 3.1% | 1.00 s/step"
    assert lines[1:] == [
        f"step 3/6 | {body} | ETA 0:00:03",  # 1 s/step (step_time), steps 4, 5, 6 left
        f"step 5/6 | {body} | ETA 0:00:01",
        f"step 6/6 | {body} | ETA 0:00:00",
    ]  # the last step always prints


def test_the_progress_line_shows_every_eval_metric_and_steps_without_reward_spread(tmp_path, capsys):
    evals = {
        "eval_loss": 1.23456,
        "eval_accuracy": 0.453,
        "eval_pass_at_4": 0.6,
        "eval_rewards/accuracy": 0.75,
        "eval_rewards/margin": 0.012345,
        "eval_hr_at_10": 0.087,
        "eval_ndcg_at_10": 0.05123,
        "eval_episode_success_rate": 0.5,
        "eval_episode_tool_call_valid_rate": 1.0,  # the episodes' breakdown: metrics.jsonl's, not the line's
        "eval_episode_end_length": 0.25,
        "eval_rewards/chosen": -2.5e-5,
    }
    with metrics.MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb", 8, 4, is_primary=True) as w:
        for step, fraction in enumerate([1.0, 0.5, 1.0, 0.0, 1.0, 0.25]):
            w.write(step, {"loss": 0.5, "reward_mean": 0.25, "zero_std_group_fraction": fraction})
        w.write(5, evals)
        w.write(6, {"eval_hr_at_10": 0.1})  # a recommender GRPO eval: nothing but HR/NDCG
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "step 1/8 | loss 0.5000 | reward 0.250 | 1 of 1 steps trained on nothing (no reward spread in any group)",
        "step 5/8 | loss 0.5000 | reward 0.250 | 2 of 4 steps trained on nothing (no reward spread in any group)",
        "step 6/8 | eval loss 1.2346, accuracy 45.3%, pass@4 60.0%, rewards/accuracy 75.0%, rewards/margin 0.0123, "
        "hr@10 0.0870, ndcg@10 0.0512, success rate 50.0%, rewards/chosen -2.5e-05",
        "step 7/8 | eval hr@10 0.1000",
    ]


def test_samples_go_to_a_text_file_by_step_and_a_resume_drops_the_later_ones(tmp_path):
    file, tb = tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "tb"
    with metrics.MetricsWriter(file, tb, 10, 1, is_primary=True) as w:
        for step in (0, 4, 8):
            w.text(step, "samples", f"**prompt** {step}+1=\n\n**completion** {step + 1}\n")
    samples = tmp_path / "run" / "samples.txt"
    blocks = samples.read_text().split("\n\n==== ")
    assert blocks[0] == "==== step 1: samples\n**prompt** 0+1=\n\n**completion** 1"
    assert blocks[1:] == [
        "step 5: samples\n**prompt** 4+1=\n\n**completion** 5",
        "step 9: samples\n**prompt** 8+1=\n\n**completion** 9\n\n",
    ]
    with metrics.MetricsWriter(file, tb, 10, 1, is_primary=True, resume_step=5) as w:
        w.text(6, "samples", "again")
    assert samples.read_text() == "\n\n==== ".join(blocks[:2]) + "\n\n==== step 7: samples\nagain\n\n"


def test_flops_match_parameter_count():
    for tie in (False, True):
        cfg = model.ModelConfig(
            vocab_size=96,
            emb_dim=32,
            mlp_dim=80,
            num_decoder_layers=3,
            num_query_heads=4,
            num_kv_heads=2,
            head_dim=12,
            platform=sharding.target_platform(),
            qkv_bias=True,
            qk_norm=True,
            tie_word_embeddings=tie,
        )
        abstract = nnx.eval_shape(lambda: model.create(cfg))  # shapes only: nothing to compute
        params = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
        names = {"/".join(map(str, path)): v.get_value() for path, v in params}
        matmul = sum(
            a.size
            for n, a in names.items()
            if not n.endswith("norm") and n.split("/")[-1] not in ("bq", "bk", "bv", "embed")
        )
        matmul += cfg.emb_dim * cfg.vocab_size if tie else 0  # tied: the embedding is the lm_head matmul
        T = 40
        expected = 6 * matmul + 12 * cfg.num_decoder_layers * cfg.num_query_heads * cfg.head_dim * T
        assert abstract.flops_per_token(T) == expected


def test_flops_match_xla_cost_analysis():
    # Unrolled layers: XLA's cost analysis counts a scan body once, not once per layer.
    cfg = model.ModelConfig(
        vocab_size=512,
        emb_dim=128,
        mlp_dim=384,
        num_decoder_layers=2,
        num_query_heads=4,
        num_kv_heads=2,
        head_dim=48,
        platform=sharding.target_platform(),
        scan_layers=False,
    )
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
    cfg = load_checked([str(REPO / "configs/base.yml"), "peak_flops_per_device=2.5e12"])
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


# ---------------------------------------------------------------- one name per metric in every sink; W&B

SFT_RUN = [
    "max_target_length=32",
    "per_device_batch_size=1",
    "peak_flops_per_device=1e12",
    "warmup_steps=1",
    "eval_interval=2",
    "eval_steps=1",
    "eval_num_samples=0",
    "log_period=1",
]
# A reward plugin: its spec `pkg.module:fn` holds characters that TensorBoard rewrites in a tag.
GRPO_RUN = [
    "mode=grpo",
    "per_device_batch_size=2",
    "rollout_batch_size=4",
    "n_samples_per_prompt=4",
    "rollout_max_response_len=4",
    "builtin_task_digits=1",
    "max_prompt_length=16",
    "warmup_steps=0",
    "peak_flops_per_device=1e12",
    "eval_interval=2",
    "eval_num_samples=4",
    "eval_n_samples=2",
    "eval_pass_k=2",
    "reward=exact_match,toy_rewards.length:score",
    "log_period=1",
]


def wandb_records(run_dir: Path, timeout: float = 60.0) -> list:
    """Every Record of the offline W&B runs under run_dir/wandb, oldest first, once each run's file
    ends in its exit record (wandb-core writes the file in the background, after finish() returns)."""
    paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    deadline = time.monotonic() + timeout
    while True:
        runs = [read_wandb_file(path) for path in paths]
        if all(r and r[-1].WhichOneof("record_type") == "exit" for r in runs) or time.monotonic() > deadline:
            return [record for r in runs for record in r]
        time.sleep(0.2)


def read_wandb_file(path: Path) -> list:
    """A .wandb file's Records: a 7-byte header (":W&B", magic, version), then LevelDB-log framing:
    32 KiB blocks of chunks, each crc32, uint16 length, uint8 type (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    records, data, i, chunks = [], path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a chunk header is padding
            i += 32768 - i % 32768
            continue
        length, kind = struct.unpack("<HB", data[i + 4 : i + 7])
        if i + 7 + length > len(data):
            break  # a chunk still being written
        chunks, i = chunks + data[i + 7 : i + 7 + length], i + 7 + length
        if kind in (1, 4):
            records.append(Record.FromString(chunks))
            chunks = b""
    return records


def wandb_history(records) -> dict:
    """{step: {metric: value}} of the logged history rows (W&B's own `_`-keys left out)."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(r.history.step.num, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def jsonl_by_step(path: Path) -> dict:
    rows = {}
    for line in read_jsonl(path):
        rows.setdefault(line.pop("step"), {}).update(line)
    return rows


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with no network and nothing written outside tmp_path."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    plugin = tmp_path / "toy_rewards" / "length.py"
    plugin.parent.mkdir()
    plugin.write_text("def score(prompt, completion, label):\n    return float(len(completion) > 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("mode_args", [SFT_RUN, GRPO_RUN], ids=["sft", "grpo"])
def test_tensorboard_wandb_and_jsonl_have_the_same_metrics(tmp_path, offline_wandb, mode_args):
    from unitrain import train

    run_dir = tmp_path / "r"
    argv = [
        str(REPO / "configs/base.yml"),
        f"base_output_directory={tmp_path}",
        "run_name=r",
        *mode_args,
        "wandb_project=unitrain-test",
        "wandb_mode=offline",
        "wandb_group=g",
        "wandb_entity=team",
    ]
    grpo = "mode=grpo" in mode_args
    assert train.main([*argv, "steps=2"]) == 0

    logged = jsonl_by_step(run_dir / "metrics.jsonl")
    keys = {k for row in logged.values() for k in row}
    assert (
        {"loss", "eval_accuracy", "eval_pass_at_2", "reward_toy_rewards.length_score_mean"} <= keys
        if grpo
        else {"loss", "eval_loss"} <= keys
    )
    events = read_events(run_dir / "tensorboard")
    tags = {v.tag for e in events for v in e.summary.value if v.HasField("simple_value")}
    assert tags == keys

    records = wandb_records(run_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [(r.run_id, r.project, r.display_name, r.run_group, r.entity) for r in runs] == [
        ((run_dir / "wandb_id").read_text().strip(), "unitrain-test", "r", "g", "team")
    ]
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert {k: config[k] for k in ("mode", "steps", "run_dir")} == {
        "mode": "grpo" if grpo else "sft",
        "steps": 2,
        "run_dir": str(run_dir),
    }
    history = wandb_history(records)
    assert sorted(history) == sorted(logged) == [0, 1]
    # TensorBoard's text is a W&B HTML panel (its fields flattened into samples/...) at the same steps.
    texts = {e.step for e in events for v in e.summary.value if v.tag.startswith("samples")}
    panels = {step: {k: row.pop(k) for k in list(row) if k.startswith("samples/")} for step, row in history.items()}
    assert texts == {step for step, panel in panels.items() if panel.get("samples/_type") == "html-file"}
    assert texts or not grpo  # GRPO's sampled completions at step 0
    if grpo:  # samples.txt: the first step's rollouts, then the evaluation's answers (no rollouts at step 2)
        blocks = (run_dir / "samples.txt").read_text().split("==== ")
        assert [b.split("\n")[0] for b in blocks[1:]] == ["step 1: samples", "step 2: samples"]
        assert blocks[2].startswith("step 2: samples\n**prompt**")
    for step, row in logged.items():
        assert history[step] == pytest.approx(row), step


def test_resumed_run_continues_its_wandb_run(tmp_path, offline_wandb):
    from unitrain import train

    argv = [
        str(REPO / "configs/base.yml"),
        f"base_output_directory={tmp_path}",
        "run_name=r",
        *SFT_RUN,
        "eval_interval=0",
        "wandb_project=p",
        "wandb_mode=offline",
        "wandb_run_name=shown",
    ]
    assert train.main([*argv, "steps=1"]) == 0
    first_id = (tmp_path / "r" / "wandb_id").read_text().strip()
    assert train.main([*argv, "steps=2"]) == 0  # resumes at step 1
    assert (tmp_path / "r" / "wandb_id").read_text().strip() == first_id
    records = wandb_records(tmp_path / "r")
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [(r.run_id, r.display_name) for r in runs] == [(first_id, "shown")] * 2
    history, logged = wandb_history(records), jsonl_by_step(tmp_path / "r" / "metrics.jsonl")
    assert sorted(history) == sorted(logged) == [0, 1]
    assert all(history[step] == pytest.approx(row) for step, row in logged.items())


def test_wandb_off_disabled_and_its_errors(tmp_path, offline_wandb, monkeypatch, capsys):
    from unitrain import train

    def run(name, *args):
        return train.main(
            [
                str(REPO / "configs/base.yml"),
                f"base_output_directory={tmp_path}",
                f"run_name={name}",
                *SFT_RUN,
                "steps=1",
                "eval_interval=0",
                *args,
            ]
        )

    assert run("off") == 0 and run("disabled", "wandb_project=p", "wandb_mode=disabled") == 0
    for name in ("off", "disabled"):
        assert not (tmp_path / name / "wandb").exists() and not (tmp_path / name / "wandb_id").exists()
    capsys.readouterr()
    # Online with no login: one line naming the key and the way out, exit 2, no traceback.
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc holding a key
    assert run("online", "wandb_project=p", "wandb_mode=online") == 2
    err = capsys.readouterr().err
    assert err.startswith("unitrain: W&B could not start a run for wandb_project='p': ") and err.count("\n") == 1
    assert "wandb login" in err and "wandb_mode=offline" in err
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    assert run("missing", "wandb_project=p") == 2
    assert capsys.readouterr().err == (
        "unitrain: wandb_project='p' needs the wandb package: pip install "
        "'unitrain[wandb]' (or wandb_project='' for no W&B)\n"
    )
