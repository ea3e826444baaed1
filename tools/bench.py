"""Times unitrain's jitted SFT train step, its sampler or whole GRPO steps and prints one JSON line.

    python tools/bench.py [CONFIG_YML] [key=value ...] [--steps 10] [--warmup 2] [--out bench.json]
    python tools/bench.py [CONFIG_YML] [key=value ...] --against ici_context_parallelism=8 --against per_device_batch_size=8
    python tools/bench.py [CONFIG_YML] [key=value ...] --compile-only [--mode grpo|sampler|rm_score] [--out mem.json]
    python tools/bench.py [CONFIG_YML] teacher_path=T distill_coef=0.5 --teacher num_decoder_layers=8 --compile-only
    python tools/bench.py [CONFIG_YML] load_parameters_path=CKPT --mode sampler [--batch 16 --prompt-len 64 --new-tokens 128]
    python tools/bench.py [CONFIG_YML] load_parameters_path=CKPT --mode sampler --against rollout_cache_phases=1
    python tools/bench.py [CONFIG_YML] --mode sampler --batch 64 --new-tokens 256 --long-tail --against rollout_compaction=0
    python tools/bench.py [CONFIG_YML] load_parameters_path=CKPT --mode sampler --new-tokens 256 --chunk-tokens 32
    python tools/bench.py [CONFIG_YML] load_parameters_path=CKPT kl_coef=0.04 --mode grpo [--prompts 4 --samples 4 --new-tokens 64]
    python tools/bench.py [CONFIG_YML] model_name=qwen2.5-0.5b mode=grpo sampler=mesh rollout_devices=4 --mode push
    python tools/bench.py [CONFIG_YML] mode=grpo kl_coef=0.04 --mode grpo_round --against rl_packing=true [--long-fraction 0.125]

--mode sampler times `--steps` calls of the configured sampler (after `--warmup` calls) on random
prompt ids with no stop token, from the ids to decoded text, and reports the median tokens/s; then
it times one-token calls to split off the decode step (its time, tokens/s, the bytes it reads and
their rate as a fraction of the devices' memory bandwidth, measured with a jitted sum).
With `--against key=value` (repeatable) it times instead the configured sampler (A) and one of
the config with those overrides (B) in turn, A B A B, in one process, on the same prompts and keys:
each one's median, B's speedup as the median of the pairs' A/B time ratios (side by side, so less
at the mercy of a shared machine's drift than two runs), and whether both drew the same tokens.
With `--long-tail` every row has its own token budget (SamplingParams.row_budgets: one row in 16
runs to --new-tokens, the others geometric lengths of mean --new-tokens / 8): the round that decode
compaction (rollout_compaction) is for; tokens/s counts the budgets' sum.
With `--chunk-tokens C` it times instead, A B A B, the rows' --new-tokens in one call (what a
continuation on a kept KV cache decodes) and the same rows C tokens a call, each call prefilling the
prompt and the tokens so far again (interruptible generation's re-prefill, rollout_chunk_tokens), and
reports both medians (and as tokens/s) and the median of the pairs' B/A ratios.
--mode grpo times `--steps` whole GRPO steps (rollout, rewards, advantages, logprobs, update) on
random prompts, with the config's reward, KL and clipping, and reports the median step time and
its parts (with sampler=mesh the weight push; with max_staleness the steps overlap rollouts with
updates). Both do the work of ../shared/bench/tunix_peer (see its README) with the same flags.
--mode grpo_round times GRPO steps on one fixed long-tailed round instead (long_tailed_groups:
`--prompts` x `--samples` completions, a `--long-fraction` of them `--new-tokens` long, the others
1 to a quarter of that, random ids, rewards and sampler logprobs; nothing sampled, so the step is
its logprob passes and its update): with `--against key=value` the config (A) and the config with
those overrides (B) in turn, A B A B, each with its own model from the same seed, and B's speedup
as the median of the pairs' A/B step-time ratios (rl_packing=true: packed against unpacked rows).
--mode push times `--steps` weight pushes (update_weights) for the config's model (random weights of
its shape) and reports the median seconds and GB/s: sampler=mesh copies the trainer's parameters to
the rollout mesh; sampler=vllm writes them (by vllm_weight_transfer: into shared memory, or an HF
folder) and its server loads them (time_weight_export and time_weight_reload apart).

--mode sft (the default) times the SFT train step; with `--against key=value` the config (A) and
the config with those overrides (B) in turn, A B A B, each on its own synthetic batch (the same rows
where both have as many), B's figures and speedup (the median of the pairs' A/B step-time ratios)
under "against": e.g. a row's sequence split over 8 devices against the unsplit step.
The mesh, model, optimizer state and step are built by unitrain.run.build_run and the SFT task from the config
(default configs/base.yml; key=value are ordinary config overrides). Each step sees the configured
global batch (global_batch_size * gradient_accumulation_steps rows of max_target_length): random
tokens, one segment per row, every target weighted, placed on device once, so no data loading is
timed. Each timed step is waited for through its metrics. The MFU denominator is the jnp.dot rate
measured in this run (metrics.peak_flops_per_device), unless peak_flops_per_device is set.

--compile-only lowers and compiles one optimizer update of the config's mode (the SFT step; with
mode=dpo the DPO update; with mode=rm the reward model's update of max_target_length pairs on the
scalar-head model; with --mode grpo the GRPO update of rows of the longest prompt and
completion) for the config's mesh without allocating anything: parameters, optimizer state and batch are abstract arrays (jax.ShapeDtypeStruct with the shardings
training would give them), so a model far larger than this machine's memory can be sized here. It
prints the compiler's memory analysis per device (arguments, outputs, temporaries, generated code,
aliased = donated bytes, total_estimate = arguments + outputs + temporaries - aliased, and peak:
the compiler's peak of bytes live at once, arguments included, which on XLA:TPU can be well below
total_estimate; XLA:CPU reports the arguments
alone), the
parameter and optimizer-state bytes per device, the mesh, and the compiler's FLOP count if it gives
one (XLA counts a loop body once, so with scan_layers=true or gradient accumulation that figure is
far below the step's work; model_flops_per_device is the analytic count bench's MFU uses).
With --mode sampler it compiles instead the colocated sampler's generate program for `--batch`
prompts of `--prompt-len` ids and `--new-tokens` new ones, with the rollout_* sampling keys: the
same program, through the same compile cache, that generate runs on real weights of those
shardings; it also prints the KV cache's bytes (all rows), the bucketed block (rows, columns), the
decode weights' bytes (the sampler's copy per weight version) and sampling_bytes_per_device, what a
device holds while it samples: parameters, decode weights, the program's temporaries and outputs.
With --mode rm_score it compiles instead the forward `reward: rm` scores with (reward_model.scoring_forward,
through the same compile cache) for one full bucket: reward_model_batch_size texts of
reward_model_max_length tokens, padded to the rows the scorer pads them to (a power of two, a multiple
of the devices the batch splits over), a scalar-head model of the config's model keys on the trainer's
mesh (with reward_model_host_offload its parameters in host memory, which XLA:CPU does not tell apart
from the devices'); it prints the rows and length, the parameters' and the batch's bytes per device
(the program's arguments) and the compiler's memory. reward_model_path is not read: give the reward
model's architecture as the model keys (model_name=llama3.1-8b).
With teacher_path and mode=sft the update is offline distillation's, the teachers' forward in it
(tasks/teacher.py): teacher_path is not read either, each teacher an abstract model of the config's
model keys with the `--teacher key=value` overrides over them (a 32B teacher beside an 8B student:
`--teacher emb_dim=5120 --teacher mlp_dim=25600 ...`); teacher_params and teacher_bytes_per_device
(pinned host memory with teacher_host_offload) beside the student's.
load_parameters_path is not read (the shapes come from the model keys, which default to its architecture). To size
an N-device mesh on a CPU machine, make the process see N devices, e.g. for fsdp over 8:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python tools/bench.py configs/base.yml model_name=llama3.2-1b dtype=bfloat16 remat_policy=full \
        per_device_batch_size=1 max_target_length=2048 ici_fsdp_parallelism=8 --compile-only

The numbers are those of the backend that compiled (CPU above); an accelerator's compiler makes
different fusion and rematerialisation choices, so treat CPU temporaries as an estimate (XLA:CPU
computes bfloat16 matmuls in float32 and holds float32 copies of bfloat16 weights and gradients).
With `--topology NAME` it compiles instead for a TPU slice that need not be attached, as MaxText's
train_compile does: NAME is JAX's topology name (v5e:2x2, v5e:16x16, v5p:4x4x4, v6e:8x8), the
config's mesh spans its devices, the models take the TPU's kernels and layouts
(sharding.compile_for), and the figures are XLA:TPU's own. It needs the libtpu that jax names beside it
(`pip install 'jax[tpu]==<jax's version>'`, or ./setup.sh --tpu; another libtpu is refused in one line:
an older one fails to compile splash attention), not a TPU.

Exit 2 with `bench: <message>` for a config mistake, and for a program the compiler finds too big
for the device's memory (XLA:TPU, --topology included): one line with the bytes it needs and the
bytes the device has. XLA:CPU sets no such limit, so a CPU compile sizes any config.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import compile_cache, lora, metrics, modes, reward_model, sharding
from unitrain import step as step_lib
from unitrain.checks import load_checked
from unitrain.context import RunContext
from unitrain.data.preference import MARGIN
from unitrain.data.prompt_ids import Prompt
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines import mesh as rollout_mesh
from unitrain.engines.base import MeasuredSampler, SamplingParams, close
from unitrain.engines.buckets import batch_parallelism, bucket_prompt_length
from unitrain.engines.colocated import phase_ends
from unitrain.engines.factory import make_sampler
from unitrain.errors import ConfigError, UserError
from unitrain.models.scalar_head import build_scalar_model
from unitrain.optimizer import learning_rate_schedule, make_optimizer
from unitrain.rollout.groups import Group
from unitrain.rollout.workflow import Sampled, Transcript
from unitrain.run import build_model, build_run, device_layout
from unitrain.tasks import teacher
from unitrain.tasks.grpo import GRPOTask
from unitrain.tasks.sft import SFTTask
from unitrain.tasks.teacher import Teacher


def synthetic_batch(cfg, rows: int, seed: int = 0) -> dict:
    """This process's share of `rows` full rows: random tokens, one segment each, all targets weighted."""
    local = rows // jax.process_count()
    T = cfg.max_target_length
    tokens = np.random.default_rng(seed + jax.process_index()).integers(0, cfg.vocab_size, (local, T + 1), np.int32)
    ones = np.ones((local, T), np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (local, T)).copy()
    return {
        "inputs": tokens[:, :-1],
        "inputs_position": positions,
        "inputs_segmentation": ones,
        "targets": tokens[:, 1:],
        "targets_segmentation": ones.copy(),
    }


