"""mode=dpo: Direct Preference Optimization (Rafailov et al. 2023) as TRL's DPOTrainer does it with
the sigmoid loss (and label smoothing, cDPO, as TRL 0.7.5 to 0.28 do), on chosen/rejected pairs
(data/preference.py), and the rest of TRL's preference family on the same data and machinery
(dpo_loss_type, losses.preference_loss and losses.kto_loss): ipo; simpo, cpo and orpo, which have no
reference, so no reference model is copied or run and the update's own forward is the only one
(step 2 below is skipped); kto, on unpaired records (each row a record beside its mismatched pair),
its reference point z computed over the whole global batch from step 2's log-probs.

One step:
  1. the next global batch of pairs (one pair per row; `num_truncated` popped, as in SFT);
  2. the summed log-probs of each chosen and rejected completion under the reference model (the
     start model, frozen: a copy taken before any update, optionally kept in pinned host memory)
     and under the policy, by one compiled forward program run once on each, in the same
     micro-batches as the update: identical weights give identical numbers (the update's own
     forward is compiled with its backward and rounds differently), so at step 0 every reward is
     exactly 0 and no pair counts as accurate;
  3. the update: train_step over the loss, with the policy's log-probs of step 2 as values and its
     own forward's gradient. Its metrics: loss, rewards/{chosen,rejected,accuracy,margin},
     logps/{chosen,rejected} (means over pairs), and each loss's own (losses.preference_loss).

The policy's second forward costs about a quarter of a step; it is what makes a tie a tie.

With rl_packing the step packs its pairs (data/rl_packing.py: first-fit-decreasing over pairs, a
pair's chosen and rejected side by side in one row as segments 2q + 1 and 2q + 2) into rows of
rl_packing_row_tokens (0: 2 x max_target_length, an unpacked pair's) and both programs take those:
the sums per pair come out as [rows, slots] arrays (slot q of a row: its pair q, 0 where none), so
every pair stays inside its row whatever the micro-batch or the device. Evaluation stays unpacked.

A row of the batch is a pair, so per_device_batch_size counts pairs and a device runs twice as many
sequences through the model. Eval (eval_interval > 0): the same loss and metrics, prefixed eval_, on
eval_steps fixed batches of the eval split (eval_dataset_path, or the built-in task's eval stream);
without an eval split, nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import losses, sharding
from unitrain.config import check
from unitrain.context import RunContext
from unitrain.data.preference import (
    LABEL,
    PAIR_FIELDS,
    SIDES,
    eval_pair_batches,
    make_preference_iterator,
    per_pair_fields,
)
from unitrain.data.rl_packing import pack_pairs, pair_rows_needed
from unitrain.data.sft import BATCH_FIELDS
from unitrain.engines.buckets import batch_parallelism, bucket_packed_rows
from unitrain.registry import REFERENCE_FREE_LOSSES
from unitrain.tasks.base import Task
from unitrain.tasks.reference import Reference

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
POLICY_KEYS = ("policy_chosen_logps", "policy_rejected_logps")
KTO_POINT = "kto_reference_point"  # float32 [pairs], kto: z, the same in every row


def both_sides(batch, key: str):
    """The chosen and rejected rows of field `key` interleaved, [P, T] x 2 -> [2P, T] (chosen at even
    rows): one forward for both sides that keeps every pair on the device that holds its row."""
    return jnp.stack([batch[f"{side}_{key}"] for side in SIDES], axis=1).reshape(-1, batch[f"chosen_{key}"].shape[-1])


def pair_logps(graphdef, chunk_size: int, params, batch):
    """Summed completion log-probs of every pair under `params`: (chosen [P], rejected [P]) float32,
    by one forward of both sides (both_sides)."""
    both = functools.partial(both_sides, batch)
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(both("inputs"), both("inputs_position"), both("inputs_segmentation"))
    stats = losses.token_stats(model.logits, hidden, both("targets"), chunk_size)
    logps = losses.sequence_logprobs(stats.logprobs, both("targets_segmentation")).reshape(-1, 2)
    return logps[:, 0], logps[:, 1]


def packed_pair_sums(batch, values):
    """Per pair of packed rows (pack_pairs' segments): the sums of `values` [rows, width] over its
    chosen and over its rejected sequence, ([rows, slots], [rows, slots]), slot q + 1 the row's pair q
    (slot 0 and slots without a pair: 0)."""
    seg = batch["inputs_segmentation"]
    rows, width = seg.shape
    slots = width // 2 + 1  # a pair holds at least 2 tokens
    key = (jnp.arange(rows, dtype=jnp.int32)[:, None] * slots + (seg + 1) // 2).reshape(-1)
    chosen = (seg % 2 == 1).reshape(-1)
    total = lambda x: jax.ops.segment_sum(x, key, num_segments=rows * slots).reshape(rows, slots)  # noqa: E731
    flat = values.reshape(-1)
    return total(jnp.where(chosen, flat, 0.0)), total(jnp.where(chosen, 0.0, flat))


def packed_pair_logps(graphdef, chunk_size: int, params, batch):
    """pair_logps of packed rows: (chosen, rejected) [rows, slots] float32 (packed_pair_sums)."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    stats = losses.token_stats(model.logits, hidden, batch["targets"], chunk_size)
    return packed_pair_sums(batch, jnp.where(batch["targets_segmentation"] > 0, stats.logprobs, 0.0))


def completion_lengths(batch):
    """The numbers of loss tokens of every pair's (chosen, rejected) completion, float32 [P]; of
    packed rows, [rows, slots] (packed_pair_sums)."""
    if "targets_segmentation" in batch:
        return packed_pair_sums(batch, (batch["targets_segmentation"] > 0).astype(jnp.float32))
    return tuple((batch[f"{side}_targets_segmentation"] > 0).sum(axis=-1).astype(jnp.float32) for side in SIDES)


def real_pairs(batch):
    """1.0 for a pair whose sequences both carry loss tokens, 0.0 for a padding row (eval batches)
    or an empty slot of packed rows."""
    chosen, rejected = completion_lengths(batch)
    return jnp.logical_and(chosen > 0, rejected > 0).astype(jnp.float32)


def reference_point_rows(batch):
    """KTO's z of `batch` (losses.kto_reference_point over its rejected side, the mismatched pairs),
    in every row."""
    z = losses.kto_reference_point(batch["policy_rejected_logps"], batch["ref_rejected_logps"], real_pairs(batch))
    return jnp.full_like(batch["policy_rejected_logps"], z)


def micro_batched_logps(logps, num_micro: int, params, batch):
    """(chosen [P], rejected [P]) log-probs under `params`, computed micro-batch by micro-batch in
    train_step's split (row i*k + j in micro-batch j), so it never holds more activations than one
    micro-batch of the update does. `logps`: pair_logps with its static arguments bound."""
    micro = jax.tree.map(lambda x: x.reshape(-1, num_micro, *x.shape[1:]).swapaxes(0, 1), batch)
    chosen, rejected = jax.lax.map(lambda mb: logps(params, mb), micro)
    unsplit = lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:])  # noqa: E731
    return unsplit(chosen), unsplit(rejected)


