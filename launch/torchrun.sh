#!/usr/bin/env bash
# One node, all local devices: launch/torchrun.sh RECIPE.yaml [key.path=value ...]
#   NPROC (default: number of GPUs, or 1 without GPUs) sets the processes on this node.
#   --dry-run prints the command instead of running it.
set -euo pipefail
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
[ $# -ge 1 ] || { echo "usage: $0 [--dry-run] RECIPE.yaml [key.path=value ...]" >&2; exit 2; }
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
cmd=(torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" -m megarl train "$@")
if [ "$dry_run" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
# Megatron's overlap of communication and compute relies on one device queue per stream.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "${cmd[@]}"
