"""The SFT loop and its data: the tiny recipe lowers train and held-out loss, DP=2 gives the numbers of one
rank on the same global batches, chat conversations train on exactly the assistant turns, and malformed
rows or templates stop with errors naming file and line."""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO, in_gpu_world, run_python
from megarl.data.prompts import DataError
from megarl.data.supervised import encode_conversation, encode_sft_row, load_sft_rows

RUN_TIMEOUT_S = 240  # the 60-step tiny recipe takes ~20 s alone on 2 cores, 2 gloo ranks ~2x; bounded anyway
DP_STEPS = 3


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def megarl_train(recipe, *overrides):
    return run_python(["-m", "megarl", "train", str(recipe), *overrides, "log.progress=false"],
                      timeout_s=RUN_TIMEOUT_S)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_run(qwen2_dir, tiny_data, tmp_path_factory):
    """RUN_DIR of recipes/sft_tiny.yaml as shipped, on this session's model and data."""
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    proc = megarl_train(REPO / "recipes" / "sft_tiny.yaml", f"model.path={qwen2_dir}",
                        f"data.train_path={tiny_data / 'train.jsonl'}", f"data.eval_path={tiny_data / 'heldout.jsonl'}",
                        f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


# ---- the loop ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_tiny_recipe_lowers_train_and_heldout_loss(sft_run):
    steps = read_metrics(sft_run)
    assert [m["step"] for m in steps] == list(range(1, 61))
    first, last = (sum(m["loss"] for m in part) / 5 for part in (steps[:5], steps[-5:]))
    heldout = [m["eval/loss"] for m in steps if "eval/loss" in m]
    assert [m["step"] for m in steps if "eval/loss" in m] == [1, 10, 20, 30, 40, 50, 60]
    # Measured: train NLL 4.5 -> 1.6 (means of the first and last 5 steps), held-out 4.71 -> 1.58 nats per
    # token (first and last evaluation). A drop of 1 nat on each leaves room for CPU-to-CPU differences and
    # is far beyond step-to-step noise (~0.1).
    assert last <= first - 1.0, (first, last)
    assert heldout[-1] <= heldout[0] - 1.0, heldout
    assert (sft_run / "checkpoints" / "final" / "model.safetensors").is_file()


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_two_data_parallel_ranks_give_the_single_rank_numbers(sft_run, qwen2_dir, tiny_data, tmp_path):
    # Same recipe, same seed, so the same global batches: DP=1 runs each as 2 micro-batches of 32, DP=2 as one
    # of 32 per rank. Only fp32 summation order differs (~1e-7 relative). The two ranks run in the world megarl
    # starts on a GPU, so the loop's host-side sums must not go to its NCCL part.
    proc = run_python([*in_gpu_world(2), "train", str(REPO / "recipes" / "sft_tiny.yaml"), f"model.path={qwen2_dir}",
                       f"data.train_path={tiny_data / 'train.jsonl'}", "data.eval_path=null",
                       f"train.steps={DP_STEPS}", "checkpoint.save_final=false", f"run_dir={tmp_path}",
                       "log.progress=false"], timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for got, want in zip(read_metrics(tmp_path), read_metrics(sft_run)[:DP_STEPS], strict=True):
        for key in ("loss", "grad_norm", "response_prob"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (got["step"], key)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_packed_sequences_give_the_padded_numbers(sft_run, qwen2_dir, tiny_data, tmp_path):
    """train.micro_batch_tokens: the same global batches in packed rows of at most 96 tokens (several rows a
    step, no padding) give the padded run's loss, gradient norm and held-out loss (fp32 sums in another order:
    1e-5 relative); a row longer than a packed micro-batch is refused naming file, row and key."""
    common = [f"model.path={qwen2_dir}", f"data.train_path={tiny_data / 'train.jsonl'}",
              f"data.eval_path={tiny_data / 'heldout.jsonl'}", "checkpoint.save_final=false", "log.progress=false"]
    proc = run_python(["-m", "megarl", "train", str(REPO / "recipes" / "sft_tiny.yaml"), *common,
                       f"train.steps={DP_STEPS}", "train.micro_batch_tokens=96", f"run_dir={tmp_path / 'packed'}"],
                      timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    padded = read_metrics(sft_run)[:DP_STEPS]
    for got, want in zip(read_metrics(tmp_path / "packed"), padded, strict=True):
        for key in ("loss", "grad_norm", "response_prob", "eval/loss"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), (got["step"], key)
    assert "eval/loss" in padded[0]
    proc = run_python(["-m", "megarl", "train", str(REPO / "recipes" / "sft_tiny.yaml"), *common,
                       "train.micro_batch_tokens=4", f"run_dir={tmp_path / 'short'}"], timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode != 0
    assert re.search(rf"{re.escape(str(tiny_data / 'train.jsonl'))}: row 1 is \d+ tokens, more than "
                     r"train.micro_batch_tokens = 4", proc.stderr), proc.stderr[-2000:]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_a_non_finite_loss_stops_the_run_before_it_is_checkpointed(qwen2_dir, tiny_data, tmp_path):
    # A learning rate of 1e30 moves every weight by ~1e30 in Adam's first update, so step 2's logits, and
    # its loss, overflow fp32. Step 1's checkpoint stays the latest; resuming from it replays step 2's rows.
    proc = megarl_train(REPO / "recipes" / "sft_tiny.yaml", f"model.path={qwen2_dir}",
                        f"data.train_path={tiny_data / 'train.jsonl'}", "data.eval_path=null", "optim.lr=1e30",
                        "optim.warmup_steps=0", "train.steps=4", "checkpoint.every_steps=1", f"run_dir={tmp_path}")
    assert proc.returncode != 0
    assert "FloatingPointError: step 2: sft loss" in proc.stderr and "is not finite" in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step00000001"
    assert not (tmp_path / "checkpoints" / "step00000002").exists()


# ---- chat conversations ------------------------------------------------------------------------------------
CONVERSATION = (
    {"role": "system", "content": "Add little-endian numbers."},
    {"role": "user", "content": "140+872="},
    {"role": "assistant", "content": "9130"},
    {"role": "user", "content": "and 001+001="},
    {"role": "assistant", "content": "2000 it is.\nDone"},
)


@pytest.fixture(scope="module")
def tokenizer(qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen2_dir))


def masked_spans(tokenizer, example) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    spans, current = [], []
    for token, trained in zip(example.ids + [None], example.loss_mask + [0]):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def test_chat_mask_covers_exactly_each_assistant_turn_and_its_end_token(tokenizer, tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps({"messages": list(CONVERSATION)})])
    example = encode_sft_row(tokenizer, load_sft_rows(path)[0], chat_template=False)  # chat rows always use it
    rendered = tokenizer.apply_chat_template(list(CONVERSATION), tokenize=False)
    assert tokenizer.decode(example.ids) == rendered
    # The template closes a turn with <|im_end|> and a newline; the newline is context, not trained.
    assert masked_spans(tokenizer, example) == ["9130<|im_end|>", "2000 it is.\nDone<|im_end|>"]
    assert len(example.ids) == len(example.loss_mask)


def test_prompt_response_rows_train_on_the_response_and_eos(tokenizer, tmp_path):
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps({"question": "140+872=", "target": "9130"})])
    row = load_sft_rows(path, prompt_key="question", response_key="target")[0]
    raw = encode_sft_row(tokenizer, row, chat_template=False)
    assert tokenizer.decode(raw.ids) == "140+872=9130<|endoftext|>"
    assert masked_spans(tokenizer, raw) == ["9130<|endoftext|>"]
    chat = encode_sft_row(tokenizer, row, chat_template=True)  # a one-turn conversation
    assert masked_spans(tokenizer, chat) == ["9130<|im_end|>"]


def test_template_that_rewrites_earlier_turns_is_refused_naming_the_row(tokenizer, tmp_path):
    # Like templates that drop past reasoning: an earlier assistant turn renders differently once a later
    # turn follows, so its span in the whole conversation is not the text rendered for it alone.
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier answer){% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_lines(tmp_path / "chat.jsonl", ["", json.dumps({"messages": list(CONVERSATION)})])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}:2: assistant turn 2: .* prefix"):
        encode_sft_row(tokenizer, load_sft_rows(path)[0], chat_template=True)


