"""What one RL run holds, and how it is built from the recipe (once, before the first step).

Every option of the recipe is resolved here into an object (engines, the objective, the advantage
estimator, the KL controller, the scorer, the environment), so the loop (megarl.loops.rl) never branches
on the config.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from megarl.algo.advantages import AdaptiveKLController, FixedKLController
from megarl.algo.aggregate import group_sums
from megarl.batch import RolloutBatch
from megarl.config import Config
from megarl.data.prompts import PromptRow, PromptSampler
from megarl.device import on_gpu
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import BasePolicy, build_engine
from megarl.envs.environment import Environment, SingleTurn, environment_factory
from megarl.envs.tool_format import ObservationFormat, observation_format
from megarl.envs.trajectories import EnvWorkers
from megarl.job import Job
from megarl.ledger import DeviceLedger, engine_owners, model_owners, run_ledger
from megarl.loops.faults import DriftGate
from megarl.metrics import PhaseTimer
from megarl.plan.estimate import PlanError
from megarl.objective import (AdvantageFn, CriticObjective, PolicyObjective, advantage_fn, kl_controller,
                              policy_objective)
from megarl.rewards.scorer import Scorer
from megarl.routing import RoutePlan


log = logging.getLogger(__name__)


class Rollouts(Protocol):
    """Where a run's samples come from and where its weights go: the rollout engines on the training ranks'
    own devices (megarl.loops.colocated) or on rollout ranks of their own (megarl.loops.split). Every training
    rank makes the same calls in the same order (SPMD)."""

    engines: int  # rollout engines in the job (a checkpoint records it: an engine's sampler RNG is per engine)
    scores_here: bool  # whether the training ranks score samples (else the rollout ranks do, and no rank here
                       # needs a pool of reward workers)

    def start(self, model_dir: str) -> None:
        """Start the engines this rank hosts, before the trainer's models are built (SGLang sizes its KV
        cache from the memory free when it starts), and give their memory back."""
        ...

    def next_batch(self, run: RLRun, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """This replica's scored batch of step `step` and the sampling metrics, timed as "generate" and
        "reward"."""
        ...

    def generate_now(self, run: RLRun, rows: list[PromptRow]) -> RolloutBatch | None:
        """One scored sample of each of `rows` with the latest weights (evaluation); None when `rows` is empty."""
        ...

    def versions(self, run: RLRun, step: int) -> tuple[int, int]:
        """The weight versions (lowest, highest) the generated tokens of step `step`'s batch may carry
        (megarl.loops.faults.check_versions)."""
        ...

    def release(self) -> None:
        """The engines give the devices to the trainer, which is about to be woken for the update."""
        ...

    def hand_over(self, run: RLRun, timer: PhaseTimer) -> dict:
        """Push the actor's new weights and give the devices back to the engines (also how a run starts).
        Returns the push's counts (`bytes`; `verified`, the tensors compared with the engines' copies; `wait_s`
        when the push waited for the engines) and `offloaded_bytes`, the trainer state parked while the engines
        generate."""
        ...

    def device_bytes(self) -> dict[str, int]:
        """What the rollout engine on this rank's device holds now, by kind (RolloutEngine.device_bytes); empty
        where none is."""
        ...

    def metrics(self, run: RLRun) -> dict[str, float]:
        """The rollouts' own figures of the step (placement split: what its messages moved), once per step on every
        training rank."""
        ...

    def resident(self, run: RLRun, *, final: bool = False) -> AbstractContextManager:
        """A context in which the trainer's state is on its devices (a checkpoint reads it); `final`: the run ends
        after it, and the engines are not woken again."""
        ...

    def state(self) -> dict:
        """What state.json records of the rollouts (checked when a run resumes)."""
        ...

    def save(self, directory: Path, step: int) -> None:
        """Write the rollouts' files of a checkpoint after `step` (every training rank calls)."""
        ...

    def restore(self, directory: Path, saved: dict, step: int) -> None:
        """Read them back; `saved` is the checkpoint's state.json."""
        ...

    def close(self) -> None:
        """Stop the engines (a run that ends, finished or not)."""
        ...


