"""Starting SGLang's processes beside a trainer rank: the engine's arguments (`engine_args`), the environment
they start in (`launch_env`), the part of an engine over whole nodes that runs on node k >= 1
(`SGLangNodePart`), stopping what an engine started and nothing else (`kill_processes`), and SGLang's SIGQUIT
turned into a failure of the engine instead of the death of this process (`sigquit_to`).
megarl.rollout.sglang_engine is the engine itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from megarl.config import LoraConfig
from megarl.device import load_cuda_driver_stand_in, on_gpu
from megarl.rollout.sglang_checks import LOADER

# CPU mode: the KV pool's cap in tokens. SGLang would otherwise give the pool mem_fraction of the free host
# memory (less the weights), which on a shared machine is gigabytes no tiny-model run needs.
CPU_POOL_TOKENS = 8192

def engine_args(model_dir: str, *, on_gpu: bool, dtype: str, seed: int, tp_size: int, mem_fraction: float,
                base_gpu_id: int, cpu_pool_tokens: int | None = CPU_POOL_TOKENS, capture_routes: bool = False,
                lora: LoraConfig | None = None, nnodes: int = 1, node_rank: int = 0,
                dist_init_addr: str | None = None) -> dict:
    """Keyword arguments of `sglang.Engine` (each one a ServerArgs field; tests check the names).

    `cpu_pool_tokens` caps the KV pool in CPU mode; None leaves it as SGLang sizes it from the free host
    memory (what a GPU engine always does with the device's). `capture_routes` makes SGLang record each
    token's MoE experts. `lora`: serve LoRA adapters of that rank on those modules (`update_adapter`).
    `nnodes` > 1: an engine over that many whole nodes, this process starting its part on node `node_rank`,
    the nodes meeting at `dist_init_addr` ("host:port" on node 0)."""
    # every push loads through megarl's loader, which checks the weights in each TP scheduler
    args = dict(model_path=model_dir, tp_size=tp_size, dtype=dtype, random_seed=seed,
                skip_tokenizer_init=True, log_level="error", custom_weight_loader=[LOADER])
    if nnodes > 1:
        args.update(nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    if capture_routes:
        # SGLang sizes its routes buffers at start-up; a request's `return_routed_experts` only reads them.
        args.update(enable_return_routed_experts=True)
    if lora is not None:
        # One adapter at a time: each push unloads the last before it loads the next. SGLang's default
        # kernels are Triton's; its CPU mode has only the torch one (and needs megarl.rollout.sglang_plugin).
        args.update(enable_lora=True, max_lora_rank=lora.rank, lora_target_modules=lora.hf_modules(),
                    max_loras_per_batch=1, max_loaded_loras=1)
        if not on_gpu:
            args.update(lora_backend="torch_native")
    if on_gpu:
        # The memory saver is what makes release/resume free anything. A pauseable CUDA-graph pool
        # (SGLANG_MEMORY_SAVER_CUDA_GRAPH, set in `launch_env`) is incompatible with SGLang's
        # breakable prefill graphs, so prefill runs eagerly and decode keeps its full graphs. Torch sampling
        # instead of FlashInfer's, which is compiled on first use (minutes on a fresh machine, and nvcc).
        args.update(enable_memory_saver=True, base_gpu_id=base_gpu_id, mem_fraction_static=mem_fraction,
                    cuda_graph_backend_prefill="disabled", sampling_backend="pytorch")
    else:
        # CPU mode: torch attention, no CUDA graphs. The fraction is of the host memory free at start-up
        # and must cover the weights; max_total_tokens keeps the KV pool itself small.
        args.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                    disable_overlap_schedule=True, mem_fraction_static=mem_fraction)
        if cpu_pool_tokens is not None:
            args.update(max_total_tokens=cpu_pool_tokens)
    return args


class SGLangNodePart:
    """Node k >= 1 of an SGLang engine that spans whole nodes (rollout.tp a multiple of the GPUs of a node),
    started by the node's first rank while the engine's host starts node 0 (SGLangEngine with the same `nnodes`
    and `dist_init_addr`): SGLang's schedulers for the TP ranks on this node, which take every request, weight
    push and memory release from node 0 over SGLang's own TP group. This rank only starts, watches and stops them;
    in a push it hands its device's payload like every rank beside a host (SGLangPeer), which the scheduler on
    that device opens: a CUDA IPC handle never leaves its node."""

    def __init__(self, model_dir: str, *, dtype: str, seed: int, tp_size: int, nnodes: int, node_rank: int,
                 dist_init_addr: str, mem_fraction: float = 0.5, base_gpu_id: int = 0,
                 cpu_pool_tokens: int | None = CPU_POOL_TOKENS, capture_routes: bool = False,
                 lora: LoraConfig | None = None):
        self.on_gpu = on_gpu()
        if not self.on_gpu:
            cpu_mode()
        args = engine_args(model_dir, on_gpu=self.on_gpu, dtype=dtype, seed=seed, tp_size=tp_size,
                           mem_fraction=mem_fraction, base_gpu_id=base_gpu_id, cpu_pool_tokens=cpu_pool_tokens,
                           capture_routes=capture_routes, lora=lora, nnodes=nnodes, node_rank=node_rank,
                           dist_init_addr=dist_init_addr)
        self.dead: str | None = None  # why this node's schedulers stopped, once one did
        self.engine = start_engine(args, owner=self, on_gpu=self.on_gpu, tp_size=tp_size, nnodes=nnodes,
                                   node_rank=node_rank)

    def _process_failed(self, *_) -> None:
        self.dead = "an SGLang scheduler of this node exited (SIGQUIT from SGLang: it died or raised)"

    def shutdown(self) -> None:
        """Stop this node's schedulers (SGLang's own shutdown would kill every child of this process)."""
        kill_processes(self.engine)

    def abandon(self) -> None:
        self.dead = self.dead or "abandoned after a failure"
        kill_processes(self.engine)


def cpu_mode() -> None:
    """SGLang's CPU mode, for this process and the scheduler processes it spawns."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    load_cuda_driver_stand_in()


