"""Megatron distributed checkpoints written and read one parameter at a time, for a model on the meta device.

The model's `sharded_state_dict` describes the checkpoint while its parameters live on the meta device:
each ShardedTensor's data is (a view of) a meta parameter, and that view's geometry (shape, strides,
offset) replays on the parameter's real value. Megatron's format (torch_dist) and its save and load paths
(factories, sharding validation, common.pt, metadata.json) are used unchanged, so what is written here
loads through `dist_checkpointing.load` at any layout, and what is read here is any Megatron checkpoint.

`LazySave` asks `resolve(name)` for the full local value of parameter `name` when the writer reaches its
first chunk and drops it when the writer moves on. Each tensor chunk goes to its own file: torch's
FileSystemWriter keeps every tensor of a file referenced until that file is closed, so one file per rank
would hold the whole shard in memory. `read_parameters` fills host tensors for a few parameters at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                              _replace_state_dict_keys_with_sharded_keys,
                                                              mcore_to_pyt_state_dict)
from torch import Tensor
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType


class LazySave(SaveShardedStrategy):
    """Megatron save strategy (torch_dist format) whose tensor values come from `resolve(name)`; `progress()`
    is called after each tensor chunk is written. Pass it to `dist_checkpointing.save(sharded_strategy=)`
    with a sharded state dict {"model": flat model sharded_state_dict}."""

    def __init__(self, resolve: Callable[[str], Tensor], *, progress: Callable[[], object] | None = None):
        super().__init__("torch_dist", 1)
        self.resolve, self.progress = resolve, progress

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # ShardedObjects (`_extra_state`) go into the checkpoint files, as Megatron's strategy puts them

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | Path) -> None:
        # Factories are applied by now, so each model entry holds the ShardedTensors built from one parameter;
        # their data are (views of) that meta parameter, whose geometry replays the view on the real value.
        origin = {}
        for name, entry in sharded_state_dict["model"].items():
            for sharded in nested_values([entry]):
                if isinstance(sharded, ShardedTensor):
                    view = sharded.data
                    origin[sharded.key, tuple(sharded.global_offset)] = (
                        name, tuple(view.shape), view.stride(), view.storage_offset())
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        dcp.save(mcore_to_pyt_state_dict(by_key, is_loading=False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False),
                 planner=_LazyPlanner(origin, self.resolve, self.progress, flatten_state_dict=False))


class _LazyPlanner(MCoreSavePlanner):
    """Megatron's save planner, with every tensor chunk cut from `resolve(name)` when it is written.

    The writer goes through the chunks key by key, and Megatron lists the chunks of one parameter together,
    so caching the last resolved parameter resolves each one once and holds one at a time."""

    def __init__(self, origin: dict, resolve: Callable[[str], Tensor], progress, **kwargs):
        super().__init__(**kwargs)
        self.origin, self.resolve, self.progress = origin, resolve, progress
        self._cached: tuple[str, Tensor] | None = None

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        where = (write_item.index.fqn, tuple(chunk.offsets))
        if where not in self.origin:
            raise KeyError(f"checkpoint tensor {where[0]} at offset {where[1]} has no source parameter")
        name, shape, stride, offset = self.origin[where]
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # drop the previous parameter before making the next
            self._cached = (name, self.resolve(name).contiguous())
        if self.progress is not None:
            self.progress()
        value = self._cached[1]  # may be a view (a TP slice of a full tensor): offsets count from its start
        return value.as_strided(shape, stride, value.storage_offset() + offset).reshape(chunk.sizes)


def read_parameters(path: str | Path, entries: dict[str, ShardedBase], values: dict[str, Tensor]) -> None:
    """Fill `values[name]`, a host tensor shaped like parameter `name`, from distributed checkpoint `path`;
    `entries[name]` is that parameter's entry of the model's sharded state dict (built on the meta device).

    Each requested chunk is handed to Megatron without its prepended (layer, expert) axes and as an
    irregular grid: Megatron builds a regular-grid request for the whole global tensor and, in a
    one-process group, counts the chunks of the layers not asked for as local too, which fails when only
    some layers are read. The chunk data are views of `values`, so the read lands in place.
    """
    built = dict(entries)
    apply_factories(built)  # e.g. the fused gate/up weight becomes its two halves, each a view of the parameter
    request = {}
    for name, entry in built.items():
        for i, sharded in enumerate(nested_values([entry])):
            if not isinstance(sharded, ShardedTensor):
                continue
            view = sharded.data
            shape = (1,) * sharded.prepend_axis_num + tuple(view.shape)
            value = values[name]
            data = value.as_strided(tuple(view.shape), view.stride(), value.storage_offset() + view.storage_offset())
            data = data.view(shape)
            request[f"{name}/{i}"] = dataclasses.replace(sharded, data=data, local_shape=shape, prepend_axis_num=0,
                                                         axis_fragmentations=None)
    # The chunks of a few parameters do not cover their global tensors: Megatron's whole-state integrity
    # check does not apply.
    loaded = dist_checkpointing.load(request, str(path), validate_access_integrity=False)
    for key, sharded in request.items():
        if loaded[key].data_ptr() != sharded.data.data_ptr():
            sharded.data.copy_(loaded[key])
