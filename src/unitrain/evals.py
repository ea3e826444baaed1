"""Task evaluation by generation: greedy pass@1 (logged as eval_accuracy) and sampled pass@k on the
eval prompts, scored by the run's reward. A sample is correct when the first reward named in
`reward` (the task reward) gives it 1. SFT uses it for the built-in task, GRPO always.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from unitrain import data, rollout


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class TaskEvaluator:
    def __init__(self, cfg, tokenizer, graphdef, mesh, rules, reward_fn):
        self.cfg, self.tokenizer, self.graphdef, self.mesh, self.rules = cfg, tokenizer, graphdef, mesh, rules
        self.reward_fn = reward_fn
        self.prompts = data.eval_prompts(cfg, tokenizer, cfg.eval_num_samples)

    def correct(self, model, prompts, sampling, key) -> np.ndarray:
        out = rollout.generate(model, [list(p.ids) for p in prompts], sampling, key, pad_id=self.tokenizer.pad_id,
                               mesh=self.mesh, rules=self.rules)
        texts = [self.tokenizer.decode(t[:l]) for t, l in zip(out["tokens"], out["lengths"])]
        _, per_reward = self.reward_fn([p.text for p in prompts], texts, [p.label for p in prompts])
        return per_reward[self.reward_fn.names[0]] >= 1.0

    def __call__(self, params) -> dict:
        cfg, model = self.cfg, nnx.merge(self.graphdef, params)
        stop = (self.tokenizer.eos_id,)
        greedy = rollout.SamplingParams(cfg.rollout_max_response_len, temperature=0.0, stop_token_ids=stop)
        result = {"eval_accuracy": float(self.correct(model, self.prompts, greedy, jax.random.key(0)).mean())}
        if cfg.eval_n_samples:
            n = cfg.eval_n_samples
            sampled = rollout.SamplingParams(cfg.rollout_max_response_len, temperature=cfg.rollout_temperature,
                                             top_k=cfg.rollout_top_k, top_p=cfg.rollout_top_p, stop_token_ids=stop)
            ok = self.correct(model, [p for p in self.prompts for _ in range(n)], sampled, jax.random.key(1))
            counts = ok.reshape(len(self.prompts), n).sum(axis=1)
            result[f"eval_pass@{cfg.eval_pass_k}"] = float(np.mean([pass_at_k(n, c, cfg.eval_pass_k) for c in counts]))
        return result
