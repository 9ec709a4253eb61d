#!/usr/bin/env bash
# Run a command on a GPU and a CPU core that gpud assigns to a task; free them however it ends.
#   examples/alloc_recipe.sh TASK_ID COMMAND [ARG...]
set -euo pipefail
TASK=$1
shift
# An assignment's exit status is its command substitution's: when gpud refuses (the node
# is full, a bad request) the script stops here, instead of running the command with
# CUDA_VISIBLE_DEVICES unset, on every GPU. --owner-pid: gpud frees it if this shell is killed.
vars=$(gpuctl alloc --task "$TASK" --gpus 1 --cpus 1 --owner-pid $$) || exit 1
trap 'gpuctl free --task "$TASK" >/dev/null || true' EXIT
eval "$vars"  # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, GPUD_TASK_ID, GPUD_GPU_SHARE, GPUD_CPUS
if [ -n "$GPUD_CPUS" ]; then
    taskset -c "$GPUD_CPUS" "$@"
else
    "$@"
fi
