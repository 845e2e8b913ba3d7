"""The reward-model loop: its loss, accuracy and margin are a plain transformers computation on the same pairs,
the tiny recipe learns to prefer correct sums (held-out accuracy 0.5 -> >= 0.85), the exported sequence
classifier gives the trained head's scores in transformers and in the `reward_model` term, an interrupted run
resumed equals one never interrupted, the loop's metrics and export at TP=2 and PP=2 are one rank's, and bad
recipes stop with errors naming file and key.

Runs are in this process (the `groups` fixture's one-rank Megatron state), which spares each the ~10 s of
imports a fresh `megarl train` pays; the CLI path is the same `train` function."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_python, with_score_head
from test_sft import read_metrics, write_lines

RECIPE = REPO / "recipes" / "rm_tiny.yaml"
FP32_TOL = 1e-4  # DESIGN contract 1: two fp32 implementations of one function (per score)
pytestmark = pytest.mark.timeout(240)


def rm_job(*args, **kwargs):
    """`rm_config(...)` resolved for one rank (megarl.job)."""
    from megarl.job import Job

    return Job.of(rm_config(*args, **kwargs), world=1, ranks_per_node=1)


def rm_config(qwen2_dir, tiny_data, run_dir, *overrides):
    from megarl.config import load_config

    return load_config(RECIPE, [f"model.path={qwen2_dir}", f"data.train_path={tiny_data / 'train_pairs.jsonl'}",
                                f"data.eval_path={tiny_data / 'heldout_pairs.jsonl'}", f"run_dir={run_dir}",
                                "log.progress=false", *overrides])


def hf_scores(model_dir, pairs) -> torch.Tensor:
    """[2P] transformers' sequence-classifier score of every pair's chosen and rejected sequence, interleaved,
    one unpadded sequence per call (the tiny tokenizer pads with its EOS, see checkpoint.classifier_config)."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.config.pad_token_id = None  # a copy of the causal LM's config (with_score_head) still names one
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([example.ids])).logits[0, 0] for pair in pairs for example in pair])


def bradley_terry_reference(scores: torch.Tensor, *, center_coef: float = 0.0) -> dict[str, float]:
    """Mean loss, accuracy (ties half) and margin over pairs of interleaved scores [2P], written out plainly."""
    chosen, rejected = scores[0::2].double(), scores[1::2].double()
    loss = -F.logsigmoid(chosen - rejected) + center_coef * (chosen + rejected) ** 2
    wins = [1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen.tolist(), rejected.tolist())]
    return {"loss": float(loss.mean()), "accuracy": sum(wins) / len(wins), "margin": float((chosen - rejected).mean())}


# ---- the loss ----------------------------------------------------------------------------------------------
def test_step_and_heldout_metrics_equal_a_transformers_computation(groups, qwen2_dir, tiny_data, tmp_path):
    """A checkpoint with a random score head: held-out loss (centring term on), accuracy and margin, then the
    first step's, are those of transformers' classifier on the same pairs."""
    from megarl.loops.rm import build_run, evaluate, pair_scores, rm_step

    scored = with_score_head(qwen2_dir, tmp_path / "scored", seed=7)
    run = build_run(rm_job(scored, tiny_data, tmp_path / "run", "data.prompts_per_step=16", "data.eval_prompts=16",
                              "train.micro_batch_size=8", "rm.center_coef=0.05"), groups)
    saved = run.sampler.state_dict()
    batch = [run.train_pairs[i] for i in run.sampler.next_batch(16)]  # what the step will draw
    run.sampler.load_state_dict(saved)
    expected_scores = hf_scores(scored, batch)
    assert (pair_scores(run.model, batch, pad_id=run.pad_id) - expected_scores).abs().max() <= FP32_TOL
    expected = bradley_terry_reference(expected_scores, center_coef=0.05)
    heldout = bradley_terry_reference(hf_scores(scored, run.eval_pairs), center_coef=0.05)
    assert 0.2 < expected["accuracy"] < 0.8 and abs(expected["margin"]) > 1e-3  # a random head: not degenerate
    # Scores agree within 1e-4 each (measured ~1e-6); loss and margin are means of functions of them with
    # slope <= 1 + 4 * center_coef * |score sum| ~ 1, so within 1e-4 too. No pair is within 2e-4 of a tie
    # (checked here), so the accuracies are exact.
    assert (expected_scores[0::2] - expected_scores[1::2]).abs().min() > 2 * FP32_TOL
    got = evaluate(run)  # forward only: the weights the step starts from
    for key in ("loss", "accuracy", "margin"):
        assert got[f"eval/{key}"] == pytest.approx(heldout[key], abs=FP32_TOL), key
    metrics = rm_step(run)
    for key in ("loss", "accuracy", "margin"):
        assert metrics[key] == pytest.approx(expected[key], abs=FP32_TOL), key
    assert metrics["accuracy"] == expected["accuracy"]
    assert metrics["grad_norm"] > 0


