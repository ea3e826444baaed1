"""Synchronous GRPO rounds against the stream of groups (max_staleness 1), without and with interruptible
generation (vllm_interrupt; and with rollout_chunk_tokens), on vLLM, on a long-tailed round: trained samples per second, the
reward curve over seeds, and the trainer's and the engine's idle fractions. One JSON line per run,
then a summary table and one summary JSON line.

    python tools/bench_stream.py OUT                       # the full run: 3 seeds x 3 configurations
    python tools/bench_stream.py OUT --smoke               # 1 seed, 4 steps each: does it all run
    python tools/bench_stream.py OUT [--seeds 0 1 2] [--steps 60] [--configs sync stream interrupt chunks]

Reproduce (from the repository root, on a machine with two quiet cores and the engine's venv,
./setup.sh --vllm; --vllm-python names its interpreter when it is not ./.venv-vllm's):

    PYTHONPATH=src .venv/bin/python tools/bench_stream.py /tmp/bench_stream [--vllm-python PATH]

The machine. The trainer runs on core 0 (`taskset -c 0` on its command: JAX, the executor, the vLLM
sampler's HTTP client threads) and the vLLM server on core 1: vllm_python is a wrapper this tool
writes (OUT/engine_python.sh: `exec taskset -c 1 <engine venv>/bin/python`, with
VLLM_CPU_OMP_THREADS_BIND=1, VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_KVCACHE_SPACE=1), so the API
server, its engine core and their OpenMP threads all run there; `--enforce-eager` (vllm_args) spares
each of the runs' server starts torch.compile's warm-up. The cores are --trainer-core and --engine-core.

The model: a random tiny Qwen2 (tools/make_tiny_model.py: 2 layers, embedding 128, MLP 256, 2 query
heads and 1 KV head of head_dim 64, tied embeddings, ~0.4M parameters), its tokenizer a byte-level
BPE with no merges (a character is a token). At that size, on one core each, a GRPO update of a
step's 64 rows and the engine's sampling of a round take about the same time (~0.35 s each on this
machine under load: time_update against time_rollout - time_weight_push of a sync run).

The task (OUT/sft.jsonl, OUT/grpo.jsonl): sums "a+b=" (a, b in 0..9, --max-a). The SFT data's
completion is "it is ####<a+b>" (12 tokens with the stop token for a two-digit sum: the median), and
in one record in 16 (--long-every, drawn apart from the prompt) it follows a "thinking" run of
letters (an alphabet backwards, its capitals, ...: each letter follows from the two before it) that
makes it 8x as long (--long-factor: 96 tokens). Half the SFT answers (--sft-noise) are written
"++++<a+b>" instead of "####<a+b>": no answer line, reward 0, what GRPO learns away (the reward
climbs from ~0.4 to ~0.6 in 30 steps). A short SFT (300 steps, made once under OUT/sft) gives a model
whose sampled completions are long-tailed by themselves: ~1 in 16 runs the thinking to ~96 tokens,
the others stop at ~12. GRPO (mode=grpo, sampler=vllm) then trains from it on other sums of the same
kind with the gsm8k reward (the number after the last "####" equals the label): 8 prompts x 8
samples a step (--prompts, --samples), one update a step (per_device_batch_size 64), learning rate
1e-4 constant, temperature 1, rollout_max_response_len 128, rollout_is on, no KL, no eval; a second
reward of weight 0 (tools/bench_stream_task.py:length) logs each completion's length without
changing the reward, and writes every sampled length to OUT/<run>.lengths.

The configurations, everything else the same, in the order sync, stream, interrupt, chunks for each seed:
    sync       max_staleness=0: a step samples its round, then updates (the synchronous trainer)
    stream     max_staleness=1: groups sample across steps, a round's first call runs during the update
    interrupt  max_staleness=1, vllm_interrupt: a push aborts the rows in flight, which go on from
               their tokens under the new weights (the push does not wait for them)
    chunks     the same and rollout_chunk_tokens=C (--chunk-tokens; default the median completion's
               tokens, 12): a turn the step waits on is sampled at most C tokens a call, so a step
               takes its groups as they finish (the call made ahead of an update: whole turns)
The seed (config `seed`) sets the prompt order and the sampling keys; the SFT model is the same.

What is measured, from each run's metrics.jsonl (steps 0 and 1, --warmup-steps, left out: step 0
holds the server's start-up and the first compiles, the warm-up):
    samples_per_sec      rows trained (prompts x samples a step) over the steps' summed step_time
                         from the end of step 1 to the end of the last step, less the seconds the
                         run's log says the compiler took in those steps (a step whose batch has no
                         long row has fewer completion columns, a new program; JAX's persistent cache,
                         OUT/jax_cache, shared by the runs, makes each new shape ~1 s after its first
                         compile); samples_per_sec_raw without that correction
    trainer_idle_fraction  the time the steps waited for their rollouts (time_rollout, less the
                         trainer's own export of the weights, time_weight_export) over their time; the
                         wait holds the weight reload, which waits for the server's rows in flight;
                         rollout_fraction: time_rollout over the step time, the export in
    engine_idle_fraction 1 - engine_busy_fraction (the sampler's: the share of the time the server had
                         a row of ours in flight, measured by the client from one step's rollouts to
                         the next), step_time-weighted over the timed steps
    reward_curve         reward_mean (the gsm8k reward) per step, and per block of --block steps
    lengths              the sampled completions' characters (tokens less the stop token): quantiles,
                         and the share of rows over 4x the median (the long tail: ~1/16)
    rollout_staleness_*, rollout_version_spread_mean (interrupt, chunks: trajectories sampled across a
                         weight update), groups_stale, sampling_rounds (means over the timed steps),
                         time_rollout, time_weight_push and time_update (medians), where logged
The summary: each configuration's median over seeds, the samples/s ratio of each configuration to
sync computed per seed and its median, and the reward per block of steps: mean [min, max] over seeds.
The issue's goal: interrupt at least 1.5x sync's samples/s with the same reward curve within the
seeds' spread.

Time: the SFT ~70 s once (kept in OUT and reused while its settings are the same); each GRPO run ~30 s
of start-up (the vLLM server ~20 s, compiles) and ~0.4-0.8 s a step: the full run (3 seeds x 4
configurations x 60 steps) ~19 min on two quiet cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LENGTH_MEAN = "reward_bench_stream_task_length_mean"  # the length plugin's mean, as the step logs it
COMPILED = re.compile(r"compiled .* in ([0-9.]+) s")

# The long "thinking" run of a long completion: each character determined by the two before it, so a
# tiny model learns it (and where it ends) quickly; no digits, so the answer line's number is the
# completion's only one.
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
THINKING = " ".join([ALPHABET[::-1], ALPHABET.upper()[::-1], ALPHABET, ALPHABET.upper()]) + " "


# ---------------------------------------------------------------- the task and the model


def problems(n: int, seed: int, max_a: int) -> list[tuple[int, int]]:
    """n sums a+b, a in [0, max_a], b in [0, 9]."""
    rng = random.Random(seed)
    return [(rng.randint(0, max_a), rng.randint(0, 9)) for _ in range(n)]


def short_completion(a: int, b: int, marked: bool = True) -> str:
    """The answer after "####" (gsm8k's answer line); unmarked ("++++", as long): no answer, reward 0."""
    return f"it is {'####' if marked else '++++'}{a + b}"


def median_tokens(opts) -> int:
    """The median short completion's tokens: its characters and the stop token."""
    lengths = sorted(len(short_completion(a, b)) + 1 for a, b in problems(1000, 0, opts.max_a))
    return lengths[len(lengths) // 2]


def thinking(opts) -> str:
    """The run a long completion starts with: (long_factor - 1) times the median short completion's
    tokens, so that a long one is long_factor times the median."""
    run = round((opts.long_factor - 1) * median_tokens(opts))
    if run > len(THINKING):
        raise SystemExit(f"--long-factor {opts.long_factor}: a thinking run over {len(THINKING)} characters")
    return THINKING[:run]


def write_data(out: Path, opts) -> tuple[Path, Path]:
    """sft.jsonl: prompt "a+b=" and its completion, one in long_every long (drawn apart from the prompt,
    so the SFT model learns to start a long one with that probability), sft_noise of them unmarked;
    grpo.jsonl: other prompts with their answers (the gsm8k reward's label)."""
    rng, run = random.Random(1), thinking(opts)
    sft, grpo = out / "sft.jsonl", out / "grpo.jsonl"
    with open(sft, "w") as f:
        for a, b in problems(opts.sft_records, 1, opts.max_a):
            long = rng.randrange(opts.long_every) == 0
            marked = rng.random() >= opts.sft_noise
            record = {"prompt": f"{a}+{b}=", "completion": (run if long else "") + short_completion(a, b, marked)}
            f.write(json.dumps(record) + "\n")
    with open(grpo, "w") as f:
        for a, b in problems(opts.grpo_records, 2, opts.max_a):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return sft, grpo


def make_model(out: Path, opts) -> Path:
    """A random tiny qwen2 (head_dim 64: vLLM's CPU attention serves it), its tokenizer a byte-level
    BPE of the 256 bytes and 3 specials, no merges: a character is a token."""
    path = out / "model"
    if (path / "config.json").exists():
        return path
    sys.path.insert(0, str(TOOLS))
    from make_tiny_model import make_tiny_model

    make_tiny_model(
        path,
        "qwen2",
        vocab_size=259,
        emb_dim=opts.emb_dim,
        mlp_dim=opts.mlp_dim,
        layers=opts.layers,
        heads=opts.heads,
        kv_heads=opts.kv_heads,
        head_dim=64,
        tie=True,
    )
    return path


PREPARED = ("max_a", "long_every", "long_factor", "sft_records", "grpo_records", "sft_steps", "sft_lr", "sft_noise")
PREPARED += ("emb_dim", "mlp_dim", "layers", "heads", "kv_heads")


def prepare(out: Path, opts) -> dict:
    """The data, the model and its SFT (kept in OUT while the settings that made them are the same)."""
    settings = {k: getattr(opts, k) for k in PREPARED}
    record = out / "prepared.json"
    if not record.exists() or json.loads(record.read_text()) != settings:
        for stale in ("model", "sft"):
            shutil.rmtree(out / stale, ignore_errors=True)
        record.unlink(missing_ok=True)
    sft_data, grpo_data = write_data(out, opts)
    model = make_model(out, opts)
    ckpts = sft(out, model, sft_data, opts)
    record.write_text(json.dumps(settings))
    return dict(ckpts=ckpts, model=model, data=grpo_data, engine=engine_wrapper(out, opts))


# ---------------------------------------------------------------- the runs


def env(out: Path) -> dict:
    """The trainer's environment: this checkout's unitrain, tools/ for the reward plugin, one CPU
    device (no XLA_FLAGS), a persistent compile cache shared by the runs."""
    paths = [str(REPO / "src"), str(TOOLS), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        "JAX_COMPILATION_CACHE_DIR": str(out / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def train(out: Path, name: str, core: int, keys: dict, log: Path, extra_env: dict | None = None) -> float:
    """One unitrain run pinned to `core`; -> its wall seconds. Raises with the log's end on failure."""
    args = ["taskset", "-c", str(core), sys.executable, "-m", "unitrain.train", str(REPO / "configs" / "base.yml")]
    args += [f"{k}={v}" for k, v in {**keys, "base_output_directory": out, "run_name": name}.items()]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env={**env(out), **(extra_env or {})})
    if done.returncode:
        raise RuntimeError(f"{name} exited {done.returncode}; the end of {log}:\n" + log.read_text()[-3000:])
    return time.perf_counter() - start


def sft(out: Path, model: Path, data: Path, opts) -> Path:
    """The short SFT that makes the sampled lengths long-tailed; -> its checkpoints (made once)."""
    ckpts = out / "sft" / "checkpoints"
    if ckpts.exists():
        return ckpts
    shutil.rmtree(out / "sft", ignore_errors=True)
    keys = dict(
        **run_keys(model, model, data),
        mode="sft",
        max_target_length=256,
        per_device_batch_size=16,
        steps=opts.sft_steps,
        learning_rate=opts.sft_lr,
        warmup_steps=20,
        eval_interval=0,
        checkpoint_period=100000,
        log_period=50,
    )
    seconds = train(out, "sft", opts.trainer_core, keys, out / "sft.log")
    print(json.dumps({"sft_seconds": round(seconds, 1), "sft_steps": opts.sft_steps}), flush=True)
    return ckpts


def engine_wrapper(out: Path, opts) -> Path:
    """vllm_python for the runs: the engine's interpreter pinned to the engine's core (taskset; the
    server's processes inherit it), its OpenMP threads bound there, no core reserved for its API server."""
    path, core = out / "engine_python.sh", opts.engine_core
    path.write_text(
        "#!/bin/sh\n"
        f"export VLLM_CPU_OMP_THREADS_BIND={core} VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=1\n"
        f'exec taskset -c {core} {opts.vllm_python} "$@"\n'
    )
    path.chmod(0o755)
    return path


CONFIGS = {  # the configurations; everything else the same
    "sync": lambda opts: {"max_staleness": 0},
    "stream": lambda opts: {"max_staleness": 1},
    "interrupt": lambda opts: {"max_staleness": 1, "vllm_interrupt": True},
    "chunks": lambda opts: {
        "max_staleness": 1,
        "vllm_interrupt": True,
        "rollout_chunk_tokens": opts.chunk_tokens or median_tokens(opts),
    },
}


def run_keys(weights: Path, model: Path, data: Path) -> dict:
    """What the SFT and the GRPO runs share: the model folder's tokenizer, the data, float32."""
    return dict(model_name="", load_parameters_path=weights, tokenizer_path=model, dataset_path=data, dtype="float32")


def grpo_keys(opts, ckpts: Path, model: Path, data: Path, engine: Path, seed: int) -> dict:
    return dict(
        **run_keys(ckpts, model, data),
        mode="grpo",
        seed=seed,
        steps=opts.steps,
        rollout_batch_size=opts.prompts,
        n_samples_per_prompt=opts.samples,
        per_device_batch_size=opts.prompts * opts.samples,  # one update a step
        max_prompt_length=16,
        rollout_max_response_len=opts.max_response,
        rollout_temperature=1.0,
        reward="gsm8k,bench_stream_task:length",
        reward_weights="[1.0,0.0]",
        learning_rate=opts.lr,
        warmup_steps=0,
        lr_schedule="constant",
        rollout_is="true",
        eval_interval=0,
        checkpoint_period=100000,
        log_period=1,
        sample_log_period=100000,
        sampler="vllm",
        vllm_python=engine,
        vllm_args=opts.vllm_args,
    )


def grpo(out: Path, config: str, seed: int, opts, inputs: dict) -> dict:
    """One GRPO run of `config`; -> its measurements."""
    name = f"{config}_s{seed}"
    shutil.rmtree(out / name, ignore_errors=True)
    lengths, log = out / f"{name}.lengths", out / f"{name}.log"
    lengths.unlink(missing_ok=True)
    keys = {**grpo_keys(opts, seed=seed, **inputs), **CONFIGS[config](opts)}
    load = os.getloadavg()[0]
    wall = train(out, name, opts.trainer_core, keys, log, {"BENCH_STREAM_LENGTHS": str(lengths)})
    head = {"config": config, "seed": seed, "chunk_tokens": keys.get("rollout_chunk_tokens", 0)}
    tail = {"wall_seconds": round(wall, 1), "loadavg_1m_at_start": load}
    return head | measure(out / name, log, lengths, opts) | tail


# ---------------------------------------------------------------- the measurements


def compile_seconds(log: Path, first_timed: int) -> float:
    """The compiles of steps >= first_timed: those logged after step first_timed - 2's line (a step's
    line is written while the step after it runs, and a step compiles before it runs)."""
    lines = log.read_text().splitlines()
    marker = f"step {first_timed - 2}/"
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    return sum(float(m.group(1)) for line in lines[start:] if (m := COMPILED.search(line)))


def measure(run_dir: Path, log: Path, lengths: Path, opts) -> dict:
    lines = map(json.loads, open(run_dir / "metrics.jsonl"))
    steps = sorted((line for line in lines if "loss" in line), key=lambda line: line["step"])
    timed = steps[opts.warmup_steps :]
    rows = opts.prompts * opts.samples
    seconds = sum(s["step_time"] for s in timed)
    compiles = compile_seconds(log, opts.warmup_steps)
    busy = sum(s["engine_busy_fraction"] * s["step_time"] for s in timed if "engine_busy_fraction" in s)
    waited = sum(s["time_rollout"] - s.get("time_weight_export", 0.0) for s in timed)
    got = sorted(int(x) for x in lengths.read_text().split()) if lengths.exists() else []

    def over_steps(key, how=statistics.fmean):
        values = [s[key] for s in timed if key in s]
        return round(how(values), 4) if values else None

    def quantile(f):
        return got[min(len(got) - 1, int(f * len(got)))]

    middle = max(quantile(0.5), 1) if got else None
    return {
        "samples_per_sec": round(rows * len(timed) / (seconds - compiles), 2),
        "samples_per_sec_raw": round(rows * len(timed) / seconds, 2),
        "timed_steps": len(timed),
        "timed_seconds": round(seconds, 2),
        "compile_seconds_in_timed_steps": round(compiles, 2),
        "step_time_median": round(statistics.median(s["step_time"] for s in timed), 3),
        "trainer_idle_fraction": round(waited / seconds, 3),
        "rollout_fraction": round(sum(s["time_rollout"] for s in timed) / seconds, 3),
        "engine_idle_fraction": round(1 - busy / seconds, 3),
        "time_rollout_median": over_steps("time_rollout", statistics.median),
        "time_weight_push_median": over_steps("time_weight_push", statistics.median),
        "time_update_median": over_steps("time_update", statistics.median),
        "sampling_rounds_mean": over_steps("sampling_rounds"),
        "rollout_staleness_mean": over_steps("rollout_staleness_mean"),
        "rollout_staleness_max": max((s.get("rollout_staleness_max", 0) for s in timed), default=None),
        "rollout_version_spread_mean": over_steps("rollout_version_spread_mean"),
        "groups_stale": sum(s.get("groups_stale", 0) for s in timed),
        "reward_curve": [round(s["reward_mean"], 4) for s in steps],
        "reward_blocks": blocks([s["reward_mean"] for s in steps], opts.block),
        "length_mean_curve": [round(s[LENGTH_MEAN], 1) for s in steps if LENGTH_MEAN in s],
        "lengths": {
            "sampled": len(got),
            **({f"p{q}": quantile(q / 100) for q in (10, 50, 90, 95, 99)} if got else {}),
            "max": got[-1] if got else None,
            "over_4x_median": round(sum(x > 4 * middle for x in got) / len(got), 4) if got else None,
        },
        "step_times": [round(s["step_time"], 2) for s in steps],
    }


def blocks(values: list[float], size: int) -> list[float]:
    return [round(statistics.fmean(values[i : i + size]), 4) for i in range(0, len(values), size)]


def summary(results: list[dict], opts) -> dict:
    """Each configuration's medians over seeds, its samples/s ratio to sync (per seed, then the median)
    and its reward per block of steps: mean, min and max over seeds."""
    out = {}
    by = {c: {r["seed"]: r for r in results if r["config"] == c and "error" not in r} for c in opts.configs}
    keys = ("samples_per_sec", "samples_per_sec_raw", "trainer_idle_fraction", "engine_idle_fraction")
    keys += ("rollout_staleness_mean", "rollout_version_spread_mean", "step_time_median")
    keys += ("compile_seconds_in_timed_steps",)
    for config, runs in by.items():
        if not runs:
            continue
        entry = {"seeds": sorted(runs)}
        for key in keys:
            values = [r[key] for r in runs.values() if r.get(key) is not None]
            entry[key] = round(statistics.median(values), 4) if values else None
        entry["long_rows"] = round(statistics.median(r["lengths"]["over_4x_median"] or 0 for r in runs.values()), 4)
        sync = by.get("sync", {})
        ratios = [runs[s]["samples_per_sec"] / sync[s]["samples_per_sec"] for s in runs if s in sync]
        entry["ratio_to_sync_per_seed"] = [round(x, 3) for x in ratios]
        entry["ratio_to_sync_median"] = round(statistics.median(ratios), 3) if ratios else None
        curves = [r["reward_blocks"] for r in runs.values()]
        entry["reward_blocks"] = [
            {"mean": round(statistics.fmean(b), 4), "min": min(b), "max": max(b)} for b in zip(*curves)
        ]
        out[config] = entry
    return out


def print_table(table: dict, opts) -> None:
    print(f"\nmedians over seeds (timed: steps {opts.warmup_steps}..{opts.steps - 1}; samples/s less compiles)")
    head = ("config", "samples/s", "raw", "x sync", "per seed", "trainer idle", "engine idle", "stale", "spread")
    head += ("long rows",)
    print("{:<10} {:>9} {:>7} {:>6} {:>22} {:>12} {:>11} {:>6} {:>7} {:>9}".format(*head))
    for config, e in table.items():

        def f(key, spec=".3f"):
            return "-" if e.get(key) is None else format(e[key], spec)

        per_seed = " ".join(format(x, ".2f") for x in e["ratio_to_sync_per_seed"])
        print(
            f"{config:<10} {f('samples_per_sec', '.1f'):>9} {f('samples_per_sec_raw', '.1f'):>7} "
            f"{f('ratio_to_sync_median', '.2f'):>6} {per_seed:>22} {f('trainer_idle_fraction'):>12} "
            f"{f('engine_idle_fraction'):>11} {f('rollout_staleness_mean', '.2f'):>6} "
            f"{f('rollout_version_spread_mean'):>7} {f('long_rows'):>9}"
        )
    print(f"\nreward_mean per block of {opts.block} steps: mean over seeds [min, max]")
    for config, e in table.items():
        cells = " ".join(f"{b['mean']:.3f}[{b['min']:.2f},{b['max']:.2f}]" for b in e["reward_blocks"])
        print(f"{config:<10} {cells}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the working folder: data, model, SFT, one folder and log per run")
    p.add_argument("--smoke", action="store_true", help="one seed, 4 steps a configuration")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=60, help="GRPO steps a run")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the timing (>= 2)")
    p.add_argument("--block", type=int, default=10, help="steps per block of the reward curve")
    p.add_argument("--prompts", type=int, default=8, help="rollout_batch_size")
    p.add_argument("--samples", type=int, default=8, help="n_samples_per_prompt")
    p.add_argument("--max-response", type=int, default=128, help="rollout_max_response_len")
    p.add_argument("--chunk-tokens", type=int, default=0, help="chunks: rollout_chunk_tokens; 0: the median's tokens")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--vllm-args", default="--enforce-eager")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the engine venv's interpreter")
    p.add_argument("--trainer-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument("--max-a", type=int, default=9, help="the first operand's largest value; the second's is 9")
    p.add_argument("--long-every", type=int, default=16, help="one SFT completion in this many is long")
    p.add_argument("--long-factor", type=float, default=8.0, help="a long completion's tokens over the median's")
    p.add_argument("--sft-records", type=int, default=20000)
    p.add_argument("--grpo-records", type=int, default=20000)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-noise", type=float, default=0.5, help="SFT answers written without their #### mark")
    p.add_argument("--emb-dim", type=int, default=128)
    p.add_argument("--mlp-dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.seeds, opts.steps, opts.block = opts.seeds[:1], 4, 4
    if opts.warmup_steps < 2 or opts.steps <= opts.warmup_steps:
        p.error("--warmup-steps must be at least 2 and below --steps")
    cores = os.sched_getaffinity(0)
    if not {opts.trainer_core, opts.engine_core} <= cores or opts.trainer_core == opts.engine_core:
        p.error(f"--trainer-core and --engine-core must be two of this process's cores {sorted(cores)}")
    if not os.access(opts.vllm_python, os.X_OK):
        p.error(f"--vllm-python {opts.vllm_python} is not an executable (./setup.sh --vllm)")
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    inputs = prepare(out, opts)
    results = []
    for seed in opts.seeds:
        for config in opts.configs:
            try:
                result = grpo(out, config, seed, opts, inputs)
            except RuntimeError as e:
                result = {"config": config, "seed": seed, "error": str(e)}
            results.append(result)
            print(json.dumps(result), flush=True)
    table = summary(results, opts)
    print_table(table, opts)
    print(json.dumps({"summary": table}))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