MODEL_KEYS = (
    "model_name",
    "model_family",
    "vocab_size",
    "emb_dim",
    "mlp_dim",
    "num_decoder_layers",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "weight_dtype",
)
RM_SCORE_KEYS = (
    "remat_policy",
    "scan_layers",
    "reward_model_batch_size",
    "reward_model_max_length",
    "reward_model_host_offload",
)
CONFIG_KEYS = MODEL_KEYS + (
    "remat_policy",
    "scan_layers",
    "per_device_batch_size",
    "gradient_accumulation_steps",
    "max_target_length",
)


def _abstract(shapes, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def abstract_model(make_model, mesh, rules) -> tuple:
    """(model, graphdef, params, their shardings) of the model `make_model` builds, built abstractly:
    the parameters are ShapeDtypeStructs in the shardings their logical axes give on `mesh`."""
    model = nnx.eval_shape(make_model)
    graphdef, shapes = nnx.split(model)
    try:
        param_shardings = sharding.logical_shardings(model.param_axes(), mesh, rules)
    except ValueError as e:  # a dimension that does not divide over its mesh axes: a config mistake
        raise ConfigError(str(e)) from None
    return model, graphdef, _abstract(nnx.to_pure_dict(shapes), param_shardings), param_shardings


def abstract_run(cfg) -> tuple[RunContext, dict]:
    """The run of `cfg` with every array abstract (ShapeDtypeStructs carrying the shardings
    build_run would give them): nothing is allocated and no weights are read."""
    layout = device_layout(cfg)
    mesh = sharding.trainer_mesh(cfg, layout)
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    model, graphdef, params, param_shardings = abstract_model(
        lambda: build_model(cfg.replace(load_parameters_path=""), mesh), mesh, rules
    )
    adapters_only = cfg.lora_rank > 0  # LoRA: the optimizer holds the adapters alone
    learning_rate = learning_rate_schedule(cfg, layout.optimizer_steps)
    optimizer = make_optimizer(cfg, lora.trainable(model.decay_mask(), adapters_only), learning_rate)
    trained, trained_shardings = (lora.trainable(t, adapters_only) for t in (params, param_shardings))
    opt_shardings = step_lib.opt_state_shardings(optimizer, trained, trained_shardings, mesh)
    if cfg.optimizer_host_offload:  # where step.init_state puts it
        opt_shardings = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_shardings)
    opt_state = _abstract(jax.eval_shape(optimizer.init, trained), opt_shardings)
    state = {
        "params": params,
        "opt_state": opt_state,
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh)),
    }
    run = RunContext(
        cfg=cfg,
        layout=layout,
        mesh=mesh,
        rollout_meshes=(),
        rules=rules,
        tokenizer=load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code),
        model=model,
        graphdef=graphdef,
        init_params=params,
        optimizer=optimizer,
        learning_rate=learning_rate,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        programs=compile_cache.CompileCache(mesh),
    )
    return run, state