def forward_values(values, traced):
    """`values` as the value, `traced`'s gradient: the policy's log-probs from the forward program
    that scored the reference, differentiated through the update's own forward. x - x is exactly
    0 for finite x, so the value is `values` to the bit."""
    return values + (traced - jax.lax.stop_gradient(traced))


class PairLearner:
    """The preference update over pair rows, shared by mode=dpo (pairs from data files) and
    mode=online_dpo (pairs of sampled answers): the configured loss, its reference, the pass that
    scores the pairs before the update, and the update's batch shardings. A Task mixes it in and
    calls init_pairs(run) before it builds its update."""

    def init_pairs(self, run: RunContext):
        cfg = run.cfg
        self.settings = losses.PreferenceConfig.from_config(cfg)
        self.ref = Reference(run) if self.settings.has_reference else None
        self.kto = self.settings.loss_type == "kto"
        self.rows2d = sharding.batch_sharding(run.mesh, run.rules)
        self.rows1d = sharding.batch_sharding(run.mesh, run.rules, ("batch",))
        self.param_shardings = run.state_shardings["params"]
        self.packing = cfg.rl_packing
        self.fields = BATCH_FIELDS if self.packing else PAIR_FIELDS
        self.pair_logps = functools.partial(
            packed_pair_logps if self.packing else pair_logps, run.graphdef, cfg.logits_chunk_size
        )
        if self.ref is not None:  # without a reference the update's own forward is the only one
            self.logps_fn = self._logps_program(cfg.gradient_accumulation_steps, self.pair_logps, self.fields)
        if self.kto:
            self.reference_point = jax.jit(reference_point_rows, out_shardings=self.rows1d)

    def _logps_program(self, num_micro: int, logps, fields):
        out = self.rows2d if fields == BATCH_FIELDS else self.rows1d  # packed: [rows, slots]
        return jax.jit(
            functools.partial(micro_batched_logps, logps, num_micro),
            in_shardings=(self.param_shardings, {k: self.rows2d for k in fields}),
            out_shardings=(out, out),
        )

    def scored(self, name: str, params, batch) -> dict:
        """`batch` with its pairs' log-probs (pair_logps_of_both) where the loss has a reference; as
        it is without one (the update's own forward is the only one)."""
        if self.ref is None:
            return batch
        return {**batch, **self.pair_logps_of_both(name, self.logps_fn, params, batch)}

    # -- the loss and its batch
    def loss(self, params, batch):
        policy = self.pair_logps(params, batch)
        if self.ref is None:
            return self.objective(policy, None, batch)
        policy = tuple(forward_values(batch[k], x) for k, x in zip(POLICY_KEYS, policy))
        return self.objective(policy, tuple(batch[k] for k in REF_KEYS), batch)

    def objective(self, policy, ref, batch):
        """The configured loss of `batch` from its (chosen, rejected) log-probs under the policy and
        the reference (None without one); kto reads the chosen side, the record's own."""
        if self.kto:
            return losses.kto_loss(
                policy[0], ref[0], batch[LABEL], batch[KTO_POINT], self.settings, weights=real_pairs(batch)
            )
        return losses.preference_loss(policy, ref, completion_lengths(batch), self.settings, weights=real_pairs(batch))

    def batch_shardings(self) -> dict:
        per_pair = self.rows2d if self.packing else self.rows1d
        scored = REF_KEYS + POLICY_KEYS if self.ref is not None else ()
        extra = per_pair_fields(self.cfg) + ((KTO_POINT,) if self.kto else ())
        return {**{k: self.rows2d for k in self.fields}, **{k: per_pair for k in scored + extra}}

    def pair_logps_of_both(self, name: str, program, params, batch) -> dict:
        """{ref_*, policy_*} log-probs of `batch` (without a reference, policy_* alone): the
        reference and the policy through the one compiled `program` (the same input shardings, so
        the same executable), the reference brought to device memory first when it is kept in host
        memory (and dropped after); kto's reference point beside them."""
        out, rows = {}, {k: batch[k] for k in (BATCH_FIELDS if "inputs" in batch else PAIR_FIELDS)}
        if self.ref is not None:
            ref = jax.device_put(self.ref.of(params), self.param_shardings)
            out = dict(zip(REF_KEYS, self.run.programs(name, program, ref, rows)))
            del ref
        out.update(zip(POLICY_KEYS, self.run.programs(name, program, params, rows)))
        if self.kto:
            out[KTO_POINT] = self.run.programs("kto_reference_point", self.reference_point, {**batch, **out})
        return out


