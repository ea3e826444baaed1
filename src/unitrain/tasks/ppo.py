"""mode=ppo: PPO with a critic, GRPO's sibling on the RL step (tasks/rl.py: rollouts, rows, the old
and reference logprobs, rollout_is, the clipped policy loss over num_iterations mini-batch passes).
It picks:
  - a learner besides the policy, the critic (`Critic`): its pass takes the critic's values of the
    sampled tokens' states (the critic as it was at rollout time: the "old" values of the clipped
    value loss), its update is num_iterations passes of the clipped value loss (losses.value_loss,
    value_clip) with its own AdamW at critic_learning_rate, before the policy's; the first
    critic_warmup_steps steps train the critic alone;
  - the estimator gae (advantages.py): the rewards as per-token rewards (the reward on the last
    sampled token, with use_kl_in_reward minus kl_coef times the per-token KL to the reference),
    advantages and returns by GAE over the sampled tokens (gae_gamma, gae_lambda: an episode's
    environment tokens are skipped), the advantages whitened over the batch's sampled tokens.

The critic is a scalar-head model (models/scalar_head.py) per token: from critic_path (an HF
classifier or causal LM, or a unitrain checkpoint), else the policy's starting backbone
(load_parameters_path, or the same random draws) under a fresh head. It trains whole, also when the
policy trains LoRA adapters. The train state holds it as state["critic"] = {params, opt_state,
step}, which checkpoint.py saves and restores as an item of its own. With rl_packing the critic's
value pass and its updates take the packed rows GRPO's do, planned once a step for all of them (its
values aligned with the targets, the value loss's seq-mean modes per segment); GAE runs on the host
in the unpacked layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain import losses, sharding
from unitrain import step as step_lib
from unitrain.config import check
from unitrain.models.scalar_head import build_scalar_model
from unitrain.optimizer import learning_rate_schedule, make_optimizer
from unitrain.tasks.base import RunContext
from unitrain.tasks.rl import RLTask


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


def critic_metric(name: str) -> str:
    """The critic's train-step metric under its name in the logs (the train step's loss is the value loss)."""
    return {"loss": "critic/value_loss", "learning_rate": "critic/lr"}.get(name, f"critic/{name}")


class Critic:
    """PPO's critic as a learner of the RL step: state["critic"] = {params, opt_state, step}."""

    def __init__(self, task: RLTask):
        run, cfg = task.run, task.cfg
        self.task = task
        critic = build_critic(run)
        self.graphdef, params = nnx.split(critic)
        params = nnx.to_pure_dict(params)
        peak = cfg.learning_rate if cfg.critic_learning_rate is None else cfg.critic_learning_rate
        self.learning_rate = learning_rate_schedule(cfg, run.layout.optimizer_steps, peak)
        optimizer = make_optimizer(cfg, critic.decay_mask(), self.learning_rate)
        # Handed to the loop's state by PPOTask.train_state (once): the first critic update donates it.
        self.start = step_lib.init_state(params, optimizer, run.mesh, cfg.optimizer_host_offload)
        self.shardings = {k: sharding.batch_sharding(run.mesh, run.rules) for k in CRITIC_KEYS}
        settings = dataclasses.replace(step_lib.StepConfig.from_config(cfg, self.learning_rate), adapters_only=False)
        self.update_fn = step_lib.make_train_step(
            self.loss, settings, optimizer, jax.tree.map(lambda x: x.sharding, self.start), self.shardings
        )
        self.value_fn = jax.jit(functools.partial(value_pass, self.graphdef))

    def loss(self, params, batch):
        """The clipped value loss of one micro-batch, in train_step's loss_fn form."""
        cfg = self.task.cfg
        values = critic_values(self.graphdef, params, batch, batch["values"].shape[1])
        loss_sum, denom, metrics = losses.value_loss(
            values,
            batch["values"],
            batch["returns"],
            batch["loss_mask"],
            cfg.value_clip,
            cfg.loss_agg_mode,
            horizon=self.task.policy_loss_config.horizon,
            sequences=losses.packed_sequences(batch["inputs_segmentation"]) if self.task.packing else losses.ROWS,
        )
        return loss_sum, (denom, metrics)

    def passes(self, state, rows) -> dict:
        """The critic's values of the sampled tokens' states, over the step's rows (tasks/rl.py's StepRows)."""
        return self.task.row_pass("values", self.value_fn, state["critic"]["params"], rows)

    def update(self, state, rows):
        critic, metrics = self.task.updates("critic_update", self.update_fn, state["critic"], rows, self.shardings)
        return {**state, "critic": critic}, {critic_metric(k): v for k, v in metrics.items()}


class PPOTask(RLTask):
    estimator = "gae"

    def __init__(self, run: RunContext, **kwargs):
        super().__init__(run, **kwargs)
        self.critic = Critic(self)
        self.learners = [self.critic]

    def train_state(self, state: dict) -> dict:
        critic, self.critic.start = self.critic.start, None
        return {**state, "critic": critic}

    def per_token_advantages(self) -> bool:
        return True

    def trains_policy(self, step: int) -> bool:
        return step >= self.cfg.critic_warmup_steps


@check("mode", "critic_path", "rollout_decoding", "turn_discount")
def _ppo(c) -> str | None:
    """PPO learns from sampled tokens, discounts by gae_gamma; its critic keys serve it alone."""
    if c["mode"] != "ppo":
        return None if not c["critic_path"] else f"critic_path is mode=ppo's critic; mode={c['mode']} trains none"
    if c["rollout_decoding"] != "sample":
        return "mode=ppo learns from sampled rollouts; rollout_decoding=beam is grpo's (ranked groups)"
    if c["turn_discount"] < 1:
        return "mode=ppo discounts later tokens by gae_gamma; turn_discount is grpo's (set it to 1.0)"
    return None


@check("mode", "advantage_estimator")
def _ppo_estimator(c) -> str | None:
    """PPO estimates by GAE from its critic: another estimator would go unused."""
    if c["mode"] != "ppo" or c["advantage_estimator"] in ("grpo", "gae"):  # grpo: the default
        return None
    return (
        f"mode=ppo estimates advantages by GAE from its critic; advantage_estimator {c['advantage_estimator']} "
        "would go unused (leave it unset, or set gae)"
    )


CONFIG_CHECKS = (_ppo, _ppo_estimator)
