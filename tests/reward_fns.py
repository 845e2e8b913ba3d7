"""Custom reward functions named by the reward tests (`reward_fns:NAME`); importable by Ray workers too."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path


def answer_in_response(*, prompt, response, answer, metadata):
    """0.5 per hit: the answer appears in the response, and the metadata's `bonus` word does."""
    return 0.5 * (answer in response) + 0.5 * (metadata.get("bonus", "\0") in response) + 0 * len(prompt)


def fails_on_bad(*, prompt, response, answer, metadata):
    if response == "bad":
        raise RuntimeError("cannot score this one")
    if response == "nan":
        return float("nan")
    if response == "slow":
        while True:
            time.sleep(0.01)
    if response == "swallowing":  # reward code that catches Exception must not hide the timeout
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # noqa: BLE001
                pass
    return 1.0


def dies_once_per_marker(*, prompt, response, answer, metadata):
    """Kills its worker process the first time it sees a marker path (in metadata) that does not exist yet."""
    marker = Path(metadata["marker"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(1)
    return 1.0


def always_dies(*, prompt, response, answer, metadata):
    os._exit(1)


def digest(*, prompt, response, answer, metadata):
    """A number in [0, 1) that changes with any field of the sample, so equal rewards mean equal samples."""
    fields = repr((prompt, response, answer, sorted(metadata.items()))).encode()
    return zlib.crc32(fields) / 2**32


def records_start(*, prompt, response, answer, metadata):
    """Writes the wall-clock time scoring began into a new file under metadata["started"]; scores 1."""
    started = time.time()
    (Path(metadata["started"]) / f"{os.getpid()}-{time.monotonic_ns()}").write_text(repr(started))
    return 1.0


NOT_A_FUNCTION = 3


def returns_text(*, prompt, response, answer, metadata):
    """A reward with a bug: a number as a string, which must fail its sample, never count as 1.0."""
    return "1.0"
