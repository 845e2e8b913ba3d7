"""Colocated placement: the rollout engines live on the training ranks' own devices, one on the first rank of
every group of `rollout.tp` ranks (megarl.rollout.placement), and the two sides take turns with the memory.

A round generates on the engines of this rank's exchange group (every device generates, whatever the trainer's
layout): the group's replicas pool their prompts, the samples are split over its engines by prompt tokens,
each engine's rank scores what its engine generated, and every rank receives its replica's batch. Between two
rounds of generation the trainer updates: the engines release their memory, the trainer's state comes back to
the device, and after the update the trainer parks its state on the host, pushes the new weights and gives the
devices back (`hand_over`).

An engine that fails (megarl.rollout.engine.EngineError: its process died, a call raised in it or stopped
making progress) is abandoned at once, and every rank of the job meets to recover after each round of
generation and after each push (`recover`, one all-reduce): the failed engines start again from the
checkpoint they started from, every engine is given the current weights again (the same version), and the
failed engines' samples go on from their last finished turn, so no prompt is lost or generated twice. Past
`rollout.max_engine_restarts` restarts in the run, every rank raises EngineLost (the run saves its last
complete step and stops). The rounds of generation run in lockstep over the whole job for this.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import inject
from megarl.algo.aggregate import group_sums
from megarl.batch import RolloutBatch
from megarl.data.prompts import PromptRow
from megarl.device import host_barrier
from megarl.engine.parallel import ParallelGroups
from megarl.envs.trajectories import Trajectory
from megarl.handoff import WeightCheck, push_weights
from megarl.job import Job
from megarl.loops.faults import EngineLost
from megarl.loops.rl_run import RLRun
from megarl.loops.sampling import draw_batch
from megarl.loops.samples import EnginePart, build_batch, encode_rows, pooled_samples, with_rewards
from megarl.metrics import PhaseTimer
from megarl.packing import balanced_partition
from megarl.rewards.scorer import Scoring
from megarl.rollout.backends import make_rollout_engine, make_rollout_node_part, make_rollout_peer
from megarl.rollout.engine import EngineError, RolloutEngine, RolloutPeer
from megarl.rollout.placement import RolloutPlacement, place_rollout, share_init_addr

log = logging.getLogger(__name__)


class ColocatedRollouts:
    """The rollouts of colocated placement (megarl.loops.rl_run.Rollouts)."""

    scores_here = True

    def __init__(self, job: Job, groups: ParallelGroups):
        cfg = job.cfg
        self.cfg, self.groups, self.shape = cfg, groups, job.shape
        self.placement = place_rollout(rollout_tp=cfg.rollout.tp, replica=groups.mp, timeout=groups.timeout,
                                       nodes=job.layout.engine_nodes)
        self.engines = self.placement.engines
        self.engine: RolloutEngine | None = None  # this rank's: on the first rank of every group of rollout.tp ranks
        self.peer: RolloutPeer | None = None      # beside an engine's host: its side of every push
        self.node = None  # on the first rank of node k >= 1 of an engine over whole nodes: SGLang's part there
        # the tensors of each push that the host compares with its engine's copy (rollout.verify_weights)
        self.check = WeightCheck(cfg.rollout.verify_weights, period=cfg.rollout.verify_period)
        self.model_dir = cfg.model.path  # the checkpoint the engines start from (the warm start's, when there is one)
        self.failure: EngineError | None = None  # this rank's engine failed since the last recovery
        self.restarts = 0  # engine restarts in this run, every engine counted (the same on every rank)
        self.lost = False  # restarts are spent: nothing is pushed any more (the run saves and stops)
        self.rng = None  # the engine's sampler state before its last generation: a restarted engine starts there
        self.redispatched = 0  # samples this rank's engines generated again after a failure, over the run
        self.released = 0  # bytes this rank's engine gave back at the step's release (rollout/released_bytes)

    def start(self, model_dir: str) -> None:
        """The engine of this rank, seeded by its index (so a run resumed at another trainer layout with the same
        world size samples as the one that saved it), which releases its memory once its KV cache is sized; then
        every rank waits for every engine of the job."""
        place = self.placement
        self.model_dir = model_dir
        if place.hosts_engine:
            self.engine = self.new_engine()
            self.engine.release_memory()  # its KV cache is sized; the trainer is built in the memory it gives back
        elif place.engine_group is not None:
            if place.node_part is not None:
                self.node = self.new_node_part()
            self.peer = make_rollout_peer(self.cfg.rollout, place.engine_group)
        # An SGLang engine's TP schedulers size the KV cache from the memory free on each of the group's devices
        # (and refuse an imbalance), so no trainer model may be built on them before. On the host side: NCCL's
        # communicators are not made yet.
        host_barrier()

    def new_engine(self) -> RolloutEngine:
        """This rank's engine over `model_dir`; a restarted one samples from a stream of its own."""
        cfg, place = self.cfg, self.placement
        # MoE: every run captures the engines' routing, for moe/routing_agreement and r3
        return inject.engine(make_rollout_engine(
            cfg.rollout, self.model_dir, shape=self.shape, dtype=cfg.model.dtype, seed=self.engine_seed(),
            capture_routes=self.shape.is_moe, group=place.engine_group, lora=self.engine_lora(),
            nodes=place.nodes, init_addr=share_init_addr(place) if place.nodes > 1 else None))

    def new_node_part(self):
        """SGLang's part of this rank's engine on this node (node k >= 1 of an engine over whole nodes), started
        while the engine's host starts node 0."""
        cfg, place = self.cfg, self.placement
        return make_rollout_node_part(cfg.rollout, self.model_dir, dtype=cfg.model.dtype, seed=self.engine_seed(),
                                      nodes=place.nodes, node_rank=place.node_part, init_addr=share_init_addr(place),
                                      capture_routes=self.shape.is_moe, lora=self.engine_lora())

    def engine_seed(self) -> int:
        return self.cfg.seed + self.placement.engine_of + self.restarts * self.engines

    def engine_lora(self):
        return self.cfg.model.lora if self.cfg.rollout.lora_sync == "adapter" else None

    # -- engine failures
    def call(self, fn: Callable[[RolloutEngine], object]) -> object:
        """`fn(this rank's engine)`, or None without running it where there is none or it failed. A failure
        (EngineError, which names its phase) abandons the engine and is kept for `recover`; None then too."""
        if self.engine is None or self.failure is not None:
            return None
        try:
            return fn(self.engine)
        except EngineError as e:
            self.failed(e)
            return None

    def failed(self, error: EngineError) -> None:
        """This rank's engine failed: its processes and memory go at once; it starts again at `recover`."""
        self.failure = error
        log.error("rollout engine %d failed: %s; it is started again once every rank knows",
                  self.placement.engine_index, error)
        self.engine.abandon()

    def recover(self, run: RLRun) -> bool:
        """Every rank of the job: False when no engine failed since the last call. Otherwise each failed engine
        is started again, every engine is given the current weights (the same version: the failed engine's
        restart took the checkpoint's), and True is returned: the caller goes on with what the failed engines
        had not finished. Past `rollout.max_engine_restarts` every rank raises EngineLost, naming each failed
        engine and its error."""
        if self.lost:
            return False
        place = self.placement
        if self.node is not None and self.node.dead is not None and self.failure is None:
            self.failure = EngineError(phase="serve", cause=self.node.dead)  # its node's schedulers stopped
        failed, = group_sums([float(self.failure is not None)], group=dist.group.WORLD)
        if not failed:
            return False
        reports: list = [None] * dist.get_world_size()
        mine = None if self.failure is None else (place.engine_of, str(self.failure))
        dist.all_gather_object(reports, mine)
        named = "; ".join(f"rollout engine {engine}: {why}" for engine, why in filter(None, reports))
        failed_engines = {engine for engine, _ in filter(None, reports)}
        self.restarts += int(failed)
        limit = self.cfg.rollout.max_engine_restarts
        if self.restarts > limit:
            self.lost = True
            raise EngineLost(f"{named}. That is failure {self.restarts} of a rollout engine in this run, past "
                             f"rollout.max_engine_restarts = {limit}")
        log.warning("restarting (restart %d of at most %d): %s", self.restarts, limit, named)
        if place.engine_of in failed_engines and (place.hosts_engine or place.node_part is not None):
            # an engine over whole nodes starts again on all of them, whichever node failed
            if self.failure is None:
                for held in (self.engine, self.node):
                    if held is not None:
                        held.abandon()
            self.failure = None
            try:
                if place.hosts_engine:
                    self.engine = self.new_engine()
                else:
                    self.node = self.new_node_part()
            except Exception as e:  # noqa: BLE001 - a restart that fails counts as one more failure
                self.engine = self.node = None
                self.failure = EngineError(phase="start", cause=f"{type(e).__name__}: {e}")
            if self.engine is not None and self.rng is not None:
                # it samples the failed calls as the failed engine would have (where its sampler state is
                # saved: the native engine), so a single-turn run computes the numbers of one never failed
                self.engine.set_rng_state(self.rng)
            self.call(lambda engine: engine.release_memory())
        host_barrier()  # every engine has sized its KV cache before the trainer takes the devices back
        with self.resident(run):
            pass
        return True

    # -- generation
    def next_batch(self, run: RLRun, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        return draw_batch(run, timer, ColocatedRounds(run, self))

    def generate_now(self, run: RLRun, rows: list[PromptRow]) -> RolloutBatch | None:
        """Samples of `rows` outside the training stream (the evaluation): the engine's sampler state is set back
        after them, so the training samples do not depend on whether or how often the run evaluates, and a
        checkpoint written before them (`RunState.saves_in_step`) holds the sampler state of the run's next
        generation."""
        rng = self.engine.rng_state() if self.engine is not None and self.failure is None else None
        batch, _, _, _ = score(run, self.placement, generate(run, self, rows, n_samples=1))
        if rng is not None and self.engine is not None and self.failure is None:
            self.engine.set_rng_state(rng)
            self.rng = rng
        return batch

    # -- the memory and the weights
    def release(self) -> None:
        self.released = self.call(lambda engine: engine.release_memory()) or 0

    def device_bytes(self) -> dict[str, int]:
        return self.engine.device_bytes() if self.engine is not None and self.failure is None else {}

    def hand_over(self, run: RLRun, timer: PhaseTimer) -> dict:
        """The trainer's gradients and optimizer state leave the device, the weights are pushed (as version
        `run.weight_version`), the trainer's parameters leave too and the engines take back
        their KV cache; then every rank meets to recover engines that failed meanwhile (`recover`)."""
        with timer("sleep_trainer"):
            offloaded = sum(engine.offload_training_state() for engine in (run.actor, run.critic)
                            if engine is not None)
        with timer("push"):
            push_stats = self.push(run)
        # while the last bucket is in flight: the trainer's parameters, the engine's weights, the push's buffers
        if run.ledger is not None:
            gathered = max(push_stats.get("largest_tensor_bytes", 0), run.ledger.largest_full_tensor)
            run.count_device("push", handoff_bucket=push_stats.get("largest_bucket_bytes", 0),
                             handoff_gathered_tensors=2 * gathered)
        with timer("wake_rollout"):
            offloaded += sum(engine.offload_params() for engine in run.trainer_engines())
            self.call(lambda engine: engine.resume_cache())
        self.recover(run)
        return push_stats | {"offloaded_bytes": offloaded}

    def push(self, run: RLRun) -> dict:
        """Hand the trainer's weights to the rollout engine as version `run.weight_version` (every rank of the
        pipeline joins the gathers); its host then compares the engine's copy of the tensors `self.check`
        selects with the ones it pushed. A host whose engine failed still takes its part in the collectives."""
        if self.lost:
            return {"bytes": 0, "verified": 0}
        if self.cfg.rollout.lora_sync == "adapter":
            return self.push_adapter(run)
        tensors = run.actor.pipeline_hf_tensors()
        bucket_bytes = self.cfg.rollout.bucket_bytes
        if self.peer is not None:
            return self.peer.push(tensors, bucket_bytes=bucket_bytes) | {"verified": 0}
        if self.placement.hosts_engine and self.failure is None:
            self.call(lambda engine: engine.resume_weights())
        if not self.placement.hosts_engine or self.failure is not None:
            return self.stand_in(tensors, bucket_bytes=bucket_bytes)
        stats = self.call(lambda engine: push_weights(
            engine, tensors, bucket_bytes=bucket_bytes, version=run.weight_version,
            verify=self.check.select(run.weight_version), dtype=getattr(torch, self.cfg.model.dtype),
            engine_name=f"rollout engine {self.placement.engine_index}"))
        # a push that failed midway: the engine finished its part in its group's collectives (SGLangEngine);
        # the trainer's gathers go on to the end
        return stats or {"bytes": sum(t.numel() * t.element_size() for _, t in tensors), "verified": 0}

    def push_adapter(self, run: RLRun) -> dict:
        """rollout.lora_sync: adapter. Every rank of the pipeline joins the adapters' gathers (a few MiB: they are
        held whole); the host hands them to its engine, which applies them over the base weights it started
        from. Beside a host there is nothing to do: SGLang reads the adapters from the host's memory for each
        of its TP ranks. The engine cannot read adapters back: the drift check (rollout.max_logprob_drift)
        watches this push."""
        lora = self.cfg.model.lora
        tensors = list(run.actor.pipeline_adapter_tensors())
        if self.placement.hosts_engine and self.failure is None:
            self.call(lambda engine: engine.resume_weights())
            self.call(lambda engine: engine.update_adapter(tensors, rank=lora.rank, alpha=lora.alpha,
                                                           version=run.weight_version))
            self.call(lambda engine: engine.flush_cache())
        return {"bytes": sum(t.numel() * t.element_size() for _, t in tensors), "verified": 0}

    def stand_in(self, tensors, *, bucket_bytes: int) -> dict:
        """A push without an engine on this rank, or with a failed one: every collective a push runs, nothing
        loaded (the trainer's gathers; a failed host takes its engine's part beside the engine's peers)."""
        if self.placement.hosts_engine and self.placement.engine_group is not None:
            return make_rollout_peer(self.cfg.rollout, self.placement.engine_group).push(
                tensors, bucket_bytes=bucket_bytes) | {"verified": 0}
        return {"bytes": sum(t.numel() * t.element_size() for _, t in tensors), "verified": 0}

    def run_part(self, run: RLRun, part: EnginePart | None) -> None:
        """This rank's share of a round (`part`, on a rank that hosts an engine) on its engine; then every rank
        meets, and after each recovery the restarted engines go on with their parts."""
        if self.node is not None and self.failure is None:
            inject.node_part(self.node)
        while True:
            if part is not None and self.failure is None:
                self.rng = self.engine.rng_state()
                if (error := part.run(self.engine)) is not None:
                    self.redispatched += part.unfinished()
                    self.failed(error)
            if not self.recover(run):
                if part is not None:
                    self.rng = self.engine.rng_state()  # what a restart before the next generation starts from
                return

    def versions(self, run: RLRun, step: int) -> tuple[int, int]:
        """Exactly the version pushed last: the engines generate between two pushes."""
        return run.weight_version, run.weight_version

    def metrics(self, run: RLRun) -> dict[str, float]:
        """Engine restarts and the samples generated again after them so far, and the bytes the job's engines
        gave back at this step's release."""
        released, redispatched = group_sums([float(self.released), float(self.redispatched)], group=dist.group.WORLD)
        return {"rollout/engine_restarts": float(self.restarts), "rollout/redispatched": redispatched,
                "rollout/released_bytes": released}

    @contextlib.contextmanager
    def resident(self, run: RLRun, *, final: bool = False) -> Iterator[None]:
        """The engines give their memory back first, as before an update: the trainer never shares the device
        with a KV cache. Their weights are released with it (unless they take adapters alone), so the end of
        the block pushes them again (the same version). A periodic checkpoint does not come here: the RL step
        writes it before its own push (`RunState.saves_in_step`). `final`: the run
        ends after the block (its last checkpoint, then the export); the engines stay released and the trained
        models' gradients and optimizer state leave the device, so the export onloads nothing beside them."""
        self.release()
        for engine in run.trainer_engines():
            engine.onload()
        run.count_device("checkpoint")
        yield
        if final:
            for engine in (run.actor, run.critic):
                if engine is not None:
                    engine.offload_training_state()
        else:
            self.hand_over(run, PhaseTimer())
        run.check_device()

    # -- checkpoints: each engine's sampler RNG
    def state(self) -> dict:
        return {}

    def save(self, directory: Path, step: int) -> None:
        if self.engine is not None:
            torch.save({"rollout_rng": self.engine.rng_state()},
                       directory / f"engine{self.placement.engine_index:05d}.pt")

    def restore(self, directory: Path, saved: dict, step: int) -> None:
        """The engine's sampler RNG when the checkpoint was written by as many engines as this run has."""
        if self.engine is None:
            return
        engines = saved["layout"].get("engines")
        if engines != self.engines:
            log.warning("resuming with %d rollout engines, saved with %s: the engines' samplers are seeded again, "
                        "so samples differ from an uninterrupted run", self.engines, engines)
            return
        rng = torch.load(directory / f"engine{self.placement.engine_index:05d}.pt", weights_only=True)["rollout_rng"]
        if rng is not None:
            self.engine.set_rng_state(rng)

    def close(self) -> None:
        if self.engine is not None and self.failure is None:
            self.engine.shutdown()
        if self.node is not None:
            self.node.shutdown()


class ColocatedRounds:
    """Rounds on the engines of this rank's exchange group (megarl.loops.sampling.Rounds)."""

    def __init__(self, run: RLRun, rollouts: ColocatedRollouts):
        self.run, self.rollouts = run, rollouts

    def next(self, draw: int, timer: PhaseTimer, *, first_group: int) -> tuple[RolloutBatch | None, int, int, int]:
        run = self.run
        with timer("generate"):
            rows = [run.train_rows[i] for i in run.sampler.next_batch(draw)] if draw else []
            generated = generate(run, self.rollouts, rows, n_samples=run.cfg.rollout.n_samples,
                                 first_group=first_group)
        if run.ledger is not None and generated.batch is not None:
            run.ledger.see_prompts(int(generated.batch.prompt_lens.max()))
        run.count_device("rollout")  # the trainer parked, the engine with the KV cache of its generation
        with timer("reward"):
            return score(run, self.rollouts.placement, generated)

    def anyone(self, flag: bool) -> bool:
        """Over the whole job (not the exchange group alone): every rank runs as many rounds, so every rank
        meets after each of them to recover failed engines (ColocatedRollouts.recover)."""
        if dist.get_world_size() == 1:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value)


