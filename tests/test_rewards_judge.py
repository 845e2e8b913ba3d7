"""The judge reward term against a local OpenAI-compatible HTTP server started here: scores parsed from chat
and completion replies, malformed replies, HTTP errors and timeouts failing their samples with the term named,
concurrency bounded (counted server-side), and recipe errors naming the key. And against a tiny local
checkpoint run by megarl's native engine (judge.path): its greedy replies are transformers' own, parsed the
same way, and a reply without a score fails its sample."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO
from megarl.config import JudgeConfig, RewardConfig, RewardTermConfig
from megarl.rewards.scorer import Scorer
from megarl.rewards.terms import Sample

pytestmark = pytest.mark.timeout(60)


class JudgeServer:
    """A judge at http://127.0.0.1:PORT/v1 whose reply each response chooses: a response "say: TEXT" gets TEXT
    as the reply's text, "status: N" an HTTP error N, "raw: TEXT" the body TEXT as it is, and "sleep: S; say:
    TEXT" waits S seconds first. It records every request body and the most requests it held at once."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []  # (path, body)
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    status, payload = self.answer(body)
                finally:  # before a byte of the reply leaves: the client cannot send its next request sooner
                    with server.lock:
                        server.in_flight -= 1
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def answer(self, body) -> tuple[int, bytes]:
                text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
                order = text.rsplit("RESPONSE:", 1)[1].strip()
                if order.startswith("sleep:"):
                    seconds, order = order.removeprefix("sleep:").split(";", 1)
                    time.sleep(float(seconds))
                    order = order.strip()
                status, payload = 200, b""
                if order.startswith("status:"):
                    status, payload = int(order.removeprefix("status:")), b'{"error": "overloaded"}'
                elif order.startswith("raw:"):
                    payload = order.removeprefix("raw:").strip().encode()
                else:
                    reply = order.removeprefix("say:").strip()
                    chat = "messages" in body
                    choice = {"message": {"role": "assistant", "content": reply}} if chat else {"text": reply}
                    payload = json.dumps({"choices": [choice]}).encode()
                return status, payload

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    judge = JudgeServer()
    yield judge
    judge.close()


TEMPLATE = "QUESTION: {question}\nREFERENCE: {reference}\nRESPONSE: {response}"


def scorer(url: str, **judge) -> Scorer:
    cfg = JudgeConfig(url=url, template=TEMPLATE, **judge)
    return Scorer(RewardConfig(terms=[RewardTermConfig(kind="judge", judge=cfg, weight=2.0)], timeout_s=30))


def sample(response: str, i: int = 0) -> Sample:
    return Sample(prompt=f"what is {i}+{i}?", response=response, answer=str(2 * i))


@pytest.mark.parametrize("api,path", [("chat", "/v1/chat/completions"), ("completions", "/v1/completions")])
def test_scores_are_parsed_and_mapped_onto_0_1(server, api, path):
    """Default score pattern, range [0, 10], weight 2: Score 7 -> 2 * 0.7; the last score of a reply counts."""
    samples = [sample("say: Good work. Score: 7", 1), sample("say: score = 2.5", 2),
               sample("say: Score: 3 at first, but on reflection Score: **10**", 3), sample("say: Score: 0", 4)]
    rewards, failures = scorer(server.url, api=api, model="grader", max_tokens=32)(samples)
    assert failures == 0 and rewards == pytest.approx([1.4, 0.5, 2.0, 0.0], abs=1e-12)
    assert sorted(p for p, _ in server.requests) == [path] * 4
    bodies = sorted((b for _, b in server.requests), key=lambda b: json.dumps(b))
    text = bodies[0]["messages"][0]["content"] if api == "chat" else bodies[0]["prompt"]
    assert text == "QUESTION: what is 1+1?\nREFERENCE: 2\nRESPONSE: say: Good work. Score: 7"
    assert bodies[0]["model"] == "grader" and bodies[0]["max_tokens"] == 32 and bodies[0]["temperature"] == 0.0


