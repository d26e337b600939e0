#!/usr/bin/env bash
# The offline merge of a verl run, with verl's own flag spelling, then a check of the result.
#
#   bash examples/verl/offline_merge.sh checkpoints/EXP [OUT]
#
# The run root means its latest step (latest_checkpointed_iteration.txt); with actor/ and critic/ both are merged,
# into OUT/actor and OUT/critic. `shardmerge verify` then compares each merged folder with its source checkpoint.
set -euo pipefail
ROOT=${1:?usage: offline_merge.sh RUN_ROOT [OUT]}
OUT=${2:-${ROOT%/}_hf}

shardmerge inspect "$ROOT"
python -m shardmerge merge --backend fsdp --local_dir "$ROOT" --target_dir "$OUT"
step=$(cat "$ROOT/latest_checkpointed_iteration.txt")
for role in actor critic; do
    if [ -d "$OUT/$role" ]; then
        shardmerge verify "$OUT/$role" "$ROOT/global_step_$step/$role"
    elif [ -f "$OUT/shardmerge.json" ] && [ -d "$ROOT/global_step_$step/$role" ]; then
        shardmerge verify "$OUT" "$ROOT/global_step_$step/$role"
    fi
done
# To publish: add --hf_upload_path USER/REPO [--private] to the merge command above.