@dataclass
class Generated:
    """One round of generation as this rank sees it: its replica's batch, and what its engine (when it hosts
    one) must still score."""

    batch: RolloutBatch | None        # this replica's samples in order; None when it drew no prompt this round
    scoring: Scoring | None           # the rewards of this engine's samples, on a rank that hosts an engine
    part: list[int]                   # exchange-wide indices of the samples this rank's engine generated
    replica: list[int]                # exchange-wide indices of this replica's samples, in batch order
    reporter: bool                    # this replica reports its exchange group's counts (the group's first)


def generate(run: RLRun, rollouts: ColocatedRollouts, rows: list[PromptRow], *, n_samples: int,
             first_group: int = 0) -> Generated:
    """Sample `n_samples` trajectories for each row, each with its own environment (megarl.envs.trajectories;
    with the single_turn environment, one response per sample), on the engines of this rank's exchange
    group: the group's replicas pool their prompts, the samples are split over the engines by prompt tokens,
    and every rank receives its replica's batch, its groups numbered from `first_group`. Each response the
    rewards score (a sample's last turn) goes to its engine's scorer as soon as it is final, while the engine
    generates the others."""
    place = rollouts.placement
    encoded = encode_rows(run, rows)
    # every replica of the exchange group, in data-parallel order (its ranks all hold the same rows)
    shares = {dp: (their_rows, their_ids)
              for dp, their_rows, their_ids in exchange(place, (run.groups.dp_rank, rows, encoded))}
    samples = pooled_samples(shares, n_samples=n_samples)
    parts = balanced_partition([len(ids) for _, _, ids in samples], len(place.exchange_engines))
    part = parts[place.exchange_engines.index(dist.get_rank())] if place.hosts_engine else []
    engine_part = EnginePart(run, [samples[i][1:] for i in part]) if place.hosts_engine else None
    rollouts.run_part(run, engine_part)
    scoring, mine = None, None
    if engine_part is not None:
        generated, scoring = engine_part.result()
        mine = (part, generated)
    trajectories: dict[int, Trajectory] = {}
    engine_of: dict[int, int] = {}  # sample -> the engine that generated it (the engine of rank r is r // tp)
    for rank, done in zip(place.exchange_ranks, exchange(place, mine)):
        if done is not None:
            trajectories.update(zip(*done))
            engine_of.update((i, rank // place.tp) for i in done[0])
    replica = [i for i, (dp, _, _) in enumerate(samples) if dp == run.groups.dp_rank]
    batch = None
    if replica:
        batch = build_batch(run.tokenizer, [samples[i][1] for i in replica], [samples[i][2] for i in replica],
                            [trajectories[i] for i in replica], engines=[engine_of[i] for i in replica],
                            n_samples=n_samples, first_group=first_group)
    return Generated(batch=batch, scoring=scoring, part=part, replica=replica,
                     reporter=run.groups.dp_rank == min(shares))


def exchange(place: RolloutPlacement, item) -> list:
    """`item` of every rank of the exchange group, in rank order."""
    if place.exchange is None:
        return [item]
    out = [None] * len(place.exchange_ranks)
    dist.all_gather_object(out, item, group=place.exchange)
    return out


def score(run: RLRun, place: RolloutPlacement, generated: Generated) -> tuple[RolloutBatch | None, int, int, int]:
    """The replica's batch with the recipe's rewards [B], plus the environment's and the reward models'; and
    the number of samples whose reward failed (scored 0; see Scorer), the number already scored when
    generation ended, and the number of engines that generated, over the exchange group, on the replica
    that reports them (0 on the group's other replicas, so sums over data-parallel ranks count each once).

    Each engine's rank scores the samples its engine generated (a sandbox or a Ray pool runs once per
    sample, not once per rank) and the exchange group shares the rewards. Reward-model terms need the
    trainer's ranks, so they are scored here, after generation, over `batch.tokens`.
    """
    result = (generated.part, *generated.scoring.result()) if generated.scoring is not None else None
    rewards_of: dict[int, float] = {}
    counts = torch.zeros(3, dtype=torch.float64)  # failures, scored before generation ended, engines
    for item in exchange(place, result):
        if item is not None:
            part, rewards, _, _ = item
            rewards_of.update(zip(part, rewards))
    if result is not None:
        counts += torch.tensor([result[2], result[3], int(bool(generated.part))], dtype=torch.float64)
    if place.exchange is not None:  # every sample was scored by exactly one engine's rank
        dist.all_reduce(counts, group=place.exchange)
    failures, hidden, engines = (int(c) * generated.reporter for c in counts.tolist())
    batch = generated.batch
    if batch is None:
        return None, failures, hidden, engines
    rewards = torch.tensor([rewards_of[i] for i in generated.replica])
    batch = with_rewards(batch, rewards, reward_models=run.reward_models,
                         micro_batch_size=run.cfg.train.micro_batch_size, pad_id=run.tokenizer.pad_token_id,
                         unfinished=run.cfg.reward.unfinished)
    return batch, failures, hidden, engines
