"""Data for unitrain: tokenizers (tokenizer.py), record sources (sources.py, builtin.py), the SFT
(sft.py), GRPO-prompt (prompts.py) and preference-pair (preference.py) pipelines, data shards
(shards.py); data_format's formats (formats.py). Import from the submodules: this package
imports none of them, so that none of them is in an import cycle with it."""
