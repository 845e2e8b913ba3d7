#!/usr/bin/env bash
# One node, all local devices: launch/torchrun.sh RECIPE.yaml [key.path=value ...]
#   NPROC (default: number of GPUs, or 1 without GPUs) sets the processes on this node.
#   MAX_RESTARTS (default 2): a job that fails (a process died or raised, a collective timed out: torchrun exits
#   1) is started again, this many times at most; it resumes from its last checkpoint (checkpoint.resume: auto),
#   so set checkpoint.every_steps. A recipe error (exit 2), a stop (130, 143) and a job this script was asked to
#   stop (SIGTERM, SIGINT) are not started again.
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
max_restarts=${MAX_RESTARTS:-2}
stopping=0
pid=
# torchrun passes SIGTERM on to its processes (they save a checkpoint and stop); Ctrl-C reaches them directly
trap 'stopping=1; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null' TERM
trap 'stopping=1' INT
for attempt in $(seq 0 "$max_restarts"); do
  [ "$attempt" = 0 ] || echo "megarl: the job failed (exit $rc); starting it again from its last checkpoint" \
    "(restart $attempt of $max_restarts)" >&2
  "${cmd[@]}" &
  pid=$!
  # a trap ends `wait` early; wait again until torchrun itself has ended (its status is kept until then)
  while :; do
    rc=0
    wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  case $rc in 0 | 2 | 130 | 143) break ;; esac
  [ "$stopping" = 0 ] || break
done
exit "$rc"
