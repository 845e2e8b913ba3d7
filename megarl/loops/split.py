"""Split placement (asynchronous RL): rollout ranks of their own generate while the training ranks train.

A job of W ranks (torchrun) with `placement.rollout_ranks` R: ranks 0 ... W-R-1 train (Megatron's world, which
meets through its own prefix of torchrun's store) and ranks W-R ... W-1 generate. The first of every
`rollout.tp` rollout ranks hosts an engine (a *worker*, seeded `seed + worker index`); the others wait beside
it (on GPU an SGLang engine spans their devices).

What travels, and how:
- Commands, prompts and finished samples go through the job's key-value store (torchrun's TCPStore): one side
  posts a key, the other blocks on it, so neither side waits in a collective while the other works. Each
  replica's first rank posts its prompts; training rank 0 posts every worker's commands, which a worker runs
  strictly in order; a worker posts each replica's share of the samples it generated, scored.
- Weights go by a collective broadcast from training rank 0 to every worker (gloo on CPU, NCCL on GPU) in
  buckets of at most `rollout.bucket_bytes`, each bucket's names, shapes and dtypes posted first. The rest of
  replica 0 joins the gathers that build the full tensors; the other replicas do not.

The schedule is deterministic. Weight version v is the policy after v - 1 updates (version 1: the start).
Step n trains on batch n, which version max(1, n - N) generated (N = `algo.max_staleness`): at the start of
step n the trainers request every batch up to n + N, whose version has been pushed by then, and the workers
generate batch n + N while step n trains. With N = 0 this is the synchronous loop: a one-worker split run
computes the numbers of a colocated run with one engine. Every generated token records the version that
sampled it (RolloutBatch.weight_versions); the metrics `async/staleness_mean` and `async/staleness_max` are
read from them, `async/rollout_wait_s` is how long the step waited for its batch, `async/push_wait_s` how long the
step's weight push waited for the workers to finish the batches requested before it, and `async/train_wait_s`
how long the workers waited for the trainers (for weights, or for a request) before generating the batch.

With `placement.partial_rollouts` a worker generates in chunks and, between two, takes a push that is the next
command (megarl.rollout.partial): the push no longer waits for the generation, whose unfinished responses
continue under the new weights. A sample's staleness is its oldest token's; `async/partial_frac` counts the
samples that span two versions. Such a run is not reproducible bit for bit (when a push lands is a race).

Checkpoints lose nothing and regenerate nothing: the N batches requested but not yet trained are waited for
and saved with the checkpoint (plain tensors and lists), with the workers' sampler RNG after them, and a
resumed run hands them to its steps, so it computes the numbers of a run never stopped (without partial
rollouts).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.batch import RolloutBatch
from megarl.checkpoint import CheckpointError
from megarl.config import Config
from megarl.data.prompts import PromptRow
from megarl.device import current_device, host_barrier, on_gpu
from megarl.handoff import buckets, flatten, unflatten
from megarl.loops.launch import job_store, job_world, launch_layout
from megarl.metrics import PhaseTimer
from megarl.packing import balanced_partition
from megarl.rollout.multi_turn import Trajectory
from megarl.rollout.partial import VersionedEngine

# ---- the job ----------------------------------------------------------------------------------------------


def _job(cfg: Config) -> tuple[dist.Store, int, int, int]:
    """(store, rank, world size, training world size), the layout checked (megarl.loops.launch.launch_layout)
    on every rank of the job, the rollout ranks too."""
    store, rank, _ = job_store(cfg.parallel.timeout_minutes)
    world, ranks_per_node = job_world(cfg)
    return store, rank, world, launch_layout(cfg, world=world, ranks_per_node=ranks_per_node).world


def is_rollout_rank(cfg: Config) -> bool:
    _, rank, _, trainers = _job(cfg)
    return rank >= trainers


def dismiss_rollout_ranks(cfg: Config) -> None:
    """End the rollout ranks of a job whose training ranks stop before any command (a finished run resumed)."""
    store, _, _, _ = _job(cfg)
    box = Mailbox(store, timedelta(minutes=cfg.parallel.timeout_minutes))
    for w in range(cfg.placement.rollout_ranks // cfg.rollout.tp):
        box.put(f"cmd/{w}/0", ("stop",))
    box.put("done", True)


def _bridge_group(store: dist.Store, *, member: int, size: int, timeout: timedelta):
    """The weight broadcast's group: training rank 0 (member 0) and every worker (member 1 + index); made
    by those processes only, outside torch.distributed's world (the workers have none)."""
    store = dist.PrefixStore("megarl/weights/", store)
    backend = dist.ProcessGroupNCCL if on_gpu() else dist.ProcessGroupGloo
    return backend(store, member, size, timeout)


