"""`data_format: minionerec` (registry.DATA_FORMATS): the MiniOneRec CSVs as records (data.py), the
HR/NDCG evaluation of constrained beam search in place of the modes' generation eval (evaluate.py),
GRPO's rollouts ranked and constrained to the SIDs (rollout.py), and the format's config checks
(checks.py)."""

from __future__ import annotations

from unitrain.data.formats import DataFormat
from unitrain.recsys import data, rollout
from unitrain.recsys.checks import CHECKS
from unitrain.recsys.evaluate import RecEvaluator


class MiniOneRec(DataFormat):
    """data_format: minionerec."""

    checks = CHECKS

    def sft_records(self, cfg, tokenizer, path: str) -> list[dict]:
        return data.sft_records(cfg, path)

    def prompt_records(self, cfg, path: str) -> list[dict]:
        return data.prompt_records(cfg, path)

    def evaluator(self, cfg, tokenizer, sampler) -> RecEvaluator:
        return RecEvaluator(cfg, tokenizer, sampler)

    def ranks_rollouts(self, cfg) -> bool:
        return cfg["rollout_decoding"] == "beam" or bool(cfg["sid_index_path"])

    def ranked_rollout(self, cfg, tokenizer):
        return rollout.ranked_rollout(cfg, tokenizer)

    def ranking(self, cfg) -> str | None:
        if cfg["evaluates"] and cfg["eval_num_samples"]:
            return "data_format=minionerec's evaluation (HR/NDCG of beam search)"
        if cfg["mode"] == "grpo" and self.ranks_rollouts(cfg):
            return "ranked rollouts (rollout_decoding=beam or sid_index_path)"
        return None