def test_a_custom_pattern_and_range(server):
    """A 1-5 Likert judge with its own format: [[4]] -> (4 - 1) / 4."""
    s = scorer(server.url, score_pattern=r"\[\[(?P<score>\d)\]\]", min_score=1, max_score=5)
    rewards, failures = s([sample("say: verdict [[4]]"), sample("say: verdict [[1]]")])
    assert failures == 0 and rewards == pytest.approx([2 * 0.75, 0.0])


@pytest.mark.parametrize("response,why", [
    ("say: I would rather not grade this.", r"JudgeError: no score in the reply \(score_pattern"),
    ("say: Score: 11", r"JudgeError: the score 11 is outside \[0, 10\]"),
    ("raw: <html>bad gateway</html>", r"JudgeError: the reply is not an OpenAI-compatible body with "
                                      r"choices\[0\]\.message\.content: '<html>bad gateway</html>'"),
    ('raw: {"choices": []}', r"JudgeError: the reply is not an OpenAI-compatible body"),
    ("status: 503", r"JudgeError: HTTP 503 from http://127\.0\.0\.1:\d+/v1/chat/completions: "
                    r'\{"error": "overloaded"\}'),
    ("sleep: 3; say: Score: 9", r"JudgeError: no reply from .* within timeout_s = 0\.5 s"),
], ids=["no-score", "out-of-range", "not-json", "no-choices", "http-error", "timeout"])
def test_failures_score_zero_and_name_the_term(server, response, why):
    """One bad sample among good ones: it alone scores 0, counts as one failure, and the scorer's first
    failure names the term's key and the cause; the timeout is the judge's own (0.5 s), not the sample's."""
    s = scorer(server.url, timeout_s=0.5)
    began = time.monotonic()
    rewards, failures = s([sample("say: Score: 5"), sample(response), sample("say: Score: 10")])
    assert time.monotonic() - began < 2.5  # a timed-out request does not hold the batch for the server's 3 s
    assert failures == 1 and rewards == [1.0, 0.0, 2.0]
    assert s.first_failure.startswith("reward.terms[0] (judge): ")
    assert re.search(why, s.first_failure), s.first_failure


def test_a_ray_workers_task_grades_with_the_judge_beside_other_terms(server):
    """What a reward worker runs for a chunk (megarl.rewards.pool._score_chunk: the terms rebuilt from the
    recipe's RewardConfig, which travels pickled): the judge's grade summed with an exact-answer term."""
    import pickle

    from megarl.rewards.pool import _score_chunk

    judge = JudgeConfig(url=server.url, template=TEMPLATE)
    cfg = RewardConfig(terms=[RewardTermConfig(kind="exact_answer"),
                              RewardTermConfig(kind="judge", weight=0.5, judge=judge)])
    samples = [Sample(prompt="1+1?", response="say: Score: 8", answer="say: Score: 8"),
               Sample(prompt="1+1?", response="say: Score: 4", answer="2"),
               Sample(prompt="1+1?", response="status: 500", answer="2")]
    outcomes = _score_chunk(pickle.loads(pickle.dumps(cfg)), samples)
    assert [value for value, _ in outcomes[:2]] == pytest.approx([1.0 + 0.5 * 0.8, 0.5 * 0.4])
    assert outcomes[2][1].startswith("reward.terms[1] (judge): JudgeError: HTTP 500")


def test_an_unreachable_judge_fails_every_sample(server):
    url = server.url
    server.close()  # nothing listens on the port any more
    s = scorer(url, timeout_s=2)
    rewards, failures = s([sample("say: Score: 5"), sample("say: Score: 6")])
    assert failures == 2 and rewards == [0.0, 0.0]
    assert "JudgeError: cannot reach" in s.first_failure


