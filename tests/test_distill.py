"""On-policy distillation (algo.name: distill, algo.distill_coef, teacher:): the per-token reverse KL equals a
transformers computation of both models, and is the same at TP=2 and PP=2 as on one rank; a teacher whose
tokenizer is not the student's, a teacher the layout cannot split and a recipe that misuses the keys are
refused naming the key; the teacher is in `megarl plan`; and distillation learns: the student's held-out
reward approaches the teacher's while the reverse KL falls.

Tolerances: the reverse KL is the difference of two fp32 logprobs, each within ~1e-7 of transformers' on these
models (tests/test_engine.py measures two fp32 implementations of one function at that level), so 1e-5 leaves
two orders of magnitude for summation order and nothing for a wrong token alignment, temperature or model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, _tiny_model_tool, run_python

pytestmark = pytest.mark.timeout(300)

RECIPE = REPO / "recipes" / "distill_tiny.yaml"
TOL = 1e-5  # per token, fp32: see the module docstring


@pytest.fixture(scope="module")
def big_teacher(tiny_models) -> Path:
    """A teacher larger than the tiny student (hidden 128, 4 layers, 8 heads): the same tokenizer, made by the
    same tool."""
    out = tiny_models / "qwen2_teacher_h128l4"
    if not (out / "config.json").exists():
        _tiny_model_tool().make_tiny_model(out, arch="qwen2", seed=5, hidden=128, layers=4, heads=8, kv_heads=4,
                                           ffn=256)
    return out


def recipe(tmp_path: Path, student: Path, teacher: Path | None, *overrides: str):
    """recipes/distill_tiny.yaml on `student` and `teacher` with prompts written here."""
    from megarl.config import load_config

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    return load_config(RECIPE, [f"model.path={student}", f"teacher.path={teacher or 'null'}", f"data.train_path={data}",
                                f"data.eval_path={data}", f"run_dir={tmp_path / 'run'}", *overrides])


def hf_token_logprobs(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logprob of each token given the ones before it, [B, T] (column 0 is 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def fixed_batch(tokenizer_vocab: int = 98):
    """A rollout batch of 4 samples: random prompt (5) + response tokens of lengths 9, 8, 7, 6."""
    from megarl.batch import RolloutBatch

    tokens = torch.randint(3, tokenizer_vocab, (4, 14), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(4, 14)
    for i in range(4):
        mask[i, 5: 14 - i] = 1.0
    n = len(tokens)
    return RolloutBatch(tokens=tokens, response_mask=mask, prompt_lens=torch.full((n,), 5), group_ids=torch.arange(n),
                        rollout_logprobs=torch.zeros_like(mask), responses=[""] * n, answers=[""] * n,
                        finish_reasons=["stop"] * n, prompt_texts=[""] * n, metadata=[{}] * n,
                        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))


# ---- the signal -------------------------------------------------------------------------------------------
def test_reverse_kl_per_token_equals_transformers_on_both_models(qwen2_dir, big_teacher, groups, tmp_path):
    """The loop's own phases (compute_logprobs, the distill advantage, the metrics) on a student and a larger
    teacher built by the run's engine factory, against both models in transformers on the same tokens."""
    from megarl.engine.roles import build_engine
    from megarl.job import Job
    from megarl.loops.rl import compute_logprobs, distill_metrics
    from megarl.objective import advantage_fn, policy_objective
    from megarl.routing import RoutePlan

    cfg = recipe(tmp_path, qwen2_dir, big_teacher, "train.micro_batch_size=2")
    assert not cfg.algo.on_policy  # the student's logprobs are needed before the update
    job = Job.of(cfg, world=1, ranks_per_node=1)
    run = SimpleNamespace(cfg=cfg, objective=policy_objective(cfg.algo, on_policy=cfg.algo.on_policy),
                          routes=RoutePlan("none", on_policy=False), reference=None, critic=None,
                          actor=build_engine(job, job.role("actor"), groups),
                          teacher=build_engine(job, job.role("teacher"), groups),
                          global_sums=lambda values: values)
    assert run.teacher.shape.hidden == 128 and run.actor.shape.hidden == 64
    batch = compute_logprobs(run, fixed_batch())
    mask = batch.response_mask
    student, teacher = hf_token_logprobs(qwen2_dir, batch.tokens), hf_token_logprobs(big_teacher, batch.tokens)
    expected = (student - teacher) * mask

    advantages, returns = advantage_fn(cfg.algo, group=None)(batch, 0.0)
    assert returns is None
    assert (-advantages - expected).abs().max() <= TOL
    assert (batch.teacher_logprobs - teacher * mask).abs().max() <= TOL
    assert expected.abs().max() > 0.1  # two different models: the comparison is not of zeros
    metrics = distill_metrics(run, batch)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(expected.sum() / mask.sum()), abs=TOL)
    assert metrics["distill/teacher_logprob"] == pytest.approx(float((teacher * mask).sum() / mask.sum()), abs=TOL)


