"""Run under torchrun by test_router_replay.py: MoE routing replayed and recorded at one parallel layout.

Every layout gets the same global batch and the same routes (random top-k experts per token and layer, so they
differ from the model's own choice). Each data-parallel rank takes its contiguous slice. Rank 0 of each replica
gathers nothing: the replica's logprobs, recorded routing and agreement are written per DP rank, and the test
compares their concatenation with the single-rank run. With --cases FILE one job runs several layouts in turn.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megarl.config import OptimConfig  # noqa: E402
from megarl.engine.megatron import TrainEngine  # noqa: E402
from megarl.models.arch import read_shape
from megarl.engine.parallel import init_parallel  # noqa: E402
from megarl.packing import sequence_lengths  # noqa: E402
from megarl.routing import RouteUse  # noqa: E402
from parallel_worker import layout_parser, run_cases  # noqa: E402

GLOBAL_BATCH, SEQ_LEN, PROMPT = 8, 12, 4


def fixed_inputs(vocab: int, *, layers: int, experts: int, top_k: int):
    """Tokens, response mask and per-sample routes [length - 1, layers, top_k] of distinct random experts."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    mask = torch.zeros(GLOBAL_BATCH, SEQ_LEN)
    for i in range(GLOBAL_BATCH):
        mask[i, PROMPT: 6 + i % 6] = 1.0
    lengths = sequence_lengths(mask, torch.full((GLOBAL_BATCH,), PROMPT))
    routes = [torch.rand(int(n) - 1, layers, experts, generator=gen).argsort(-1)[..., :top_k].to(torch.uint8)
              for n in lengths]
    return tokens, mask, lengths, routes


def case_parser() -> argparse.ArgumentParser:
    parser = layout_parser()
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="pack sequences (0: padded rows of 2)")
    parser.add_argument("--recompute", action="store_true", help="recompute every layer in the backward pass")
    return parser


def run_case(args: argparse.Namespace) -> None:
    groups = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp, seed=0)
    # no load-balancing loss: it is a function of the micro-batches, which packing changes (megarl.engine.compute)
    megatron = {"moe_aux_loss_coeff": 0.0, **({"sequence_parallel": True} if args.tp > 1 else {})}
    if args.recompute:
        megatron.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    actor = TrainEngine(model_dir=args.model, shape=read_shape(args.model), dtype="float32", megatron=megatron, groups=groups,
                        optim=OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=0.0, distributed=True))
    shape = actor.shape
    tokens, mask, lengths, routes = fixed_inputs(shape.vocab_size, layers=shape.moe_layers, experts=shape.experts,
                                                 top_k=shape.topk)
    total_tokens = float(mask.sum())
    per_rank = GLOBAL_BATCH // groups.dp_size
    mine = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    tokens, mask, lengths, routes = tokens[mine], mask[mine], lengths[mine], routes[mine]
    micro = dict(micro_batch_size=2)
    if args.micro_batch_tokens:
        micro.update(micro_batch_tokens=args.micro_batch_tokens, lengths=lengths)
    own = actor.logprobs(tokens, temperature=1.0, routes=RouteUse(routes=routes, record=True), **micro)
    agreement = actor.routing_agreement()
    recorded = [r[: int(n)] for r, n in zip(actor.recorded_routes(), lengths)]
    replayed = actor.logprobs(tokens, temperature=1.0, routes=RouteUse(routes=routes, replay=True), **micro)

    def loss_fn(logprobs, mb):  # the replayed sequences' mean token NLL over the global batch
        loss = -(logprobs * mb["response_mask"]).sum() / total_tokens
        return loss, {"loss": loss.detach()}

    step = actor.train_step(tokens, {"response_mask": mask}, loss_fn, temperature=1.0,
                            routes=RouteUse(routes=routes, replay=True), **micro)
    if groups.tp_rank == 0 and groups.cp_rank == 0 and groups.pp_rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"own": own * mask, "replayed": replayed * mask, "recorded": recorded, "routes": routes,
                    "lengths": lengths}, out / f"dp{groups.dp_rank}.pt")
        if groups.dp_rank == 0:
            (out / "agreement.json").write_text(json.dumps({"agreement": agreement, "dp": groups.dp_size,
                                                           "loss": step["loss"], "grad_norm": step["grad_norm"]}))
    dist.barrier()


if __name__ == "__main__":
    run_cases(case_parser(), run_case)