class DPOTask(PairLearner, Task):
    def __init__(self, run: RunContext):
        super().__init__(run)
        cfg = self.cfg
        self.init_pairs(run)
        rows = run.layout.rows_per_update
        self.data_iterator = make_preference_iterator(
            cfg, run.tokenizer, rows, jax.process_index(), jax.process_count()
        )
        self.tokens_per_step = 2 * rows * cfg.max_target_length  # both sequences of every pair
        self.update = run.make_update(self.loss, self.batch_shardings())
        batches = eval_pair_batches(cfg, run.tokenizer, run.layout.global_batch_size, cfg.eval_steps)
        self.eval_batches = [sharding.full_rows_to_global(b, self.batch_shardings()) for b in batches]
        if self.eval_batches:
            unpacked = functools.partial(pair_logps, run.graphdef, cfg.logits_chunk_size)
            self.eval_logps_fn = self._logps_program(1, unpacked, PAIR_FIELDS)
            self.eval_fn = jax.jit(self._eval_sums)

    def packed(self, batch: dict) -> dict:
        """This process's pairs packed into rows (pack_pairs): as many as the process that needs the
        most, bucketed to whole micro-batches on every device, so every process has the same shape."""
        cfg = self.cfg
        width = cfg.rl_packing_row_tokens or 2 * cfg.max_target_length
        need = pair_rows_needed(batch, SIDES, width)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            need = int(np.max(multihost_utils.process_allgather(np.int32(need))))
        devices = batch_parallelism(self.run.mesh, self.run.rules)
        multiple = max(1, cfg.gradient_accumulation_steps * devices // jax.process_count())
        rows = bucket_packed_rows(need, multiple)
        return pack_pairs(batch, SIDES, BATCH_FIELDS, width, rows, self.run.tokenizer.pad_id)

    # -- one step
    def step(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        if self.packing:
            batch = self.packed(batch)
        batch = sharding.local_rows_to_global(batch, self.batch_shardings())
        name = f"pair_logps ({len(batch['inputs'])} packed rows)" if self.packing else "pair_logps"
        batch = self.scored(name, state["params"], batch)
        state, metrics = self.run.programs("train_step", self.update, state, batch)
        return state, {**metrics, "num_truncated": truncated}

    # -- eval
    def _eval_sums(self, logps, batch):
        ref = tuple(logps[k] for k in REF_KEYS) if self.ref is not None else None
        loss_sum, (pairs, metrics) = self.objective(tuple(logps[k] for k in POLICY_KEYS), ref, {**batch, **logps})
        return {"loss": (loss_sum, pairs), **metrics}

    def evaluate(self, params, step) -> dict:
        if not self.eval_batches:
            return {}
        outs = []
        for b in self.eval_batches:
            logps = self.pair_logps_of_both("dpo_eval_logps", self.eval_logps_fn, params, b)
            outs.append(self.run.programs("dpo_eval", self.eval_fn, logps, b))
        return eval_means(outs)


def eval_means(outs: list[dict]) -> dict:
    """{eval_<metric>: total sum / total count} over the eval batches' {metric: (sum, count)},
    fetched once after every batch is dispatched."""
    totals: dict = {}
    for sums in jax.device_get(outs):
        for name, (total, count) in sums.items():
            t, c = totals.get(name, (0.0, 0.0))
            totals[name] = (t + float(total), c + float(count))
    return {f"eval_{name}": total / max(count, 1.0) for name, (total, count) in totals.items()}


@check("mode", "dpo_loss_type", "dpo_label_smoothing", "kl_coef", "ref_params_host_offload", "rl_packing")
def _preference_loss(c) -> str | None:
    """dpo_loss_type is mode=dpo's (and online_dpo's); the keys of a reference and of label smoothing need a loss that
    has them; KTO's unpaired records are not packed."""
    loss = c["dpo_loss_type"]
    if c["mode"] not in ("dpo", "online_dpo"):
        return None if loss == "sigmoid" else f"dpo_loss_type={loss} is a loss of mode=dpo; mode is {c['mode']}"
    if c["kl_coef"] > 0:
        why = (
            "has no reference model"
            if loss in REFERENCE_FREE_LOSSES
            else "holds the policy to the reference by dpo_beta"
        )
        return f"dpo_loss_type={loss} {why}; kl_coef is grpo's and ppo's, set it to 0"
    if loss in REFERENCE_FREE_LOSSES and c["ref_params_host_offload"]:
        return f"dpo_loss_type={loss} has no reference model to offload; set ref_params_host_offload=false"
    if c["dpo_label_smoothing"] and loss not in ("sigmoid", "simpo", "cpo"):
        return f"dpo_label_smoothing flips the labels of the sigmoid losses (sigmoid, simpo, cpo); dpo_loss_type={loss} has none"
    if loss == "kto" and c["rl_packing"]:
        return "rl_packing packs preference pairs; dpo_loss_type=kto's unpaired records are not packed, set rl_packing=false"
    return None


CONFIG_CHECKS = (_preference_loss,)
