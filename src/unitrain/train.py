"""The entry point: config -> mesh -> model -> data -> jitted step -> loop.

    python -m unitrain.train configs/base.yml [key=value ...]

Read top to bottom: `main` turns user mistakes into one line and exit status 2; `train` builds
everything once, then runs the loop, where metrics of step s are fetched while step s+1 runs, so the
host never waits on the device except at checkpoints and evals.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from unitrain import checkpoint, data, distributed, losses, metrics, sharding
from unitrain import model as model_lib
from unitrain.config import ConfigError, load_config, write_config
from unitrain.optimizer import learning_rate_schedule, make_optimizer

log = logging.getLogger("unitrain")

EXIT_USER_ERROR, EXIT_NAN, EXIT_SIGTERM = 2, 3, 143


class NonFiniteLoss(RuntimeError):
    pass


# ---------------------------------------------------------------- model and state

def build_model(cfg, mesh) -> nnx.Module:
    """The decoder with its parameters placed in their shardings: random init, HF weights, or the
    parameters of an orbax checkpoint (`load_parameters_path`)."""
    model_cfg = model_lib.ModelConfig.from_config(cfg)
    # Checked on the abstract model, before any parameter is materialised.
    _check_not_replicated(nnx.state(nnx.eval_shape(lambda: model_lib.create(model_cfg))), mesh,
                          model_cfg.logical_axis_rules, cfg.max_replicated_param_mib)
    path = cfg.load_parameters_path
    if path and os.path.isfile(os.path.join(path, "config.json")):
        from unitrain.adapters import hf

        _check_dims_match(cfg, hf.model_config_from_hf(path, cfg.trust_remote_code), path)
        execution = {k: getattr(model_cfg, k) for k in ("weight_dtype", "remat_policy", "scan_layers")}
        return hf.load(path, model_cfg.dtype, mesh, rules=model_cfg.logical_axis_rules,
                       trust_remote_code=cfg.trust_remote_code, **execution)
    model = sharding.init_sharded(lambda: model_lib.create(model_cfg, cfg.seed), mesh, model_cfg.logical_axis_rules)
    if path:
        graphdef, params = nnx.split(model)
        model = nnx.merge(graphdef, checkpoint.load_params(path, nnx.to_pure_dict(params)))
    return model


def _check_not_replicated(abstract_state, mesh, rules, limit_mib: float) -> None:
    """A large parameter copied whole onto every device is almost always a wrong axis rule."""
    if mesh.size == 1:
        return
    shardings = sharding.state_shardings(abstract_state, mesh, rules)
    for (path, var), (_, s) in zip(nnx.to_flat_state(abstract_state), nnx.to_flat_state(shardings)):
        mib = math.prod(var.shape) * np.dtype(var.dtype).itemsize / 2**20
        if s.get_value().is_fully_replicated and mib > limit_mib:
            name = ".".join(map(str, path))
            raise ConfigError(
                f"parameter {name} ({mib:.0f} MiB, logical axes {sharding.logical_axes_of(var)}) would be fully "
                f"replicated on all {mesh.size} devices; map one of its axes to a mesh axis in logical_axis_rules "
                f"or raise max_replicated_param_mib")


def _check_dims_match(cfg, hf_cfg: model_lib.ModelConfig, path: str) -> None:
    for key in ("model_family", "vocab_size", "emb_dim", "mlp_dim", "num_decoder_layers", "num_query_heads",
                "num_kv_heads", "head_dim", "qkv_bias", "qk_norm", "tie_word_embeddings"):
        if getattr(hf_cfg, key) != cfg[key]:
            raise ConfigError(f"load_parameters_path {path} has {key}={getattr(hf_cfg, key)} but the config says "
                              f"{key}={cfg[key]}; set model_name to the matching model (or override {key})")


def opt_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of optimizer.init(params): each moment takes its parameter's sharding, everything
    else (step counts) is replicated over the mesh. `params` may be concrete or abstract."""
    return optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params),
                                 param_shardings, transform_non_params=lambda _: sharding.replicated(mesh))


def init_state(params: dict, optimizer: optax.GradientTransformation, mesh) -> dict:
    """{params, opt_state, step}, every array in its sharding."""
    shardings = opt_state_shardings(optimizer, params, jax.tree.map(lambda x: x.sharding, params), mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(mesh))
    return {"params": params, "opt_state": opt_state, "step": step}


# ---------------------------------------------------------------- the step

