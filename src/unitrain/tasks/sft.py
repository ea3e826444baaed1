"""mode=sft: cross-entropy on the completion tokens of packed prompt/completion examples.

Evaluation: the loss on `eval_steps` fixed batches of the eval split and, for the built-in task,
the accuracy of greedy answers (evals.TaskEvaluator through the run's sampler).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain import data, losses, rewards, rollout, sharding
from unitrain import step as step_lib
from unitrain.config import ConfigError
from unitrain.evals import TaskEvaluator
from unitrain.tasks.base import RunContext, Task


class SFTTask(Task):
    def __init__(self, run: RunContext):
        super().__init__(run)
        cfg = self.cfg
        self.data_iterator = data.make_sft_iterator(cfg, run.tokenizer, cfg.rows_per_update, "train",
                                                    jax.process_index(), jax.process_count())
        self.tokens_per_step = cfg.rows_per_update * cfg.max_target_length
        self.update = step_lib.make_train_step(self.loss, cfg, run.optimizer, run.state_shardings,
                                               self.batch_shardings())
        self.eval_loss = jax.jit(self._eval_sums)
        self.eval_batches = self._eval_batches() if cfg.eval_interval else []
        self.task_eval = None
        self._seen_loss_tokens = False
        if cfg.eval_interval and cfg.dataset_path == "builtin" and cfg.eval_num_samples:
            self.task_eval = TaskEvaluator(cfg, run.tokenizer, rollout.make_sampler(run), rewards.make_reward_fn(cfg))

    def loss(self, params, batch):
        model = nnx.merge(self.run.graphdef, params)
        logits, _ = model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
        weights = (batch["targets_segmentation"] > 0).astype(jnp.float32)
        loss_sum, count, nll_sum = losses.cross_entropy(logits, batch["targets"], weights, self.cfg.z_loss_weight)
        return loss_sum, (count, {"nll": (nll_sum, count)})

    def batch_shardings(self) -> dict:
        return {k: sharding.batch_sharding(self.run.mesh, self.run.rules) for k in data.BATCH_FIELDS}

    def step(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        if not self._seen_loss_tokens:  # the first batch of the run, checked on the host: no device sync
            self._seen_loss_tokens = bool(batch["targets_segmentation"].any())
            if not self._seen_loss_tokens:
                raise ConfigError(f"step {step}: the batch has no completion tokens to train on (check tokenizer_path, "
                                  f"{self.cfg.completion_key!r}/{self.cfg.messages_key!r} in {self.cfg.dataset_path})")
        batch = step_lib.local_rows_to_global(batch, self.batch_shardings())
        state, metrics = self.run.programs("train_step", self.update, state, batch)
        return state, {**metrics, "num_truncated": truncated}

    def evaluate(self, params, step):
        sums = [self.run.programs("eval_step", self.eval_loss, params, b) for b in self.eval_batches]
        total, count = (sum(float(x[i]) for x in sums) for i in (0, 1))
        return {"eval_loss": total / max(count, 1.0), **(self.task_eval(params, step) if self.task_eval else {})}

    def _eval_batches(self) -> list:
        cfg = self.cfg
        iterator = data.make_sft_iterator(cfg, self.run.tokenizer, cfg.global_batch_size, "eval",
                                          jax.process_index(), jax.process_count())
        batches = []
        for _ in range(cfg.eval_steps):
            batch = next(iterator)
            batch.pop("num_truncated")
            batches.append(step_lib.local_rows_to_global(batch, self.batch_shardings()))
        return batches

    def _eval_sums(self, params, batch):
        loss_sum, (count, _) = self.loss(params, batch)
        return loss_sum, count
