"""The SGLang rollout engine: SGLang's offline `Engine`, co-located with the trainer.

One engine per rollout group, started by the group's first rank. On GPU it shares the devices with Megatron:
its weights, KV cache and CUDA-graph pool are released while the trainer works, the weights are resumed for
the weight push (with undefined contents: SGLang starts without `enable_weights_cpu_backup`) and the rest once
the push is done. An engine that takes a LoRA policy's adapters alone (rollout.lora_sync: adapter) keeps its
base weights. SGLang's CPU mode has no memory saver: a release frees nothing there, and resumed weights are
pushed NaN instead, so a CPU run that generates before the next full push fails as a GPU run would.

Weights arrive as full HF-named tensors in byte-bounded buckets (megarl.handoff). Every rank of the engine's
group holds each tensor in full (the trainer's gathers deliver them to every rank), so each flattens the
bucket into one fresh byte buffer on its own device and serializes it for the SGLang TP rank on that device:
on GPU the payload is a CUDA IPC handle to memory local to the scheduler that opens it, on CPU a
shared-memory tensor. The payloads are gathered to the host rank, which hands SGLang one per TP rank
(`gather_payloads`; the ranks beside the host run `SGLangPeer`). A buffer is never reused: CUDA keeps an
exported block until its receiver released it (`torch.cuda.ipc_collect` frees it then).

With `capture_routes`, SGLang records every token's top-k expert ids at each MoE layer as the token is fed
in (`enable_return_routed_experts`), indexed by the token's KV-cache slot, so prompt tokens served from the
prefix cache keep the routes of the forward that computed them (megarl flushes the cache after every push).
Each finished request returns them base64-encoded in `meta_info["routed_experts"]`.

Every call into SGLang is bounded (`rollout.engine_timeout_s` without progress: a push's bucket, a flush, a
release or resume, a generate call in which no response finished) and fails with EngineError naming its
phase. SGLang's watchdog answers a dead scheduler or detokenizer with SIGQUIT to this process, whose handler
would kill the process tree, trainer included; megarl takes that signal over and fails the call in flight
(or the next one) instead, so the run can start the engine again (megarl.loops.colocated).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.checkpoint import peft_adapter_config
from megarl.config import LoraConfig
from megarl.device import host_barrier, on_gpu
from megarl.handoff import WeightMismatch, buckets, flatten
from megarl.models.arch import ModelShape
from megarl.models.safetensors_dir import SafetensorsDir
from megarl.plan.memory import DTYPE_BYTES, kv_bytes_per_token
from megarl.rollout.engine import EngineError, Generation, ResponseCallback, released_weights
from megarl.rollout import sglang_plugin
from megarl.rollout.sglang_launch import (CPU_POOL_TOKENS, cpu_mode, engine_args, kill_processes, on_sigquit,
                                          start_engine)
from megarl.rollout.sglang_checks import LOADER, REPORT_NAME, header
from megarl.rollout.sglang_transfer import decode_routes, gather_payloads, ipc_exportable

log = logging.getLogger(__name__)

# SGLang's memory tags (sglang.srt.constants). The weights come back first, for the push that fills
# them; the KV cache and the CUDA-graph pool after it, so the push has the most room.
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")
# The largest tensor read back for a weight check (values): SGLang reads back through Python lists.
READBACK_MAX_VALUES = 1 << 22
# CPU mode: the buckets of NaN that stand in for resumed weights (resume_weights)
POISON_BUCKET_BYTES = 64 * 2**20


class SGLangEngine:
    """Generate with SGLang; take weights pushed by the trainer; release and resume device memory."""

    def __init__(self, model_dir: str, *, shape: ModelShape, dtype: str = "float32", seed: int = 0,
                 tp_size: int = 1, mem_fraction: float = 0.5, base_gpu_id: int = 0,
                 cpu_pool_tokens: int | None = CPU_POOL_TOKENS, capture_routes: bool = False,
                 group: dist.ProcessGroup | None = None, timeout_s: float = 1800.0, lora: LoraConfig | None = None,
                 nnodes: int = 1, dist_init_addr: str | None = None):
        """`shape`: the checkpoint's architecture (megarl.job reads it once per run). `group`: the trainer ranks
        on the engine's devices, this one first (its SGLang TP ranks, in order), each of which serializes its own
        copy of every pushed bucket (`SGLangPeer` on the others); None: this rank serializes its copy for every
        TP rank. `timeout_s`: how long a call may go without progress.
        `lora`: the policy's adapters (model.lora) arrive by `update_adapter` and every request uses them.
        `nnodes` > 1: the engine spans that many whole nodes; this is node 0, the others start their parts
        (SGLangNodePart) at the same time, meeting at `dist_init_addr`."""
        self.on_gpu = on_gpu()
        if group is not None and group.size() != tp_size:
            raise ValueError(f"the engine's group has {group.size()} ranks for an SGLang engine of tp_size {tp_size}")
        self.group = group
        if not self.on_gpu:
            cpu_mode()
            if nnodes > 1:
                # the schedulers of the other nodes are not this process's children: a host tensor travels to
                # them by name (a shared-memory file), as SGLangPeer's do, not as a descriptor only children take
                torch.multiprocessing.set_sharing_strategy("file_system")

        self.capture_routes = capture_routes
        if capture_routes:
            if not shape.is_moe:
                raise ValueError(f"capture_routes needs a mixture-of-experts model; {model_dir} is a dense "
                                 f"{shape.arch}")
            # megarl.models.arch.read_shape refuses dense layers between MoE layers, so SGLang's per-layer rows (one per
            # hidden layer) are exactly the MoE layers, in order.
            self.route_layers, self.route_top_k, self.route_experts = shape.moe_layers, shape.topk, shape.experts
            if not self.on_gpu:
                sglang_plugin.require("Capturing MoE routes")

        self.tp_size = tp_size
        self.model_dir = model_dir
        self.dtype = dtype
        self.keeps_weights = lora is not None  # adapters alone arrive: the base weights under them stay
        # SGLang skips tensor names its model does not know; a push is checked against the names of the
        # checkpoint the engine was started from instead, so a wrong name table fails loudly.
        checkpoint = SafetensorsDir(model_dir)
        self.expected_names = frozenset(checkpoint.names())
        self._shapes = checkpoint.shapes()
        self._sizes = {name: math.prod(shape) for name, shape in self._shapes.items()}  # read_weights
        # What this engine holds on each of its GPUs: its TP share of the weights, and the KV pool (sized below)
        self.weight_bytes = sum(self._sizes.values()) * DTYPE_BYTES[dtype] // tp_size
        self._kv_bytes_per_token = kv_bytes_per_token(shape, dtype=dtype, tp=tp_size)
        args = engine_args(model_dir, on_gpu=self.on_gpu, dtype=dtype, seed=seed, tp_size=tp_size,
                           mem_fraction=mem_fraction, base_gpu_id=base_gpu_id, cpu_pool_tokens=cpu_pool_tokens,
                           capture_routes=capture_routes, lora=lora, nnodes=nnodes, dist_init_addr=dist_init_addr)
        if lora is not None and not self.on_gpu:
            sglang_plugin.require("rollout.lora_sync = 'adapter'")
        self.adapter: str | None = None  # the loaded LoRA adapter every request names (update_adapter)
        self.timeout_s = timeout_s
        self.dead: str | None = None  # why SGLang can no longer answer, once it cannot
        self._watch: _CallWatch | None = None  # the call in flight
        self.engine = start_engine(args, owner=self, on_gpu=self.on_gpu, tp_size=tp_size, nnodes=nnodes)
        self._take_over_sigquit()
        if self.on_gpu:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            # CUDA IPC handles then name the GPU by UUID rather than by ordinal, which differs between
            # this process and the scheduler's when CUDA_VISIBLE_DEVICES orders differ.
            monkey_patch_torch_reductions()
        self.weight_version = 0
        self._released: set[str] = set()
        self.garbage = False  # weights resumed and not filled by a full push since: not the policy of any version
        self.kv_bytes = self._pool_tokens() * self._kv_bytes_per_token
        self.stamps_versions = hasattr(self.engine.tokenizer_manager, "update_weight_version")  # SGLang 0.5.21+
        self._readable: bool | None = None  # whether get_weights_by_name answers (None: not asked yet)

    def _take_over_sigquit(self) -> None:
        """Once running, SGLang answers SIGQUIT (from its watchdog, which polls its processes every second, or
        from a scheduler that raised) by killing this whole process tree. Its handler is set on the event loop
        when the first request starts the tokenizer manager's loop: start it now and replace the handler."""
        async def start_handle_loop() -> None:  # inside the engine's loop, or SGLang makes a loop of its own
            self.engine.tokenizer_manager.auto_create_handle_loop()

        self.engine.loop.run_until_complete(start_handle_loop())
        if threading.current_thread() is threading.main_thread():
            self.engine.loop.add_signal_handler(signal.SIGQUIT, on_sigquit)

    def _process_failed(self, *_) -> None:
        self.dead = "an SGLang process exited (SIGQUIT from SGLang: a scheduler or the detokenizer died or raised)"
        if self._watch is not None:
            self._watch.stop(self.dead)

    def _bounded(self, phase: str, call: Callable, *args, **kwargs):
        """`call(...)`, which runs on SGLang's event loop, failing with EngineError(phase) once `timeout_s` pass
        without progress or SGLang reports a dead process."""
        if self.dead is not None:
            raise EngineError(phase=phase, cause=self.dead)
        watch = self._watch = _CallWatch(self.engine.loop, self.timeout_s)
        try:
            return call(*args, **kwargs)
        except asyncio.CancelledError:
            raise EngineError(phase=phase, cause=watch.reason or "cancelled", elapsed_s=watch.elapsed_s) from None
        except EngineError:
            raise
        except Exception as e:
            if watch.reason is not None:  # a request cut short by the stop
                raise EngineError(phase=phase, cause=watch.reason, elapsed_s=watch.elapsed_s) from e
            raise
        finally:
            watch.close()
            self._watch = None

    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_id: int, pad_id: int, on_response: ResponseCallback | None = None) -> Generation:
        """One response per prompt; logprobs are SGLang's log_softmax(logits / temperature), before top-p.
        `on_response(i, ids, logprobs, finish_reason)` gets response i as soon as SGLang returns it.

        A response stops at `eos_id` (kept as its last token) or at `max_new_tokens`. SGLang also stops
        at the EOS ids of the checkpoint's config.json and generation_config.json, whatever is passed here.
        With `capture_routes`, `routes[i]` holds the experts of prompt i's tokens and of its response but
        the last token (Generation.routes).
        """
        if self.garbage or "weights" in self._released:
            raise released_weights(still_released="weights" in self._released)
        params = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                  "stop_token_ids": [eos_id], "ignore_eos": False}
        responses: dict[int, tuple[list[int], list[float], str]] = {}
        routes: dict[int, Tensor] = {}
        stamps: dict[int, int] = {}  # the weight version SGLang answered each request with

        # One request per prompt, all sent at once: SGLang's scheduler batches them as it would one batch
        # request, and each is answered as it finishes rather than with the slowest.
        async def request(i: int, ids: list[int]) -> None:
            out = await self.engine.async_generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                                   return_routed_experts=self.capture_routes, lora_path=self.adapter)
            if self._watch is not None:
                self._watch.progress()  # a response finished: the clock starts again
            meta = out["meta_info"]
            reason = meta["finish_reason"]["type"]
            if reason == "abort":
                raise EngineError(phase="generate", cause=f"SGLang aborted a request: {meta['finish_reason']}")
            response = list(out["output_ids"])
            responses[i] = (response, [lp for lp, _, _ in meta["output_token_logprobs"]][: len(response)],
                            "stop" if reason == "stop" else "length")
            stamps[i] = self._version_of(meta)
            if self.capture_routes:
                routes[i] = decode_routes(meta.get("routed_experts"), tokens=len(ids) + len(response) - 1,
                                          layers=self.route_layers, top_k=self.route_top_k,
                                          experts=self.route_experts)
            if on_response is not None:
                on_response(i, *responses[i])

        async def all_requests() -> None:
            await asyncio.gather(*(request(i, ids) for i, ids in enumerate(prompts)))

        self._bounded("generate", self.engine.loop.run_until_complete, all_requests())
        ordered = [responses[i] for i in range(len(prompts))]
        return Generation(response_ids=[r[0] for r in ordered], logprobs=[r[1] for r in ordered],
                          finish_reasons=[r[2] for r in ordered],
                          routes=[routes[i] for i in range(len(prompts))] if self.capture_routes else None,
                          versions=[[stamps[i]] * len(r[0]) for i, r in enumerate(ordered)])

    def _version_of(self, meta: dict) -> int:
        """The weight version SGLang stamped a response with (`meta_info["weight_version"]`, which megarl sets
        after every push: "default" until the first), or this engine's own count where SGLang cannot record one."""
        if not self.stamps_versions:
            return self.weight_version
        stamp = str(meta.get("weight_version", "default"))
        return int(stamp) if stamp.isdigit() else 0

    def rng_state(self) -> None:
        """None: SGLang's sampler state lives in its scheduler process and cannot be saved, so a resumed
        run samples differently from an uninterrupted one (it is seeded again from `seed`)."""
        return None

    def set_rng_state(self, state) -> None:
        if state is not None:
            raise ValueError("SGLangEngine cannot restore a sampler state (saved by another rollout engine)")

    def update_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], *, version: int,
                       expected: dict | None = None) -> int:
        """Load HF-named full tensors bucket by bucket inside one SGLang weight-update session. The tensors named in
        `expected` (filled as the stream passes, megarl.handoff.push_weights) are checked in every TP scheduler as
        they arrive and where they are loaded (megarl.rollout.sglang_checks); returns how many (tensor, TP rank)
        pairs were, or raises WeightMismatch naming the first that differed."""
        verify = expected if expected is not None else {}
        self._load(buckets, what=f"weight push of version {version}", group=self.group, verify=verify)
        checked = self._weight_report(version) if verify else 0
        self.garbage = False
        self._stamp(version)
        return checked

    def _weight_report(self, version: int) -> int:
        """The TP schedulers' checks of the push just loaded: the number of (tensor, rank) pairs found as pushed,
        or WeightMismatch at the first rank that found a difference."""
        reports = self._bounded("weight_report", self.engine.get_weights_by_name, REPORT_NAME, truncate_size=1)
        if not isinstance(reports, list):
            raise EngineError(phase="weight_report", cause=f"SGLang answered {reports!r} for the push's checks")
        for report in reports:
            if report["failures"]:
                raise WeightMismatch(
                    f"weight push of version {version}: SGLang TP rank {report['rank']} holds other weights than the "
                    f"trainer pushed: {report['failures'][0]} ({len(report['failures'])} differences on that rank). "
                    "Check the HF name table (megarl.models.names) and SGLang's loader for this model class")
        return sum(report["checked"] for report in reports)

    def _load(self, buckets: Iterable[list[tuple[str, Tensor]]], *, what: str,
              group: dist.ProcessGroup | None, verify: dict | None = None) -> None:
        """Every tensor of the model, bucket by bucket, inside one weight-update session; `group`: the ranks
        whose own copies SGLang's TP ranks take (None: this rank serializes one for each); `verify`: the names
        the TP schedulers check (megarl.rollout.sglang_checks)."""
        missing = set(self.expected_names)
        # SGLang 0.5.21+ applies tensor updates only inside a weight-update session; older releases have
        # no session and apply them directly.
        buckets = iter(buckets)
        session = hasattr(self.engine, "begin_weight_update")
        try:
            if session:
                _check(self._bounded("begin_weight_update", self.engine.begin_weight_update), "begin_weight_update")
            with ipc_exportable(self.on_gpu):
                for bucket in buckets:
                    unknown = [name for name, _ in bucket if name not in self.expected_names]
                    if unknown:
                        raise KeyError(f"{what}: the rollout model has no tensor {unknown[0]!r}")
                    missing.difference_update(name for name, _ in bucket)
                    self._send(bucket, group=group, verify=verify or {})
            if group is not None:
                host_barrier(group)  # SGLang loaded the last bucket: the group's buffers may go
            if session:
                _check(self._bounded("end_weight_update", self.engine.end_weight_update), "end_weight_update")
        except EngineError:
            if group is not None:  # the group's other ranks go on gathering: take their payloads to the end
                for bucket in buckets:
                    gather_payloads(bucket, group=group)
                host_barrier(group)
            raise
        finally:
            if self.on_gpu:
                torch.cuda.ipc_collect()  # free staging buffers whose last IPC reference just dropped
        if missing:
            raise ValueError(f"{what} missed tensors: {sorted(missing)[:5]}")

    def _send(self, bucket: list[tuple[str, Tensor]], *, group: dist.ProcessGroup | None, verify: dict) -> None:
        """One bucket to every TP scheduler, under a name that is its header (the slots of the bucket's byte
        buffer, and the trainer's Fingerprint of each tensor `verify` holds): for TP rank k, the buffer the trainer
        rank on its device made (`gather_payloads`), or with no `group` a handle to this rank's for each."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        if group is not None:
            per_rank, flat, slots = gather_payloads(bucket, group=group)
        else:
            # one handle per TP rank; each scheduler opens only its own, so the IPC reference counts drop back
            # to zero after every bucket
            flat, slots = flatten(bucket, share_memory=True)
            per_rank = [MultiprocessingSerializer.serialize(flat) for _ in range(self.tp_size)]
        expected = {name: verify[name] for name, _ in bucket if name in verify}
        payload = [(header(slots, expected), LocalSerializedTensor(values=per_rank))]
        _check(self._bounded("update_weights_from_tensor", self.engine.update_weights_from_tensor, payload,
                             load_format=LOADER, flush_cache=False), "update_weights_from_tensor")
        # Dropping the references is safe once the call returned: torch keeps an exported CUDA block out of the
        # allocator until every receiver has synchronized its stream and released its handle (ipc_collect frees
        # it then).
        del per_rank, flat

    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], *, rank: int, alpha: float,
                       version: int) -> None:
        """Unload the last adapter, load these (host copies, which SGLang reads for each of its TP ranks) as
        adapter `policy-v{version}` (`Engine.load_lora_adapter_from_tensors`); every later request names it.

        Always copies, on a CPU too: SGLang pickles the tensors for its scheduler with torch.multiprocessing,
        which moves a host tensor's storage into shared memory in place, and a trainer storage moved there
        (a view of its parameter buffer) crashes the process when the offload resizes it back."""
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
        config = peft_adapter_config(tensors, rank=rank, alpha=alpha, base_model=self.model_dir)
        if self.adapter is not None:
            _check_lora(self._bounded("unload_lora_adapter", self.engine.unload_lora_adapter, self.adapter),
                        "unload_lora_adapter")
            self.adapter = None
        name = f"policy-v{version}"
        _check_lora(self._bounded("load_lora_adapter_from_tensors", self.engine.load_lora_adapter_from_tensors,
                                  name, tensors, config), "load_lora_adapter_from_tensors")
        self.adapter = name
        self._stamp(version)

    def _stamp(self, version: int) -> None:
        """Version `version` is loaded: the scheduler stamps every later response with it (meta_info[
        "weight_version"], SGLang 0.5.21+)."""
        if self.stamps_versions:
            from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

            request = UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
            self._bounded("update_weight_version", self.engine.loop.run_until_complete,
                          self.engine.tokenizer_manager.update_weight_version(request))
        self.weight_version = version

    def read_weights(self, names: list[str]) -> Iterator[tuple[str, Tensor | None]]:
        """SGLang's own read-back, `Engine.get_weights_by_name`: in 0.5.23 the model class's method, which turns
        the whole tensor into a float32 Python list in the scheduler and sends it over its socket (about a
        microsecond per value), so tensors above READBACK_MAX_VALUES are not read (None). Only some classes have
        the method (Llama and a few others; not Qwen2, Qwen3 or the MoE classes: None for every tensor), and
        with tp_size > 1 it returns one TP rank's shard of the column-parallel tensors: None for all then."""
        for name in names:
            held = None
            if self.tp_size == 1 and self._readable is not False and self._sizes.get(name, 0) <= READBACK_MAX_VALUES:
                values = self._bounded("read_weights", self.engine.get_weights_by_name, name, truncate_size=sys.maxsize)
                # a model class without the method answers None to every name (and logs an error): ask once
                self._readable = self._readable or values is not None
                held = None if values is None else torch.tensor(values, dtype=torch.float32)
            yield name, held

    def flush_cache(self) -> None:
        result = self._bounded("flush_cache", self.engine.flush_cache)
        if not getattr(result, "success", True):
            raise EngineError(phase="flush_cache", cause=f"SGLang refused to flush its cache: {result}")

    def release_memory(self) -> int:
        """Free SGLang's weights (unless it keeps them), KV cache and CUDA-graph pool for the trainer; returns the
        bytes given back on each of the engine's GPUs (weights and KV pool; the graph pool is not counted).
        SGLang must be idle: generate() has returned. In CPU mode nothing is freed (SGLang has no memory saver
        there) and the weights are poisoned when they are resumed (`resume_weights`)."""
        tags = [t for t in (CACHE_TAGS if self.keeps_weights else WEIGHT_TAGS + CACHE_TAGS) if t not in self._released]
        if not tags:
            return 0
        if self.on_gpu:
            self._bounded("release_memory", self.engine.release_memory_occupation, tags=tags)
        self._released.update(tags)
        return self.kv_bytes * ("kv_cache" in tags) + self.weight_bytes * ("weights" in tags)

    def resume_weights(self) -> None:
        """Re-allocate the weight memory, ahead of the push that fills it. Released weights come back as garbage
        (on a CPU: NaN): a full push must follow before the next generate."""
        if "weights" not in self._released:
            return
        if self.on_gpu:
            self._bounded("resume_weights", self.engine.resume_memory_occupation, tags=list(WEIGHT_TAGS))
        else:
            self._load(self._poison(), what="the CPU stand-in of resumed weights (NaN)", group=None)
        self._released.difference_update(WEIGHT_TAGS)
        self.garbage = True

    def resume_cache(self) -> None:
        """Re-allocate the KV cache and CUDA-graph pool once the push is done."""
        # SGLang raises on resuming a tag that is not released: resume only what release_memory took.
        tags = [t for t in CACHE_TAGS if t in self._released]
        if tags and self.on_gpu:
            self._bounded("resume_cache", self.engine.resume_memory_occupation, tags=tags)
        self._released.difference_update(tags)

    def device_bytes(self) -> dict[str, int]:
        """What the engine holds on each of its GPUs now, by kind: its weights and its KV pool, while not released."""
        return {"weights": 0 if "weights" in self._released else self.weight_bytes,
                "kv_cache": 0 if "kv_cache" in self._released else self.kv_bytes}

    def _poison(self) -> Iterator[list[tuple[str, Tensor]]]:
        """Every tensor of the model filled with NaN, in buckets of POISON_BUCKET_BYTES: what a GPU engine's resumed
        weights hold, for SGLang's CPU mode, which cannot unmap them."""
        dtype = getattr(torch, self.dtype)
        return buckets(((name, torch.full(self._shapes[name], float("nan"), dtype=dtype))
                        for name in sorted(self.expected_names)), bucket_bytes=POISON_BUCKET_BYTES)

    def _pool_tokens(self) -> int:  # the KV pool's size in tokens, as SGLang's scheduler sized it
        return int(self.engine.get_server_info()["max_total_num_tokens"])

    def shutdown(self) -> None:
        self.engine.shutdown()

    def abandon(self) -> None:
        """Kill this engine's processes (its schedulers and detokenizer, each with its children) and cancel its
        tasks, without waiting on SGLang. SGLang's own shutdown kills every child of this process, which would
        take the reward sandboxes and pools beside it too."""
        self.dead = self.dead or "abandoned after a failure"
        manager = self.engine.tokenizer_manager
        if getattr(manager, "_subprocess_watchdog", None) is not None:
            manager._subprocess_watchdog.stop()  # a child it sees die would send SIGQUIT again
        kill_processes(self.engine)
        for task in getattr(manager, "asyncio_tasks", ()):
            task.cancel()


