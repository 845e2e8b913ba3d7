#!/usr/bin/env bash
# The quickstart: make a tiny model and an arithmetic prompt set on this machine, then run
# recipes/quickstart.yaml (a short supervised warm start, then GRPO on real Megatron-core).
#   bash tools/quickstart.sh [--out DIR] [--recipe FILE] [--nproc N] [key.path=value ...]
# DIR (default runs/quickstart) receives the model, the data and the run (DIR/run for the quickstart
# recipe, DIR/<recipe name> for another one, e.g. recipes/ppo_tiny.yaml); --nproc N runs it under torchrun
# with N processes (e.g. placement.mode=split placement.rollout_ranks=1); the rest are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/quickstart
recipe=recipes/quickstart.yaml
launch=(megarl)
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --recipe) recipe=$2; shift 2 ;;
    --nproc) launch=(python -m torch.distributed.run --standalone "--nproc_per_node=$2" -m megarl); shift 2 ;;
    *) break ;;
  esac
done
name=$(basename "$recipe" .yaml)
[ "$name" = quickstart ] && name=run
[ -f "$out/model/config.json" ] || python tools/make_tiny_model.py --out "$out/model" --arch qwen2 --seed 0 \
  --hidden 128 --layers 2 --heads 8 --kv-heads 4 --ffn 256
[ -f "$out/data/train.jsonl" ] || python -m megarl.data.arithmetic --out "$out/data" --seed 0
exec "${launch[@]}" train "$recipe" run_dir="$out/$name" model.path="$out/model" \
  data.train_path="$out/data/train.jsonl" data.eval_path="$out/data/heldout.jsonl" "$@"
