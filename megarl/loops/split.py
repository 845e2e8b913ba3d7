"""Split placement (asynchronous RL): rollout ranks of their own generate while the training ranks train.

A job of W ranks (torchrun) with `placement.rollout_ranks` R: ranks 0 ... W-R-1 train (Megatron's world, which
meets through its own prefix of torchrun's store) and ranks W-R ... W-1 generate. The first of every
`rollout.tp` rollout ranks hosts an engine (a *worker*, seeded `seed + worker index`); the others wait beside
it (on GPU an SGLang engine spans their devices).

What travels, and how (megarl.loops.transport):
- Commands go through the job's key-value store (torchrun's TCPStore, which also serves rendezvous): training
  rank 0 posts every worker's commands, which a worker runs strictly in order; a worker posts that it is ready
  for a push. These are tens of bytes, whatever the batch (`async/store_bytes`).
- Prompts and finished samples go point to point over groups of their own (gloo on CPU, NCCL on GPU) between
  each replica's first rank and every worker: the replica sends its prompts to every worker, and each worker
  sends each replica its share of the samples it generated, scored (ids, logprobs, versions, rewards, MoE
  routes), as soon as its part of the request is done; the replica's first rank shares them with the rest of
  the replica. Neither side waits for the other to take a message (`async/transport_bytes`).
- Weights go by a collective broadcast from training rank 0 to every worker (gloo on CPU, NCCL on GPU) in
  buckets of at most `rollout.bucket_bytes`, each bucket's names, shapes and dtypes broadcast first. The rest
  of replica 0 joins the gathers that build the full tensors; the other replicas do not. Behind the last bucket
  go the fingerprints of the tensors the push verifies (rollout.verify_weights): each worker checks its engine's
  copy against them once loaded, and a difference stops the worker, and with it the job.

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

A worker whose engine fails (megarl.rollout.engine.EngineError) starts it again in place (megarl.loops.split_worker) with
the last push, which it keeps on the host while `rollout.max_engine_restarts` allows restarts, and generates
what was unfinished again. Past that bound the worker is lost: it answers every request from then on with the
error instead of samples (and still takes its part in every push), so the training ranks stop together at the
first batch it did not generate (EngineLost), saving the last step they completed with every batch requested:
a resumed run requests again those a lost worker answered, with the same prompts.

Checkpoints lose nothing and regenerate nothing: the N batches requested but not yet trained are waited for
and saved with the checkpoint by each replica (plain tensors and lists), with the workers' sampler RNG after
them, and a resumed run hands them to its steps, so it computes the numbers of a run never stopped (without
partial rollouts).
"""

from __future__ import annotations

import contextlib
import functools
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.batch import RolloutBatch
from megarl.checkpoint import CheckpointError
from megarl.job import Job
from megarl.data.prompts import PromptRow
from megarl.device import current_device, host_barrier, on_gpu
from megarl.engine.parallel import ParallelGroups
from megarl.envs.trajectories import Trajectory
from megarl.handoff import WeightCheck, buckets, fingerprinted, flatten
from megarl.loops.faults import EngineLost
from megarl.loops.launch import job_store
from megarl.loops.rl_run import RLRun
from megarl.loops.samples import build_batch, encode_rows, with_rewards
from megarl.loops.sampling import draw_batch
from megarl.loops.transport import Link, Mailbox, own_group, send_header
from megarl.metrics import PhaseTimer


# ---- the job ----------------------------------------------------------------------------------------------


def is_rollout_rank(job: Job) -> bool:
    """Whether this process is one of the job's rollout ranks (torchrun's rank past the training world)."""
    _, rank, _ = job_store(job.cfg.parallel.timeout_minutes)
    return rank >= job.layout.world


class Links:
    """Both sample links of a job (megarl.loops.transport.Link): prompts from the replicas' first ranks to the
    workers, samples back. Members: replica d is member d, worker w is member `replicas` + w. Made when first
    used, by every replica's first rank and every worker (a run that turns out to be finished makes none)."""

    def __init__(self, store: dist.Store, *, member: int, size: int, timeout: timedelta):
        self.prompts = Link(own_group(store, "prompts", member=member, size=size, timeout=timeout))
        self.samples = Link(own_group(store, "samples", member=member, size=size, timeout=timeout))

    @property
    def bytes(self) -> int:
        return self.prompts.bytes + self.samples.bytes


# ---- the training ranks' side -------------------------------------------------------------------------------