# what each kind of key carries, for the error of a wait that timed out
_WHAT = {"cmd": "a rollout worker's next command", "in": "a replica's prompts", "out": "a worker's samples",
         "weights": "a weight bucket's names and shapes", "ready": "a worker ready for a weight push",
         "rng": "a worker's sampler state", "done": "the end of the training ranks' run"}


class Mailbox:
    """Keys of the job's store holding pickled plain data (lists, dicts, numbers, strings, tensors)."""

    def __init__(self, store: dist.Store, timeout: timedelta):
        self.store, self.timeout = dist.PrefixStore("megarl/split/", store), timeout

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def take(self, key: str, *, keep: bool = False):
        """The value of `key`, waiting for it to be posted (up to parallel.timeout_minutes); removed unless
        `keep`."""
        try:
            self.store.wait([key], self.timeout)
        except dist.DistStoreError:
            raise TimeoutError(f"placement split: waited {self.timeout} (parallel.timeout_minutes) for {key!r} "
                               f"({_WHAT.get(key.split('/')[0], 'a message')}) from the other side of the job"
                               ) from None
        value = pickle.loads(self.store.get(key))
        if not keep:
            self.store.delete_key(key)
        return value

    def drop(self, key: str) -> None:
        self.store.delete_key(key)

    def ready(self, key: str) -> bool:
        """Whether `key` is posted (without waiting)."""
        return self.store.check([key])


# ---- a rollout rank ---------------------------------------------------------------------------------------


@dataclass
class RolloutRank:
    """What a worker holds: the fields of an RLRun that generation and scoring read
    (megarl.loops.generation.generate_part)."""

    cfg: Config
    tokenizer: object
    rollout: object
    scorer: object
    new_env: object
    observations: object
    env_workers: object


def serve_rollout(cfg: Config) -> None:
    """A rollout rank's whole run: build the engine, then run the training rank 0's commands in order until it
    says stop."""
    from transformers import AutoTokenizer

    from megarl.envs.environment import environment_factory
    from megarl.envs.tool_format import observation_format
    from megarl.models.arch import read_shape
    from megarl.rewards.scorer import Scorer
    from megarl.rollout.backends import captures_routes, make_rollout_engine
    from megarl.rollout.multi_turn import EnvWorkers

    store, rank, world, trainers = _job(cfg)
    timeout = timedelta(minutes=cfg.parallel.timeout_minutes)
    box = Mailbox(store, timeout)
    local, workers = rank - trainers, cfg.placement.rollout_ranks // cfg.rollout.tp
    if local % cfg.rollout.tp:  # beside a worker: its engine spans this device; nothing to run here
        box.take("done", keep=True)
        return
    index = local // cfg.rollout.tp
    if on_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # the broadcast group meets at the first push (a run that turns out to be finished never pushes)
    bridge = functools.partial(_bridge_group, store, member=1 + index, size=1 + workers, timeout=timeout)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    moe = read_shape(cfg.model.path).is_moe
    engine = make_rollout_engine(cfg.rollout, cfg.model.path, dtype=cfg.model.dtype, seed=cfg.seed + index,
                                 capture_routes=moe and captures_routes(cfg.rollout))
    new_env = environment_factory(cfg.env)
    worker = Worker(box, bridge, index=index, workers=workers)
    place = cfg.placement
    # every token's version is recorded; with partial rollouts, pushed weights are taken between chunks
    worker.engine = VersionedEngine(engine, chunk_tokens=place.chunk_tokens if place.partial_rollouts else None,
                                    between_chunks=worker.take_pushed_weights)
    me = RolloutRank(cfg=cfg, tokenizer=tokenizer, rollout=worker.engine, scorer=Scorer(cfg.reward), new_env=new_env,
                     observations=observation_format(cfg.env, tokenizer), env_workers=EnvWorkers(cfg.env.tool_workers))
    try:
        worker.serve(me)
    finally:
        me.scorer.close()
        me.env_workers.retire()
        engine.shutdown()


