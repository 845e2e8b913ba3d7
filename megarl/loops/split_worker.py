"""A rollout rank of split placement (megarl.loops.split describes the whole): the worker that hosts an engine
runs the training rank 0's commands in order (generate a batch, load a push, save or set its sampler RNG,
stop), and the ranks beside it wait for the end.

A worker whose engine fails starts it again in place (`Worker.restart`) from the last push, which it keeps on the
host while `rollout.max_engine_restarts` allows restarts, and generates what was unfinished again. Past that
bound the worker is lost: it answers every later request with its error and still takes its part in every push,
so the training ranks stop together at the first batch it did not generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from megarl import inject
from megarl.config import Config
from megarl.job import Job
from megarl.device import current_device, on_gpu
from megarl.envs.environment import environment_factory
from megarl.envs.tool_format import observation_format
from megarl.envs.trajectories import EnvWorkers
from megarl.handoff import unflatten, verify_engine
from megarl.loops.samples import EnginePart, pooled_samples
from megarl.loops.launch import job_store
from megarl.loops.split import Links
from megarl.loops.transport import Mailbox, own_group, receive_header
from megarl.packing import balanced_partition
from megarl.rewards.scorer import Scorer
from megarl.rollout.backends import make_rollout_engine
from megarl.rollout.engine import EngineError, RolloutEngine
from megarl.rollout.partial import VersionedEngine

log = logging.getLogger(__name__)


@dataclass
class RolloutRank:
    """What a worker holds: the fields of an RLRun that generation and scoring read
    (megarl.loops.samples.SampleContext), and its engine."""

    cfg: Config
    tokenizer: object
    rollout: VersionedEngine
    scorer: Scorer
    new_env: object
    tool_schemas: list[dict]
    observations: object
    env_workers: EnvWorkers


def serve_rollout(job: Job) -> None:
    """A rollout rank's whole run: build the engine, then run the training rank 0's commands in order until it
    says stop."""
    from transformers import AutoTokenizer

    cfg, layout = job.cfg, job.layout
    store, rank, _ = job_store(cfg.parallel.timeout_minutes)
    timeout = timedelta(minutes=cfg.parallel.timeout_minutes)
    box = Mailbox(store, timeout)
    inject.arm(cfg.faults, rank=rank, run_dir=cfg.run_dir)
    hosts = layout.engine_ranks
    workers = len(hosts)
    if rank not in hosts:  # beside a worker: its engine spans this device; nothing to run here
        box.take("done", keep=True)
        return
    index = hosts.index(rank)
    if on_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # the groups meet when first used (a run that turns out to be finished uses none)
    bridge = functools.partial(own_group, store, "weights", member=1 + index, size=1 + workers, timeout=timeout)
    links = functools.partial(Links, store, member=layout.dp + index, size=layout.dp + workers, timeout=timeout)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    def new_engine(restarts: int) -> RolloutEngine:  # a restarted one samples from a stream of its own
        return inject.engine(make_rollout_engine(cfg.rollout, cfg.model.path, shape=job.shape, dtype=cfg.model.dtype,
                                                 seed=cfg.seed + index + restarts * workers,
                                                 capture_routes=job.shape.is_moe), counts_calls=True)

    new_env = environment_factory(cfg.env)
    worker = Worker(box, bridge, links, index=index, workers=workers, replicas=layout.dp, new_engine=new_engine,
                    max_restarts=cfg.rollout.max_engine_restarts)
    place = cfg.placement
    # every token's version is recorded; with partial rollouts, pushed weights are taken between chunks
    worker.engine = VersionedEngine(new_engine(0),
                                    chunk_tokens=place.chunk_tokens if place.partial_rollouts else None,
                                    between_chunks=worker.take_pushed_weights)
    me = RolloutRank(cfg=cfg, tokenizer=tokenizer, rollout=worker.engine, scorer=Scorer(cfg.reward), new_env=new_env,
                     tool_schemas=new_env().tools, observations=observation_format(cfg.env, tokenizer),
                     env_workers=EnvWorkers(cfg.env.tool_workers))
    try:
        worker.serve(me)
    finally:
        me.scorer.close()
        me.env_workers.retire()
        worker.engine.shutdown()


class Worker:
    """A rollout rank with an engine: runs the training rank 0's commands in order."""

    def __init__(self, box: Mailbox, bridge, links, *, index: int, workers: int, replicas: int,
                 new_engine: Callable[[int], RolloutEngine], max_restarts: int):
        self.box, self.index, self.workers, self.replicas = box, index, workers, replicas
        self.bridge, self.links = functools.cache(bridge), functools.cache(links)  # made when first used
        self.new_engine, self.max_restarts = new_engine, max_restarts
        self.restarts = 0
        self.redispatched = 0  # samples generated again after the engine failed, over the run
        self.lost: str | None = None  # why its engine is gone for good (past max_restarts)
        # the last push, on the host, for an engine started again (with restarts allowed): (slots, bytes) per
        # bucket, and its version (0: the checkpoint the engines start from)
        self.kept: list[tuple[list, Tensor]] = []
        self.kept_version = 0
        self.rng = None  # the engine's sampler state before its last generation: a restarted engine starts there
        self.engine: VersionedEngine | None = None
        self.next = 0  # the next command's number
        self.waited = 0.0  # seconds spent waiting for a command since the last batch was posted

    def serve(self, me: RolloutRank) -> None:
        while True:
            start = time.monotonic()
            command, *args = self.box.take(f"cmd/{self.index}/{self.next}")
            self.next += 1
            self.waited += time.monotonic() - start
            if command == "generate":
                key, n_samples, evaluation = args
                self.generate(me, key, n_samples=n_samples, evaluation=evaluation)
                self.waited = 0.0
            elif command == "weights":
                self.load_weights(*args)
            elif command == "rng":  # to training rank 0, behind every sample sent before (a lost engine's last)
                rng = self.rng if self.lost else self.engine.rng_state()
                self.links().samples.send({"key": f"rng{args[0]}", "rng": rng}, to=0)
            elif command == "set_rng":
                rng = self.links().prompts.receive(0)
                if rng is not None:  # None: saved by a lost worker that never generated
                    self.engine.set_rng_state(rng)
            elif command == "stop":
                return
            else:
                raise RuntimeError(f"rollout worker {self.index}: unknown command {command!r}")

    def load_weights(self, version: int) -> None:
        """Load a push, then compare the engine's copy of the tensors the trainer fingerprinted (sent behind the
        last bucket) with the trainer's: a difference stops this worker, and with it the job. An engine that
        fails meanwhile is started again once the push is received (`restart`), and given it."""
        group = self.bridge()
        self.box.put(f"ready/{version}/{self.index}", True)  # the push may start
        kept: list[tuple[list, Tensor]] | None = [] if self.max_restarts else None
        received = _received(group, keep=kept)
        failure = None
        try:
            if self.lost:
                raise EngineError(phase="push", cause=self.lost)
            self.engine.update_weights(received, version=version)
            self.engine.flush_cache()
        except EngineError as e:
            failure = e
            for _ in received:  # the broadcast goes on to its end
                pass
        if kept is not None:
            self.kept, self.kept_version = kept, version
        expected = receive_header(group)  # the fingerprints behind the last bucket
        if failure is not None:
            if not self.lost:
                self.restart(failure)
            return
        verify_engine(self.engine, expected, version=version, engine_name=f"rollout worker {self.index}")

    def restart(self, error: EngineError) -> bool:
        """Start this worker's engine again and give it the last push (its version). Past `max_restarts` in the
        run, the worker is lost instead (`lost` says why, and the requests it answers from then on) and False
        is returned."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            self.lost = (f"rollout worker {self.index}: {error}. That is failure {self.restarts} of its engine in "
                         f"this run, past rollout.max_engine_restarts = {self.max_restarts}")
            log.error("%s; its requests are answered with this error from now on", self.lost)
            with contextlib.suppress(Exception):  # what is left of it
                self.engine.engine.abandon()
            return False
        log.warning("rollout worker %d: %s; restarting its engine (restart %d of at most %d)", self.index, error,
                    self.restarts, self.max_restarts)
        self.engine.engine.abandon()
        engine = self.new_engine(self.restarts)
        if self.rng is not None:  # it samples the failed call as the failed engine would have (native engine)
            engine.set_rng_state(self.rng)
        if self.kept_version:
            device = current_device()
            engine.update_weights((unflatten(flat.to(device), slots) for slots, flat in self.kept),
                                  version=self.kept_version)
            engine.flush_cache()
        self.engine.engine = engine
        return True

    def take_pushed_weights(self) -> None:
        """Between two chunks of a generation (partial rollouts): load the weights pushed meanwhile, if the next
        command is a push; any other command waits for the generation to end."""
        key = f"cmd/{self.index}/{self.next}"
        if not self.box.ready(key):
            return
        command, *args = self.box.take(key, keep=True)
        if command == "weights":
            self.box.drop(key)
            self.next += 1
            self.load_weights(*args)

    def generate(self, me: RolloutRank, key: str, *, n_samples: int, evaluation: bool = False) -> None:
        """Generate and score this worker's share of request `key` (the pooled prompts of every replica, split
        over the workers by prompt tokens as colocated engines split them), and send each replica its samples.
        An `evaluation` sets the engine's sampler back after it: the training samples do not depend on it."""
        links = self.links()
        shares = {dp: tuple(links.prompts.receive(dp)) for dp in range(self.replicas)}
        samples = pooled_samples(shares, n_samples=n_samples)
        first = {dp: min(i for i, s in enumerate(samples) if s[0] == dp) for dp in shares if shares[dp][0]}
        part = balanced_partition([len(ids) for _, _, ids in samples], self.workers)[self.index]
        trajectories, rewards, failures, hidden = [], [], 0, 0
        if part and not self.lost:
            engine_part = EnginePart(me, [samples[i][1:] for i in part])
            self.rng = me.rollout.rng_state()
            while (error := engine_part.run(me.rollout)) is not None:
                self.redispatched += engine_part.unfinished()
                if not self.restart(error):  # its samples go on from their last finished turn
                    break
            else:
                if evaluation:
                    me.rollout.set_rng_state(self.rng)
                self.rng = me.rollout.rng_state()  # what a restart before the next generation starts from
                trajectories, scoring = engine_part.result()
                rewards, failures, hidden = scoring.result()
        if self.lost:
            for dp in range(self.replicas):
                links.samples.send({"key": key, "lost": self.lost}, to=dp)
            return
        for dp in range(self.replicas):
            mine = [j for j, i in enumerate(part) if samples[i][0] == dp]
            links.samples.send({
                "key": key,
                "index": [part[j] - first[dp] for j in mine],
                # what the environments were given and returned stays here, where they are replayed
                "trajectories": [dataclasses.asdict(dataclasses.replace(trajectories[j], stepped=[])) for j in mine],
                "rewards": [rewards[j] for j in mine],
                # failures, scored before generation ended, engines that generated: counted once, on replica 0
                "counts": [failures, hidden, int(bool(part))] if dp == 0 else [0, 0, 0],
                "restarts": self.restarts, "redispatched": self.redispatched, "waited_s": self.waited}, to=dp)


def _received(group, *, keep: list | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """The buckets of a weight push, as the training rank 0 broadcasts them (each one's slots first; None ends
    the push); each bucket's (slots, bytes) also goes into `keep`, on the host, when given."""
    while (slots := receive_header(group)) is not None:
        flat = torch.empty(slots[-1][4], dtype=torch.uint8, device=current_device())  # the last slot's end
        group.broadcast(flat, 0).wait()
        if keep is not None:
            keep.append((slots, flat.cpu() if flat.is_cuda else flat))  # the CPU buffer is not reused
        yield unflatten(flat, slots)
