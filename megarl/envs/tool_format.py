"""Tool calls in the chat template's own syntax: parsed from a model turn, answered in the tool-response format.

Two call syntaxes, chosen by `env.tool_format`:

    qwen     <tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>
             (Qwen2.5 / Qwen3, Hermes-style; several calls per turn, each in its own tags)
    llama3   {"name": "calculator", "parameters": {"expression": "47*86"}}
             <|python_tag|>print(47 * 86)          (Llama 3.1 code interpreter: the `python` tool)
             (one call per turn, the whole turn)

A call that cannot be read (bad JSON, no name, arguments that are not an object, an unclosed tag) becomes a
ToolCall with `error` set: the environment answers it with an error message, so the model sees its mistake
and can retry, and the rollout never raises on what a model wrote.

Observations go back in the template's tool-response format, found by rendering the template itself
(`ObservationFormat`), so the same code serves every chat template that renders a `tool` message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megarl.config import EnvConfig, RecipeError

QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
# End-of-message markers a Llama 3 turn may carry when special tokens are kept in its text.
LLAMA3_TURN_ENDS = ("<|eom_id|>", "<|eot_id|>")


@dataclass(frozen=True)
class ToolCall:
    name: str = ""
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call could not be read; set means name/arguments are not to be used


def parse_tool_calls(turn: str, *, tool_format: str) -> list[ToolCall]:
    """The tool calls of one model turn (its text, special tokens kept), in order; [] when the turn calls
    no tool, which makes it the model's final answer."""
    match tool_format:
        case "qwen":
            return _qwen_calls(turn)
        case "llama3":
            return _llama3_calls(turn)
    raise ValueError(f"unknown tool format {tool_format!r}; expected qwen or llama3")


def _qwen_calls(turn: str) -> list[ToolCall]:
    calls = [_json_call(body, arguments_key="arguments") for body in QWEN_CALL.findall(turn)]
    # An opening tag left without its closing tag (the turn ended inside the call) is a broken call.
    if turn.count("<tool_call>") > len(calls):
        calls.append(ToolCall(error="<tool_call> is not closed by </tool_call>"))
    return calls


def _llama3_calls(turn: str) -> list[ToolCall]:
    text = turn.strip()
    for end in LLAMA3_TURN_ENDS:
        text = text.removesuffix(end).rstrip()
    if text.startswith(PYTHON_TAG):
        body = text[len(PYTHON_TAG):].strip()
        if body.startswith("{"):
            return [_json_call(body, arguments_key="parameters")]
        return [ToolCall(name="python", arguments={"code": body})]
    if text.startswith("{"):
        return [_json_call(text, arguments_key="parameters")]
    return []


def _json_call(body: str, *, arguments_key: str) -> ToolCall:
    """One call from its JSON text: {"name": str, arguments_key: object}. Models trained on other
    templates sometimes write `arguments` for `parameters` or the reverse, or the arguments as a JSON
    string; those are read too, since their meaning is unambiguous."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON: {e.msg} at column {e.colno}")
    if not isinstance(call, dict):
        return ToolCall(error=f"the tool call must be a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error='the tool call has no "name" string')
    arguments = next((call[k] for k in (arguments_key, "arguments", "parameters") if k in call), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f'the "{arguments_key}" of a tool call must be a JSON object')
    return ToolCall(name=name, arguments=arguments)


class ObservationFormat:
    """Observation text in the chat template's tool-response format, as it follows a model turn.

    The template is asked once how it ends an assistant turn and how it renders tool messages followed by
    the next assistant prompt: a conversation [user, assistant SENTINEL] is rendered, then the same with
    tool messages appended and the generation prompt. The observation is what the second rendering adds,
    preceded by the rest of the assistant turn's ending after the model's own stop token (Qwen: the
    newline after <|im_end|>). For Qwen2.5 and two results A, B that is

        \\n<|im_start|>user\\n<tool_response>\\nA\\n</tool_response>\\n<tool_response>\\nB\\n</tool_response>
        <|im_end|>\\n<|im_start|>assistant\\n     (one string, cut here to fit the page)

    ValueError when the template cannot render a tool message, or renders the earlier turns differently
    once one follows (then no suffix exists).
    """

    SENTINEL = "\x00megarl-turn\x00"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template to render tool responses with")
        self.tokenizer = tokenizer
        self.base_messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self.SENTINEL}]
        self.base = self._render(self.base_messages, add_generation_prompt=False)
        turn_end = self.base[self.base.index(self.SENTINEL) + len(self.SENTINEL):]
        stop = tokenizer.decode([tokenizer.eos_token_id])
        # The model's turn already ends with its stop token; the template's text after that token follows.
        self.after_stop = turn_end.removeprefix(stop) if turn_end.startswith(stop) else turn_end
        self.text(["probe"])  # a template that cannot render a tool message fails now, at launch

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def text(self, messages: list[str]) -> str:
        """The observation text for these tool messages (one per call, in order)."""
        tool_turns = [{"role": "tool", "content": m} for m in messages]
        full = self._render(self.base_messages + tool_turns, add_generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders the earlier turns differently once a tool message "
                             "follows, so an observation cannot be appended to the tokens already generated")
        return self.after_stop + full[len(self.base):]

    def ids(self, messages: list[str]) -> list[int]:
        return self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]


def observation_format(env: EnvConfig, tokenizer) -> ObservationFormat | None:
    """How tool messages are rendered for the recipe's environment; None for single_turn, which sends none."""
    if env.kind == "single_turn":
        return None
    try:
        return ObservationFormat(tokenizer)
    except Exception as e:  # noqa: BLE001 - the template's own errors (jinja) name what it could not render
        raise RecipeError(f"env.name: {env.name} sends tool messages, but the chat template of model.path "
                          f"cannot render them: {type(e).__name__}: {e}") from None
