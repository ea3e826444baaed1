"""The teachers of distillation (`teacher_path`): frozen models that score the student's sampled
tokens beside the reference (tasks/reference.py) in the RL step's logprob pass (grpo and ppo,
on-policy: tasks/rl.py rollout_logprobs, the same program, the same bounded chunks of the output
head), or give soft targets on the dataset's tokens in SFT's update (offline: `targets`).

A teacher is any checkpoint a load_parameters_path takes (an HF folder, a unitrain run, its
checkpoints or a step directory; any model source, MoE included), built once on the trainer's mesh
with its own architecture, and kept in pinned host memory between passes with
teacher_host_offload, refused before the load where its parameters cannot fit (as the reward
model is). It scores the student's token ids, so it must share the student's tokenizer (checked
before it loads) and have room for every id the student can sample (checked after).

The distillation term (`distill`): per sampled token the reverse KL to the teachers,
KL_t = sum_i w_i (logp(x_t) - logp_i(x_t)) at the sampled x_t under the old policy, joins the
estimator's advantages as advantage_t = distill_reward_weight * A - distill_coef * KL_t, a dense
per-token signal with or without the outcome reward (verl's OPD, Thinking Machines' on-policy
distillation); with distill_kl_discount each token's KL_t gives way to the discounted sum of the
KL from it to the row's end (tinker-cookbook's kl_discount_factor). Every workflow's trajectory is rows like any other: environment tokens carry no
term (loss_mask 0).

Offline (mode=sft): each teacher's top-`distill_top_k` tokens at every label position, at
`distill_temperature` and renormalised over the k, are soft targets beside the labels
(losses.distill_cross_entropy: (1 - distill_coef) * CE + distill_coef * T^2 * sum_i w_i KL_i; with
gkd_beta GKD's generalised JSD in the KL's place, as TRL's GKDTrainer on dataset completions). The
teacher runs in the update's own program on the micro-batch, its head a chunk of positions at a
time as the student's (losses.teacher_targets, then losses.distill_token_stats): the two models'
full-vocabulary logits exist for one chunk at a time, never for a whole row. tasks/gkd.py chooses
whose completions those rows hold (the dataset's, the teacher's, the student's samples).

Metrics: distill/teacher_kl, with several teachers each one's (distill/teacher_kl/<i>; offline
distill/kl and distill/kl/<i>, tasks/sft.py); at every
evaluation the teachers' eval accuracy, evaluated once by the student's evaluator through a sampler
of the teacher's model, and the student's gap to it (TeacherAccuracy).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from flax import nnx

from unitrain import losses, sharding
from unitrain import step as step_lib
from unitrain.config import check
from unitrain.data.tokenizer import load_tokenizer
from unitrain.engines import colocated
from unitrain.engines.colocated import ColocatedSampler
from unitrain.errors import ConfigError
from unitrain.evals import TaskEvaluator
from unitrain.models import moe, sources
from unitrain.models.base import SharedPrefixModel
from unitrain.reward_model import check_fits, recorded_tokenizer

log = logging.getLogger("unitrain")


def teacher_paths(teacher_path: str) -> list[str]:
    """The paths of the comma list `teacher_path`."""
    return [p.strip() for p in teacher_path.split(",") if p.strip()]


class Teacher:
    """A teacher on the run's mesh: `model`'s graphdef and its `params` as kept between uses (in
    pinned host memory with teacher_host_offload; abstract arrays where tools/bench.py sizes a
    teacher without its weights), `device` their device shardings (where the logprob pass brings
    them), `shares_prefix` whether it computes a group's prompt once (SharedPrefixModel), `key` the
    batch key of its logprobs and `weight` its weight in the KL."""

    def __init__(self, model, params: dict, key: str, weight: float):
        self.graphdef, self.params = nnx.graphdef(model), params
        self.device = step_lib.device_shardings(params)
        self.shares_prefix = isinstance(model, SharedPrefixModel)
        self.key, self.weight = key, weight

    def on_device(self):
        """The parameters in device memory (where teacher_host_offload keeps them in the host's)."""
        return jax.device_put(self.params, self.device)

    def sampler(self, run) -> ColocatedSampler:
        """A colocated sampler of the teacher's model on the trainer's mesh (its own completions:
        distill_seq_kd; its eval accuracy: TeacherAccuracy); the caller pushes on_device() to it."""
        model = nnx.merge(self.graphdef, self.params)
        return colocated.from_run(dataclasses.replace(run, model=model, graphdef=self.graphdef))

    def targets(self, params, batch, cfg, vocab: int) -> losses.SoftTargets:
        """The teacher's soft targets (losses.teacher_targets) at every position of SFT's rows, over
        the student's `vocab`; `params` (self.params, as the program takes them) brought to device memory."""
        model = nnx.merge(self.graphdef, jax.device_put(params, self.device))
        rows = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
        with moe.collect_router_stats():  # the teacher's routers are not the student's to balance
            hidden = model.hidden_states(*rows)
        return losses.teacher_targets(
            model.logits, hidden, cfg.logits_chunk_size, cfg.distill_top_k, cfg.distill_temperature, vocab
        )


def load_teachers(run) -> list[Teacher]:
    """The config's teachers, loaded once ([] without teacher_path)."""
    paths = teacher_paths(run.cfg.teacher_path)
    return [load_teacher(run, p, f"teacher_logprobs_{i}", w) for i, (p, w) in enumerate(zip(paths, weights(run.cfg)))]


def weights(cfg) -> list[float]:
    """Each teacher's weight: teacher_weights, else equal ones."""
    count = len(teacher_paths(cfg.teacher_path))
    return [float(w) for w in cfg.teacher_weights or [1.0 / max(count, 1)] * count]


def load_teacher(run, path: str, key: str, weight: float) -> Teacher:
    """The teacher at `path` (any checkpoint a load_parameters_path takes), checked and built on the
    run's mesh with its own architecture."""
    cfg = run.cfg
    check_vocabulary(run, path)
    check_fits(cfg, run.mesh, run.rules, path, "teacher_path", "teacher_host_offload")
    model = sources.build(cfg.replace(load_parameters_path=path), run.mesh)
    if model.vocab_size < run.model.vocab_size:
        raise ConfigError(
            f"teacher_path={path!r}: the teacher has {model.vocab_size} token embeddings, fewer than the "
            f"student's {run.model.vocab_size}; it cannot score every id the student samples"
        )
    params = nnx.to_pure_dict(nnx.state(model))
    if cfg.teacher_host_offload:
        params = sharding.with_memory_kind(params, "pinned_host")
    log.info(
        "teacher %s (weight %g)%s",
        path,
        weight,
        ", kept in host memory between uses" if cfg.teacher_host_offload else "",
    )
    return Teacher(model, params, key, weight)


class TeacherAccuracy:
    """How far the student's eval accuracy is from each teacher's: the teachers evaluated once, at
    the first evaluation, by the student's own generation evaluator (evals.TaskEvaluator: the same
    prompts, greedy answers and reward) through a sampler of their own; then at every evaluation
    the gap, teacher minus student."""

    def __init__(self, run, teachers: list[Teacher]):
        self.run, self.teachers, self.accuracies = run, teachers, None

    def __call__(self, evaluator, params, step: int) -> dict:
        """evaluator(params, step), the student's metrics, and beside its eval_accuracy each teacher's
        (eval_teacher_accuracy) and the gap (eval_teacher_accuracy_gap), suffixed /<i> per teacher
        when there are several; the student's alone without teachers or with a data format's own
        evaluator. The teachers go first, so the evaluator's samples stay the student's."""
        if not self.teachers or not isinstance(evaluator, TaskEvaluator):
            return evaluator(params, step)
        if self.accuracies is None:
            self.accuracies = [
                evaluator(t.on_device(), 0, sampler=t.sampler(self.run))["eval_accuracy"] for t in self.teachers
            ]
            log.info("teachers' eval accuracy: %s", ", ".join(f"{a:.4f}" for a in self.accuracies))
        results = evaluator(params, step)
        for i, accuracy in enumerate(self.accuracies):
            suffix = f"/{i}" if len(self.teachers) > 1 else ""
            results[f"eval_teacher_accuracy{suffix}"] = accuracy
            results[f"eval_teacher_accuracy_gap{suffix}"] = accuracy - results["eval_accuracy"]
        return results


def check_vocabulary(run, path: str) -> None:
    """A ConfigError unless the teacher at `path` exists and its tokenizer (the HF folder's, or the
    one its unitrain run recorded) is the student's, token for token."""
    if not os.path.isdir(path):
        raise ConfigError(f"teacher_path={path!r} does not exist (an HF folder or a unitrain checkpoint)")
    found = recorded_tokenizer(path)
    if found is None:
        raise ConfigError(f"teacher_path={path!r} holds neither an HF checkpoint nor a unitrain run's config.yml")
    theirs = load_tokenizer(*found, run.cfg.trust_remote_code).vocabulary()
    ours = run.tokenizer.vocabulary()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise ConfigError(
            f"teacher_path={path!r}: the teacher's tokenizer ({len(theirs)} tokens) is not the student's "
            f"({len(ours)} tokens; {differ} token-id pairs differ); the teacher scores the student's token "
            "ids, so both must share one vocabulary"
        )


def distill(teachers: list[Teacher], cfg, advantages: np.ndarray, batch: dict) -> tuple[np.ndarray, dict]:
    """The estimator's `advantages` ([rows] or [rows, C]) with the distillation term, [rows, C]
    (losses.distill_advantages over the old policy's and the teachers' logprobs), and its metrics:
    the weighted per-token KL, and with several teachers each one's."""
    mask = batch["loss_mask"]
    out, kl = losses.distill_advantages(
        advantages,
        batch["old_logprobs"],
        [batch[t.key] for t in teachers],
        [t.weight for t in teachers],
        mask,
        cfg.distill_coef,
        cfg.distill_reward_weight,
        cfg.distill_kl_discount,
    )
    tokens = max(mask.sum(), 1)
    metrics = {"distill/teacher_kl": float(np.asarray(kl).sum() / tokens)}
    if len(teachers) > 1:  # each teacher's own, unweighted: which one the student is far from
        sampled = mask > 0
        for i, t in enumerate(teachers):
            metrics[f"distill/teacher_kl/{i}"] = float((batch["old_logprobs"] - batch[t.key])[sampled].sum() / tokens)
    return np.asarray(out), metrics


@check("teacher_path", "distill_coef", "distill_reward_weight", "mode", "distill_seq_kd")
def _distillation(c) -> str | None:
    named = bool(teacher_paths(c["teacher_path"]))
    if not named and c["distill_coef"] == 0 and c["distill_reward_weight"] == 1:
        return None
    if not named:
        return "distill_coef and distill_reward_weight weigh a teacher's KL and the reward: set teacher_path"
    if c["distill_coef"] == 0 and not c["distill_seq_kd"]:  # with it the teacher writes the labels: SeqKD alone
        return "teacher_path is set but distill_coef is 0, so the teacher would score for nothing: set distill_coef > 0"
    if c["mode"] == "sft":
        if c["distill_coef"] > 1:
            return "mode=sft weighs the labels by 1 - distill_coef and the teacher's KL by distill_coef: set distill_coef <= 1"
        if c["distill_reward_weight"] != 1:
            return (
                "distill_reward_weight weighs the RL step's outcome advantage; mode=sft's labels weigh 1 - distill_coef"
            )
        return None
    if c["mode"] not in ("grpo", "ppo"):
        return (
            f"teacher_path: a teacher distils in mode sft (offline) or grpo and ppo (on-policy), not mode {c['mode']}"
        )
    return None


@check("teacher_path", "mode", "distill_kl_discount")
def _kl_discount(c) -> str | None:
    if c["distill_kl_discount"] == 0 or (teacher_paths(c["teacher_path"]) and c["mode"] in ("grpo", "ppo")):
        return None
    return (
        "distill_kl_discount discounts on-policy distillation's per-token KL: it needs teacher_path in mode grpo or ppo"
    )


@check("teacher_path", "mode", "distill_temperature", "distill_top_k", "gkd_beta")
def _soft_targets(c) -> str | None:
    if c["distill_temperature"] == 1 and c["distill_top_k"] == 64 and c["gkd_beta"] is None:
        return None
    if c["mode"] == "sft" and teacher_paths(c["teacher_path"]):
        return None
    return (
        "distill_temperature, distill_top_k and gkd_beta shape a teacher's soft targets in mode=sft (with "
        "teacher_path); on-policy distillation scores the sampled tokens at rollout_temperature"
    )


@check("teacher_path", "teacher_weights")
def _teacher_weights(c) -> str | None:
    count = len(teacher_paths(c["teacher_path"]))
    weights = c["teacher_weights"]
    if weights is None or len(weights) == count:
        return None
    return f"teacher_weights has {len(weights)} weights but teacher_path names {count} teachers"


CONFIG_CHECKS = (_distillation, _kl_discount, _soft_targets, _teacher_weights)
