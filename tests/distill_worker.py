"""Run under torchrun by test_distill.py: the distillation signal of one fixed batch at a parallel layout.

A student and a larger teacher (each its own checkpoint, one tokenizer) are built in Megatron's parallel state
for --tp/--pp, both score the same tokens, and rank 0 writes the per-token reverse KL (log p_student -
log p_teacher, megarl.algo.kl.reverse_kl) and the teacher's logprobs to --out/result.json. With --cases FILE
one job runs several layouts in turn (tests/parallel_worker.run_cases).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megarl.algo.kl import reverse_kl  # noqa: E402
from megarl.engine.megatron import TrainEngine  # noqa: E402
from megarl.models.arch import read_shape
from megarl.engine.parallel import init_parallel  # noqa: E402
from parallel_worker import layout_parser, run_cases  # noqa: E402


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [4, 14] from the tiny tokenizer's real vocabulary and a response mask of different lengths."""
    tokens = torch.randint(3, 98, (4, 14), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(4, 14)
    for i in range(4):
        mask[i, 5: 14 - i] = 1.0
    return tokens, mask


def run_case(args) -> None:
    groups = init_parallel(tp=args.tp, pp=args.pp, seed=0)
    tokens, mask = fixed_batch()
    scores = {}
    for name, path in (("student", args.model), ("teacher", args.teacher)):
        engine = TrainEngine(model_dir=path, shape=read_shape(path), dtype="float32", megatron={}, groups=groups)
        scores[name] = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2) * mask
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "reverse_kl": reverse_kl(scores["student"], scores["teacher"], mask).tolist(),
            "teacher_logprobs": scores["teacher"].tolist()}))
    dist.barrier()


if __name__ == "__main__":
    parser = layout_parser()
    parser.add_argument("--teacher", required=True)
    run_cases(parser, run_case)
