"""Megatron distributed checkpoints of a train engine: model and optimizer state written by every rank
collectively, fully reshardable (loads at any TP, PP, EP or DP layout), checked before reading, and the
trainer's RNG state beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from megarl.checkpoint import CheckpointError
from megarl.device import on_gpu
from megarl.engine.hf_weights import hf_shard
from megarl.engine.lora import is_adapter
from megarl.engine.model import StageModel, global_name, named_weights
from megarl.models.safetensors_dir import SafetensorsDir

# How optimizer state is laid out in distributed checkpoints: "fully_reshardable" is the format that loads
# at a different TP/PP/EP/DP layout (the default "fully_sharded_model_space" fails to save on gloo).
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def save(stage: StageModel, optimizer, path: str | Path, *, hf_dir: str | Path | None = None,
         progress: Callable[[], object] | None = None) -> None:
    """Model (and optimizer) state as a Megatron distributed checkpoint in directory `path`, written by
    every rank of the job collectively. The optimizer state is saved fully reshardable, so the
    checkpoint loads at any TP, PP, EP or DP layout.

    With `hf_dir` (a model without optimizer), the weights are read from that HF checkpoint as the
    writer reaches each one instead of from the module, which may then live on the meta device
    (megarl.engine.megatron.meta_engine): memory holds about one tensor, whatever the model size.
    `progress()` is called after each tensor (chunk) is written."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)  # Megatron writes into an existing, empty directory
    _collect_write_results_in_process()
    if hf_dir is None:
        state = _sharded_state(stage, optimizer, is_loading=False)
        dist_checkpointing.save(state, str(path), content_metadata=CHECKPOINT_METADATA)
        return
    from megarl.engine.lazy_checkpoint import LazySave

    if optimizer is not None:
        raise ValueError("save_checkpoint(hf_dir=...) writes weights only; this engine has an optimizer")
    # one model chunk (the conversion tools build no virtual stages); the files name tensors by their
    # global keys, so the checkpoint loads into any number of chunks
    state = {"model": stage.module.sharded_state_dict()}
    source, params = SafetensorsDir(hf_dir), dict(named_weights(stage.module))

    def resolve(local_name: str) -> Tensor:
        name = global_name(local_name, stage.layer_offsets[0])
        return hf_shard(stage, source, name, params[local_name]).to(params[local_name].dtype)

    dist_checkpointing.save(state, str(path), sharded_strategy=LazySave(resolve, progress=progress),
                            content_metadata=CHECKPOINT_METADATA)


def _collect_write_results_in_process() -> None:
    """Give Megatron's file writer a plain in-process queue for its write results.

    Its default is a `multiprocessing.Manager` queue: a spawned server process (~300 MB, it imports the
    launching module) plus a resource tracker, both kept for the life of the job and left running when the
    job is killed with SIGKILL. A synchronous save, the only kind megarl makes, puts and gets the results
    in the calling process (AsyncRequest.execute_sync), so no process is needed for them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load(stage: StageModel, optimizer, path: str | Path) -> None:
    """Restore what `save_checkpoint` wrote, whatever layout wrote it (a frozen or converted model
    takes the model part of a checkpoint that also holds optimizer state). A checkpoint of another
    architecture or size is an error listing the tensors that do not match; nothing is loaded then."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _ready_for_loading(optimizer)
    state = _sharded_state(stage, optimizer, is_loading=True)
    _check_checkpoint(Path(path), state["model"])
    strict = StrictHandling.RAISE_ALL if optimizer is not None else StrictHandling.RAISE_UNEXPECTED
    loaded = dist_checkpointing.load(state, str(path), strict=strict)
    for chunk, chunk_state in zip(stage.chunks, loaded["model"], strict=True):
        _load_chunk(chunk, chunk_state, adapters_only=stage.lora is not None)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])


def _load_chunk(chunk, state: dict, *, adapters_only: bool) -> None:
    """Copy a loaded state into a model chunk: every tensor, or with LoRA every adapter (the base stays)."""
    if not adapters_only:
        chunk.load_state_dict(state)
        return
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [name for name in missing if is_adapter(name)]
    if missing or unexpected:
        raise CheckpointError(f"LoRA checkpoint: missing adapters {missing[:5]}, unexpected tensors {unexpected[:5]}")


def checkpoint_params(stage: StageModel, path: Path, *, bucket_bytes: int) -> Iterator[tuple[str, Tensor, Tensor]]:
    """(name with the global layer index, parameter, its value on this rank read from checkpoint `path`)
    for every parameter, in module order, read a bucket of about `bucket_bytes` at a time (a larger
    tensor alone). An engine of one model chunk (`module`)."""
    from megarl.engine.lazy_checkpoint import read_parameters

    model_state = stage.module.sharded_state_dict()
    _check_checkpoint(path, model_state)
    params = list(named_weights(stage.module))
    while params:
        bucket = [params.pop(0)]
        size = bucket[0][1].nbytes
        while params and size + params[0][1].nbytes <= bucket_bytes:
            size += params[0][1].nbytes
            bucket.append(params.pop(0))
        values = {name: torch.empty_like(param, device="cpu") for name, param in bucket}
        read_parameters(path, {name: model_state[name] for name, _ in bucket}, values)
        for name, param in bucket:
            yield global_name(name, stage.layer_offsets[0]), param, values.pop(name)


