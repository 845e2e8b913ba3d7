"""What one RL run holds, and how it is built from the recipe (once, before the first step).

Every option of the recipe is resolved here into an object (engines, the objective, the advantage
estimator, the KL controller, the scorer, the environment), so the loop (megarl.loops.rl) never branches
on the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megarl.algo.advantages import AdaptiveKLController, FixedKLController
from megarl.algo.aggregate import group_sums
from megarl.config import Config, RecipeError
from megarl.data.prompts import PromptRow, PromptSampler
from megarl.device import host_barrier
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import make_engine
from megarl.envs.environment import Environment, SingleTurn, environment_factory
from megarl.envs.tool_format import ObservationFormat, observation_format
from megarl.models.arch import read_shape
from megarl.objective import (AdvantageFn, CriticObjective, PolicyObjective, advantage_fn, kl_controller,
                              policy_objective)
from megarl.rewards.scorer import Scorer
from megarl.rewards.terms import build_terms
from megarl.rollout.backends import captures_routes, make_rollout_engine, make_rollout_peer
from megarl.rollout.engine import RolloutEngine, RolloutPeer
from megarl.rollout.multi_turn import EnvWorkers
from megarl.rollout.placement import RolloutPlacement, place_rollout
from megarl.routing import RoutePlan


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
    reference: TrainEngine | None     # when algo.kl_coef > 0
    critic: TrainEngine | None        # when algo.name is ppo
    rollout: RolloutEngine | None     # this rank's engine: on the first rank of every group of rollout.tp ranks
    placement: RolloutPlacement       # where the job's engines live, and which ranks exchange with this one
    prompts_per_rank: int
    objective: PolicyObjective
    critic_objective: CriticObjective | None
    routes: RoutePlan  # MoE: the routes each pass of the policy compares with, replays or records
    advantages: AdvantageFn
    kl: FixedKLController | AdaptiveKLController
    scorer: Scorer                    # the recipe's per-sample reward terms, in process or on Ray workers
    reward_models: list[tuple[float, TrainEngine]]  # (weight, frozen scalar-head model) of reward_model terms
    rollout_peer: RolloutPeer | None = None  # beside an engine's host: its side of every push (make_rollout_peer)
    weight_version: int = 0
    failed_reward_steps: int = 0  # consecutive steps in which every sample's reward failed (check_rewards)
    new_env: Callable[[], Environment] = SingleTurn  # one trajectory's environment (env.name)
    tool_schemas: list[dict] = dataclasses.field(default_factory=list)  # the environment's tools, for the prompt
    observations: ObservationFormat | None = None  # renders tool messages; None when the env sends none
    env_workers: EnvWorkers | None = None  # the threads of the environment steps, kept from step to step
    # placement split: the training ranks' side of the rollout ranks (megarl.loops.split.SplitRollout, made by the
    # loop, which imports this module)
    split: object | None = None

    def trainer_engines(self) -> list[TrainEngine]:
        return [e for e in (self.actor, self.reference, self.critic) if e is not None]

    def trained_engines(self) -> dict[str, TrainEngine]:
        """The models a checkpoint saves, by name (frozen ones are rebuilt from their checkpoints)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def global_sums(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks of the run, in one all-reduce."""
        return group_sums(values, group=self.groups.dp)


def check_launch(cfg: Config) -> None:
    """What the recipe needs besides its parallel layout (checked by megarl.loops.launch.init_groups): the reward
    terms and the environment import, and router replay suits the model and the engine; RecipeError names the
    keys."""
    build_terms(cfg.reward)  # a custom reward that does not import stops here, before any work
    environment_factory(cfg.env)  # and so does an environment
    shape = read_shape(cfg.model.path)
    if cfg.algo.router_replay != "none" and not shape.is_moe:
        raise RecipeError(f"algo.router_replay = {cfg.algo.router_replay!r} replays mixture-of-experts routing; the "
                          f"model in model.path ({shape.arch}) has no experts: set it to 'none'")
    if cfg.algo.router_replay == "r3" and not captures_routes(cfg.rollout):
        raise RecipeError(f"algo.router_replay = 'r3' replays the rollout engine's routes, which rollout.engine = "
                          f"{cfg.rollout.engine!r} cannot return on this machine (SGLang captures them on GPU only); "
                          "use the native engine, or r2")
    if cfg.algo.router_replay != "none" and cfg.model.megatron.get("moe_router_fusion"):
        raise RecipeError("algo.router_replay needs Megatron's unfused router: the fused top-k kernel "
                          "(model.megatron.moe_router_fusion: true) has no replay hook")


def build_run(cfg: Config, groups: ParallelGroups, *, tokenizer, train_rows: list[PromptRow],
              eval_rows: list[PromptRow], model_dir: str, split=None) -> RLRun:
    """The rollout engines, one on the first rank of every group of `rollout.tp` ranks (megarl.rollout.placement),
    each seeded by its index (so a run resumed at another trainer layout with the same world size samples
    as the one that saved it), started before the trainer's models are built: SGLang sizes its KV cache from
    the device memory free when it starts. Then the train engines: actor; reference when algo.kl_coef > 0;
    critic for PPO; the reward models, which stay on the device the whole step because their scores are
    needed as generation ends. With `split` (placement split, megarl.loops.split.SplitRollout) this rank
    holds no engine: the rollout ranks do."""
    algo = cfg.algo
    if split is not None:  # placement split: the engines are on rollout ranks of their own
        placement = RolloutPlacement(tp=cfg.rollout.tp, engines=split.workers, engine_index=None, exchange=None,
                                     exchange_ranks=(dist.get_rank(),), exchange_engines=())
    else:
        placement = place_rollout(rollout_tp=cfg.rollout.tp, replica=groups.mp, timeout=groups.timeout)
    rollout = rollout_peer = None
    if placement.hosts_engine:
        # MoE: every run captures the engines' routing where they can, for moe/routing_agreement and r3
        rollout = make_rollout_engine(cfg.rollout, model_dir, dtype=cfg.model.dtype,
                                      seed=cfg.seed + placement.engine_index,
                                      capture_routes=read_shape(model_dir).is_moe and captures_routes(cfg.rollout),
                                      group=placement.engine_group)
        rollout.release_memory()  # its KV cache is sized; the trainer is built in the memory it gives back
    elif placement.engine_group is not None:
        rollout_peer = make_rollout_peer(cfg.rollout, placement.engine_group)
    if split is None:
        # Every rank waits for every engine of the job to start and give its memory back: an SGLang engine's
        # TP schedulers size the KV cache from the memory free on each of the group's devices (and refuse an
        # imbalance), so no trainer model may be built on them before. On the host side: NCCL's
        # communicators are not made yet.
        host_barrier()
    actor = make_engine(cfg, groups, role="actor", model_dir=model_dir)
    reference = make_engine(cfg, groups, role="reference", model_dir=model_dir) if algo.kl_coef > 0 else None
    critic = None
    if algo.name == "ppo":
        critic = make_engine(cfg, groups, role="critic", model_dir=cfg.critic.path or model_dir)
    reward_models = [(term.weight, make_engine(cfg, groups, role="reward_model", model_dir=term.path))
                     for term in cfg.reward.terms if term.kind == "reward_model"]
    new_env = environment_factory(cfg.env)
    # placement split: the rollout ranks score, so a training rank needs no pool of reward workers
    reward_in_process = dataclasses.replace(cfg.reward, workers=0)
    return RLRun(
        cfg=cfg, groups=groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
        sampler=PromptSampler(len(train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank,
                              dp_size=groups.dp_size),
        actor=actor, reference=reference, critic=critic,
        rollout=rollout, rollout_peer=rollout_peer, placement=placement,
        prompts_per_rank=cfg.data.prompts_per_step // groups.dp_size,
        objective=policy_objective(algo, on_policy=algo.on_policy),
        critic_objective=CriticObjective(value_clip=cfg.critic.value_clip) if critic is not None else None,
        routes=RoutePlan(algo.router_replay, on_policy=algo.on_policy),
        advantages=advantage_fn(algo, group=groups.dp), kl=kl_controller(algo), scorer=Scorer(cfg.reward if split is None else reward_in_process),
        reward_models=reward_models, new_env=new_env, tool_schemas=new_env().tools,
        observations=observation_format(cfg.env, tokenizer), env_workers=EnvWorkers(cfg.env.tool_workers), split=split)
