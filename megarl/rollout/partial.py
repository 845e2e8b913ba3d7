"""Versioned generation, with partial rollouts: responses generated in chunks, new weights taken between chunks.

`VersionedEngine` wraps any rollout engine (megarl.rollout.engine) for a rollout rank of placement split
(megarl.loops.split). It records, for every generated token, the weight version that sampled it
(Generation.versions). With `chunk_tokens` below a call's `max_new_tokens` it generates each response
`chunk_tokens` at a time and calls `between_chunks()` after every chunk while some response is unfinished:
that is where a rollout rank loads weights pushed meanwhile, so a long generation is interrupted and continues
under the newer weights (AReaL's interruptible generation; slime's and verl's partial rollouts). A continued
response keeps its tokens and the logprob each was sampled with; the next chunk prefills the prompt and the
response so far again, with the new weights (an engine's KV cache of the old weights is flushed with every push).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from megarl.rollout.engine import Generation, ResponseCallback, RolloutEngine


class VersionedEngine:
    """A rollout engine that records each token's weight version and may take new weights between chunks."""

    def __init__(self, engine: RolloutEngine, *, chunk_tokens: int | None = None,
                 between_chunks: Callable[[], None] = lambda: None):
        self.engine = engine
        self.chunk_tokens = chunk_tokens  # None: each call in one piece
        self.between_chunks = between_chunks

    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_id: int, pad_id: int, on_response: ResponseCallback | None = None) -> Generation:
        n = len(prompts)
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        routes: list[Tensor | None] = [None] * n
        active = list(range(n))
        chunk = max_new_tokens if self.chunk_tokens is None else min(self.chunk_tokens, max_new_tokens)
        while active:
            version = self.engine.weight_version
            # every active response has the same length: all of the chunks so far
            budget = min(chunk, max_new_tokens - len(ids[active[0]]))
            handed: set[int] = set()

            def final(j: int, new_ids: list[int], new_logprobs: list[float], reason: str) -> None:
                # a response final within the call goes on at once (its reward may be scored meanwhile)
                i = active[j]
                if on_response is not None and (reason == "stop" or len(ids[i]) + len(new_ids) >= max_new_tokens):
                    handed.add(i)
                    on_response(i, ids[i] + new_ids, logprobs[i] + new_logprobs, reason)

            out = self.engine.generate([prompts[i] + ids[i] for i in active], temperature=temperature, top_p=top_p,
                                       max_new_tokens=budget, eos_id=eos_id, pad_id=pad_id, on_response=final)
            for j, i in enumerate(active):
                ids[i] += out.response_ids[j]
                logprobs[i] += out.logprobs[j]
                # the engine's own stamps; an engine that records none sampled with the version it had
                versions[i] += out.versions[j] if out.versions is not None else [version] * len(out.response_ids[j])
                if out.routes is not None:
                    routes[i] = out.routes[j]  # the last call's routes cover the whole sequence
                if out.finish_reasons[j] == "stop" or len(ids[i]) >= max_new_tokens:
                    reasons[i] = out.finish_reasons[j]
                    if on_response is not None and i not in handed:
                        on_response(i, ids[i], logprobs[i], reasons[i])
            active = [i for i in active if reasons[i] is None]
            if active:
                self.between_chunks()
        return Generation(response_ids=ids, logprobs=logprobs, finish_reasons=reasons,
                          routes=routes if all(r is not None for r in routes) and n else None, versions=versions)

    def __getattr__(self, name: str):
        """Everything else of the interface (weights, memory, cache, RNG, shutdown) is the engine's own."""
        return getattr(self.engine, name)
