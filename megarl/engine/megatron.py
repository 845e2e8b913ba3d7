"""The Megatron-core train engine: one model (actor, reference, critic or reward model) over this rank's share
of the parallel layout, built from a HuggingFace checkpoint directory.

`TrainEngine` is the interface the loops use; each of its jobs lives in its own module:
  megarl.engine.parallel         process groups (Megatron's parallel state, handed out as ParallelGroups)
  megarl.engine.model            TransformerConfig, layer spec, GPTModel chunks, the value head
  megarl.engine.hf_weights       HF weights in (shards from safetensors) and out (full HF-named tensors)
  megarl.engine.dist_checkpoint  distributed checkpoints and RNG state
  megarl.engine.compute          micro-batches through the pipeline schedule: logprobs, values, losses
  megarl.engine.offload          device memory handed to the rollout engine between updates

Sequences are [B, T] token ids, right padded. Logprobs are aligned with the tokens: `logprobs[b, t]` is
log p(tokens[b, t] | tokens[b, :t]) at the sampling temperature, and column 0 is 0.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from megarl.config import LoraConfig
from megarl.engine import dist_checkpoint, hf_weights
from megarl.engine import lora as adapters
from megarl.engine.compute import LossFn, PipelineSchedule
from megarl.engine.model import StageModel, build_stage_model, only_chunk
from megarl.engine.offload import TrainerMemory
from megarl.engine.parallel import ParallelGroups, init_parallel
from megarl.engine.router_replay import ModelRouting
from megarl.layout import check_layout
from megarl.models.arch import ModelShape
from megarl.packing import PromptGroups
from megarl.routing import RouteUse


class TrainEngine:
    """One Megatron model (actor, reference or critic) over this rank's share of the parallel layout.

    With `optim` None the model is frozen (reference): no DDP wrapper, no optimizer, no gradients. With
    `optim` (a megarl.config.OptimConfig) every `train_step` runs at `optim.lr_at(step)`: the one place the
    learning-rate schedule is applied.
    `value_head=True` makes a critic: the vocabulary projection is replaced by a scalar head, read from
    the checkpoint's `score.weight` when it has one (a reward model) and zero otherwise, so every value
    starts at 0.

    With `lora` (a megarl.config.LoraConfig, trained engines only) the base weights are frozen and only the
    adapters train (megarl.engine.lora; `seed` draws them); `hf_tensors` then gives the merged weights.

    `shape` is the checkpoint's architecture (megarl.job reads it once per run); `te_layers`, whether the layers
    are Transformer Engine's (None: wherever it is usable, megarl.engine.model.uses_transformer_engine).

    With virtual pipeline stages (`model.megatron.virtual_pipeline_model_parallel_size`) this rank holds
    one model chunk per virtual stage (`chunks`, `models`) and runs Megatron's interleaved schedule;
    weights, handoff and checkpoints name every layer by its global index either way.
    """

    def __init__(self, *, model_dir: str, shape: ModelShape, dtype: str, megatron: dict, groups: ParallelGroups,
                 optim=None, value_head: bool = False, load_weights: bool = True, lora: LoraConfig | None = None,
                 seed: int = 0, te_layers: bool | None = None):
        self.stage: StageModel = build_stage_model(shape, dtype=dtype, megatron=megatron, groups=groups,
                                                   value_head=value_head, lora=lora, te_layers=te_layers)
        if load_weights:  # False: the weights come from a distributed checkpoint (`load_checkpoint`)
            hf_weights.load_hf(self.stage, model_dir)
        if lora is not None:
            if optim is None:
                raise ValueError("LoRA adapters are trained: a TrainEngine with `lora` needs `optim`")
            adapters.init_adapters(self.stage.adapted_layers(), seed=seed, tp_rank=groups.tp_rank,
                                   tp_size=groups.tp_size, etp_rank=groups.etp_rank, etp_size=groups.etp_size,
                                   expert_offset=groups.ep_rank * (self.shape.experts // groups.ep_size))
            adapters.freeze_base(self.chunks)
        self.optim = optim
        if optim is None:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.models, self.optimizer = self.chunks, None
        else:
            self.models, self.optimizer = self._wrap_for_training(optim)
        routing = None
        if self.shape.is_moe:
            routing = ModelRouting(self.chunks, moe_layers=self.shape.moe_layers, groups=groups,
                                   first_moe_layer=self.shape.dense_layers,
                                   sequence_parallel=self.config.sequence_parallel)
        self.schedule = PipelineSchedule(self.stage, self.models, routing)
        self.memory = TrainerMemory(self.chunks, self.models if optim is not None else None, self.optimizer)
        self.step = 0

    # ---- what the engine holds ------------------------------------------------------------------------
    @property
    def groups(self) -> ParallelGroups:
        return self.stage.groups

    @property
    def shape(self):
        return self.stage.shape

    @property
    def config(self):
        """Megatron's TransformerConfig of the model."""
        return self.stage.config

    @property
    def chunks(self) -> list:
        """The GPTModel chunks of this rank, one per virtual pipeline stage."""
        return self.stage.chunks

    @property
    def value_head(self) -> bool:
        return self.stage.value_head

    @property
    def names(self):
        return self.stage.names

    @property
    def module(self):
        """The GPTModel of an engine without virtual pipeline stages."""
        return self.stage.module

    @property
    def model(self):
        """`module`, wrapped in Megatron DDP when the engine trains."""
        return only_chunk(self.models)

    def _wrap_for_training(self, optim):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=optim.distributed)
        ddps = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk)
                for chunk in self.chunks]
        for ddp in ddps:
            skip_one_rank_collectives(ddp)
        offload = {}
        if optim.cpu_offload:
            # Megatron's HybridDeviceOptimizer steps that fraction of the state on the host. It runs through
            # the precision-aware path, so the fp32 master weights it keeps are the only ones (on the host for
            # the offloaded share) and no second master copy stays on the GPU; the transfers overlap the
            # host's steps. It keeps whole fp32 masters, not TE FusedAdam's remainders.
            offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=optim.cpu_offload,
                           use_precision_aware_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True,
                           store_param_remainders=False)
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
            adam_beta2=optim.beta2, adam_eps=optim.eps, clip_grad=optim.grad_clip,
            bf16=self.config.bf16, fp16=self.config.fp16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=optim.distributed,
            # fp16: torch GradScaler's first scale. Megatron's 2**32 overflows fp16 gradients and skips steps
            # while it halves down (17 skipped steps on the tiny model, each a whole RL step's rollout).
            initial_loss_scale=2.0**16, **offload,
        )
        # one optimizer over every chunk: one gradient norm, one clipping, one step
        with warnings.catch_warnings():
            # megatron-core compares torch's version as a string ('2.14' < '2.3') and warns wrongly
            warnings.filterwarnings("ignore", message="CPU offload is recommended for PyTorch >= 2.3.0")
            optimizer = get_megatron_optimizer(opt_config, ddps)
        count_expert_copies_once(optimizer, etp_group=self.stage.groups.etp)
        fuse_torch_adam(optimizer)
        # The schedule multiplies each loss (and the MoE aux loss) by the optimizer's loss scale, which the
        # optimizer divides out of the gradients again: 1 except in fp16, where it keeps them representable.
        self.config.grad_scale_func = optimizer.scale_loss
        self.config.finalize_model_grads_func = finalize_model_grads
        # the interleaved schedule takes one no_sync per chunk, the others a single one
        self.config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [ddp.no_sync for ddp in ddps]
        return ddps, optimizer

    # ---- weights ----------------------------------------------------------------------------------
    def load_hf(self, model_dir: str | Path) -> None:
        """Copy an HF checkpoint into this rank's shards. Every Megatron parameter must be covered."""
        hf_weights.load_hf(self.stage, model_dir)

    def hf_tensors(self, *, checkpoint: str | Path | None = None, bucket_bytes: int = 2**30,
                   classifier: bool = False) -> Iterator[tuple[str, Tensor]]:
        """Full HF-named tensors of this pipeline stage, one at a time (megarl.engine.hf_weights.hf_tensors;
        `classifier`: a scalar-head model's, as a sequence classifier).

        With `checkpoint`, the weights are read from that distributed checkpoint about `bucket_bytes` at a
        time instead of from the module, which may then live on the meta device (`meta_engine`): memory
        holds one bucket, whatever the model size. A checkpoint of another model is a CheckpointError.
        """
        params = None
        if checkpoint is not None:
            params = dist_checkpoint.checkpoint_params(self.stage, Path(checkpoint), bucket_bytes=bucket_bytes)
        return hf_weights.hf_tensors(self.stage, params, classifier=classifier)

    def pipeline_hf_tensors(self, *, classifier: bool = False) -> Iterator[tuple[str, Tensor]]:
        """`hf_tensors` of every pipeline stage, delivered in stage order to every rank of the pipeline."""
        return hf_weights.pipeline_hf_tensors(self.stage, partial(hf_weights.hf_tensors, classifier=classifier))

    def pipeline_adapter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """A LoRA policy's adapters under PEFT's names (megarl.engine.hf_weights.hf_adapter_tensors), every
        pipeline stage's, delivered in stage order to every rank of the pipeline."""
        return hf_weights.pipeline_hf_tensors(self.stage, hf_weights.hf_adapter_tensors)

    # ---- device memory choreography (co-located rollout) ------------------------------------------------
    # The trainer gives its device memory to the rollout engine between updates (megarl.engine.offload), on
    # the CPU too, in the same order and with the storage really freed.
    def offload_training_state(self) -> int:
        """Free gradient buffers and move optimizer state to the host; returns the bytes freed."""
        return self.memory.offload_training_state()

    def offload_params(self) -> int:
        """Move parameters to the host; `onload` brings everything back. Returns the bytes freed."""
        return self.memory.offload_params()

    def onload(self, *, params_only: bool = False) -> None:
        """Bring parameters, gradient buffers (zeroed) and optimizer state back to the device (with `params_only`,
        the parameters alone)."""
        self.memory.onload(params_only=params_only)

    def free(self) -> int:
        """Free every storage the engine holds, for good (megarl.engine.offload.TrainerMemory.free); returns the
        bytes freed. The engine cannot be used afterwards."""
        return self.memory.free()

    # ---- distributed checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, *, hf_dir: str | Path | None = None,
                        progress: Callable[[], object] | None = None) -> None:
        """Model (and optimizer) state as a Megatron distributed checkpoint in directory `path`, written by
        every rank collectively (megarl.engine.dist_checkpoint.save; `hf_dir` streams the weights from an
        HF checkpoint instead of the module)."""
        dist_checkpoint.save(self.stage, self.optimizer, path, hf_dir=hf_dir, progress=progress)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, whatever layout wrote it; a checkpoint of another model is
        an error listing the tensors that do not match, and nothing is loaded then."""
        dist_checkpoint.load(self.stage, self.optimizer, path)
        if self.optimizer is not None:  # the checkpoint's param groups replaced the optimizer's own settings
            fuse_torch_adam(self.optimizer)

    # ---- compute ------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, tokens: Tensor, *, temperature: float, micro_batch_size: int,
                 lengths: Tensor | None = None, micro_batch_tokens: int | None = None,
                 routes: RouteUse | None = None, prompt_groups: PromptGroups | None = None) -> Tensor:
        """Token logprobs [B, T] of `tokens` [B, T] on every rank of the pipeline (micro-batching as in
        `PipelineSchedule.run`: `micro_batch_tokens` packs sequences of `lengths` [B] tokens; `routes`: MoE
        routes to compare with, replay or record; `prompt_groups`: prompts held once per group)."""
        if self.value_head:
            raise ValueError("a critic has no token logprobs; use values()")
        out, _ = self.schedule.run(tokens, {}, None, temperature=temperature, micro_batch_size=micro_batch_size,
                                   forward_only=True, lengths=lengths, micro_batch_tokens=micro_batch_tokens,
                                   routes=routes, prompt_groups=prompt_groups)
        return self.schedule.from_last_stage(out, tokens.shape).cpu()

    # ---- MoE routing -----------------------------------------------------------------------------------
    def routing_agreement(self) -> float | None:
        """The fraction of the trainer's own expert choices that equal the routes compared with since the last
        call, over every rank (all ranks call it); None for a dense model or when nothing was compared."""
        return self.schedule.routing.take_agreement() if self.schedule.routing is not None else None

    def recorded_routes(self) -> list[Tensor]:
        """The trainer's own routing per sample [length, moe_layers, top_k] of the last pass that recorded it."""
        routing = self.schedule.routing
        if routing is None or routing.recorded is None:
            raise ValueError("no routing was recorded (a MoE model's pass with RouteUse(record=True))")
        recorded, routing.recorded = routing.recorded, None
        return recorded

    @torch.no_grad()
    def values(self, tokens: Tensor, *, micro_batch_size: int, lengths: Tensor | None = None,
               micro_batch_tokens: int | None = None, prompt_groups: PromptGroups | None = None) -> Tensor:
        """A critic's values [B, T]: column t is V(tokens[:t]), the state in which token t was chosen."""
        if not self.value_head:
            raise ValueError("values() needs a critic (TrainEngine(value_head=True))")
        out, _ = self.schedule.run(tokens, {}, None, temperature=1.0, micro_batch_size=micro_batch_size,
                                   forward_only=True, lengths=lengths, micro_batch_tokens=micro_batch_tokens,
                                   prompt_groups=prompt_groups)
        return self.schedule.from_last_stage(out, tokens.shape).cpu()

    def train_step(self, tokens: Tensor, extras: dict[str, Tensor], loss_fn: LossFn, *, temperature: float,
                   micro_batch_size: int, entropy: bool = False, lengths: Tensor | None = None,
                   micro_batch_tokens: int | None = None, return_outputs: bool = False,
                   routes: RouteUse | None = None, prompt_groups: PromptGroups | None = None
                   ) -> dict[str, float] | tuple[dict[str, float], Tensor]:
        """One optimizer step on this rank's share [B, T] of the global batch, at learning rate
        `optim.lr_at(step)`.

        `loss_fn(outputs [b, T], micro-batch dict)` sees logprobs (values for a critic), plus
        `entropy=` [b, T] when `entropy` is True; `micro_batch_tokens` packs sequences of `lengths` [B]
        tokens into micro-batches (`prompt_groups`: prompts held once per group); `routes`: MoE routes to compare
        with or replay. Returns its statistics summed
        over micro-batches and DP ranks (each one a contribution normalized by global counts, so the sums are global means), plus `grad_norm` and `lr`;
        with `return_outputs`, also the outputs [B, T] the loss saw (before the update, detached), on every
        rank of the pipeline, as `logprobs` / `values` return them.
        """
        lr = self.optim.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out, stats = self.schedule.run(tokens, extras, loss_fn, temperature=temperature,
                                       micro_batch_size=micro_batch_size, forward_only=False, entropy=entropy,
                                       lengths=lengths, micro_batch_tokens=micro_batch_tokens,
                                       keep_outputs=return_outputs, routes=routes, prompt_groups=prompt_groups)
        ok, grad_norm, _ = self.optimizer.step()
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.step += 1
        metrics = self.schedule.reduce_stats(stats)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        if not ok:
            metrics["skipped_step"] = 1.0
        metrics["lr"] = lr
        if return_outputs:
            return metrics, self.schedule.from_last_stage(out, tokens.shape).cpu()
        return metrics


