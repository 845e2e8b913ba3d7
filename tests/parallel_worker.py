"""Run under torchrun by test_parallel.py: two optimizer steps of a policy loss on a fixed global batch.

Every layout (TP, SP, PP, VPP, DP, EP, CP and their combinations) gets the same global batch: each DP rank takes
its contiguous slice (the context-parallel ranks of a replica take the same one and split its
sequences). Rank 0 writes the numbers and the full HF state dict after training to --out, so the
test can compare every layout against the single-rank run, and whether the handoff of the untrained
reference reproduced the checkpoint bit for bit. With --save the actor's distributed checkpoint after the
two steps goes to that directory; with --resume-from a fresh actor loads such a checkpoint (written at any
layout) and takes a third step on the same batch. With --cases FILE one job runs several layouts in turn.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

warnings.filterwarnings("ignore")

from megarl.algo.aggregate import global_loss_norm  # noqa: E402
from megarl.batch import RolloutBatch  # noqa: E402
from megarl.config import AlgoConfig, LoraConfig, OptimConfig  # noqa: E402
from megarl.engine.megatron import TrainEngine  # noqa: E402
from megarl.engine.parallel import init_parallel  # noqa: E402
from megarl.models.arch import read_shape  # noqa: E402
from megarl.objective import CriticObjective, policy_objective  # noqa: E402
from megarl.packing import PromptGroups, redistribute, sequence_lengths  # noqa: E402
from megarl.routing import RouteUse  # noqa: E402

GLOBAL_BATCH, SEQ_LEN = 8, 12


def global_batch(vocab: int) -> dict[str, torch.Tensor]:
    """A fixed batch: random tokens, responses of different lengths, advantages of both signs."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    mask = torch.zeros(GLOBAL_BATCH, SEQ_LEN)
    for i in range(GLOBAL_BATCH):
        mask[i, 4: 6 + i % 6] = 1.0
    advantages = torch.randn(GLOBAL_BATCH, 1, generator=gen).expand(-1, SEQ_LEN) * mask
    return {"tokens": tokens, "response_mask": mask, "advantages": advantages.contiguous()}


def lengths_of(mask: torch.Tensor) -> torch.Tensor:
    """[B] real tokens of the fixed batch (prompts of 4); packed rows score nothing past them."""
    return sequence_lengths(mask, torch.full((len(mask),), 4))


def redistributed(tokens: torch.Tensor, mine: dict, *, group, group_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict]:
    """This rank's samples after the RL loop's token balancing over the DP group (each sample its own group
    unless `group_ids` says otherwise; they come back as `group_ids`, made distinct over the ranks)."""
    n, mask = len(tokens), mine["response_mask"]
    group_ids = torch.arange(n) if group_ids is None else group_ids
    batch = RolloutBatch(tokens=tokens, response_mask=mask, prompt_lens=torch.full((n,), 4), group_ids=group_ids,
                         rollout_logprobs=torch.zeros_like(mask), responses=[""] * n, answers=[""] * n,
                         finish_reasons=["stop"] * n, prompt_texts=[""] * n, metadata=[{}] * n,
                         old_logprobs=mine["old_logprobs"], ref_logprobs=mine["ref_logprobs"],
                         advantages=mine["advantages"])
    batch, _ = redistribute(batch, group=group, pad_id=0)
    return batch.tokens, {"response_mask": batch.response_mask, "advantages": batch.advantages,
                          "old_logprobs": batch.old_logprobs, "ref_logprobs": batch.ref_logprobs,
                          "group_ids": batch.group_ids}