def test_distill_coef_adds_the_teacher_term_to_any_algorithm():
    """grpo: the group advantages plus -coef * reverse_kl per token; ppo: the same term in the token rewards
    that GAE discounts (with gamma = lam = 1 and a zero critic the advantage before whitening is the reward-to-go)."""
    from megarl.algo.advantages import broadcast_to_tokens, grpo_advantages, whiten
    from megarl.config import AlgoConfig
    from megarl.objective import advantage_fn

    batch = fixed_batch()
    gen = torch.Generator().manual_seed(3)
    mask = batch.response_mask
    batch = batch.replace(old_logprobs=-torch.rand(4, 14, generator=gen) * mask,
                          teacher_logprobs=-torch.rand(4, 14, generator=gen) * mask, values=torch.zeros(4, 14))
    rkl = (batch.old_logprobs - batch.teacher_logprobs) * mask
    group_ids = torch.tensor([0, 0, 1, 1])
    batch = dataclasses.replace(batch, group_ids=group_ids)  # two groups of two

    grpo, _ = advantage_fn(AlgoConfig(name="grpo", distill_coef=0.5), group=None)(batch, 0.0)
    plain = broadcast_to_tokens(grpo_advantages(batch.rewards, group_ids, std_norm=True), mask)
    assert torch.allclose(grpo, plain - 0.5 * rkl, atol=1e-6)

    ppo, _ = advantage_fn(AlgoConfig(name="ppo", distill_coef=0.5, gamma=1.0, lam=1.0), group=None)(batch, 0.0)
    token_rewards = -0.5 * rkl
    last = mask.cumsum(1).argmax(1)
    token_rewards[torch.arange(4), last] += batch.rewards
    to_go = token_rewards.flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(ppo, whiten(to_go, mask), atol=1e-5)


# ---- refusals ---------------------------------------------------------------------------------------------
def test_teacher_with_another_tokenizer_is_refused_naming_teacher_path(qwen2_dir, tmp_path):
    """A teacher whose vocabulary maps two tokens to each other's ids is refused before any model is built."""
    from megarl.config import RecipeError
    from megarl.loops.launch import resolve_job

    teacher = tmp_path / "teacher"
    shutil.copytree(qwen2_dir, teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RecipeError, match=r"^teacher\.path: the teacher's tokenizer .* token 'a' is id \d+, the "
                                          r"student's \d+"):
        resolve_job(recipe(tmp_path, qwen2_dir, teacher))
    resolve_job(recipe(tmp_path, qwen2_dir, qwen2_dir))  # the same tokenizer passes