def start_engine(args: dict, *, owner, on_gpu: bool, tp_size: int, nnodes: int = 1, node_rank: int = 0):
    """`sglang.Engine(**args)` for node `node_rank` of an engine of `tp_size` TP ranks over `nnodes` nodes, in
    `launch_env`, SGLang's SIGQUIT going to `owner._process_failed` while it starts (the server arguments travel
    to its processes, so the handler is a module function, pickled by name)."""
    from sglang.srt.entrypoints.engine import Engine

    args["custom_sigquit_handler"] = sigquit_to(owner)
    with launch_env(on_gpu, tp_size=tp_size, nnodes=nnodes, node_rank=node_rank):
        return Engine(**args)


def kill_processes(engine) -> None:
    """Kill the processes an `sglang.Engine` started in this process (its schedulers and detokenizer, each with its
    children), and nothing else, without waiting on SGLang."""
    import psutil

    doomed = []
    for pid in engine.get_all_child_pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            doomed += [*root.children(recursive=True), root]
    for process in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(doomed, timeout=30)


@contextlib.contextmanager
def launch_env(on_gpu: bool, *, tp_size: int = 1, nnodes: int = 1, node_rank: int = 0) -> Iterator[None]:
    """Environment for starting SGLang next to a trainer, restored afterwards: node `node_rank` of an engine of
    `tp_size` TP ranks over `nnodes` nodes.

    SGLang's scheduler processes inherit this process's environment at start. torch_memory_saver refuses
    expandable segments, so PYTORCH_CUDA_ALLOC_CONF is left out for them; the CUDA-graph pool is made
    pauseable. SGLang also overwrites CUDA_DEVICE_MAX_CONNECTIONS (Megatron needs its own value for
    overlapped TP communication) and resets the root logger to its log level (silencing the trainer's).
    SGLang's CPU mode with several TP ranks binds each to the cores SGLANG_CPU_OMP_THREADS_BIND lists for it (by
    default one NUMA node each, which a machine with fewer nodes refuses); megarl deals this process's cores out
    to the node's ranks. Its TP groups would also load the NCCL library a CUDA build of torch brings and ask it
    for a device, so it is pointed at none (what a CPU build of torch has). A node part's `sglang.Engine` returns
    once its schedulers are up instead of blocking (SGLANG_BLOCK_NONZERO_RANK_CHILDREN).
    """
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS", "SGLANG_MEMORY_SAVER_CUDA_GRAPH",
            "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_NCCL_SO_PATH", "SGLANG_BLOCK_NONZERO_RANK_CHILDREN")
    saved = {k: os.environ.get(k) for k in keys}
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    if on_gpu:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
    elif tp_size > 1:
        per_node = tp_size // nnodes
        cores = sorted(os.sched_getaffinity(0))  # entry i: the node's i-th rank, TP rank node_rank * per_node + i
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(
            str(cores[r % len(cores)]) for r in range(node_rank * per_node, (node_rank + 1) * per_node)))
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", "megarl-cpu-mode-has-no-nccl")
    if node_rank > 0:
        os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        root.setLevel(root_level)
        root.handlers[:] = root_handlers


_sigquit_target = None  # the engine (or node part) this process started last: SGLang's SIGQUIT goes to it


def sigquit_to(target) -> Callable:
    """The SIGQUIT handler to hand SGLang (`custom_sigquit_handler`, which its processes inherit by name): it
    calls `target._process_failed()`, for the engine or node part this process starts now."""
    global _sigquit_target
    _sigquit_target = target
    return on_sigquit


def on_sigquit(*_) -> None:
    if _sigquit_target is not None:
        _sigquit_target._process_failed()
