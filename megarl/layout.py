"""The parallel layout of a job: one value, built and checked in one place.

`Layout.of(cfg, shape, world=..., ranks_per_node=...)` is how every part of megarl learns whether a recipe can
run on a job of `world` ranks, `ranks_per_node` to a node: the launch of every loop (megarl.loops.launch, with
the ranks torchrun started), the rollout ranks of placement split (megarl.loops.split) and `megarl plan` (with
--nodes * --gpus-per-node and --gpus-per-node). Because they all ask here, a layout that plans is a layout that
launches, with the same error. The rules, in the order they are checked:

1. Placement split: the job's last `placement.rollout_ranks` ranks only generate, so at least one rank must
   be left to train; Megatron's world is the rest (the training world), and everything below divides it.
2. The model splits: the world by tp*pp*cp, heads, query groups and MLP widths by tp, layers by pp (and by
   pp * virtual stages), experts by ep, their MLP width by etp and the expert grid etp*ep*pp by the world
   (`check_layout`). A distillation teacher (`teacher.path`) is built at the same layout, so its own shape must
   split the same way.
3. The batch splits: `data.prompts_per_step` by the data-parallel size, each rank's sequences (RL's samples,
   SFT's rows, DPO's chosen and rejected) by `train.micro_batch_size` (not with sequence packing, whose
   micro-batches are cut by tokens), and with virtual stages the micro-batch count fits Megatron's
   interleaved schedule. RL's supervised warm start splits `warmup.batch_size` the same way.
4. The rollout engines (RL only): one on every group of `rollout.tp` consecutive generating ranks, so
   rollout.tp divides the world. An SGLang engine splits the model over its rollout.tp GPUs: rollout.tp
   divides the heads and MLP width, the KV heads or is a multiple of them, and the engine fits in one node
   (rollout.tp divides the ranks per node) or spans whole nodes (a multiple of them; colocated placement,
   where each node's share of the engine runs beside the trainer ranks there: megarl.rollout.placement). The
   native engine holds a whole model on one rank of its group and needs neither.

Every error is a LayoutError naming the recipe keys and both numbers; launch reports it as a recipe error
(exit code 2), `megarl plan` as a plan error (exit code 2), with the same text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config import Config, RecipeError
from megarl.models.arch import ModelShape

VPP_KEY = "model.megatron.virtual_pipeline_model_parallel_size"


class LayoutError(RecipeError):
    """A parallel layout this job cannot run; the message names the recipe keys and both numbers."""


@dataclass(frozen=True)
class Layout:
    """Where a recipe's work goes in a job of world + rollout_ranks ranks; dp and expert_dp are what the
    training world leaves."""

    world: int  # Megatron's world: ranks 0 ... world - 1 train (every rank, unless placement split)
    rollout_ranks: int  # placement split: ranks world ... world + rollout_ranks - 1 only generate; else 0
    ranks_per_node: int  # torchrun's LOCAL_WORLD_SIZE; `megarl plan`'s --gpus-per-node
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int  # expert tensor-parallel size: parallel.etp, or parallel.tp where that is null
    dp: int  # world / (tp * pp * cp)
    expert_dp: int  # world / (etp * ep * pp)
    vpp: int  # virtual pipeline stages per pipeline rank (1 = none)
    micro_batches: int  # per data-parallel rank per optimizer step, of train.micro_batch_size sequences
    rollout_tp: int  # ranks per rollout engine
    engine_nodes: int = 1  # nodes each rollout engine spans (an SGLang engine larger than a node); else 1

    @property
    def job_world(self) -> int:
        """Every rank of the job, training and generating."""
        return self.world + self.rollout_ranks

    @property
    def engine_ranks(self) -> list[int]:
        """The rank that hosts each rollout engine: the first of every group of rollout_tp consecutive ranks
        of the generating ones (the whole job, or with placement split its last rollout_ranks ranks)."""
        first = self.world if self.rollout_ranks else 0
        return [span.start for span in engine_spans(range(first, self.job_world), self.rollout_tp)]

    @classmethod
    def of(cls, cfg: Config, shape: ModelShape, *, world: int, ranks_per_node: int,
           teacher: ModelShape | None = None) -> Layout:
        """The layout of recipe `cfg` for model `shape` (and the distillation teacher's `teacher`, when the
        recipe has one) on a job of `world` ranks, `ranks_per_node` to a node; LayoutError when one of the
        rules of this module's docstring fails."""
        par, megatron = cfg.parallel, cfg.model.megatron
        rollout_ranks = cfg.placement.rollout_ranks if cfg.placement.mode == "split" else 0
        if rollout_ranks >= world:
            raise LayoutError(f"placement.rollout_ranks = {rollout_ranks} leaves no training rank in a job of "
                              f"{world} ranks")
        trainers = world - rollout_ranks
        # where the training world comes from, for the messages
        size = f"training world size {trainers}" if rollout_ranks else f"world size {trainers}"
        why = f"; placement.rollout_ranks {rollout_ranks} of the {world} ranks only generate" if rollout_ranks else ""

        vpp = virtual_stages(megatron, layers=shape.layers, pp=par.pp)
        try:
            check_layout(shape, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, etp=par.etp, world_size=trainers,
                         vpp=vpp, sequence_parallel=bool(megatron.get("sequence_parallel")))
        except LayoutError as e:
            if not rollout_ranks:
                raise
            raise LayoutError(f"{e} (training world size = {world} ranks - placement.rollout_ranks "
                              f"{rollout_ranks})") from None
        if teacher is not None:
            check_teacher_layout(teacher, cfg, world=trainers, vpp=vpp)
        dp = trainers // (par.tp * par.pp * par.cp)
        dp_from = f"{size} / (parallel.tp * parallel.pp * parallel.cp){why}"

        prompts, micro = cfg.data.prompts_per_step, cfg.train.micro_batch_size
        _divides(prompts, dp, f"data.prompts_per_step {prompts}", f"the data-parallel size {dp} ({dp_from})")
        # sequences per prompt: RL's samples, SFT's row, a pair's chosen and rejected (DPO, RM)
        if cfg.algo.traits.pairs:
            per_prompt, what, times = 2, "sequences", " * 2 (chosen and rejected)"
        elif cfg.algo.traits.offline:
            per_prompt, what, times = 1, "sequences", ""
        else:
            per_prompt, what, times = cfg.rollout.n_samples, "samples", " * rollout.n_samples"
        sequences = prompts // dp * per_prompt
        micro_batches = -(-sequences // micro)
        if not cfg.train.micro_batch_tokens:  # packed micro-batches are cut by tokens: any count of sequences
            named_dp = f", data-parallel size {dp} = {dp_from}" if rollout_ranks else ""
            _divides(sequences, micro, f"{what} per data-parallel rank {sequences} (data.prompts_per_step / {dp}"
                     f"{times}{named_dp})", f"train.micro_batch_size = {micro}")
            check_schedule(micro_batches, megatron, pp=par.pp, vpp=vpp, what="micro-batches per data-parallel rank")

        if not cfg.algo.traits.offline:
            if cfg.warmup.sft_steps:
                rows = cfg.warmup.batch_size
                _divides(rows, dp, f"warmup.batch_size {rows}", f"the data-parallel size {dp} ({dp_from})")
                # the warm start's micro-batches hold gcd(rows per rank, train.micro_batch_size) rows
                per_rank = rows // dp
                check_schedule(per_rank // math.gcd(per_rank, micro), megatron, pp=par.pp, vpp=vpp,
                               what="warm-start micro-batches per data-parallel rank")
            check_rollout(cfg, shape, world=world, ranks_per_node=ranks_per_node)

        etp = par.tp if par.etp is None else par.etp
        return cls(world=trainers, rollout_ranks=rollout_ranks, ranks_per_node=ranks_per_node, tp=par.tp,
                   pp=par.pp, cp=par.cp, ep=par.ep, etp=etp, dp=dp, expert_dp=trainers // (etp * par.ep * par.pp),
                   vpp=vpp, micro_batches=micro_batches, rollout_tp=cfg.rollout.tp,
                   engine_nodes=engine_nodes(cfg, ranks_per_node=ranks_per_node))


def engine_spans(ranks: range, rollout_tp: int) -> list[range]:
    """The ranks of each rollout engine among the generating `ranks`: groups of `rollout_tp` consecutive ranks,
    the first of each its host (rule 4). The one place megarl does this arithmetic."""
    return [range(start, min(start + rollout_tp, ranks.stop)) for start in range(ranks.start, ranks.stop, rollout_tp)]


def check_teacher_layout(teacher: ModelShape, cfg: Config, *, world: int, vpp: int) -> None:
    """Rule 2 for the distillation teacher: it runs in the trainer's parallel state, so its heads, query
    groups, MLP width and layers split by the same tp, pp and virtual stages (its experts by ep and etp, when
    it has experts; a dense teacher beside a mixture-of-experts student ignores them)."""
    par = cfg.parallel
    try:
        check_layout(teacher, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep if teacher.is_moe else 1,
                     etp=par.etp if teacher.is_moe else None, world_size=world, vpp=vpp,
                     sequence_parallel=bool(cfg.model.megatron.get("sequence_parallel")))
    except LayoutError as e:
        raise LayoutError(f"teacher.path ({teacher.arch}, the distillation teacher, built at the trainer's layout): "
                          f"{e}") from None


def _divides(number: int, divisor: int, what: str, by: str) -> None:
    if divisor <= 0 or number % divisor:
        raise LayoutError(f"{what} is not divisible by {by}")


def engine_nodes(cfg: Config, *, ranks_per_node: int) -> int:
    """The nodes each rollout engine spans: rollout.tp / ranks per node for an SGLang engine larger than a node
    (check_rollout makes it whole), else 1 (the native engine lives in its host's process)."""
    rtp = cfg.rollout.tp
    return rtp // ranks_per_node if cfg.rollout.engine == "sglang" and rtp > ranks_per_node else 1


def check_rollout(cfg: Config, shape: ModelShape, *, world: int, ranks_per_node: int) -> None:
    """Rule 4 of the module docstring: the engines of an RL recipe on a job of `world` ranks."""
    rtp = cfg.rollout.tp
    if cfg.rollout.engine == "sglang":  # SGLang splits the model over the engine's rollout.tp GPUs
        _divides(shape.heads, rtp, f"attention heads {shape.heads}", f"rollout.tp = {rtp}")
        if shape.kv_heads % rtp and rtp % shape.kv_heads:
            raise LayoutError(f"key/value heads {shape.kv_heads} and rollout.tp = {rtp}: neither divides the "
                              "other (SGLang splits the KV heads over its TP ranks or replicates them)")
        ffn, name = (shape.moe_ffn, "expert MLP width") if shape.is_moe else (shape.ffn, "MLP width")
        _divides(ffn, rtp, f"{name} {ffn}", f"rollout.tp = {rtp}")
        if rtp <= ranks_per_node:
            _divides(ranks_per_node, rtp, f"GPUs per node {ranks_per_node}",
                     f"rollout.tp = {rtp}: an engine's GPUs must be on one node or span whole nodes")
        else:  # an engine that spans nodes: SGLang's nnodes, each node's part started beside its trainer ranks
            _divides(rtp, ranks_per_node, f"rollout.tp = {rtp}",
                     f"the {ranks_per_node} GPUs of a node: an engine's GPUs must be on one node or span whole "
                     "nodes")
            if cfg.placement.mode == "split":
                raise LayoutError(f"rollout.tp = {rtp} is more than the {ranks_per_node} GPUs of a node, with "
                                  "placement.mode = 'split': an engine spans nodes only in colocated placement")
    if cfg.placement.mode != "split":  # split: placement.rollout_ranks is a multiple of rollout.tp (Config)
        _divides(world, rtp, f"world size {world}", f"rollout.tp = {rtp}: every rank belongs to one rollout engine")


def virtual_stages(megatron: dict, *, layers: int, pp: int) -> int:
    """Virtual pipeline stages per pipeline rank from `model.megatron` (1 when not set). Megatron's training
    scripts spell it `num_layers_per_virtual_pipeline_stage`; TransformerConfig only knows the stage count."""
    if "num_layers_per_virtual_pipeline_stage" in megatron:
        per = megatron["num_layers_per_virtual_pipeline_stage"]
        hint = f" (= layers / (pp * {per}) = {layers / (pp * per):g})" if per else ""
        raise LayoutError("model.megatron.num_layers_per_virtual_pipeline_stage is not a TransformerConfig field: "
                          f"set virtual_pipeline_model_parallel_size{hint}")
    return virtual_stage_count(megatron)


def virtual_stage_count(megatron: dict) -> int:
    """`model.megatron.virtual_pipeline_model_parallel_size`, 1 when not set; LayoutError unless a whole
    number >= 1."""
    vpp = megatron.get("virtual_pipeline_model_parallel_size")
    if vpp is None:
        return 1
    if type(vpp) is not int or vpp < 1:
        raise LayoutError(f"{VPP_KEY} = {vpp!r}: the number of virtual pipeline stages per pipeline rank must be "
                          "a whole number >= 1")
    return vpp


def check_schedule(micro_batches: int, megatron: dict, *, pp: int, vpp: int, what: str) -> None:
    """With virtual stages Megatron's interleaved schedule runs micro-batches in groups of g =
    `model.megatron.microbatch_group_size_per_vp_stage` (default pp) through each chunk: it needs at least g
    of them and a last group of 0 or at least pp (megatron.core.pipeline_parallel.schedules refuses others)."""
    if vpp == 1:
        return
    group = megatron.get("microbatch_group_size_per_vp_stage") or pp
    if group == pp:
        _divides(micro_batches, pp, f"{what} {micro_batches}", f"parallel.pp = {pp} (interleaved pipeline schedule)")
    elif micro_batches < group or 0 < micro_batches % group < pp:
        raise LayoutError(f"{what} {micro_batches} cannot run on the interleaved pipeline schedule ({VPP_KEY} = "
                          f"{vpp}): it needs at least model.megatron.microbatch_group_size_per_vp_stage = {group} "
                          f"and a remainder modulo {group} of 0 or at least parallel.pp = {pp}")


def check_layout(shape: ModelShape, *, tp: int, pp: int, cp: int, world_size: int, ep: int = 1,
                 etp: int | None = None, sequence_parallel: bool = False, vpp: int = 1) -> None:
    """The parallel layout must split this model and this world evenly; LayoutError says which number
    does not divide which (keys as in the recipe's `parallel:` section).

    Expert parallelism splits the experts over `ep` ranks and each expert's linears over `etp` (None: tp, as
    the recipe's null parallel.etp means); Megatron lays those ranks out inside each pipeline stage, so
    etp * ep * pp must divide the world as well. Shared experts are split like the dense MLP, over tp. `vpp` is
    the number of virtual pipeline stages (`check_virtual_stages`).
    """
    check_virtual_stages(vpp, layers=shape.layers, pp=pp)
    etp_key, etp = ("parallel.tp", tp) if etp is None else ("parallel.etp", etp)
    if ep > 1 and not shape.is_moe:
        raise LayoutError(f"parallel.ep = {ep} needs a mixture-of-experts model; {shape.arch} has no experts")
    if etp != tp and not shape.is_moe:
        raise LayoutError(f"parallel.etp = {etp} needs a mixture-of-experts model; {shape.arch} has no experts")
    if shape.is_moe and tp > 1 and not sequence_parallel:
        # Megatron refuses to train MoE layers under tensor parallelism without it (its MoE layer checks
        # at the first training step); on CPU too, where megarl's RMSNorm carries sequence parallelism
        raise LayoutError(f"parallel.tp = {tp} with a mixture-of-experts model ({shape.arch}) needs "
                          f"model.megatron.sequence_parallel: true")
    if shape.is_moe and etp != tp and ep == 1:
        # Megatron's expert linears reduce their gradients over the expert data-parallel ranks only with ep > 1
        # (they are `allreduce` weights otherwise, reduced over the data-parallel ranks); with ep = 1 and
        # etp != tp those are other ranks, and the experts' gradients would come out wrong
        raise LayoutError(f"parallel.etp = {etp} differs from parallel.tp = {tp} with parallel.ep = 1: Megatron "
                          "reduces the experts' gradients over their own data-parallel ranks only under expert "
                          "parallelism; set parallel.ep > 1, or leave parallel.etp unset")
    checks = [
        (world_size, tp * pp * cp, f"world size {world_size}",
         f"parallel.tp * parallel.pp * parallel.cp = {tp * pp * cp}"),
        (shape.heads, tp, f"attention heads {shape.heads}", f"parallel.tp = {tp}"),
        (shape.kv_heads, tp, f"key/value heads (query groups) {shape.kv_heads}", f"parallel.tp = {tp}"),
        (shape.ffn, tp, f"MLP width {shape.ffn}", f"parallel.tp = {tp}"),
        (shape.layers, pp, f"layers {shape.layers}", f"parallel.pp = {pp}"),
    ]
    if shape.is_moe:
        checks += [
            (shape.experts, ep, f"experts {shape.experts}", f"parallel.ep = {ep}"),
            (world_size, etp * ep * pp, f"world size {world_size}",
             f"{etp_key} * parallel.ep * parallel.pp = {etp * ep * pp}"),
            (shape.moe_ffn, etp, f"expert MLP width {shape.moe_ffn}", f"{etp_key} = {etp}"),
            (shape.shared_ffn, tp, f"shared expert MLP width {shape.shared_ffn}", f"parallel.tp = {tp}"),
        ]
    for number, divisor, what, by in checks:
        _divides(number, divisor, what, by)


def check_virtual_stages(vpp: int, *, layers: int, pp: int) -> None:
    """Virtual pipeline stages (`model.megatron.virtual_pipeline_model_parallel_size`) cut each of the pp
    pipeline stages into vpp model chunks that the interleaved schedule visits in turn: it needs pp >= 2
    and the same number of layers in every one of the pp * vpp chunks. LayoutError names the numbers."""
    if vpp == 1:
        return
    if vpp < 1:
        raise LayoutError(f"{VPP_KEY} = {vpp} must be at least 1")
    if pp < 2:
        raise LayoutError(f"{VPP_KEY} = {vpp} needs parallel.pp >= 2, got parallel.pp = {pp}")
    if layers % (pp * vpp):
        raise LayoutError(f"layers {layers} is not divisible by parallel.pp * {VPP_KEY} = {pp} * {vpp} = {pp * vpp}")
