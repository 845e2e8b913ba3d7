#!/usr/bin/env bash
# The quickstart: make a tiny model and an arithmetic prompt set on this machine, then run
# recipes/quickstart.yaml (a short supervised warm start, then GRPO on real Megatron-core).
# Extra arguments are recipe overrides, e.g. `bash tools/quickstart.sh train.steps=10`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=runs/quickstart
[ -f "$out/model/config.json" ] || python tools/make_tiny_model.py --out "$out/model" --arch qwen2 --seed 0 \
  --hidden 128 --layers 4 --heads 4 --kv-heads 2 --ffn 256
[ -f "$out/data/train.jsonl" ] || python -m megarl.data.arithmetic --out "$out/data" --seed 0
exec megarl train recipes/quickstart.yaml "$@"
