#!/usr/bin/env bash
# The built-in demonstration of both modes in one run directory, on CPU:
#   1. SFT of the tiny model on the built-in arithmetic task   -> runs/<name>/sft
#   2. GRPO from the SFT parameters with an exact-match reward -> runs/<name>/grpo
# Usage: tools/sft_then_grpo.sh [name] [key=value ...]   (extra keys go to both stages)
# Each stage resumes if re-run; compare `eval_accuracy` in the two metrics.jsonl files.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-sft_then_grpo}
shift || true
python=${PYTHON:-.venv/bin/python}
"$python" -m unitrain.train configs/base.yml base_output_directory="runs/$name" run_name=sft "$@"
"$python" -m unitrain.train configs/builtin_grpo.yml base_output_directory="runs/$name" run_name=grpo \
    load_parameters_path="runs/$name/sft/checkpoints" "$@"
grep -h eval_accuracy "runs/$name/sft/metrics.jsonl" | tail -1 | sed 's/^/sft  final eval: /'
grep -h eval_accuracy "runs/$name/grpo/metrics.jsonl" | tail -1 | sed 's/^/grpo final eval: /'