def test_a_fresh_head_starts_at_log_2_and_chance(groups, qwen2_dir, tiny_data, tmp_path):
    """Without score.weight the head starts at zero (the critic's): every score is 0, so the first loss is
    log 2 to fp32 rounding, every pair a tie (accuracy 0.5) and the margin 0; the head still gets a gradient."""
    from megarl.loops.rm import build_run, rm_step

    run = build_run(rm_job(qwen2_dir, tiny_data, tmp_path / "run", "data.prompts_per_step=8",
                              "train.micro_batch_size=8"), groups)
    metrics = rm_step(run)
    assert metrics["loss"] == pytest.approx(math.log(2.0), rel=1e-7)
    assert metrics["accuracy"] == 0.5 and metrics["margin"] == 0.0
    assert metrics["grad_norm"] > 0


# ---- the tiny recipe: learning, export -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def rm_run(groups, qwen2_dir, tiny_data, tmp_path_factory):
    """RUN_DIR of recipes/rm_tiny.yaml as shipped (60 steps of 32 pairs), on this session's model and pairs."""
    from megarl.loops.rm import train

    run_dir = tmp_path_factory.mktemp("rm") / "run"
    final = train(rm_config(qwen2_dir, tiny_data, run_dir))
    assert final == run_dir / "checkpoints" / "final"
    return run_dir


def test_tiny_recipe_learns_to_prefer_correct_sums(rm_run):
    steps = read_metrics(rm_run)
    assert [m["step"] for m in steps] == list(range(1, 61))
    # The zero head scores every sequence 0: the first step is at chance exactly (ties count half).
    assert steps[0]["accuracy"] == 0.5 and steps[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-7)
    heldout = [(m["step"], m["eval/accuracy"], m["eval/margin"]) for m in steps if "eval/accuracy" in m]
    assert [s for s, _, _ in heldout] == [1, 10, 20, 30, 40, 50, 60]
    # Measured on 128 held-out pairs: accuracy 0.69 after the first step (0.5 before it: all ties), 0.80 at
    # step 10, 0.84 at 20, 0.96 at 60 (0.89-0.91 from step 30 on); margin 0.001 -> 4.2. 0.85 is the bar the
    # issue sets; one pair of 128 is 0.8 points. Train loss: 0.66 -> 0.17 (means of the first and last 10
    # steps, 32 fresh pairs each).
    assert heldout[-1][1] >= 0.85, heldout
    assert heldout[-1][2] >= heldout[0][2] + 1.0, heldout
    first, last = (sum(m["loss"] for m in part) / 10 for part in (steps[:10], steps[-10:]))
    assert last <= first - 0.3, (first, last)


def test_export_is_a_sequence_classifier_with_the_trained_scores(rm_run, tiny_data, groups, tmp_path):
    """The export loads in transformers as Qwen2ForSequenceClassification (one label) and its held-out loss,
    accuracy and margin are the ones the Megatron head measured at the last step; the `reward_model` term
    loads it and scores rollout-shaped batches as transformers does."""
    from transformers import AutoTokenizer

    from megarl.batch import RolloutBatch
    from megarl.data.supervised import encode_pair, load_preference_pairs
    from megarl.engine.roles import make_engine
    from megarl.job import ModelRole
    from megarl.loops.samples import reward_model_scores
    from megarl.models.arch import read_shape

    final = rm_run / "checkpoints" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["num_labels"] == 1
    assert "pad_token_id" not in config  # the tiny tokenizer pads with its EOS (checkpoint.classifier_config)
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    pairs = [encode_pair(tokenizer, p, chat_template=False)
             for p in load_preference_pairs(tiny_data / "heldout_pairs.jsonl")[:128]]
    scores = hf_scores(final, pairs)
    expected = bradley_terry_reference(scores)
    assert (scores[0::2] - scores[1::2]).abs().min() > 2 * FP32_TOL  # no near-tie: the accuracy is exact
    last = read_metrics(rm_run)[-1]
    for key in ("loss", "margin"):  # means of 1e-4-close scores through functions of slope <= 1
        assert last[f"eval/{key}"] == pytest.approx(expected[key], abs=FP32_TOL), key
    assert last["eval/accuracy"] == expected["accuracy"]

    # The reward_model term (megarl.loops.rl_run builds it this way) on the same sequences as a rollout batch:
    # prompt, response and EOS, right-padded, the response mask on the response and its EOS.
    role = ModelRole("reward_model", "reward.terms[0].path", str(final), read_shape(final), value_head=True)
    term = make_engine(role, groups, dtype="float32", megatron={}, te_layers=False, seed=0)
    examples = [example for pair in pairs[:16] for example in pair]
    width = max(len(e.ids) for e in examples)
    tokens = torch.tensor([e.ids + [tokenizer.pad_token_id] * (width - len(e.ids)) for e in examples])
    mask = torch.tensor([e.loss_mask + [0] * (width - len(e.ids)) for e in examples], dtype=torch.float32)
    n = len(examples)
    prompt_lens = torch.tensor([e.loss_mask.index(1) for e in examples])
    batch = RolloutBatch(tokens=tokens, response_mask=mask, prompt_lens=prompt_lens,
                         group_ids=torch.arange(n), rollout_logprobs=torch.zeros_like(mask), responses=[""] * n,
                         answers=[""] * n, finish_reasons=["stop"] * n, prompt_texts=[""] * n, metadata=[{}] * n)
    term_scores = reward_model_scores(term, batch, pad_id=tokenizer.pad_token_id, micro_batch_size=8)
    assert (term_scores - scores[:n]).abs().max() <= FP32_TOL
    assert (term_scores[0::2] > term_scores[1::2]).float().mean() >= 0.85