def sft_loss(graphdef, cfg, params, batch):
    """Cross-entropy on completion tokens of one micro-batch, in train_step's loss_fn form."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    weights = (batch["targets_segmentation"] > 0).astype(jnp.float32)
    loss_sum, count, nll_sum = losses.cross_entropy(logits, batch["targets"], weights, cfg.z_loss_weight)
    return loss_sum, (count, {"nll": (nll_sum, count)})


def train_step(loss_fn, cfg, optimizer, state, batch, *, opt_device_shardings=None):
    """One optimizer step over `gradient_accumulation_steps` micro-batches, exact at token level.

    loss_fn(params, micro_batch) -> (loss_sum, (denominator, {metric: (sum, count)})). Gradients of
    the summed losses are added up over micro-batches and divided once by the total denominator;
    each metric likewise ends as its total sum over its total count. With the optimizer state
    offloaded to host memory, `opt_device_shardings` brings it to the device for the update (the
    step's out_shardings send it back).
    """
    k = cfg.gradient_accumulation_steps
    # Row i*k + j goes to micro-batch j: each device's contiguous rows stay on that device.
    micro = jax.tree.map(lambda x: x.reshape(-1, k, *x.shape[1:]).swapaxes(0, 1), batch)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    shapes = jax.eval_shape(grad_fn, state["params"], jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def accumulate(carry, mb):
        return jax.tree.map(lambda c, x: c + x.astype(jnp.float32), carry, grad_fn(state["params"], mb)), None

    ((loss_sum, (denom, sums)), grads), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(denom, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, state["params"])
    grad_norm = optax.tree.norm(grads)
    opt_state = state["opt_state"]
    if opt_device_shardings is not None:
        opt_state = jax.device_put(opt_state, opt_device_shardings)
    updates, opt_state = optimizer.update(grads, opt_state, state["params"])
    params = optax.apply_updates(state["params"], updates)
    clipped = jnp.minimum(grad_norm, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else grad_norm
    step_metrics = {
        "loss": loss_sum / denom, "grad_norm": grad_norm, "grad_norm_clipped": clipped,
        "learning_rate": learning_rate_schedule(cfg)(state["step"]), "loss_denominator": denom,
        **{name: total / jnp.maximum(count, 1.0) for name, (total, count) in sums.items()},
    }
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, step_metrics


def make_step_fn(loss_fn, cfg, optimizer, state_shardings, batch_sharding_):
    """train_step jitted with explicit shardings and the state donated."""
    opt_device = (jax.tree.map(lambda s: s.with_memory_kind("device"), state_shardings["opt_state"])
                  if cfg.optimizer_host_offload else None)
    return jax.jit(functools.partial(train_step, loss_fn, cfg, optimizer, opt_device_shardings=opt_device),
                   in_shardings=(state_shardings, batch_sharding_), out_shardings=(state_shardings, None),
                   donate_argnums=0)


def eval_step(graphdef, cfg, params, batch):
    loss_sum, (count, _) = sft_loss(graphdef, cfg, params, batch)
    return loss_sum, count


def compile_logged(name: str, jitted, *args):
    """AOT-compiles `jitted` for these arguments and logs it: a later call with other shapes is an
    error instead of a silent recompilation."""
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    log.info("compiled %s in %.1f s", name, time.perf_counter() - start)
    memory = compiled.memory_analysis()
    if memory is not None:
        log.info("%s memory per device: arguments %.1f MiB, outputs %.1f MiB, temporaries %.1f MiB", name,
                 memory.argument_size_in_bytes / 2**20, memory.output_size_in_bytes / 2**20,
                 memory.temp_size_in_bytes / 2**20)
    return compiled


# ---------------------------------------------------------------- eval

class Evaluator:
    """SFT eval: loss on fixed batches of the eval split and, for the built-in task, the accuracy of
    greedy answers (evals.TaskEvaluator)."""

    def __init__(self, cfg, tokenizer, graphdef, mesh, rules, batch_sharding_):
        iterator = data.make_sft_iterator(cfg, tokenizer, cfg.global_batch_size, "eval",
                                          jax.process_index(), jax.process_count())
        self.batches = [_to_global(_without_counts(next(iterator)), batch_sharding_) for _ in range(cfg.eval_steps)]
        self.loss_fn, self.compiled = jax.jit(functools.partial(eval_step, graphdef, cfg)), None
        self.task = None
        if cfg.dataset_path == "builtin" and cfg.eval_num_samples:
            from unitrain import evals, rewards

            self.task = evals.TaskEvaluator(cfg, tokenizer, graphdef, mesh, rules, rewards.make_reward_fn(cfg))

    def __call__(self, params) -> dict:
        if self.compiled is None:
            self.compiled = compile_logged("eval_step", self.loss_fn, params, self.batches[0])
        sums = [self.compiled(params, b) for b in self.batches]
        total, count = (sum(float(x[i]) for x in sums) for i in (0, 1))
        return {"eval_loss": total / max(count, 1.0), **(self.task(params) if self.task else {})}


# ---------------------------------------------------------------- the loop

def _to_global(batch: dict, batch_sharding_) -> dict:
    """This process's rows -> global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(batch_sharding_, v) for k, v in batch.items()}


def _without_counts(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "num_truncated"}


def _fetch(step_metrics: dict) -> dict:
    """Host copy of a step's metrics; a non-finite loss or gradient means the state after it is bad."""
    values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}  # numbers pass through
    for key in ("loss", "grad_norm"):
        if not math.isfinite(values[key]):
            raise NonFiniteLoss(f"{key} is {values[key]}")
    return values


