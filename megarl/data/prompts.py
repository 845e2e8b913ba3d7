"""Prompt sets from JSONL or Parquet files, and the deterministic, resumable sampler that orders them.

A prompt file holds one record per row with a prompt and a reference answer (field names configurable). A
row's metadata, for rewards that need more than the answer, is either the mapping under one named field or
every other field of the row.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A prompt file that cannot be read; the message names the file and the 1-based line (or row)."""


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    """The text the policy continues."""
    answer: str
    """The reference answer rewards compare against."""
    index: int
    """Position of the row among the loaded rows, 0-based; what the sampler returns."""
    metadata: dict = field(default_factory=dict)
    """What rewards see besides the answer: the row's metadata field, or its other fields."""


def load_prompts(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 metadata_key: str | None = None, skip_bad_rows: bool = False) -> list[PromptRow]:
    """Read a `.jsonl` or `.parquet` prompt file.

    Blank JSONL lines are skipped. A malformed row (invalid JSON, not an object, a missing or non-string
    prompt/answer, metadata that is not a mapping) raises DataError naming the file and line, or with
    `skip_bad_rows` is left out and counted, and one warning names the count and the first problem.
    """
    path = Path(path)
    rows, bad = [], []
    for where, record in read_records(path):
        try:
            rows.append(_prompt_row(record, where, index=len(rows), prompt_key=prompt_key,
                                    answer_key=answer_key, metadata_key=metadata_key))
        except DataError as e:
            if not skip_bad_rows:
                raise
            bad.append(str(e))
    if bad:
        log.warning("%s: skipped %d malformed rows of %d (first: %s)", path, len(bad), len(bad) + len(rows), bad[0])
    if not rows:
        raise DataError(f"{path}: all {len(bad)} rows are malformed (first: {bad[0]})" if bad
                        else f"{path}: empty file, no prompt rows")
    return rows


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) per row: `file:line` and the parsed JSON value, or `file:row N` and a Parquet row.
    An unparsable JSON line comes as a DataError in place of the record, so the caller decides to skip."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow: pip install -e '.[parquet]' "
                            "-c constraints.txt in the megarl checkout") from None
        for i, record in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"{path}:row {i}", record
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                # e.colno counts from the line's own newline when the JSON is cut short; e.pos is in the line
                text = line.rstrip("\r\n")
                ends = " (the line ends before the JSON value does)" if e.pos >= len(text.rstrip()) else ""
                yield where, DataError(f"{where}: invalid JSON ({e.msg} at column {min(e.pos, len(text)) + 1})"
                                       f"{ends}")


def _prompt_row(record: object, where: str, *, index: int, prompt_key: str, answer_key: str,
                metadata_key: str | None) -> PromptRow:
    if isinstance(record, DataError):
        raise record
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in (prompt_key, answer_key):
        if key not in record:
            raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(record)})")
        if not isinstance(record[key], str):
            raise DataError(f"{where}: {key!r} must be a string, got {type(record[key]).__name__}")
    if metadata_key is None:
        metadata = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    else:
        metadata = record.get(metadata_key, {})
        if not isinstance(metadata, dict):
            raise DataError(f"{where}: {metadata_key!r} must be a mapping, got {type(metadata).__name__}")
    return PromptRow(record[prompt_key], record[answer_key], index, metadata)


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
        self.drawn: list[int] = []  # the global batches' indices since `take_drawn`, every rank's, in order

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
        self.drawn += global_batch
        return global_batch[self.dp_rank * n:(self.dp_rank + 1) * n]

    def take_drawn(self) -> list[int]:
        """The row indices every rank drew since the last call (all ranks walk the same stream)."""
        drawn, self.drawn = self.drawn, []
        return drawn

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands; the seed and sizes come from the constructor, not from here."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.n_rows:
            raise ValueError(f"sampler state {state} does not fit {self.n_rows} rows")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool, tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids, wrapped as a user turn in the tokenizer's chat template when asked, which also
    lists `tools` (JSON schemas) the way the template does.

    The template is rendered to text and then tokenized, because `apply_chat_template(tokenize=True)`
    returns a list in some transformers releases and a BatchEncoding in others.
    """
    if chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools or None,
                                               add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]