@pytest.mark.parametrize("overrides, message", [
    ((), r"algo\.name = 'distill' distills from a teacher: set teacher\.path"),
    (("algo.name=grpo", "rollout.n_samples=4", "algo.distill_coef=0.1"),
     r"algo\.distill_coef > 0 distills from a teacher: set teacher\.path"),
    (("teacher.path=TEACHER", "algo.name=grpo", "rollout.n_samples=4"), r"teacher\.path is set but nothing reads it"),
    (("teacher.path=TEACHER", "algo.distill_coef=0.5"), r"algo\.distill_coef: adds the teacher's term to another"),
    (("teacher.path=TEACHER", "algo.name=grpo", "rollout.n_samples=4", "algo.distill_coef=-1"),
     r"algo\.distill_coef: must be >= 0"),
    (("teacher.path=TEACHER", "algo.name=sft"), r"teacher\.path: on-policy distillation scores generated samples"),
    (("teacher.path=/nonexistent/teacher",), r"teacher\.path: directory not found"),
])
def test_config_errors_name_the_key(qwen2_dir, tmp_path, overrides, message):
    from megarl.dataclass_yaml import ConfigError

    overrides = tuple(o.replace("TEACHER", str(qwen2_dir)) for o in overrides)
    with pytest.raises(ConfigError, match=message):
        recipe(tmp_path, qwen2_dir, None, *overrides)


def test_teacher_layout_is_checked_and_planned(qwen2_dir, big_teacher, tmp_path):
    """The teacher is built at the trainer's layout: a teacher whose heads TP cannot split is refused, by launch
    and by `megarl plan` alike, naming teacher.path; a teacher that fits is in the plan with its own size."""
    from megarl.layout import Layout, LayoutError
    from megarl.job import Job
    from megarl.models.arch import read_shape
    from megarl.plan.estimate import PlanError, plan
    from megarl.plan.memory import Cluster, stage_params

    odd = _tiny_model_tool().make_tiny_model(tmp_path / "odd", arch="qwen2", hidden=72, heads=3, kv_heads=1)
    student = read_shape(qwen2_dir)  # 4 heads, 2 query groups: TP=2 splits it
    cfg = recipe(tmp_path, qwen2_dir, odd, "parallel.tp=2", "data.prompts_per_step=4", "train.micro_batch_size=1")
    Layout.of(cfg, student, world=2, ranks_per_node=2)  # the student alone splits
    with pytest.raises(LayoutError, match=r"^teacher\.path \(qwen2, the distillation teacher.*\): attention heads 3 "
                                          r"is not divisible by parallel\.tp = 2"):
        Job.of(cfg, world=2, ranks_per_node=2)
    with pytest.raises(PlanError, match=r"^teacher\.path .*attention heads 3"):
        plan(cfg, student, Cluster(nodes=1, gpus_per_node=2))

    cfg = recipe(tmp_path, qwen2_dir, big_teacher)
    result = plan(cfg, student, Cluster(nodes=1, gpus_per_node=1))
    models = {m.name: m for m in result.models}
    teacher_params = stage_params(read_shape(big_teacher), tp=1, pp=1, ep=1, stage=0).total * 4  # fp32
    assert models["teacher"].params == teacher_params > models["actor"].params
    assert models["teacher"].grads == models["teacher"].optim == models["teacher"].activations == 0
    assert any("distillation teacher" in line for line in result.assumptions)


# ---- layouts ----------------------------------------------------------------------------------------------
def test_reverse_kl_is_the_same_at_tp2_and_pp2_as_on_one_rank(qwen2_dir, big_teacher, groups, tmp_path):
    """One torchrun job of two gloo ranks runs TP=2, then PP=2 (tests/distill_worker.py); this process is the one
    rank. Sharded and whole matmuls differ only in fp32 summation order: within TOL per token."""
    from distill_worker import fixed_batch as worker_batch

    from megarl.algo.kl import reverse_kl
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    tokens, mask = worker_batch()
    one_rank = {name: TrainEngine(model_dir=str(path), shape=read_shape(str(path)), dtype="float32", megatron={}, groups=groups).logprobs(
                    tokens, temperature=1.0, micro_batch_size=2) * mask
                for name, path in (("student", qwen2_dir), ("teacher", big_teacher))}
    want = {"reverse_kl": reverse_kl(one_rank["student"], one_rank["teacher"], mask),
            "teacher_logprobs": one_rank["teacher"]}
    assert want["reverse_kl"].abs().max() > 0.1

    cases = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
    argv = [["--model", str(qwen2_dir), "--teacher", str(big_teacher), "--out", str(tmp_path / name), *extra]
            for name, extra in cases.items()]
    (tmp_path / "cases.json").write_text(json.dumps(argv))
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(REPO / "tests" / "distill_worker.py"), "--cases", str(tmp_path / "cases.json")], timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in cases:
        got = json.loads((tmp_path / name / "result.json").read_text())
        for key, value in want.items():
            assert (torch.tensor(got[key]) - value).abs().max() <= TOL, (name, key)


