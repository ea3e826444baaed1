"""mode=grpo: GRPO and its relatives: rollouts from the current policy, rewards, dynamic sampling, advantages,
old/reference logprobs, and the clipped policy loss.

One step (`GRPOTask.step`):
  1. push the current parameters to the sampler (rollout/base.py; colocated by default: no copy)
     and sample n completions for each prompt, in rounds of `over_sampling_batch_size` prompts until
     `rollout_batch_size` groups pass the filter (rollout/groups.py);
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
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import data, losses, rewards, rollout, sharding
from unitrain import step as step_lib
from unitrain.evals import TaskEvaluator
from unitrain.rollout.base import SamplingParams
from unitrain.rollout.colocated import bucket_prompt_length
from unitrain.rollout.groups import collect_groups, make_filter, samples_markdown, select_groups
from unitrain.tasks.base import RunContext, Task

ROW_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "loss_mask")


def token_logprobs(graphdef, temperature: float, params, batch):
    """log pi(target) at every position, at the sampling temperature, float32 [B, T]."""
    logits, _ = nnx.merge(graphdef, params)(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    return losses.token_logprobs(logits.astype(jnp.float32) / temperature, batch["targets"])


class GRPOTask(Task):
    def __init__(self, run: RunContext):
        super().__init__(run)
        cfg, tokenizer = self.cfg, run.tokenizer
        self.reward_fn = rewards.make_reward_fn(cfg)
        self.keep = make_filter(cfg.dynamic_sampling_filter)
        self.sampler = rollout.make_sampler(run)
        # Every process samples the same prompts with the same key (the sampler wants identical
        # inputs everywhere) and so computes the same batch; each then hands JAX only its own rows.
        self.data_iterator = data.make_prompt_iterator(cfg, tokenizer, cfg.over_sampling_batch_size or cfg.rollout_batch_size)
        self.sampling = SamplingParams(
            max_new_tokens=cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
            top_k=cfg.rollout_top_k, top_p=cfg.rollout_top_p, stop_token_ids=(tokenizer.eos_id,))
        self.max_length = cfg.max_prompt_length + cfg.rollout_max_response_len
        self.logprob_fn = jax.jit(functools.partial(token_logprobs, run.graphdef, cfg.rollout_temperature))
        # The reference policy is the starting one, kept only when a KL term needs it; it may live
        # in host memory, so it is brought over inside the jit.
        self.ref_params = None
        if cfg.kl_coef > 0:
            self.ref_params = step_lib.frozen_copy(run.init_params, cfg.ref_params_host_offload)
            on_device = step_lib.device_shardings(self.ref_params)
            self.ref_logprob_fn = jax.jit(lambda p, b: token_logprobs(
                run.graphdef, cfg.rollout_temperature, jax.device_put(p, on_device), b))
        self.update_fn = step_lib.make_train_step(self.loss, cfg, run.optimizer, run.state_shardings,
                                                  self.batch_shardings())
        self.evaluator = TaskEvaluator(cfg, tokenizer, self.sampler, self.reward_fn) if cfg.evaluates else None
        self.text = ""

    # -- what the loop and the step see
    def loss(self, params, batch):
        """The clipped policy loss of one micro-batch, in train_step's loss_fn form."""
        cfg = self.cfg
        logits, _ = nnx.merge(self.run.graphdef, params)(batch["inputs"], batch["inputs_position"],
                                                         batch["inputs_segmentation"])
        logits = logits.astype(jnp.float32) / cfg.rollout_temperature
        kl_in_loss = cfg.kl_coef > 0 and not cfg.use_kl_in_reward
        loss_sum, denom, metrics = losses.policy_loss(
            losses.token_logprobs(logits, batch["targets"]), batch["old_logprobs"], batch["advantages"],
            batch["loss_mask"], eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
            loss_agg_mode=cfg.loss_agg_mode, horizon=cfg.rollout_max_response_len,
            ref_logprobs=batch["ref_logprobs"] if kl_in_loss else None, kl_coef=cfg.kl_coef if kl_in_loss else 0.0,
            kl_type=cfg.kl_type, entropy=losses.entropy_from_logits(logits), entropy_coef=cfg.entropy_coef)
        return loss_sum, (denom, metrics)

    def batch_shardings(self) -> dict:
        rows2d = sharding.batch_sharding(self.run.mesh, self.run.rules)
        keys = [*ROW_KEYS, "old_logprobs"] + (["ref_logprobs"] if self.cfg.kl_coef > 0 else [])
        return {**{k: rows2d for k in keys}, "advantages": sharding.batch_sharding(self.run.mesh, self.run.rules, ("batch",))}

    def evaluate(self, params, step):
        return self.evaluator(params, step) if self.evaluator else {}

    def samples_text(self, step):
        return self.text if step % self.cfg.sample_log_period == 0 else ""

    def step(self, state, step: int):
        cfg, t0 = self.cfg, time.perf_counter()
        self.sampler.update_weights(state["params"], step)
        groups, stats = self.sample_groups(step)
        t1 = time.perf_counter()
        arrays = self.to_rows(groups)
        batch = {k: arrays[k] for k in ROW_KEYS}
        batch["old_logprobs"] = old = self.logprobs(self.logprob_fn, state["params"], batch)
        mask = arrays["loss_mask"].astype(bool)
        rewards_ = np.concatenate([g.rewards for g in groups]).astype(np.float32)
        if self.ref_params is not None:
            batch["ref_logprobs"] = self.logprobs(self.ref_logprob_fn, self.ref_params, batch)
            if cfg.use_kl_in_reward:
                kl = np.asarray(losses.kl_penalty(old, batch["ref_logprobs"], cfg.kl_type)) * mask
                rewards_ = rewards_ - cfg.kl_coef * kl.sum(axis=1)
        group_ids = np.repeat(np.arange(len(groups)), cfg.n_samples_per_prompt)
        batch["advantages"] = np.asarray(losses.compute_advantages(
            rewards_, group_ids, len(groups), cfg.advantage_estimator, cfg.advantage_norm_by_std,
            weights=mask.sum(axis=1).astype(np.float32) if cfg.advantage_estimator == "reinforce_pp" else None))
        t2 = time.perf_counter()
        state, update_metrics = self.update(state, batch)
        t3 = time.perf_counter()
        metrics = {**update_metrics, **stats, **self.rollout_metrics(groups, arrays, old, mask),
                   "time_rollout": t1 - t0, "time_logprob": t2 - t1, "time_update": t3 - t2,
                   "rollout_tokens_per_sec": float(mask.sum()) / max(t1 - t0, 1e-9)}
        if step % cfg.sample_log_period == 0:
            self.text = samples_markdown(groups)
        return state, metrics

    # -- the pieces of a step
    def sample_groups(self, step: int):
        """Rounds of sampling until rollout_batch_size groups pass the filter (or the cap is hit)."""
        cfg = self.cfg
        kept, dropped, rounds, prompts_dropped = [], [], 0, 0
        while len(kept) < cfg.rollout_batch_size and rounds < cfg.max_sampling_rounds:
            batch = next(self.data_iterator)
            prompts_dropped += batch["num_dropped"]
            key = jax.random.fold_in(jax.random.key(cfg.seed), step * cfg.max_sampling_rounds + rounds)
            for group in collect_groups(self.sampler, batch["prompts"], cfg.n_samples_per_prompt, self.sampling, key,
                                        self.run.tokenizer, self.reward_fn):
                (kept if self.keep is None or self.keep(group) else dropped).append(group)
            rounds += 1
        groups, discarded, refilled = select_groups(kept, dropped, cfg.rollout_batch_size)
        return groups, {"sampling_rounds": rounds, "groups_discarded": discarded, "groups_refilled": refilled,
                        "prompts_dropped": prompts_dropped}

    def to_rows(self, groups) -> dict:
        """Prompt + completion rows, right-padded, with next-token targets and the loss mask."""
        longest = max(len(g.prompt.ids) + int(g.completions.lengths.max()) for g in groups)
        # Rows as long as this step needs, rounded up to a power of two: bounded recompilation.
        L = min(bucket_prompt_length(longest), self.max_length)
        rows, pad = len(groups) * self.cfg.n_samples_per_prompt, self.run.tokenizer.pad_id
        arrays = {k: np.zeros((rows, L), np.int32) for k in ROW_KEYS}
        arrays["inputs"][:], arrays["targets"][:] = pad, pad
        arrays["sampler_logprobs"] = np.zeros((rows, L), np.float32)
        r = 0
        for group in groups:
            ids = list(group.prompt.ids)
            c = group.completions
            for tokens, length, logprobs in zip(c.tokens, c.lengths, c.logprobs):
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

    def logprobs(self, fn, params, batch) -> np.ndarray:
        """Per-token logprobs over the rollout rows, in update-sized chunks (one compiled shape)."""
        chunk = self.cfg.rows_per_update
        keys = ("inputs", "inputs_position", "inputs_segmentation", "targets")
        shardings = sharding.batch_sharding(self.run.mesh, self.run.rules)
        name = f"{'logprobs' if fn is self.logprob_fn else 'ref_logprobs'} (rows of {batch['inputs'].shape[1]})"
        outs = [self.run.programs(name, fn, params, step_lib.full_rows_to_global(
                    {k: batch[k][start:start + chunk] for k in keys}, shardings))
                for start in range(0, len(batch["inputs"]), chunk)]
        return np.concatenate([step_lib.to_host(o) for o in outs])

    def update(self, state, batch):
        """num_iterations passes over the rows in mini-batches; metrics are averaged over updates."""
        chunk, rows, shardings = self.cfg.rows_per_update, len(batch["inputs"]), self.batch_shardings()
        collected = []
        for _ in range(self.cfg.num_iterations):
            for start in range(0, rows, chunk):
                mb = step_lib.full_rows_to_global({k: v[start:start + chunk] for k, v in batch.items()}, shardings)
                state, m = self.run.programs(f"grpo_update (rows of {mb['inputs'].shape[1]})", self.update_fn, state, mb)
                collected.append(m)
        # One device->host copy for all updates of the step.
        stacked = jax.device_get(collected)
        return state, {k: float(np.mean([m[k] for m in stacked])) for k in stacked[0]}

    def rollout_metrics(self, groups, arrays, old_logprobs, mask) -> dict:
        rewards_ = np.concatenate([g.rewards for g in groups])
        lengths = np.concatenate([g.completions.lengths for g in groups])
        metrics = {"reward_mean": rewards_.mean(), "reward_std": rewards_.std(), "reward_min": rewards_.min(),
                   "reward_max": rewards_.max(), "response_length_mean": lengths.mean(),
                   "response_length_max": lengths.max(),
                   "response_clip_ratio": float(np.mean(lengths >= self.cfg.rollout_max_response_len)),
                   "zero_std_group_fraction": float(np.mean([np.std(g.rewards) == 0 for g in groups])),
                   "sampler_trainer_logprob_gap": float(np.abs(arrays["sampler_logprobs"] - old_logprobs)[mask].mean())}
        for name in self.reward_fn.names:
            values = np.concatenate([g.per_reward[name] for g in groups])
            metrics.update({f"reward_{name}_{stat}": getattr(values, stat)() for stat in ("mean", "std", "min", "max")})
        return {k: float(v) for k, v in metrics.items()}
