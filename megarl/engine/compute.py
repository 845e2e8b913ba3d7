"""The forward and backward passes of a train engine: micro-batches (padded, or packed by token budget)
through Megatron's pipeline schedule, token logprobs and entropy from vocabulary-parallel logits, values
of a scalar head, and the loss function's statistics reduced over the pipeline and data-parallel ranks.

Sequences are [B, T] token ids, right padded. Outputs are aligned with the tokens: `logprobs[b, t]` is
log p(tokens[b, t] | tokens[b, :t]) at the sampling temperature, and column 0 is 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megarl.device import current_device, on_gpu
from megarl.engine.context_parallel import gather_sequence, split_sequence
from megarl.engine.model import StageModel
from megarl.engine.router_replay import ModelRouting
from megarl.packing import (PackedRow, PromptGroups, count_bins, first_own_predictions, pack, pack_shared,
                            packed_row, plan_micro_batches, prompt_units, sequence_positions, shared_keys, shared_row,
                            unit_tokens, unpack, unpack_shared, with_prompt_routes)
from megarl.routing import RouteUse

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

# A loss function sees one micro-batch: the head's output [b, T] (logprobs, or values of a critic) and
# that micro-batch's slice of every extra tensor; it returns its contribution to the global loss and to
# each summed statistic.
LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the schedule feeds it: the model's inputs, the rows its loss function sees and
    where those rows sit in the batch.

    Padded rows reach the model as they are, [b, T / cp] (this context-parallel rank's share of each
    row); packed rows as one row [1, row_len] of their sequences back to back (`packed`).
    """

    index: Tensor                       # [b] long: the rows of the batch in this micro-batch
    ids: Tensor                         # [b, T / cp] or [1, row_len]: the model's input token ids
    labels: Tensor                      # shaped like ids: the token after each position
    positions: Tensor                   # shaped like ids: position ids
    rows: dict[str, Tensor]             # "tokens" [b, T] and each extra tensor's rows [b, ...], on the device
    packed: PackedRow | None = None     # the packed layout; None for padded rows
    packed_params: PackedSeqParams | None = None  # the same layout as Megatron's attention takes it

    @classmethod
    def of_rows(cls, tokens: Tensor, extras: dict[str, Tensor], index: Tensor, packed: PackedRow | None, *,
                cp: int, cp_rank: int, device) -> MicroBatch:
        """Rows `index` of `tokens` [B, T] and of every extra tensor, padded as they are (`packed` None) or
        packed into the row `packed`; padded rows are split over `cp` context-parallel ranks."""
        rows = {"tokens": tokens[index].to(device), **{k: v[index].to(device) for k, v in extras.items()}}
        if packed is None:
            # the token after each position, taken before the split: a context-parallel rank's last
            # position of a chunk predicts a token that another rank holds
            labels = F.pad(rows["tokens"][:, 1:], (0, 1))
            positions = split_sequence(torch.arange(tokens.shape[1], device=device)[None], cp=cp, rank=cp_rank)
            return cls(index=index, ids=split_sequence(rows["tokens"], cp=cp, rank=cp_rank),
                       labels=split_sequence(labels, cp=cp, rank=cp_rank),
                       positions=positions.expand(len(index), -1), rows=rows)
        from megatron.core.packed_seq_params import PackedSeqParams

        from megarl.engine.local_attention import SharedPromptParams

        ids, positions = pack(tokens, packed) if packed.shared is None else pack_shared(tokens, packed)
        labels = F.pad(ids[:, 1:], (0, 1))  # the token after each position of the row
        layout = dict(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens.to(device),
                      cu_seqlens_kv=packed.cu_seqlens.to(device), max_seqlen_q=packed.max_seqlen,
                      max_seqlen_kv=packed.max_seqlen)
        if packed.shared is None:
            params = PackedSeqParams(**layout)
        else:
            keys = shared_keys(packed.cu_seqlens, packed.shared.prefix_of)
            params = SharedPromptParams(**layout, prefix_of=packed.shared.prefix_of.to(device),
                                        keys=replace(keys, index=keys.index.to(device),
                                                     cu_seqlens=keys.cu_seqlens.to(device)))
        return cls(index=index, ids=ids.to(device), labels=labels.to(device), positions=positions.to(device),
                   rows=rows, packed=packed, packed_params=params)