@pytest.mark.parametrize("limit", [1, 3])
def test_requests_in_flight_never_exceed_max_concurrency(server, limit):
    """12 samples whose judge takes 0.2 s each: the server holds exactly `limit` requests at once at most
    (and reaches it: the requests really overlap), so the batch takes about 12 / limit * 0.2 s."""
    samples = [sample(f"sleep: 0.2; say: Score: {i % 11}", i) for i in range(12)]
    began = time.monotonic()
    rewards, failures = scorer(server.url, max_concurrency=limit)(samples)
    elapsed = time.monotonic() - began
    assert failures == 0 and rewards == pytest.approx([2 * (i % 11) / 10 for i in range(12)])
    assert server.most_in_flight == limit
    assert elapsed >= 12 / limit * 0.2 * 0.9  # 10% slack for timer granularity


@pytest.mark.parametrize("judge,message", [
    ("{url: 'localhost:8000/v1'}", r"reward\.terms\[0\]\.judge\.url: expected an http:// or https:// URL"),
    ("{url: 'http://h/v1', template: 'Grade {answer}: {response}'}",
     r"reward\.terms\[0\]\.judge\.template: unknown field \{answer\} \(fields: \{question\}, \{response\}"),
    ("{url: 'http://h/v1', template: 'Grade {question}'}", r"judge\.template: has no \{response\} field"),
    ("{url: 'http://h/v1', score_pattern: 'Score: (\\d+)'}", r"judge\.score_pattern: needs a named group"),
    ("{url: 'http://h/v1', min_score: 5, max_score: 5}", r"judge\.max_score: must be > min_score = 5"),
    ("{url: 'http://h/v1', api: chats}", r"judge\.api: expected one of 'chat', 'completions', got 'chats'"),
    ("{url: 'http://h/v1', max_concurency: 4}", r"judge\.max_concurency: unknown key \(did you mean 'max_concurrency'"),
    ("{url: 'http://h/v1', max_concurrency: 0}", r"judge\.max_concurrency: must be >= 1, got 0"),
    ("null", r"reward\.terms\[0\]\.judge: required for kind 'judge'"),
    ("{api: chat}", r"reward\.terms\[0\]\.judge: set one of url \(an OpenAI-compatible endpoint\) and path"),
    ("{url: 'http://h/v1', path: /ckpt/judge}", r"judge: set one of url .* and path .*, not both"),
])
def test_judge_recipe_errors_name_file_and_key(judge, message):
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    with pytest.raises(ConfigError, match=r"grpo_tiny\.yaml: .*" + message):
        load_config(REPO / "recipes" / "grpo_tiny.yaml", [f"reward.terms=[{{kind: judge, judge: {judge}}}]"],
                    check_paths=False)


def test_a_missing_api_key_variable_stops_the_launch(server, monkeypatch):
    from megarl.config import RecipeError

    monkeypatch.delenv("MEGARL_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(RecipeError, match=r"reward\.terms\[0\]\.judge\.api_key_env: the environment variable "
                                          r"MEGARL_TEST_JUDGE_KEY is not set"):
        scorer(server.url, api_key_env="MEGARL_TEST_JUDGE_KEY")


# ---- a local judge checkpoint (judge.path), run by megarl's native engine ---------------------------------------
# A tiny Llama (untied output layer) made a judge whose every reply token is a digit its network chooses: the
# final norm keeps one hidden unit alone (one whose sign differs among the test's prompts), and the output layer
# maps that unit's sign to '7' (+) or '3' (-). It is
# asked "Q R=" (the arithmetic tokenizer's characters); the first character of its reply is the score (0-9). What is
# tested is that the term asks the model the filled template, decodes greedily, and parses what transformers'
# own greedy decoding of the same checkpoint says.
LOCAL_TEMPLATE = "{question}{response}="


