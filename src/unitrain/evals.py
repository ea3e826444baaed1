"""Task evaluation by generation: greedy pass@1 (logged as eval_accuracy) and sampled pass@k on the
eval prompts, scored by the run's reward. A sample is correct when the first reward named in
`reward` (the task reward) gives it 1. SFT uses it for the built-in task, GRPO always.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from unitrain import data
from unitrain.rollout.base import SamplingParams
from unitrain.rollout.groups import collect_groups


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class TaskEvaluator:
    def __init__(self, cfg, tokenizer, sampler, reward_fn):
        self.cfg, self.tokenizer, self.sampler, self.reward_fn = cfg, tokenizer, sampler, reward_fn
        self.prompts = data.eval_prompts(cfg, tokenizer, cfg.eval_num_samples)

    def correct(self, n: int, sampling: SamplingParams, key) -> np.ndarray:
        """[prompts, n] bool: which samples the task reward scores 1."""
        groups = collect_groups(self.sampler, self.prompts, n, sampling, key, self.tokenizer, self.reward_fn)
        return np.stack([g.per_reward[self.reward_fn.names[0]] >= 1.0 for g in groups])

    def __call__(self, params, step: int) -> dict:
        cfg, stop = self.cfg, (self.tokenizer.eos_id,)
        self.sampler.update_weights(params, step)
        greedy = SamplingParams(cfg.rollout_max_response_len, temperature=0.0, stop_token_ids=stop)
        result = {"eval_accuracy": float(self.correct(1, greedy, jax.random.key(0)).mean())}
        if cfg.eval_n_samples:
            sampled = SamplingParams(cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
                                     top_k=cfg.rollout_top_k, top_p=cfg.rollout_top_p, stop_token_ids=stop)
            counts = self.correct(cfg.eval_n_samples, sampled, jax.random.key(1)).sum(axis=1)
            result[f"eval_pass@{cfg.eval_pass_k}"] = float(np.mean(
                [pass_at_k(cfg.eval_n_samples, c, cfg.eval_pass_k) for c in counts]))
        return result
