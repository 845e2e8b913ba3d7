"""Resumable checkpoints of an RL run: what is saved, by which rank, and how a run continues from it.

A checkpoint directory (see megarl.checkpoint for how it is published atomically) holds:
  actor/, critic/      Megatron distributed checkpoints: model and optimizer state, fully reshardable, so a
                       run may resume at another TP, PP or EP layout
  state.json           step, weight version, KL controller, optimizer step counts, the layout that wrote it
  dp{d}.pt             per data-parallel replica: its prompt sampler position and rollout sampler RNG
  rank{r}.pt           per rank: torch and Megatron RNG states (restored when the layout is unchanged)
  recipe.yaml          the recipe of the run
  hf/                  the model's config and tokenizer files, so conversion tools need nothing else

Everything is restored, so a resumed run draws the same prompts, samples the same responses (native engine;
SGLang's sampler state cannot be saved) and computes the same metrics as one never interrupted.
Files load with `weights_only=True`: nothing is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint import (CheckpointError, copy_side_files, latest_checkpoint, publish, step_dir_name,
                               temporary_dir)
from megarl.config import Config, RecipeError, dump_config
from megarl.engine.megatron import set_trainer_rng_state, trainer_rng_state

log = logging.getLogger(__name__)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint `checkpoint.resume` asks for: None to start fresh. RecipeError when the request
    cannot be honoured without losing something (starting over on top of a run's checkpoints)."""
    resume = cfg.checkpoint.resume
    root = checkpoint_root(cfg)
    if resume == "auto":
        return latest_checkpoint(root)
    if resume == "never":
        if latest_checkpoint(root) is not None:
            raise RecipeError(f"checkpoint.resume: 'never', but {root} holds checkpoints of an earlier run; "
                              f"use another run_dir, remove them, or resume with checkpoint.resume=auto")
        return None
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise RecipeError(f"checkpoint.resume: {path} is not a checkpoint directory (no state.json)")
    return path


def _layout(run) -> dict[str, int]:
    g = run.groups
    return {"world": dist.get_world_size(), "tp": g.tp_size, "pp": g.pp_size, "ep": g.ep_size, "dp": g.dp_size}


def save_run_checkpoint(run, step: int) -> Path:
    """Save the run after `step` (a collective call: every rank writes its share). Returns the directory."""
    cfg = run.cfg
    name = [str(temporary_dir(checkpoint_root(cfg), step)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    run.actor.save_checkpoint(tmp / "actor")
    if run.critic is not None:
        run.critic.save_checkpoint(tmp / "critic")
    if run.is_rollout_rank:
        torch.save({"sampler": run.sampler.state_dict(), "rollout_rng": run.rollout.rng_state()},
                   tmp / f"dp{run.groups.dp_rank:05d}.pt")
    torch.save(trainer_rng_state(), tmp / f"rank{dist.get_rank():05d}.pt")
    if dist.get_rank() == 0:
        state = {"step": step, "weight_version": run.weight_version, "kl": run.kl.state_dict(),
                 "actor_step": run.actor.step, "critic_step": run.critic.step if run.critic else None,
                 "layout": _layout(run)}
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        dump_config(cfg, tmp / "recipe.yaml")
        (tmp / "hf").mkdir()
        copy_side_files(cfg.model.path, tmp / "hf")
    dist.barrier()
    final = Path(cfg.run_dir) / "checkpoints" / step_dir_name(step)
    if dist.get_rank() == 0:
        final = publish(tmp, step=step, keep_last=cfg.checkpoint.keep_last)
        log.info("checkpoint of step %d saved to %s", step, final)
    dist.barrier()
    return final


def resume_run(run, path: Path) -> int:
    """Restore everything `save_run_checkpoint` wrote to `path` into `run`; returns the step it holds."""
    state = json.loads((path / "state.json").read_text())
    run.actor.load_checkpoint(path / "actor")
    run.actor.step = state["actor_step"]
    if run.critic is not None:
        if state["critic_step"] is None:
            raise CheckpointError(f"{path}: has no critic, but algo.name = {run.cfg.algo.name!r} trains one")
        run.critic.load_checkpoint(path / "critic")
        run.critic.step = state["critic_step"]
    run.kl.load_state_dict(state["kl"])
    run.weight_version = state["weight_version"]
    saved, now = state["layout"], _layout(run)
    replicas = sorted(path.glob("dp*.pt"))
    if saved["dp"] == now["dp"]:
        mine = torch.load(path / f"dp{run.groups.dp_rank:05d}.pt", weights_only=True)
        run.sampler.load_state_dict(mine["sampler"])
        if run.is_rollout_rank and mine["rollout_rng"] is not None:
            run.rollout.set_rng_state(mine["rollout_rng"])
    else:
        # Each replica's prompts came from one global stream; continuing after the furthest position
        # repeats no prompt. Sampling is seeded again, so samples differ from an uninterrupted run.
        positions = [torch.load(p, weights_only=True)["sampler"] for p in replicas]
        run.sampler.load_state_dict(max(positions, key=lambda s: (s["epoch"], s["position"])))
        log.warning("resuming with data-parallel size %d, saved with %d: the data order continues, the "
                    "rollout samples differ from an uninterrupted run", now["dp"], saved["dp"])
    if saved == now:
        set_trainer_rng_state(torch.load(path / f"rank{dist.get_rank():05d}.pt", weights_only=True))
    else:
        log.info("resuming at layout %s (saved at %s): trainer RNG streams start fresh", now, saved)
    return int(state["step"])
