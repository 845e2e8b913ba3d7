#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, downloaded here into .device_wheels/ (ignored by git; carried to the
# machine with the working tree, under 64 MiB in all). That machine has Python 3.12, torch 2.11 (CUDA 13),
# transformers 5.17 and their dependencies, and no package index: megarl's other requirements travel as
# wheels for CPython 3.12 on x86-64 Linux, at the versions constraints.txt pins.
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
dest=.device_wheels
rm -rf "$dest"
mkdir -p "$dest"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -c constraints.txt -d "$dest" "${missing[@]}"

n=$(find "$dest" -name '*.whl' | wc -l)
[ "$n" -eq "${#missing[@]}" ] || { echo "prepare.sh: expected ${#missing[@]} wheels, got $n" >&2; exit 1; }
size_kib=$(du -sk "$dest" | cut -f1)
limit_kib=$((32 * 1024))  # half of what travels to the machine: the working tree needs the rest
[ "$size_kib" -le "$limit_kib" ] || { echo "prepare.sh: $dest is $size_kib KiB, over $limit_kib KiB" >&2; exit 1; }
ls -1 "$dest"
echo "$n wheels, $size_kib KiB in $dest"
