"""mode=dpo: Direct Preference Optimization (Rafailov et al. 2023) as TRL's DPOTrainer does it with
the sigmoid loss (and label smoothing, cDPO), on chosen/rejected pairs (data/preference.py).

One step:
  1. the next global batch of pairs (one pair per row; `num_truncated` popped, as in SFT);
  2. the summed log-probs of each chosen and rejected completion under the reference model (the
     start model, frozen: a copy taken before any update, optionally kept in pinned host memory),
     one jitted forward over the batch in the same micro-batches as the update;
  3. the update: train_step over losses.dpo_loss, which adds the policy's log-probs. Its metrics:
     loss, rewards/{chosen,rejected,accuracy,margin}, logps/{chosen,rejected} (means over pairs).

A row of the batch is a pair, so per_device_batch_size counts pairs and a device runs twice as many
sequences through the model. Eval (eval_interval > 0): the same loss and metrics, prefixed eval_, on
eval_steps fixed batches of the eval split (eval_dataset_path, or the built-in task's eval stream);
without an eval split, nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain import lora, losses, sharding
from unitrain import step as step_lib
from unitrain.data.preference import PAIR_FIELDS, SIDES, eval_pair_batches, make_preference_iterator
from unitrain.run import RunContext
from unitrain.tasks.base import Task

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def pair_logps(graphdef, chunk_size: int, params, batch):
    """Summed completion log-probs of every pair under `params`: (chosen [P], rejected [P]) float32.

    One forward for both sides: the rows are interleaved ([P, 2, T] -> [2P, T]), which keeps every
    pair on the device that holds its row."""

    def both(key):
        return jnp.stack([batch[f"{side}_{key}"] for side in SIDES], axis=1).reshape(
            -1, batch[f"chosen_{key}"].shape[-1]
        )

    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(both("inputs"), both("inputs_position"), both("inputs_segmentation"))
    stats = losses.token_stats(model.logits, hidden, both("targets"), chunk_size)
    logps = losses.sequence_logprobs(stats.logprobs, both("targets_segmentation")).reshape(-1, 2)
    return logps[:, 0], logps[:, 1]


def real_pairs(batch):
    """1.0 for a pair whose sequences both carry loss tokens, 0.0 for a padding row (eval batches)."""
    return jnp.logical_and(*(batch[f"{side}_targets_segmentation"].max(axis=-1) > 0 for side in SIDES)).astype(
        jnp.float32
    )


def reference_logps(logps, num_micro: int, device, ref_params, batch) -> dict:
    """{ref_chosen_logps, ref_rejected_logps} [P] of the reference, computed micro-batch by micro-batch
    in train_step's split (row i*k + j in micro-batch j), so it never holds more activations than
    one micro-batch of the update does. `logps`: pair_logps with its static arguments bound;
    `device`: the reference's shardings in device memory (it may be kept in host memory)."""
    ref_params = jax.device_put(ref_params, device)
    micro = jax.tree.map(lambda x: x.reshape(-1, num_micro, *x.shape[1:]).swapaxes(0, 1), batch)
    chosen, rejected = jax.lax.map(lambda mb: logps(ref_params, mb), micro)
    unsplit = lambda x: x.swapaxes(0, 1).reshape(-1)  # noqa: E731
    return {"ref_chosen_logps": unsplit(chosen), "ref_rejected_logps": unsplit(rejected)}


