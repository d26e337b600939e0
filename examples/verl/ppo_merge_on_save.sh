#!/usr/bin/env bash
# verl PPO (FSDP) with every saved step merged into HF siblings by shardmerge, in the background.
#
# Needs a GPU node with verl and its rollout engine installed, and shardmerge installed in the same environment
# (pip install -e /path/to/shardmerge): verl loads shardmerge's `verl.plugins` entry point in every process that
# imports verl, so the `merge_on_save` flag reaches the trainer inside its Ray actor.
#
# Each save writes checkpoints/$EXP/global_step_N/{actor,critic}; once the save is complete (the tracker
# latest_checkpointed_iteration.txt is written) global_step_N/actor_hf and critic_hf appear, each with a
# shardmerge.json manifest and an <target>.status.json job record. Queued merges are waited for when fit() ends.
set -euo pipefail
EXP=${EXP:-qwen2.5-0.5b-ppo-shardmerge}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=gae \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    critic.strategy=fsdp2 critic.model.path="$MODEL" critic.ppo_micro_batch_size_per_gpu=4 \
    trainer.project_name=shardmerge-demo trainer.experiment_name="$EXP" \
    trainer.default_local_dir="checkpoints/$EXP" trainer.logger=console \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=1 \
    trainer.save_freq=50 trainer.test_freq=50 \
    +trainer.merge_on_save=true \
    +trainer.shardmerge.dtype=bfloat16 \
    +trainer.shardmerge.keep_last=2 \
    "$@"