class Worker:
    """A rollout rank with an engine: runs the training rank 0's commands in order."""

    def __init__(self, box: Mailbox, bridge, *, index: int, workers: int):
        self.box, self.bridge, self.index, self.workers = box, bridge, index, workers
        self.group = None  # the weight broadcast's, made at the first push
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
                key, replicas, n_samples = args
                _generate(me, self.box, key, replicas=replicas, n_samples=n_samples, index=self.index,
                          workers=self.workers, waited=self.waited)
                self.waited = 0.0
            elif command == "weights":
                self.load_weights(*args)
            elif command == "rng":
                self.box.put(f"rng/{args[0]}/{self.index}", self.engine.rng_state())
            elif command == "set_rng":
                self.engine.set_rng_state(args[0][self.index])
            elif command == "stop":
                return
            else:
                raise RuntimeError(f"rollout worker {self.index}: unknown command {command!r}")

    def load_weights(self, version: int) -> None:
        if self.group is None:
            self.group = self.bridge()
        self.box.put(f"ready/{version}/{self.index}", True)  # the push may start
        self.engine.update_weights(_received(self.box, self.group, index=self.index, version=version),
                                   version=version)
        self.engine.flush_cache()

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


def _generate(me: RolloutRank, box: Mailbox, key: str, *, replicas: int, n_samples: int, index: int, workers: int,
              waited: float) -> None:
    """Generate and score this worker's share of request `key` (the pooled prompts of every replica, split over
    the workers by prompt tokens as colocated engines split them), and post each replica its samples."""
    from megarl.loops.generation import generate_part, pooled_samples

    shares = {dp: tuple(box.take(f"in/{key}/{dp}", keep=True)) for dp in range(replicas)}
    samples = pooled_samples(shares, n_samples=n_samples)
    first = {dp: min(i for i, s in enumerate(samples) if s[0] == dp) for dp in shares if shares[dp][0]}
    part = balanced_partition([len(ids) for _, _, ids in samples], workers)[index]
    trajectories, rewards, failures, hidden = [], [], 0, 0
    if part:
        trajectories, scoring = generate_part(me, [samples[i][1:] for i in part])
        rewards, failures, hidden = scoring.result()
    for dp in range(replicas):
        mine = [j for j, i in enumerate(part) if samples[i][0] == dp]
        box.put(f"out/{key}/{index}/{dp}", {
            "index": [part[j] - first[dp] for j in mine],
            "trajectories": [dataclasses.asdict(trajectories[j]) for j in mine],
            "rewards": [rewards[j] for j in mine],
            # failures, scored before generation ended, engines that generated: counted once, on replica 0
            "counts": [failures, hidden, int(bool(part))] if dp == 0 else [0, 0, 0],
            "waited_s": waited})


