"""The RL step every RL mode shares (GRPO and PPO are siblings over it: tasks/grpo.py, tasks/ppo.py),
as named stages (`RLTask.step`):

  1. rollouts: the step's groups from the executor (rollout/executor.py): rounds of
     `over_sampling_batch_size` prompts, a workflow's group of n trajectories each (rollout/workflow.py),
     scored, reshaped by the reward shapers (rollout/shaping.py: DAPO's overlong penalty) and judged
     by the filter (rollout/groups.py) as each finishes, until `rollout_batch_size` groups pass.
     Groups in flight from earlier steps (max_staleness) go on first, with this step's parameters,
     pushed to the sampler first (engines/base.py; colocated by default: no copy; sampler mesh: a
     timed copy to its devices), as do the rounds the step starts;
  2. rows: the groups as the train batch's rows (the layout below), cut once into the update-sized
     chunks every pass and update of the step takes (`StepRows`: with rl_packing, packed once); the
     fields they share (the inputs, their positions and segments, the targets, the routes) go to the
     devices once a step, each program's others (loss mask, advantages, logprobs...) when it runs;
  3. passes: what the updates read of the models before they change them, in one program per chunk of
     rows: the sampled tokens' logprobs under the trainer's forward (the PPO "old" policy), with a
     KL term the reference's (tasks/reference.py), with teacher_path each teacher's
     (tasks/teacher.py), and each extra learner's (PPO's critic values). With one optimizer update
     per step (one mini-batch, num_iterations 1), no KL in the reward and no teacher, the old policy
     is the one being updated: the loss takes its own logprobs under stop_gradient and the old pass
     is skipped;
  4. estimator: advantages from the rewards (advantages.py: the mode's estimator, a registry entry
     or a plugin; with use_kl_in_reward less the KL to the reference), per token with a turn_discount
     below 1 or with teachers (less distill_coef times each sampled token's reverse KL to them:
     on-policy distillation); then the row filters take rows out of the loss (rollout/shaping.py:
     DAPO's overlong filter; after the advantages, so cut rows still count in their group's baseline);
  5. learners: the extra learners' updates (PPO's critic), then the policy's: `num_iterations` passes
     over the rows in mini-batches, one optimizer update each, of the PPO or GSPO loss
     (`policy_loss`), with rollout_is weighted against the sampler's logprobs.

Row layout of the train batch, as the sampler lays out its own rows: `inputs` (and its positions
and segments) [rows, P + C] is the prompt left-padded to end at column P, then the completion
right-padded to C columns (P and C: the step's longest prompt and completion rounded up to a power
of two, C at most rollout_max_response_len). The completion-side arrays are [rows, C]: `targets`
are the completion tokens, predicted from columns P-1 .. P+C-2, and `loss_mask` is 1 for the
sampled ones (up to and including the stop token). Only those C columns go through the output
head: the prompt's logits are never computed. A group's n rows are consecutive and share their P
prompt columns, which the passes compute once per group where the model can (token_stats).
Every rollout is a workflow's trajectory (rollout/workflow.py): a row's completion is everything
after the prompt (C at most the workflow's max_tokens: a multi-turn episode's episode_max_tokens),
the environment's tokens targets with loss_mask 0.

With rl_packing the passes and the updates take each mini-batch's sequences (prompt + completion)
packed into rows instead (data/rl_packing.py: first-fit-decreasing, a segment each, every field
aligned with `inputs`, so P = 0 and C = the row's width); the host keeps the layout above, the
programs' outputs come back into it, and the losses take the per-sequence quantities per segment
(losses.Sequences). Packing puts a group's copies wherever they fit, so no row shares a prompt
with its neighbour: the shared-prompt pass is off (packing wins, logged), since the user asked to
stop paying for padding, which on long-tailed rounds outweighs the prompt's repeats.

With moe_routing_replay the colocated sampler records the experts every token ran in each MoE
layer (its prefill's for the prompt, its decode steps' for the completion), `routes` [rows, P + C,
L, k] lays them out like `inputs` (-1: the trainer routes that token itself: padding, and a
completion's last token, which no target reads), and the logprob pass and every update route by
them, so the old and the new policy take the sampler's experts. The old policy then always has a
pass of its own, which also measures `moe/replay_changed_fraction`: the share of replayed sampled
tokens whose experts the trainer's own router would have changed in some layer.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unitrain import advantages as advantages_lib
from unitrain import losses, rewards, sharding
from unitrain.config import check
from unitrain.data import format_choice
from unitrain.data.images import IMAGE_FIELDS
from unitrain.data.prompts import make_prompt_iterator
from unitrain.data.rl_packing import RolloutPacking, completion_rows, packed_rows_needed
from unitrain.engines.base import MeasuredSampler, SamplingParams, close, release
from unitrain.engines.buckets import batch_parallelism, bucket_packed_rows, bucket_prompt_length
from unitrain.engines.factory import make_sampler
from unitrain.evals import TaskEvaluator
from unitrain.models import moe, qwen2_5_vl
from unitrain.models.base import SharedPrefixModel
from unitrain.rollout.driver import Driver, make_workflow
from unitrain.rollout.executor import RolloutExecutor
from unitrain.rollout.groups import make_filter
from unitrain.rollout.shaping import reward_shapers, row_filters
from unitrain.tasks.base import RunContext, Task
from unitrain.tasks.reference import Reference
from unitrain.tasks.teacher import TeacherAccuracy, distill, load_teachers

log = logging.getLogger("unitrain")

ROW_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "loss_mask", "sampler_logprobs")
# The fields a step's passes and updates share: put on the devices once a step (StepRows).
FIXED_KEYS = ("inputs", "inputs_position", "inputs_segmentation", "targets", "routes", *IMAGE_FIELDS)


def token_stats(
    graphdef,
    temperature: float,
    chunk_size: int,
    params,
    batch,
    with_entropy: bool = False,
    group_rows: int = 1,
    replay: bool = True,
    frozen_tower: bool = False,
):
    """losses.TokenStats of the completion tokens at the sampling temperature, float32 [rows, C].
    group_rows > 1: the rows come in runs of that many copies of one prompt, whose prompt columns
    the model computes once per run (`hidden_states_shared_prefix`). Packed rows (P = 0): every column's.
    `replay`: route by the batch's recorded routes, if any (not a teacher: its experts are its own).
    Rows with images: see `image_inputs` (`frozen_tower`: no gradient through the tower)."""
    model = nnx.merge(graphdef, params)
    rows = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    C = batch["targets"].shape[1]
    P = rows[0].shape[1] - C
    # Routing replay: the recorded routes as a keyword, so that a model without experts never sees one.
    routes = {"routes": batch["routes"]} if replay and "routes" in batch else {}
    images = image_inputs(model, batch, P, group_rows, frozen_tower)
    if group_rows > 1:
        hidden = model.hidden_states_shared_prefix(*rows, P, group_rows, **routes, **images)
    else:
        hidden = model.hidden_states(*rows, **routes, **images)
    hidden = hidden[:, P - 1 : P - 1 + C] if P else hidden
    return losses.token_stats(model.logits, hidden, batch["targets"], chunk_size, temperature, with_entropy)


def image_inputs(model, batch, P: int, group_rows: int, frozen_tower: bool) -> dict:
    """A vision-language model's image arguments of rollout rows with images (`to_rows`' IMAGE_FIELDS;
    none: {}): the images of each run of `group_rows` copies of a prompt encoded once (its first
    row's), M-RoPE's positions, and the image pads of the P prompt columns alone (a pad the sampler
    drew is text, as it was to the sampler)."""
    if "pixels" not in batch:
        return {}
    fields = {k: batch[k] for k in ("pixels", "patch_positions", "patch_windows", "patch_images")}
    if group_rows > 1:
        fields = {k: v.reshape(-1, group_rows, *v.shape[1:])[:, 0] for k, v in fields.items()}
    features = model.encode_rows(fields)
    out = {"image_features": jax.lax.stop_gradient(features) if frozen_tower else features}
    out["rope_positions"] = batch["rope_positions"]
    if group_rows == 1:
        columns = jnp.arange(batch["inputs"].shape[1]) < P
        out["image_mask"] = (batch["inputs"] == model.cfg.image_token_id) & columns
    return out


def shared_prompt_rows(cfg, rows_per_update: int, model, devices: int) -> dict:
    """The runs of rows that share a prompt in the logprob pass and in an update's micro-batch (1:
    every row computes its own). A pass shares where its rows hold whole groups and every device
    its own whole groups: the logprob pass takes contiguous rows, and train_step's micro-batch j
    rows j, j+k, j+2k, ..., so a group's n rows come to it as a run of n/k."""
    n, k, rows = cfg.n_samples_per_prompt, cfg.gradient_accumulation_steps, rows_per_update
    if not isinstance(model, SharedPrefixModel):
        return {"logprobs": 1, "update": 1}
    fits = lambda count, run: count % (run * devices) == 0  # whole runs on every device
    return {"logprobs": n if fits(rows, n) else 1, "update": n // k if n % k == 0 and fits(rows // k, n // k) else 1}


def rollout_logprobs(stats, with_old: bool, scorers: tuple, params, frozen_params: tuple, batch) -> dict:
    """The logprobs the step takes of the rollout rows, in one program: the old policy's (`with_old`)
    and each frozen scorer's, the reference's (a KL term) and the teachers' (distillation):
    `scorers` (batch key, token_stats of its model, its parameters' shardings in device memory), one
    for each of `frozen_params`, which may be kept in host memory, so they are brought over here."""
    out = {}
    if with_old:
        with moe.collect_router_stats() as collected:
            out["old_logprobs"] = stats(params, batch).logprobs
        if "routes" in batch:
            out["replay_changed"] = replay_changed(collected[-1], batch["targets"].shape)
    for (key, frozen_stats, device), frozen in zip(scorers, frozen_params):
        out[key] = frozen_stats(jax.device_put(frozen, device), batch).logprobs
    return out


def replay_changed(completions: moe.RouterStats, shape: tuple[int, int]) -> jax.Array:
    """[rows, C] float32: 1 where a completion column's replayed token would have gone to other
    experts in some layer, from the RouterStats of the forward's part that ends with the C
    completion columns (the whole row, or the shared-prompt pass's completion part)."""
    changed = jnp.any(completions.changed, axis=0).reshape(shape[0], -1)
    return changed[:, -shape[1] :].astype(jnp.float32)


def trajectories(groups) -> list:
    """The groups' trajectories in row order."""
    return [t for g in groups for t in g.trajectories]


def replay_routes(groups, P: int, C: int) -> np.ndarray:
    """[rows, P + C, L, k] int32: each row's recorded routes laid out as `to_rows` lays out its
    tokens (the prompt left-padded to end at column P, the completion after it); -1 elsewhere."""
    rows = trajectories(groups)
    out = np.full((len(rows), P + C, *rows[0].routes.shape[1:]), -1, np.int32)
    for r, t in enumerate(rows):
        out[r, P - len(t.prompt_ids) : P] = t.prompt_routes
        out[r, P : P + len(t.ids)] = t.routes
    return out


def turn_discounts(groups, columns: int, discount: float) -> np.ndarray:
    """[rows, columns] float32: discount ** (turns after the token's own) on each trajectory's sampled
    tokens (0 elsewhere), so that with advantages [rows] the product credits later turns more."""
    rows = trajectories(groups)
    out = np.zeros((len(rows), columns), np.float32)
    for r, t in enumerate(rows):
        sampled = t.turn_index >= 0
        out[r, : len(t.ids)][sampled] = discount ** (t.turns - 1 - t.turn_index[sampled])
    return out


@dataclasses.dataclass
class Chunk:
    """An update-sized run of a step's rows: `rows` of the host batch, `plan` their packing (None:
    unpacked), `device` its FIXED_KEYS fields on the devices once a program has taken them."""

    rows: slice
    plan: RolloutPacking | None
    device: dict = dataclasses.field(default_factory=dict)

    @property
    def sequences(self) -> int:
        return self.rows.stop - self.rows.start


@dataclasses.dataclass
class StepRows:
    """A step's rows as its passes and updates take them, planned once (RLTask.step_rows): `batch`
    on the host in the module docstring's layout (the step adds the passes' outputs, the advantages
    and the row filters' masks to it; no row leaves it), cut into the same chunks for every program."""

    batch: dict
    chunks: list[Chunk]
    pad_id: int

    def host(self, chunk: Chunk, key: str) -> np.ndarray:
        """A field of the chunk's rows as the programs take it (packed with rl_packing)."""
        values = self.batch[key][chunk.rows]
        return values if chunk.plan is None else chunk.plan.pack(key, values, self.pad_id)

    def on_device(self, keys, shardings) -> list[dict]:
        """Each chunk's `keys` as global arrays (`shardings`: one, or one per key): the FIXED_KEYS
        put once a step, the others (the passes' outputs, the advantages, the masks) on every call."""
        shardings = shardings if isinstance(shardings, dict) else dict.fromkeys(keys, shardings)
        out = []
        for chunk in self.chunks:
            new = [k for k in keys if k not in chunk.device]
            put = sharding.full_rows_to_global({k: self.host(chunk, k) for k in new}, shardings) if new else {}
            chunk.device.update({k: v for k, v in put.items() if k in FIXED_KEYS})
            held = {**chunk.device, **put}
            out.append({k: held[k] for k in keys})
        return out

    def unpack(self, outs: list[dict]) -> dict:
        """The programs' [rows, C] outputs, one dict per chunk -> on the host in the batch's layout."""
        outs = jax.tree.map(sharding.to_host, outs)
        outs = [
            o if c.plan is None else {k: c.plan.unpack(v, c.sequences) for k, v in o.items()}
            for o, c in zip(outs, self.chunks)
        ]
        return {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}


class RLTask(Task):
    """The RL step of the module docstring. A mode picks its estimator (`estimator`, a registry name
    or plugin; None for a mode that trains on no advantages) and its extra learners (`learners`: objects with passes(state, rows) -> {key: [rows, C]}
    and update(state, rows) -> (state, metrics) over the step's StepRows (row_pass, updates),
    trained before the policy on the same rows)."""

    estimator: str | None

    def __init__(self, run: RunContext, *, prompts=None, sampling: SamplingParams | None = None):
        """`prompts`: the prompt stream (next() -> {"prompts", "num_dropped"}, get_state, set_state;
        None: the config's dataset); `sampling`: the rollouts' (None: the config's rollout_* keys,
        stopping at EOS). tools/bench.py gives both: random prompts, no stop token."""
        super().__init__(run)
        cfg, tokenizer = self.cfg, run.tokenizer
        self.reward_fn = rewards.make_reward_fn(cfg)
        self.keep = make_filter(cfg.dynamic_sampling_filter)
        self.sampler = make_sampler(run)
        self.measured = isinstance(self.sampler, MeasuredSampler)  # what the engine did, logged with each step
        self.workflow = make_workflow(run)
        self.max_completion = self.workflow.max_tokens
        self.shapers = reward_shapers(cfg, self.max_completion)
        self.row_filters = row_filters(cfg)
        self.estimate = advantages_lib.make_estimator(self.estimator) if self.estimator else None
        self.learners: list = []
        # Every process samples the same prompts with the same key (the sampler wants identical
        # inputs everywhere) and so computes the same batch; each then hands JAX only its own rows.
        self.sampling = sampling or SamplingParams.from_config(cfg, stop_token_ids=(tokenizer.eos_id,))
        self.replay = cfg.moe_routing_replay
        if self.replay:
            self.sampling = dataclasses.replace(self.sampling, record_routes=True)
        round_size = cfg.over_sampling_batch_size or cfg.rollout_batch_size
        if prompts is None:
            prompts = make_prompt_iterator(cfg, tokenizer, round_size)
        driver = Driver(
            self.sampler,
            self.workflow,
            cfg.n_samples_per_prompt,
            self.sampling,
            self.reward_fn,
            cfg.rollout_chunk_tokens,
            # A step's worth of groups raising in a row, none returned: the workflow, not its records.
            give_up_after=round_size * cfg.max_sampling_rounds,
        )
        self.rollouts = RolloutExecutor(cfg, prompts, driver, self.shape, self.keep)
        self.data_iterator = self.rollouts  # the checkpoint's prompt position: before the groups not yet consumed
        self.stats = functools.partial(token_stats, run.graphdef, cfg.rollout_temperature, cfg.logits_chunk_size)
        self.packing = cfg.rl_packing
        self.group_rows = shared_prompt_rows(
            cfg, run.layout.rows_per_update, run.model, batch_parallelism(run.mesh, run.rules)
        )
        split = run.mesh.shape["context"] > 1
        if (self.packing or split) and max(self.group_rows.values()) > 1:
            why = "packed rows hold no whole groups" if self.packing else "the sequence is split over the context axis"
            log.info("rl: %s, so each sequence computes its own prompt", why)
            self.group_rows = {"logprobs": 1, "update": 1}
        self.teachers = load_teachers(run)
        self.teacher_accuracy = TeacherAccuracy(run, self.teachers)
        # Replay measures the routes the trainer would change in the old policy's pass; distillation's
        # advantages take the old policy's logprobs.
        self.separate_old = (
            run.layout.updates_per_step > 1 or cfg.use_kl_in_reward or self.replay or bool(self.teachers)
        )
        log.info(
            "GRPO passes: old-policy logprobs %s; a group's prompt computed once per %d rows in the "
            "logprob pass and per %d in the update (1: each row its own)",
            "in a pass of their own" if self.separate_old else "from the update's forward",
            self.group_rows["logprobs"],
            self.group_rows["update"],
        )
        # The reference policy is the starting one, kept only when a KL term needs it.
        self.reference = Reference(run) if cfg.kl_coef > 0 else None
        self.logprob_fn = None
        if self.separate_old or self.reference is not None:
            stats = functools.partial(self.stats, group_rows=self.group_rows["logprobs"])
            scorers = [("ref_logprobs", stats, self.reference.device)] if self.reference is not None else []
            scorers += [(t.key, self.teacher_stats(t), t.device) for t in self.teachers]
            self.logprob_fn = jax.jit(functools.partial(rollout_logprobs, stats, self.separate_old, tuple(scorers)))
        self.policy_loss_config = losses.PolicyLossConfig.from_config(cfg)
        self.update_fn = run.make_update(self.loss, self.batch_shardings())
        self.evaluator = None
        if cfg.evaluates:  # the data format's own evaluation (a recommender's HR/NDCG) or the generation eval
            # of the configured workflow (ranked rollouts are evaluated by their greedy answer)
            self.evaluator = format_choice.data_format(cfg).evaluator(cfg, tokenizer, self.sampler) or TaskEvaluator(
                cfg, tokenizer, self.sampler, self.reward_fn, make_workflow(run, cfg.workflow)
            )
        self.text, self.eval_text = "", ""  # the latest rollouts' and evaluation's, as markdown

    # -- what the loop and the step see
    def loss(self, params, batch):
        """The clipped policy loss of one micro-batch, in train_step's loss_fn form."""
        cfg = self.cfg
        stats = self.stats(
            params, batch, with_entropy=True, group_rows=self.group_rows["update"], frozen_tower=cfg.freeze_vision_tower
        )
        sequences = losses.packed_sequences(batch["inputs_segmentation"]) if self.packing else losses.ROWS
        old = batch["old_logprobs"] if self.separate_old else jax.lax.stop_gradient(stats.logprobs)
        mask, weights, is_metrics = batch["loss_mask"], None, {}
        if cfg.rollout_is:  # against the old policy, whichever pass it came from
            weights, mask, is_metrics = losses.rollout_correction(
                old,
                batch["sampler_logprobs"],
                mask,
                level=cfg.rollout_is_level,
                mode=cfg.rollout_is_mode,
                threshold=cfg.rollout_is_threshold,
                threshold_lower=cfg.rollout_is_threshold_lower,
                sequences=sequences,
            )
        loss_sum, denom, metrics = losses.policy_loss(
            stats.logprobs,
            old,
            batch["advantages"],
            mask,
            self.policy_loss_config,
            ref_logprobs=batch["ref_logprobs"] if self.policy_loss_config.kl_coef > 0 else None,
            entropy=stats.entropy,
            pg_weights=weights,
            sequences=sequences,
        )
        metrics.update(is_metrics)
        sampled = batch["loss_mask"].astype(jnp.float32)
        gap = jnp.abs(batch["sampler_logprobs"] - jax.lax.stop_gradient(old)) * sampled
        metrics["sampler_trainer_logprob_gap"] = (gap.sum(), sampled.sum())
        return loss_sum, (denom, metrics)

    def batch_shardings(self) -> dict:
        rows2d = sharding.batch_sharding(self.run.mesh, self.run.rules)
        keys = [*ROW_KEYS] + ["old_logprobs"] * self.separate_old + ["ref_logprobs"] * (self.reference is not None)
        keys += ["routes"] * self.replay  # [rows, P + C, L, k]: split by rows as the rest
        keys += [*IMAGE_FIELDS] * bool(self.cfg.max_image_patches)
        return {
            **{k: rows2d for k in keys},
            "advantages": rows2d
            if self.per_token_advantages() or self.packing
            else sharding.batch_sharding(self.run.mesh, self.run.rules, ("batch",)),
        }

    def per_token_advantages(self) -> bool:
        """Whether the advantages are [rows, C] (else [rows], one per completion)."""
        return self.cfg.turn_discount < 1 or bool(self.teachers)

    def teacher_stats(self, teacher):
        """token_stats of the teacher's model, at the student's temperature, routed by its own experts."""
        group_rows = self.group_rows["logprobs"] if teacher.shares_prefix else 1
        return functools.partial(
            token_stats,
            teacher.graphdef,
            self.cfg.rollout_temperature,
            self.cfg.logits_chunk_size,
            group_rows=group_rows,
            replay=False,
        )

    def evaluate(self, params, step):
        if not self.evaluator:
            return {}
        results = self.teacher_accuracy(self.evaluator, params, step)
        self.eval_text = self.evaluator.samples
        return results

    def close(self) -> None:
        close(self.sampler)

    def samples_text(self, step):
        """The step's rollouts every sample_log_period steps, and each evaluation's greedy answers once."""
        parts = [self.text if step % self.cfg.sample_log_period == 0 else "", self.eval_text]
        self.eval_text = ""
        return "\n\n".join(part for part in parts if part)

    def step(self, state, step: int):
        t0 = time.perf_counter()
        groups, stats = self.take_rollouts(state, step)
        t1 = time.perf_counter()
        batch = self.to_rows(groups)
        rows = self.step_rows(batch)  # the passes and the updates take the same chunks
        batch.update(self.rollout_passes(state, rows))
        if self.replay:
            stats["moe/replay_changed_fraction"] = self.replay_changed_fraction(batch)
        mask = batch["loss_mask"].astype(bool)
        advantages, advantage_metrics = self.advantages(batch, groups)
        batch.update(advantages)
        stats.update(advantage_metrics)
        for row_filter in self.row_filters:
            keep, filter_metrics = row_filter(groups)  # rows out of the loss, not of the chunks
            batch["loss_mask"] = batch["loss_mask"] * keep[:, None]
            stats.update(filter_metrics)
        t2 = time.perf_counter()
        state, update_metrics = self.update(state, rows, step)
        t3 = time.perf_counter()
        # time_rollout is the time the step waited for its rollouts; only on-policy is that their sampling time.
        metrics = {
            **update_metrics,
            **stats,
            **self.rollout_metrics(groups),
            "time_rollout": t1 - t0,
            "time_logprob": t2 - t1,
            "time_update": t3 - t2,
        }
        if not self.cfg.max_staleness:
            metrics["rollout_tokens_per_sec"] = float(mask.sum()) / max(t1 - t0, 1e-9)
            metrics["episodes_per_sec"] = len(mask) / max(t1 - t0, 1e-9)
        if step % self.cfg.sample_log_period == 0:
            self.text = self.workflow.markdown(groups)
        return state, metrics

    # -- the stages of a step
    def take_rollouts(self, state, step: int) -> tuple[list, dict]:
        """The step's groups from the executor, the step's weights pushed to the sampler before it samples."""
        pushed = {}

        def push(version):
            if version in pushed:
                return
            start = time.perf_counter()
            self.sampler.update_weights(state["params"], version)
            pushed[version] = time.perf_counter() - start

        if self.cfg.max_staleness:
            # The groups in flight go on with this step's weights (the colocated sampler's earlier ones
            # were donated).
            push(step)
        self.reward_fn.metrics()  # drop what an evaluation's scoring measured: the rm/* metrics are the step's rollouts'
        groups, stats = self.rollouts.prepare_batch(step, push)
        stats.update(self.reward_fn.metrics())
        release(self.sampler)  # no sampling before the next push: what it kept goes before the update
        stats.update(self.sampler.metrics() if self.measured else {}, time_weight_push=sum(pushed.values()))
        return groups, stats

    def shape(self, group):
        """A finished group through the reward shapers (before a dynamic-sampling filter sees it)."""
        for shaper in self.shapers:
            group = shaper(group)
        return group

    def to_rows(self, groups) -> dict:
        """The rows of the module docstring's layout, from the groups' prompts and completions."""
        # As long as this step needs, rounded up to a power of two: bounded recompilation.
        P = bucket_prompt_length(max(len(g.prompt.ids) for g in groups))
        C = min(bucket_prompt_length(max(len(t.ids) for t in trajectories(groups))), self.max_completion)
        rows, pad = len(groups) * self.cfg.n_samples_per_prompt, self.run.tokenizer.pad_id
        arrays = {k: np.zeros((rows, P + C), np.int32) for k in ("inputs", "inputs_position", "inputs_segmentation")}
        arrays.update(
            targets=np.full((rows, C), pad, np.int32),
            loss_mask=np.zeros((rows, C), np.int32),
            sampler_logprobs=np.zeros((rows, C), np.float32),
        )
        arrays["inputs"][:] = pad
        if self.replay:
            arrays["routes"] = replay_routes(groups, P, C)
        for r, t in enumerate(trajectories(groups)):
            length = len(t.ids)
            start, end = P - len(t.prompt_ids), P + length
            arrays["inputs"][r, start:end] = [*t.prompt_ids, *t.ids]
            arrays["inputs_position"][r, start:end] = np.arange(end - start)
            arrays["inputs_segmentation"][r, start:end] = 1
            arrays["targets"][r, :length] = t.ids
            arrays["loss_mask"][r, :length] = t.loss_mask  # episodes: not the environment's tokens
            arrays["sampler_logprobs"][r, :length] = t.logprobs
        if self.cfg.max_image_patches:
            arrays.update(self.image_rows(groups, arrays, P))
        return arrays

    def image_rows(self, groups, rows: dict, P: int) -> dict:
        """IMAGE_FIELDS of the rows: each row's prompt's images laid out for the tower (qwen2_5_vl.
        image_rows), M-RoPE's positions of its prompt and, after it, each position shifted by the
        row's rope delta, as the sampler decoded them."""
        vision, pad = self.run.model.vision.cfg, self.run.model.cfg.image_token_id
        images = [g.prompt.images for g in groups for _ in g.trajectories]
        prompt, deltas = qwen2_5_vl.prompt_rope(
            rows["inputs"][:, :P], rows["inputs_segmentation"][:, :P], images, pad, vision
        )
        after = rows["inputs_position"][:, P:] + deltas[:, None]
        rope = np.concatenate([prompt, np.repeat(after[..., None], 3, axis=-1)], axis=1)
        return {**qwen2_5_vl.image_rows(images, vision, self.cfg.max_image_patches), "rope_positions": rope}

    def rollout_passes(self, state, rows: StepRows | dict) -> dict:
        """What the updates read of the models before they change them, [rows, C] each: the old and
        the reference logprobs (rollout_logprobs), where the config needs them, and each learner's."""
        rows = self.step_rows(rows)
        out = self.logprobs(state["params"], rows) if self.logprob_fn is not None else {}
        for learner in self.learners:
            out.update(learner.passes(state, rows))
        return out

    def replay_changed_fraction(self, batch) -> float:
        """The share of the replayed sampled tokens whose experts the old policy's router would have
        changed (the logprob pass's `replay_changed`, taken out of the batch)."""
        C = batch["targets"].shape[1]
        replayed = batch["loss_mask"].astype(bool) & (batch["routes"][:, -C:, 0, 0] >= 0)
        changed = batch.pop("replay_changed").astype(bool) & replayed
        return float(changed.sum() / max(replayed.sum(), 1))

    def advantages(self, batch, groups) -> tuple[dict, dict]:
        """({"advantages", ...}, metrics) of the mode's estimator (advantages.py); with a
        turn_discount below 1, per-row advantages become per token."""
        cfg = self.cfg
        kl = None
        if cfg.use_kl_in_reward and self.reference is not None:
            kl = np.asarray(losses.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], cfg.kl_type))
        arrays, metrics = self.estimate(
            advantages_lib.Rollout(
                rewards=np.concatenate([g.rewards for g in groups]).astype(np.float32),
                group_ids=np.repeat(np.arange(len(groups)), cfg.n_samples_per_prompt),
                num_groups=len(groups),
                loss_mask=batch["loss_mask"],
                kl=kl,
                values=batch.get("values"),
                cfg=cfg,
            )
        )
        if arrays["advantages"].ndim == 1 and cfg.turn_discount < 1:
            columns = batch["targets"].shape[1]
            arrays["advantages"] = arrays["advantages"][:, None] * turn_discounts(groups, columns, cfg.turn_discount)
        if self.teachers:
            arrays["advantages"], distill_metrics = distill(self.teachers, cfg, arrays["advantages"], batch)
            metrics = {**metrics, **distill_metrics}
        return arrays, metrics

    def logprobs(self, params, rows: StepRows | dict) -> dict:
        """rollout_logprobs over the rollout rows, in update-sized chunks (one compiled shape)."""
        frozen = [self.reference.of(params)] if self.reference is not None else []
        frozen += [t.params for t in self.teachers]
        return self.row_pass("logprobs", self.logprob_fn, params, tuple(frozen), self.step_rows(rows))

    def row_pass(self, name: str, fn, *args_and_rows) -> dict:
        """fn(*args, chunk) -> {name: [rows, C]} over the step's chunks, gathered on the host in the
        batch's layout; `args_and_rows` ends with the StepRows."""
        *args, rows = args_and_rows
        keys = ("inputs", "inputs_position", "inputs_segmentation", "targets", *["routes"] * self.replay)
        keys += IMAGE_FIELDS * bool(self.cfg.max_image_patches)
        chunks = rows.on_device(keys, sharding.batch_sharding(self.run.mesh, self.run.rules))
        return rows.unpack([self.run.programs(self.program_name(name, c), fn, *args, c) for c in chunks])

    def step_rows(self, batch: dict | StepRows) -> StepRows:
        """The batch's update-sized chunks, planned once for the step's passes and updates (a
        StepRows is already planned). With rl_packing every chunk of a step has the same packed rows
        (the most any needs, bucketed to whole micro-batches on every device): one compiled shape."""
        if isinstance(batch, StepRows):
            return batch
        size, count = self.run.layout.rows_per_update, len(batch["inputs"])
        spans = [slice(s, min(s + size, count)) for s in range(0, count, size)]
        plans = self.packing_plans(batch, spans) if self.packing else [None] * len(spans)
        return StepRows(batch, [Chunk(s, plan) for s, plan in zip(spans, plans)], self.run.tokenizer.pad_id)

    def packing_plans(self, batch: dict, spans: list[slice]) -> list[RolloutPacking]:
        """The packing of each span of rows into the same number of packed rows."""
        parts = [{k: batch[k][s] for k in ("inputs", "inputs_segmentation", "targets")} for s in spans]
        width = self.cfg.rl_packing_row_tokens or batch["inputs"].shape[1]
        need = max(packed_rows_needed(sum(completion_rows(p)), width) for p in parts)
        multiple = self.cfg.gradient_accumulation_steps * batch_parallelism(self.run.mesh, self.run.rules)
        rows = bucket_packed_rows(need, multiple)
        return [RolloutPacking.plan(p, width, rows) for p in parts]

    def program_name(self, name: str, rows: dict) -> str:
        count, width = rows["inputs"].shape
        return f"{name} ({count} packed rows of {width})" if self.packing else f"{name} (rows of {width})"

    def update(self, state, rows: StepRows | dict, step: int):
        """The learners' updates, then (unless trains_policy says not yet) the policy's: num_iterations
        passes over the rows in mini-batches; metrics are averaged over updates."""
        rows, metrics = self.step_rows(rows), {}
        for learner in self.learners:
            state, learner_metrics = learner.update(state, rows)
            metrics.update(learner_metrics)
        if self.trains_policy(step):
            policy = {k: state[k] for k in ("params", "opt_state", "step")}
            policy, policy_metrics = self.updates("grpo_update", self.update_fn, policy, rows, self.batch_shardings())
            state = {**state, **policy}
            metrics.update(policy_metrics)
        return state, metrics

    def trains_policy(self, step: int) -> bool:
        return True

    def updates(self, name: str, update_fn, state, rows: StepRows, shardings):
        """num_iterations passes of update_fn over the step's chunks, in mini-batches of the keys of
        `shardings`, one optimizer update each: (state, metrics averaged over the updates)."""
        chunks = rows.on_device(tuple(shardings), shardings)
        collected = []
        for _ in range(self.cfg.num_iterations):
            for mb in chunks:
                state, m = self.run.programs(self.program_name(name, mb), update_fn, state, mb)
                collected.append(m)
        # One device->host copy for all updates of the step.
        stacked = jax.device_get(collected)
        return state, {k: float(np.mean([m[k] for m in stacked])) for k in stacked[0]}

    def rollout_metrics(self, groups) -> dict:
        rewards_ = np.concatenate([g.rewards for g in groups])
        lengths = np.asarray([len(t.ids) for t in trajectories(groups)], np.int32)
        metrics = {
            "reward_mean": rewards_.mean(),
            "reward_std": rewards_.std(),
            "reward_min": rewards_.min(),
            "reward_max": rewards_.max(),
            "response_length_mean": lengths.mean(),
            "response_length_max": lengths.max(),
            "response_clip_ratio": float(np.mean(lengths >= self.max_completion)),
            "zero_std_group_fraction": float(np.mean([np.std(g.rewards) == 0 for g in groups])),
            **self.workflow.metrics(trajectories(groups)),
        }
        for name in groups[0].per_reward:
            values = np.concatenate([g.per_reward[name] for g in groups])
            metrics.update({f"reward_{name}_{stat}": getattr(values, stat)() for stat in ("mean", "std", "min", "max")})
        if self.cfg.max_staleness:  # a trajectory sampled across weight updates: its versions' spread
            spread = np.asarray([version_spread(t) for t in trajectories(groups)])
            metrics.update(rollout_version_spread_mean=spread.mean(), rollout_version_spread_max=spread.max())
        return {k: float(v) for k, v in metrics.items()}


def version_spread(trajectory) -> int:
    """Newest minus oldest weights version of a trajectory's sampled tokens (0: one version)."""
    versions = trajectory.versions[trajectory.loss_mask == 1]
    return int(versions.max() - versions.min()) if len(versions) else 0


@check("over_sampling_batch_size", "rollout_batch_size")
def _over_sampling(c) -> str | None:
    if c["over_sampling_batch_size"] == 0 or c["over_sampling_batch_size"] >= c["rollout_batch_size"]:
        return None
    return f"over_sampling_batch_size ({c['over_sampling_batch_size']}) must be 0 or at least rollout_batch_size ({c['rollout_batch_size']})"


CONFIG_CHECKS = (_over_sampling,)
