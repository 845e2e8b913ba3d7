#!/usr/bin/env bash
# The GPU-only checks, on a node with the GPU image (SGLang, Transformer Engine), in about 15 minutes (each
# stage is bounded; every stage runs, and the script fails at the end naming each stage that failed):
#   1. preflight: interpreter, torch with CUDA, SGLang, megatron-core, and the device's free memory;
#   2. the tests marked `gpu` in tests/test_sglang*.py and tests/test_engine.py (none may be skipped):
#      - CUDA IPC push: SGLang's bf16 logprobs equal the trainer's after a push; peak push memory bounded,
#      - release/resume: device-wide free memory grows by most of SGLang's share; generation works after,
#      - trainer offload/onload: memory drops, the same weights come back, training goes on,
#      - Megatron's bf16 logprobs against transformers', fused kernels against unfused,
#      - a 3-step bf16 GRPO run of the quickstart recipe with rollout.engine=sglang under torchrun;
#   3. shared-prompt rows through Transformer Engine's packed attention against the padded layout
#      (tests/test_shared_prompts.py -m gpu): bf16 on the backend TE picks for this GPU, each check in a dtype
#      its backend supports;
#   4. LoRA with rollout.lora_sync=adapter on SGLang (tests/test_sglang_runs.py -k lora): a run whose engine
#      releases its memory before every trainer phase, resumes and generates from the adapters over the base
#      weights it kept; every step's rollout logprobs must be the trainer's (review finding N1);
#   5. checkpoint.save_final with SGLang: a 2-step bf16 GRPO run under torchrun must leave checkpoints/final,
#      which transformers loads (finding N2: the export runs beside the rollout engine);
#   6. a TP 2 push, only where `nvidia-smi -L` lists 2 GPUs or more: a 2-step bf16 GRPO run with the trainer at
#      parallel.tp=2 and one SGLang engine at rollout.tp=2 on both, logprobs within the bf16 bound;
#   7. tools/bench_handoff.py --device cuda: push GB/s vs a plain copy, peak extra memory vs the bucket.
#
# In the GPU image (Dockerfile) nothing needs setting up:
#   docker run --gpus all --ipc=host megarl:gpu bash tools/gpu_check.sh
# Elsewhere, once, on a machine with Python 3.11, an NVIDIA driver for CUDA 13 (R580+; SGLang 0.5.23 pins a
# cu13 torch) and this repository:
#   python3.11 -m venv .venv-sglang && . .venv-sglang/bin/activate \
#     && pip install -r requirements-sglang.txt && pip install --no-deps -e .
# Run, with that environment active (or --python PATH to its interpreter):
#   bash tools/gpu_check.sh [--python PATH] [--dry-run]
# --dry-run checks everything that needs no GPU (imports, versions, test collection and counts, the runs'
# recipes through `megarl plan`, the bench's options) and prints the commands it would run. Uses the first
# visible GPU (the first two for stage 6); run it on an otherwise idle node, since the memory checks read
# device-wide free memory.
set -euo pipefail
cd "$(dirname "$0")/.."

python=python
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --python PATH, --dry-run)" >&2; exit 2 ;;
  esac
done

# This checkout first on the path; the first GPU only (stage 6 names two); never the model hub.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
failed=()

stage() { printf '\n== %s (%ds elapsed)\n' "$1" $((SECONDS - start)); }
fail() { echo "FAILED: $1" >&2; failed+=("$1"); }

# pytest on the GPU, within LIMIT seconds, of WANT tests: in the dry run collect them and check the count;
# else every one must pass and none may skip.
gpu_tests() {
  local name=$1 limit=$2 want=$3 status=0 n
  shift 3
  if [ "$dry_run" = 1 ]; then
    echo "would run: timeout $limit $python -m pytest -q -p no:cacheprovider -rs $*"
    timeout 180 "$python" -m pytest -q -p no:cacheprovider --collect-only "$@" >"$tmp/collect.txt" 2>&1 || status=$?
    n=$(grep -c '::' "$tmp/collect.txt" || true)
    [ "$status" -eq 0 ] && [ "$n" -eq "$want" ] || { cat "$tmp/collect.txt"; fail "$name: expected $want tests, collected $n"; }
    return 0
  fi
  timeout "$limit" "$python" -m pytest -q -p no:cacheprovider -rs "$@" >"$tmp/tests.txt" 2>&1 || status=$?
  cat "$tmp/tests.txt"
  if [ "$status" -ne 0 ]; then fail "$name (pytest exit $status; 124: ran past $limit s)"
  elif grep -q 'skipped' "$tmp/tests.txt"; then fail "$name: a GPU test was skipped (reasons above)"
  fi
}

