"""mode=online_dpo: online DPO as TRL's OnlineDPOTrainer runs it (Guo et al. 2024, "Direct Language
Model Alignment from Online AI Feedback"): each step the policy samples n_samples_per_prompt (two or
more) answers to each of rollout_batch_size prompts with the run's sampler and workflow
(tasks/rl.py's rollouts: the executor, the reward, max_staleness), the reward (a rule, e.g. the
built-in task's, or `reward: rm`) picks each prompt's chosen answer (the best; the first of equals,
as TRL's `>=`) and rejected one (the worst), and one update of mode=dpo's loss (PairLearner:
dpo_loss_type and its keys, the reference the start model) trains on those pairs.

A pair row is DPO's unpacked layout (data/preference.py) of max_prompt_length + the workflow's
completion bound columns: the prompt, then the sampled answer, whose sampled tokens alone carry the
loss (an episode's environment tokens are context). per_device_batch_size counts pairs, and one
update takes the step's rollout_batch_size pairs. Metrics: DPO's, and the rollouts' (reward_mean ...:
the reward it is judged by; tied_pair_fraction, the pairs whose answers the reward could not tell
apart); eval, the generation eval of mode=grpo.
"""

from __future__ import annotations

import time

import numpy as np

from unitrain import sharding
from unitrain.config import check
from unitrain.data.preference import SIDES
from unitrain.errors import ConfigError
from unitrain.tasks.dpo import PairLearner
from unitrain.tasks.rl import RLTask


def pair_rows(groups, width: int, pad_id: int) -> dict:
    """Each group's best and worst trajectory by reward (a stable sort: of equals, the first is
    chosen) as one preference pair row: {chosen_*, rejected_*} int32 [groups, width]."""
    fields = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_segmentation")
    rows = {
        f"{side}_{k}": np.full((len(groups), width), pad_id if k in ("inputs", "targets") else 0, np.int32)
        for side in SIDES
        for k in fields
    }
    for g, group in enumerate(groups):
        order = np.argsort(-np.asarray(group.rewards), kind="stable")
        for side, t in zip(SIDES, (group.trajectories[order[0]], group.trajectories[order[-1]])):
            sequence, start = [*t.prompt_ids, *t.ids], len(t.prompt_ids)
            n = len(sequence)
            rows[f"{side}_inputs"][g, :n] = sequence
            rows[f"{side}_inputs_position"][g, :n] = np.arange(n)
            rows[f"{side}_inputs_segmentation"][g, :n] = 1
            rows[f"{side}_targets"][g, : n - 1] = sequence[1:]
            rows[f"{side}_targets_segmentation"][g, start - 1 : n - 1] = t.loss_mask  # the sampled tokens
    return rows


class OnlineDPOTask(PairLearner, RLTask):
    estimator = None  # its pairs need no advantages

    def __init__(self, run, **kwargs):
        if run.cfg.rollout_batch_size != run.layout.rows_per_update:
            raise ConfigError(
                f"mode=online_dpo makes one update a step of its rollout_batch_size ({run.cfg.rollout_batch_size})"
                f" pairs: it must equal per_device_batch_size * devices * gradient_accumulation_steps"
                f" ({run.layout.rows_per_update})"
            )
        self.init_pairs(run)  # before RLTask builds the update over this loss and its shardings
        super().__init__(run, **kwargs)
        self.width = self.cfg.max_prompt_length + self.max_completion
        self.tokens_per_step = 2 * self.cfg.rollout_batch_size * self.width

    def step(self, state, step: int):
        t0 = time.perf_counter()
        groups, stats = self.take_rollouts(state, step)
        t1 = time.perf_counter()
        # every process sampled the same groups, so each holds the whole batch
        batch = sharding.full_rows_to_global(
            pair_rows(groups, self.width, self.run.tokenizer.pad_id), self.batch_shardings()
        )
        batch = self.scored("pair_logps", state["params"], batch)
        state, metrics = self.run.programs("train_step", self.update_fn, state, batch)
        if step % self.cfg.sample_log_period == 0:
            self.text = self.workflow.markdown(groups)
        timing = {"time_rollout": t1 - t0, "time_update": time.perf_counter() - t1}
        rollout = self.rollout_metrics(groups)
        # a tie still trains (its first answer chosen), unlike GRPO's zero-spread group, which trains on nothing
        rollout["tied_pair_fraction"] = rollout.pop("zero_std_group_fraction")
        return state, {**metrics, **stats, **rollout, **timing}


@check("mode", "n_samples_per_prompt", "dpo_loss_type", "rl_packing", "num_iterations")
def _online_dpo(c) -> str | None:
    """Online DPO: a pair of answers a prompt, one update a step, of pairs."""
    if c["mode"] != "online_dpo":
        return None
    if c["n_samples_per_prompt"] < 2:
        return f"mode=online_dpo picks a chosen and a rejected answer among n_samples_per_prompt ({c['n_samples_per_prompt']}); it needs 2 or more"
    if c["dpo_loss_type"] == "kto":
        return "mode=online_dpo trains on pairs; dpo_loss_type=kto reads unpaired records (mode=dpo)"
    if c["rl_packing"]:
        return "mode=online_dpo takes its pairs unpacked; set rl_packing=false"
    if c["num_iterations"] != 1:
        return "mode=online_dpo makes one update a step; set num_iterations=1"
    return None


CONFIG_CHECKS = (_online_dpo,)