# ---- learning ---------------------------------------------------------------------------------------------
LEARNING_STEPS = 150
EVAL_EVERY = 5


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_distillation_brings_the_warm_start_toward_the_quickstart_teacher(quickstart_out, tmp_path):
    """recipes/distill_tiny.yaml for LEARNING_STEPS steps: the student is the quickstart's supervised warm start
    (held-out reward ~0.2), the teacher the quickstart's model after 200 GRPO steps, whose held-out reward is the
    mean of its last 10 evaluations on the same 64 held-out prompts. The student is evaluated every EVAL_EVERY
    steps on those 64: its start is the mean of its first 2 evaluations (steps 5 and 10), its end the mean of its
    last 6 (steps 125-150, 384 prompts); the reverse KL is the mean of the first and of the last 10 steps.

    Measured at one thread on a 2-core CPU: held-out reward 0.180 -> 0.549 against the teacher's 0.603 (91%),
    reverse KL 0.443 -> 0.032 (its own run of the recipe on 256 prompts: 80% at step 90, 86% at 120: docs/algorithms.md,
    "On-policy distillation"). Bars: 80% of the teacher, as the issue asks, 2.6 standard errors of the end's
    mean (~0.026 at p ~ 0.55 over 384 prompts; 4% of the teacher) below the measured 91%; a rise of at least 0.2
    (measured 0.37); the reverse KL down to a quarter of its start at most (measured 7%). A student that learned
    nothing would stay near the warm start, ~0.2 (a third of the teacher), with its reverse KL."""
    run_dir = tmp_path / "distill"
    proc = run_python(["-m", "megarl", "train", str(RECIPE), f"run_dir={run_dir}",
                       f"model.path={quickstart_out / 'run' / 'warmup'}",
                       f"teacher.path={quickstart_out / 'run' / 'checkpoints' / 'final'}",
                       f"data.train_path={quickstart_out / 'data' / 'train.jsonl'}",
                       f"data.eval_path={quickstart_out / 'data' / 'heldout.jsonl'}", f"train.steps={LEARNING_STEPS}",
                       f"data.eval_every={EVAL_EVERY}", "checkpoint.save_final=false", "log.progress=false"],
                      timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    teacher_runs = [json.loads(line) for line in (quickstart_out / "run" / "metrics.jsonl").read_text().splitlines()]
    teacher = sum(m["eval/reward_mean"] for m in teacher_runs[-10:]) / 10
    evals = [m["eval/reward_mean"] for m in metrics if "eval/reward_mean" in m]
    assert len(evals) == LEARNING_STEPS // EVAL_EVERY
    start, end = sum(evals[:2]) / 2, sum(evals[-6:]) / 6
    kl = [m["distill/reverse_kl"] for m in metrics]
    kl_start, kl_end = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    print(f"distill {LEARNING_STEPS} steps: held-out reward {start:.3f} -> {end:.3f}, teacher {teacher:.3f} "
          f"({end / teacher:.0%}); reverse KL {kl_start:.3f} -> {kl_end:.3f}")
    assert end >= 0.8 * teacher and end >= start + 0.2
    assert kl_end <= 0.25 * kl_start
    assert all(m["distill/teacher_logprob"] < 0 for m in metrics)
