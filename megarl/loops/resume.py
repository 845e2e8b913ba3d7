"""Resumable checkpoints of a run (RL, SFT, DPO): what is saved, by which rank, and how a run continues.

A checkpoint directory (see megarl.checkpoint for how it is published atomically) holds:
  actor/, critic/      Megatron distributed checkpoints: model and optimizer state, fully reshardable, so a
                       run may resume at another TP, PP or EP layout
  state.json           step, optimizer step counts, the layout that wrote it, the loop's own state (RL:
                       weight version and KL controller)
  dp{d}.pt             per data-parallel replica: its prompt sampler position
  engine{e}.pt         per rollout engine: its sampler RNG (restored when the engine count is unchanged)
  rank{r}.pt           per rank: torch and Megatron RNG states (restored when the layout is unchanged)
  recipe.yaml          the recipe of the run
  hf/                  the model's config and tokenizer files, so conversion tools need nothing else
  manifest.json        every other file's size and sha256 (checked before a resume loads anything)

Everything is restored, so a resumed run draws the same prompts, samples the same responses (native engine;
SGLang's sampler state cannot be saved) and computes the same metrics as one never interrupted.
Files load with `weights_only=True`: nothing is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import inject
from megarl.checkpoint import (MANIFEST, CheckpointError, check_files, checkpoint_files, copy_side_files,
                               describe_files, disk_full_error, latest_checkpoint, publish, read_manifest,
                               set_aside, set_latest, step_dir_name, temporary_dir)
from megarl.config import Config, RecipeError
from megarl.data.prompts import PromptSampler
from megarl.dataclass_yaml import dump_config
from megarl.engine.dist_checkpoint import set_trainer_rng_state, trainer_rng_state
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups

log = logging.getLogger(__name__)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


def find_resume(cfg: Config) -> tuple[Path | None, int]:
    """The checkpoint `checkpoint.resume` asks for and the step it holds; (None, 0) to start fresh.
    RecipeError when the request cannot be honoured without losing something (starting over on top of a
    run's checkpoints)."""
    resume = cfg.checkpoint.resume
    root = checkpoint_root(cfg)
    if resume == "auto":
        path = latest_checkpoint(root)
        if path is not None:
            path = newest_whole(root, path)
    elif resume == "never":
        if latest_checkpoint(root) is not None:
            raise RecipeError(f"checkpoint.resume: 'never', but {root} holds checkpoints of an earlier run; "
                              f"use another run_dir, remove them, or resume with checkpoint.resume=auto")
        path = None
    else:
        path = Path(resume)
        if not (path / "state.json").is_file():
            raise RecipeError(f"checkpoint.resume: {path} is not a checkpoint directory (no state.json)")
        problems = damage(path)
        if problems:
            raise CheckpointError(f"checkpoint.resume: {path} is damaged: " + "; ".join(problems))
    if path is None:
        return None, 0
    return path, int(json.loads((path / "state.json").read_text())["step"])


def damage(path: Path) -> list[str]:
    """What is wrong with checkpoint `path` against its manifest, checked by every rank in parallel (a
    collective call); empty when it is whole or was written before manifests."""
    world, rank = dist.get_world_size(), dist.get_rank()
    manifest = read_manifest(path)
    if manifest is None:
        log.info("%s has no %s (written before checkpoints carried one): not checked", path, MANIFEST)
        return []
    names = sorted(manifest["files"])
    found: list[list[str] | None] = [None] * world
    dist.all_gather_object(found, check_files(path, manifest, names[rank::world]))
    return [problem for problems in found for problem in problems]


def newest_whole(root: Path, latest: Path) -> Path:
    """`latest`, or, when it is damaged, the newest older checkpoint under `root` that is whole; each damaged
    one is named in the log and moved aside (`.corrupt-stepN`), and `latest` points at the one returned.
    CheckpointError when none is whole."""
    older = sorted((p for p in root.glob("step*") if p.is_dir() and p.name < latest.name), reverse=True)
    lead, seen = dist.get_rank() == 0, []
    for path in [latest, *older]:
        problems = damage(path)
        if not problems:
            if path != latest and lead:
                set_latest(root, path.name)
            dist.barrier()
            return path
        seen.append(f"{path.name}: " + "; ".join(problems))
        if lead:
            aside = set_aside(path)
            log.error("checkpoint %s is damaged (%s): moved to %s; resuming from an older one",
                      path, "; ".join(problems), aside)
        dist.barrier()
    raise CheckpointError(f"no checkpoint under {root} is whole: " + " | ".join(seen))


def already_finished(cfg: Config, path: Path | None, step: int, steps: int) -> bool:
    """True (and says so) when the checkpoint to resume from already holds the last step."""
    if path is None:
        return False
    if step >= steps:
        if dist.get_rank() == 0:
            print(f"megarl: {cfg.run_dir} already finished {step} of {steps} steps ({path}); nothing to do")
        return True
    log.warning("resuming from %s (step %d of %d)", path, step, steps)
    return False


def _layout(state: RunState) -> dict[str, int]:
    groups = state.groups
    return {"world": dist.get_world_size(), "tp": groups.tp_size, "pp": groups.pp_size, "ep": groups.ep_size,
            "etp": groups.etp_size, "dp": groups.dp_size, "engines": state.rollout_engines}


@dataclass
class RunState:
    """What a checkpoint of a run holds, whatever the loop (RL, SFT, DPO)."""

    groups: ParallelGroups
    engines: dict[str, TrainEngine]  # trained models by name ("actor", "critic"); frozen ones are rebuilt
    sampler: PromptSampler           # this data-parallel replica's prompt sampler
    rollout_engines: int = 0         # RL: the job's rollout engines (their sampler RNG is saved per engine)
    extra: Callable[[], dict] = dict  # the loop's own JSON state (RL: weight version, KL controller, rollouts)
    load_extra: Callable[[dict], None] = lambda saved: None  # restores it from state.json
    # (directory, step): the loop's own files, every rank (RL: the rollouts', e.g. each engine's sampler RNG)
    save_files: Callable[[Path, int], None] | None = None
    load_files: Callable[[Path, dict, int], None] | None = None  # (directory, state.json, step): read them back
    # a context in which the engines' state is on the device, to be read (RL: onloaded from the host, where a
    # co-located run keeps it while the rollout engines generate); `final`: the run ends after it (the rollout
    # engines are not woken again)
    resident: Callable[..., AbstractContextManager] = lambda final=False: contextlib.nullcontext()
    # (phase, bytes by transient owner): count what the device holds (RL, colocated: megarl.ledger); then check
    count_device: Callable[..., None] = lambda phase, **transient: None
    check_device: Callable[[], None] = lambda: None
    # the loop's step writes its periodic checkpoints itself, where its trainer's state is already on the device
    # (RL, colocated: between the update and the weight push, so no second hand-over follows a checkpoint)
    saves_in_step: bool = False
    last_saved: Path | None = None  # the run's newest checkpoint (save_checkpoint records it) and its step
    last_saved_step: int = 0


def checkpoint_due(cfg: Config, step: int, steps: int) -> bool:
    """A periodic checkpoint follows `step` (`checkpoint.every_steps`; the last step's is the final one)."""
    every = cfg.checkpoint.every_steps
    return bool(every) and step % every == 0 and step < steps


def save_checkpoint(cfg: Config, step: int, state: RunState, *, final: bool = False, held: bool = False) -> Path:
    """Save a run after `step` (a collective call: every rank writes its share); returns the directory and
    records it in `state.last_saved`. A full disk is a CheckpointError that says so and names the directory.
    `final`: the run ends after it (the rollout engines are not woken again). `held`: the caller holds the
    trainer's state on the device already (`state.saves_in_step`), so no `state.resident` wraps the write."""
    name = [str(temporary_dir(checkpoint_root(cfg), step)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    try:
        if held:
            state.count_device("checkpoint")
        with contextlib.nullcontext() if held else state.resident(final=final):
            state.last_saved, state.last_saved_step = _write_checkpoint(cfg, step, state, tmp), step
            return state.last_saved
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        full = disk_full_error(e, tmp)
        if full is not None:
            raise full from e
        raise


def _write_checkpoint(cfg: Config, step: int, state: RunState, tmp: Path) -> Path:
    groups, engines = state.groups, state.engines
    for key, engine in engines.items():
        engine.save_checkpoint(tmp / key)
    inject.at("checkpoint")
    inject.checkpoint_written(tmp)
    if dist.get_rank() == groups.mp_src_global_rank:  # one writer per data-parallel replica
        torch.save({"sampler": state.sampler.state_dict()}, tmp / f"dp{groups.dp_rank:05d}.pt")
    torch.save(trainer_rng_state(), tmp / f"rank{dist.get_rank():05d}.pt")
    if state.save_files is not None:
        state.save_files(tmp, step)
    if dist.get_rank() == 0:
        saved = {"step": step, "engine_steps": {k: e.step for k, e in engines.items()}, "layout": _layout(state),
                 **state.extra()}
        (tmp / "state.json").write_text(json.dumps(saved, indent=2) + "\n")
        dump_config(cfg, tmp / "recipe.yaml")
        (tmp / "hf").mkdir()
        copy_side_files(cfg.model.path, tmp / "hf")
    dist.barrier()
    _write_manifest(tmp, checksums=cfg.checkpoint.checksums)
    final = checkpoint_root(cfg) / step_dir_name(step)
    if dist.get_rank() == 0:
        final = publish(tmp, step=step, keep_last=cfg.checkpoint.keep_last)
        log.info("checkpoint of step %d saved to %s", step, final)
    dist.barrier()
    return final


def _write_manifest(tmp: Path, *, checksums: bool) -> None:
    """Every file of the checkpoint in `tmp`, written by all ranks, described in its manifest: each rank sizes
    and hashes its share of the files, rank 0 writes what they found (a collective call)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    names = [checkpoint_files(tmp) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    shares: list[dict | None] = [None] * world
    dist.all_gather_object(shares, describe_files(tmp, names[0][rank::world], checksums=checksums))
    if rank == 0:
        files = {name: entry for share in shares for name, entry in share.items()}
        (tmp / MANIFEST).write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")


def restore_checkpoint(path: Path, state: RunState) -> int:
    """Restore what `save_checkpoint` wrote to `path` into `state`; returns the step it holds."""
    saved_state = json.loads((path / "state.json").read_text())
    groups = state.groups
    for key, engine in state.engines.items():
        if key not in saved_state["engine_steps"]:
            raise CheckpointError(f"{path}: has no {key}, which this recipe trains")
        engine.load_checkpoint(path / key)
        engine.step = saved_state["engine_steps"][key]
    saved, now = saved_state["layout"], _layout(state)
    saved = {"etp": saved["tp"], **saved}  # a layout saved without etp split its experts over tp
    if saved["dp"] == now["dp"]:
        mine = torch.load(path / f"dp{groups.dp_rank:05d}.pt", weights_only=True)
        state.sampler.load_state_dict(mine["sampler"])
    else:
        # Each replica's prompts came from one global stream; continuing after the furthest position
        # repeats no prompt. Sampling is seeded again, so samples differ from an uninterrupted run.
        positions = [torch.load(p, weights_only=True)["sampler"] for p in sorted(path.glob("dp*.pt"))]
        state.sampler.load_state_dict(max(positions, key=lambda s: (s["epoch"], s["position"])))
        log.warning("resuming with data-parallel size %d, saved with %d: the data order continues, the "
                    "rollout samples differ from an uninterrupted run", now["dp"], saved["dp"])
    if {k: v for k, v in saved.items() if k != "engines"} == {k: v for k, v in now.items() if k != "engines"}:
        set_trainer_rng_state(torch.load(path / f"rank{dist.get_rank():05d}.pt", weights_only=True))
    else:
        log.info("resuming at layout %s (saved at %s): trainer RNG streams start fresh", now, saved)
    state.load_extra(saved_state)
    if state.load_files is not None:
        state.load_files(path, saved_state, int(saved_state["step"]))
    return int(saved_state["step"])