def _received(box: Mailbox, group, *, index: int, version: int) -> Iterator[list[tuple[str, Tensor]]]:
    """The buckets of weight version `version`, as the training rank 0 broadcasts them."""
    n = 0
    while (slots := box.take(f"weights/{index}/{version}/{n}")) is not None:
        flat = torch.empty(slots[-1][4], dtype=torch.uint8, device=current_device())  # the last slot's end
        group.broadcast(flat, 0).wait()
        yield unflatten(flat, slots)
        n += 1


# ---- the training ranks' side -------------------------------------------------------------------------------


class SplitRollout:
    """The training ranks' side: requests batches ahead of the steps that train them, collects them, pushes
    weights; the same calls on every training rank (SPMD)."""

    def __init__(self, cfg: Config, groups):
        store, _, _, _ = _job(cfg)
        timeout = timedelta(minutes=cfg.parallel.timeout_minutes)
        self.cfg, self.groups, self.box = cfg, groups, Mailbox(store, timeout)
        self.workers = cfg.placement.rollout_ranks // cfg.rollout.tp
        self.lead = dist.get_rank() == 0  # sends the commands and the weights
        self.writer = dist.get_rank() == groups.mp_src_global_rank  # posts its replica's prompts
        self.bridge = functools.partial(_bridge_group, store, member=0, size=1 + self.workers, timeout=timeout)
        self.group = None  # made at the first push, as the workers make theirs
        self.sent = [0] * self.workers  # commands posted to each worker
        self.requested = 0  # the last batch requested
        self.pending: dict[int, list[int]] = {}  # requested batch -> this replica's prompt rows (indices)
        self.version = 0  # the last weight version pushed
        self.collected: list[str] = []  # requests whose keys go once every rank has read them
        self.evals = 0

    # -- commands
    def _command(self, *command) -> None:
        """Post `command` to every worker (from training rank 0)."""
        if not self.lead:
            return
        for w in range(self.workers):
            self.box.put(f"cmd/{w}/{self.sent[w]}", command)
            self.sent[w] += 1

    def _request(self, run, key: str, rows: list[PromptRow], *, n_samples: int) -> None:
        from megarl.loops.generation import encode_rows

        if self.writer:
            self.box.put(f"in/{key}/{self.groups.dp_rank}", (rows, encode_rows(run, rows)))
        self._command("generate", key, self.groups.dp_size, n_samples)

    def _collect(self, run, key: str, rows: list[PromptRow], *, n_samples: int):
        """This replica's batch of request `key` with its rewards (None when it asked for no prompt), the
        counts [failures, scored early, engines], the versions and the longest worker wait."""
        from megarl.loops.generation import build_batch, with_rewards

        if self.lead:  # every rank has read the earlier requests' keys: they are past a collective since
            for done in self.collected:
                for dp in range(self.groups.dp_size):
                    self.box.drop(f"in/{done}/{dp}")
                    for w in range(self.workers):
                        self.box.drop(f"out/{done}/{w}/{dp}")
            self.collected = []
        self.collected.append(key)
        trajectories: dict[int, Trajectory] = {}
        rewards: dict[int, float] = {}
        counts, waited = torch.zeros(3, dtype=torch.float64), 0.0
        for w in range(self.workers):
            part = self.box.take(f"out/{key}/{w}/{self.groups.dp_rank}", keep=True)
            for i, t, r in zip(part["index"], part["trajectories"], part["rewards"]):
                trajectories[i], rewards[i] = Trajectory(**t), r
            counts += torch.tensor(part["counts"], dtype=torch.float64)
            waited = max(waited, part["waited_s"])
        if not rows:
            return None, counts, waited
        done = [trajectories[i] for i in range(len(rows) * n_samples)]  # the replica's samples, in order
        batch = build_batch(run, [row for row in rows for _ in range(n_samples)], [t.prompt_ids for t in done],
                            done, n_samples=n_samples)
        batch = with_rewards(run, batch, torch.tensor([rewards[i] for i in range(len(done))]))
        versions = torch.zeros_like(batch.tokens)
        for row, (start, t) in enumerate(zip(batch.prompt_lens.tolist(), done)):
            versions[row, start: start + len(t.versions)] = torch.tensor(t.versions)
        return batch.replace(weight_versions=versions * batch.response_mask.long()), counts, waited

    # -- the loop's calls
    def next_batch(self, run, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """Request the batches up to `step` + max_staleness not requested yet, then take batch `step` (with
        dynamic sampling, further rounds are requested now, behind those: the engines' current weights)."""
        from megarl.loops.generation import rollout

        cfg = self.cfg
        for k in range(self.requested + 1, step + cfg.algo.max_staleness + 1):
            self.pending[k] = run.sampler.next_batch(run.prompts_per_rank)
            self._request(run, f"b{k}", [run.train_rows[i] for i in self.pending[k]], n_samples=cfg.rollout.n_samples)
            self.requested = k
        start = time.monotonic()
        rounds = SplitRounds(self, run, step)
        batch, sampling = rollout(run, timer, rounds)  # dynamic sampling: more rounds
        waited_for_batch = time.monotonic() - start
        oldest, newest = sample_versions(batch)
        staleness = (step - oldest).double()
        n, stale_sum, partial = run.global_sums([float(len(batch)), float(staleness.sum()),
                                                 float((newest > oldest).sum())])
        worst = torch.tensor([float(staleness.max()), waited_for_batch, rounds.waited])
        if run.groups.dp_size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=run.groups.dp)
        return batch, {**sampling, "async/staleness_mean": stale_sum / n, "async/staleness_max": float(worst[0]),
                       "async/partial_frac": partial / n,
                       "async/rollout_wait_s": float(worst[1]), "async/train_wait_s": float(worst[2])}

    def generate_now(self, run, rows: list[PromptRow], *, n_samples: int) -> RolloutBatch | None:
        """Generate `rows` with the latest weights, after every batch requested so far (evaluation)."""
        key = f"e{self.evals}"
        self.evals += 1
        self._request(run, key, rows, n_samples=n_samples)
        batch, _, _ = self._collect(run, key, rows, n_samples=n_samples)
        return batch

    def push(self, run) -> dict:
        """Broadcast the actor's weights to every worker as the next version; a worker loads them once it
        has generated every batch requested before, so the push first waits for those (its "wait_s", on
        training rank 0: the engines were the slower side)."""
        self.version += 1
        groups = self.groups
        gathers = groups.dp_rank == 0 or groups.ep_size > 1  # the ranks whose gathers deliver the tensors
        waited = 0.0
        if self.lead:
            self._command("weights", self.version)
            if self.group is None:
                self.group = self.bridge()
            start = time.monotonic()
            for w in range(self.workers):
                self.box.take(f"ready/{self.version}/{w}")
            waited = time.monotonic() - start
        if gathers:
            # The gathering ranks start together once the workers are ready: a rank that ran ahead of the waiting
            # lead would queue a gather for every tensor and hold its buffers, up to a copy of the model.
            host_barrier(None if groups.ep_size > 1 else groups.mp)
        tensors = run.actor.pipeline_hf_tensors() if gathers else iter(())
        if not self.lead:
            return {"bytes": sum(t.numel() * t.element_size() for _, t in tensors)}  # drive the gathers
        nbytes, n = 0, 0
        for n, bucket in enumerate(buckets(tensors, bucket_bytes=self.cfg.rollout.bucket_bytes), start=1):
            flat, slots = flatten(bucket, device=current_device())
            for w in range(self.workers):
                self.box.put(f"weights/{w}/{self.version}/{n - 1}", slots)
            self.group.broadcast(flat, 0).wait()
            if on_gpu():  # one bucket in flight: wait() orders the stream only, not this host thread
                torch.cuda.current_stream().synchronize()
            nbytes += flat.numel()
        for w in range(self.workers):
            self.box.put(f"weights/{w}/{self.version}/{n}", None)  # the end of the push
        return {"bytes": nbytes, "wait_s": waited}

    def close(self) -> None:
        """Stop the workers (and the ranks beside them)."""
        self._command("stop")
        if self.lead:
            self.box.put("done", True)

    # -- checkpoints
    def state(self) -> dict:
        return {"max_staleness": self.cfg.algo.max_staleness, "workers": self.workers}

    def save(self, directory: Path, *, step: int) -> None:
        """The batches requested but not trained yet (waited for) and the workers' sampler RNG after them; the
        replicas' rows of those batches."""
        if self.writer:
            torch.save({"pending": self.pending}, directory / f"split_dp{self.groups.dp_rank:05d}.pt")
        if not self.lead:
            return
        ahead = {}
        for k in sorted(self.pending):
            for w in range(self.workers):
                for dp in range(self.groups.dp_size):
                    ahead[f"out/b{k}/{w}/{dp}"] = self.box.take(f"out/b{k}/{w}/{dp}", keep=True)
        self._command("rng", step)
        rng = [self.box.take(f"rng/{step}/{w}") for w in range(self.workers)]
        torch.save({"ahead": ahead, "rng": rng}, directory / "split.pt")

    def restore(self, directory: Path, saved: dict, *, step: int) -> None:
        here = self.state()
        if saved.get("split") != here:
            raise CheckpointError(f"{directory}: saved with placement split {saved.get('split')} "
                                  f"(algo.max_staleness, rollout workers); this run has {here}: resume with the "
                                  "same algo.max_staleness and placement.rollout_ranks / rollout.tp")
        mine = torch.load(directory / f"split_dp{self.groups.dp_rank:05d}.pt", weights_only=True)
        self.pending = mine["pending"]
        self.requested = max(self.pending, default=step)
        self.version = step
        if self.lead:
            kept = torch.load(directory / "split.pt", weights_only=True)
            for key, value in kept["ahead"].items():
                self.box.put(key, value)
            self._command("set_rng", kept["rng"])


