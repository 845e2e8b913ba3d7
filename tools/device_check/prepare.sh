#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, downloaded here into .device_wheels/ (ignored by git; carried to the
# machine with the working tree). That machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17 and
# their dependencies, and no package index: megarl's other requirements travel as wheels for CPython 3.12 on
# x86-64 Linux, at the versions constraints.txt pins, and so does what the probe itself needs beyond megarl.
# Everything that travels (this checkout's tracked and untracked, not ignored, files and the wheels) must stay
# under the machine's 64 MiB.
#
#   bash tools/device_check/prepare.sh [--python PATH]    # any interpreter with pip; the wheels are for 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."

python=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    *) echo "prepare.sh: unknown argument $1 (use --python PATH)" >&2; exit 2 ;;
  esac
done

# megarl's requirements that the machine's image does not hold (its package list: torch, transformers,
# tokenizers, safetensors, numpy, pyyaml, psutil, tqdm, packaging, sympy, pytest, pytest-timeout are there).
missing=(megatron-core math-verify latex2sympy2_extended antlr4-python3-runtime pyseccomp)
# The probe's own, pinned here since megarl does not require it: torch_memory_saver at SGLang 0.5.23's pin
# (2.6 MB, its CUDA 12 and 13 hooks in one cp39-abi3 wheel), whose pause and resume stage 2 exercises.
probe_only=(torch_memory_saver==0.0.10)
dest=.device_wheels
rm -rf "$dest"
mkdir -p "$dest"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -c constraints.txt -d "$dest" "${missing[@]}" "${probe_only[@]}"

n=$(find "$dest" -name '*.whl' | wc -l)
want=$(( ${#missing[@]} + ${#probe_only[@]} ))
[ "$n" -eq "$want" ] || { echo "prepare.sh: expected $want wheels, got $n" >&2; exit 1; }
wheels_kib=$(du -sk "$dest" | cut -f1)
# What the device tool sends: tracked and untracked files that git does not ignore, plus the carried wheels.
tree_kib=$(( $(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null \
  | tail -1 | cut -f1) / 1024 ))
limit_kib=$((64 * 1024))
total_kib=$((wheels_kib + tree_kib))
ls -1 "$dest"
echo "$n wheels, $wheels_kib KiB in $dest; with the working tree ($tree_kib KiB) $total_kib KiB of $limit_kib KiB"
[ "$total_kib" -le "$limit_kib" ] || { echo "prepare.sh: $total_kib KiB would travel, over $limit_kib KiB" >&2; exit 1; }
