"""The device memory a GPU run would hold, counted phase by phase on any machine, the CPU included, against the
recipe's plan (`megarl plan`).

A colocated RL run counts, at each point where the hardware changes hands, what every owner holds on this rank's
device: each trainer model's parameters, gradients and optimizer state (the bytes of its storages that are
resident, megarl.engine.offload; with optim.cpu_offload the share Megatron keeps on the host is not the
device's), the activations of the largest micro-batch (the plan's formula at the batch's
real length: a CPU cannot measure a GPU's activations), the rollout engine's weights and KV cache as its
`device_bytes` reports them (SGLang's CPU mode stands in for the pool a GPU would size with the plan's figure),
the weight push's bucket and gathered tensors, and the plan's fixed reserve. The phases are the plan's
(`rollout`, `train`, `push`) plus `checkpoint` and `export`, which the plan does not list because they must fit
inside its peak: a phase whose count exceeds the plan's peak fails the run, naming the phase and its owners,
largest first. So a step order that a GPU would run out of memory on fails on the CPU first.

The capacity is the plan's peak plus what the plan leaves out on purpose (DDP's padding of every parameter and
bucket, `DDP_PADDING_ELEMENTS` per parameter tensor in each of its parameter, gradient and optimizer buffers):
an order that holds one piece of state more than the plan allows exceeds it by far more than that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.plan.estimate import Plan, gib
from megarl.plan.memory import GIB, RESERVE_GIB

# Megatron's DDP pads each parameter to 64 elements and each bucket to 128 (the plan counts neither)
DDP_PADDING_ELEMENTS = 64


class MemoryOverPlan(RuntimeError):
    """A phase of the run holds more device memory than the recipe's plan gives its peak phase."""


