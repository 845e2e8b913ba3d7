#!/usr/bin/env bash
# The GPU-only checks, on one CUDA device, in about 5 minutes (each stage is bounded; 8 minutes at most):
#   1. preflight: interpreter, torch with CUDA, SGLang, megatron-core, and the device's free memory;
#   2. the tests marked `gpu` in tests/test_sglang*.py, tests/test_engine.py and tests/test_shared_prompts.py
#      (none may be skipped):
#      - CUDA IPC push: SGLang's bf16 logprobs equal the trainer's after a push; peak push memory bounded,
#      - release/resume: device-wide free memory grows by most of SGLang's share; generation works after,
#      - trainer offload/onload: memory drops, the same weights come back, training goes on,
#      - Megatron's bf16 logprobs against transformers', fused kernels against unfused,
#      - shared-prompt rows through Transformer Engine's packed attention against the padded layout,
#      - a 3-step bf16 GRPO run of the quickstart recipe with rollout.engine=sglang under torchrun;
#   3. tools/bench_handoff.py --device cuda: push GB/s vs a plain copy, peak extra memory vs the bucket.
#
# In the GPU image (Dockerfile) nothing needs setting up:
#   docker run --gpus all --ipc=host megarl:gpu bash tools/gpu_check.sh
# Elsewhere, once, on a machine with Python 3.11, an NVIDIA driver for CUDA 13 (R580+; SGLang 0.5.23 pins a
# cu13 torch) and this repository:
#   python3.11 -m venv .venv-sglang && . .venv-sglang/bin/activate \
#     && pip install -r requirements-sglang.txt && pip install --no-deps -e .
# Run, with that environment active (or --python PATH to its interpreter):
#   bash tools/gpu_check.sh [--python PATH] [--dry-run]
# --dry-run checks everything that needs no GPU (imports, versions, test collection, the bench's options)
# and prints the commands it would run. Uses the first visible GPU; run it on an otherwise idle device,
# since the memory checks read device-wide free memory.
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

# This checkout first on the path; the first GPU only; never the model hub.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

stage() { printf '\n== %s (%ds elapsed)\n' "$1" $((SECONDS - start)); }

stage "1/3 preflight"
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

stage "2/3 GPU tests"
tests=(-m pytest -q -p no:cacheprovider -m gpu -rs tests/test_sglang.py tests/test_sglang_runs.py tests/test_engine.py
       tests/test_shared_prompts.py)
if [ "$dry_run" = 1 ]; then
  echo "would run: timeout 330 $python ${tests[*]}"
  timeout 180 "$python" "${tests[@]}" --collect-only | tee "$tmp/collect.txt"
  n=$(grep -c '::test_gpu_' "$tmp/collect.txt" || true)
  [ "$n" -eq 7 ] || { echo "expected 7 GPU tests, collected $n" >&2; exit 1; }
else
  status=0
  timeout 330 "$python" "${tests[@]}" >"$tmp/tests.txt" 2>&1 || status=$?
  cat "$tmp/tests.txt"
  [ "$status" -eq 0 ] || { echo "GPU tests failed (exit $status; 124: ran past 330 s)" >&2; exit 1; }
  if grep -q 'skipped' "$tmp/tests.txt"; then echo "a GPU test was skipped: see the reasons above" >&2; exit 1; fi
fi

stage "3/3 handoff benchmark"
bench=(tools/bench_handoff.py --device cuda --engine sglang --bucket-mb 64 --dtype bfloat16)
if [ "$dry_run" = 1 ]; then
  echo "would run: timeout 150 $python ${bench[*]}"
  timeout 120 "$python" "${bench[@]}" --help >/dev/null
else
  timeout 150 "$python" "${bench[@]}"
fi

if [ "$dry_run" = 1 ]; then stage "dry run done: nothing ran on a GPU"; else stage "all GPU checks passed"; fi
