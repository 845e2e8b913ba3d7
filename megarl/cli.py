"""`megarl` command line: `megarl train RECIPE.yaml [key.path=value ...]`.

Run it directly for one process, or under torchrun (`torchrun --nproc_per_node=N -m megarl train ...`)
for one process per device. A recipe or data error stops before any work with exit code 2 and a
message that names the file and the key or line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from megarl.config import ConfigError, RecipeError, load_config


def _quiet_expected_warnings() -> None:
    # Without Transformer Engine/apex (every CPU run), megatron warns at import about the fallbacks it uses.
    for pattern in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*", ".*is deprecated. Please use `torch.distributed.*"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megarl", description="RL, DPO and SFT post-training of LLMs on Megatron-core")
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="run a recipe")
    train_p.add_argument("recipe", help="recipe YAML file")
    train_p.add_argument("overrides", nargs="*", help="key.path=value overrides of recipe fields")
    train_p.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_expected_warnings()
    match args.command:
        case "train":
            try:
                cfg = load_config(args.recipe, args.overrides)
            except ConfigError as e:
                print(f"megarl: recipe error: {e}", file=sys.stderr)
                sys.exit(2)
            from megarl.data.prompts import DataError

            match cfg.algo.name:
                case "sft":
                    from megarl.loops.sft import train
                case "dpo":
                    from megarl.loops.dpo import train
                case _:  # every policy-gradient algorithm
                    from megarl.loops.rl import train

            try:
                final = train(cfg)
            except RecipeError as e:
                print(f"megarl: recipe error: {args.recipe}: {e}", file=sys.stderr)
                sys.exit(2)
            except DataError as e:
                print(f"megarl: data error: {e}", file=sys.stderr)
                sys.exit(2)
            import torch.distributed as dist

            if dist.get_rank() == 0:
                print(f"megarl: done; final checkpoint in {final}")


if __name__ == "__main__":
    main()