@dataclass
class DeviceLedger:
    """Counts of one rank's device memory by phase (`count`), checked against the plan of the longest prompt
    seen so far (`see_prompts`)."""

    replan: Callable[[int], Plan]    # the recipe's plan for prompts of that many tokens
    padding: int                     # bytes of DDP padding the plan leaves out (module doc)
    activations: Callable[[int], int]  # bytes of one training pass of this rank (rl.activation_tokens's tokens)
    enforce: bool = True             # False (a GPU, whose allocator is the judge): count and log only
    stand_ins: dict[str, int] = field(default_factory=dict)  # owners whose count the plan's figure replaces
    counted: dict[str, int] = field(default_factory=dict)  # each phase's largest count so far, reserve included
    over: str | None = None          # why this rank went over the plan, until `check` raises it
    prompt_tokens: int = 1
    # bytes of the largest full tensor a gather of the actor's shards makes (a fused QKV or gate/up included): a
    # push or an export holds it and the shards it is made of
    largest_full_tensor: int = 0

    def __post_init__(self):
        self.plan = self.replan(self.prompt_tokens)

    @property
    def planned(self) -> dict[str, int]:
        """The plan's bytes per GPU in each of its phases, reserve included."""
        return self.plan.phases

    @property
    def reserve(self) -> int:
        return int(RESERVE_GIB * GIB)

    @property
    def capacity(self) -> int:
        """The most any phase may hold: the plan's peak plus DDP's padding."""
        return self.plan.peak + self.padding

    def see_prompts(self, prompt_tokens: int) -> None:
        """Plan for prompts of `prompt_tokens` tokens from now on, when they are longer than those seen."""
        if prompt_tokens > self.prompt_tokens:
            self.prompt_tokens = prompt_tokens
            self.plan = self.replan(prompt_tokens)

    def count(self, phase: str, owners: dict[str, int]) -> None:
        """What `owners` hold on this rank's device in `phase` (bytes by owner); a count over the capacity is kept
        for `check`, which every rank calls at the same point."""
        owners = {name: self.stand_ins.get(name, nbytes) for name, nbytes in owners.items() if nbytes}
        total = sum(owners.values()) + self.reserve
        self.counted[phase] = max(total, self.counted.get(phase, 0))
        if self.enforce and total > self.capacity and self.over is None:
            held = ", ".join(f"{name} {nbytes / 2**20:.1f} MiB"
                             for name, nbytes in sorted(owners.items(), key=lambda item: -item[1]))
            self.over = (f"phase {phase!r} would hold {gib(total)} GiB ({total} bytes) on this rank's GPU, "
                         f"{(total - self.capacity) / 2**20:.2f} MiB more than the {gib(self.capacity)} GiB "
                         f"({self.capacity} bytes) of the plan's peak phase "
                         f"({max(self.planned, key=self.planned.get)}; megarl plan for this recipe and world): "
                         f"{held}, and the reserve {self.reserve / 2**20:.0f} MiB")

    def check(self, group=None) -> None:
        """Raise MemoryOverPlan on every rank of `group` (None: the world, when there is one) once any of them
        went over, with this rank's reason or the rank that did."""
        flag = torch.tensor([float(self.over is not None)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item():
            raise MemoryOverPlan(self.over or "another rank held more device memory than the plan's peak phase "
                                              "(its log names the phase and the owners)")

    def metrics(self) -> dict[str, float]:
        """`memory/peak_planned_bytes/{phase}` (the plan's) and `memory/peak_counted_bytes/{phase}` (this rank's
        largest count since the last call) for each of the plan's phases; the counts start again. Checkpoints and
        the export are checked against the peak but not logged (a resumed run's steps log what an uninterrupted
        run's do)."""
        out = {f"memory/peak_planned_bytes/{phase}": float(nbytes) for phase, nbytes in self.planned.items()}
        out |= {f"memory/peak_counted_bytes/{phase}": float(self.counted[phase])
                for phase in self.planned if phase in self.counted}
        self.counted = {}
        return out


def model_owners(name: str, resident: dict[str, int]) -> dict[str, int]:
    """A trainer model's resident bytes by kind (TrainerMemory.resident_bytes) as ledger owners."""
    kinds = {"params": "parameters", "grads": "gradients", "optim": "optimizer state"}
    return {f"{name} {kinds[kind]}": nbytes for kind, nbytes in resident.items()}


def engine_owners(device_bytes: dict[str, int]) -> dict[str, int]:
    """A rollout engine's `device_bytes` as ledger owners."""
    return {f"rollout engine {kind.replace('_', ' ')}": nbytes for kind, nbytes in device_bytes.items()}


def run_ledger(cfg, shape, *, world: int, stage: int, models: list, sglang_on_cpu: bool,
               enforce: bool) -> DeviceLedger:
    """The ledger of one rank of a colocated RL run of `world` ranks (planned as one node of `world` GPUs of the
    plan's default size), whose trainer `models` (TrainEngine, the actor first, frozen ones included) live on pipeline stage
    `stage`. `sglang_on_cpu`: SGLang's CPU pool is capped far below what a GPU gives it, so the plan's pool
    stands in for it. `enforce`: fail a phase over the plan (False: count and log only)."""
    from megarl.plan.estimate import plan, training_activations
    from megarl.plan.memory import DTYPE_BYTES, GRAD_BYTES, ADAM_BYTES, MASTER_BYTES, Cluster

    cluster = Cluster(nodes=1, gpus_per_node=world)

    job = None  # resolved by the first plan, for this cluster

    def replan(prompt_tokens: int) -> Plan:
        return plan(cfg, shape, cluster, prompt_tokens=prompt_tokens, job=job)

    first = replan(1)
    layout = first.layout
    job = first.job
    value_heads = [False] + ([True] if cfg.algo.traits.critic else [])

    def activations(tokens: int) -> int:  # a padded sequence's tokens, or with packing a packed row's
        packed = {"packed_tokens": tokens} if cfg.train.micro_batch_tokens else {}
        return max(training_activations(cfg, shape, layout, stage=stage, seq_len=tokens, value_head=head, **packed)
                   for head in value_heads)

    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    optim_bytes = ADAM_BYTES + (MASTER_BYTES if cfg.model.dtype != "float32" else 0)
    # the optimizer state's share on the device: optim.cpu_offload keeps the rest on the host
    trained_bytes = param_bytes + GRAD_BYTES + (1 - cfg.optim.cpu_offload) * optim_bytes
    # DDP_PADDING_ELEMENTS per parameter tensor in each buffer that holds one: parameters, and for a trained
    # model its gradients and optimizer state too
    padding = int(sum(DDP_PADDING_ELEMENTS * sum(1 for chunk in model.chunks for _ in chunk.parameters())
                      * (trained_bytes if model.memory.optimizer is not None else param_bytes) for model in models))
    stand_ins = {"rollout engine kv cache": first.rollout.kv_bytes} if sglang_on_cpu else {}
    actor = models[0]
    largest = max(p.numel() * p.element_size() for chunk in actor.chunks for p in chunk.parameters())
    return DeviceLedger(replan=replan, padding=padding, activations=activations, enforce=enforce,
                        stand_ins=stand_ins, largest_full_tensor=largest * layout.tp)
