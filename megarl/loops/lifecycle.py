"""One run lifecycle for every loop (RL, SFT, DPO, RM): resume, the steps with their metrics and periodic
checkpoints, then the final checkpoint and HF export.

    resume_from, done = find_resume(cfg)            # before any work, so a finished run does none
    if already_finished(cfg, resume_from, done, steps): return final_dir(cfg)
    ... build the loop's models, sampler and rollout engine into a RunState ...
    return run_steps(cfg, state, step=one_step, steps=steps, resume_from=resume_from, desc="rl")

A loop's `step(n)` does one update and returns that step's metrics (its own evaluation and non-finite
checks included); everything around it is here, stopping on a signal included (megarl.loops.stop): before
each step every rank agrees whether to go on, and a run asked to stop saves the step it finished and raises
Stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch.distributed as dist

from megarl.checkpoint import classifier_config, save_hf, save_peft_adapter
from megarl.config import Config
from megarl.dataclass_yaml import dump_config
from megarl.job import adapts_experts
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.loops.faults import EngineLost
from megarl.loops.resume import RunState, checkpoint_due, restore_checkpoint, save_checkpoint
from megarl.loops.stop import STOP, Stopped
from megarl.metrics import MetricsWriter
from megarl.timeline import TIMELINE, ProfileWindow, global_rank
from megarl.trackers import open_trackers


def final_dir(cfg: Config) -> Path:
    """Where the final HF checkpoint of a run goes."""
    return Path(cfg.run_dir) / "checkpoints" / "final"


def run_steps(cfg: Config, state: RunState, *, step: Callable[[int], dict[str, float]], steps: int,
              resume_from: Path | None, desc: str, on_start: Callable[[], object] | None = None,
              exported: str = "actor") -> Path:
    """Restore `state` from `resume_from` (when given), call `on_start()` (RL: the first weight push, of the
    restored weights), then run steps up to `steps`: metrics every
    `log.every_steps` (and the last), a checkpoint every `checkpoint.every_steps` (written by the step itself
    where `state.saves_in_step`), and with
    `checkpoint.save_final` a last checkpoint plus the model `state.engines[exported]` exported as an HF
    checkpoint (a scalar-head model as a sequence classifier). Returns the
    directory of that export. A signal (megarl.loops.stop) ends the run before its next step: the last
    finished step is saved unless it already was, and Stopped is raised. So does a rollout engine lost for
    good (EngineLost, raised again with its `checkpoint`): a step it stopped before the update gives back
    the prompts it drew. The first record written by this
    process has `timing/startup_seconds`: seconds from the process's start to its first step. With
    `log.trace` every rank writes its step timeline (megarl.timeline) from here on, and with
    `log.profile_steps` runs torch.profiler over those steps. Rank 0 logs each record to the trackers of
    `log.wandb` and `log.mlflow` too (megarl.trackers), in the tracker runs of the run it resumes."""
    start = restore_checkpoint(resume_from, state) if resume_from is not None else 0
    trackers = []
    if dist.get_rank() == 0:
        dump_config(cfg, Path(cfg.run_dir) / "recipe.yaml")
        trackers = open_trackers(cfg, resume_step=start)
    writer = MetricsWriter(cfg.run_dir, total_steps=steps, enabled=dist.get_rank() == 0, progress=cfg.log.progress,
                           tensorboard=cfg.log.tensorboard, desc=desc, resume_step=start, trackers=trackers)
    if cfg.log.trace:
        start_trace(Path(cfg.run_dir) / "trace", resume_step=start)
    profile = ProfileWindow(cfg.log.profile_steps, Path(cfg.run_dir) / "profile", rank=global_rank())
    finished = False
    try:
        if on_start is not None:
            on_start()
        state.last_saved, state.last_saved_step = resume_from, start
        startup = {"timing/startup_seconds": time.time() - psutil.Process().create_time()}
        for n in range(start + 1, steps + 1):
            if exit_code := STOP.agreed():
                if state.last_saved_step < n - 1:
                    save_checkpoint(cfg, n - 1, state, final=True)
                raise Stopped(step=n - 1, checkpoint=state.last_saved, exit_code=exit_code,
                              signal_name=STOP.signal_name)
            drawn = state.sampler.state_dict()
            try:
                with TIMELINE.step(n), profile.step(n):
                    metrics = step(n)
            except EngineLost as e:  # every rank: save the last complete state, the step's prompts not drawn
                last = n if e.trained else n - 1
                if not e.trained and not e.keeps_prompts:
                    state.sampler.load_state_dict(drawn)
                if state.last_saved_step < last:
                    save_checkpoint(cfg, last, state, final=True)
                e.checkpoint = state.last_saved
                raise
            writer.rows(n, metrics)
            if n % cfg.log.every_steps == 0 or n == steps:
                writer.write(n, metrics | startup)
                startup = {}
            if checkpoint_due(cfg, n, steps) and not state.saves_in_step:
                save_checkpoint(cfg, n, state)
        finished = True
    finally:
        writer.close(finished=finished)
        TIMELINE.close()
        profile.close()
    final = final_dir(cfg)
    if cfg.checkpoint.save_final:
        # One residency: the last checkpoint, then the export of the parameters alone, with the rollout engines
        # released (a resumed engine beside the whole training state would not fit a GPU the plan fills).
        save_checkpoint(cfg, steps, state, final=True)
        export_policy(state.engines[exported], state.groups, source_dir=cfg.model.path, out_dir=final,
                      meta={"stage": desc, "step": steps}, count_device=state.count_device)
        state.check_device()
    return final


def start_trace(trace_dir: Path, *, resume_step: int) -> None:
    """This rank's timeline file of the steps after `resume_step`; a fresh run (0) first drops the rank's
    files of an earlier run in the same run_dir, as metrics.jsonl starts over."""
    rank = global_rank()
    if resume_step == 0:
        for old in trace_dir.glob(f"rank{rank}-from-step*.json"):
            old.unlink()
    TIMELINE.start(trace_dir / f"rank{rank}-from-step{resume_step + 1}.json", rank=rank)


def export_policy(engine: TrainEngine, groups: ParallelGroups, *, source_dir: str, out_dir: Path,
                  meta: dict, count_device: Callable[..., None] = lambda phase, **transient: None) -> None:
    """Write the model as an HF checkpoint from global rank 0 (a scalar-head model as a one-label sequence
    classifier); its model-parallel peers join the gathers (with expert parallelism that is every rank: the
    expert-parallel peers sit in other data-parallel ranks). A LoRA policy's are its merged weights, and its
    adapters go to `out_dir/adapter` in PEFT's format, for the base model `source_dir`, unless they adapt a MoE
    model's experts (transformers holds a layer's experts as one fused tensor, which PEFT's LoRA does not
    wrap): the merged weights alone then. `count_device(phase, **transient)` counts the device's memory while the
    gathers run (megarl.ledger)."""
    engine.onload(params_only=True)  # on GPU the parameters wait on the host from the weight push to the next step
    if groups.dp_rank == 0 or groups.ep_size > 1:
        tensors = counted(engine.pipeline_hf_tensors(classifier=engine.value_head), count_device)
        if dist.get_rank() == 0:
            config = classifier_config(source_dir) if engine.value_head else None
            save_hf(tensors, source_dir=source_dir, out_dir=out_dir, meta=meta, config=config)
        else:
            for _ in tensors:
                pass
    lora = engine.stage.lora
    if lora is not None and groups.dp_rank == 0 and not adapts_experts(lora, engine.shape):
        adapters = engine.pipeline_adapter_tensors()
        if dist.get_rank() == 0:
            save_peft_adapter(adapters, rank=lora.rank, alpha=lora.alpha, base_model=source_dir,
                              out_dir=out_dir / "adapter")
        else:
            for _ in adapters:
                pass
    dist.barrier()


def counted(tensors, count_device: Callable[..., None]):
    """`tensors` (name, tensor) as they stream, counting the device once the largest has passed: each full tensor
    is gathered from its shards, so two copies of the largest are on the device at once (megarl.plan)."""
    largest = 0
    for name, tensor in tensors:
        largest = max(largest, tensor.numel() * tensor.element_size())
        yield name, tensor
    count_device("export", export_gathered_tensors=2 * largest)
