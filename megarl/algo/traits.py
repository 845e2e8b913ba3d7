"""What each `algo.name` is, in one table: the loop that trains it, its advantage estimator and policy loss,
and the models and data it needs. The recipe's check (megarl.config), the objective (megarl.objective), the
layout and memory plan (megarl.layout, megarl.plan), the ledger and the loops read these facts here and
nowhere else; the other `algo` keys are the papers' knobs, set per recipe.

    ALGOS["ppo"].critic        # True: a value model trains beside the policy
    cfg.algo.traits.offline    # the recipe's own row (AlgoConfig.traits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The advantage estimators of megarl.objective.advantage_fn: GAE over a critic's values (Schulman et al. 2016);
# REINFORCE++ with and without a group baseline (Hu 2025); group-relative with and without the std division
# (GRPO, Shao et al. 2024; Dr. GRPO, Liu et al. 2025); leave-one-out (RLOO, Ahmadian et al. 2024); the
# teacher's reverse KL per token (on-policy distillation)
Estimator = Literal["gae", "reinforce_pp", "reinforce_pp_baseline", "grpo", "dr_grpo", "rloo", "distill"]


@dataclass(frozen=True)
class AlgoTraits:
    """The facts of one algorithm that do not depend on the recipe."""

    # the training loop: rl generates samples and trains the policy on them (megarl.loops.rl); sft, dpo and rm
    # train on a fixed data set (megarl.loops.sft, .dpo, .rm) and generate nothing
    loop: Literal["rl", "sft", "dpo", "rm"]
    estimator: Estimator | None = None  # rl: how rewards become advantages
    # rl: the policy loss, PPO's clip of each token's ratio or GSPO's clip of the sequence's ratio (Zheng et al. 2025)
    surrogate: Literal["ppo", "gspo"] | None = None
    groups: bool = False  # the baseline is computed within the group of samples of one prompt: n_samples >= 2
    # advantages come from per-token rewards, into which a KL penalty can be folded (algo.kl_in_reward)
    token_rewards: bool = False
    critic: bool = False  # a value model (critic:) trains beside the policy
    dynamic_sampling: bool = False  # the default of algo.dynamic_sampling (DAPO, Yu et al. 2025)
    distills: bool = False  # the teacher's reverse KL alone is the advantage (teacher:)
    reference: bool = False  # compares the policy with the frozen reference whatever algo.kl_coef (DPO's beta)
    pairs: bool = False  # trains on preference pairs, a pair's two sequences side by side in one micro-batch
    scalar_head: bool = False  # the trained model is a scalar-head reward model, not the policy
    packs: bool = True  # its loop takes packed micro-batches (train.micro_batch_tokens)

    @property
    def offline(self) -> bool:
        """Trained on a fixed data set: no rollout engine, `rollout:` is unused."""
        return self.loop != "rl"


ALGOS: dict[str, AlgoTraits] = {
    "ppo": AlgoTraits(loop="rl", estimator="gae", surrogate="ppo", token_rewards=True, critic=True),
    "grpo": AlgoTraits(loop="rl", estimator="grpo", surrogate="ppo", groups=True),
    "dr_grpo": AlgoTraits(loop="rl", estimator="dr_grpo", surrogate="ppo", groups=True),
    "dapo": AlgoTraits(loop="rl", estimator="grpo", surrogate="ppo", groups=True, dynamic_sampling=True),
    "gspo": AlgoTraits(loop="rl", estimator="grpo", surrogate="gspo", groups=True),
    "rloo": AlgoTraits(loop="rl", estimator="rloo", surrogate="ppo", groups=True),
    "reinforce_pp": AlgoTraits(loop="rl", estimator="reinforce_pp", surrogate="ppo", token_rewards=True),
    "reinforce_pp_baseline": AlgoTraits(loop="rl", estimator="reinforce_pp_baseline", surrogate="ppo", groups=True),
    "distill": AlgoTraits(loop="rl", estimator="distill", surrogate="ppo", distills=True),
    "dpo": AlgoTraits(loop="dpo", reference=True, pairs=True, packs=False),
    "sft": AlgoTraits(loop="sft"),
    "rm": AlgoTraits(loop="rm", pairs=True, scalar_head=True, packs=False),
}
# a recipe's algo.name: one of the table's keys, in its order (the loader's type check names them)
AlgoName = Literal[tuple(ALGOS)]
