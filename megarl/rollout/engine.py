"""The rollout-engine interface: what the RL loop asks of a generation backend, and the one place that picks it.

Two engines implement it: `native` (a transformers model in-process; megarl.rollout.native) and `sglang`
(SGLang's offline engine, co-located with the trainer; megarl.rollout.sglang_engine). The loop calls, per
step and in this order: `generate`, `release_memory` (the trainer takes the device), then after the update
`resume_weights`, `update_weights` + `flush_cache` + `read_weights` (megarl.handoff.push_weights, which
verifies the push; a LoRA policy with rollout.lora_sync: adapter calls `update_adapter` + `flush_cache`
instead), `resume_cache`. A call that fails raises EngineError (`abandon` then frees what the
engine holds, and the loop starts a new one). megarl.rollout.backends picks the recipe's engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor


@dataclass(frozen=True)
class Generation:
    """What an engine returns for each prompt it was given, in order."""

    response_ids: list[list[int]]        # generated token ids, EOS included when it stopped on EOS
    logprobs: list[list[float]]          # one per response token
    finish_reasons: list[str]            # "stop" (EOS) or "length" (max_new_tokens)
    # With routes captured (an engine built with `capture_routes=True` on a MoE model): per prompt, the
    # experts [len(prompt) + len(response) - 1, moe_layers, top_k] (megarl.routing.route_dtype) that row t's
    # token was routed to at each MoE layer, in layer order, when the engine fed it in: the prompt's tokens
    # at prefill, then each sampled token but the last (which is never fed in). None otherwise.
    routes: list[Tensor] | None = None
    # Per prompt, the weight version that sampled each response token, as the engine records it (its
    # `weight_version` when the call ran; a partial rollout's chunks may differ: megarl.rollout.partial).
    versions: list[list[int]] | None = None


class EngineError(RuntimeError):
    """A rollout engine failed a call: its process died, the call raised inside the engine, or it went
    `rollout.engine_timeout_s` without progress. The engine is unusable afterwards; colocated runs start it
    again (megarl.loops.colocated, rollout.max_engine_restarts)."""

    def __init__(self, *, phase: str, cause: str, elapsed_s: float | None = None):
        self.phase, self.cause, self.elapsed_s = phase, cause, elapsed_s
        after = f" after {elapsed_s:.1f} s" if elapsed_s is not None else ""
        super().__init__(f"{phase} failed{after}: {cause}")


def released_weights(*, still_released: bool) -> EngineError:
    """The error of a `generate` whose engine's weights do not hold any version of the policy: released for the
    trainer and not resumed yet, or resumed (garbage, as a GPU's remapped pages) and not filled by a full push
    since (an engine taking adapters alone must keep its base weights)."""
    return EngineError(phase="generate", cause=(
        "the engine's weights were released for the trainer and no full weight push has filled them since "
        "(released weights come back as garbage): " + ("they are still released" if still_released else
        "a push of the adapters alone does not restore the base weights under them")))


# An engine's call for each response as soon as it is final: (index in the call's prompts, response ids,
# their logprobs, finish reason).
ResponseCallback = Callable[[int, list[int], list[float], str], None]


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend that takes the trainer's weights after every update."""

    weight_version: int  # the version of the last complete weight push (0: the checkpoint it started from)

    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_id: int, pad_id: int, on_response: ResponseCallback | None = None) -> Generation:
        """One response per prompt (repeat a prompt for a group). Logprobs are log_softmax(logits /
        temperature) of each sampled token, before top-p truncation. `on_response` gets each response as
        soon as it is final, while the others are still generated."""
        ...

    def update_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], *, version: int,
                       expected: dict | None = None) -> int | None:
        """Load full HF-named tensors, bucket by bucket; every tensor of the model must arrive, else an error.
        `expected`: the trainer's Fingerprint of each tensor the push verifies (megarl.handoff; filled as the stream
        passes). An engine that checks them where it loads them returns how many (tensor, device) pairs it checked
        and raises WeightMismatch on a difference; None: the push reads them back (`read_weights`)."""
        ...

    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], *, rank: int, alpha: float,
                       version: int) -> None:
        """Apply a LoRA policy's adapters as version `version` (rollout.lora_sync: adapter), in place of the ones
        before, over the base weights the engine started from: PEFT-named full tensors
        (`base_model.model.{module}.lora_A.weight` [rank, in], `.lora_B.weight` [out, rank]), each module's
        update (alpha / rank) B A."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes computed with the previous weights."""
        ...

    def read_weights(self, names: list[str]) -> Iterable[tuple[str, Tensor | None]]:
        """The engine's own copy of each named tensor, in the HF layout it was pushed in, one at a time and in
        order (a view where the engine can); None for a tensor the engine cannot read back. Weight checks
        (megarl.handoff.verify_engine) compare these with the trainer's."""
        ...

    def release_memory(self) -> int:
        """Give the device memory (weights, KV cache) to the trainer; returns the bytes given back on each of the
        engine's devices. Released weights are gone, on a CPU too: the engine cannot generate the trainer's policy
        until a full push fills them again (its `generate` raises EngineError until then). An engine that keeps
        its weights (one taking a LoRA policy's adapters alone) gives back its KV cache only."""
        ...

    def resume_weights(self) -> None:
        """Take the weight memory back, ahead of the push that fills it; until then it holds garbage."""
        ...

    def resume_cache(self) -> None:
        """Take the KV cache back once the push is done."""
        ...

    def device_bytes(self) -> dict[str, int]:
        """What the engine holds on each of its devices now, by kind ("weights", "kv_cache"), as a GPU run would
        hold it: counted by the run's device-memory ledger (megarl.ledger)."""
        ...

    def rng_state(self) -> Tensor | None:
        """The sampler's random state for checkpoints; None when the engine cannot save it."""
        ...

    def set_rng_state(self, state: Tensor | None) -> None:
        ...

    def shutdown(self) -> None:
        ...

    def abandon(self) -> None:
        """Free what a failed engine holds (its processes, its device memory) without waiting on it."""
        ...


@runtime_checkable
class RolloutPeer(Protocol):
    """A rank beside an engine's host, on one of the engine's devices: its side of every weight push."""

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, bucket_bytes: int) -> dict:
        """Take part in the host's `update_weights` of these tensors (each rank holds them in full); returns the
        push's counts (`bytes`)."""
        ...