@dataclass
class RLRun:
    """Everything one RL run holds, built once from the recipe (`build_run`)."""

    cfg: Config
    groups: ParallelGroups
    tokenizer: object
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    sampler: PromptSampler
    actor: TrainEngine
    reference: TrainEngine | BasePolicy | None  # when algo.kl_coef > 0 (with model.lora: the actor, adapters off)
    critic: TrainEngine | None        # when algo.name is ppo
    rollouts: Rollouts                # the rollout engines' side of the run (colocated or split placement)
    prompts_per_rank: int
    objective: PolicyObjective
    critic_objective: CriticObjective | None
    routes: RoutePlan  # MoE: the routes each pass of the policy compares with, replays or records
    advantages: AdvantageFn
    kl: FixedKLController | AdaptiveKLController
    scorer: Scorer                    # the recipe's per-sample reward terms, in process or on Ray workers
    reward_models: list[tuple[float, TrainEngine]]  # (weight, frozen scalar-head model) of reward_model terms
    # stops the run when the engines' logprobs stay off the trainer's (rollout.max_logprob_drift); off by default
    drift: DriftGate = dataclasses.field(default_factory=lambda: DriftGate(limit=None, patience=1))
    # the version of the trainer's weights: 1 at the start, one more after each update; colocated placement
    # pushes them to the engines under this number (placement split counts its own pushes)
    weight_version: int = 1
    failed_reward_steps: int = 0  # consecutive steps in which every sample's reward failed (check_rewards)
    new_env: Callable[[], Environment] = SingleTurn  # one trajectory's environment (env.name)
    tool_schemas: list[dict] = dataclasses.field(default_factory=list)  # the environment's tools, for the prompt
    observations: ObservationFormat | None = None  # renders tool messages; None when the env sends none
    env_workers: EnvWorkers | None = None  # the threads of the environment steps, kept from step to step
    teacher: TrainEngine | None = None  # frozen, when algo.name is distill or algo.distill_coef > 0
    # colocated placement: this rank's device memory, counted phase by phase against the plan (megarl.ledger)
    ledger: DeviceLedger | None = None

    def trainer_engines(self) -> list[TrainEngine]:
        """The models the trainer wakes for a step and parks while the engines generate (a LoRA run's reference
        is the actor's, not a model of its own)."""
        return [e for e in (self.actor, self.reference, self.teacher, self.critic) if isinstance(e, TrainEngine)]

    def trained_engines(self) -> dict[str, TrainEngine]:
        """The models a checkpoint saves, by name (frozen ones are rebuilt from their checkpoints)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def global_sums(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks of the run, in one all-reduce."""
        return group_sums(values, group=self.groups.dp)

    def device_models(self) -> dict[str, TrainEngine]:
        """Every model of the trainer on this rank's devices, by name, the actor first: those the trainer wakes and
        parks, and the reward models, which stay."""
        named = {"actor": self.actor, "reference": self.reference, "teacher": self.teacher, "critic": self.critic}
        named |= {f"reward model {i}": model for i, (_, model) in enumerate(self.reward_models)}
        return {name: model for name, model in named.items() if isinstance(model, TrainEngine)}

    def count_device(self, phase: str, **transient: int) -> None:
        """Count what this rank's device holds in `phase` (megarl.ledger): every trainer model's resident state,
        the rollout engine's memory, and `transient` bytes by owner (activations, buckets)."""
        if self.ledger is None:
            return
        owners = {}
        for name, model in self.device_models().items():
            owners |= model_owners(name, model.memory.resident_bytes())
        owners |= engine_owners(self.rollouts.device_bytes())
        self.ledger.count(phase, owners | {name.replace("_", " "): nbytes for name, nbytes in transient.items()})

    def check_device(self) -> None:
        """Every rank: raise MemoryOverPlan once a rank counted a phase over the plan (megarl.ledger)."""
        if self.ledger is not None:
            self.ledger.check()


def build_run(job: Job, groups: ParallelGroups, *, rollouts: Rollouts, tokenizer, train_rows: list[PromptRow],
              eval_rows: list[PromptRow]) -> RLRun:
    """The rollout engines first (`rollouts.start`: SGLang sizes its KV cache from the device memory free when it
    starts), then the train engines of the run's cast (megarl.job), in its order: actor; reference when
    algo.kl_coef > 0 (with model.lora, the actor with its adapters off); the distillation teacher; critic for
    PPO; the reward models, which stay on the device the whole step because their scores are needed as
    generation ends."""
    cfg, algo = job.cfg, job.cfg.algo
    actor_role = job.role("actor")
    rollouts.start(actor_role.checkpoint)  # the warm start's export, when the run has one
    actor = build_engine(job, actor_role, groups)
    built = {role.name: build_engine(job, role, groups, actor=actor) for role in job.cast if role.name in
             ("reference", "teacher", "critic")}
    weights = [term.weight for term in cfg.reward.terms if term.kind == "reward_model"]
    reward_models = list(zip(weights, [build_engine(job, role, groups) for role in job.roles("reward_model")]))
    new_env = environment_factory(cfg.env)
    in_process = dataclasses.replace(cfg.reward, workers=0)
    # No drift gate where older weights generate the batch by design (placement split, algo.max_staleness > 0):
    # the drift there is the staleness's; the weight versions and the push checks stand guard.
    stale = cfg.placement.mode == "split" and algo.max_staleness > 0
    drift = DriftGate(limit=None if stale else cfg.rollout.max_logprob_drift, patience=cfg.rollout.drift_patience)
    run = RLRun(
        cfg=cfg, groups=groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
        sampler=PromptSampler(len(train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank,
                              dp_size=groups.dp_size),
        actor=actor, reference=built.get("reference"), teacher=built.get("teacher"), critic=built.get("critic"),
        rollouts=rollouts,
        prompts_per_rank=cfg.data.prompts_per_step // groups.dp_size,
        objective=policy_objective(algo, on_policy=algo.on_policy),
        critic_objective=CriticObjective(value_clip=cfg.critic.value_clip) if "critic" in built else None,
        routes=RoutePlan(algo.router_replay, on_policy=algo.on_policy),
        advantages=advantage_fn(algo, group=groups.dp), kl=kl_controller(algo),
        scorer=Scorer(cfg.reward if rollouts.scores_here else in_process),
        reward_models=reward_models, drift=drift, new_env=new_env, tool_schemas=new_env().tools,
        observations=observation_format(cfg.env, tokenizer), env_workers=EnvWorkers(cfg.env.tool_workers))
    if cfg.placement.mode == "colocated":
        try:
            run.ledger = run_ledger(cfg, job.shape, world=dist.get_world_size(), stage=groups.pp_rank,
                                    models=list(run.device_models().values()), enforce=not on_gpu(),
                                    sglang_on_cpu=cfg.rollout.engine == "sglang" and not on_gpu())
        except PlanError as e:  # nothing to count against (a multi-turn env without env.max_tokens)
            log.warning("the device-memory ledger is off for this run: megarl plan cannot plan it: %s", e)
    return run
