"""What `data_format` names (registry.DATA_FORMATS, or a plugin `pkg.module:Class`): how a data set's
files become records, and what else the format brings the modes. DataFormat is the built-in
`records` format (prompt/completion or messages records for SFT, prompt/label records for GRPO, in
any file form of data/sources.py) and the base of every other: a format (recsys/format.py, or a
third party's) subclasses it and overrides what it does differently.

    fmt = format_choice.data_format(cfg)
    fmt.sft_records(cfg, tokenizer, path)    # SFT's records of the files at `path`
    fmt.prompt_records(cfg, path)            # GRPO's {prompt, label} records
    fmt.evaluator(cfg, tokenizer, sampler)   # an evaluator in place of the mode's generation eval, or None
    fmt.workflow(cfg)                        # the workflow GRPO's rollouts take (rollout/workflow.py)
    fmt.ranked_rollout(cfg, tokenizer)       # how workflow ranked ranks (engines/beam.py BeamParams); None = plain beams
    fmt.ranking(cfg)                         # what of the config ranks with beam search, or None
    fmt.check(cfg)                           # what is wrong with the config for this format, or None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from unitrain.data.sources import file_records, read_prompt_records


def _sid_index_needs_a_format(c) -> str | None:
    """Records have no SIDs to constrain GRPO's rollouts to: a set sid_index_path would do nothing."""
    if c["mode"] != "grpo" or not c["sid_index_path"]:
        return None
    return 'sid_index_path constrains GRPO\'s rollouts to SIDs, which data_format records does not do; set data_format=minionerec or sid_index_path=""'


class DataFormat:
    """data_format: records."""

    checks: tuple[Callable[[Mapping], str | None], ...] = (_sid_index_needs_a_format,)  # None or what is wrong

    def sft_records(self, cfg, tokenizer, path: str) -> list[dict]:
        return file_records(cfg, tokenizer, path)

    def prompt_records(self, cfg, path: str) -> list[dict]:
        return read_prompt_records(path, cfg.prompt_key, cfg.label_key)

    def evaluator(self, cfg, tokenizer, sampler):
        """An evaluator `(params, step) -> metrics` with its `samples` markdown, in place of the mode's
        generation eval (evals.TaskEvaluator); None = the mode's."""
        return None

    def ranks_rollouts(self, cfg) -> bool:
        """Whether GRPO's rollouts are ranked groups (workflow ranked): with rollout_decoding=beam."""
        return cfg["rollout_decoding"] == "beam"

    def workflow(self, cfg) -> str:
        """The workflow GRPO's rollouts take: ranked where the format ranks them, else `workflow`."""
        return "ranked" if self.ranks_rollouts(cfg) else cfg["workflow"]

    def ranked_rollout(self, cfg, tokenizer):
        """How workflow ranked ranks, as engines/beam.py's BeamParams; None = the n_samples_per_prompt
        plain beams of rollout_decoding=beam (rollout/ranked.py)."""
        return None

    def ranking(self, cfg) -> str | None:
        """What of the config ranks with beam search, so that the sampler must be able to; None = nothing."""
        return "rollout_decoding=beam" if cfg["mode"] == "grpo" and self.ranks_rollouts(cfg) else None

    def check(self, cfg) -> str | None:
        """The first of the format's checks that fails, or None. (Whether the sampler can rank where
        `ranking` says the config ranks is the engines' check, engines/factory.py.)"""
        return next((problem for check in self.checks if (problem := check(cfg))), None)
