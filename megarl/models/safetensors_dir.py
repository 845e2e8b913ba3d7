"""Read access to the tensors of a HuggingFace checkpoint directory, one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor


class SafetensorsDir:
    """Lazy read access to the tensors of an HF checkpoint directory (single file or sharded index).

    Each `get` maps its file only while it copies the one tensor out: a mapping kept open would leave
    every page read so far resident in this process, as much memory as the checkpoint by the last tensor.
    """

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.model_dir = model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = ["model.safetensors"]
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = model_dir / name
            if not path.exists():
                raise FileNotFoundError(f"{path}: weight file listed for the checkpoint is missing")
            try:
                with safe_open(str(path), framework="pt") as handle:
                    self._where.update(dict.fromkeys(handle.keys(), path))
                    self._shapes.update((key, tuple(handle.get_slice(key).get_shape())) for key in handle.keys())
            except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
                raise ValueError(f"{path}: not a readable safetensors file (truncated?): {e}") from None

    def names(self) -> list[str]:
        return list(self._where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the file headers."""
        return dict(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, *, row: int | None = None) -> Tensor:
        """Tensor `name`; with `row`, only its row `row` along the first dim, read alone (one expert of a
        stacked expert tensor)."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not found in the checkpoint")
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name) if row is None else handle.get_slice(name)[row]
