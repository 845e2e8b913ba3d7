"""Run under torchrun by test_convert.py: load a converted checkpoint into a TrainEngine at a given layout
and write the HF tensors it hands off (every stage's, gathered over TP and EP) to --out from rank 0. With
--cases FILE one job loads at several layouts in turn."""

from __future__ import annotations

import argparse
import warnings

import torch.distributed as dist
from safetensors.torch import save_file

warnings.filterwarnings("ignore")

from megarl.engine.megatron import TrainEngine  # noqa: E402
from megarl.models.arch import read_shape
from megarl.engine.parallel import init_parallel  # noqa: E402
from parallel_worker import run_cases  # noqa: E402


def case_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    return parser


def run_case(args: argparse.Namespace) -> None:
    groups = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    engine = TrainEngine(model_dir=f"{args.ckpt}/hf", shape=read_shape(f"{args.ckpt}/hf"), dtype="float32", megatron={}, groups=groups, load_weights=False)
    engine.load_checkpoint(f"{args.ckpt}/actor")
    tensors = {name: t.clone() for name, t in engine.pipeline_hf_tensors()}
    if dist.get_rank() == 0:
        save_file(tensors, args.out)
    dist.barrier()


if __name__ == "__main__":
    run_cases(case_parser(), run_case)