class _SigtermFlag:
    """Turns SIGTERM (preemption, `kill`) into a flag the loop checks after each step."""

    def __init__(self):
        self.raised = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, *_):
        self.raised = True


class SFTStep:
    """Callable (state, step) -> (state, metrics) for the loop: one packed batch, one update."""

    def __init__(self, cfg, tokenizer, step_fn, batch_sharding_):
        self.step_fn, self.batch_sharding, self.compiled = step_fn, batch_sharding_, None
        self.data_iterator = data.make_sft_iterator(cfg, tokenizer, cfg.rows_per_update, "train",
                                                    jax.process_index(), jax.process_count())
        self.tokens_per_step = cfg.rows_per_update * cfg.max_target_length

    def __call__(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        batch = _to_global(batch, self.batch_sharding)
        if self.compiled is None:
            self.compiled = compile_logged("train_step", self.step_fn, state, batch)
        state, step_metrics = self.compiled(state, batch)
        return state, {**step_metrics, "num_truncated": truncated}


def train(cfg) -> int:
    is_primary = jax.process_index() == 0
    mesh = sharding.mesh_from_config(cfg)
    rules = sharding.rules_from_config(cfg.logical_axis_rules)
    if is_primary:
        write_config(cfg, os.path.join(cfg.run_dir, "config.yml"))
    log.info("mode %s; mesh %s over %d devices (%d processes)", cfg.mode, dict(mesh.shape), mesh.size,
             jax.process_count())

    tokenizer = data.load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"tokenizer_path has {tokenizer.vocab_size} tokens but vocab_size is {cfg.vocab_size}")
    model = build_model(cfg, mesh)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    optimizer = make_optimizer(cfg)
    # The reference policy is the starting one; it is kept only when a KL term needs it.
    ref_params = jax.tree.map(jnp.copy, params) if cfg.mode == "grpo" and cfg.kl_coef > 0 else None
    if ref_params is not None and cfg.ref_params_host_offload:
        ref_params = sharding.with_memory_kind(ref_params, "pinned_host")
    state = init_state(params, optimizer, mesh)
    if cfg.optimizer_host_offload:
        state["opt_state"] = sharding.with_memory_kind(state["opt_state"], "pinned_host")
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_sharding_ = sharding.batch_sharding(mesh, rules)
    if cfg.mode == "sft":
        step_fn = make_step_fn(functools.partial(sft_loss, graphdef, cfg), cfg, optimizer, state_shardings,
                               batch_sharding_)
        runner = SFTStep(cfg, tokenizer, step_fn, batch_sharding_)
        evaluator = Evaluator(cfg, tokenizer, graphdef, mesh, rules, batch_sharding_) if cfg.eval_interval else None
    else:
        from unitrain import evals, grpo, rewards

        reward_fn = rewards.make_reward_fn(cfg)
        batch_shardings = _grpo_batch_shardings(cfg, mesh, rules)
        step_fn = make_step_fn(functools.partial(grpo.grpo_loss, graphdef, cfg), cfg, optimizer, state_shardings,
                               batch_shardings)
        runner = grpo.GRPOStep(cfg, tokenizer, graphdef, mesh, rules, reward_fn, step_fn, ref_params, batch_sharding_)
        evaluator = evals.TaskEvaluator(cfg, tokenizer, graphdef, mesh, rules, reward_fn) if cfg.eval_interval else None

    checkpointer = checkpoint.Checkpointer(cfg.checkpoint_dir, cfg.checkpoint_period, cfg.max_to_keep,
                                           cfg.async_checkpointing)
    start = checkpointer.latest_step() or 0
    if start:
        state = checkpointer.restore(start, state, runner.data_iterator)
        log.info("resumed from %s at step %d", cfg.checkpoint_dir, start)
    writer = metrics.MetricsWriter.from_config(cfg, cfg.steps, resume_step=start)
    with jax.set_mesh(mesh):
        return _loop(cfg, state, runner, checkpointer, evaluator, writer, _SigtermFlag(), start,
                     _Throughput(cfg, model.cfg, mesh.size, getattr(runner, "tokens_per_step", None)), graphdef)


