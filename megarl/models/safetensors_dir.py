"""Read access to the tensors of a HuggingFace checkpoint directory, one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor


class SafetensorsDir:
    """Lazy read access to the tensors of an HF checkpoint directory (single file or sharded index)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = ["model.safetensors"]
        self._handles, self._where = {}, {}
        for name in files:
            path = model_dir / name
            if not path.exists():
                raise FileNotFoundError(f"{path}: weight file listed for the checkpoint is missing")
            handle = safe_open(str(path), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        return self._handles[self._where[name]].get_tensor(name)