def layout_parser() -> argparse.ArgumentParser:
    """The arguments every layout worker takes: the checkpoint, where results go, and the parallel sizes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    parser.add_argument("--cp", type=int, default=1)
    return parser


def case_parser() -> argparse.ArgumentParser:
    parser = layout_parser()
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per pipeline rank")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="model.megatron.sequence_parallel: activations split over TP ranks along the sequence")
    parser.add_argument("--save", help="save the actor's distributed checkpoint after its two steps here")
    parser.add_argument("--resume-from", help="load this actor checkpoint into a fresh actor and take one step")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="pack sequences (0: padded rows)")
    parser.add_argument("--redistribute", action="store_true",
                        help="balance samples over DP ranks by tokens after the old logprobs, before training")
    parser.add_argument("--lora", action="store_true", help="the actor trains rank-4 adapters on every linear")
    parser.add_argument("--share-prompts", action="store_true",
                        help="also compare GRPO groups with their prompts held once (train.share_prompts) and not")
    return parser


# ---- shared prompts -------------------------------------------------------------------------------------------
# The fixed batch made into GRPO groups of 3, 2 and 3 samples: each group's prompt (4 tokens) is its first
# row's. With DP=2 the middle group is cut between the ranks (rows 0-3 and 4-7), each rank sharing its part.
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])


def grouped_batch(vocab: int) -> dict[str, torch.Tensor]:
    batch = global_batch(vocab)
    tokens = batch["tokens"].clone()
    for i, g in enumerate(GROUP_IDS.tolist()):
        tokens[i, :4] = tokens[int((GROUP_IDS == g).nonzero()[0]), :4]
    return batch | {"tokens": tokens, "group_ids": GROUP_IDS}


def grouped_routes(batch: dict, shape) -> list[torch.Tensor]:
    """Random distinct experts for every token but the last of each sample of the grouped batch, [length - 1,
    layers, top_k]; a group's samples have their first sample's routes over the prompt, as an engine that
    reads the prompt once gives them."""
    gen = torch.Generator().manual_seed(5)
    routes, first = [], {}
    for i, (n, g) in enumerate(zip(lengths_of(batch["response_mask"]).tolist(), batch["group_ids"].tolist())):
        picks = [torch.randperm(shape.experts, generator=gen)[:shape.topk] for _ in range((n - 1) * shape.layers)]
        routes.append(torch.stack(picks).view(n - 1, shape.layers, shape.topk).to(torch.uint8))
        routes[i][:4] = routes[first.setdefault(g, i)][:4]
    return routes


def shared_prompt_check(actor, critic, groups, args, *, moe_engines: Callable | None = None) -> dict:
    """On this layout, one forward and backward of the GRPO loss (clipped ratio, KL, entropy bonus) over the
    grouped batch with train.share_prompts on and off, packed (no update; the gradients are read after the
    schedule's reduction over DP, the TP reduction of sequence-parallel weights and the tied embedding's
    over pipeline stages, then cleared), and the critic's values. A MoE model's actor and critic come from
    `moe_engines` (its load-balancing loss off, as train.share_prompts needs), its routing is recorded (R2) in
    both layouts and compared sample by sample, and every pass of the actor replays random routes (R3). Returns
    the largest differences over all ranks and the global statistics of both passes."""
    batch = grouped_batch(actor.shape.vocab_size)
    moe = actor.shape.is_moe
    if moe:
        actor, critic = moe_engines()
        batch["routes"] = grouped_routes(batch, actor.shape)
        if groups.is_pp_last:  # the fresh critic's head is zeros: a small random one gives values to compare
            critic.module.output_layer.weight.data.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(99)
    noise = {k: 0.3 * torch.randn(batch["tokens"].shape, generator=gen) for k in ("old", "ref")}
    per_rank = GLOBAL_BATCH // groups.dp_size
    mine = {k: v[groups.dp_rank * per_rank: (groups.dp_rank + 1) * per_rank] for k, v in (batch | noise).items()}
    replay = RouteUse(routes=mine["routes"], replay=True) if moe else None
    if args.redistribute:  # as the RL loop balances tokens over DP: a group's samples may move to other ranks
        tokens, moved = redistributed(mine["tokens"], {"response_mask": mine["response_mask"],
                                                       "advantages": mine["advantages"], "old_logprobs": mine["old"],
                                                       "ref_logprobs": mine["ref"]},
                                      group=groups.dp, group_ids=mine["group_ids"])
        mine = {"tokens": tokens, "response_mask": moved["response_mask"], "advantages": moved["advantages"],
                "old": moved["old_logprobs"], "ref": moved["ref_logprobs"], "group_ids": moved["group_ids"]}
    tokens, mask = mine["tokens"], mine["response_mask"]
    lengths = lengths_of(mask)
    ok = torch.arange(tokens.shape[1])[None] < lengths[:, None]
    packed = dict(micro_batch_size=args.micro_batch_size, micro_batch_tokens=args.micro_batch_tokens or 24,
                  lengths=lengths)
    shared = {"prompt_groups": PromptGroups(mine["group_ids"], torch.full((len(tokens),), 4))}
    diffs = {}

    def worst(key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        diffs[key] = max(diffs.get(key, 0.0), float((a - b).abs().max()) if a.numel() else 0.0)

    # the tokens of this rank's packed rows, padding included: fewer with the prompts held once
    row_tokens = {name: sum(row.row_len for row in actor.schedule.packed_rows(
        tokens, lengths, packed["micro_batch_tokens"], **kw)) for name, kw in (("off", {}), ("on", shared))}
    if moe:  # the trainer's own routing of every token, recorded per sample in both layouts
        recorded = {}
        for name, kwargs in (("off", packed), ("on", packed | shared)):
            actor.logprobs(tokens, temperature=1.0, routes=RouteUse(record=True), **kwargs)
            recorded[name] = actor.recorded_routes()
        diffs["routes_recorded"] = float(sum(not torch.equal(on[:n], off[:n]) for on, off, n in
                                             zip(recorded["on"], recorded["off"], lengths.tolist())))
    base = actor.logprobs(tokens, temperature=1.0, routes=replay, **packed)
    worst("logprobs", actor.logprobs(tokens, temperature=1.0, routes=replay, **packed, **shared)[ok], base[ok])
    extras = {"response_mask": mask, "advantages": mine["advantages"], "old_logprobs": (base + mine["old"]) * mask,
              "ref_logprobs": (base + mine["ref"]) * mask,
              "row_id": torch.arange(float(len(tokens)))[:, None].expand_as(mask).contiguous()}
    algo = AlgoConfig(name="grpo", kl_coef=0.1, clip_low=0.2, clip_high=0.28, entropy_coef=0.05)
    loss_fn = partial(policy_objective(algo), norm=global_loss_norm(mask, group=groups.dp))
    passes = {}
    for name, kwargs in (("off", packed), ("on", packed | shared)):
        seen = {}

        def recording(logprobs, mb, seen=seen, **kw):  # keeps the entropy per token it saw, by row
            for k, row in enumerate(mb["row_id"][:, 0].long().tolist()):
                seen[row] = kw["entropy"][k].detach().cpu()
            return loss_fn(logprobs, mb, **kw)

        out, stats = actor.schedule.run(tokens, extras, recording, temperature=1.0, forward_only=False, entropy=True,
                                        keep_outputs=True, routes=replay, **kwargs)
        grads = {n: p.main_grad.detach().clone() for n, p in actor.stage.named_parameters()}
        for model in actor.models:
            model.zero_grad_buffer()
        passes[name] = (out, actor.schedule.reduce_stats(stats), grads,
                        torch.stack([seen[r] for r in range(len(tokens))]) if seen else None)
    (out_off, stats_off, grads_off, ent_off), (out_on, stats_on, grads_on, ent_on) = passes["off"], passes["on"]
    if groups.is_pp_last:  # the loss and its outputs live on the last stage
        worst("train_logprobs", out_on.cpu()[ok], out_off.cpu()[ok])
        worst("entropy", ent_on[ok], ent_off[ok])
    for n, g in grads_off.items():
        worst("grads", grads_on[n], g)
    grad_max = max(float(g.abs().max()) for g in grads_off.values())
    values = critic.values(tokens, **packed)
    worst("values", critic.values(tokens, **packed, **shared)[ok], values[ok])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (diffs, grad_max, row_tokens))
    keys = {k for d, _, _ in gathered for k in d}
    return {"max_diff": {k: max(d.get(k, 0.0) for d, _, _ in gathered) for k in keys},
            "grad_max": max(m for _, m, _ in gathered), "row_tokens": [r for _, _, r in gathered],
            "stats_off": stats_off, "stats_on": stats_on,
            "values_max": float(values[ok].abs().max())}


def rank_holding(actor, groups) -> dict:
    """What this rank holds of the actor: its parameters (the routers' expert bias included, as the HF checkpoint
    has it) and, where its stage has MoE layers, the routed experts of its first one: how many, and the rows of
    one's fc1 (gate and up, as split over the expert tensor-parallel ranks)."""
    named = dict(actor.stage.named_parameters())
    fc1 = {}
    for name, param in named.items():
        if ".local_experts." in name and name.endswith("linear_fc1.weight"):
            _, layer, _ = actor.stage.names.lookup(name)
            fc1.setdefault(layer, []).append(param)
    first = fc1[min(fc1)] if fc1 else None
    return {"pp_rank": groups.pp_rank, "params": sum(p.numel() for p in named.values()),
            "experts": first and {"count": len(first), "fc1_rows": first[0].shape[0]}}