class PipelineSchedule:
    """Runs micro-batches of one model (`stage`, trained through `models`: its chunks, DDP-wrapped when the
    engine trains) through Megatron's forward-backward schedule for this rank's pipeline stage."""

    def __init__(self, stage: StageModel, models: list, routing: ModelRouting | None = None):
        self.stage = stage
        self.models = models
        self.routing = routing  # MoE: the routers' replay hooks (megarl.engine.router_replay)

    def run(self, tokens: Tensor, extras: dict[str, Tensor], loss_fn: LossFn | None, *, temperature: float,
             micro_batch_size: int, forward_only: bool, entropy: bool = False, lengths: Tensor | None = None,
             micro_batch_tokens: int | None = None, keep_outputs: bool = False, routes: RouteUse | None = None,
             prompt_groups: PromptGroups | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Run the pipeline schedule over micro-batches.

        The head's output per token, [b, T] (logprobs of an LM, values of a critic), goes to `loss_fn`
        (with `entropy=` [b, T] as well when asked). Returns (the outputs [B, T], detached, when `loss_fn` is
        None, `forward_only` or `keep_outputs`, on the last pipeline stage, else None; the loss function's
        statistics summed over micro-batches).

        Micro-batches hold `micro_batch_size` padded rows (the last one fewer when they do not divide the
        batch, on one pipeline stage), or, with `micro_batch_tokens`, are packed rows of at most that many
        tokens (`lengths` [B], the real tokens of each row of `tokens`, is then required; see
        `packed_rows`). Loss functions see [b, T] tensors either way; packed outputs are 0 past each
        sequence's end.

        `routes` (MoE models) gives the routers each sample's experts to compare with, or to replay; with
        `routes.record` the trainer's own routing is kept per sample (`ModelRouting.recorded`).

        `prompt_groups` (packed rows only): a group's samples with equal prompts hold the prompt once in their
        row (megarl.packing.shared_row); the outputs are those of the samples run alone.
        """
        routes = routes or RouteUse()
        batch, seq_len = tokens.shape
        self._check_inputs(tokens, routes, micro_batch_tokens=micro_batch_tokens, prompt_groups=prompt_groups)
        if prompt_groups is not None and routes.routes is not None:
            prompt_groups = with_prompt_routes(prompt_groups, routes.routes)
        if not micro_batch_tokens:
            tokens, extras = self._pad_columns(tokens, extras)
        micro = self.micro_batches(tokens, extras, lengths=lengths, micro_batch_size=micro_batch_size,
                                   micro_batch_tokens=micro_batch_tokens, prompt_groups=prompt_groups)
        self._check_micro_batch_count(len(micro), batch=batch, micro_batch_size=micro_batch_size)
        one_pass = SchedulePass(self, loss_fn, temperature=temperature, entropy=entropy, seq_len=seq_len,
                                width=tokens.shape[1], loss_scale=self.loss_scale(len(micro)),
                                keep_outputs=forward_only or keep_outputs, routes=routes.routes)
        # the shape of the activations pipeline stages exchange: rows x seq_length tokens
        if micro_batch_tokens:
            seq_length, rows = max(m.packed.row_len for m in micro), 1
        else:
            seq_length, rows = tokens.shape[1], micro_batch_size
        self._run_schedule(one_pass, micro, seq_length=seq_length, rows=rows, forward_only=forward_only,
                           routes=routes)
        if routes.record:
            self.routing.recorded = self._recorded_routes(micro, batch, seq_len)
        return one_pass.outputs(batch), one_pass.stat_sums

    def _check_inputs(self, tokens: Tensor, routes: RouteUse, *, micro_batch_tokens: int | None,
                      prompt_groups: PromptGroups | None = None) -> None:
        """Refuse what the schedule cannot run, naming the setting to change."""
        batch, seq_len = tokens.shape
        cp = self.stage.groups.cp_size
        if prompt_groups is not None:
            check_shared_prompts(micro_batch_tokens=micro_batch_tokens, config=self.stage.config)
        if cp > 1 and micro_batch_tokens:
            raise ValueError(f"sequence packing (train.micro_batch_tokens = {micro_batch_tokens}) cannot be combined "
                             f"with context parallelism (parallel.cp = {cp}); turn one of them off")
        window = self.stage.shape.sliding_window
        if window is not None and seq_len > window:
            # Megatron's attention here is full causal, which is the checkpoint's sliding-window attention
            # only while a sequence fits in the window (transformers masks nothing more until then).
            raise ValueError(f"sequence length {seq_len} exceeds the checkpoint's sliding_window {window}: "
                             "sliding-window attention is not supported beyond the window")
        if (routes.routes is not None or routes.record) and self.routing is None:
            raise ValueError("MoE routes were given to a model without mixture-of-experts routers")
        if routes.routes is not None and len(routes.routes) != batch:
            raise ValueError(f"routes for {len(routes.routes)} samples, batch of {batch}")

    def _pad_columns(self, tokens: Tensor, extras: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """`tokens` [B, T] and the [B, T] extras padded to a width that splits evenly: sequence parallelism
        splits every row over TP ranks, context parallelism into 2 * cp chunks. The padding is masked, so no
        loss sees it, and the outputs are cut back to T."""
        seq_len = tokens.shape[1]
        cp = self.stage.groups.cp_size
        multiple = (self.stage.groups.tp_size if self.stage.config.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        if seq_len % multiple == 0:
            return tokens, extras
        width = -(-seq_len // multiple) * multiple

        def grow(t: Tensor) -> Tensor:
            return F.pad(t, (0, width - seq_len)) if t.dim() == 2 and t.shape[1] == seq_len else t

        return grow(tokens), {k: grow(v) for k, v in extras.items()}

    def micro_batches(self, tokens: Tensor, extras: dict[str, Tensor], *, lengths: Tensor | None,
                      micro_batch_size: int, micro_batch_tokens: int | None,
                      prompt_groups: PromptGroups | None = None) -> list[MicroBatch]:
        """The batch's rows in micro-batches: packed rows of at most `micro_batch_tokens` tokens (`packed_rows`),
        or `micro_batch_size` padded rows each."""
        groups = self.stage.groups
        if micro_batch_tokens:
            return [MicroBatch.of_rows(tokens, extras, row.index, row, cp=groups.cp_size, cp_rank=groups.cp_rank,
                                       device=current_device())
                    for row in self.packed_rows(tokens, lengths, micro_batch_tokens, prompt_groups=prompt_groups)]
        batch = tokens.shape[0]
        # Pipeline stages exchange activations of one fixed shape, so with pp > 1 every micro-batch holds
        # micro_batch_size rows; one stage takes a smaller last one (a step on part of a batch).
        if batch % micro_batch_size != 0 and groups.pp_size > 1:
            raise ValueError(f"batch of {batch} sequences is not divisible by micro_batch_size "
                             f"{micro_batch_size}, which pipeline parallelism needs")
        return [MicroBatch.of_rows(tokens, extras, torch.arange(start, min(start + micro_batch_size, batch)), None,
                                   cp=groups.cp_size, cp_rank=groups.cp_rank, device=current_device())
                for start in range(0, batch, micro_batch_size)]

    def _check_micro_batch_count(self, n_micro: int, *, batch: int, micro_batch_size: int) -> None:
        if self.schedulable(n_micro) == n_micro:
            return
        group = self.stage.config.microbatch_group_size_per_vp_stage
        config, pp = self.stage.config, self.stage.groups.pp_size
        raise ValueError(
            f"{batch} sequences in micro-batches of {micro_batch_size} (train.micro_batch_size) make {n_micro} "
            "micro-batches; the interleaved pipeline schedule (model.megatron.virtual_pipeline_model_parallel_"
            f"size = {config.virtual_pipeline_model_parallel_size}) needs at least {group} and a count "
            f"whose remainder modulo {group} (model.megatron.microbatch_group_size_per_vp_stage, default "
            f"parallel.pp) is 0 or at least parallel.pp = {pp}, e.g. {self.schedulable(n_micro)}")

    def loss_scale(self, n_micro: int) -> float:
        """The factor on each micro-batch's loss that makes the gradient exactly that of the global loss.

        Megatron divides each micro-batch loss by the number of micro-batches and DDP averages over DP
        ranks; loss functions here already return contributions normalized by global counts, so the
        scale undoes both averages. Context parallelism changes nothing here: every CP rank computes the
        loss of the whole sequences (their outputs are gathered) and back-propagates it through its own
        positions only, so the CP ranks' gradients add up to the full one; DDP averages over DP x CP ranks
        and the schedule multiplies each loss by cp to match.

        The MoE load-balancing loss is not scaled here: each router attaches coeff * aux_loss of its
        micro-batch to the autograd graph (MoEAuxLossAutoScaler), and the schedule scales its gradient by
        1 / n_micro, then DDP by 1 / dp. Its gradient is therefore that of coeff * (mean over the global
        batch's micro-batches of each layer's aux loss), summed over layers: the same for every layout
        that keeps the micro-batches (packing changes them), and part of grad_norm but not of the loss.
        """
        return float(n_micro * self.stage.groups.dp_size)

    def _run_schedule(self, one_pass: SchedulePass, micro: list[MicroBatch], *, seq_length: int, rows: int,
                      forward_only: bool, routes: RouteUse) -> None:
        """Megatron's forward-backward schedule over `micro`, with messages between pipeline stages of
        `rows` x `seq_length` tokens; the routers' hooks (MoE) armed for the pass."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for model in self.models:
            if model.training == forward_only:  # train() walks every submodule: only when the mode changes
                model.train(not forward_only)
        vpp = self.stage.config.virtual_pipeline_model_parallel_size
        # Every chunk reads every micro-batch in order (positions and packing for all, tokens for the first,
        # the loss inputs for the last). The virtual stage count is passed, not read from parallel_state.
        if self.routing is not None:
            self.routing.begin(routes)
        get_forward_backward_func(pp_size=self.stage.groups.pp_size, vp_size=vpp)(
            forward_step_func=one_pass.forward_step, data_iterator=[iter(micro) for _ in self.models],
            model=self.models, num_microbatches=len(micro), seq_length=seq_length, micro_batch_size=rows,
            forward_only=forward_only,
        )
        if self.routing is not None:
            self.routing.end()

    def _recorded_routes(self, micro: list[MicroBatch], batch: int, seq_len: int) -> list[Tensor]:
        """The trainer's own routing of each sample [seq_len or its length, moe_layers, top_k] (long), every
        layer on every pipeline stage, from the hooks' records of the micro-batches `micro`."""
        recorded: list[Tensor | None] = [None] * batch
        for m, mb in enumerate(micro):
            if len(mb.index) == 0:  # a packed micro-batch of padding only
                continue
            rows = self.routing.recorded_micro_batch(m, rows=len(mb.index) if mb.packed is None else 1).cpu()
            if mb.packed is None:
                for j, i in enumerate(mb.index.tolist()):
                    recorded[i] = rows[j, :seq_len]
            else:
                for i, where in zip(mb.packed.index.tolist(), sequence_positions(mb.packed)):
                    recorded[i] = rows[0, where]  # a shared prompt's routing is each of its samples
        return self.routing.combine_stages(recorded)

    def packed_rows(self, tokens: Tensor, lengths: Tensor | None, max_tokens: int, *,
                    prompt_groups: PromptGroups | None = None) -> list[PackedRow]:
        """The rows of `tokens` [B, T] (`lengths` [B] real tokens each) packed into micro-batches of at most
        `max_tokens` tokens, as many on every data-parallel rank. With `prompt_groups`, the units packed are
        `prompt_units` (a group's prompt once, then its samples' own tokens) instead of single sequences.

        The count is the largest first-fit-decreasing bin count over DP ranks (Megatron's DDP and pipeline
        schedules need one count everywhere), raised until the token-balanced split fits the budget on
        every rank. With pipeline stages every row is padded to the step's longest, so every message
        between stages has one shape.
        """
        if lengths is None:
            raise ValueError("packed micro-batches (micro_batch_tokens) need the sequence lengths")
        lens = [int(n) for n in lengths]
        if max(lens) > tokens.shape[1]:
            raise ValueError(f"a length {max(lens)} exceeds the {tokens.shape[1]} columns of the batch")
        units = None
        if prompt_groups is not None:
            units = prompt_units(tokens, lengths, prompt_groups, max_tokens=max_tokens)
            lens = [unit_tokens(unit, lengths, prompt_groups.prompt_lens) for unit in units]
        n_micro = self.schedulable(self._dp_reduce(count_bins(lens, max_tokens), dist.ReduceOp.MAX))
        while True:
            plan = plan_micro_batches(lens, max_tokens=max_tokens, n_micro=n_micro)
            # one more micro-batch helps; with one per sequence every plan fits, so this ends
            if self._dp_reduce(int(plan is None), dist.ReduceOp.MAX) == 0:
                break
            n_micro = self.schedulable(n_micro + 1)
        row_lens = [max(1, sum(lens[i] for i in part)) for part in plan]
        if self.stage.groups.pp_size > 1:
            row_lens = [max(row_lens)] * len(plan)
        if self.stage.config.sequence_parallel:
            # sequence parallelism splits the row evenly over TP ranks
            tp = self.stage.groups.tp_size
            row_lens = [-(-n // tp) * tp for n in row_lens]
        if units is not None:
            return [shared_row([units[u] for u in part], lengths, prompt_groups.prompt_lens, row_len=row_len)
                    for part, row_len in zip(plan, row_lens)]
        return [packed_row(part, lengths, row_len=row_len) for part, row_len in zip(plan, row_lens)]

    def schedulable(self, n_micro: int) -> int:
        """The smallest micro-batch count from `n_micro` up that the pipeline schedule runs. Any count runs
        without virtual stages. The interleaved schedule runs micro-batches in groups of g =
        `microbatch_group_size_per_vp_stage` (default pp) through each chunk: at least g of them, and a last
        group of 0 or at least pp (a shorter one would leave stages waiting on each other)."""
        if self.stage.config.virtual_pipeline_model_parallel_size is None:
            return n_micro
        group, pp = self.stage.config.microbatch_group_size_per_vp_stage, self.stage.groups.pp_size
        n_micro = max(n_micro, group)
        while 0 < n_micro % group < pp:
            n_micro += 1
        return n_micro

    def _dp_reduce(self, value: int, op) -> int:
        if self.stage.groups.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=current_device())
        dist.all_reduce(t, op=op, group=self.stage.groups.dp)
        return int(t)

    def token_logprobs(self, logits: Tensor, labels: Tensor, *, temperature: float, entropy: bool
                        ) -> tuple[Tensor, dict[str, Tensor]]:
        """logits [b, s, V/tp] and labels [b, s] (the token after each position) -> (logprobs of the labels
        [b, s], {"entropy": [b, s]} of the next-token distribution when asked), position by position."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        scaled = self._mask_vocab_padding(logits.float() / temperature)
        if not entropy and not on_gpu() and self.stage.groups.tp_size == 1:
            # The same logprobs (4.8e-7 apart at V = 128) without Megatron's three all-reduces over a group of
            # one: forward and backward in a third of the time on a 32 x 13 x 128 CPU batch. Not on a GPU:
            # torch's log-softmax keeps a second logits-sized tensor, where Megatron's works in place, and the
            # logits are the largest activation of the step there.
            return -F.cross_entropy(scaled.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels), {}
        if not entropy:
            return -vocab_parallel_cross_entropy(scaled, labels), {}
        token_entropy = self._vocab_parallel_entropy(scaled)
        # Megatron's cross entropy works in place on its input: give it a copy of the logits entropy used
        logprobs = -vocab_parallel_cross_entropy(scaled.clone(), labels)
        return logprobs, {"entropy": token_entropy}

    def _mask_vocab_padding(self, logits: Tensor) -> Tensor:
        """Rows added to make the vocabulary split evenly over TP hold zero weights, so their logit is 0,
        not -inf: they would take probability mass the HF model does not have. Give them the lowest
        finite logit instead (finite, so 0 * logit stays 0 in the entropy)."""
        vocab_slice = logits.shape[-1]
        first = self.stage.groups.tp_rank * vocab_slice
        real = max(0, min(vocab_slice, self.stage.shape.vocab_size - first))
        if real == vocab_slice:
            return logits
        padding = torch.arange(vocab_slice, device=logits.device) >= real
        return logits.masked_fill(padding, torch.finfo(logits.dtype).min)

    def _vocab_parallel_entropy(self, logits: Tensor) -> Tensor:
        """Entropy [b, T] of softmax over the full vocabulary from this rank's slice logits [b, T, V/tp].

        H = log S + m - (1/S) sum_v exp(z_v - m) z_v with S = sum_v exp(z_v - m) over all slices. The sums
        are all-reduced forward with an identity backward (every TP rank computes the same loss, so each
        receives the full gradient of its own slice).
        """
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        m = logits.detach().max(dim=-1, keepdim=True).values
        if self.stage.groups.tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.stage.groups.tp)
        e = torch.exp(logits - m)
        sums = torch.stack([e.sum(-1), (e * logits).sum(-1)])
        if self.stage.groups.tp_size > 1:
            sums = reduce_from_tensor_model_parallel_region(sums, group=self.stage.groups.tp)
        return torch.log(sums[0]) + m.squeeze(-1) - sums[1] / sums[0]

    def from_last_stage(self, tensor: Tensor | None, shape) -> Tensor:
        if self.stage.groups.pp_size == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=torch.float32, device=current_device())
        dist.broadcast(tensor, src=self.stage.groups.pp_last_global_rank, group=self.stage.groups.pp)
        return tensor

    def reduce_stats(self, stats: dict[str, Tensor]) -> dict[str, float]:
        """Sum statistics over DP ranks and send them from the last pipeline stage to every rank."""
        keys = [sorted(stats)] if self.stage.groups.is_pp_last else [None]
        if self.stage.groups.pp_size > 1:
            dist.broadcast_object_list(keys, src=self.stage.groups.pp_last_global_rank, group=self.stage.groups.pp)
        values = torch.stack([torch.as_tensor(stats.get(k, 0.0), dtype=torch.float64) for k in keys[0]]) \
            if keys[0] else torch.zeros(0, dtype=torch.float64)
        values = values.to(current_device())
        if self.stage.groups.pp_size > 1:
            dist.broadcast(values, src=self.stage.groups.pp_last_global_rank, group=self.stage.groups.pp)
        if self.stage.groups.dp_size > 1:
            dist.all_reduce(values, group=self.stage.groups.dp)
        return {k: float(v) for k, v in zip(keys[0], values.tolist())}


@dataclass
class SchedulePass:
    """One pass of the schedule over a batch: the forward step Megatron calls for each micro-batch, the
    loss it hands back for the micro-batch's output, and the outputs and statistics kept along the way."""

    schedule: PipelineSchedule
    loss_fn: LossFn | None
    temperature: float
    entropy: bool             # the loss function receives the entropy [b, T] of each position too
    seq_len: int              # T, the columns of the batch and of its outputs
    width: int                # the columns the model runs on: T, or more where ranks split rows evenly
    loss_scale: float         # PipelineSchedule.loss_scale
    keep_outputs: bool        # keep the outputs although a loss function consumes them
    routes: list[Tensor] | None = None  # MoE: each sample's routes to compare with or replay
    kept: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (index [b], outputs [b, T]) per micro-batch
    stat_sums: dict[str, Tensor] = field(default_factory=dict)       # the loss function's statistics, summed

    def forward_step(self, data_iterator, model):
        """Megatron's forward step: the next micro-batch through `model` (one chunk of the model), and the
        loss function of its output."""
        micro: MicroBatch = next(data_iterator)
        if self.schedule.routing is not None:
            self.schedule.routing.set_micro_batch(self.schedule.models.index(model), self._local_routes(micro))
        output = model(micro.ids, micro.positions, None, packed_seq_params=micro.packed_params)
        return output, partial(self.loss, micro)

    def _local_routes(self, micro: MicroBatch) -> Tensor | None:
        """The routes of `micro`'s rows laid out as the model sees them (None: nothing to compare or replay)."""
        if self.routes is None:
            return None
        if micro.packed is None:
            return self.schedule.routing.padded_routes(self.routes, micro.index, width=self.width,
                                                       device=current_device())
        return self.schedule.routing.packed_routes(self.routes, micro.packed, device=current_device())

    def loss(self, micro: MicroBatch, output: Tensor) -> tuple[Tensor, dict]:
        """The last stage's loss of one micro-batch, from the model's `output` (logits, or values of a
        critic), scaled by `loss_scale`; the outputs and the loss function's statistics are kept."""
        out, kwargs = self._head_outputs(micro, output)
        if len(micro.index) == 0:  # a packed micro-batch of padding only, so every rank has as many
            return out.sum() * 0.0, {}
        if self.loss_fn is None:
            self.kept.append((micro.index, out.detach()))
            return out.sum() * 0.0, {}
        loss, stats = self.loss_fn(out, micro.rows, **kwargs)
        for key, value in stats.items():
            self.stat_sums[key] = self.stat_sums.get(key, 0.0) + value.detach().float()
        if self.keep_outputs:
            self.kept.append((micro.index, out.detach()))
        return loss * self.loss_scale, {}

    def _head_outputs(self, micro: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The head's output per token [b, T] aligned with the tokens (logprobs, or values of a critic), and
        {"entropy": [b, T]} when asked; packed rows back in the right-padded layout."""
        if micro.packed is not None and micro.packed.shared is not None:
            return self._shared_outputs(micro, output)
        if self.schedule.stage.value_head:
            out, kwargs = self._aligned(output[..., 0].float()), {}
        else:
            per_position, kwargs = self.schedule.token_logprobs(output, micro.labels, temperature=self.temperature,
                                                                 entropy=self.entropy)
            out, kwargs = self._aligned(per_position), {k: self._aligned(v) for k, v in kwargs.items()}
        if micro.packed is not None:
            out = unpack(out[0], micro.packed, width=self.seq_len)
            kwargs = {k: unpack(v[0], micro.packed, width=self.seq_len) for k, v in kwargs.items()}
        return out, kwargs

    def _shared_outputs(self, micro: MicroBatch, output: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """`_head_outputs` of a shared-prompt row: what each position predicts, plus each sequence's first
        own token as predicted by its prompt's last position (which predicts a different token for every
        sequence of its group), unpacked to [b, T]."""
        row = micro.packed
        where, first_tokens = first_own_predictions(row, micro.ids[0])
        where = where.to(output.device)
        if self.schedule.stage.value_head:
            values = output[0, :, 0].float()
            return unpack_shared(torch.cat([values, values[where]]), row, width=self.seq_len), {}
        per_position, kwargs = self.schedule.token_logprobs(output, micro.labels, temperature=self.temperature,
                                                             entropy=self.entropy)
        first, _ = self.schedule.token_logprobs(output[:, where], first_tokens[None], temperature=self.temperature,
                                                entropy=False)
        out = unpack_shared(torch.cat([per_position[0], first[0]]), row, width=self.seq_len)
        return out, {k: unpack_shared(torch.cat([v[0], v[0, where]]), row, width=self.seq_len)
                     for k, v in kwargs.items()}

    def _aligned(self, per_position: Tensor) -> Tensor:
        """[b, s / cp] per position of this rank -> [b, s] whole sequences, shifted right by one: column t
        scores token t from the prefix before it (the value of the state before token t sits in column
        t, like the logprob of token t); column 0 is 0."""
        return F.pad(gather_sequence(per_position, group=self.schedule.stage.groups.cp)[:, :-1], (1, 0))

    def outputs(self, batch: int) -> Tensor | None:
        """The kept outputs [batch, T] in the batch's row order; None when none were kept (not the last
        pipeline stage, or a loss function consumed them)."""
        if not self.kept:
            return None
        out = torch.zeros(batch, self.width, dtype=self.kept[0][1].dtype, device=current_device())
        out[torch.cat([index for index, _ in self.kept])] = torch.cat([values for _, values in self.kept])
        return out[:, :self.seq_len]


def check_shared_prompts(*, micro_batch_tokens: int | None, config) -> None:
    """Refuse a shared-prompt layout (train.share_prompts) that the engine cannot compute exactly (`config`:
    the model's TransformerConfig). Both core attentions megarl builds take shared rows (megarl.engine.model.
    build_gpt: the local one, or Transformer Engine's through megarl.engine.te_attention)."""
    from megarl.job import shared_prompt_moe_refusal

    if not micro_batch_tokens:
        raise ValueError("train.share_prompts lays a group out as one packed row: it needs sequence packing "
                         "(set train.micro_batch_tokens)")
    refusal = shared_prompt_moe_refusal(lambda name: getattr(config, name, None))
    if refusal:
        raise ValueError(f"train.share_prompts on this mixture-of-experts model: {refusal}")
    if config.apply_rope_fusion:
        raise ValueError("train.share_prompts rotates a shared row by its position ids (own tokens continue after "
                         "their prompt) with Megatron's unfused RoPE, and its padded and packed rows alike, so "
                         "that every layout computes the same numbers: set model.megatron.apply_rope_fusion: false")
