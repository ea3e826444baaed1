"""GRPO and its relatives: rollouts from the current policy, rewards, dynamic sampling, advantages,
old/reference logprobs, and the clipped policy loss.

One step (`GRPOStep.__call__`):
  1. sample n completions for each prompt with the training parameters (colocated, no copy), in
     rounds of `over_sampling_batch_size` prompts until `rollout_batch_size` groups pass the filter;
  2. score them (rewards.py), optionally subtract the KL to the reference from the reward, and turn
     rewards into advantages per group (losses.compute_advantages);
  3. recompute the sampled tokens' logprobs with the trainer's forward (the PPO "old" policy) and,
     with a KL term, the reference model's;
  4. run `num_iterations` passes over the rows in mini-batches, one optimizer update each.

Row layout of the train batch ([rows, L], L = the step's longest prompt + completion rounded up to a
power of two, at most max_prompt_length + rollout_max_response_len): the prompt, then the completion,
then padding. `targets` is the next token; `loss_mask` is 1 at the positions
whose target is a sampled completion token (up to and including its stop token).
"""

from __future__ import annotations

import functools
import importlib
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import data, losses, rollout
from unitrain.config import ConfigError

log = logging.getLogger("unitrain")


# ---------------------------------------------------------------- jitted pieces

def token_logprobs(graphdef, temperature: float, params, batch):
    """log pi(target) at every position, at the sampling temperature, float32 [B, T]."""
    logits, _ = nnx.merge(graphdef, params)(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits = logits.astype(jnp.float32) / temperature
    return _gather_logprobs(logits, batch["targets"])


def _gather_logprobs(logits, targets):
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z


def grpo_loss(graphdef, cfg, params, batch):
    """The clipped policy loss of one micro-batch, in train_step's loss_fn form."""
    logits, _ = nnx.merge(graphdef, params)(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits = logits.astype(jnp.float32) / cfg.rollout_temperature
    kl_in_loss = cfg.kl_coef > 0 and not cfg.use_kl_in_reward
    loss_sum, denom, metrics = losses.policy_loss(
        _gather_logprobs(logits, batch["targets"]), batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
        loss_agg_mode=cfg.loss_agg_mode, horizon=cfg.rollout_max_response_len,
        ref_logprobs=batch["ref_logprobs"] if kl_in_loss else None, kl_coef=cfg.kl_coef if kl_in_loss else 0.0,
        kl_type=cfg.kl_type, entropy=losses.entropy_from_logits(logits), entropy_coef=cfg.entropy_coef)
    return loss_sum, (denom, metrics)


# ---------------------------------------------------------------- filters

def nonzero_std(rewards: np.ndarray) -> bool:
    """Keep a group only if its rewards differ: equal rewards give zero advantage, hence no signal."""
    return bool(np.std(rewards) > 0)


def make_filter(spec: str):
    """'' (keep all), 'nonzero_std', or a plugin 'pkg.module:fn' taking a group's rewards -> bool."""
    if spec == "":
        return None
    if spec == "nonzero_std":
        return nonzero_std
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"dynamic_sampling_filter '{spec}' is neither nonzero_std nor of the form pkg.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"dynamic_sampling_filter '{spec}' cannot be loaded: {e}") from None
    if not callable(fn):
        raise ConfigError(f"dynamic_sampling_filter '{spec}' is not callable")
    return fn


def select_groups(kept: list, dropped: list, batch_size: int) -> tuple[list, int, int]:
    """The step's groups: those that passed the filter, topped up with dropped ones when the
    sampling rounds ran out (shapes stay static; a zero-std group only adds zero advantages).
    Returns (groups, number discarded, number refilled)."""
    refilled = min(max(0, batch_size - len(kept)), len(dropped))
    groups = (kept + dropped[:refilled])[:batch_size]
    if len(groups) < batch_size:
        raise ConfigError("the prompt stream ran out before a rollout batch was full; raise num_epochs")
    return groups, len(dropped) - refilled, refilled


# ---------------------------------------------------------------- one step

class GRPOStep:
    """Callable (state, step) -> (state, metrics) for the training loop; owns the prompt stream."""

    def __init__(self, cfg, tokenizer, graphdef, mesh, rules, reward_fn, step_fn, ref_params, batch_sharding_):
        self.cfg, self.tokenizer, self.graphdef, self.mesh, self.rules = cfg, tokenizer, graphdef, mesh, rules
        self.reward_fn, self.step_fn, self.ref_params = reward_fn, step_fn, ref_params
        self.batch_sharding = batch_sharding_
        self.keep = make_filter(cfg.dynamic_sampling_filter)
        self.prompts_per_round = cfg.over_sampling_batch_size or cfg.rollout_batch_size
        # Every process samples the same prompts with the same key (generate wants identical inputs
        # everywhere) and so computes the same batch; each then hands JAX only its own rows.
        self.data_iterator = data.make_prompt_iterator(cfg, tokenizer, self.prompts_per_round)
        self.sampling = rollout.SamplingParams(
            max_new_tokens=cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
            top_k=cfg.rollout_top_k, top_p=cfg.rollout_top_p, stop_token_ids=(tokenizer.eos_id,))
        self.max_length = cfg.max_prompt_length + cfg.rollout_max_response_len
        self.logprob_fn = jax.jit(functools.partial(token_logprobs, graphdef, cfg.rollout_temperature))
        if ref_params is not None:  # the reference may live in host memory: bring it over inside the jit
            on_device = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), ref_params)
            self.ref_logprob_fn = jax.jit(lambda p, b: token_logprobs(
                graphdef, cfg.rollout_temperature, jax.device_put(p, on_device), b))
        self.logprob_shapes = set()
        self.compiled = {}  # row length -> AOT-compiled update; row lengths are bucketed, so few
        self.samples_text = ""

    # -- rollout
    def sample_groups(self, params, step: int):
        """Rounds of sampling until rollout_batch_size groups pass the filter (or the cap is hit)."""
        model = nnx.merge(self.graphdef, params)
        n, kept, dropped, rounds, prompts_dropped = self.cfg.n_samples_per_prompt, [], [], 0, 0
        while len(kept) < self.cfg.rollout_batch_size and rounds < self.cfg.max_sampling_rounds:
            batch = next(self.data_iterator)
            prompts_dropped += batch["num_dropped"]
            prompts = [p for p in batch["prompts"] for _ in range(n)]
            key = jax.random.fold_in(jax.random.key(self.cfg.seed), step * self.cfg.max_sampling_rounds + rounds)
            out = rollout.generate(model, [list(p.ids) for p in prompts], self.sampling, key,
                                   pad_id=self.tokenizer.pad_id, mesh=self.mesh, rules=self.rules)
            texts = [self.tokenizer.decode(t[:l]) for t, l in zip(out["tokens"], out["lengths"])]
            total, per_reward = self.reward_fn([p.text for p in prompts], texts, [p.label for p in prompts])
            for g in range(len(batch["prompts"])):
                rows = slice(g * n, (g + 1) * n)
                group = {"prompt": batch["prompts"][g], "texts": texts[rows], "reward": total[rows],
                         "per_reward": {k: v[rows] for k, v in per_reward.items()},
                         **{k: out[k][rows] for k in ("tokens", "mask", "logprobs", "lengths")}}
                (kept if self.keep is None or self.keep(group["reward"]) else dropped).append(group)
            rounds += 1
        groups, discarded, refilled = select_groups(kept, dropped, self.cfg.rollout_batch_size)
        stats = {"sampling_rounds": rounds, "groups_discarded": discarded, "groups_refilled": refilled,
                 "prompts_dropped": prompts_dropped}
        return groups, stats

    def to_rows(self, groups) -> dict:
        """Prompt + completion rows, right-padded, with next-token targets and the loss mask."""
        longest = max(len(g["prompt"].ids) + int(g["lengths"].max()) for g in groups)
        # Rows as long as this step needs, rounded up to a power of two: bounded recompilation.
        L = min(rollout.bucket_prompt_length(longest), self.max_length)
        rows, pad = len(groups) * self.cfg.n_samples_per_prompt, self.tokenizer.pad_id
        arrays = {k: np.zeros((rows, L), np.int32) for k in ("inputs", "inputs_position", "inputs_segmentation",
                                                               "targets", "loss_mask")}
        arrays["inputs"][:], arrays["targets"][:] = pad, pad
        arrays["sampler_logprobs"] = np.zeros((rows, L), np.float32)
        r = 0
        for group in groups:
            ids = list(group["prompt"].ids)
            for tokens, length, logprobs in zip(group["tokens"], group["lengths"], group["logprobs"]):
                seq = ids + list(tokens[:length])
                n, p = len(seq), len(ids)
                arrays["inputs"][r, :n] = seq
                arrays["inputs_position"][r, :n] = np.arange(n)
                arrays["inputs_segmentation"][r, :n] = 1
                arrays["targets"][r, :n - 1] = seq[1:]
                arrays["loss_mask"][r, p - 1:n - 1] = 1  # position i predicts token i + 1
                arrays["sampler_logprobs"][r, p - 1:n - 1] = logprobs[:length]
                r += 1
        return arrays

    # -- the step
    def __call__(self, state, step: int):
        cfg, t0 = self.cfg, time.perf_counter()
        groups, stats = self.sample_groups(state["params"], step)
        t1 = time.perf_counter()
        arrays = self.to_rows(groups)
        rewards = np.concatenate([g["reward"] for g in groups]).astype(np.float32)
        batch = {k: v for k, v in arrays.items() if k != "sampler_logprobs"}
        old = self.logprobs(state["params"], batch)
        batch["old_logprobs"] = old
        mask = arrays["loss_mask"].astype(bool)
        if self.ref_params is not None:
            batch["ref_logprobs"] = self.logprobs(self.ref_params, batch, self.ref_logprob_fn)
            if cfg.use_kl_in_reward:
                kl = np.asarray(losses.kl_penalty(old, batch["ref_logprobs"], cfg.kl_type)) * mask
                rewards = rewards - cfg.kl_coef * kl.sum(axis=1)
        group_ids = np.repeat(np.arange(len(groups)), cfg.n_samples_per_prompt)
        batch["advantages"] = np.asarray(losses.compute_advantages(
            rewards, group_ids, len(groups), cfg.advantage_estimator, cfg.advantage_norm_by_std,
            weights=mask.sum(axis=1).astype(np.float32) if cfg.advantage_estimator == "reinforce_pp" else None))
        t2 = time.perf_counter()
        state, update_metrics = self.update(state, batch)
        t3 = time.perf_counter()
        metrics = {**update_metrics, **stats, **self.rollout_metrics(groups, arrays, old, mask),
                   "time_rollout": t1 - t0, "time_logprob": t2 - t1, "time_update": t3 - t2,
                   "rollout_tokens_per_sec": float(mask.sum()) / max(t1 - t0, 1e-9)}
        if step % cfg.sample_log_period == 0:
            self.samples_text = "\n\n".join(f"**prompt** {g['prompt'].text}\n\n**completion** {g['texts'][0]}\n\n"
                                            f"**reward** {g['reward'][0]:.3f}" for g in groups[:4])
        return state, metrics

    def logprobs(self, params, batch, fn=None) -> np.ndarray:
        """Per-token logprobs over the rollout rows, in update-sized chunks (one compiled shape)."""
        chunk = self.cfg.rows_per_update
        keys = ("inputs", "inputs_position", "inputs_segmentation", "targets")
        fn = fn or self.logprob_fn
        if (fn, batch["inputs"].shape) not in self.logprob_shapes:  # jit compiles on a new shape: say so
            self.logprob_shapes.add((fn, batch["inputs"].shape))
            log.info("compiling logprobs for rows of %d tokens", batch["inputs"].shape[1])
        outs = []
        for start in range(0, len(batch["inputs"]), chunk):
            part = {k: self._global(batch[k][start:start + chunk]) for k in keys}
            with jax.set_mesh(self.mesh):
                outs.append(fn(params, part))
        return np.concatenate([np.asarray(_host(o)) for o in outs])

    def update(self, state, batch):
        """num_iterations passes over the rows in mini-batches; metrics are averaged over updates."""
        chunk, rows = self.cfg.rows_per_update, len(batch["inputs"])
        collected = []
        for _ in range(self.cfg.num_iterations):
            for start in range(0, rows, chunk):
                mb = {k: self._global(v[start:start + chunk]) for k, v in batch.items()}
                length = mb["inputs"].shape[1]
                if length not in self.compiled:
                    from unitrain.train import compile_logged
                    self.compiled[length] = compile_logged(f"grpo_update (rows of {length})", self.step_fn, state, mb)
                with jax.set_mesh(self.mesh):
                    state, m = self.compiled[length](state, mb)
                collected.append(m)
        # One device->host copy for all updates of the step.
        stacked = jax.device_get(collected)
        return state, {k: float(np.mean([m[k] for m in stacked])) for k in stacked[0]}

    def _global(self, rows: np.ndarray):
        """Rows every process holds in full -> a global array sharded over the batch axes."""
        sharding_ = self.batch_sharding if rows.ndim > 1 else jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec(self.batch_sharding.spec[0]))
        return jax.make_array_from_callback(rows.shape, sharding_, lambda idx: rows[idx])

    def rollout_metrics(self, groups, arrays, old_logprobs, mask) -> dict:
        rewards = np.concatenate([g["reward"] for g in groups])
        lengths = np.concatenate([g["lengths"] for g in groups])
        metrics = {"reward_mean": rewards.mean(), "reward_std": rewards.std(), "reward_min": rewards.min(),
                   "reward_max": rewards.max(), "response_length_mean": lengths.mean(),
                   "response_length_max": lengths.max(),
                   "response_clip_ratio": float(np.mean(lengths >= self.cfg.rollout_max_response_len)),
                   "zero_std_group_fraction": float(np.mean([np.std(g["reward"]) == 0 for g in groups])),
                   "sampler_trainer_logprob_gap": float(np.abs(arrays["sampler_logprobs"] - old_logprobs)[mask].mean())}
        for name in self.reward_fn.names:
            values = np.concatenate([g["per_reward"][name] for g in groups])
            metrics.update({f"reward_{name}_{stat}": getattr(values, stat)() for stat in ("mean", "std", "min", "max")})
        return {k: float(v) for k, v in metrics.items()}


def _host(x):
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return x