def _ready_for_loading(optimizer) -> None:
    """Give a fresh torch Adam (the optimizer Megatron falls back to without apex or Transformer Engine)
    zero moments and a `step`, as it has after a real step. Megatron's own state initialization for
    loading leaves `step` out, and its distributed optimizer then fails reading it; the loaded
    checkpoint overwrites all three.

    A fresh HybridDeviceOptimizer (optim.cpu_offload) takes Megatron's own dummy step, which its distributed
    optimizer runs when loading into it, but only after reading the state's steps, which without apex or
    Transformer Engine fails on an empty state. The step moves the weights and the optimizer state by random
    gradients; the checkpoint then overwrites both (and a resume restores the RNG after loading).

    A checkpoint written with optim.cpu_offload, whatever this run's setting, names the offloading optimizer's
    host and device optimizer classes (they sit in its param groups), which torch.load reads only once
    allowed: exactly the two megatron-core builds it with."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if optimizer is None:
        return
    torch.serialization.add_safe_globals([torch.optim.AdamW, megatron_optimizer.Adam])
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if isinstance(torch_optimizer, HybridDeviceOptimizer) and not torch_optimizer.state:
            torch_optimizer.dummy_step()
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if not torch_optimizer.state[param]:
                    torch_optimizer.state[param].update(
                        exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param),
                        step=torch.zeros((), dtype=torch.float32))


def _sharded_state(stage: StageModel, optimizer, *, is_loading: bool) -> dict:
    # One state dict per chunk. The tensors' keys in the checkpoint carry global layer indices (the dict
    # keys inside each chunk's state do not), so any number of chunks per rank loads any other.
    model_state = [chunk.sharded_state_dict() for chunk in stage.chunks]
    if stage.lora is not None:  # the frozen base is model.path's: a checkpoint holds what trains
        model_state = [{k: v for k, v in chunk.items() if is_adapter(k)} for chunk in model_state]
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                               metadata=CHECKPOINT_METADATA)
    return state


def _check_checkpoint(path: Path, model_state: dict) -> None:
    """Before reading distributed checkpoint `path` into a model whose sharded state is `model_state`: a
    CheckpointError naming the missing or truncated file, or listing the tensors that do not match."""
    from megatron.core.dist_checkpointing import ShardedTensor, load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a distributed checkpoint (no metadata.json)")
    _check_files(path)
    saved = load_tensors_metadata(str(path))
    problems = []
    for sharded in nested_values(model_state):
        if not isinstance(sharded, ShardedTensor):
            continue
        if sharded.key not in saved:
            problems.append(f"{sharded.key}: not in the checkpoint")
        elif tuple(saved[sharded.key].global_shape) != tuple(sharded.global_shape):
            problems.append(f"{sharded.key}: shape {tuple(saved[sharded.key].global_shape)} in the "
                            f"checkpoint, {tuple(sharded.global_shape)} in this model")
    wanted = [s.key for s in nested_values(model_state) if isinstance(s, ShardedTensor)]
    if problems and any(is_adapter(key) for key in saved) and not any(is_adapter(key) for key in wanted):
        raise CheckpointError(f"{path}: a LoRA run's checkpoint (model.lora) holds its adapters, not the frozen base "
                              "weights, which are the run's model.path: resume the run with its recipe, or take the "
                              "merged HF export of its end (checkpoints/final, adapters in checkpoints/final/adapter)")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        shown = "\n  ".join(problems[:20]) + more
        raise CheckpointError(f"{path}: {len(problems)} tensor(s) do not match this model "
                              f"(another architecture or size?):\n  {shown}")


def _check_files(path: Path) -> None:
    """Every data file the checkpoint's index lists is there and long enough: a copy cut short (a full
    disk, an interrupted transfer) is an error naming the file, not an unpickling error deep inside."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable index is the same problem for the user
        raise CheckpointError(f"{path}: the checkpoint index (.metadata) cannot be read: {e}") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the checkpoint index but missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"{file}: truncated ({file.stat().st_size} bytes; the index needs {end})")



def trainer_rng_state() -> dict:
    """This rank's random state: torch's (CPU and, on GPU, CUDA) and Megatron's model-parallel RNG tracker
    (dropout streams). Restored by `set_trainer_rng_state` on a resume with the same layout."""
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if on_gpu() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_trainer_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and on_gpu():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