# `megarl train recipes/quickstart.yaml` under torchrun with NPROC ranks within LIMIT seconds (in the dry run:
# `megarl plan` of the same recipe for NPROC GPUs, which refuses an unknown key or a layout that does not
# divide), then the steps' checks; --final: also checkpoints/final, which transformers must load.
quickstart_run() {
  local name=$1 limit=$2 nproc=$3 final=$4 run_dir="$tmp/$1" status=0
  shift 4
  local args=(recipes/quickstart.yaml "run_dir=$run_dir" "model.path=$tmp/model" model.dtype=bfloat16
              "data.train_path=$tmp/data/train.jsonl" "data.eval_path=$tmp/data/heldout.jsonl"
              rollout.engine=sglang warmup.sft_steps=0 train.steps=2 train.skip_zero_advantage=false
              log.progress=false "$@")
  if [ "$dry_run" = 1 ]; then
    echo "would run: timeout $limit $python -m torch.distributed.run --standalone --nproc_per_node=$nproc -m megarl train ${args[*]}"
    timeout 120 "$python" -m megarl plan "${args[@]}" --nodes 1 --gpus-per-node "$nproc" >"$tmp/plan.txt" 2>&1 \
      || { cat "$tmp/plan.txt"; fail "$name: megarl plan refused the run"; }
    return 0
  fi
  timeout "$limit" "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" -m megarl train \
    "${args[@]}" || status=$?
  [ "$status" -eq 0 ] || { fail "$name (megarl train exit $status; 124: ran past $limit s)"; return 0; }
  timeout 120 "$python" - "$run_dir" "$final" <<'PY' || fail "$name: its checks"
import json
import math
import sys
from pathlib import Path

run_dir, final = Path(sys.argv[1]), sys.argv[2] == "final"
steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
assert [m["step"] for m in steps] == [1, 2], [m["step"] for m in steps]
for m in steps:
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
    assert m["handoff/bytes"] > 0, m
    assert m["rollout/logprob_diff_mean"] <= 0.1, m  # bf16 on both sides: the parity tests' mean bound
print(f"steps {[m['step'] for m in steps]}, max logprob diff {max(m['rollout/logprob_diff_max'] for m in steps):.3g}")
if final:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "final")
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()
    print("checkpoints/final loads in transformers, finite logits")
PY
}

stage "1/7 preflight"
command -v "$python" >/dev/null || { echo "no interpreter '$python' (activate the SGLang environment or pass --python)" >&2; exit 1; }
timeout 120 "$python" - "$dry_run" <<'PY'
import importlib.metadata as md
import sys

dry_run = sys.argv[1] == "1"
assert sys.version_info[:2] >= (3, 11), f"Python 3.11+ needed, got {sys.version.split()[0]}"
import torch

versions = {p: md.version(p) for p in ("torch", "sglang", "megatron-core", "transformers", "torch_memory_saver")}
print("versions:", ", ".join(f"{k} {v}" for k, v in versions.items()))
if versions["sglang"] != "0.5.23":
    print(f"warning: tested with sglang 0.5.23, found {versions['sglang']}")
import megarl.rollout.sglang_engine  # noqa: F401  megarl itself imports
if not dry_run:
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device visible to torch (built for CUDA {torch.version.cuda}; an older driver "
                 "hides the GPU): this script needs one GPU")
    free, total = torch.cuda.mem_get_info()
    print(f"device: {torch.cuda.get_device_name()}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    if free < 0.8 * total:
        sys.exit("the device is busy (less than 80% free): the memory checks need an idle GPU")
PY
# The runs' tiny model (heads and KV heads divide by TP 2) and arithmetic data.
timeout 120 "$python" tools/make_tiny_model.py --out "$tmp/model" --hidden 128 --layers 2 --heads 8 --kv-heads 4 \
  --ffn 256 >/dev/null
timeout 120 "$python" -m megarl.data.arithmetic --out "$tmp/data" >/dev/null

stage "2/7 GPU tests"
gpu_tests "GPU tests" 330 6 -m gpu tests/test_sglang.py tests/test_sglang_runs.py tests/test_engine.py

stage "3/7 Transformer Engine shared-prompt rows"
gpu_tests "TE shared rows" 180 1 -m gpu tests/test_shared_prompts.py

stage "4/7 LoRA adapter sync on SGLang: release, resume, generate"
# The test's run starts from the quickstart's warm start, which its fixture makes first (a few minutes).
gpu_tests "LoRA adapter sync" 900 1 tests/test_sglang_runs.py -k lora

stage "5/7 checkpoint.save_final with SGLang"
quickstart_run save_final 300 1 final checkpoint.every_steps=1 checkpoint.save_final=true

stage "6/7 TP 2 push"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "$gpus" -ge 2 ] || [ "$dry_run" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0,1 quickstart_run tp2_push 300 2 no-final parallel.tp=2 rollout.tp=2 \
    checkpoint.save_final=false
else
  echo "skipped: nvidia-smi lists $gpus GPU(s); a TP 2 push needs 2"
fi

stage "7/7 handoff benchmark"
bench=(tools/bench_handoff.py --device cuda --engine sglang --bucket-mb 64 --dtype bfloat16)
if [ "$dry_run" = 1 ]; then
  echo "would run: timeout 150 $python ${bench[*]}"
  timeout 120 "$python" "${bench[@]}" --help >/dev/null || fail "bench_handoff.py --help"
else
  timeout 150 "$python" "${bench[@]}" || fail "handoff benchmark"
fi

if [ "${#failed[@]}" -gt 0 ]; then
  stage "failed: ${failed[*]}"
  exit 1
fi
if [ "$dry_run" = 1 ]; then stage "dry run done: nothing ran on a GPU"; else stage "all GPU checks passed"; fi
