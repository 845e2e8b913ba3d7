#!/usr/bin/env bash
# The device probe on the lent machine (one H100 or H200, Python 3.12, torch 2.11, no package index): installs
# the wheels of tools/device_check/prepare.sh without an index and without dependencies, on top of the machine's
# own torch and transformers, installs megarl the same way, then runs tools/device_check/check.py (at most its
# TOTAL_S, 8 minutes; 4.5 to 6.5 expected on an H100), which writes device_check.json, device_check.md and one
# log per stage into OUT (the machine returns at most 8 files from it; scratch goes to a temporary folder).
#
# The machine receives tracked and untracked, not ignored, files only: .device_wheels is git-ignored, so the
# call carries it. After `bash tools/device_check/prepare.sh` here, the device tool's call is
#   run(command="bash tools/device_check/run.sh", carry=[".device_wheels"], timeout_s=540)
# (540 s: the check's 480 and the installs, under the machine's 600 s per command). A rerun of the stages that
# failed, on the same warm machine: run.sh --only STAGE,STAGE (check.py's stage names).
#
#   bash tools/device_check/run.sh [--out DIR] [--only STAGES]  # on the GPU machine; DIR defaults to $OUT
#   bash tools/device_check/run.sh --dry-run                    # here: the bundle resolves for CPython 3.12,
#                                                               # and every stage runs on the CPU, tiny
set -euo pipefail
cd "$(dirname "$0")/../.."

dry_run=0
out=${OUT:-runs/device_check}
python=python3
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1; shift ;;
    --out) out=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --only) only=(--only "$2"); shift 2 ;;
    *) echo "run.sh: unknown argument $1 (use --dry-run, --out DIR, --only STAGES, --python PATH)" >&2; exit 2 ;;
  esac
done
wheels=.device_wheels
mkdir -p "$out"

if [ ! -d "$wheels" ]; then
  echo "run.sh: no $wheels: run bash tools/device_check/prepare.sh first (where pip reaches an index)" >&2
  exit 1
fi
mapfile -t bundle < <(find "$wheels" -name '*.whl' | sort)
if [ "$dry_run" = 1 ]; then
  # What the machine's pip will do with the bundle, for its interpreter, without installing anything.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$python" -m pip install --quiet --disable-pip-version-check --dry-run --no-index --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --target "$tmp/site" "${bundle[@]}"
  echo "bundle: ${#bundle[@]} wheels install on CPython 3.12 x86-64 without an index"
  "$python" tools/device_check/check.py --out "$out" --dry-run "${only[@]}"  # set -e: its failure is ours
  exit 0
fi

"$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps "${bundle[@]}"
# megarl itself (its build backend, setuptools, is on the machine); the check puts this checkout first on
# PYTHONPATH anyway, so a failure here is reported and the check goes on.
"$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-build-isolation -e . \
  || echo "run.sh: megarl did not install; the check imports it from this checkout" >&2
"$python" -m pip check || true  # printed for the record: the machine's own packages may disagree among themselves
exec "$python" tools/device_check/check.py --out "$out" "${only[@]}"
