"""`RolloutBatch`: the one object that carries an RL step from generation to training.

Generation creates it; every later stage returns `batch.replace(new_field=...)`, which refuses to
overwrite a field an earlier stage set. Two later changes are not rewrites and have methods of their own:
new names for the same groups (`renumber_groups`) and responses taken out of the mask
(`mask_responses_except`). A batch can be saved and loaded, so any stage can be replayed
alone (train on a saved rollout without generating again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RolloutBatch:
    tokens: Tensor                        # [B, T] prompt + response ids, right padded
    response_mask: Tensor                 # [B, T] 1.0 on generated response tokens (EOS included), else 0;
                                          # 0 on observation tokens between the turns of a multi-turn response
    prompt_lens: Tensor                   # [B] long: prompt length in tokens
    group_ids: Tensor                     # [B] long: samples of the same prompt share an id
    rollout_logprobs: Tensor              # [B, T] the rollout engine's logprobs on response tokens, else 0
    responses: list[str]                  # [B] decoded responses
    answers: list[str]                    # [B] reference answers of the prompts
    finish_reasons: list[str]             # [B] "stop", "length" or the limit that ended a multi-turn rollout
    prompt_texts: list[str]               # [B] the prompts as text, before any chat template (for rewards)
    metadata: list[dict]                  # [B] the prompt rows' metadata (for rewards)
    turns: Tensor | None = None           # [B] long: model turns of each trajectory (1 for single-turn rollouts)
    tool_calls: Tensor | None = None      # [B] long: tool calls the environment answered
    env_retries: Tensor | None = None     # [B] long: environment steps tried again on a fresh environment
    env_rewards: Tensor | None = None     # [B] sum of the environment's step rewards, added to the recipe's
                                          # rewards; 0 where one was not a finite number (a failed sample)
    routes: list[Tensor] | None = None    # [B] MoE models: the experts the rollout engine routed each token to,
                                          # [real tokens - 1, moe_layers, top_k] per sample (megarl.routing)
    trainer_routes: list[Tensor] | None = None  # [B] the experts the old-logprob forward routed each token to
                                          # (router_replay r2), [T or real tokens, moe_layers, top_k] per sample:
                                          # T from padded micro-batches, the real tokens from packed ones
    weight_versions: Tensor | None = None  # [B, T] long: the weight version that generated each response token
                                          # (as its engine stamped it), 0 on every other token
    engines: Tensor | None = None         # [B] long: the rollout engine (its index in the job) that generated
                                          # each sample
    rewards: Tensor | None = None         # [B] each sample's reward: the recipe's terms plus env_rewards
    old_logprobs: Tensor | None = None    # [B, T] trainer logprobs before the update
    ref_logprobs: Tensor | None = None    # [B, T] reference-model logprobs
    teacher_logprobs: Tensor | None = None  # [B, T] the distillation teacher's logprobs on response tokens, else 0
    values: Tensor | None = None          # [B, T] critic values before the update (ppo)
    advantages: Tensor | None = None      # [B, T]
    returns: Tensor | None = None         # [B, T] critic targets (ppo)

    def replace(self, **fields) -> RolloutBatch:
        """A copy with new fields set; setting a field that is already set is an error."""
        for name in fields:
            if getattr(self, name) is not None:
                raise ValueError(f"RolloutBatch.{name} is already set; a later stage must not overwrite it")
        return dataclasses.replace(self, **fields)

    def renumber_groups(self, group_ids: Tensor) -> RolloutBatch:
        """The same samples under new group ids [B] (long), so that groups stay distinct where batches of
        other ranks or steps are combined with this one. The groups themselves cannot change: samples that
        shared an id share the new one, and no others do."""
        pairs = torch.stack([self.group_ids, group_ids]).unique(dim=1).shape[1]
        if group_ids.shape != self.group_ids.shape or not (
                pairs == self.group_ids.unique().numel() == group_ids.unique().numel()):
            raise ValueError("RolloutBatch.renumber_groups: the new group ids group the samples differently")
        return dataclasses.replace(self, group_ids=group_ids)

    def mask_responses_except(self, live: Tensor) -> RolloutBatch:
        """The batch with the responses of the samples not `live` ([B] bool) taken out of `response_mask`:
        they still run through the trainer, but no loss term or statistic counts them. Tokens only leave the
        mask, so every field an earlier stage set keeps its meaning. `self` when no token leaves it."""
        mask = self.response_mask * live[:, None]
        if torch.equal(mask, self.response_mask):
            return self
        return dataclasses.replace(self, response_mask=mask)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: Tensor) -> RolloutBatch:
        """The samples at `index` ([k] long), every field sliced alike."""
        picked = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value[index]
            elif isinstance(value, list):
                value = [value[i] for i in index.tolist()]
            picked[f.name] = value
        return RolloutBatch(**picked)

    @classmethod
    def concat(cls, batches: list[RolloutBatch], *, pad_id: int) -> RolloutBatch:
        """One batch of all samples in order; [B, T] fields are right padded to the widest (`pad_id` for
        tokens, 0 elsewhere). Group ids must already be distinct between batches."""
        width = max(b.tokens.shape[1] for b in batches)
        out = {}
        for f in dataclasses.fields(cls):
            values = [getattr(b, f.name) for b in batches]
            if any(v is None for v in values):
                if not all(v is None for v in values):
                    raise ValueError(f"RolloutBatch.concat: {f.name} is set in some batches only")
                out[f.name] = None
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif values[0].dim() == 2:
                fill = pad_id if f.name == "tokens" else 0
                out[f.name] = torch.cat([F.pad(v, (0, width - v.shape[1]), value=fill) for v in values])
            else:
                out[f.name] = torch.cat(values)
        return cls(**out)

    def save(self, path: str | Path) -> None:
        torch.save({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> RolloutBatch:
        return cls(**torch.load(path, weights_only=True))


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], response_logprobs: list[list[float]],
                   *, pad_id: int, generated_masks: list[list[int]] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Concatenate prompt and response ids, right padded: tokens [B, T] long, response_mask [B, T],
    logprobs [B, T] (response logprobs placed on their tokens). The mask is 1 on the whole response, or,
    with `generated_masks` (one 0/1 per response id), on the generated ids of a multi-turn response only."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    batch = len(prompts)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width))
    logprobs = torch.zeros((batch, width))
    for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs)):
        tokens[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[i, len(p): len(p) + len(r)] = 1.0 if generated_masks is None else torch.tensor(
            generated_masks[i], dtype=torch.float32)
        logprobs[i, len(p): len(p) + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return tokens, mask, logprobs
