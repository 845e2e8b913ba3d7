"""Environments: tool calls read from both chat syntaxes (a malformed one becomes an error message for the
model, never an exception), the built-in tools, observations rendered in the chat template's own
tool-response format, and the `env:` section's launch-time errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO
from megarl.config import EnvConfig, RecipeError, load_config
from megarl.data.multiplication import demonstration
from megarl.dataclass_yaml import ConfigError
from megarl.envs.documents import DocumentIndex, write_document_set
from megarl.envs.environment import SingleTurn, ToolEnvironment, environment_factory
from megarl.envs.tool_format import ObservationFormat, ToolCall, parse_tool_calls
from megarl.envs.tools import CALCULATOR, python_tool


# ---- tool-call syntax ---------------------------------------------------------------------------------------
def test_qwen_calls_are_read_in_order_with_their_arguments():
    turn = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "47*86"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"Osk\\"}"}</tool_call>')
    assert parse_tool_calls(turn, tool_format="qwen") == [
        ToolCall("calculator", {"expression": "47*86"}), ToolCall("search", {"query": "Osk"})]
    assert parse_tool_calls("4042", tool_format="qwen") == []  # no call: the final answer


@pytest.mark.parametrize("turn, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', '"arguments" of a tool call must be'),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "not closed"),
])
def test_malformed_qwen_calls_carry_an_error(turn, error):
    calls = parse_tool_calls(turn, tool_format="qwen")
    assert len(calls) == 1 and error in calls[0].error


def test_llama3_json_and_python_tag_calls():
    parse = lambda turn: parse_tool_calls(turn, tool_format="llama3")  # noqa: E731
    assert parse('{"name": "calculator", "parameters": {"expression": "2**10"}}') == [
        ToolCall("calculator", {"expression": "2**10"})]
    assert parse("<|python_tag|>print(6 * 7)<|eom_id|>") == [ToolCall("python", {"code": "print(6 * 7)"})]
    assert parse('<|python_tag|>{"name": "search", "parameters": {"query": "Isen"}}') == [
        ToolCall("search", {"query": "Isen"})]
    assert parse("The answer is 42.") == []
    broken = parse('{"name": "calculator", "parameters": {"expression": "1+"')
    assert len(broken) == 1 and "not valid JSON" in broken[0].error


def test_tool_environment_answers_malformed_and_unknown_calls_with_error_messages():
    env = ToolEnvironment([CALCULATOR], tool_format="qwen")
    env.reset("47*86=", {})
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>'
                    '<tool_call>{"name": "calculator" </tool_call>'
                    '<tool_call>{"name": "web", "arguments": {}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>')
    assert not step.done and step.tool_calls == 5
    assert step.observation[0] == "4042"
    assert step.observation[1].startswith("error: the tool call is not valid JSON")
    assert step.observation[2] == "error: unknown tool 'web'; the tools are calculator"
    assert step.observation[3] == "error: division by zero"
    assert step.observation[4].startswith('error: expected a string argument "expression"')
    final = env.step("4042")
    assert final.done and final.tool_calls == 0
    assert env.tools == [CALCULATOR.schema]


@pytest.mark.parametrize("expression, result", [
    ("47*86", "4042"), ("(2+3)*-4", "-20"), ("7/2", "3.5"), ("6/3", "2"), ("2**10 % 1000", "24"),
    ("__import__('os').system('true')", None), ("[1]*10", None), ("9**9**9", None), ("1e308*10", "inf"),
])
def test_calculator_does_arithmetic_and_nothing_else(expression, result):
    env = ToolEnvironment([CALCULATOR], tool_format="qwen")
    out = env.step(json.dumps({"name": "calculator", "arguments": {"expression": expression}}).join(
        ["<tool_call>", "</tool_call>"])).observation[0]
    if result is None:
        assert out.startswith("error:"), out
    else:
        assert out == result


def test_python_tool_runs_code_in_the_sandbox(isolated):
    from megarl.config import SandboxConfig

    tool = python_tool(SandboxConfig(wall_s=1.0, cpu_s=5))
    assert tool({"code": "print(sum(range(10)))"}) == "45\n"
    failed = tool({"code": "print('before')\n1/0"})
    assert failed.startswith("before\nerror (exit status 1):") and "ZeroDivisionError" in failed
    # CPU time never runs ahead of wall time, so the 1 s wall-clock kill comes before the 5 s CPU limit
    spin = tool({"code": "print('spin', flush=True)\nwhile True: pass"})
    assert spin == "spin\nerror: killed after 1.0 s of wall time"


# ---- retrieval ----------------------------------------------------------------------------------------------
def test_retrieval_finds_the_document_a_question_is_about(tmp_path):
    path = write_document_set(tmp_path, seed=0, cities=50)
    index = DocumentIndex.load(path)
    rows = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 10  # 20% of the cities, three questions each
    env = environment_factory(EnvConfig(name="retrieval", documents_path=str(path), top_k=1))()
    titles = {doc.title for doc in index.documents}
    for row in rows:
        name = next(word for word in row["prompt"].rstrip("?").split() if word in titles)
        call = {"name": "search", "arguments": {"query": row["prompt"]}}  # the question itself is the query
        hit = env.step(f"<tool_call>{json.dumps(call)}</tool_call>").observation[0]
        assert hit.startswith(f"[{name}]") and row["answer"] in hit, (row, hit)
    assert index.search("zzz unknown", top_k=3) == []


# ---- observations in the chat template ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_chat_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model(tmp_path_factory.mktemp("tool_chat"), tool_chat=True)


def test_observations_follow_qwen25_tool_response_format(tool_chat_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_chat_dir)
    fmt = ObservationFormat(tokenizer)
    # Qwen2.5-Instruct's template: the model's turn ends with <|im_end|> (its EOS); the template adds "\n",
    # then one user turn holding every tool response, then the next assistant prompt.
    assert fmt.text(["4042", "error: x"]) == (
        "\n<|im_start|>user\n<tool_response>\n4042\n</tool_response>\n<tool_response>\nerror: x\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_demonstrations_tokenize_as_the_trajectory_the_rollout_builds(tool_chat_dir):
    """The warm start's conversation and the RL trajectory with the same content are the same tokens, with
    the loss on the same (assistant) tokens."""
    from transformers import AutoTokenizer

    from megarl.data.supervised import encode_conversation
    from megarl.data.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tool_chat_dir)
    messages = demonstration(47, 86, use_tool=True)
    example = encode_conversation(tokenizer, messages, where="demo")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = encode(messages[1]["content"]) + [tokenizer.eos_token_id]
    answer = encode("4042") + [tokenizer.eos_token_id]
    obs = ObservationFormat(tokenizer).ids(["4042"])
    prompt = encode_prompt(tokenizer, "47*86=", chat_template=True)
    trajectory = prompt + call + obs + answer
    assert example.ids[:len(trajectory)] == trajectory
    assert example.loss_mask[:len(trajectory)] == ([0] * len(prompt) + [1] * len(call) + [0] * len(obs)
                                                   + [1] * len(answer))


def test_a_template_that_cannot_render_tool_messages_is_refused_at_launch(tool_chat_dir):
    from transformers import AutoTokenizer

    from megarl.envs.tool_format import observation_format

    tokenizer = AutoTokenizer.from_pretrained(tool_chat_dir)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                               "{{ raise_exception('no tools here') }}{% endif %}{{ m['content'] }}{% endfor %}")
    cfg = load_cfg_dict({"env": {"name": "calculator"}})
    with pytest.raises(RecipeError, match="env.name: calculator sends tool messages.*no tools here"):
        observation_format(cfg.env, tokenizer)
    assert observation_format(load_cfg_dict({}).env, tokenizer) is None  # single_turn renders nothing


# ---- the env: section ---------------------------------------------------------------------------------------
def load_cfg_dict(sections: dict, overrides=()):
    import tempfile
    from pathlib import Path

    import yaml

    tmp = Path(tempfile.mkdtemp())
    (tmp / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    recipe = tmp / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(tmp)}, "data": {"train_path": str(tmp / "train.jsonl")},
                                      **sections}))
    return load_config(recipe, overrides)


@pytest.mark.parametrize("env, message", [
    ({"name": "calculater"}, "env.name: expected one of single_turn, calculator, python, retrieval or 'module:Class'"),
    ({"name": "calculator", "top_k": 2}, "env.top_k: is not an option of environment 'calculator' (it takes none)"),
    ({"name": "retrieval"}, "env.documents_path: required for the retrieval environment"),
    ({"name": "python", "max_turns": 0}, "env.max_turns: must be >= 1"),
    ({"name": "python", "tool_format": "hermes"}, "env.tool_format: expected one of 'qwen', 'llama3'"),
])
def test_env_section_errors_name_the_key(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_cfg_dict({"env": env})


def test_environments_that_do_not_build_stop_the_launch_naming_the_key():
    with pytest.raises(RecipeError, match="env.name: cannot import 'no_such_module:Env': ModuleNotFoundError"):
        environment_factory(EnvConfig(name="no_such_module:Env"))
    with pytest.raises(RecipeError, match="env.name: cannot import 'envs_for_tests:Missing'"):
        environment_factory(EnvConfig(name="envs_for_tests:Missing"))
    with pytest.raises(RecipeError, match=r"env.options: envs_for_tests:NeedsOption cannot be built with \{\}"):
        environment_factory(EnvConfig(name="envs_for_tests:NeedsOption"))
    env = environment_factory(EnvConfig(name="envs_for_tests:NeedsOption", options={"level": 3}))()
    assert env.level == 3
    assert isinstance(environment_factory(EnvConfig())(), SingleTurn)
