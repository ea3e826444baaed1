"""mode=sft: cross-entropy on the completion tokens (the assistant turns of a chat) of packed examples.

Evaluation: the loss on `eval_steps` fixed batches of the eval split and, as GRPO evaluates, answers
generated for the first `eval_num_samples` eval prompts (evals.TaskEvaluator through the run's
sampler), scored by the first reward in `reward` against the label (label_key's field, else the
completion; GSM8K's '#### <answer>' labels by the math reward unless `reward` is set, evals.sft_reward_fn):
greedy accuracy and pass@k; the first greedy answers go to TensorBoard as samples. With
`env` set (training on the environment's demonstrations) the answers are episodes with it. A
data format may bring its own evaluator instead (data/formats.py; the recommender's HR/NDCG).

Offline distillation (`teacher_path`, tasks/teacher.py): the teachers' top-k tokens at each label
position are soft targets beside the labels, their KL logged as distill/kl (per label token, at
distill_temperature, unscaled, weighted by teacher_weights; with several teachers each one's too,
distill/kl/<i>; with gkd_beta GKD's divergence in its place, distill/jsd); the teachers are loaded
once and run in the update's program, on each micro-batch. The eval loss stays the labels' cross-entropy: it needs no teacher. With
distill_lmbda or distill_seq_kd a step's completions may be the student's or the teacher's samples
of its prompts (tasks/gkd.py, by the run's sampler: the one the evaluation uses).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from unitrain import losses, sharding
from unitrain.data import format_choice
from unitrain.data.images import IMAGE_FIELDS
from unitrain.data.sft import BATCH_FIELDS, eval_prompt_records, make_sft_iterator
from unitrain.data.sources import split_path
from unitrain.engines.base import close
from unitrain.engines.factory import make_sampler
from unitrain.envs.factory import demonstrations
from unitrain.errors import ConfigError
from unitrain.evals import TaskEvaluator, sft_reward_fn, warn_if_answers_cut
from unitrain.rollout.driver import make_workflow
from unitrain.tasks import gkd
from unitrain.tasks.base import RunContext, Task
from unitrain.tasks.gkd import CompletionMix
from unitrain.tasks.teacher import TeacherAccuracy, load_teachers


class SFTTask(Task):
    def __init__(self, run: RunContext, teachers: list | None = None):
        """`teachers`: built ones in place of teacher_path's (tools/bench.py's abstract teachers)."""
        super().__init__(run)
        cfg = self.cfg
        rows = run.layout.rows_per_update
        self.demonstration = demonstrations(cfg)
        self.data_iterator = make_sft_iterator(
            cfg, run.tokenizer, rows, "train", jax.process_index(), jax.process_count(), self.demonstration
        )
        self.tokens_per_step = rows * cfg.max_target_length
        self.teachers = load_teachers(run) if teachers is None else teachers
        # The teachers whose soft targets the update takes: none where distill_coef is 0 (distill_seq_kd
        # alone: the labels' cross-entropy on the teacher's samples, sequence-level KD).
        self.scorers = self.teachers if cfg.distill_coef > 0 else []
        self.teacher_accuracy = TeacherAccuracy(run, self.teachers)
        self.update = run.make_update(
            self.loss, self.batch_shardings(), tuple(jax.tree.map(lambda x: x.sharding, t.params) for t in self.scorers)
        )
        self.eval_loss = jax.jit(self._eval_sums)
        self.eval_batches = self._eval_batches() if cfg.evaluates else []
        self.task_eval, self.text, self.mix = None, "", None
        self._seen_loss_tokens = False
        eval_path = split_path(cfg, "eval") if cfg.evaluates else "synthetic"
        generates = eval_path != "synthetic" and cfg.eval_num_samples  # synthetic rows have no prompts or answers
        mixes = cfg.distill_lmbda > 0 or cfg.distill_seq_kd
        self.sampler = make_sampler(run) if generates or mixes else None
        if mixes:
            self.mix = CompletionMix(run, self.sampler, self.teachers[0] if cfg.distill_seq_kd else None)
        if generates:
            self.task_eval = format_choice.data_format(cfg).evaluator(cfg, run.tokenizer, self.sampler)
            if self.task_eval is None:
                records = None if eval_path == "builtin" else eval_prompt_records(cfg, run.tokenizer)
                warn_if_answers_cut(cfg, run.tokenizer, records)
                self.task_eval = TaskEvaluator(
                    cfg,
                    run.tokenizer,
                    self.sampler,
                    sft_reward_fn(cfg, records),
                    make_workflow(run, "multi_turn" if cfg.env else "single_turn"),  # the demonstrations' env plays
                    records,
                )

    def close(self) -> None:
        if self.sampler is not None:
            close(self.sampler)

    def loss(self, params, batch, *teacher_params):
        """The labels' cross-entropy; with `teacher_params` (one tree per teacher: the update's, not
        the eval's) the distillation loss, losses.distill_cross_entropy."""
        cfg = self.cfg
        model = nnx.merge(self.run.graphdef, params)
        hidden = model.hidden_states(
            batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], **self._images(model, batch)
        )
        weights = (batch["targets_segmentation"] > 0).astype(jnp.float32)
        if not teacher_params:
            stats = losses.token_stats(model.logits, hidden, batch["targets"], cfg.logits_chunk_size)
            loss_sum, count, nll_sum = losses.cross_entropy(stats, weights, cfg.z_loss_weight)
            return loss_sum, (count, {"nll": (nll_sum, count)})
        vocab = self.run.model.vocab_size
        soft = [t.targets(p, batch, cfg, vocab) for t, p in zip(self.scorers, teacher_params)]
        stats, divergences = losses.distill_token_stats(
            model.logits,
            hidden,
            batch["targets"],
            soft,
            cfg.logits_chunk_size,
            cfg.distill_temperature,
            cfg.gkd_beta,
        )
        loss_sum, count, nll_sum, divergence_sum, each = losses.distill_cross_entropy(
            stats,
            divergences,
            [t.weight for t in self.scorers],
            weights,
            cfg.distill_coef,
            cfg.distill_temperature,
            cfg.z_loss_weight,
        )
        name = "distill/kl" if cfg.gkd_beta is None else "distill/jsd"
        metrics = {"nll": (nll_sum, count), name: (divergence_sum, count)}
        if len(each) > 1:  # each teacher's own, unweighted: which one the student is far from
            metrics.update({f"{name}/{i}": (s, count) for i, s in enumerate(each)})
        return loss_sum, (count, metrics)

    def _images(self, model, batch) -> dict:
        """The decoder's image arguments of a batch with images (max_image_patches): the rows' images
        encoded by the tower (a frozen one passes no gradient), M-RoPE's positions."""
        if "pixels" not in batch:
            return {}
        features = model.encode_rows(batch)
        if self.cfg.freeze_vision_tower:
            features = jax.lax.stop_gradient(features)
        return {"image_features": features, "rope_positions": batch["rope_positions"]}

    def batch_shardings(self) -> dict:
        fields = BATCH_FIELDS + (IMAGE_FIELDS if self.cfg.max_image_patches else ())
        return {k: sharding.batch_sharding(self.run.mesh, self.run.rules) for k in fields}

    def step(self, state, step):
        batch = next(self.data_iterator)
        truncated = int(batch.pop("num_truncated"))
        if not self._seen_loss_tokens:  # the first batch of the run, checked on the host: no device sync
            self._seen_loss_tokens = bool(batch["targets_segmentation"].any())
            if not self._seen_loss_tokens:
                raise ConfigError(
                    f"step {step}: the batch has no completion tokens to train on (check tokenizer_path, "
                    f"{self.cfg.completion_key!r}/{self.cfg.messages_key!r} in {self.cfg.dataset_path})"
                )
        source = self.mix.source(step) if self.mix else gkd.DATASET
        # The same keys every step of a mix, so that the logged means span every step.
        mixed = {"distill/on_policy": float(source == gkd.STUDENT), "distill/samples_dropped": 0.0} if self.mix else {}
        if source == gkd.DATASET:
            batch = sharding.local_rows_to_global(batch, self.batch_shardings())
        else:
            batch, sampled = self.mix.rows(batch, state["params"], step, source)
            batch = sharding.full_rows_to_global(batch, self.batch_shardings())
            mixed.update(sampled)
        teachers = [t.params for t in self.scorers]
        state, metrics = self.run.programs("train_step", self.update, state, batch, *teachers)
        return state, {**metrics, **mixed, "num_truncated": truncated}

    def evaluate(self, params, step):
        sums = [self.run.programs("eval_step", self.eval_loss, params, b) for b in self.eval_batches]
        total, count = (sum(float(x[i]) for x in sums) for i in (0, 1))
        if self.task_eval is None:
            return {"eval_loss": total / max(count, 1.0)}
        generated = self.teacher_accuracy(self.task_eval, params, step)
        self.text = self.task_eval.samples
        return {"eval_loss": total / max(count, 1.0), **generated}

    def samples_text(self, step):
        text, self.text = self.text, ""  # each evaluation's answers, once
        return text

    def _eval_batches(self) -> list:
        cfg, rows = self.cfg, self.run.layout.global_batch_size
        iterator = make_sft_iterator(
            cfg, self.run.tokenizer, rows, "eval", jax.process_index(), jax.process_count(), self.demonstration
        )
        batches = []
        for batch in itertools.islice(iterator, cfg.eval_steps):  # fewer when the eval data runs out
            batch.pop("num_truncated")
            batches.append(sharding.local_rows_to_global(batch, self.batch_shardings()))
        if not batches:
            raise ConfigError(
                f"eval_dataset_path ({split_path(cfg, 'eval')}) does not fill one eval batch of "
                f"{rows} rows of {cfg.max_target_length} tokens; add eval records"
            )
        return batches

    def _eval_sums(self, params, batch):
        loss_sum, (count, _) = self.loss(params, batch)
        return loss_sum, count