# ---- resume --------------------------------------------------------------------------------------------------
def test_an_interrupted_run_resumed_equals_one_never_interrupted(groups, qwen2_dir, tiny_data, tmp_path, monkeypatch):
    """8 steps at once vs a run stopped by SIGTERM's request after step 3 (saved there) and started again:
    the same metrics at every step and the same exported weights (pair order and optimizer carry over)."""
    from safetensors.torch import load_file

    from megarl.loops import rm
    from megarl.loops.stop import STOP, Stopped

    common = ["train.steps=8", "data.eval_every=4", "data.eval_prompts=16", "checkpoint.every_steps=100"]
    once, twice = tmp_path / "once", tmp_path / "twice"
    rm.train(rm_config(qwen2_dir, tiny_data, once, *common))

    step = rm.rm_step

    def stop_after_third(run):
        metrics = step(run)
        if run.model.step == 3:
            monkeypatch.setattr(STOP, "kind", 2)  # what SIGTERM's handler records
        return metrics

    monkeypatch.setattr(rm, "rm_step", stop_after_third)
    with pytest.raises(Stopped) as stopped:
        rm.train(rm_config(qwen2_dir, tiny_data, twice, *common))
    assert stopped.value.step == 3 and stopped.value.checkpoint.name == "step00000003"
    monkeypatch.setattr(STOP, "kind", 0)
    monkeypatch.setattr(rm, "rm_step", step)
    rm.train(rm_config(qwen2_dir, tiny_data, twice, *common))

    drop_timing = lambda m: {k: v for k, v in m.items() if not k.startswith("timing/")}  # noqa: E731
    assert [drop_timing(m) for m in read_metrics(twice)] == [drop_timing(m) for m in read_metrics(once)]
    a, b = (load_file(str(d / "checkpoints" / "final" / "model.safetensors")) for d in (once, twice))
    assert sorted(a) == sorted(b) and "score.weight" in a and "lm_head.weight" not in a
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- layouts ---------------------------------------------------------------------------------------------
LAYOUT_RUN = ["train.steps=2", "data.eval_every=1", "data.prompts_per_step=16", "data.eval_prompts=32",
              "train.micro_batch_size=8", "checkpoint.every_steps=100"]


