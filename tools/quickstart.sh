#!/usr/bin/env bash
# The quickstart: make a tiny model and an arithmetic prompt set on this machine, then run
# recipes/quickstart.yaml (a short supervised warm start, then GRPO on real Megatron-core).
#   bash tools/quickstart.sh [--out DIR] [key.path=value ...]
# DIR (default runs/quickstart) receives the model, the data and the run; the rest are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/quickstart
if [ "${1:-}" = "--out" ]; then out=$2; shift 2; fi
[ -f "$out/model/config.json" ] || python tools/make_tiny_model.py --out "$out/model" --arch qwen2 --seed 0 \
  --hidden 128 --layers 2 --heads 8 --kv-heads 4 --ffn 256
[ -f "$out/data/train.jsonl" ] || python -m megarl.data.arithmetic --out "$out/data" --seed 0
exec megarl train recipes/quickstart.yaml run_dir="$out/run" model.path="$out/model" \
  data.train_path="$out/data/train.jsonl" data.eval_path="$out/data/heldout.jsonl" "$@"