def digit_judge(arch_dir, out, prompts: list[str]):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(arch_dir("llama"), out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():  # the last layer's output at each prompt's last position, [prompts, hidden]
        last = torch.stack([model(torch.tensor([tokenizer(p)["input_ids"]]), output_hidden_states=True)
                            .hidden_states[-2][0, -1] for p in prompts])
    unit = int(torch.minimum((last > 0).sum(0), (last < 0).sum(0)).argmax())  # the most evenly split sign
    tensors = load_file(str(out / "model.safetensors"))
    norm = torch.zeros_like(tensors["model.norm.weight"])
    norm[unit] = 1.0
    head = torch.zeros_like(tensors["lm_head.weight"])
    head[tokenizer.convert_tokens_to_ids("7"), unit], head[tokenizer.convert_tokens_to_ids("3"), unit] = 1.0, -1.0
    save_file(tensors | {"model.norm.weight": norm, "lm_head.weight": head}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def local_judge(model_dir, **judge) -> JudgeConfig:
    return JudgeConfig(**{"path": str(model_dir), "api": "completions", "template": LOCAL_TEMPLATE, "max_tokens": 6,
                          "score_pattern": r"^(?P<score>\d)", "min_score": 0, "max_score": 9} | judge)


def transformers_greedy(model_dir, texts: list[str], max_tokens: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replies = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        replies.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return replies


def test_a_local_judge_grades_with_its_models_greedy_reply(arch_dir, tmp_path):
    """Eight samples in batches of max_concurrency = 3: each reward is the score in transformers' greedy reply
    of the judge checkpoint to the filled template, mapped from [0, 9]."""
    questions = [("12+34=", "46"), ("7+8=", "15"), ("30+11=", "41"), ("5+5=", "10"), ("99+1=", "100"),
                 ("2+2=", "5"), ("61+7=", "68"), ("40+40=", "80")]
    prompts = [LOCAL_TEMPLATE.format(question=q, response=r, reference="") for q, r in questions]
    model = digit_judge(arch_dir, tmp_path / "judge", prompts)
    samples = [Sample(prompt=q, response=r, answer="") for q, r in questions]
    cfg = local_judge(model, max_concurrency=3)
    replies = transformers_greedy(model, prompts, cfg.max_tokens)
    expected = [int(re.search(cfg.score_pattern, reply).group("score")) / 9 for reply in replies]
    assert len(set(expected)) == 2, replies  # the network's choice differs between samples: both digits occur

    rewards, failures = Scorer(RewardConfig(terms=[RewardTermConfig(kind="judge", judge=cfg)], timeout_s=60))(samples)
    assert failures == 0 and rewards == pytest.approx(expected, abs=1e-12), (rewards, replies)


def test_a_local_judges_reply_without_a_score_fails_its_sample(arch_dir, tmp_path):
    """The same judge asked for a score its replies never hold (an 8): every sample fails, named by the term."""
    judge = Scorer(RewardConfig(terms=[RewardTermConfig(kind="judge", judge=local_judge(
        digit_judge(arch_dir, tmp_path / "judge", ["1+1=2="]), score_pattern=r"(?P<score>8)"))]))
    rewards, failures = judge([Sample(prompt="1+1=", response="2", answer=""),
                               Sample(prompt="2+2=", response="4", answer="")])
    assert failures == 2 and rewards == [0.0, 0.0]
    assert judge.first_failure.startswith("reward.terms[0] (judge): JudgeError: no score in the reply"), \
        judge.first_failure


def test_a_local_judge_without_a_chat_template_is_refused_for_chat_naming_the_key(qwen2_dir, tmp_path):
    import shutil

    from megarl.config import RecipeError

    plain = tmp_path / "plain"
    shutil.copytree(qwen2_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    judge = Scorer(RewardConfig(terms=[RewardTermConfig(kind="judge", judge=local_judge(plain, api="chat"))]))
    with pytest.raises(RecipeError, match=r"reward\.terms\[0\]\.judge\.api = 'chat': the tokenizer in .* has no "
                                          r"chat template; use api: completions"):
        judge([Sample(prompt="1+1=", response="2", answer="")])


def test_a_local_judge_path_that_does_not_exist_is_named(tmp_path):
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"reward\.terms\[0\]\.judge\.path: .*not found"):
        load_config(REPO / "recipes" / "grpo_tiny.yaml",
                    [f"model.path={tmp_path}", f"data.train_path={rows}", "data.eval_path=null",
                     f"reward.terms=[{{kind: judge, judge: {{path: {tmp_path / 'missing'}}}}}]"], check_paths=True)