def test_steps_and_export_are_the_same_at_tp2_and_pp2_as_on_one_rank(groups, qwen2_dir, tiny_data, tmp_path):
    """Two steps of the loop from a random score head (so the first step's pairs are not all ties), each
    followed by the held-out evaluation, then the export: one torchrun job of two gloo ranks runs TP=2, then
    PP=2 (4 micro-batches of 4 pairs through the 1F1B schedule; the head on the last stage), and this process
    the one rank. Sharded and whole matmuls differ only in fp32 summation order: the metrics, means of scores
    that differ by ~1e-6, agree as test_parallel's policy steps do (rel 1e-5), the accuracies exactly (a pair
    flips only within ~1e-6 of a tie; these random-head margins are of order 0.1), and the exported trunk and
    head as test_parallel's trained weights do (assert_same_weights: two Adam steps at lr 1e-3)."""
    from safetensors.torch import load_file
    from test_parallel import assert_same_weights

    from megarl.loops.rm import train

    scored = with_score_head(qwen2_dir, tmp_path / "scored", seed=7)
    data = [f"data.train_path={tiny_data / 'train_pairs.jsonl'}", f"data.eval_path={tiny_data / 'heldout_pairs.jsonl'}",
            "log.progress=false", *LAYOUT_RUN]
    train(rm_config(scored, tiny_data, tmp_path / "one", *LAYOUT_RUN))
    cases = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
    argv = [["--model", str(scored), "--out", str(tmp_path / name), *extra, *(a for d in data for a in ("--set", d))]
            for name, extra in cases.items()]
    (tmp_path / "cases.json").write_text(json.dumps(argv))
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(REPO / "tests" / "rm_worker.py"), "--cases", str(tmp_path / "cases.json")], timeout_s=200)
    assert proc.returncode == 0, proc.stderr[-4000:]

    want = read_metrics(tmp_path / "one")
    assert 0.2 < want[0]["accuracy"] < 0.8 and want[1]["eval/accuracy"] != want[0]["eval/accuracy"]
    keys = ("loss", "accuracy", "margin", "grad_norm", "eval/loss", "eval/accuracy", "eval/margin")
    weights = load_file(str(tmp_path / "one" / "checkpoints" / "final" / "model.safetensors"))
    assert "score.weight" in weights and not torch.equal(weights["score.weight"],
                                                         load_file(str(scored / "model.safetensors"))["score.weight"])
    for name in cases:
        got = read_metrics(tmp_path / name)
        assert len(got) == len(want) == 2, name
        for g, w in zip(got, want):
            for key in keys:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (name, g["step"], key)
            assert g["accuracy"] == w["accuracy"] and g["eval/accuracy"] == w["eval/accuracy"], name
        assert_same_weights(load_file(str(tmp_path / name / "checkpoints" / "final" / "model.safetensors")), weights)


# ---- errors and the plan ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["train.micro_batch_size=3"], "rm_tiny.yaml: algo.name = 'rm' needs an even train.micro_batch_size"),
    (["rm.center=0.1"], r"rm_tiny.yaml: override 'rm.center=0.1': rm.center: unknown key \(did you mean "
                        r"'center_coef'\?\)"),
    (["rm.center_coef=-0.1"], r"rm.center_coef: must be >= 0, got -0.1"),
    (["train.micro_batch_tokens=256"], "train.micro_batch_tokens \\(sequence packing\\) is for the RL and SFT loops"),
    (["model.lora.rank=8"], "model.lora: adapters go on the policy; algo.name = 'rm' trains a scalar-head model"),
])
def test_rm_recipe_errors_name_file_and_key(qwen2_dir, tiny_data, tmp_path, overrides, message):
    from megarl.dataclass_yaml import ConfigError

    with pytest.raises(ConfigError, match=message):
        rm_config(qwen2_dir, tiny_data, tmp_path, *overrides)


def test_a_malformed_pair_stops_the_run_naming_file_and_line(groups, qwen2_dir, tiny_data, tmp_path):
    from megarl.data.prompts import DataError
    from megarl.loops.rm import build_run

    bad = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "1+1=", "chosen": "2", "rejected": "3"}',
                                               '{"prompt": "1+1=", "chosen": "2"}'])
    with pytest.raises(DataError, match=rf"{bad}:2: missing key 'rejected'"):
        build_run(rm_job(qwen2_dir, tiny_data, tmp_path / "run", f"data.train_path={bad}"), groups)


def test_plan_counts_the_trained_scalar_head_model_alone(capsys):
    """`megarl plan` of a reward-model recipe: one trainable model with the scalar head (no vocabulary
    projection: its [1, hidden] head replaces the untied [vocab / tp, hidden] output layer of the same
    recipe's SFT actor, in bf16 bytes per GPU), and no rollout engine."""
    from megarl.cli import main

    config = REPO / "recipes" / "gpu" / "configs" / "qwen2.5-7b" / "config.json"
    results = {}
    for algo in ("sft", "rm"):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", str(REPO / "recipes" / "dpo_7b.yaml"), f"algo.name={algo}", "--nodes", "1",
                  "--gpus-per-node", "8", "--model-config", str(config), "--json"])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0, out
        results[algo] = json.loads(out)
    rm_plan, sft_plan = results["rm"], results["sft"]
    assert [m["name"] for m in rm_plan["models"]] == ["reward_model"] and rm_plan["rollout"] is None
    (model,), (actor,) = rm_plan["models"], sft_plan["models"]
    assert model["grads"] > 0 and model["optim"] > 0
    shape, tp = json.loads(config.read_text()), rm_plan["layout"]["tp"]
    assert not shape["tie_word_embeddings"]
    bf16_bytes = 2
    assert actor["params"] - model["params"] == (shape["vocab_size"] * shape["hidden_size"] // tp
                                                 - shape["hidden_size"]) * bf16_bytes
    assert rm_plan["layout"]["micro_batches"] == sft_plan["layout"]["micro_batches"] * 2  # two sequences a pair
