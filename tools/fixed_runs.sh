#!/usr/bin/env bash
# Fixed-seed short runs of every rollout shape and RL algorithm, for tools/same_metrics.py: GRPO with a
# KL term and rollout_is, GRPO packed with the KL in the reward, DAPO (dynamic sampling, overlong
# penalty and filter, Dr.GRPO; a step ahead, and on-policy), PPO, guessing-game episodes (a step
# ahead, and on-policy), MiniOneRec GRPO with beams and SFT. Each RL run starts from a short SFT run (made once under OUT/start) so that rewards vary.
#   tools/fixed_runs.sh OUT [name ...]     # e.g. on two commits, then tools/same_metrics.py A B
# MiniOneRec needs ../shared/data/minionerec.
set -u
out=$(realpath -m "$1"); shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" JAX_PLATFORMS=cpu
py=${PYTHON:-.venv/bin/python}
start=$out/start
[ -d "$start/arith/checkpoints" ] || $py -m unitrain.train configs/base.yml model_name=tiny steps=300 builtin_task_digits=1 \
  eval_interval=0 base_output_directory="$start" run_name=arith log_period=100 > "$out/start_arith.log" 2>&1
[ -d "$start/guess/checkpoints" ] || $py -m unitrain.train configs/base.yml mode=sft model_name=tiny builtin_task_ops=+-* \
  env=guess_number chat_template_file=templates/tiny_chat.jinja max_target_length=128 steps=40 eval_interval=0 \
  base_output_directory="$start" run_name=guess log_period=20 > "$out/start_guess.log" 2>&1
[ -d "$start/rec" ] || $py tools/make_tiny_model.py "$start/rec" \
  --extra-tokens ../shared/data/minionerec/index_Industrial_and_Scientific.index.json \
  --corpus ../shared/data/minionerec/info_Industrial_and_Scientific_5_2016-10-2018-11.txt \
  --vocab-size 1024 --emb-dim 32 --mlp-dim 64 --head-dim 16 > /dev/null 2>&1
g="mode=grpo per_device_batch_size=2 rollout_batch_size=4 n_samples_per_prompt=4 rollout_max_response_len=6 log_period=1
   builtin_task_digits=1 max_prompt_length=16 learning_rate=1e-3 warmup_steps=0 model_name=tiny steps=3 eval_interval=3
   eval_num_samples=8 eval_n_samples=2 eval_pass_k=2 checkpoint_period=100 rollout_temperature=2.0
   load_parameters_path=$start/arith/checkpoints base_output_directory=$out"
run() {
  local name=$1; shift
  [ -z "$names" ] || [[ " $names " == *" $name "* ]] || return 0
  rm -rf "${out:?}/$name"
  $py -m unitrain.train "$@" run_name="$name" > "$out/$name.log" 2>&1
  echo "$name rc=$?"
}
names="$*"
# shellcheck disable=SC2086  # $g is a list of key=value words
run grpo_kl configs/base.yml $g kl_coef=0.05 rollout_is=true
run grpo_pack configs/base.yml $g rl_packing=true num_iterations=2 kl_coef=0.05 use_kl_in_reward=true
run dapo configs/base.yml $g over_sampling_batch_size=8 dynamic_sampling_filter=nonzero_std max_sampling_rounds=3 \
  overlong_buffer_len=2 overlong_filter=true advantage_estimator=drgrpo max_staleness=1
run dapo_on_policy configs/base.yml $g over_sampling_batch_size=8 dynamic_sampling_filter=nonzero_std max_sampling_rounds=3 \
  overlong_buffer_len=2 overlong_filter=true advantage_estimator=drgrpo
run ppo configs/base.yml ${g/mode=grpo/mode=ppo} kl_coef=0.05 use_kl_in_reward=true critic_warmup_steps=1
run guess configs/base.yml $g load_parameters_path="$start/guess/checkpoints" builtin_task_ops=+-* workflow=multi_turn \
  env=guess_number chat_template_file=templates/tiny_chat.jinja max_turns=3 rollout_max_response_len=4 \
  episode_max_tokens=48 max_staleness=1 max_prompt_length=64 max_target_length=128 turn_discount=0.9 rollout_temperature=1.0
run guess_on_policy configs/base.yml $g load_parameters_path="$start/guess/checkpoints" builtin_task_ops=+-* workflow=multi_turn \
  env=guess_number chat_template_file=templates/tiny_chat.jinja max_turns=3 rollout_max_response_len=4 \
  episode_max_tokens=48 max_prompt_length=64 max_target_length=128 turn_discount=0.9 rollout_temperature=1.0
run rec configs/minionerec_grpo.yml load_parameters_path="$start/rec" tokenizer_path="$start/rec" base_output_directory="$out" \
  steps=2 n_samples_per_prompt=4 rollout_batch_size=4 over_sampling_batch_size=8 per_device_batch_size=2 eval_interval=2 \
  eval_num_samples=16 beam_width=10 'rec_eval_k=[1,10]' log_period=1 max_target_length=192 max_prompt_length=128
run sft configs/base.yml model_name=tiny steps=6 eval_interval=3 eval_num_samples=16 per_device_batch_size=2 log_period=1 \
  base_output_directory="$out"