def skip_one_rank_collectives(ddp) -> bool:
    """Make `ddp`'s gradient reduction and parameter all-gather no-ops when every group they run over has one
    rank and nothing is rescaled or recast in them: each collective is then the identity, but Megatron runs
    it anyway, and on gloo it copies every gradient, and every parameter after the optimizer step, through
    its buffers (a fifth of a 4-layer hidden-512 CPU step). Returns whether it did. Without overlapped
    reduction and gathering (megarl's settings) nothing else starts them."""
    ddp_config = ddp.ddp_config
    if ddp_config.overlap_grad_reduce or ddp_config.overlap_param_gather or getattr(ddp.config, "fp8", None):
        return False
    groups = [ddp.intra_dp_cp_group, ddp.intra_expt_dp_group]
    if any(group is not None and group.size() > 1 for group in groups):
        return False
    buckets = [b for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups for b in group.buckets]
    if any(b.gradient_scaling_factor != 1.0 for b in buckets):
        return False
    ddp.finish_grad_sync = lambda *args, **kwargs: None
    ddp.start_param_sync = lambda *args, **kwargs: None
    return True


def fuse_torch_adam(optimizer) -> None:
    """Step torch's Adam, which Megatron falls back to without Transformer Engine or apex (every CPU run),
    with its fused kernel: all parameters of a group in one pass per element, instead of a dozen tensor ops
    per parameter (3x faster on a 2-layer hidden-128 model, 3x at 4 layers hidden 512). The update is the
    same Adam to float rounding. Megatron builds torch's Adam without `fused`, and a loaded checkpoint
    brings back the param groups it was saved with, so this runs after both. The offloading optimizer
    (optim.cpu_offload) builds its torch Adams with `fused` itself."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = inner.optimizer
        if not isinstance(adam, torch.optim.Adam) or getattr(adam, "defaults", {}).get("differentiable"):
            continue
        for group in adam.param_groups:
            if group.get("fused"):
                continue
            group["fused"], group["foreach"] = True, False
            for param in group["params"]:
                step = adam.state.get(param, {}).get("step")
                if isinstance(step, Tensor):  # the fused kernel reads the step count on the parameter's device
                    adam.state[param]["step"] = step.to(param.device, torch.float32)


def count_expert_copies_once(optimizer, *, etp_group) -> None:
    """Megatron hands every optimizer of its chain the tensor-parallel group, and the gradient norm counts a tensor
    that is not split over it (no `tensor_model_parallel` tag) on TP rank 0 only, as a copy held by every TP rank.
    An expert's unsplit tensors (gpt-oss's fc2 bias, the replicated factor of an expert's adapter) are copies over
    the expert tensor-parallel ranks instead; with etp != tp the TP filter would drop the different experts of the
    other TP ranks from the norm (measured at TP = 2, ETP = 1: a norm 24% low). The expert optimizer (the one of
    the expert-parallel parameter groups) gets the expert tensor-parallel group (`etp_group`)."""
    for each in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(group.get("is_expert_parallel") for group in each.param_groups):
            each.tp_group = etp_group


def meta_engine(model_dir: str | Path, *, shape: ModelShape, dtype: str, tp: int = 1, pp: int = 1,
                ep: int = 1, etp: int | None = None) -> TrainEngine:
    """A frozen TrainEngine whose model lives on the meta device: Megatron's names, shapes and sharding at
    this layout (`etp`: the expert tensor-parallel size, None: tp), no weights, for the conversion tools to
    stream tensors through (`save_checkpoint(hf_dir=)`, `hf_tensors(checkpoint=)`). ValueError, naming the
    numbers, when the layout does not split the model or the torchrun world."""
    import warnings

    # sequence_parallel: a conversion never trains, so the MoE-under-TP rule of training does not apply
    check_layout(shape, tp=tp, pp=pp, cp=1, ep=ep, etp=etp, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                 sequence_parallel=True)
    # Without GPU-only Apex / Transformer Engine megatron warns at import about its fallbacks, which are the
    # intended code on CPU; a conversion's output is its progress.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    groups = init_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    with torch.device("meta"):
        return TrainEngine(model_dir=str(model_dir), shape=shape, dtype=dtype, megatron={}, groups=groups,
                           load_weights=False)