class DPOTask(Task):
    def __init__(self, run: RunContext):
        super().__init__(run)
        cfg = self.cfg
        # Copied now: the first update donates the start parameters.
        # With LoRA the reference is the base with its adapters off: the live arrays, no copy (reference()).
        self.ref_params = None if cfg.lora_rank else step_lib.frozen_copy(run.init_params, cfg.ref_params_host_offload)
        rows = run.layout.rows_per_update
        self.data_iterator = make_preference_iterator(
            cfg, run.tokenizer, rows, jax.process_index(), jax.process_count()
        )
        self.tokens_per_step = 2 * rows * cfg.max_target_length  # both sequences of every pair
        self.rows2d = sharding.batch_sharding(run.mesh, run.rules)
        self.rows1d = sharding.batch_sharding(run.mesh, run.rules, ("batch",))
        pair_shardings = {k: self.rows2d for k in PAIR_FIELDS}
        ref_in = jax.tree.map(lambda x: x.sharding, self.reference(run.init_params))
        self.ref_device = step_lib.device_shardings(self.reference(run.init_params))
        self.pair_logps = functools.partial(pair_logps, run.graphdef, cfg.logits_chunk_size)
        self.ref_fn = jax.jit(
            functools.partial(reference_logps, self.pair_logps, cfg.gradient_accumulation_steps, self.ref_device),
            in_shardings=(ref_in, pair_shardings),
            out_shardings={k: self.rows1d for k in REF_KEYS},
        )
        self.update = step_lib.make_train_step(
            self.loss,
            step_lib.StepConfig.from_config(cfg, run.learning_rate),
            run.optimizer,
            run.state_shardings,
            self.batch_shardings(),
        )
        self.eval_batches = self._eval_batches() if cfg.evaluates else []
        if self.eval_batches:
            self.eval_fn = jax.jit(
                self._eval_sums, in_shardings=(run.state_shardings["params"], ref_in, pair_shardings)
            )

    # -- the loss and its batch
    def loss(self, params, batch):
        chosen, rejected = self.pair_logps(params, batch)
        return losses.dpo_loss(
            chosen,
            rejected,
            batch["ref_chosen_logps"],
            batch["ref_rejected_logps"],
            beta=self.cfg.dpo_beta,
            label_smoothing=self.cfg.dpo_label_smoothing,
            weights=real_pairs(batch),
        )

    def batch_shardings(self) -> dict:
        return {**{k: self.rows2d for k in PAIR_FIELDS}, **{k: self.rows1d for k in REF_KEYS}}

    def reference(self, params):
        """The reference policy's parameters: the frozen start, or with LoRA the base of `params`."""
        return lora.adapters_off(params) if self.ref_params is None else self.ref_params

    # -- one step
    def step(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        batch = step_lib.local_rows_to_global(batch, self.rows2d)
        batch = {**batch, **self.run.programs("reference_logps", self.ref_fn, self.reference(state["params"]), batch)}
        state, metrics = self.run.programs("train_step", self.update, state, batch)
        return state, {**metrics, "num_truncated": truncated}

    # -- eval
    def _eval_batches(self) -> list[dict]:
        cfg = self.cfg
        if not cfg.eval_dataset_path and cfg.dataset_path != "builtin":
            return []  # files without an eval split: nothing to evaluate on
        batches = eval_pair_batches(cfg, self.run.tokenizer, self.run.layout.global_batch_size, cfg.eval_steps)
        return [step_lib.full_rows_to_global(b, self.rows2d) for b in batches]

    def _eval_sums(self, params, ref_params, batch):
        ref = reference_logps(self.pair_logps, 1, self.ref_device, ref_params, batch)
        loss_sum, (pairs, metrics) = self.loss(params, {**batch, **ref})
        return {"loss": (loss_sum, pairs), **metrics}

    def evaluate(self, params, step) -> dict:
        if not self.eval_batches:
            return {}
        outs = [
            self.run.programs("dpo_eval", self.eval_fn, params, self.reference(params), b) for b in self.eval_batches
        ]
        totals: dict = {}
        for sums in jax.device_get(outs):  # one fetch after every batch is dispatched
            for name, (total, count) in sums.items():
                t, c = totals.get(name, (0.0, 0.0))
                totals[name] = (t + float(total), c + float(count))
        return {f"eval_{name}": total / max(count, 1.0) for name, (total, count) in totals.items()}
