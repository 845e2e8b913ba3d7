"""Checkpoints: the trained policy exported as an HF checkpoint directory, written atomically.

The export is written to a temporary sibling directory and published with one rename, so a reader
never sees a half-written checkpoint; config and tokenizer files are copied from the source model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

# Files of an HF checkpoint directory that are not weights.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def save_hf(named_tensors: Iterable[tuple[str, Tensor]], *, source_dir: str | Path, out_dir: str | Path,
            shard_bytes: int = 2 * 2**30, meta: dict | None = None) -> Path:
    """Write `named_tensors` as sharded safetensors with an index, plus `source_dir`'s side files.

    Tensors are streamed into shards of at most `shard_bytes`; only one shard is held in memory.
    `out_dir` is replaced atomically; `meta` goes to `megarl_checkpoint.json`.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    shard: dict[str, Tensor] = {}
    shard_size, files, total = 0, [], 0

    def flush():
        nonlocal shard, shard_size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_size = {}, 0

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard_size += nbytes
        total += nbytes
    if shard:
        flush()
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for side in _SIDE_FILES:
        if (Path(source_dir) / side).exists():
            shutil.copy2(Path(source_dir) / side, tmp / side)
    (tmp / "megarl_checkpoint.json").write_text(json.dumps(meta or {}, indent=2) + "\n")
    _fsync_dir(tmp)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out_dir)
    return out_dir


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())

