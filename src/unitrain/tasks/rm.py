"""mode=rm: a reward model trained on preference pairs as TRL's RewardTrainer trains one: a scalar
head over the model (models/scalar_head.py, built by the run builder because this Task says
`scalar_head`), the reward of a sequence its value at the last real token (pool_last), and the
Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) with TRL's centring term
(losses.reward_model_loss; `rm_margin_key`, `rm_center_coef`).

The data are DPO's (data/preference.py: the same formats, chat templates and truncation; one row a
pair, so per_device_batch_size counts pairs). One step is one update over the next global batch, the
loss's denominator the number of pairs, so gradient accumulation is exact. Metrics: loss, accuracy
(r_chosen > r_rejected, strict), margin, rewards/chosen, rewards/rejected; eval (eval_interval > 0)
the same, prefixed eval_, on eval_steps fixed batches of eval_dataset_path (or the built-in task's
eval stream). The start is load_parameters_path (an HF classifier or causal LM, a unitrain
checkpoint) or a random model of the model keys; with LoRA the adapters go on the backbone and the
score trains whole; export_hf_path writes an HF *ForSequenceClassification.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from unitrain import losses, sharding
from unitrain.config import VISION_LANGUAGE_FAMILIES, check
from unitrain.context import RunContext
from unitrain.data.preference import MARGIN, PAIR_FIELDS, eval_pair_batches, make_preference_iterator
from unitrain.models.scalar_head import pool_last
from unitrain.tasks.base import Task
from unitrain.tasks.dpo import both_sides, eval_means, real_pairs


def pair_rewards(graphdef, params, batch):
    """The rewards (chosen [P], rejected [P]) float32 of every pair under `params`: one forward of
    both sides, each sequence's value at its last real token."""
    model = nnx.merge(graphdef, params)
    both = functools.partial(both_sides, batch)
    values = model(both("inputs"), both("inputs_position"), both("inputs_segmentation"))
    rewards = pool_last(values, both("inputs_segmentation"))[:, 0].reshape(-1, 2)
    return rewards[:, 0], rewards[:, 1]


class RMTask(Task):
    scalar_head = True

    def __init__(self, run: RunContext):
        super().__init__(run)
        cfg = self.cfg
        rows = run.layout.rows_per_update
        self.data_iterator = make_preference_iterator(
            cfg, run.tokenizer, rows, jax.process_index(), jax.process_count()
        )
        self.tokens_per_step = 2 * rows * cfg.max_target_length  # both sequences of every pair
        self.rows2d = sharding.batch_sharding(run.mesh, run.rules)
        self.rows1d = sharding.batch_sharding(run.mesh, run.rules, ("batch",))
        self.rewards = functools.partial(pair_rewards, run.graphdef)
        self.update = run.make_update(self.loss, self.batch_shardings())
        batches = eval_pair_batches(cfg, run.tokenizer, run.layout.global_batch_size, cfg.eval_steps)
        self.eval_batches = [sharding.full_rows_to_global(b, self.batch_shardings()) for b in batches]
        if self.eval_batches:
            self.eval_fn = jax.jit(
                self._eval_sums, in_shardings=(run.state_shardings["params"], self.batch_shardings())
            )

    # -- the loss and its batch
    def loss(self, params, batch):
        chosen, rejected = self.rewards(params, batch)
        return losses.reward_model_loss(
            chosen,
            rejected,
            margin=batch.get(MARGIN),
            center_coef=self.cfg.rm_center_coef,
            weights=real_pairs(batch),
        )

    def batch_shardings(self) -> dict:
        margin = {MARGIN: self.rows1d} if self.cfg.rm_margin_key else {}
        return {**{k: self.rows2d for k in PAIR_FIELDS}, **margin}

    # -- one step
    def step(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        batch = sharding.local_rows_to_global(batch, self.batch_shardings())
        state, metrics = self.run.programs("train_step", self.update, state, batch)
        return state, {**metrics, "num_truncated": truncated}

    # -- eval
    def _eval_sums(self, params, batch):
        loss_sum, (pairs, metrics) = self.loss(params, batch)
        return {"loss": (loss_sum, pairs), **metrics}

    def evaluate(self, params, step) -> dict:
        if not self.eval_batches:
            return {}
        return eval_means([self.run.programs("rm_eval", self.eval_fn, params, b) for b in self.eval_batches])


@check("mode", "rm_margin_key", "rm_center_coef", "dataset_path", "eval_dataset_path", "lora_export_adapters")
def _reward_model_mode(c) -> str | None:
    """mode=rm's keys belong to it; its margins are a field of data files; its head trains whole
    beside the adapters, which a PEFT adapter folder of a causal LM cannot hold."""
    if c["mode"] != "rm" and (c["rm_margin_key"] or c["rm_center_coef"]):
        return f"rm_margin_key and rm_center_coef shape mode=rm's loss; mode is {c['mode']}"
    if c["rm_margin_key"] and "builtin" in (c["dataset_path"], c["eval_dataset_path"]):
        return "rm_margin_key reads a field of preference data files; the built-in task's pairs have no margin"
    if c["mode"] == "rm" and c["lora_export_adapters"]:
        return "lora_export_adapters writes a causal LM's PEFT adapters; mode=rm also trains its score head whole: export the merged model (export_hf_path)"
    return None


@check("mode", "model_family", "export_hf_path")
def _classifier_export(c) -> str | None:
    """The export is a *ForSequenceClassification folder: transformers has no such class for a
    vision-language family (an error after training otherwise)."""
    if c["mode"] == "rm" and c["export_hf_path"] and c["model_family"] in VISION_LANGUAGE_FAMILIES:
        return (
            f"mode=rm exports a sequence classifier, which transformers has none of for model_family "
            f"{c['model_family']}; drop export_hf_path (the run's checkpoints keep the reward model)"
        )
    return None


CONFIG_CHECKS = (_reward_model_mode, _classifier_export)
