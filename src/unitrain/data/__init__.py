"""Data for unitrain: tokenizers, sources (files, built-in task, synthetic) and the SFT and GRPO-prompt pipelines."""

from unitrain.data.builtin import builtin_problem
from unitrain.data.prompts import Prompt, eval_prompts, make_prompt_dataset, make_prompt_iterator
from unitrain.data.sft import BATCH_FIELDS, make_sft_dataset, make_sft_iterator
from unitrain.data.sources import read_records, resolve_paths
from unitrain.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "BATCH_FIELDS",
    "Tokenizer",
    "builtin_problem",
    "load_tokenizer",
    "make_sft_dataset",
    "make_sft_iterator",
    "read_records",
    "resolve_paths",
    "Prompt",
    "eval_prompts",
    "make_prompt_dataset",
    "make_prompt_iterator",
]
