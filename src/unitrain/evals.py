"""Task evaluation by generation: greedy pass@1 (logged as eval_accuracy) and sampled pass@k (eval_pass_at_k)
on the eval prompts, scored by the run's reward. A sample is correct when the first reward named in
`reward` (the task reward) gives it 1. GRPO evaluates its prompt files; SFT its eval files, the
label being label_key's field or else the completion (data.sft.eval_prompt_records).
With a multi-turn workflow (rollout/episodes.py) a sample is an episode, correct when it succeeds
(its reward reaches 1), and the greedy episodes' statistics are logged too (eval_episode_*).
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
from unitrain.data.prompts import eval_prompts
from unitrain.rollout.base import SamplingParams, release
from unitrain.rollout.episodes import episode_metrics, episodes_markdown, start_episode_groups
from unitrain.rollout.groups import collect_groups, samples_markdown

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
    """`evaluator(params, step) -> metrics`; `samples` is then the markdown of the first greedy
    answers (prompt, completion, label, reward) for TensorBoard. `records` replace the eval split's
    prompt records (see data.prompts.eval_prompts); `workflow` (rollout/episodes.py; None: single
    turn) makes the samples episodes."""

    def __init__(self, cfg, tokenizer, sampler, reward_fn, records: list[dict] | None = None, workflow=None):
        self.cfg, self.tokenizer, self.sampler, self.reward_fn = cfg, tokenizer, sampler, reward_fn
        self.workflow = workflow
        self.prompts = eval_prompts(cfg, tokenizer, cfg.eval_num_samples, records)
        self.samples = ""

    def groups(self, n: int, sampling: SamplingParams, key) -> list:
        if self.workflow is not None:
            args = (self.sampler, self.workflow, self.prompts, n, sampling, key, self.tokenizer)
            return start_episode_groups(*args)()
        return collect_groups(self.sampler, self.prompts, n, sampling, key, self.tokenizer, self.reward_fn)

    def correct(self, groups: list) -> np.ndarray:
        """[prompts, n] bool: which samples the task reward scores 1 (episodes: which succeed)."""
        name = "env" if self.workflow is not None else self.reward_fn.names[0]
        return np.stack([g.per_reward[name] >= 1.0 for g in groups])

    def __call__(self, params, step: int) -> dict:
        cfg, stop = self.cfg, (self.tokenizer.eos_id,)
        self.sampler.update_weights(params, step)
        greedy = SamplingParams(cfg.rollout_max_response_len, temperature=0.0, stop_token_ids=stop)
        answers = self.groups(1, greedy, jax.random.key(0))
        result = {"eval_accuracy": float(self.correct(answers).mean())}
        if self.workflow is not None:
            greedy_episodes = [t for g in answers for t in g.episodes]
            self.samples = episodes_markdown(greedy_episodes)
            result.update(episode_metrics(greedy_episodes, prefix="eval_"))
        else:
            self.samples = samples_markdown(answers)
        if cfg.eval_n_samples:
            sampled = SamplingParams.from_config(cfg, stop_token_ids=stop)
            counts = self.correct(self.groups(cfg.eval_n_samples, sampled, jax.random.key(1))).sum(axis=1)
            result[f"eval_pass_at_{cfg.eval_pass_k}"] = float(
                np.mean([pass_at_k(cfg.eval_n_samples, c, cfg.eval_pass_k) for c in counts])
            )
        release(self.sampler)
        return result