def _grpo_batch_shardings(cfg, mesh, rules) -> dict:
    rows2d = sharding.batch_sharding(mesh, rules)
    rows1d = sharding.batch_sharding(mesh, rules, ("batch",))
    keys = ["inputs", "inputs_position", "inputs_segmentation", "targets", "loss_mask", "old_logprobs"]
    if cfg.kl_coef > 0:
        keys.append("ref_logprobs")
    return {**{k: rows2d for k in keys}, "advantages": rows1d}


class _Throughput:
    """tokens/s and MFU of a step from its wall time (SFT: every position of the batch counts)."""

    def __init__(self, cfg, model_cfg, num_devices: int, tokens_per_step: int | None):
        self.tokens_per_step, self.num_devices = tokens_per_step, num_devices
        if tokens_per_step:
            self.flops_per_token = metrics.train_flops_per_token(model_cfg, cfg.max_target_length)
            self.peak = metrics.peak_flops_per_device(cfg)
            log.info("MFU denominator: %.3g FLOP/s per device (jnp.dot); model: %.3g FLOP per token",
                     self.peak, self.flops_per_token)

    def __call__(self, step_time: float) -> dict:
        if not self.tokens_per_step:
            return {"step_time": step_time}
        tokens_per_sec = self.tokens_per_step / step_time
        return {"step_time": step_time, "tokens_per_sec": tokens_per_sec,
                "mfu": metrics.mfu(tokens_per_sec, self.flops_per_token, self.peak, self.num_devices)}


def _loop(cfg, state, runner, checkpointer, evaluator, writer, sigterm, start, throughput, graphdef) -> int:
    """The shared loop. Metrics of step s are written while step s+1 runs (no host sync for them)."""
    profiler = metrics.Profiler.from_config(cfg)
    pending = None  # (step, metrics, dispatch time) of the step not yet written
    last_good = start
    try:
        for step in range(start, cfg.steps):
            profiler.maybe_start(step)
            dispatched = time.perf_counter()
            state, step_metrics = runner(state, step)
            profiler.maybe_stop(step, block_on=step_metrics)
            if pending is not None:
                _write(writer, pending, dispatched, throughput)
            pending = (step, step_metrics, dispatched)
            if getattr(runner, "samples_text", "") and step % cfg.sample_log_period == 0:
                writer.text(step, "samples", runner.samples_text)
            done = step + 1
            if evaluator and (done % cfg.eval_interval == 0 or done == cfg.steps):
                writer.write(step, evaluator(state["params"]))
            if done % cfg.checkpoint_period == 0 or done == cfg.steps or sigterm.raised:
                _fetch(step_metrics)  # never save a state that came from a non-finite loss
                checkpointer.save(done, state, runner.data_iterator, force=True)
                last_good = done
            if sigterm.raised:
                break
        if pending is not None:
            _write(writer, pending, time.perf_counter(), throughput)
        if sigterm.raised:
            log.warning("SIGTERM: saved a checkpoint at step %d; stopping", last_good)
            return EXIT_SIGTERM
        if cfg.export_hf_path:
            from unitrain.adapters import hf

            hf.save(nnx.merge(graphdef, state["params"]), cfg.export_hf_path)
            log.info("exported the model to %s", cfg.export_hf_path)
        return 0
    except NonFiniteLoss as e:
        log.error("stopping: %s; the last good checkpoint is step %d", e, last_good)
        return EXIT_NAN
    finally:
        profiler.close()
        checkpointer.wait()
        checkpointer.close()
        writer.close()


def _write(writer, pending, now, throughput) -> None:
    step, step_metrics, dispatched = pending
    writer.write(step, {**_fetch(step_metrics), **throughput(max(now - dispatched, 1e-9))})


def _setup_logging() -> None:
    """unitrain's own handler: libraries (absl via orbax) configure the root logger their way."""
    for old in list(log.handlers):  # a second main() in one process (tests) gets today's stdout
        log.removeHandler(old)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s unitrain: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _setup_logging()
    try:
        cfg = load_config(argv, before_derive=distributed.maybe_initialize)
        if jax.process_index() != 0:  # only after jax.distributed has started
            log.setLevel(logging.WARNING)
        return train(cfg)
    except ConfigError as e:
        print(f"unitrain: {e}", file=sys.stderr)
        return _exit(EXIT_USER_ERROR)
    except Exception:
        traceback.print_exc()
        return _exit(1)


def _exit(code: int) -> int:
    """A failed process of a multi-process job leaves at once: a normal exit would wait in
    jax.distributed's shutdown barrier for peers that are stuck in a collective."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
