"""`sampler: vllm` against the colocated JAX sampler, side by side in one process; one JSON line per measurement.

    python tools/bench_vllm.py CKPT [key=value ...] [--batches 16 64] [--long-tail-batches 64] [--reps 5]
        [--bandwidth-batches 1 16 64] [--grpo-rounds 2] [--push-model qwen2.5-0.5b]
        [--push-dirs "" /dev/shm/unitrain_bench] [--skip sampler long_tail bandwidth grpo push]

CKPT is an HF checkpoint both load (../shared/bench/tunix_peer/make_ckpt.py makes the Tunix bench's
16M Qwen2; head_dim 64, which vLLM's CPU attention serves). The measurements, each with
tools/bench.py's own functions:

  sampler  for each --batches size: prompts of 64 random ids, 128 new tokens each, temperature 1,
           no stop token, colocated (A) and vllm (B) called in turn, A B A B (bench.py --against):
           both medians and B's speed-up as the median of the pairs' A/B ratios.
  long_tail for each --long-tail-batches size: the same with 256 new tokens at most and a budget per
           row (bench.long_tail_budgets: one row in 16 runs to 256, the others about 32), the
           round where finished rows must stop costing (colocated: rollout_compaction; vLLM:
           each request's max_tokens).
  bandwidth for each --bandwidth-batches size: the colocated sampler alone at 64 + 128, its decode
           step's bytes over its time as a fraction of the memory bandwidth a jitted sum reaches.
  grpo     whole GRPO steps (bench.py --mode grpo with tools/peer_ab.sh's settings: 4 prompts x 4
           samples, 64 new tokens, KL 0.04) with each sampler, alternating --grpo-rounds times;
           medians of the step and its parts (vllm: every step exports the policy and the server
           reloads it).
  push     update_weights of sampler=vllm for a random model of --push-model's shape, the export
           folder on disk (<run_dir>) and in memory (/dev/shm): export and reload apart.

The server runs with the environment given (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0 lets its worker use
every core; by default vLLM keeps one core for its API server).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import bench_grpo, bench_push, bench_sampler, bench_sampler_against  # noqa: E402
from unitrain.checks import load_checked  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def config(ckpt: str, overrides: list[str], **keys):
    base = [str(REPO / "configs" / "base.yml"), f"load_parameters_path={ckpt}", "dtype=float32", *overrides]
    return load_checked([*base, *(f"{k}={v}" for k, v in keys.items())])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for both samplers")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--long-tail-batches", type=int, nargs="+", default=[64])
    p.add_argument("--bandwidth-batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--grpo-rounds", type=int, default=2)
    p.add_argument("--grpo-steps", type=int, default=4)
    p.add_argument("--push-model", default="qwen2.5-0.5b", help="model_name of the push's model")
    p.add_argument("--push-dirs", nargs="+", default=["", "/dev/shm/unitrain_bench_push"])
    p.add_argument("--skip", nargs="*", default=[], choices=["sampler", "long_tail", "bandwidth", "grpo", "push"])
    opts = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench_vllm_")
    engine = dict(sampler="vllm", vllm_python=REPO / ".venv-vllm" / "bin" / "python")
    print(json.dumps({"ckpt": opts.ckpt, "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}))

    def report(name, result):
        print(json.dumps({"measurement": name, **result}), flush=True)

    for batch in opts.batches if "sampler" not in opts.skip else []:
        colocated = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/a{batch}")
        vllm = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/b{batch}", **engine)
        report(f"sampler_{batch}x64+128", bench_sampler_against(colocated, vllm, batch, 64, 128, opts.reps, 2))

    for batch in opts.long_tail_batches if "long_tail" not in opts.skip else []:
        colocated = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/la{batch}")
        vllm = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/lb{batch}", **engine)
        result = bench_sampler_against(colocated, vllm, batch, 64, 256, opts.reps, 2, long_tail=True)
        report(f"sampler_long_tail_{batch}x64+256", result)

    for batch in opts.bandwidth_batches if "bandwidth" not in opts.skip else []:
        colocated = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/w{batch}")
        result = bench_sampler(colocated, batch, 64, 128, opts.reps, 2)
        keys = ("tokens_per_sec", "decode_step_time", "decode_bytes_per_step", "memory_bandwidth_per_device")
        report(f"bandwidth_{batch}x64+128", {k: result[k] for k in (*keys, "decode_bandwidth_fraction")})

    if "grpo" not in opts.skip:
        peer = dict(kl_coef=0.04, learning_rate=1e-6, per_device_batch_size=16, reward="format")
        peer["format_reward_pattern"] = "[02468]"  # peer_ab's reward: even token ids
        grpo = {"colocated": [], "vllm": []}
        for i in range(opts.grpo_rounds):
            for name, keys in (("colocated", {}), ("vllm", engine)):
                cfg = config(opts.ckpt, opts.overrides, base_output_directory=f"{root}/g{i}{name}", **peer, **keys)
                grpo[name].append(bench_grpo(cfg, 4, 4, 64, 64, opts.grpo_steps, 1))
        parts = ("step_time_median", "time_rollout", "time_weight_push", "time_logprob", "time_update")
        for name, runs in grpo.items():
            report(f"grpo_{name}", {k: statistics.median(r[k] for r in runs) for k in parts} | {"runs": runs})

    for where in opts.push_dirs if "push" not in opts.skip else []:
        keys = [f"model_name={opts.push_model}", "mode=grpo", f"base_output_directory={root}/push"]
        keys += [f"vllm_export_dir={where}", *(f"{k}={v}" for k, v in engine.items()), "vllm_args=--max-num-seqs 8"]
        cfg = load_checked([str(REPO / "configs" / "base.yml"), *keys])
        report(f"push_{opts.push_model}_{'memory' if where.startswith('/dev/shm') else 'disk'}", bench_push(cfg, 3, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