def bytes_per_device(tree) -> int:
    """Bytes one device holds of these (abstract or concrete) arrays: the largest shard of each."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def update_batch(cfg, rows: int, shardings: dict) -> dict:
    """One update's batch of the config's mode (`rows` rows) as abstract arrays in `shardings`, at
    the longest rows the config allows (GRPO: the longest prompt and completion)."""

    def width(key):
        if cfg.mode != "grpo":
            return cfg.max_target_length
        prompt = bucket_prompt_length(cfg.max_prompt_length) if key.startswith("inputs") else 0
        return prompt + cfg.rollout_max_response_len

    def spec(key, where):
        floating = key in ("advantages", MARGIN) or key.endswith(("logprobs", "logps"))
        shape = (rows,) if len(where.spec) == 1 else (rows, width(key))
        return jax.ShapeDtypeStruct(shape, jnp.float32 if floating else jnp.int32, sharding=where)

    return {key: spec(key, where) for key, where in shardings.items()}


def libtpu_mismatch() -> str | None:
    """What is wrong with the installed libtpu for this jax, or None: jax's `tpu` extra names the
    libtpu its Pallas kernels are built for (an older one fails to compile splash attention)."""
    try:
        installed = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None  # no libtpu at all: topologies says so
    pins = [r.split(";")[0].strip() for r in metadata.requires("jax") or [] if r.startswith("libtpu") and "tpu" in r]
    wanted = pins[0].removeprefix("libtpu").lstrip("=") if pins else ""
    release = wanted.removesuffix(".*")  # ==0.0.50.* takes 0.0.50 and 0.0.50.1
    if not wanted or installed in (wanted, release) or (wanted.endswith(".*") and installed.startswith(release + ".")):
        return None
    return (
        f"libtpu {installed} is installed and jax {jax.__version__} is built for libtpu {wanted}; "
        f"pip install 'jax[tpu]=={jax.__version__}' (or ./setup.sh --tpu) installs it"
    )


def tpu_topology(name: str) -> list:
    """The devices of the TPU slice `name` (e.g. v5e:2x2), for compiling ahead of time without it;
    each host holds up to 2 x 2 chips, as a v4, v5e, v5p or v6e host does."""
    from jax.experimental import topologies

    version, _, shape = name.partition(":")
    try:
        chips = [int(n) for n in shape.split("x")]
    except ValueError:
        chips = []
    if not version or not 2 <= len(chips) <= 3 or min(chips) < 1:
        raise ConfigError(f"--topology {name!r}: expected a TPU version and its chips, e.g. v5e:2x2 or v5p:2x2x2")
    per_host = (min(chips[0], 2), min(chips[1], 2), 1)
    mismatch = libtpu_mismatch()
    if mismatch:
        raise ConfigError(f"--topology: {mismatch}")
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu", chips_per_host_bounds=per_host).devices
    except RuntimeError as e:  # includes XLA's JaxRuntimeError for a topology libtpu does not know
        first = str(e).splitlines()[0]
        if "not installed" in first:
            raise ConfigError(
                f"--topology needs libtpu beside jax (pip install 'jax[tpu]=={jax.__version__}'): {first}"
            ) from None
        raise ConfigError(f"--topology {name!r}: {first}") from None


def compile_only(cfg, teacher_cfg=None) -> dict:
    """Compiles one optimizer update of the config's mode (sft, dpo, grpo) on abstract state and
    batch; with teacher_path (mode=sft) its teachers abstract models of `teacher_cfg`'s architecture;
    returns the compiler's per-device memory."""
    run, state = abstract_run(cfg.replace(eval_interval=0))
    mesh = run.mesh
    if cfg.teacher_path:
        if cfg.mode != "sft":
            raise ConfigError(
                f"--compile-only sizes a teacher in mode=sft's update (offline distillation), not in mode={cfg.mode}'s"
            )
        task = SFTTask(run, abstract_teachers(run, teacher_cfg or cfg))
    else:
        task = modes.create(run)
    teachers = tuple(t.params for t in task.scorers) if cfg.teacher_path else ()
    shardings = task.batch_shardings()
    update = run.make_update(task.loss, shardings, tuple(jax.tree.map(lambda x: x.sharding, t) for t in teachers))
    batch = update_batch(cfg, run.layout.rows_per_update, shardings)
    start = time.perf_counter()
    compiled = run.programs.compiled(f"{cfg.mode} update", update, state, batch, *teachers)
    compile_seconds = time.perf_counter() - start
    return {
        "compile_only": True,
        "num_params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
        "param_bytes_per_device": bytes_per_device(state["params"]),
        "opt_state_bytes_per_device": bytes_per_device(state["opt_state"]),
        "teacher_params": [int(sum(x.size for x in jax.tree.leaves(t))) for t in teachers],
        "teacher_bytes_per_device": bytes_per_device(teachers),
        "memory_per_device": memory_per_device(compiled),
        "cost_analysis_flops": compiler_flops(compiled),
        "model_flops_per_device": sum(
            run.model.flops_per_token(x.shape[1]) * x.size for key, x in batch.items() if key.endswith("inputs")
        )
        / mesh.size,
        "compile_seconds": compile_seconds,
        "config": {k: cfg[k] for k in CONFIG_KEYS}
        | {
            "mode": cfg.mode,
            "global_batch_rows": run.layout.rows_per_update,
            "mesh_shape": dict(mesh.shape),
            "device_kind": mesh.devices.flat[0].device_kind,
            "num_devices": mesh.size,
            "platform": mesh.devices.flat[0].platform,
        },
    }


def abstract_teachers(run, teacher_cfg) -> list[Teacher]:
    """The config's teachers (teacher_path is not read) as abstract models of `teacher_cfg`'s model
    keys on the run's mesh, in pinned host memory with teacher_host_offload, as load_teacher keeps them."""
    model, _, params, shardings = abstract_model(
        lambda: build_model(teacher_cfg.replace(load_parameters_path=""), run.mesh), run.mesh, run.rules
    )
    if run.cfg.teacher_host_offload:
        params = _abstract(params, jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings))
    return [Teacher(model, params, f"teacher_logprobs_{i}", w) for i, w in enumerate(teacher.weights(run.cfg))]