class SplitRounds:
    """The rounds of step `step` (megarl.loops.generation.Rounds): the first is the batch requested ahead, a
    further one (dynamic sampling) is requested when it is drawn."""

    def __init__(self, split: SplitRollout, run, step: int):
        self.split, self.run, self.step, self.round = split, run, step, 0
        self.waited = 0.0  # the workers' longest wait for the trainers before generating this step's rounds

    def next(self, draw: int, timer: PhaseTimer) -> tuple[RolloutBatch | None, int, int, int]:
        split, run, n_samples = self.split, self.run, self.split.cfg.rollout.n_samples
        self.round += 1
        key = f"b{self.step}" if self.round == 1 else f"b{self.step}.{self.round}"
        with timer("generate"):
            if self.round == 1:
                rows = [run.train_rows[i] for i in split.pending.pop(self.step)]
            else:
                rows = [run.train_rows[i] for i in run.sampler.next_batch(draw)] if draw else []
                split._request(run, key, rows, n_samples=n_samples)
            batch, counts, waited = split._collect(run, key, rows, n_samples=n_samples)
        self.waited = max(self.waited, waited)
        failures, hidden, engines = (int(c) for c in counts.tolist())
        return batch, failures, hidden, engines

    def anyone(self, flag: bool) -> bool:
        """Every replica posts its prompts (maybe none) for every round: they decide together."""
        value = torch.tensor([int(flag)])
        if self.run.groups.dp_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.run.groups.dp)
        return bool(value)


def sample_versions(batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """[B] the oldest and the newest weight version among each sample's generated tokens: a sample continued
    under newer weights by a partial rollout has newest > oldest."""
    generated = batch.response_mask.bool()
    big = torch.iinfo(batch.weight_versions.dtype).max
    newest = torch.where(generated, batch.weight_versions, 0).max(dim=1).values
    oldest = torch.where(generated, batch.weight_versions, big).min(dim=1).values
    return torch.where(generated.any(dim=1), oldest, newest), newest