def run_case(args: argparse.Namespace) -> None:
    """One layout's run, in Megatron's parallel state for that layout (made here, torn down by the caller)."""
    groups = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp, seed=0)
    optim = OptimConfig(lr=1e-3, grad_clip=1.0, distributed=True)
    megatron = {"virtual_pipeline_model_parallel_size": args.vpp} if args.vpp > 1 else {}
    if args.sequence_parallel:
        megatron["sequence_parallel"] = True
    engine = partial(TrainEngine, model_dir=args.model, shape=read_shape(args.model), dtype="float32", megatron=megatron,
                     groups=groups)
    lora = LoraConfig(rank=4, alpha=8.0) if args.lora else None
    actor = engine(optim=optim, lora=lora)
    reference = engine()
    batch = global_batch(actor.shape.vocab_size)
    per_rank = GLOBAL_BATCH // groups.dp_size
    mine = {k: v[groups.dp_rank * per_rank: (groups.dp_rank + 1) * per_rank] for k, v in batch.items()}
    tokens = mine.pop("tokens")
    micro = dict(micro_batch_size=args.micro_batch_size)
    if args.micro_batch_tokens:
        micro.update(micro_batch_tokens=args.micro_batch_tokens, lengths=lengths_of(mine["response_mask"]))
    kwargs = dict(temperature=1.0, **micro)

    logprobs0 = reference.logprobs(tokens, **kwargs)
    mine["old_logprobs"] = logprobs0 * mine["response_mask"]
    mine["ref_logprobs"] = mine["old_logprobs"]
    if args.redistribute:
        tokens, mine = redistributed(tokens, mine, group=groups.dp)
        if args.micro_batch_tokens:
            micro["lengths"] = lengths_of(mine["response_mask"])
        kwargs = dict(temperature=1.0, **micro)
    trained_rows = [int((batch["tokens"] == row).all(dim=1).nonzero()) for row in tokens]
    norm = global_loss_norm(mine["response_mask"], group=groups.dp)
    # the entropy bonus exercises the vocab-parallel entropy and its gradient under TP
    algo = AlgoConfig(kl_coef=0.1, clip_low=0.2, clip_high=0.28, entropy_coef=0.05)
    loss_fn = partial(policy_objective(algo), norm=norm)
    steps = [actor.train_step(tokens, mine, loss_fn, entropy=True, **kwargs) for _ in range(2)]
    if args.save:
        actor.save_checkpoint(args.save)

    # A critic on the same trunk fits the advantages as returns: its scalar head sits on the last stage
    critic = engine(optim=optim, value_head=True)
    values = critic.values(tokens, **micro) * mine["response_mask"]
    critic_extras = {"response_mask": mine["response_mask"], "values": values, "returns": mine["advantages"]}
    critic_fn = partial(CriticObjective(value_clip=0.01), norm=norm)  # small: clipping is hit
    critic_steps = [critic.train_step(tokens, critic_extras, critic_fn, **kwargs) for _ in range(3)]
    # summed over the real tokens: packed rows have no output past a sequence's end
    real = (torch.arange(tokens.shape[1])[None] < lengths_of(mine["response_mask"])[:, None]).float()
    values_sum = (critic.values(tokens, **micro) * real).sum().reshape(1)
    dist.all_reduce(values_sum, group=groups.dp)  # over the whole global batch
    critic_steps.append({"values_sum": float(values_sum)})

    # Every rank drives the gathers (expert-parallel peers sit in other DP ranks); each must see it all.
    handoff = dict(reference.pipeline_hf_tensors())
    checkpoint = load_file(str(Path(args.model) / "model.safetensors"))
    handoff_exact = set(handoff) == set(checkpoint) and all(torch.equal(handoff[k], v) for k, v in checkpoint.items())
    all_exact = [None] * dist.get_world_size()
    dist.all_gather_object(all_exact, handoff_exact)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (groups.dp_rank, groups.tp_rank, groups.pp_rank, logprobs0.tolist(),
                                      trained_rows))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank_holding(actor, groups))
    tensors = dict(actor.pipeline_hf_tensors()) if groups.dp_rank == 0 or groups.ep_size > 1 else {}
    tensors = {k: v.clone() for k, v in tensors.items()}
    started = time.perf_counter()
    no_balancing = megatron | {"moe_aux_loss_coeff": 0.0}  # what train.share_prompts needs of a MoE model
    shared = shared_prompt_check(actor, critic, groups, args, moe_engines=lambda: (
        engine(optim=optim, megatron=no_balancing), engine(optim=optim, value_head=True, megatron=no_balancing))
    ) if args.share_prompts else None
    if shared is not None:
        shared["seconds"] = time.perf_counter() - started
    resumed = {}
    if args.resume_from:
        # a LoRA checkpoint holds the adapters and their optimizer state: the frozen base comes from model.path
        resumed_actor = engine(optim=optim, lora=lora, load_weights=lora is not None)
        resumed_actor.load_checkpoint(args.resume_from)
        # copies: the handoff yields views of the parameters where no gather was needed
        resumed["loaded"] = {k: v.clone() for k, v in resumed_actor.pipeline_hf_tensors()}
        resumed["step"] = resumed_actor.train_step(tokens, mine, loss_fn, entropy=True, **kwargs)
        resumed["stepped"] = dict(resumed_actor.pipeline_hf_tensors())
    if dist.get_rank() == 0:
        # The full logprobs of the global batch, in DP order, from TP rank 0 of each DP replica.
        by_dp = {dp: lp for dp, tp, pp, lp, _ in gathered if tp == 0 and pp == 0}
        rows_by_dp = {dp: rows for dp, tp, pp, _, rows in gathered if tp == 0 and pp == 0}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        full_lp = [row for dp in sorted(by_dp) for row in by_dp[dp]]
        (out / "result.json").write_text(json.dumps({"steps": steps, "critic_steps": critic_steps,
                                                     "logprobs": full_lp,
                                                     "tokens": batch["tokens"].tolist(),
                                                     "lengths": lengths_of(batch["response_mask"]).tolist(),
                                                     "trained_rows": [rows_by_dp[dp] for dp in sorted(rows_by_dp)],
                                                     "handoff_exact_on_every_rank": all(all_exact),
                                                     "ranks": ranks,
                                                     "resumed_step": resumed.get("step"),
                                                     "shared_prompts": shared}))
        torch.save({k: v.clone() for k, v in tensors.items()}, out / "weights.pt")
        if resumed:
            torch.save({"loaded": resumed["loaded"], "stepped": resumed["stepped"]}, out / "resumed.pt")
    dist.barrier()


def run_cases(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], None]) -> None:
    """`--cases FILE`: `run` each argument list of that JSON file in turn, one job for many layouts of one world
    size (a launch costs every rank its imports); otherwise the command line is one case."""
    from megatron.core import parallel_state as ps

    cases = argparse.ArgumentParser(add_help=False)
    cases.add_argument("--cases")
    known, rest = cases.parse_known_args()
    for argv in json.loads(Path(known.cases).read_text()) if known.cases else [rest]:
        run(parser.parse_args(argv))
        ps.destroy_model_parallel()  # the next case initializes its own layout on the same ranks
    dist.destroy_process_group()


if __name__ == "__main__":
    run_cases(case_parser(), run_case)