def compiler_flops(compiled) -> float | None:
    """The compiler's FLOP count of the program (None where the backend gives none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        cost = None
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    flops = cost.get("flops") if cost else None
    return float(flops) if flops is not None else None


def rm_score_program(cfg) -> tuple:
    """(jitted forward, abstract parameters, abstract (tokens, positions, segment ids), mesh)
    of one full reward-model bucket: reward_model_batch_size texts of reward_model_max_length tokens,
    padded to the rows the scorer pads them to (reward_model.score_batches), on the scorer's mesh and
    shardings. The reward model is a scalar-head model of the config's model keys (no weights read),
    its parameters in host memory with reward_model_host_offload, as RewardModelScorer keeps them."""
    mesh = sharding.trainer_mesh(cfg, device_layout(cfg))
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    _, graphdef, params, param_shardings = abstract_model(
        lambda: build_scalar_model(cfg.replace(load_parameters_path=""), mesh, ""), mesh, rules
    )
    forward = reward_model.scoring_forward(graphdef, params, cfg.reward_model_host_offload)
    if cfg.reward_model_host_offload:
        params = _abstract(params, jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), param_shardings))
    texts, length = cfg.reward_model_batch_size, cfg.reward_model_max_length
    ((_, length, rows),) = reward_model.score_batches([length] * texts, length, texts, batch_parallelism(mesh, rules))
    column = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding.batch_sharding(mesh, rules))
    return forward, params, (column,) * 3, mesh


def compile_rm_score(cfg) -> dict:
    """Compiles reward_model.py's scoring forward for one full bucket (rm_score_program) on
    abstract weights; returns the compiler's per-device memory, the parameters' and the batch's bytes."""
    forward, params, batch, mesh = rm_score_program(cfg)
    start = time.perf_counter()
    rows, length = batch[0].shape
    compiled = compile_cache.CompileCache(mesh).compiled(
        f"reward model (rows {rows} x {length})", forward, params, *batch
    )
    compile_seconds = time.perf_counter() - start
    return {
        "compile_only": True,
        "mode": "rm_score",
        "rows": rows,
        "length": length,
        "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
        "param_bytes_per_device": bytes_per_device(params),
        "batch_bytes_per_device": bytes_per_device(batch),
        "memory_per_device": memory_per_device(compiled),
        "cost_analysis_flops": compiler_flops(compiled),
        "compile_seconds": compile_seconds,
        "config": {k: cfg[k] for k in MODEL_KEYS + RM_SCORE_KEYS}
        | {
            "mesh_shape": dict(mesh.shape),
            "device_kind": mesh.devices.flat[0].device_kind,
            "num_devices": mesh.size,
            "platform": mesh.devices.flat[0].platform,
        },
    }


def memory_per_device(compiled) -> dict | None:
    """The compiler's memory analysis of one device's program, in bytes (None where it gives none)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    per_device = {
        name: int(getattr(memory, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "temp", "generated_code", "alias")
    }
    # In host memory (optimizer_host_offload, reward_model_host_offload); XLA:TPU's peak counts it,
    # the device's peak here does not.
    host = {
        name: int(getattr(memory, f"host_{name}_size_in_bytes")) for name in ("argument", "output", "temp", "alias")
    }
    per_device["host_argument"], per_device["host_temp"] = host["argument"], host["temp"]
    per_device["total_estimate"] = (
        per_device["argument"] + per_device["output"] + per_device["temp"] - per_device["alias"]
    )
    per_device["peak"] = int(memory.peak_memory_in_bytes) - (
        host["argument"] + host["output"] + host["temp"] - host["alias"]
    )
    return per_device


def compile_sampler(cfg, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Compiles the colocated sampler's generate program for `batch` prompts of `prompt_len` ids,
    `new_tokens` each, with the config's sampling flags, on abstract weights in the shardings
    training gives them; returns the compiler's per-device memory and the KV cache's bytes."""
    if cfg.sampler != "colocated":
        raise ConfigError(
            f"--compile-only --mode sampler compiles the colocated sampler's program, not sampler={cfg.sampler}"
            " (for the rollout mesh's, give the mesh keys its shape)"
        )
    run, state = abstract_run(cfg.replace(eval_interval=0))
    sampler = make_sampler(run)
    sampler.update_weights(state["params"], 0)
    prompts = random_prompts(batch, prompt_len, run.model.vocab_size, cfg.seed)
    start = time.perf_counter()
    call = sampler.generate_call(prompts, rollout_sampling(cfg, new_tokens), jax.random.key(0))
    compiled = sampler.generate_program(call)
    compile_seconds = time.perf_counter() - start
    rows, columns = call.key.rows, call.key.prompt_columns
    params, decode = bytes_per_device(state["params"]), bytes_per_device(sampler.decode_weights())
    memory = memory_per_device(compiled)
    # The program's arguments are the weights it reads (often the decode weights and the embedding
    # alone); while it samples, a device holds all the parameters, the decode weights and its temporaries.
    holds = params + decode + memory["temp"] + memory["output"] if memory else None
    return {
        "compile_only": True,
        "mode": "sampler",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "block_shape": [rows, columns],
        "param_bytes_per_device": params,
        "decode_weight_bytes_per_device": decode,
        "sampling_bytes_per_device": holds,
        "kv_cache_bytes": cache_bytes(run.model, rows, columns + new_tokens),
        "memory_per_device": memory,
        "compile_seconds": compile_seconds,
        "config": {k: cfg[k] for k in MODEL_KEYS}
        | {
            "mesh_shape": dict(run.mesh.shape),
            "num_devices": run.mesh.size,
            "platform": run.mesh.devices.flat[0].platform,
        },
    }


def sft_step(cfg) -> list:
    """[run, the SFT task's compiled step, the train state, a synthetic batch of one update's rows]."""
    run, state = build_run(cfg.replace(eval_interval=0))
    task = modes.create(run)
    batch = sharding.local_rows_to_global(synthetic_batch(cfg, run.layout.rows_per_update), task.batch_shardings())
    return [run, run.programs.compiled("train_step", task.update, state, batch), state, batch]


