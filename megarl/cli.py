"""`megarl` command line.

    megarl train RECIPE.yaml [key.path=value ...]
    megarl plan RECIPE.yaml [key.path=value ...] --nodes N --gpus-per-node G [--gpu-mem-gb 80]
        [--host-mem-gb 2048] [--prompt-tokens 1024 | --seq-tokens 4096] [--json]
    megarl trace RUN_DIR [--out FILE]
    megarl report RUN_DIR [--out DIR]

Overrides may come before, between or after the flags.

Run `train` directly for one process, or under torchrun (`torchrun --nproc_per_node=N -m megarl train ...`)
for one process per device. A recipe or data error stops before any work with exit code 2 and a
message that names the file and the key or line. SIGTERM or SIGUSR1 (a preemption, a job time limit) stops
a run after its current step with a checkpoint and exit code 143, Ctrl-C with exit code 130 (a second
Ctrl-C at once); the same command resumes it (megarl/loops/stop.py). `plan` checks a recipe's layout for a
cluster and estimates its memory per GPU on any machine (see megarl/plan/): exit code 0 when it fits, 1
when it does not, 2 for a recipe or layout error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

from megarl.config import RecipeError, load_config
from megarl.dataclass_yaml import ConfigError
from megarl.plan import DEFAULT_HOST_MEM_GIB, DEFAULT_SEQ_TOKENS


def _quiet_expected_warnings() -> None:
    # Without Transformer Engine/apex (every CPU run), megatron warns at import about the fallbacks it uses.
    for pattern in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*", ".*is deprecated. Please use `torch.distributed.*"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: list[str] | None = None) -> None:
    from megarl import __version__

    parser = argparse.ArgumentParser(prog="megarl",
                                     description="RL, DPO, SFT and reward-model post-training of LLMs on Megatron-core")
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    sub = parser.add_subparsers(dest="command")
    train_p = sub.add_parser("train", help="run a recipe")
    train_p.add_argument("recipe", nargs="?", help="recipe YAML file")
    train_p.add_argument("overrides", nargs="*", help="key.path=value overrides of recipe fields")
    train_p.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    plan_p = sub.add_parser("plan", help="check a recipe's layout for a cluster and estimate memory per GPU")
    plan_p.add_argument("recipe", help="recipe YAML file")
    plan_p.add_argument("overrides", nargs="*", help="key.path=value overrides of recipe fields")
    plan_p.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    plan_p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    plan_p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory per GPU in GiB (default 80)")
    plan_p.add_argument("--host-mem-gb", type=float, default=DEFAULT_HOST_MEM_GIB,
                        help="host memory per node in GiB, for the trainer state offloaded during rollouts "
                             f"(default {DEFAULT_HOST_MEM_GIB:g}, a DGX H100 node)")
    plan_p.add_argument("--model-config", help="the model's HF config.json when model.path is not on this "
                        "machine (default: model.path/config.json)")
    plan_p.add_argument("--prompt-tokens", type=int, default=1024,
                        help="longest prompt in tokens; sequences are this + rollout.max_new_tokens, or + "
                             "env.max_tokens for a multi-turn env (default 1024)")
    plan_p.add_argument("--seq-tokens", type=int,
                        help=f"SFT, DPO and RM: the longest tokenized row (default {DEFAULT_SEQ_TOKENS})")
    plan_p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    plan_p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    trace_p = sub.add_parser("trace", help="merge a run's per-rank step timelines (log.trace) into one file")
    trace_p.add_argument("run_dir", help="the run's run_dir")
    trace_p.add_argument("--out", help="the merged Chrome-trace JSON (default RUN_DIR/trace.json)")
    trace_p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    report_p = sub.add_parser("report", help="PNG charts and a Markdown summary of a run's metrics.jsonl")
    report_p.add_argument("run_dir", help="the run's run_dir")
    report_p.add_argument("--out", help="folder of the charts and report.md (default RUN_DIR/report)")
    report_p.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    args = parse_args(parser, argv)
    if args.command is None or (args.command == "train" and args.recipe is None):
        # without this, argparse says only which positional argument is missing
        (parser if args.command is None else train_p).print_help(sys.stderr)
        sys.exit(2)
    if args.command not in ("train", "plan") and args.overrides:
        parser.error(f"unrecognized arguments: {' '.join(args.overrides)}")

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_expected_warnings()
    match args.command:
        case "plan":
            sys.exit(run_plan(args))
        case "train":
            sys.exit(run_train(args))
        case "trace":
            sys.exit(run_trace(args))
        case "report":
            sys.exit(run_report(args))


def run_train(args: argparse.Namespace) -> int:
    """`megarl train`: 0 when the run finished, 2 for a recipe, data or checkpoint error, 1 when every reward
    failed for reward.max_failed_steps steps, when a rollout engine does not sample the trainer's policy
    (megarl.loops.faults), or any other error (with its traceback), 143 (SIGTERM,
    SIGUSR1) or 130 (SIGINT) when a signal stopped it (megarl.loops.stop)."""
    import shlex

    from megarl.loops.stop import EXIT_INTERRUPTED, STOP, Stopped

    STOP.install()  # before any work: a signal during the start is honoured before the first step
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"megarl: recipe error: {e}", file=sys.stderr)
        return 2
    from megarl.checkpoint import CheckpointError, latest_checkpoint
    from megarl.data.prompts import DataError
    from megarl.handoff import WeightMismatch
    from megarl.loops.faults import EngineFault, EngineLost
    from megarl.rewards.scorer import RewardFailure

    match cfg.algo.traits.loop:
        case "sft":
            from megarl.loops.sft import train
        case "dpo":
            from megarl.loops.dpo import train
        case "rm":
            from megarl.loops.rm import train
        case "rl":  # every policy-gradient algorithm
            from megarl.loops.rl import train

    import torch.distributed as dist

    def lead() -> bool:  # the job's rank 0 (a rollout rank of placement split has no torch.distributed world)
        return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"

    def say(message: str) -> None:
        if lead():
            print(message, file=sys.stderr, flush=True)

    resume = shlex.join(["megarl", "train", args.recipe, *args.overrides])
    try:
        final = train(cfg)
    except RecipeError as e:
        print(f"megarl: recipe error: {args.recipe}: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"megarl: data error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"megarl: checkpoint error: {e}", file=sys.stderr)
        return 2
    except RewardFailure as e:
        say(f"megarl: reward error: {e}")
        return 1
    except WeightMismatch as e:  # raised where an engine holds other weights (any rank): that rank says so
        print(f"megarl: rollout engine fault: {e}", file=sys.stderr, flush=True)
        return 1
    except EngineLost as e:  # every training rank, after saving the last complete step
        saved = f"checkpoint {e.checkpoint}" if e.checkpoint is not None else "no step ran, nothing saved"
        say(f"megarl: rollout engine lost: {e} ({saved}); to resume, run the same command with the same run_dir "
            f"(checkpoint.resume: auto): {resume}")
        return 1
    except EngineFault as e:  # every training rank stops at the same step
        say(f"megarl: rollout engine fault: {e}")
        return 1
    except Stopped as e:
        saved = f"checkpoint {e.checkpoint}" if e.checkpoint is not None else "no step ran, nothing saved"
        say(f"megarl: stopped by {e.signal_name} after step {e.step} ({saved}); to resume, run the same "
            f"command with the same run_dir (checkpoint.resume: auto): {resume}")
        return e.exit_code
    except KeyboardInterrupt:
        try:
            last = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
        except CheckpointError:
            last = None
        say(f"megarl: interrupted; {f'the last checkpoint is {last}' if last else 'no checkpoint was saved'}; "
            f"to resume, run the same command: {resume}")
        return EXIT_INTERRUPTED
    finally:
        STOP.restore()
    is_lead = lead()
    if dist.is_initialized():  # the backends' threads joined here: left to the interpreter's exit, a rank may abort
        dist.destroy_process_group()
    if is_lead:
        if cfg.checkpoint.save_final:
            print(f"megarl: done; final checkpoint in {final}")
        else:
            print(f"megarl: done; no final checkpoint (checkpoint.save_final is false), metrics in "
                  f"{Path(cfg.run_dir) / 'metrics.jsonl'}")
    return 0


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, taking key=value overrides wherever they stand: argparse ends a positional list at the first
    flag, so overrides after a flag come back unparsed and are appended here, in order."""
    args, rest = parser.parse_known_args(argv)
    stray = [word for word in rest if word.startswith("-") or "=" not in word]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*getattr(args, "overrides", []), *rest]  # none without a command: main prints the usage
    return args


