"""The evaluator of `data_format: minionerec` in every mode: HR@K and NDCG@K of the ranked SIDs that
(constrained) beam search gives for the eval split's next-item examples, and <run_dir>/predictions.jsonl.

    evaluator = RecEvaluator(cfg, tokenizer, sampler)
    evaluator(params, step) -> {"eval_hr_at_10": ..., "eval_ndcg_at_10": ..., ...}

With one relevant item per example, HR@K is the share of examples whose target is among the top K
and NDCG@K the mean of 1/log2(rank + 2) over those (rank 0 = first), as MiniOneRec computes them.
Beam search is constrained to `sid_index_path`'s SIDs when it is set. The prompts go to the sampler
in blocks of `rec_eval_batch_size` (the last block padded), so every evaluation reuses one compiled
program per prompt-length bucket.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from unitrain.data.prompt_ids import fitting_prompts
from unitrain.data.sources import split_path
from unitrain.engines.base import release
from unitrain.recsys.data import history_prompt, read_examples
from unitrain.recsys.rollout import sid_beams


def hr_ndcg(ranked: list[list[str]], targets: list[str], ks) -> dict:
    """{hr_at_K, ndcg_at_K} over examples: `ranked` are each example's predictions, best first."""
    ranks = np.asarray([r.index(t) if t in r else np.inf for r, t in zip(ranked, targets)], np.float64)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr_at_{k}"] = float(hit.mean())
        out[f"ndcg_at_{k}"] = float(np.where(hit, 1.0 / np.log2(np.where(hit, ranks, 0) + 2), 0.0).mean())
    return out


class RecEvaluator:
    """The evaluator of the rec modes; `samples` is then the markdown of the first predictions."""

    def __init__(self, cfg, tokenizer, sampler):
        self.cfg, self.tokenizer, self.sampler = cfg, tokenizer, sampler
        examples = read_examples(split_path(cfg, "eval"), cfg.rec_history_titles)
        # The label is the example's index: a prompt longer than max_prompt_length is dropped, and
        # the index still finds its user and target.
        records = [{"prompt": history_prompt(e), "label": str(i)} for i, e in enumerate(examples)]
        self.prompts = fitting_prompts(cfg, tokenizer, cfg.eval_num_samples, records, split_path(cfg, "eval"))
        self.examples = [examples[int(p.label)] for p in self.prompts]
        self.beams = sid_beams(cfg, tokenizer, cfg.beam_width)
        self.samples = ""

    def predict(self) -> list[list[tuple[str, float]]]:
        """(SID, total logprob) of each eval prompt's beams, best first; beams with no sequence left out."""
        size, out = self.cfg.rec_eval_batch_size, []
        for start in range(0, len(self.prompts), size):
            ids = [list(p.ids) for p in self.prompts[start : start + size]]
            n = len(ids)
            ranked = self.sampler.beam_search(ids + ids[:1] * (size - n), self.beams, jax.random.key(0))
            for tokens, lengths, scores in zip(ranked.tokens[:n], ranked.lengths[:n], ranked.scores[:n]):
                out.append(
                    [
                        (self.tokenizer.decode(t[:l]).strip(), float(s))
                        for t, l, s in zip(tokens, lengths, scores)
                        if np.isfinite(s)
                    ]
                )
        return out

    def __call__(self, params, step: int) -> dict:
        self.sampler.update_weights(params, step)
        predictions = self.predict()
        release(self.sampler)
        targets = [e["target"] for e in self.examples]
        metrics = hr_ndcg([[sid for sid, _ in p] for p in predictions], targets, self.cfg.rec_eval_k)
        self._write(step, predictions)
        self.samples = "\n\n".join(
            f"**history** {', '.join(e['history'])}\n\n**target** {e['target']}\n\n"
            f"**top 3** {', '.join(sid for sid, _ in p[:3])}"
            for e, p in zip(self.examples[:4], predictions)
        )
        return {f"eval_{k}": v for k, v in metrics.items()}

    def _write(self, step: int, predictions) -> None:
        """predictions.jsonl: the latest evaluation's ranked SIDs per example (process 0)."""
        if jax.process_index() != 0:
            return
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        path = os.path.join(self.cfg.run_dir, "predictions.jsonl")
        with open(path + ".tmp", "w") as f:
            for e, p in zip(self.examples, predictions):
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "user_id": e["user"],
                            "target": e["target"],
                            "predictions": [sid for sid, _ in p],
                            "logprobs": [s for _, s in p],
                        }
                    )
                    + "\n"
                )
        os.replace(path + ".tmp", path)
