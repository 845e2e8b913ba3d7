"""The SGLang rollout engine: SGLang's offline `Engine`, co-located with the trainer.

One engine per rollout group, started by the group's first rank. On GPU it shares the devices with
Megatron: its weights and KV cache are released while the trainer works and resumed for the weight push
and the next generation. On a machine without CUDA, SGLang runs in its CPU mode (no memory release there:
those calls are GPU-only and are skipped and logged), so the same code path is tested everywhere.

Weights arrive as full HF-named tensors in byte-bounded buckets (megarl.handoff). Each bucket is
flattened into one fresh byte buffer (never reused: SGLang reads it asynchronously through CUDA IPC on GPU
or shared memory on CPU) and sent once per rollout TP rank inside SGLang's weight-update session.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from torch import Tensor

from megarl.engine import cpu_compat
from megarl.models.safetensors_dir import SafetensorsDir
from megarl.rollout.native import Generation

log = logging.getLogger(__name__)


class SGLangEngine:
    """Generate with SGLang; take weights pushed by the trainer; release and resume device memory."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0, tp_size: int = 1,
                 mem_fraction: float = 0.5, base_gpu_id: int = 0):
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            # SGLang's CPU mode, for this process and the scheduler processes it spawns.
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            cpu_compat.load_cuda_driver_stand_in()
        import sglang

        args = dict(model_path=model_dir, tp_size=tp_size, dtype=dtype, random_seed=seed,
                    skip_tokenizer_init=True, log_level="error")
        if self.on_gpu:
            args.update(enable_memory_saver=True, base_gpu_id=base_gpu_id, mem_fraction_static=mem_fraction)
        else:
            # CPU mode: torch attention, no CUDA graphs, a small fixed KV pool.
            args.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                        disable_overlap_schedule=True, mem_fraction_static=0.05,
                        max_total_tokens=8192)
        self.tp_size = tp_size
        # SGLang skips tensor names its model does not know; a push is checked against the names of the
        # checkpoint the engine was started from instead, so a wrong name table fails loudly.
        self.expected_names = frozenset(SafetensorsDir(model_dir).names())
        self.engine = sglang.Engine(**args)
        self.weight_version = 0
        self._released = False

    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_id: int, pad_id: int) -> Generation:
        """One response per prompt; logprobs are SGLang's log_softmax(logits / temperature), before top-p."""
        params = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                  "stop_token_ids": [eos_id]}
        outs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        response_ids, logprobs, reasons = [], [], []
        for out in outs:
            meta = out["meta_info"]
            ids = list(out["output_ids"])
            reason = meta["finish_reason"]["type"]
            if reason == "abort":
                raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
            response_ids.append(ids)
            logprobs.append([lp for lp, _, _ in meta["output_token_logprobs"]][: len(ids)])
            reasons.append("stop" if reason == "stop" else "length")
        return Generation(response_ids=response_ids, logprobs=logprobs, finish_reasons=reasons)

    def rng_state(self) -> None:
        """None: SGLang's sampler state lives in its scheduler process and cannot be saved, so a resumed
        run samples differently from an uninterrupted one (it is seeded again from `seed`)."""
        return None

    def set_rng_state(self, state) -> None:
        if state is not None:
            raise ValueError("SGLangEngine cannot restore a sampler state (saved by another rollout engine)")

    def update_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], *, version: int) -> None:
        """Load HF-named full tensors bucket by bucket inside one SGLang weight-update session."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        missing = set(self.expected_names)
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in buckets:
                unknown = [name for name, _ in bucket if name not in self.expected_names]
                if unknown:
                    raise KeyError(f"weight push of version {version}: the rollout model has no tensor {unknown[0]!r}")
                missing.difference_update(name for name, _ in bucket)
                # Widest dtypes first keeps every tensor's byte offset a multiple of its item size.
                ordered = sorted(bucket, key=lambda item: -item[1].element_size())
                flat = FlattenedTensorBucket(named_tensors=[(n, t.detach().contiguous()) for n, t in ordered])
                payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
                per_rank = [MultiprocessingSerializer.serialize(payload, output_str=True)
                            for _ in range(self.tp_size)]
                _check(self.engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket",
                                                              flush_cache=False), "update_weights_from_tensor")
                del flat, payload, per_rank  # SGLang has copied the bucket once the call returned
        finally:
            _check(self.engine.end_weight_update(), "end_weight_update")
        if missing:
            raise ValueError(f"weight push of version {version} missed tensors: {sorted(missing)[:5]}")
        self.weight_version = version

    def flush_cache(self) -> None:
        result = self.engine.flush_cache()
        if not getattr(result, "success", True):
            raise RuntimeError(f"SGLang refused to flush its cache: {result}")

    def release_memory(self) -> None:
        """Free SGLang's weights and KV cache for the trainer (GPU only)."""
        if not self.on_gpu:
            log.debug("sglang: release_memory skipped on CPU (GPU-only operation)")
            return
        self.engine.release_memory_occupation(tags=["kv_cache", "weights"])
        self._released = True

    def resume_weights(self) -> None:
        """Re-allocate the weight memory, ahead of the push that fills it (GPU only)."""
        if self.on_gpu and self._released:
            self.engine.resume_memory_occupation(tags=["weights"])

    def resume_cache(self) -> None:
        """Re-allocate the KV cache once the push is done (GPU only)."""
        if self.on_gpu and self._released:
            self.engine.resume_memory_occupation(tags=["kv_cache"])
            self._released = False

    def shutdown(self) -> None:
        self.engine.shutdown()


def _check(result, what: str) -> None:
    """SGLang's weight calls return (success, message) and never raise: turn a failure into an error."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool) and not result[0]:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
