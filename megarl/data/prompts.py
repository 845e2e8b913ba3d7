"""Prompt sets from JSONL files, and the deterministic, resumable sampler that orders them.

A prompt file holds one JSON object per line with a prompt and a reference answer (keys configurable). Every
other key of the object is kept as the row's metadata, for rewards that need more than the answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


class DataError(ValueError):
    """A prompt file that cannot be read; the message names the file and the 1-based line."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    """The text the policy continues."""
    answer: str
    """The reference answer rewards compare against."""
    index: int
    """Position of the row in its file, 0-based over non-blank lines; what the sampler returns."""
    metadata: dict = field(default_factory=dict)
    """The row's other JSON keys."""


def load_prompts(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[PromptRow]:
    """Read a JSONL prompt file. Blank lines are skipped; any other bad line raises DataError."""
    path = Path(path)
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for key in (prompt_key, answer_key):
                if key not in obj:
                    raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(obj)})")
                if not isinstance(obj[key], str):
                    raise DataError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
            metadata = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key)}
            rows.append(PromptRow(obj[prompt_key], obj[answer_key], len(rows), metadata))
    if not rows:
        raise DataError(f"{path}: empty file, no prompt rows")
    return rows


class PromptSampler:
    """Row indices in seeded epochs, split across data-parallel ranks, resumable from (epoch, position).

    Epoch e visits all `n_rows` rows once, in the order `random.Random(f"{seed}:{e}")` shuffles them (or in file
    order when `shuffle` is False). A global batch of `n * dp_size` indices is taken from the stream of epochs,
    running on into the next epoch when one ends mid-batch; rank r gets the slice [r*n, (r+1)*n) of it. Every
    rank walks the same stream, so all ranks agree on the state without communicating.
    """

    def __init__(self, n_rows: int, *, seed: int, shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1):
        if n_rows <= 0:
            raise ValueError(f"n_rows must be positive, got {n_rows}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.n_rows, self.seed, self.shuffle = n_rows, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.n_rows))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[int]:
        """This rank's n row indices of the next global batch of n * dp_size."""
        global_batch = []
        while len(global_batch) < n * self.dp_size:
            if self.position == self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n * self.dp_size - len(global_batch), self.n_rows - self.position)
            global_batch += self._order[self.position:self.position + take]
            self.position += take
        return global_batch[self.dp_rank * n:(self.dp_rank + 1) * n]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands; the seed and sizes come from the constructor, not from here."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.n_rows:
            raise ValueError(f"sampler state {state} does not fit {self.n_rows} rows")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
