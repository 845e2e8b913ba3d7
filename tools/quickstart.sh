#!/usr/bin/env bash
# The quickstart: make a tiny model and an arithmetic prompt set on this machine, then run
# recipes/quickstart.yaml (a short supervised warm start, then GRPO on real Megatron-core).
#   bash tools/quickstart.sh [--out DIR] [--recipe FILE] [key.path=value ...]
# DIR (default runs/quickstart) receives the model, the data and the run (DIR/run for the quickstart
# recipe, DIR/<recipe name> for another one, e.g. recipes/ppo_tiny.yaml); the rest are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/quickstart
recipe=recipes/quickstart.yaml
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --recipe) recipe=$2; shift 2 ;;
    *) break ;;
  esac
done
name=$(basename "$recipe" .yaml)
[ "$name" = quickstart ] && name=run
[ -f "$out/model/config.json" ] || python tools/make_tiny_model.py --out "$out/model" --arch qwen2 --seed 0 \
  --hidden 128 --layers 2 --heads 8 --kv-heads 4 --ffn 256
[ -f "$out/data/train.jsonl" ] || python -m megarl.data.arithmetic --out "$out/data" --seed 0
exec megarl train "$recipe" run_dir="$out/$name" model.path="$out/model" \
  data.train_path="$out/data/train.jsonl" data.eval_path="$out/data/heldout.jsonl" "$@"
