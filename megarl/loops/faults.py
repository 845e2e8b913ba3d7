"""How a run notices rollout engines that do not sample the trainer's policy, and stops with the cause.

Weight pushes check themselves (megarl.handoff.verify_engine: the engine's copy of the tensors against the
trainer's). Two more checks run on every training rank at every step, on figures all ranks share, so every
rank stops at the same step with the same error:

- `check_versions`: every generated token carries the weight version its engine stamped when it sampled it
  (RolloutBatch.weight_versions). The step expects a range (Rollouts.versions): colocated, exactly the last
  version pushed; split, from step - algo.max_staleness (at least 1, the start) to the last version pushed.
  A token outside it comes from an engine that did not take a push: EngineFault names the engine, the
  expected and the actual version.
- `DriftGate`: the mean |rollout - trainer| logprob per generated token (`rollout/logprob_diff_mean`) above
  `rollout.max_logprob_drift` for `rollout.drift_patience` consecutive steps stops the run; a shorter
  excursion is a warning, and a step that trained no sample (so measured no drift) does not count. It
  catches what the two checks above cannot see: an engine that holds the pushed bytes and the right version
  but computes another distribution (another dtype, temperature, kernel).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megarl.algo.aggregate import group_sums
from megarl.batch import RolloutBatch

log = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """The rollout engines do not sample the policy the trainer trains."""


class EngineLost(EngineFault):
    """A rollout engine failed once more than `rollout.max_engine_restarts` allows. The step it stopped saves
    its last complete state (megarl.loops.lifecycle.run_steps), and `checkpoint` says where: `trained`, whether
    that step had updated the trainer (megarl.loops.rl.rl_step sets it: the push and the evaluation come after
    the update); `keeps_prompts`, whether the rollouts keep the prompts they were given for the resumed run
    (split placement saves every batch requested), so the sampler is not given them back."""

    def __init__(self, message: str, *, keeps_prompts: bool = False):
        super().__init__(message)
        self.trained = False
        self.keeps_prompts = keeps_prompts
        self.checkpoint = None


def check_versions(batch: RolloutBatch, versions: tuple[int, int], *, step: int, group=None) -> None:
    """Raise EngineFault when a generated token of `batch` carries a weight version outside `versions` (lowest,
    highest). Every rank of the data-parallel `group` calls it and raises the same error, naming one engine at
    fault and its version (one all-reduce per step, a second one when a token is outside)."""
    lowest, highest = versions
    stamped = batch.weight_versions  # [B, T]
    wrong = batch.response_mask.bool() & ((stamped < lowest) | (stamped > highest))  # [B, T]
    count, = group_sums([float(wrong.sum())], group=group)
    if not count:
        return
    culprit = torch.tensor([-1])  # engine << 32 | version of this rank's first wrong token, the largest kept
    if wrong.any():
        row = int(wrong.any(dim=1).nonzero()[0])
        culprit[0] = int(batch.engines[row]) << 32 | int(stamped[row][wrong[row]][0])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(culprit, op=dist.ReduceOp.MAX, group=group)
    engine, actual = int(culprit) >> 32, int(culprit) & 0xFFFFFFFF
    expected = f"version {lowest}" if lowest == highest else f"versions {lowest} to {highest}"
    raise EngineFault(
        f"step {step}: rollout engine {engine} generated with weight version {actual}; the step expects "
        f"{expected} ({int(count)} tokens outside it). The engine did not take the weight push (or its "
        "update did not take effect), so it samples another policy than the trainer's: check its update_weights "
        "and that every push reaches it")


class DriftGate:
    """Stops a run whose engines sample another policy than the trainer's (`observe`, once per step)."""

    def __init__(self, *, limit: float | None, patience: int):
        self.limit = limit  # None: off
        self.patience = patience
        self.recent: list[tuple[int, float]] = []  # (step, drift) of the consecutive steps above the limit

    def observe(self, drift: float, *, tokens: float, step: int) -> None:
        """`drift`: the step's `rollout/logprob_diff_mean` over the global batch (the same on every rank), measured
        over `tokens` tokens. A step that measured none (no sample trained) tells nothing: the count stays."""
        if self.limit is None or not tokens:
            return
        if drift <= self.limit:
            self.recent = []
            return
        self.recent.append((step, drift))  # NaN counts as above
        figures = ", ".join(f"step {s}: {d:.4g}" for s, d in self.recent)
        if len(self.recent) < self.patience:
            log.warning("rollout/logprob_diff_mean %.4g is above rollout.max_logprob_drift = %g (%d of "
                        "rollout.drift_patience = %d steps in a row)", drift, self.limit, len(self.recent),
                        self.patience)
            return
        raise EngineFault(
            f"the rollout engines are not sampling the trainer's policy: the mean |rollout - trainer| logprob per "
            f"token stayed above rollout.max_logprob_drift = {self.limit} for {self.patience} steps ({figures}). "
            "Check that the weight pushes reach the engines (rollout.verify_weights: every verifies each one), "
            "the model's HF name table (megarl.models.names), that engine and trainer compute in the same dtype "
            "(model.dtype) at the same temperature, and the engine's own settings (its kernels, quantization); "
            "raise rollout.max_logprob_drift only if this drift is expected")