def bench(cfg, steps: int, warmup: int, cfg_b=None) -> dict:
    """SFT steps of `cfg` (A) and of `cfg_b` (B; None: A alone) in turn, A B A B, each on its own
    synthetic batch (the same rows where both have as many: the same seed)."""
    sides = [sft_step(c) for c in (cfg, cfg_b) if c is not None]
    times, losses = tuple([] for _ in sides), [None] * len(sides)
    for i in range(warmup + steps):
        for k, (side, series) in enumerate(zip(sides, times)):
            start = time.perf_counter()
            side[2], step_metrics = side[1](side[2], side[3])
            losses[k] = float(step_metrics["loss"])  # waits for the step
            if i >= warmup:
                series.append(time.perf_counter() - start)
    result = sft_result(cfg, sides[0][0], sides[0][2], times[0], losses[0], steps, warmup)
    if cfg_b is not None:
        run_b, a, b = sides[1][0], times[0], times[1]
        result["against"] = {
            "mesh_shape": dict(run_b.mesh.shape),
            "global_batch_rows": run_b.layout.rows_per_update,
            "step_time_median": statistics.median(b),
            "step_times": b,
            "tokens_per_sec": run_b.layout.rows_per_update * cfg_b.max_target_length / statistics.median(b),
            "final_loss": losses[1],
            "speedup_median": statistics.median(x / y for x, y in zip(a, b)),
        }
    return result


def sft_result(cfg, run, state, times: list, loss: float, steps: int, warmup: int) -> dict:
    """A's figures: its step times, throughput and MFU."""
    num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    rows = run.layout.rows_per_update
    peak = metrics.peak_flops_per_device(cfg)
    flops_per_token = run.model.flops_per_token(cfg.max_target_length)
    median = statistics.median(times)
    tokens_per_sec = rows * cfg.max_target_length / median
    return {
        "num_params": int(num_params),
        "config": {k: cfg[k] for k in CONFIG_KEYS}
        | {
            "global_batch_rows": rows,
            "mesh_shape": dict(run.mesh.shape),
            "device_kind": jax.devices()[0].device_kind,
            "num_devices": run.mesh.size,
            "steps": steps,
            "warmup": warmup,
        },
        "step_time_median": median,
        "step_time_min": min(times),
        "step_time_max": max(times),
        "tokens_per_sec": tokens_per_sec,
        "model_flops_per_token": flops_per_token,
        "model_flops_per_sec_per_device": tokens_per_sec * flops_per_token / run.mesh.size,
        "matmul_peak_flops_per_device": peak,
        "peak_source": "config" if cfg.peak_flops_per_device is not None else f"jnp.dot {cfg.matmul_peak_size}",
        "mfu": metrics.mfu(tokens_per_sec, flops_per_token, peak, run.mesh.size),
        "final_loss": loss,
    }