def test_chat_row_without_a_chat_template_is_an_error(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="f.jsonl:7: chat messages need a tokenizer with a chat template"):
        encode_conversation(tokenizer, CONVERSATION, where="f.jsonl:7")


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "1+1=", "response": ', "invalid JSON"),
    ('["1+1=", "2"]', "expected a JSON object, got list"),
    ('{"prompt": "1+1="}', "missing key 'response'"),
    ('{"prompt": "1+1=", "response": 2}', "'response' must be a string, got int"),
    ('{"text": "1+1=2"}', "expected 'messages', or 'prompt' and 'response'"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object with string 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "'messages' has no assistant turn to train on"),
], ids=["bad-json", "not-object", "missing-key", "not-string", "neither-form", "empty-messages", "bad-turn",
        "no-assistant"])
def test_malformed_sft_row_names_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "sft.jsonl", ['{"prompt": "1+1=", "response": "2"}', "", line])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: {message}"):
        load_sft_rows(path)


# ---- full-size recipes -------------------------------------------------------------------------------------
QWEN25_7B = {  # config.json of the Qwen2.5-7B layout (no weights are needed to check a recipe against it)
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,train_file", [("sft_7b", "train.jsonl"), ("dpo_7b", "train_pairs.jsonl")])
def test_full_size_recipe_placeholders_fail_and_layout_fits_one_8_gpu_node(name, train_file, tiny_data, tmp_path):
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError
    from megarl.engine.model import transformer_config
    from megarl.layout import Layout
    from megarl.models.arch import read_shape

    recipe = REPO / "recipes" / f"{name}.yaml"
    with pytest.raises(ConfigError, match=rf"{name}.yaml: model.path: directory not found: /SET-ME/"):
        load_config(recipe)
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    with pytest.raises(ConfigError, match=rf"{name}.yaml: data.train_path: file not found: /SET-ME/"):
        load_config(recipe, [f"model.path={model}"])

    data = tiny_data / train_file
    cfg = load_config(recipe, [f"model.path={model}", f"data.train_path={data}", f"data.eval_path={data}"])
    assert (cfg.algo.name, cfg.model.dtype) == (name.removesuffix("_7b"), "bfloat16")
    shape, par = read_shape(model), cfg.parallel
    layout = Layout.of(cfg, shape, world=8, ranks_per_node=8)  # the check launch makes
    assert layout.dp == 8 // (par.tp * par.pp * par.cp)
    # The megatron: block is a valid TransformerConfig for this shape (recompute settings included).
    config = transformer_config(shape, dtype=cfg.model.dtype, tp=par.tp, pp=par.pp, megatron=cfg.model.megatron)
    assert config.bf16 and config.recompute_granularity == "full"


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_an_interrupted_run_resumed_equals_one_never_interrupted(sft_run, qwen2_dir, tiny_data, tmp_path):
    """8 steps at once vs 4 steps and then a new invocation to 8 (resumed from the step-4 checkpoint): the
    same metrics at every step and the same final weights (the prompt order and the optimizer carry over)."""
    import torch
    from safetensors.torch import load_file

    common = [f"model.path={qwen2_dir}", f"data.train_path={tiny_data / 'train.jsonl'}", "data.eval_path=null",
              "checkpoint.every_steps=2"]
    once, twice = tmp_path / "once", tmp_path / "twice"
    for run_dir, steps in ((once, 8), (twice, 4), (twice, 8)):
        proc = megarl_train(REPO / "recipes" / "sft_tiny.yaml", *common, f"run_dir={run_dir}", f"train.steps={steps}")
        assert proc.returncode == 0, proc.stderr[-4000:]
    drop_timing = lambda m: {k: v for k, v in m.items() if not k.startswith("timing/")}  # noqa: E731
    assert [drop_timing(m) for m in read_metrics(twice)] == [drop_timing(m) for m in read_metrics(once)]
    a, b = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (once, twice))
    assert all(torch.equal(a[k], b[k]) for k in a)
