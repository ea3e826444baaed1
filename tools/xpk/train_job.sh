#!/usr/bin/env bash
# What runs on every worker of a multi-host job (every TPU VM of every slice under XPK/GKE; also usable
# per node under SLURM or on a plain TPU VM):  make sure jax + unitrain are importable, then
#   python -m unitrain.train <config.yml> [key=value ...]
# from the repository root. No coordinator keys are passed: on a TPU pod (and on GKE multislice, where XPK
# sets TPU_WORKER_ID / MEGASCALE_*), unitrain's distributed_init=auto calls jax.distributed.initialize()
# and JAX detects the coordinator, the process count and this process's id itself.
#
# Usage:  bash tools/xpk/train_job.sh configs/gsm8k_grpo.yml base_output_directory=/gcs/ckpt/runs ...
# Environment (all optional):
#   UNITRAIN_ACCEL    tpu (default) | gpu | cpu   the jax build to install when one is needed
#   UNITRAIN_INSTALL  auto (default: install only if jax/unitrain/the accelerator plugin are missing)
#                     | always | never
#   PYTHON            the interpreter; default .venv/bin/python when it runs, else python3
set -euo pipefail
cd "$(dirname "$0")/../.."
accel=${UNITRAIN_ACCEL:-tpu}
install=${UNITRAIN_INSTALL:-auto}
case "$accel" in
  tpu) jax_spec="jax[tpu]" ; plugin=libtpu ;;
  gpu) jax_spec="jax[cuda12]" ; plugin=jax_cuda12_plugin ;;
  cpu) jax_spec="jax[cpu]" ; plugin="" ;;
  *) echo "train_job.sh: UNITRAIN_ACCEL must be tpu, gpu or cpu, not '$accel'" >&2; exit 2 ;;
esac
case "$install" in
  auto|always|never) ;;
  *) echo "train_job.sh: UNITRAIN_INSTALL must be auto, always or never, not '$install'" >&2; exit 2 ;;
esac
if [[ $# -lt 1 ]]; then
  echo "usage: bash tools/xpk/train_job.sh <config.yml> [key=value ...]" >&2
  exit 2
fi

if [[ -n ${PYTHON:-} ]]; then
  python=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "" 2>/dev/null; then
  python=.venv/bin/python   # e.g. a TPU VM prepared with ./setup.sh --tpu
else
  python=python3            # e.g. the container XPK builds: no venv, install into its python
fi

ready() {  # jax, unitrain and the accelerator plugin importable? (no device is touched)
  "$python" - "$plugin" <<'PY'
import importlib.util, sys
names = ["jax", "unitrain"] + [n for n in sys.argv[1:] if n]
sys.exit(0 if all(importlib.util.find_spec(n) for n in names) else 1)
PY
}

if [[ $install == always ]] || { [[ $install == auto ]] && ! ready; }; then
  echo "train_job.sh: installing $jax_spec and unitrain into $python" >&2
  "$python" -m pip install -q --no-cache-dir "$jax_spec>=0.10,<0.13" -e .
fi

export PYTHONUNBUFFERED=1   # log lines reach `kubectl logs` / the SLURM log as they are printed
echo "train_job.sh: host $(hostname) worker ${TPU_WORKER_ID:-${SLURM_PROCID:-?}}" \
     "slice ${MEGASCALE_SLICE_ID:-0}/${MEGASCALE_NUM_SLICES:-1} python $python" >&2
exec "$python" -m unitrain.train "$@"
