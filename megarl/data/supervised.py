"""Supervised data sets: SFT rows and preference pairs from JSONL, and their tokenization with loss masks.

An SFT file holds one JSON object a line, in either of two forms (key names set by the recipe's `data:`):

    {"prompt": "140+872=", "response": "9130"}
    {"messages": [{"role": "user", "content": "140+872="}, {"role": "assistant", "content": "9130"}]}

A preference file holds {"prompt": ..., "chosen": ..., "rejected": ...} a line. Other keys are ignored.

Tokenized, every row is an `Example`: token ids and a loss mask that is 1 exactly on the tokens the model is
trained to produce (the response and its end token, or every assistant turn of a conversation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megarl.data.prompts import DataError, read_records


@dataclass(frozen=True)
class SFTRow:
    where: str
    """"file:line" of the row, for errors found when it is tokenized."""
    prompt: str = ""
    """Prompt/response rows: the text the response continues."""
    response: str = ""
    """Prompt/response rows: the target text."""
    messages: tuple[dict, ...] = ()
    """Chat rows: the turns, each {"role": str, "content": str}; loss on the assistant turns."""


@dataclass(frozen=True)
class PreferencePair:
    where: str
    """"file:line" of the pair."""
    prompt: str
    chosen: str
    """The preferred response."""
    rejected: str
    """The dispreferred response."""


@dataclass(frozen=True)
class Example:
    ids: list[int]
    """Token ids of the whole sequence."""
    loss_mask: list[int]
    """Same length as `ids`: 1 on the tokens trained on, 0 on the context."""


# ---- loading ---------------------------------------------------------------------------------------------
def _json_objects(path: Path):
    """(where, object) for every row of a .jsonl or .parquet file; a row that is not an object (or not valid
    JSON) raises DataError naming it."""
    for where, record in read_records(path):
        if isinstance(record, DataError):
            raise record
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(obj)})")
    if not isinstance(obj[key], str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _messages(value, key: str, where: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{role, content}} objects")
    for i, turn in enumerate(value):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str)):
            raise DataError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content', "
                            f"got {json.dumps(turn)[:80]}")
    if not any(turn["role"] == "assistant" for turn in value):
        raise DataError(f"{where}: {key!r} has no assistant turn to train on")
    return tuple(value)


def load_sft_rows(path: str | Path, *, prompt_key: str = "prompt", response_key: str = "response",
                  messages_key: str = "messages") -> list[SFTRow]:
    """Read an SFT file. A row with `messages_key` is a conversation; any other row needs `prompt_key` and
    `response_key`. Blank lines are skipped; a malformed row raises DataError naming file and line."""
    path = Path(path)
    rows = []
    for where, obj in _json_objects(path):
        if messages_key in obj:
            rows.append(SFTRow(where, messages=_messages(obj[messages_key], messages_key, where)))
        elif prompt_key in obj or response_key in obj:
            rows.append(SFTRow(where, prompt=_string(obj, prompt_key, where),
                               response=_string(obj, response_key, where)))
        else:
            raise DataError(f"{where}: expected {messages_key!r}, or {prompt_key!r} and {response_key!r} "
                            f"(keys present: {sorted(obj)})")
    if not rows:
        raise DataError(f"{path}: empty file, no SFT rows")
    return rows


def load_preference_pairs(path: str | Path, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
                          rejected_key: str = "rejected") -> list[PreferencePair]:
    """Read a preference file. Blank lines are skipped; a malformed row raises DataError naming file and line."""
    path = Path(path)
    pairs = [PreferencePair(where, *(_string(obj, k, where) for k in (prompt_key, chosen_key, rejected_key)))
             for where, obj in _json_objects(path)]
    if not pairs:
        raise DataError(f"{path}: empty file, no preference pairs")
    return pairs


# ---- tokenization ----------------------------------------------------------------------------------------
def completion_example(prompt_ids: list[int], response_ids: list[int]) -> Example:
    """Prompt then response, loss on the response."""
    return Example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def _render_ids(tokenizer, messages, *, add_generation_prompt: bool, where: str) -> list[int]:
    """The chat template rendered to text, then tokenized (the same two steps as RL prompts)."""
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except TemplateError as e:
        raise DataError(f"{where}: the chat template rejects this conversation: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages, *, where: str) -> Example:
    """A conversation rendered with the tokenizer's chat template, loss on every assistant turn.

    Assistant turn i spans the tokens between the rendering of turns [0, i) with the generation prompt and
    the rendering of turns [0, i], up to and including the last special token in between: its content and
    the end-of-turn token (<|im_end|>, <|eot_id|>, </s>), which is what the model must produce to end its
    turn. Text the template writes after that token (the newline between turns) is context: generation stops
    at the token. Both renderings must tokenize to prefixes of the whole conversation's tokens, or the span
    would not be the tokens trained on; a template that rewrites earlier turns (e.g. drops past reasoning)
    or a tokenizer that merges across the boundary breaks that, and the row is refused with a DataError
    naming it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template; this one has none")
    ids = _render_ids(tokenizer, messages, add_generation_prompt=False, where=where)
    special = set(tokenizer.all_special_ids)
    mask = [0] * len(ids)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        start = _render_ids(tokenizer, messages[:i], add_generation_prompt=True, where=where)
        end = _render_ids(tokenizer, messages[:i + 1], add_generation_prompt=False, where=where)
        for part, what in ((start, "up to its generation prompt"), (end, "through its end")):
            if ids[:len(part)] != part:
                raise DataError(f"{where}: assistant turn {i}: the conversation {what} does not tokenize to a "
                                f"prefix of the whole conversation's tokens, so its loss span is ambiguous")
        stop = next((j + 1 for j in range(len(end) - 1, len(start) - 1, -1) if end[j] in special), len(end))
        mask[len(start):stop] = [1] * (stop - len(start))
    return Example(ids, mask)


def encode_response(tokenizer, prompt: str, response: str, *, chat_template: bool, where: str) -> Example:
    """A prompt and its response, loss on the response.

    With `chat_template`, a one-turn conversation (user prompt, assistant response) as in
    `encode_conversation`; otherwise the raw prompt tokens, then the response tokens and EOS.
    """
    if chat_template:
        return encode_conversation(tokenizer, ({"role": "user", "content": prompt},
                                               {"role": "assistant", "content": response}), where=where)
    return completion_example(tokenizer(prompt, add_special_tokens=False)["input_ids"],
                              tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])


def encode_sft_row(tokenizer, row: SFTRow, *, chat_template: bool) -> Example:
    """A chat row always goes through the chat template; a prompt/response row only with `chat_template`."""
    if row.messages:
        return encode_conversation(tokenizer, row.messages, where=row.where)
    return encode_response(tokenizer, row.prompt, row.response, chat_template=chat_template, where=row.where)


def encode_pair(tokenizer, pair: PreferencePair, *, chat_template: bool) -> tuple[Example, Example]:
    """(chosen, rejected) examples of one pair, each the prompt followed by that response."""
    return tuple(encode_response(tokenizer, pair.prompt, response, chat_template=chat_template, where=pair.where)
                 for response in (pair.chosen, pair.rejected))


def pad_examples(examples: list[Example], *, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded tokens [B, T] (long) and loss mask [B, T] (float), T = the longest example."""
    width = max(len(e.ids) for e in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width))
    for i, e in enumerate(examples):
        tokens[i, :len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        mask[i, :len(e.ids)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return tokens, mask
