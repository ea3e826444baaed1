#!/usr/bin/env bash
# unitrain against Google Tunix on the work of ../shared/bench/tunix_peer, alternated A B A B in one
# run (timings drift on shared machines; the ratio of neighbours drifts less). One line per pair and
# the median ratio at the end (> 1: unitrain faster for the sampler; < 1: unitrain's step shorter for grpo).
#
#   tools/peer_ab.sh sampler PAIRS [BATCH PROMPT_LEN NEW_TOKENS]      tokens/s ours / Tunix's
#   tools/peer_ab.sh grpo PAIRS [PROMPTS SAMPLES NEW_TOKENS]          step time ours / Tunix's
#
# Needs Tunix in a venv of its own and the peer's checkpoint (../shared/bench/tunix_peer/README.md):
#   TUNIX_VENV (default ~/venv-tunix), CKPT (default ~/bench_ckpt/qwen2-16m), PEER (default ../shared/bench/tunix_peer).
# Extra unitrain config overrides go in UNITRAIN_ARGS (e.g. UNITRAIN_ARGS="rollout_cache_phases=1").
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?mode: sampler or grpo}
pairs=${2:?number of A B pairs}
TUNIX_VENV=${TUNIX_VENV:-$HOME/venv-tunix}
CKPT=${CKPT:-$HOME/bench_ckpt/qwen2-16m}
PEER=$(cd "${PEER:-../shared/bench/tunix_peer}" && pwd)
PYTHON=${PYTHON:-.venv/bin/python}
case "$mode" in
  sampler)
    read -r b p n <<<"${3:-16} ${4:-64} ${5:-128}"
    peer_args=(--skip grpo --batch "$b" --prompt-len "$p" --gen-len "$n")
    ours_args=(--mode sampler --batch "$b" --prompt-len "$p" --new-tokens "$n" --steps 5 --warmup 2)
    peer_key=sampler_tokens_per_s; ours_key=tokens_per_sec ;;
  grpo)
    read -r g s n <<<"${3:-4} ${4:-4} ${5:-64}"
    peer_args=(--skip sampler --grpo-prompts "$g" --num-generations "$s" --grpo-gen-len "$n")
    ours_args=(--mode grpo --prompts "$g" --samples "$s" --new-tokens "$n" --steps 4 --warmup 1
               kl_coef=0.04 learning_rate=1e-6 per_device_batch_size=$((g * s)) reward=format "format_reward_pattern=[02468]")
    peer_key=grpo_step_time_s; ours_key=step_time_median ;;
  *) echo "peer_ab.sh: mode must be sampler or grpo, not '$mode'" >&2; exit 2 ;;
esac
[[ -x $TUNIX_VENV/bin/python ]] || { echo "peer_ab.sh: no Tunix venv at $TUNIX_VENV (see $PEER/README.md)" >&2; exit 2; }
[[ -f $CKPT/config.json ]] || { echo "peer_ab.sh: no checkpoint at $CKPT (make it with $PEER/make_ckpt.py)" >&2; exit 2; }

last_json() { grep '^{' | tail -1; }
field() { "$PYTHON" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
ratios=()
for ((i = 1; i <= pairs; i++)); do
  peer=$(cd "$PEER" && env -u XLA_FLAGS "$TUNIX_VENV/bin/python" tunix_bench.py --ckpt "$CKPT" "${peer_args[@]}" 2>/dev/null | last_json) || true
  [[ -n $peer ]] || { echo "peer_ab.sh: Tunix's bench printed no result (run it by hand as $PEER/README.md says)" >&2; exit 1; }
  # shellcheck disable=SC2086  # UNITRAIN_ARGS is a list of key=value words
  ours=$(env -u XLA_FLAGS JAX_PLATFORMS=cpu "$PYTHON" tools/bench.py configs/base.yml "load_parameters_path=$CKPT" \
         ${UNITRAIN_ARGS:-} "${ours_args[@]}" 2>/dev/null | last_json) || true
  [[ -n $ours ]] || { echo "peer_ab.sh: tools/bench.py printed no result (run it by hand: tools/bench.py ${ours_args[*]})" >&2; exit 1; }
  a=$(field "$peer" "$peer_key"); u=$(field "$ours" "$ours_key")
  r=$("$PYTHON" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}')" "$u" "$a")
  ratios+=("$r")
  echo "pair $i: tunix $peer_key=$a  unitrain $ours_key=$u  ratio $r"
done
"$PYTHON" -c "import statistics, sys; r = [float(x) for x in sys.argv[1:]]; print(f'median ratio {statistics.median(r):.3f} of {len(r)}: {sorted(r)}')" "${ratios[@]}"