class SplitRollouts:
    """The training ranks' side (megarl.loops.rl_run.Rollouts): requests batches ahead of the steps that train
    them, collects them, pushes weights; the same calls on every training rank (SPMD). The training ranks keep
    their memory: nothing is released or parked."""

    scores_here = False  # the workers score what they generate

    def __init__(self, job: Job, groups: ParallelGroups):
        cfg = job.cfg
        store, _, _ = job_store(cfg.parallel.timeout_minutes)
        timeout = timedelta(minutes=cfg.parallel.timeout_minutes)
        self.cfg, self.groups, self.box = cfg, groups, Mailbox(store, timeout)
        self.workers = len(job.layout.engine_ranks)
        self.engines = self.workers
        self.lead = dist.get_rank() == 0  # sends the commands and the weights
        self.writer = dist.get_rank() == groups.mp_src_global_rank  # sends and takes its replica's messages
        dp = groups.dp_size
        # made when first used, as the workers make theirs
        self.bridge = functools.cache(functools.partial(own_group, store, "weights", member=0, size=1 + self.workers,
                                                        timeout=timeout))
        self.links = functools.cache(functools.partial(Links, store, member=groups.dp_rank, size=dp + self.workers,
                                                       timeout=timeout))
        self.sent = [0] * self.workers  # commands posted to each worker
        self.requested = 0  # the last batch requested
        self.pending: dict[int, list[int]] = {}  # requested batch -> this replica's prompt rows (indices)
        self.again: list[int] = []  # pending batches to request again (a checkpoint saved a lost worker's answer)
        self.taken: dict[str, dict[int, dict]] = {}  # request -> worker -> its message, taken ahead of its turn
        self.version = 0  # the last weight version pushed
        # the tensors of each push the workers compare with their engines' copies (rollout.verify_weights)
        self.check = WeightCheck(cfg.rollout.verify_weights, period=cfg.rollout.verify_period)
        self.evals = 0
        self.counted = (0, 0)  # store and link bytes of this rank when the metrics were last read
        self.restarts: dict[int, int] = {}  # worker -> its engine restarts, as its last samples said
        self.redispatched: dict[int, int] = {}  # worker -> the samples it generated again after them

    # -- commands
    def _command(self, *command) -> None:
        """Post `command` to every worker (from training rank 0)."""
        if not self.lead:
            return
        for w in range(self.workers):
            self.box.put(f"cmd/{w}/{self.sent[w]}", command)
            self.sent[w] += 1

    def _request(self, run: RLRun, key: str, rows: list[PromptRow], *, n_samples: int,
                 evaluation: bool = False) -> None:
        """Ask every worker for `n_samples` of each of `rows` under `key`; an `evaluation`'s samples leave the
        workers' samplers where they were."""
        self._command("generate", key, n_samples, evaluation)  # first: the workers make the links when they run it
        if self.writer:
            prompts = (rows, encode_rows(run, rows))
            for w in range(self.workers):
                self.links().prompts.send(prompts, to=self.groups.dp_size + w)

    def _arrived(self, key: str) -> dict[int, dict]:
        """Each worker's message for request `key` to this replica (its first rank). A worker answers requests in
        the order they were made, and its messages arrive in that order: those for requests taken later (the
        batches requested ahead of an evaluation) are kept until their turn."""
        for w in range(self.workers):
            while w not in self.taken.get(key, {}):
                message = self.links().samples.receive(self.groups.dp_size + w)
                self.taken.setdefault(message["key"], {})[w] = message
        return self.taken[key]

    def _take(self, key: str) -> list[dict]:
        """Each worker's part of request `key` for this replica: on its first rank from the workers (or from what
        a checkpoint saved), shared with the rest of the replica."""
        parts = None
        if self.writer:
            self._arrived(key)
            parts = [self.taken[key][w] for w in range(self.workers)]
            del self.taken[key]
        if self.groups.tp_size * self.groups.pp_size * self.groups.cp_size > 1:
            shared = [parts]
            dist.broadcast_object_list(shared, src=self.groups.mp_src_global_rank, group=self.groups.mp)
            parts = shared[0]
        return parts

    def _collect(self, run: RLRun, key: str, rows: list[PromptRow], *, n_samples: int, first_group: int = 0):
        """This replica's batch of request `key` with its rewards (None when it asked for no prompt), its groups
        numbered from `first_group`, the counts [failures, scored early, engines], the versions and the longest
        worker wait."""
        parts = self._take(key)
        if lost := [part["lost"] for part in parts if "lost" in part]:  # every training rank sees the same parts
            if self.writer:  # kept for the checkpoint the run saves now (`restore` requests the batch again)
                self.taken[key] = dict(enumerate(parts))
            raise EngineLost("; ".join(lost), keeps_prompts=True)
        trajectories: dict[int, Trajectory] = {}
        rewards: dict[int, float] = {}
        engine_of: dict[int, int] = {}  # sample -> the worker that generated it
        counts, waited = torch.zeros(3, dtype=torch.float64), 0.0
        for w, part in enumerate(parts):
            for i, t, r in zip(part["index"], part["trajectories"], part["rewards"]):
                trajectories[i], rewards[i], engine_of[i] = Trajectory(**t), r, w
            counts += torch.tensor(part["counts"], dtype=torch.float64)
            waited = max(waited, part["waited_s"])
            self.restarts[w] = part["restarts"]  # the worker's engine restarts so far (every rank sees every part)
            self.redispatched[w] = part["redispatched"]
        if not rows:
            return None, counts, waited
        done = [trajectories[i] for i in range(len(rows) * n_samples)]  # the replica's samples, in order
        batch = build_batch(run.tokenizer, [row for row in rows for _ in range(n_samples)],
                            [t.prompt_ids for t in done], done, engines=[engine_of[i] for i in range(len(done))],
                            n_samples=n_samples, first_group=first_group)
        batch = with_rewards(batch, torch.tensor([rewards[i] for i in range(len(done))]),
                             reward_models=run.reward_models, micro_batch_size=run.cfg.train.micro_batch_size,
                             pad_id=run.tokenizer.pad_token_id, unfinished=run.cfg.reward.unfinished)
        return batch, counts, waited

    # -- the loop's calls
    def start(self, model_dir: str) -> None:
        """Nothing to start here: the workers started their engines (with the recipe's model; the first push hands
        them the trainer's weights, warm-started or restored)."""

    def next_batch(self, run: RLRun, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """Request the batches up to `step` + max_staleness not requested yet (first, those a restored checkpoint
        holds no samples of), then take batch `step` (with dynamic sampling, further rounds are requested now,
        behind those: the engines' current weights)."""
        cfg = self.cfg
        for k in self.again:
            self._request(run, f"b{k}", [run.train_rows[i] for i in self.pending[k]], n_samples=cfg.rollout.n_samples)
        self.again = []
        for k in range(self.requested + 1, step + cfg.algo.max_staleness + 1):
            self.pending[k] = run.sampler.next_batch(run.prompts_per_rank)
            self._request(run, f"b{k}", [run.train_rows[i] for i in self.pending[k]], n_samples=cfg.rollout.n_samples)
            self.requested = k
        start = time.monotonic()
        rounds = SplitRounds(self, run, step)
        batch, sampling = draw_batch(run, timer, rounds)  # dynamic sampling: more rounds
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

    def generate_now(self, run: RLRun, rows: list[PromptRow]) -> RolloutBatch | None:
        """One sample of each of `rows` with the latest weights, after every batch requested so far (evaluation):
        outside the training stream, so the workers set their samplers back after it, as colocated engines do."""
        key = f"e{self.evals}"
        self.evals += 1
        self._request(run, key, rows, n_samples=1, evaluation=True)
        batch, _, _ = self._collect(run, key, rows, n_samples=1)
        return batch

    def versions(self, run: RLRun, step: int) -> tuple[int, int]:
        """Batch `step` was generated by version max(1, step - max_staleness), a later dynamic-sampling round or
        a partial rollout's later chunks by any version since, up to the one pushed last."""
        return max(1, step - self.cfg.algo.max_staleness), self.version

    def release(self) -> None:
        """Nothing: the engines are on devices of their own."""

    def hand_over(self, run: RLRun, timer: PhaseTimer) -> dict:
        with timer("push"):
            return self.push(run) | {"offloaded_bytes": 0}

    def device_bytes(self) -> dict[str, int]:
        return {}  # the engines are on devices of their own

    def metrics(self, run: RLRun) -> dict[str, float]:
        """The bytes the training ranks posted to the job's store and moved over the sample links (prompts out,
        samples in) since the last call, summed over the training ranks."""
        links = self.links().bytes if self.writer and self.links.cache_info().currsize else 0
        now = (self.box.written, links)
        store, moved = run.global_sums([float(a - b) for a, b in zip(now, self.counted)])
        self.counted = now
        return {"async/store_bytes": store, "async/transport_bytes": moved, "rollout/released_bytes": 0.0,
                "rollout/engine_restarts": float(sum(self.restarts.values())),
                "rollout/redispatched": float(sum(self.redispatched.values()))}

    def resident(self, run: RLRun, *, final: bool = False) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def push(self, run: RLRun) -> dict:
        """Broadcast the actor's weights to every worker as the next version; a worker loads them once it
        has generated every batch requested before, so the push first waits for those (its "wait_s", on
        training rank 0: the engines were the slower side)."""
        self.version += 1
        groups = self.groups
        gathers = groups.dp_rank == 0 or groups.ep_size > 1  # the ranks whose gathers deliver the tensors
        waited = 0.0
        if self.lead:
            self._command("weights", self.version)
            group = self.bridge()
            start = time.monotonic()
            for w in range(self.workers):
                self.box.take(f"ready/{self.version}/{w}")
            waited = time.monotonic() - start
        if gathers:
            # The gathering ranks start together once the workers are ready: a rank that ran ahead of the waiting
            # lead would queue a gather for every tensor and hold its buffers, up to a copy of the model.
            host_barrier(None if groups.ep_size > 1 else groups.mp)
        tensors = run.actor.pipeline_hf_tensors() if gathers else iter(())
        verify = self.check.select(self.version)
        if not self.lead:  # drive the gathers
            return {"bytes": sum(t.numel() * t.element_size() for _, t in tensors), "verified": 0}
        nbytes, n, expected = 0, 0, {}
        tensors = fingerprinted(tensors, verify, into=expected, dtype=getattr(torch, self.cfg.model.dtype))
        for n, bucket in enumerate(buckets(tensors, bucket_bytes=self.cfg.rollout.bucket_bytes), start=1):
            flat, slots = flatten(bucket, device=current_device())
            send_header(group, slots)
            group.broadcast(flat, 0).wait()
            if on_gpu():  # one bucket in flight: wait() orders the stream only, not this host thread
                torch.cuda.current_stream().synchronize()
            nbytes += flat.numel()
        send_header(group, None)  # the end of the push
        send_header(group, expected)  # the workers compare their engines' copies with these fingerprints
        return {"bytes": nbytes, "wait_s": waited, "verified": len(expected)}

    def close(self) -> None:
        """Stop the workers (and the ranks beside them)."""
        self._command("stop")
        if self.lead:
            self.box.put("done", True)

    # -- checkpoints
    def state(self) -> dict:
        return {"split": {"max_staleness": self.cfg.algo.max_staleness, "workers": self.workers}}

    def save(self, directory: Path, step: int) -> None:
        """Each replica's rows of the batches requested but not trained yet, and those batches' samples (waited
        for, and kept for the steps that train them); the workers' sampler RNG after them."""
        if not self.writer:
            return
        ahead = {f"b{k}": self._arrived(f"b{k}") for k in sorted(self.pending)}
        torch.save({"pending": self.pending, "taken": ahead}, directory / f"split_dp{self.groups.dp_rank:05d}.pt")
        if self.lead:
            self._command("rng", step)
            rng = self._arrived(f"rng{step}")
            del self.taken[f"rng{step}"]
            torch.save({"rng": [rng[w]["rng"] for w in range(self.workers)]}, directory / "split.pt")

    def restore(self, directory: Path, saved: dict, step: int) -> None:
        here = self.state()["split"]
        if saved.get("split") != here:
            raise CheckpointError(f"{directory}: saved with placement split {saved.get('split')} "
                                  f"(algo.max_staleness, rollout workers); this run has {here}: resume with the "
                                  "same algo.max_staleness and placement.rollout_ranks / rollout.tp")
        mine = torch.load(directory / f"split_dp{self.groups.dp_rank:05d}.pt", weights_only=True)
        self.pending = mine["pending"]
        # a batch some worker answered with its loss is requested again, by every replica (every one of them
        # saved that answer: a lost worker sends it to all), before any new one
        self.again = [k for k in sorted(self.pending)
                      if any("lost" in part for part in mine["taken"][f"b{k}"].values())]
        self.requested = max(self.pending, default=step)
        self.version = step
        self._command("set_rng")  # first: the workers make the links when they run it
        if self.writer:  # every replica's first rank makes them together with the workers
            self.taken = {key: parts for key, parts in mine["taken"].items() if int(key[1:]) not in self.again}
            links = self.links()
            if self.lead:
                for w, rng in enumerate(torch.load(directory / "split.pt", weights_only=True)["rng"]):
                    links.prompts.send(rng, to=self.groups.dp_size + w)


class SplitRounds:
    """The rounds of step `step` (megarl.loops.sampling.Rounds): the first is the batch requested ahead, a
    further one (dynamic sampling) is requested when it is drawn."""

    def __init__(self, split: SplitRollouts, run: RLRun, step: int):
        self.split, self.run, self.step, self.round = split, run, step, 0
        self.waited = 0.0  # the workers' longest wait for the trainers before generating this step's rounds

    def next(self, draw: int, timer: PhaseTimer, *, first_group: int) -> tuple[RolloutBatch | None, int, int, int]:
        split, run, n_samples = self.split, self.run, self.split.cfg.rollout.n_samples
        self.round += 1
        key = f"b{self.step}" if self.round == 1 else f"b{self.step}.{self.round}"
        with timer("generate"):
            if self.round == 1:  # pending until taken: a checkpoint saved meanwhile (a lost worker) keeps it
                rows = [run.train_rows[i] for i in split.pending[self.step]]
            else:
                rows = [run.train_rows[i] for i in run.sampler.next_batch(draw)] if draw else []
                split._request(run, key, rows, n_samples=n_samples)
            batch, counts, waited = split._collect(run, key, rows, n_samples=n_samples, first_group=first_group)
            if self.round == 1:
                del split.pending[self.step]
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

