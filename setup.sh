#!/usr/bin/env bash
# One-time set-up: makes .venv and installs unitrain (editable) with its test, tunix and wandb extras.
# Idempotent: re-running only installs what is missing.
#   ./setup.sh          CPU jax (default; nothing CUDA-sized is pulled in)
#   ./setup.sh --gpu    jax with CUDA 12 plugins
#   ./setup.sh --tpu    jax with libtpu
set -euo pipefail
cd "$(dirname "$0")"
accel=cpu
for arg in "$@"; do
  case "$arg" in
    --cpu) accel=cpu ;;
    --gpu) accel=gpu ;;
    --tpu) accel=tpu ;;
    *) echo "setup.sh: unknown option '$arg' (expected --cpu, --gpu or --tpu)" >&2; exit 2 ;;
  esac
done
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
case "$accel" in
  cpu) jax_spec="jax[cpu]" ;;
  gpu) jax_spec="jax[cuda12]" ;;
  tpu) jax_spec="jax[tpu]" ;;
esac
# torch (test extra) is pinned to a CPU build; install it first so nothing pulls a CUDA torch.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q "$jax_spec>=0.10,<0.12" -e ".[test,tunix,wandb]"
# Tunix's model library (model_source=tunix): its requirements came with the tunix extra; the
# package itself without its safetensors<0.8 pin (see pyproject.toml).
.venv/bin/python -m pip install -q --no-deps "google-tunix==0.1.7"
echo "set-up done: activate with 'source .venv/bin/activate'"
