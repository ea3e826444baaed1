"""GKD's mix of completions in offline distillation (mode=sft with teacher_path), as TRL's
GKDTrainer draws it (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"): a step's rows keep the batch's prompts, and their completions are

    the dataset's                  by default (offline distillation as it was);
    the teacher's samples          every step with distill_seq_kd (TRL's seq_kd: sequence-level KD);
    the student's own samples      with probability distill_lmbda (TRL's lmbda: on-policy), drawn
                                   per step after seq_kd, so that it wins over it.

The teachers' soft targets and the loss (losses.distill_token_stats) are the dataset batch's; on
sampled rows they score the sampled tokens. A prompt is an example's tokens before its first
trained one (the prompt text; a chat's turns before the first trained assistant turn, whose header
the template puts in the prompt), so a step's prompts are those the data gave it: the data's position
moves as offline, and a sampled step reads none of the dataset's completions. The coin and the
sampling key come from (seed, step): the same on every process and after a resume. Sampling is
the rollouts' (rollout_temperature, rollout_top_k, rollout_top_p, rollout_max_response_len new
tokens, stopping at EOS), by the run's sampler (the student) or a colocated one of the teacher's model.

The sampled examples (prompt and completion, cut at max_target_length) are laid out as SFT's rows
(data/sft.py): first-fit into the step's rows in order, one a row with packing=false; an example
that finds no room is left out of the step and counted (distill/samples_dropped). With several
processes each sees the whole batch's prompts (the sampler wants the same prompts everywhere) and
lays out the same rows.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from unitrain.config import check
from unitrain.data.sft import BATCH_FIELDS
from unitrain.engines.base import SamplingParams, release
from unitrain.tasks.teacher import teacher_paths

DATASET, STUDENT, TEACHER = "dataset", "student", "teacher"


def prompts(batch: dict) -> list[list[int]]:
    """Each example's tokens up to its first trained target (the token that predicts the first
    trained one), in row order; an example with no trained target has none."""
    out = []
    for inputs, segments, trained in zip(batch["inputs"], batch["inputs_segmentation"], batch["targets_segmentation"]):
        for s in np.unique(segments[segments > 0]):
            columns = np.flatnonzero(segments == s)
            first = columns[trained[columns] > 0]
            if len(first):
                out.append(inputs[columns[0] : first[0] + 1].tolist())
    return out


def sft_rows(examples: list[tuple[list[int], list[int]]], rows: int, width: int, pad_id: int, per_row: int):
    """(SFT's batch fields of `rows` rows of `width` tokens, examples left out): each (prompt,
    completion) cut at `width` tokens, first-fit into the rows, at most `per_row` a row; the
    completion's tokens are the targets trained on, as data/sft.py lays out an example."""
    out = {k: np.zeros((rows, width), np.int32) for k in BATCH_FIELDS}
    out["inputs"][:], out["targets"][:] = pad_id, pad_id
    used, count, dropped = np.zeros(rows, int), np.zeros(rows, int), 0
    for prompt, completion in examples:
        ids = (prompt + completion)[:width]
        fits = np.flatnonzero((used + len(ids) <= width) & (count < per_row))
        if not len(fits):
            dropped += 1
            continue
        r = fits[0]
        start, end = used[r], used[r] + len(ids)
        used[r], count[r] = end, count[r] + 1
        out["inputs"][r, start:end] = ids
        out["inputs_position"][r, start:end] = np.arange(len(ids))
        out["inputs_segmentation"][r, start:end] = count[r]
        out["targets"][r, start : end - 1] = ids[1:]
        out["targets_segmentation"][r, start + len(prompt) - 1 : end - 1] = count[r]
    return out, dropped


class CompletionMix:
    """The module docstring's choice of a step's completions: `source(step)`, and `rows(batch,
    params, step, source)` the sampled step's rows. `sampler`: the student's (the run's sampler);
    `teacher`: the teacher that samples with distill_seq_kd (tasks/teacher.py), else None."""

    def __init__(self, run, sampler, teacher=None):
        cfg = run.cfg
        self.cfg, self.sampler, self.pad_id = cfg, sampler, run.tokenizer.pad_id
        self.teacher, self.teacher_sampler = teacher, teacher.sampler(run) if teacher is not None else None
        self.rows_per_step = run.layout.rows_per_update
        self.sampling = SamplingParams.from_config(cfg, stop_token_ids=(run.tokenizer.eos_id,))

    def source(self, step: int) -> str:
        """Whose completions step `step` trains on."""
        if np.random.default_rng([self.cfg.seed, step]).random() < self.cfg.distill_lmbda:
            return STUDENT
        return TEACHER if self.teacher is not None else DATASET

    def rows(self, batch: dict, params, step: int, source: str) -> tuple[dict, dict]:
        """(the whole step's rows, on every process, of this process's `batch`'s prompts with the
        completions `source` samples from them; their metrics)."""
        if jax.process_count() > 1:
            keep = ("inputs", "inputs_segmentation", "targets_segmentation")
            batch = {k: np.asarray(multihost_utils.process_allgather(batch[k], tiled=True)) for k in keep}
        asked = prompts(batch)
        sampler = self.sampler if source == STUDENT else self.teacher_sampler
        sampler.update_weights(params if source == STUDENT else self.teacher.on_device(), step)
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), step)
        done = sampler.generate(asked, self.sampling, key)
        release(sampler)  # nothing more is sampled before the update
        completions = [done.tokens[i, : done.lengths[i]].tolist() for i in range(len(asked))]
        per_row = self.cfg.max_target_length if self.cfg.packing else 1
        rows, dropped = sft_rows(
            list(zip(asked, completions)), self.rows_per_step, self.cfg.max_target_length, self.pad_id, per_row
        )
        return rows, {"distill/samples_dropped": float(dropped)}


@check("distill_lmbda", "distill_seq_kd", "mode", "teacher_path", "distill_coef", "env")
def _mix(c) -> str | None:
    if c["distill_lmbda"] == 0 and not c["distill_seq_kd"]:
        return None
    if c["mode"] != "sft" or not teacher_paths(c["teacher_path"]):
        return (
            "distill_lmbda and distill_seq_kd choose the completions of offline distillation: mode=sft with "
            "teacher_path (grpo and ppo with teacher_path distil on their own rollouts)"
        )
    if c["env"]:
        return "distill_lmbda and distill_seq_kd sample single answers; an env's episodes distil on-policy in mode=grpo"
    if c["distill_seq_kd"] and len(teacher_paths(c["teacher_path"])) > 1:
        return "distill_seq_kd samples one teacher's completions, but teacher_path names several"
    if c["distill_lmbda"] > 0 and c["distill_coef"] != 1:
        return (
            "distill_lmbda trains on the student's own samples, whose labels are its own tokens: GKD's loss "
            "is the divergence alone, set distill_coef=1"
        )
    return None


CONFIG_CHECKS = (_mix,)
