"""mode=ppo: PPO with a critic. GRPO's machinery (tasks/grpo.py: rollouts, rewards, the old and
reference logprobs, rollout_is, the clipped policy loss over num_iterations mini-batch passes) with
the critic's advantages in place of the group baseline, and the critic trained alongside.

One step (`PPOTask.step`), where it differs from GRPO's:
  3. the logprob pass also takes the critic's values of the sampled tokens' states (the critic as it
     was at rollout time: the "old" values of the clipped value loss);
  2'. the rewards become per-token rewards (losses.token_rewards: the reward on the last sampled
     token, with use_kl_in_reward minus kl_coef times the per-token KL to the reference), then
     advantages and returns by GAE over the sampled tokens (losses.gae, gae_gamma, gae_lambda: an
     episode's environment tokens are skipped), the advantages whitened over the batch's sampled
     tokens (losses.masked_whiten);
  4. the critic's own num_iterations passes of the clipped value loss (losses.value_loss,
     value_clip), its own AdamW at critic_learning_rate; then the policy's, except during the first
     critic_warmup_steps steps, which train the critic alone.

The critic is a scalar-head model (models/scalar_head.py) per token: from critic_path (an HF
classifier or causal LM, or a unitrain checkpoint), else the policy's starting backbone
(load_parameters_path, or the same random draws) under a fresh head. It trains whole, also when the
policy trains LoRA adapters. The train state holds it as state["critic"] = {params, opt_state,
step}, which checkpoint.py saves and restores as an item of its own. With rl_packing the critic's
value pass and its updates take the packed rows GRPO's do (its values aligned with the targets, the
value loss's seq-mean modes per segment); GAE runs on the host in the unpacked layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import losses, sharding
from unitrain import step as step_lib
from unitrain.models.scalar_head import build_scalar_model
from unitrain.optimizer import learning_rate_schedule, make_optimizer
from unitrain.tasks.base import RunContext
from unitrain.tasks.grpo import GRPOTask


def build_critic(run: RunContext):
    """The critic: critic_path's scalar-head model, else the policy's starting backbone (a copy of
    its parameters, the LoRA base's with adapters) under a fresh head. Where those parameters are not
    the backbone's own arrays (model_source tunix, a quantised QLoRA base) the backbone is read again
    from load_parameters_path."""
    cfg = run.cfg
    if cfg.critic_path or cfg.model_source != "unitrain" or cfg.lora_base_dtype in ("int8", "nf4"):
        return build_scalar_model(cfg, run.mesh, cfg.critic_path or cfg.load_parameters_path)
    critic = build_scalar_model(cfg, run.mesh, "")  # the head's draws; the backbone's are replaced
    graphdef, state = nnx.split(critic)
    params = nnx.to_pure_dict(state)
    policy = run.init_params["base"] if cfg.lora_rank else run.init_params
    # A copy: the policy's starting arrays are donated to its first update.
    backbone = {k: policy[k] for k in params["backbone"]}
    params["backbone"] = jax.tree.map(lambda c, p: jnp.copy(p).astype(c.dtype), params["backbone"], backbone)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


CRITIC_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "loss_mask", "values", "returns")


def critic_values(graphdef, params, batch, columns: int):
    """The critic's value of the state before each completion token, float32 [rows, columns]: its
    output at the column that predicts the token (the prompt ends at column P = width - columns;
    packed rows, P = 0: every column's, aligned with the targets)."""
    critic = nnx.merge(graphdef, params)
    values = critic(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])[..., 0]
    start = batch["inputs"].shape[1] - columns - 1
    return values[:, start : start + columns] if start >= 0 else values


def value_pass(graphdef, params, batch) -> dict:
    """The logprob pass's critic half: {"values": [rows, C]} of the completion columns."""
    return {"values": critic_values(graphdef, params, batch, batch["targets"].shape[1])}


@functools.partial(jax.jit, static_argnames=("gamma", "lam", "kl_coef"))
def gae_advantages(rewards, values, mask, kl, *, gamma: float, lam: float, kl_coef: float) -> dict:
    """{advantages (whitened over the batch's sampled tokens, 0 off them), returns} [rows, C] of a
    rollout batch, and its critic metrics; `kl` None: no KL in the reward."""
    per_token = losses.token_rewards(rewards, mask, kl, kl_coef)
    advantages, returns = losses.gae(per_token, values, mask, gamma, lam)
    m = mask.astype(np.float32)
    tokens = m.sum()
    return {
        "advantages": losses.masked_whiten(advantages, m) * m,
        "returns": returns,
        "critic/values_mean": (values * m).sum() / tokens,
        "critic/returns_mean": returns.sum() / tokens,
        "critic/explained_var": losses.explained_variance(returns, values, m),
    }


def critic_metric(name: str) -> str:
    """The critic's train-step metric under its name in the logs (the train step's loss is the value loss)."""
    return {"loss": "critic/value_loss", "learning_rate": "critic/lr"}.get(name, f"critic/{name}")


class PPOTask(GRPOTask):
    def __init__(self, run: RunContext, **kwargs):
        super().__init__(run, **kwargs)
        cfg = self.cfg
        critic = build_critic(run)
        self.critic_graphdef, params = nnx.split(critic)
        params = nnx.to_pure_dict(params)
        peak = cfg.learning_rate if cfg.critic_learning_rate is None else cfg.critic_learning_rate
        self.critic_learning_rate = learning_rate_schedule(cfg, run.layout.optimizer_steps, peak)
        optimizer = make_optimizer(cfg, critic.decay_mask(), self.critic_learning_rate)
        # Handed to the loop's state by train_state (once): the first critic update donates it.
        self.critic_start = step_lib.init_state(params, optimizer, run.mesh, cfg.optimizer_host_offload)
        self.critic_shardings = {k: sharding.batch_sharding(run.mesh, run.rules) for k in CRITIC_KEYS}
        settings = dataclasses.replace(
            step_lib.StepConfig.from_config(cfg, self.critic_learning_rate), adapters_only=False
        )
        self.critic_update_fn = step_lib.make_train_step(
            self.critic_loss,
            settings,
            optimizer,
            jax.tree.map(lambda x: x.sharding, self.critic_start),
            self.critic_shardings,
        )
        self.value_fn = jax.jit(functools.partial(value_pass, self.critic_graphdef))
        self.trains_policy = True

    # -- what the loop and the step see
    def train_state(self, state: dict) -> dict:
        critic, self.critic_start = self.critic_start, None
        return {**state, "critic": critic}

    def per_token_advantages(self) -> bool:
        return True

    def critic_loss(self, params, batch):
        """The clipped value loss of one micro-batch, in train_step's loss_fn form."""
        cfg = self.cfg
        values = critic_values(self.critic_graphdef, params, batch, batch["values"].shape[1])
        loss_sum, denom, metrics = losses.value_loss(
            values,
            batch["values"],
            batch["returns"],
            batch["loss_mask"],
            cfg.value_clip,
            cfg.loss_agg_mode,
            horizon=self.policy_loss_config.horizon,
            sequences=losses.packed_sequences(batch["inputs_segmentation"]) if self.packing else losses.ROWS,
        )
        return loss_sum, (denom, metrics)

    def step(self, state, step: int):
        self.trains_policy = step >= self.cfg.critic_warmup_steps
        return super().step(state, step)

    # -- the pieces of a step that differ from GRPO's
    def rollout_passes(self, state, batch) -> dict:
        """GRPO's logprobs, and the critic's values of the sampled tokens' states."""
        return {
            **super().rollout_passes(state, batch),
            **self.row_pass("values", self.value_fn, state["critic"]["params"], batch),
        }

    def advantages(self, batch, groups) -> tuple[dict, dict]:
        cfg = self.cfg
        rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32)
        kl = None
        if cfg.use_kl_in_reward and self.ref_params is not None:
            kl = losses.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_type)
        out = gae_advantages(
            rewards,
            batch["values"],
            batch["loss_mask"],
            kl,
            gamma=cfg.gae_gamma,
            lam=cfg.gae_lambda,
            kl_coef=cfg.kl_coef,
        )
        out = {k: np.asarray(v) for k, v in out.items()}
        arrays = {k: out.pop(k) for k in ("advantages", "returns")}
        return arrays, {k: float(v) for k, v in out.items()}

    def update(self, state, batch):
        """The critic's updates, then (after critic_warmup_steps) the policy's, on the same rows."""
        critic, critic_metrics = self.updates(
            "critic_update", self.critic_update_fn, state["critic"], batch, self.critic_shardings
        )
        policy = {k: v for k, v in state.items() if k != "critic"}
        metrics = {critic_metric(k): v for k, v in critic_metrics.items()}
        if self.trains_policy:
            policy, policy_metrics = super().update(policy, batch)
            metrics.update(policy_metrics)
        return {**policy, "critic": critic}, metrics
