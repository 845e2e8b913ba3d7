"""Run under torchrun by test_rm.py: recipes/rm_tiny.yaml's loop (megarl.loops.rm.train: steps, held-out
evaluation, export) at a parallel layout. The metrics and the exported sequence classifier land in --out (the
run_dir) as a one-rank run's do. With --cases FILE one job runs several layouts in turn
(tests/parallel_worker.run_cases).
"""

from __future__ import annotations

import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from megarl.config import load_config  # noqa: E402
from megarl.loops.rm import train  # noqa: E402
from parallel_worker import layout_parser, run_cases  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "rm_tiny.yaml"


def run_case(args) -> None:
    train(load_config(RECIPE, [f"model.path={args.model}", f"run_dir={args.out}", f"parallel.tp={args.tp}",
                               f"parallel.pp={args.pp}", *args.set]))


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--set", action="append", default=[], help="a recipe override (key=value)")
    run_cases(parser, run_case)