def run_plan(args: argparse.Namespace) -> int:
    """`megarl plan`: print the plan; return 0 (fits), 1 (does not fit) or 2 (recipe or layout error)."""
    from megarl.plan import Cluster, PlanError, plan, read_model, render_table, to_json

    try:
        counts = [args.nodes, args.gpus_per_node, args.prompt_tokens]
        counts += [] if args.seq_tokens is None else [args.seq_tokens]
        if min(counts) < 1 or min(args.gpu_mem_gb, args.host_mem_gb) <= 0:
            raise PlanError(f"--nodes {args.nodes}, --gpus-per-node {args.gpus_per_node}, --prompt-tokens "
                            f"{args.prompt_tokens}, --seq-tokens {args.seq_tokens} must be >= 1 and --gpu-mem-gb "
                            f"{args.gpu_mem_gb}, --host-mem-gb {args.host_mem_gb} > 0")
        # The recipe names the cluster's checkpoint and data: their existence is checked at launch, not here.
        cfg = load_config(args.recipe, args.overrides, check_paths=False)
        config_json = Path(args.model_config) if args.model_config else Path(cfg.model.path) / "config.json"
        if not config_json.is_file():
            where = "--model-config" if args.model_config else "model.path"
            raise PlanError(f"{where}: no config.json at {config_json}; where the checkpoint is not on this "
                            "machine, pass --model-config FILE (recipes/gpu/configs/ holds the shipped models')")
        shape = read_model(config_json)
        cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_mem_gb, args.host_mem_gb)
        result = plan(cfg, shape, cluster, recipe=args.recipe, prompt_tokens=args.prompt_tokens,
                      seq_tokens=args.seq_tokens)
    except (ConfigError, PlanError) as e:
        print(f"megarl: plan error: {e}", file=sys.stderr)
        return 2
    print(to_json(result) if args.json else render_table(result))
    return 0 if result.fits else 1


def run_trace(args: argparse.Namespace) -> int:
    """`megarl trace`: 0 with the merged file written, 2 when the run has no readable trace files."""
    from megarl.timeline import TraceError, merge_traces

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "trace.json"
    try:
        files, events = merge_traces(run_dir, out)
    except TraceError as e:
        print(f"megarl: trace error: {e}", file=sys.stderr)
        return 2
    print(f"megarl: {events} events of {files} trace files in {out} (open it in https://ui.perfetto.dev or "
          "chrome://tracing)")
    return 0


def run_report(args: argparse.Namespace) -> int:
    """`megarl report`: 0 with the charts and report.md written, 2 without metrics or without matplotlib."""
    from megarl.report import ReportError, write_report

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    try:
        written = write_report(run_dir, out_dir=out)
    except ReportError as e:
        print(f"megarl: report error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # matplotlib is an optional extra
        if not (e.name or "").startswith("matplotlib"):
            raise
        print(f"megarl: report needs matplotlib ({e}): pip install -e '.[report]' -c constraints.txt in the "
              "megarl checkout", file=sys.stderr)
        return 2
    print(f"megarl: {len(written) - 1} charts and the summary in {written[-1]}")
    return 0


if __name__ == "__main__":
    main()
