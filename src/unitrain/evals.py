"""Task evaluation by generation: the workflow run greedily (eval_accuracy: pass@1) and with k samples
(eval_pass_at_k) on the eval prompts, then scored. A sample is correct when its group's first reward
(the task reward, the first named in `reward`; an environment's) gives it 1. GRPO evaluates its
prompt files; SFT its eval files, the label being label_key's field or else the completion
(data.sft.eval_prompt_records). The greedy samples' workflow metrics are logged too (a multi-turn
workflow's eval_episode_*). A prompt whose workflow raised is left out of the scores and counted
(eval_workflow_errors, when any did); every prompt's raising is one line.
SFT scores what the data's answer is: labels that end in a '#### <answer>' line (GSM8K's worked
solutions) are checked by the math reward on that answer unless `reward` is set (sft_reward_fn),
and answers longer than rollout_max_response_len are said to be cut (warn_if_answers_cut).
"""

from __future__ import annotations

import logging
import math
import re

import jax
import numpy as np

from unitrain import rewards
from unitrain.config import check
from unitrain.data.prompts import eval_prompts
from unitrain.engines.base import SamplingParams, release
from unitrain.errors import DataError
from unitrain.rollout.driver import Driver

log = logging.getLogger("unitrain")

_ANSWER_LINE = re.compile(r"####[ \t]*\S")  # a GSM8K label's final answer line: "#### 72"


def sft_reward_fn(cfg, records: list[dict] | None) -> rewards.RewardFn:
    """What an SFT eval scores its answers by: `reward`'s; but with `reward` left at base.yml's
    exact_match and eval labels that all end in a '#### <answer>' line, the math reward, which
    compares the answer a completion states with that line's: a right answer worded another way
    than the reference solution is right."""
    labels = [str(r["label"]) for r in (records or [])[: cfg.eval_num_samples]]
    if labels and cfg.is_default("reward") and all(_ANSWER_LINE.search(label) for label in labels):
        log.info(
            "eval: the eval labels end in '#### <answer>': answers are scored by the math reward on that "
            "answer (set reward= to choose another)"
        )
        cfg = cfg.replace(reward="math", reward_weights=None)
    return rewards.make_reward_fn(cfg)


def warn_if_answers_cut(cfg, tokenizer, records: list[dict] | None) -> None:
    """One line when eval answers as long as the data's completions cannot fit in
    rollout_max_response_len tokens: they are cut before their final answer and score 0."""
    completions = [r["completion"] for r in (records or [])[: cfg.eval_num_samples] if "completion" in r]
    lengths = [len(tokenizer.encode(text)) + 1 for text in completions]  # + the end-of-sequence token
    if cut := sum(n > cfg.rollout_max_response_len for n in lengths):
        log.warning(
            "eval: %d of %d eval completions are longer than rollout_max_response_len=%d tokens (the longest %d): "
            "answers like them are cut before they end and score 0; raise rollout_max_response_len",
            cut,
            len(lengths),
            cfg.rollout_max_response_len,
            max(lengths),
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class TaskEvaluator:
    """`evaluator(params, step) -> metrics`; `samples` is then the workflow's markdown of the greedy
    answers for TensorBoard. `records` replace the eval split's prompt records (see
    data.prompts.eval_prompts)."""

    def __init__(self, cfg, tokenizer, sampler, reward_fn, workflow, records: list[dict] | None = None):
        self.cfg, self.tokenizer, self.sampler, self.reward_fn = cfg, tokenizer, sampler, reward_fn
        self.workflow = workflow
        self.prompts = eval_prompts(cfg, tokenizer, cfg.eval_num_samples, records)
        self.samples = ""

    def correct(self, n: int, sampling: SamplingParams, key, sampler=None) -> tuple[np.ndarray, list, int]:
        """([groups, n] bool: which samples are correct, the groups, how many prompts' workflow
        raised: their groups are left out, as rejected ones are), sampled by `sampler` (None: the evaluator's)."""
        driver = Driver(
            sampler or self.sampler, self.workflow, n, sampling, self.reward_fn, give_up_after=len(self.prompts)
        )
        driver.start(self.prompts, key)
        driver.dispatch()
        groups = driver.groups()
        if not groups:  # nothing to score: an accuracy over no answers would be made up
            raise DataError(
                f"the evaluation has no answer to score: workflow {driver.name} left out all "
                f"{len(self.prompts)} eval prompts (an episode whose first prompt is longer than "
                "max_prompt_length is left out; check the eval records, max_prompt_length and the environment)"
            )
        return np.stack([g.correct for g in groups]), groups, driver.errors

    def __call__(self, params, step: int, sampler=None) -> dict:
        """The metrics of the model of `params` sampled by `sampler` (None: the evaluator's, the
        student's; a teacher's own, tasks/teacher.py TeacherAccuracy)."""
        cfg, stop, sampler = self.cfg, (self.tokenizer.eos_id,), sampler or self.sampler
        sampler.update_weights(params, step)
        greedy = SamplingParams(cfg.rollout_max_response_len, temperature=0.0, stop_token_ids=stop)
        correct, answers, errors = self.correct(1, greedy, jax.random.key(0), sampler)
        result = {"eval_accuracy": float(correct.mean())}
        result.update(self.workflow.metrics([t for g in answers for t in g.trajectories], prefix="eval_"))
        self.samples = self.workflow.markdown(answers)
        if cfg.eval_n_samples:
            sampled = SamplingParams.from_config(cfg, stop_token_ids=stop)
            sampled_correct, _, sampled_errors = self.correct(cfg.eval_n_samples, sampled, jax.random.key(1), sampler)
            result[f"eval_pass_at_{cfg.eval_pass_k}"] = float(
                np.mean([pass_at_k(cfg.eval_n_samples, c, cfg.eval_pass_k) for c in sampled_correct.sum(axis=1)])
            )
            errors += sampled_errors
        if errors:  # shown on the eval's line only when a workflow raised
            result["eval_workflow_errors"] = float(errors)
        release(sampler)
        return result


@check("eval_n_samples", "eval_pass_k")
def _pass_k(c) -> str | None:
    if c["eval_n_samples"] == 0 or c["eval_pass_k"] <= c["eval_n_samples"]:
        return None
    return f"eval_pass_k ({c['eval_pass_k']}) cannot exceed eval_n_samples ({c['eval_n_samples']})"


CONFIG_CHECKS = (_pass_k,)