# ---------------------------------------------------------------- rollouts and RL steps


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random ids in [1, vocab) (0 is often the pad id)."""
    return np.random.default_rng(seed).integers(1, vocab, (n, length)).tolist()


def rollout_sampling(cfg, new_tokens: int, budgets: tuple[int, ...] = ()) -> SamplingParams:
    """The config's rollout sampling flags, `new_tokens` per row (or each row's of `budgets`) and no stop token."""
    sampling = SamplingParams.from_config(cfg, stop_token_ids=(), max_new_tokens=new_tokens)
    return dataclasses.replace(sampling, row_budgets=budgets)


def long_tail_budgets(rows: int, new_tokens: int, seed: int) -> tuple[int, ...]:
    """Per-row token budgets of a long-tailed round: one row in 16 (at least one) runs to `new_tokens`,
    the others draw geometric lengths of mean new_tokens / 8 (capped at new_tokens)."""
    rng = np.random.default_rng(seed)
    budgets = np.minimum(new_tokens, rng.geometric(min(1.0, 8 / new_tokens), rows))
    budgets[rng.permutation(rows)[: max(1, rows // 16)]] = new_tokens
    return tuple(int(b) for b in budgets)


def bench_sampler(
    cfg, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int, long_tail: bool = False
) -> dict:
    """Tokens/s of the configured sampler: `batch` prompts of `prompt_len` random ids, `new_tokens`
    each, no stop token (every row runs to the end); a call is timed from the ids to decoded text.

    The decode step's time is the call's minus a one-token call's (the prefill and set-up), over
    the other new_tokens - 1 tokens; its bytes are what one decode step reads at least: every
    weight in the compute dtype and the KV cache its phase attends over (rollout_cache_phases),
    averaged over the steps. With `long_tail` each row samples its long_tail_budgets tokens (a
    long-tailed round) and the decode step is not split off.
    """
    run, state = build_run(cfg.replace(eval_interval=0))
    sampler = make_sampler(run)
    sampler.update_weights(state["params"], 0)
    prompts = random_prompts(batch, prompt_len, run.model.vocab_size, cfg.seed)
    budgets = long_tail_budgets(batch, new_tokens, cfg.seed) if long_tail else ()

    def timed_calls(n_new: int) -> tuple[list[float], int]:
        sampling = rollout_sampling(cfg, n_new, budgets if n_new == new_tokens else ())
        times, generated = [], set()
        for i in range(warmup + reps):
            seconds, out = timed_generate(sampler, prompts, sampling, jax.random.key(i), run.tokenizer)
            times.append(seconds)
            generated.add(int(out.lengths.sum()))
        (tokens,) = generated  # every call generates every row to the end
        return times[warmup:], tokens

    times, tokens = timed_calls(new_tokens)
    median = statistics.median(times)
    result = {
        "mode": "sampler",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tokens_per_call": tokens,
        "tokens_per_sec": tokens / median,
        "call_time_median": median,
        "call_times": times,
        "sampler": cfg.sampler,
        "device_kind": jax.devices()[0].device_kind,
        "num_devices": run.mesh.size,
    }
    if long_tail:
        result["row_budgets"] = budgets
    elif new_tokens > 1 and hasattr(sampler, "block_shape"):  # the JAX samplers' decode step
        first = statistics.median(timed_calls(1)[0])
        step_time = (median - first) / (new_tokens - 1)
        rows, columns = sampler.block_shape(batch, prompt_len)
        step_bytes = decode_bytes_per_step(
            run.model, state["params"], cfg.dtype, rows, columns, new_tokens, cfg.rollout_cache_phases
        )
        bandwidth = metrics.measure_memory_bandwidth()
        result |= {
            "first_token_call_time_median": first,
            "decode_step_time": step_time,
            "decode_tokens_per_sec": batch / step_time,
            "decode_bytes_per_step": step_bytes,
            "memory_bandwidth_per_device": bandwidth,
            "decode_bandwidth_fraction": step_bytes / step_time / (bandwidth * run.mesh.size),
        }
    close(sampler)
    return result


def timed_generate(sampler, prompts, sampling, key, tokenizer):
    """(seconds from the ids to decoded text, the Completions) of one generate call."""
    start = time.perf_counter()
    out = sampler.generate(prompts, sampling, key)
    [tokenizer.decode(t[:n]) for t, n in zip(out.tokens, out.lengths)]
    return time.perf_counter() - start, out


def bench_sampler_against(
    cfg, cfg_b, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int, long_tail: bool = False
) -> dict:
    """The samplers of `cfg` (A) and `cfg_b` (B) called in turn on the same prompts and keys (with
    `long_tail`, the same long_tail_budgets)."""
    budgets = long_tail_budgets(batch, new_tokens, cfg.seed) if long_tail else ()
    runs = [build_run(c.replace(eval_interval=0)) for c in (cfg, cfg_b)]  # each compiles its own programs
    samplers = []
    for (run, state), c in zip(runs, (cfg, cfg_b)):
        sampler = make_sampler(run)
        sampler.update_weights(state["params"], 0)
        samplers.append((sampler, rollout_sampling(c, new_tokens, budgets)))
    tokenizer = runs[0][0].tokenizer
    prompts = random_prompts(batch, prompt_len, runs[0][0].model.vocab_size, cfg.seed)
    times, same = ([], []), True
    for i in range(warmup + reps):
        outs = []
        for (sampler, sampling), series in zip(samplers, times):
            seconds, out = timed_generate(sampler, prompts, sampling, jax.random.key(i), tokenizer)
            series.append(seconds)
            outs.append(out.tokens)
        same &= bool((outs[0] == outs[1]).all())
    for sampler, _ in samplers:
        close(sampler)
    a, b = (t[warmup:] for t in times)
    tokens = sum(budgets) if long_tail else batch * new_tokens  # no stop token: every row runs to its budget
    return {
        "mode": "sampler",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "row_budgets": budgets,
        "tokens_per_sec": tokens / statistics.median(a),
        "call_times": a,
        "against": {
            "tokens_per_sec": tokens / statistics.median(b),
            "call_times": b,
            "speedup_median": statistics.median(x / y for x, y in zip(a, b)),
            "same_tokens": same,
        },
        "device_kind": jax.devices()[0].device_kind,
    }


def bench_chunked(cfg, batch: int, prompt_len: int, new_tokens: int, chunk: int, reps: int, warmup: int) -> dict:
    """Interruptible generation's two ways, side by side: `new_tokens` per row in one call (A: what a
    continuation on the kept KV cache decodes, its lower bound) against the same rows served `chunk`
    tokens a call, each call re-prefilling the prompt and the tokens so far (B: rollout_chunk_tokens,
    what the driver does so that a push between calls continues under the new weights)."""
    run, state = build_run(cfg.replace(eval_interval=0))
    sampler = make_sampler(run)
    sampler.update_weights(state["params"], 0)
    prompts = random_prompts(batch, prompt_len, run.model.vocab_size, cfg.seed)
    whole, piece = rollout_sampling(cfg, new_tokens), rollout_sampling(cfg, chunk)

    def chunked(key):
        contexts = [list(p) for p in prompts]
        for c in range(math.ceil(new_tokens / chunk)):
            out = sampler.generate(contexts, piece, jax.random.fold_in(key, c))
            contexts = [ctx + t[:n].tolist() for ctx, t, n in zip(contexts, out.tokens, out.lengths)]

    times = ([], [])
    for i in range(warmup + reps):
        for series, call in zip(times, (lambda k: sampler.generate(prompts, whole, k), chunked)):
            start = time.perf_counter()
            call(jax.random.key(i))
            series.append(time.perf_counter() - start)
    close(sampler)
    a, b = (t[warmup:] for t in times)
    return {
        "mode": "sampler",
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "chunk_tokens": chunk,
        "one_call_time_median": statistics.median(a),
        "chunked_time_median": statistics.median(b),
        "chunked_over_one_call_median": statistics.median(y / x for x, y in zip(a, b)),
        # every row samples all new_tokens (no stop token)
        "one_call_tokens_per_s": batch * new_tokens / statistics.median(a),
        "chunked_tokens_per_s": batch * new_tokens / statistics.median(b),
        "call_times": a,
        "chunked_times": b,
        "device_kind": jax.devices()[0].device_kind,
    }


def decode_bytes_per_step(
    model, params, dtype: str, rows: int, prompt_columns: int, new_tokens: int, phases: int
) -> float:
    """Bytes one decode step reads, averaged over the new_tokens - 1 steps: every parameter in the
    compute `dtype` (as the sampler applies them; an untied input table is counted whole, though a
    step reads a row per sequence) and the KV cache its phase attends over (engines/colocated.py):
    `rows` x (`prompt_columns` + the phase's last token count) positions."""
    weights = sum(x.size for x in jax.tree.leaves(params)) * jnp.dtype(dtype).itemsize
    ends = phase_ends(new_tokens, phases)
    spans = [(end, end - max(start, 1)) for start, end in zip([0, *ends], ends)]  # the loop runs tokens 1..N-1
    cache = sum(steps * cache_bytes(model, rows, prompt_columns + end) for end, steps in spans)
    return weights + cache / max(1, new_tokens - 1)


def cache_bytes(model, rows: int, length: int) -> int:
    """Bytes of the model's whole KV cache for `rows` x `length` positions (nothing allocated)."""
    cache = jax.eval_shape(lambda: model.init_cache(rows, length))
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


class _SamePrompts:
    """A prompt stream of one batch, again and again (nothing to checkpoint)."""

    def __init__(self, batch: dict):
        self.batch = batch

    def __next__(self) -> dict:
        return self.batch

    def get_state(self):
        return None


def bench_grpo(cfg, prompts: int, samples: int, prompt_len: int, new_tokens: int, steps: int, warmup: int) -> dict:
    """Time of whole GRPO steps (rollout, rewards, advantages, logprobs, update) on random prompts of
    `prompt_len` ids, `samples` completions of `new_tokens` each (no stop token)."""
    cfg = cfg.replace(
        mode="grpo",
        rollout_batch_size=prompts,
        n_samples_per_prompt=samples,
        eval_interval=0,
        steps=warmup + steps,
        rollout_max_response_len=new_tokens,
        max_prompt_length=max(cfg.max_prompt_length, prompt_len),
    )
    run, state = build_run(cfg)
    batch = [Prompt(tuple(ids), "", "") for ids in random_prompts(prompts, prompt_len, run.model.vocab_size, cfg.seed)]
    task = GRPOTask(
        run, prompts=_SamePrompts({"num_dropped": 0, "prompts": batch}), sampling=rollout_sampling(cfg, new_tokens)
    )
    times, parts = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        state, step_metrics = task.step(state, step)
        step_metrics = jax.device_get(step_metrics)
        times.append(time.perf_counter() - start)
        parts.append(
            {k: float(step_metrics[k]) for k in ("time_rollout", "time_weight_push", "time_logprob", "time_update")}
        )
    task.close()
    timed = parts[warmup:]
    return {
        "mode": "grpo",
        "prompts": prompts,
        "samples": samples,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "step_time_median": statistics.median(times[warmup:]),
        "step_times": times[warmup:],
        **{k: statistics.median(p[k] for p in timed) for k in timed[0]},
        "kl_coef": cfg.kl_coef,
        "sampler": cfg.sampler,
        "max_staleness": cfg.max_staleness,
        "old_logprob_pass": task.separate_old,
        "shared_prompt_rows": task.group_rows,
        "device_kind": jax.devices()[0].device_kind,
        "num_devices": run.mesh.size,
        "rollout_devices": cfg.rollout_devices,
    }


def long_tailed_groups(
    prompts: int, samples: int, prompt_lens: tuple[int, int], new_tokens: int, vocab: int, long_fraction: float, seed=0
) -> list[Group]:
    """A GRPO round whose completion lengths are long-tailed: each completion `new_tokens` long with
    probability `long_fraction`, else 1 to new_tokens // 4 (at least 1); prompts of
    prompt_lens[0] .. prompt_lens[1] ids. Random ids in [3, vocab), sampler logprobs in [-6, -1]
    and normal rewards."""
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(prompts):
        ids = tuple(int(t) for t in rng.integers(3, vocab, size=int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))))
        short = rng.integers(1, max(2, new_tokens // 4 + 1), size=samples)
        lengths = np.where(rng.random(samples) < long_fraction, new_tokens, short).astype(np.int32)
        mask = (np.arange(new_tokens) < lengths[:, None]).astype(np.int32)
        tokens = rng.integers(3, vocab, size=(samples, new_tokens)).astype(np.int32) * mask
        logprobs = (rng.uniform(-6.0, -1.0, size=(samples, new_tokens)) * mask).astype(np.float32)
        rewards = rng.normal(size=samples).astype(np.float32)
        rows = []
        for t, lp, n, reward in zip(tokens, logprobs, lengths, rewards):
            transcript = Transcript(ids)
            transcript.add_sampled(Sampled(t[:n], lp[:n], np.zeros(n, np.int32), True))
            rows.append(transcript.trajectory(reward, "stop"))
        groups.append(Group(Prompt(ids, "", ""), tuple(rows), rewards, {}))
    return groups


def bench_grpo_round(
    cfg, cfg_b, prompts: int, samples: int, prompt_len: int, new_tokens: int, long_fraction, steps, warmup
) -> dict:
    """GRPO steps of `cfg` (A) and `cfg_b` (B; None: A alone) in turn on one long-tailed round."""
    cfgs = [c for c in (cfg, cfg_b) if c is not None]
    cfgs = [
        c.replace(
            mode="grpo",
            rollout_batch_size=prompts,
            n_samples_per_prompt=samples,
            eval_interval=0,
            rollout_max_response_len=new_tokens,
            max_prompt_length=max(c.max_prompt_length, prompt_len),
        )
        for c in cfgs
    ]
    runs = [build_run(c) for c in cfgs]
    vocab = runs[0][0].model.vocab_size
    groups = long_tailed_groups(prompts, samples, (prompt_len, prompt_len), new_tokens, vocab, long_fraction, cfg.seed)
    sides = []
    for run, state in runs:
        task = GRPOTask(run, prompts=_SamePrompts({"num_dropped": 0, "prompts": []}))
        task.rollouts.prepare_batch = lambda step, push: (groups, {})
        sides.append([task, task.train_state(state)])
    times, parts = tuple([] for _ in sides), tuple([] for _ in sides)
    for step in range(warmup + steps):
        for side, series, split in zip(sides, times, parts):
            start = time.perf_counter()
            side[1], metrics = side[0].step(side[1], step)
            metrics = jax.device_get(metrics)
            series.append(time.perf_counter() - start)
            split.append({k: float(metrics[k]) for k in ("time_logprob", "time_update")})
    medians = [{k: statistics.median(p[k] for p in split[warmup:]) for k in split[0]} for split in parts]
    lengths = np.asarray([len(t.ids) for g in groups for t in g.trajectories])
    result = {
        "mode": "grpo_round",
        "sequences": int(lengths.size),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "completion_tokens": int(lengths.sum()),
        "completion_columns": int(lengths.size * bucket_prompt_length(lengths.max())),
        "step_time_median": statistics.median(times[0][warmup:]),
        "step_times": times[0][warmup:],
        **medians[0],
        "rl_packing": cfgs[0].rl_packing,
        "device_kind": jax.devices()[0].device_kind,
        "num_devices": runs[0][0].mesh.size,
    }
    if cfg_b is not None:
        a, b = times[0][warmup:], times[1][warmup:]
        result["against"] = {
            "step_time_median": statistics.median(b),
            "step_times": b,
            **medians[1],
            "speedup_median": statistics.median(x / y for x, y in zip(a, b)),
            "rl_packing": cfgs[1].rl_packing,
        }
    return result


def bench_push(cfg, steps: int, warmup: int) -> dict:
    """Time of update_weights: sampler=mesh copies the parameters to the rollout mesh; sampler=vllm
    and sglang export them and have their server reload them (the first push starts the server: a
    warm-up)."""
    if cfg.sampler not in ("mesh", "vllm", "sglang"):
        raise ConfigError("--mode push times the weight push of sampler=mesh, vllm or sglang")
    run, state = build_run(cfg)
    params = state["params"]
    del state  # the optimizer's moments (twice the parameters): a push needs the parameters alone
    sampler = make_sampler(run)
    times, parts, via_hosts = [], [], []
    for version in range(warmup + steps):
        start = time.perf_counter()
        sampler.update_weights(params, version)
        times.append(sampler.push_seconds if cfg.sampler == "mesh" else time.perf_counter() - start)
        parts.append(
            {k: v for k, v in sampler.metrics().items() if k.startswith("time_")}
            if isinstance(sampler, MeasuredSampler)
            else {}
        )
        if cfg.sampler == "mesh":  # the multi-process path (each parameter through the hosts), in one process
            start = time.perf_counter()
            jax.block_until_ready(rollout_mesh.through_hosts(params, sampler.shardings))
            via_hosts.append(time.perf_counter() - start)
    close(sampler)
    median = statistics.median(times[warmup:])
    gigabytes = sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9
    result = {
        "mode": "push",
        "sampler": cfg.sampler,
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "weight_dtype": cfg.weight_dtype,
        "gigabytes": gigabytes,
        "push_seconds_median": median,
        "push_times": times[warmup:],
        "gigabytes_per_sec": gigabytes / median,
        **{f"{k}_median": statistics.median(p[k] for p in parts[warmup:]) for k in parts[-1]},
        "trainer_mesh": dict(run.mesh.shape),
        "processes": jax.process_count(),
        "device_kind": jax.devices()[0].device_kind,
    }
    if via_hosts:
        result |= {
            "through_hosts_seconds_median": statistics.median(via_hosts[warmup:]),
            "rollout_mesh": dict(run.rollout_meshes[0].shape),
            "rollout_meshes": len(run.rollout_meshes),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", help="[CONFIG_YML] [key=value ...]")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the step on abstract arrays and print its memory per device; run nothing",
    )
    parser.add_argument(
        "--mode",
        choices=("sft", "sampler", "grpo", "grpo_round", "push", "rm_score"),
        default="sft",
        help="sft: the train step | sampler: rollout tokens/s | grpo: whole GRPO steps | "
        "push: the weight push of sampler=mesh | rm_score: the reward model's scoring forward (--compile-only)",
    )
    parser.add_argument("--batch", type=int, default=16, help="sampler: prompts per call")
    parser.add_argument(
        "--long-fraction", type=float, default=0.125, help="grpo_round: the fraction of completions --new-tokens long"
    )
    parser.add_argument("--prompts", type=int, default=4, help="grpo: prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="grpo: completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=64, help="sampler, grpo: prompt ids")
    parser.add_argument("--new-tokens", type=int, default=128, help="sampler, grpo: tokens generated per completion")
    parser.add_argument(
        "--long-tail",
        action="store_true",
        help="sampler: a long-tailed round, each row its own token budget (1 in 16 rows runs to --new-tokens)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="sampler: also serve the rows this many tokens a call (re-prefilled), A B A B against one call",
    )
    parser.add_argument(
        "--topology",
        metavar="NAME",
        help="with --compile-only: compile for this TPU slice (JAX's name, e.g. v5e:2x2) ahead of time",
    )
    parser.add_argument(
        "--teacher",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--compile-only with mode=sft and teacher_path (not read): the teachers' model keys over the config's "
        "(repeat for several)",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sft, sampler, grpo_round: also time the config with this override (repeat for several), A B A B in one process",
    )
    opts = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    args = opts.args
    if not args or "=" in args[0]:
        args = ["configs/base.yml", *args]
    try:
        if opts.steps < 1 or opts.warmup < 0:
            raise ConfigError("--steps must be >= 1 and --warmup >= 0")
        if opts.topology and not opts.compile_only:
            raise ConfigError("--topology compiles for a TPU slice that is not here: it needs --compile-only")
        with sharding.compile_for(tpu_topology(opts.topology)) if opts.topology else contextlib.nullcontext():
            result = run_mode(opts, args)
    except UserError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    text = json.dumps(result)
    print(text, flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
    return 0


def run_mode(opts, args: list[str]) -> dict:
    """The result of the benchmark or compile the options ask for."""
    cfg = load_checked(args)
    if opts.long_tail and (opts.mode != "sampler" or opts.compile_only):
        raise ConfigError("--long-tail times a long-tailed sampler round: --mode sampler, without --compile-only")
    if opts.against and (opts.mode not in ("sft", "sampler", "grpo_round") or opts.compile_only):
        raise ConfigError(
            "--against times two configs side by side: --mode sft, sampler or grpo_round, without --compile-only"
        )
    if opts.mode == "grpo_round":
        if opts.compile_only or not 0 <= opts.long_fraction <= 1:
            raise ConfigError("--mode grpo_round times steps (no --compile-only) with --long-fraction in [0, 1]")
        cfg_b = load_checked([*args, *opts.against]) if opts.against else None
        shape = (opts.prompts, opts.samples, opts.prompt_len, opts.new_tokens, opts.long_fraction)
        return bench_grpo_round(cfg, cfg_b, *shape, opts.steps, opts.warmup)
    if opts.compile_only and opts.mode == "push":
        raise ConfigError(
            "--compile-only compiles a program: --mode sft (with mode=dpo or mode=rm for their updates), grpo, "
            "sampler or rm_score"
        )
    if opts.mode == "rm_score":
        if not opts.compile_only:
            raise ConfigError(
                "--mode rm_score sizes the reward model's scoring program: it needs --compile-only "
                "(a run's rm/completions_per_sec times the scoring)"
            )
        return compile_rm_score(cfg)
    if opts.mode == "push":
        return bench_push(cfg, opts.steps, opts.warmup)
    if opts.mode == "sampler" and opts.compile_only:
        return compile_sampler(cfg, opts.batch, opts.prompt_len, opts.new_tokens)
    if opts.mode == "sampler" and opts.chunk_tokens:
        if opts.against or opts.long_tail or not 0 < opts.chunk_tokens < opts.new_tokens:
            raise ConfigError("--chunk-tokens C times one sampler config, 0 < C < --new-tokens, no --long-tail")
        shape = (opts.batch, opts.prompt_len, opts.new_tokens, opts.chunk_tokens)
        return bench_chunked(cfg, *shape, opts.steps, opts.warmup)
    if opts.mode == "sampler" and opts.against:
        return bench_sampler_against(
            cfg,
            load_checked([*args, *opts.against]),
            opts.batch,
            opts.prompt_len,
            opts.new_tokens,
            opts.steps,
            opts.warmup,
            opts.long_tail,
        )
    if opts.mode == "sampler":
        return bench_sampler(cfg, opts.batch, opts.prompt_len, opts.new_tokens, opts.steps, opts.warmup, opts.long_tail)
    if opts.teacher and not (opts.compile_only and cfg.teacher_path):
        raise ConfigError(
            "--teacher gives the shape of teacher_path's teachers: it needs teacher_path and --compile-only"
        )
    if opts.compile_only:
        teacher_cfg = load_checked([*args, *opts.teacher]) if opts.teacher else None
        return compile_only(cfg.replace(mode=opts.mode) if opts.mode == "grpo" else cfg, teacher_cfg)
    if opts.mode == "grpo":
        return bench_grpo(cfg, opts.prompts, opts.samples, opts.prompt_len, opts.new_tokens, opts.steps, opts.warmup)
    return bench(cfg, opts.steps, opts.warmup, load_checked([*args, *opts.against]) if opts.against else None)


if __name__ == "__main__":
    sys.exit(main())