def _check(result, what: str) -> None:
    """SGLang's weight calls return (success, message) and never raise: turn a failure into an error."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool) and not result[0]:
        raise EngineError(phase=what, cause=f"SGLang said: {result[1]}")


def _check_lora(result, what: str) -> None:
    """SGLang's adapter calls answer LoRAUpdateOutput(success, error_message) and never raise."""
    if not getattr(result, "success", False):
        raise EngineError(phase=what, cause=f"SGLang said: {getattr(result, 'error_message', result)}")


class _CallWatch:
    """Bounds one call on SGLang's event loop: the tasks the call starts are cancelled (so the call raises
    CancelledError) once `timeout_s` pass without `progress()`, or at `stop(reason)`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self.loop, self.timeout_s = loop, timeout_s
        self.before = asyncio.all_tasks(loop)  # SGLang's own tasks (its handle loop), left alone
        self.started = time.monotonic()
        self.reason: str | None = None
        self.timer = loop.call_later(timeout_s, self._expired)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _expired(self) -> None:
        self.stop(f"no progress in rollout.engine_timeout_s = {self.timeout_s:g} s")

    def progress(self) -> None:
        self.timer.cancel()
        self.timer = self.loop.call_later(self.timeout_s, self._expired)

    def stop(self, reason: str) -> None:
        self.reason = self.reason or reason
        for task in asyncio.all_tasks(self.loop) - self.before:
            task.cancel()

    def close(self) -> None:
        self.timer.cancel()
