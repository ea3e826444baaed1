"""Times unitrain's jitted SFT train step on synthetic batches and prints one JSON line.

    python tools/bench.py [CONFIG_YML] [key=value ...] [--steps 10] [--warmup 2] [--out bench.json]

The mesh, model, optimizer state and step are built by unitrain.train's own functions from the config
(default configs/base.yml; key=value are ordinary config overrides). Each step sees the configured
global batch (global_batch_size * gradient_accumulation_steps rows of max_target_length): random
tokens, one segment per row, every target weighted, placed on device once, so no data loading is
timed. Each timed step is waited for through its metrics. The MFU denominator is the jnp.dot rate
measured in this run (metrics.peak_flops_per_device), unless peak_flops_per_device is set.
Exit 2 with `bench: <message>` for a config mistake.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from unitrain import metrics, sharding
from unitrain.config import ConfigError, load_config
from unitrain.optimizer import make_optimizer
from unitrain.train import _to_global, build_model, compile_logged, init_state, make_step_fn, sft_loss


def synthetic_batch(cfg, rows: int, seed: int = 0) -> dict:
    """This process's share of `rows` full rows: random tokens, one segment each, all targets weighted."""
    local = rows // jax.process_count()
    T = cfg.max_target_length
    tokens = np.random.default_rng(seed + jax.process_index()).integers(0, cfg.vocab_size, (local, T + 1), np.int32)
    ones = np.ones((local, T), np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (local, T)).copy()
    return {"inputs": tokens[:, :-1], "inputs_position": positions, "inputs_segmentation": ones,
            "targets": tokens[:, 1:], "targets_segmentation": ones.copy()}


def bench(cfg, steps: int, warmup: int) -> dict:
    mesh = sharding.mesh_from_config(cfg)
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    model = build_model(cfg, mesh)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(cfg)
    state = init_state(nnx.to_pure_dict(params), optimizer, mesh)
    num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_sharding_ = sharding.batch_sharding(mesh, rules)
    rows = cfg.global_batch_size * cfg.gradient_accumulation_steps
    batch = _to_global(synthetic_batch(cfg, rows), batch_sharding_)
    step_fn = make_step_fn(functools.partial(sft_loss, graphdef, cfg), cfg, optimizer, state_shardings,
                           batch_sharding_)
    times = []
    with jax.set_mesh(mesh):
        compiled = compile_logged("train_step", step_fn, state, batch)
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, step_metrics = compiled(state, batch)
            jax.block_until_ready(step_metrics)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    peak = metrics.peak_flops_per_device(cfg)
    flops_per_token = metrics.train_flops_per_token(model.cfg, cfg.max_target_length)
    median = statistics.median(times)
    tokens_per_sec = rows * cfg.max_target_length / median
    return {
        "num_params": int(num_params),
        "config": {k: cfg[k] for k in ("model_name", "model_family", "vocab_size", "emb_dim", "mlp_dim",
                                       "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim",
                                       "dtype", "weight_dtype", "remat_policy", "scan_layers",
                                       "per_device_batch_size", "gradient_accumulation_steps",
                                       "max_target_length")}
        | {"global_batch_rows": rows, "mesh_shape": dict(mesh.shape), "device_kind": jax.devices()[0].device_kind,
           "num_devices": mesh.size, "steps": steps, "warmup": warmup},
        "step_time_median": median, "step_time_min": min(times), "step_time_max": max(times),
        "tokens_per_sec": tokens_per_sec,
        "model_flops_per_token": flops_per_token,
        "model_flops_per_sec_per_device": tokens_per_sec * flops_per_token / mesh.size,
        "matmul_peak_flops_per_device": peak,
        "peak_source": "config" if cfg.peak_flops_per_device is not None else f"jnp.dot {cfg.matmul_peak_size}",
        "mfu": metrics.mfu(tokens_per_sec, flops_per_token, peak, mesh.size),
        "final_loss": float(step_metrics["loss"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", help="[CONFIG_YML] [key=value ...]")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    parser.add_argument("--out", help="also write the JSON here")
    opts = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    args = opts.args
    if not args or "=" in args[0]:
        args = ["configs/base.yml", *args]
    try:
        if opts.steps < 1 or opts.warmup < 0:
            raise ConfigError("--steps must be >= 1 and --warmup >= 0")
        result = bench(load_config(args), opts.steps, opts.warmup)
    except ConfigError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result)
    print(text, flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
