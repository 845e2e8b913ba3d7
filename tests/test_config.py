"""Recipe loading: every mistake is a ConfigError naming the file and the key, and a resolved recipe
round-trips through YAML."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import Config, load_config
from megarl.dataclass_yaml import ConfigError, config_to_dict, dump_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """Write a recipe (YAML text) next to an existing model directory and train file; return its path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')

    def write(body: str = "") -> Path:
        path = tmp_path / "q.yaml"
        path.write_text("model:\n  path: model\ndata:\n  train_path: train.jsonl\n" + body)
        return path

    return write


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_minimal_recipe_gets_defaults_and_absolute_paths(recipe, tmp_path):
    cfg = load_config(recipe())
    assert cfg.model.path == str(tmp_path / "model")
    assert cfg.data.train_path == str(tmp_path / "train.jsonl")
    assert cfg.rollout == type(cfg.rollout)()
    assert cfg.algo.name == "grpo" and cfg.optim.lr == 1e-6


def test_float_without_dot_in_file_and_int_for_float(recipe):
    cfg = load_config(recipe("optim:\n  lr: 3e-6\nrollout:\n  temperature: 1\n"))
    assert cfg.optim.lr == 3e-6
    assert cfg.rollout.temperature == 1.0 and type(cfg.rollout.temperature) is float


def test_unknown_key_in_file_suggests_the_near_name(recipe):
    path = recipe("rollout:\n  temprature: 0.5\n")
    assert error_of(path) == f"{path}: rollout.temprature: unknown key (did you mean 'temperature'?)"


def test_unknown_key_in_override_names_the_override(recipe):
    path = recipe()
    assert error_of(path, ["rollout.temprature=0.5"]) == (
        f"{path}: override 'rollout.temprature=0.5': rollout.temprature: unknown key (did you mean 'temperature'?)"
    )
    assert error_of(path, ["rolout.temperature=1"]) == (
        f"{path}: override 'rolout.temperature=1': rolout: unknown key (did you mean 'rollout'?)"
    )


def test_wrong_types_name_key_expected_type_and_value(recipe):
    path = recipe("train:\n  steps: ten\n")
    assert error_of(path) == f"{path}: train.steps: expected int, got 'ten' (str)"
    path = recipe("log:\n  progress: 1\n")
    assert error_of(path) == f"{path}: log.progress: expected bool, got 1 (int)"
    path = recipe()
    assert error_of(path, ["model.dtype=bfloat"]) == (
        f"{path}: override 'model.dtype=bfloat': model.dtype: expected one of 'float32', 'bfloat16', 'float16',"
        " got 'bfloat' (str) (did you mean 'bfloat16'?)"
    )


def test_missing_required_key(recipe, tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text("data:\n  train_path: train.jsonl\n")
    assert error_of(path) == f"{path}: model.path: required key missing (expected str)"


def test_missing_model_dir_and_train_file(recipe, tmp_path):
    path = recipe()
    assert error_of(path, ["model.path=nowhere"]) == (
        f"{path}: override 'model.path=nowhere': model.path: directory not found: {tmp_path / 'nowhere'}"
    )
    path.write_text("model:\n  path: model\ndata:\n  train_path: missing.jsonl\n")
    assert error_of(path) == f"{path}: data.train_path: file not found: {tmp_path / 'missing.jsonl'}"
    path.write_text("model:\n  path: train.jsonl\ndata:\n  train_path: model\n")
    assert error_of(path) == f"{path}: model.path: not a directory: {tmp_path / 'train.jsonl'}"


def test_impossible_values_name_the_field(recipe):
    path = recipe("rollout:\n  temperature: 0\n")
    assert error_of(path) == f"{path}: rollout.temperature: must be > 0, got 0.0"
    path = recipe()
    assert error_of(path, ["rollout.top_p=1.5"]) == (
        f"{path}: override 'rollout.top_p=1.5': rollout.top_p: must be in (0, 1], got 1.5"
    )
    assert error_of(path, ["parallel.tp=0"]).endswith("parallel.tp: must be >= 1, got 0")


def test_expert_tensor_parallel_size_has_one_key(recipe):
    """parallel.etp sets the expert tensor-parallel size (null: parallel.tp); Megatron's own spelling of it, and of
    every other parallel size, in model.megatron is refused naming the key to use, so the parallel state and the
    TransformerConfig can never disagree."""
    path = recipe()
    assert load_config(path).parallel.etp is None
    assert load_config(path, ["parallel.etp=1"]).parallel.etp == 1
    assert error_of(path, ["parallel.etp=0"]) == f"{path}: override 'parallel.etp=0': parallel.etp: must be >= 1, got 0"
    assert error_of(path, ["model.megatron.expert_tensor_parallel_size=1"]) == (
        f"{path}: override 'model.megatron.expert_tensor_parallel_size=1': model.megatron: "
        "expert_tensor_parallel_size is the parallel layout's: set parallel.etp instead")
    assert error_of(path, ["model.megatron.tensor_model_parallel_size=2"]).endswith(
        "tensor_model_parallel_size is the parallel layout's: set parallel.tp instead")


def test_cross_section_check_names_the_keys_and_numbers(recipe):
    path = recipe("rollout:\n  n_samples: 3\n")
    assert error_of(path, ["data.prompts_per_step=6", "train.micro_batch_size=4"]) == (
        f"{path}: rollout.n_samples * data.prompts_per_step = 3 * 6 = 18 samples per step"
        " is not divisible by train.micro_batch_size = 4"
    )
    assert error_of(path, ["rollout.n_samples=1", "algo.name=rloo"]) == (
        f"{path}: algo.name = 'rloo' compares samples within a group and needs rollout.n_samples >= 2, got 1"
    )


@pytest.mark.parametrize("overrides, message", [
    (["algo.mis_low=0.5"], "algo.mis_high: must be set together with algo.mis_low, the other edge of the band "
                            "(both null = off)"),
    (["algo.mis_high=2.0"], "algo.mis_low: must be set together with algo.mis_high, the other edge of the band "
                             "(both null = off)"),
    (["algo.mis_low=1.0", "algo.mis_high=2.0"], "algo.mis_low: must be in (0, 1), got 1.0"),
    (["algo.mis_low=0", "algo.mis_high=2.0"], "algo.mis_low: must be in (0, 1), got 0.0"),
    (["algo.mis_low=0.5", "algo.mis_high=1.0"], "algo.mis_high: must be > 1, got 1.0"),
    (["algo.mis_level=tokens"], "algo.mis_level: "),
    (["algo.name=gspo", "algo.loss_agg=seq-mean-token-mean", "algo.mis_low=0.5", "algo.mis_high=2.0"],
     "algo.mis_level = 'token' rejects single tokens, which would break the sequence ratio of algo.name = 'gspo'; "
     "set algo.mis_level: sequence"),
])
def test_mis_band_mistakes_name_the_key(recipe, overrides, message):
    path = recipe()
    assert message in error_of(path, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.lora_sync=adapter"], "rollout.lora_sync = 'adapter' hands the engines a LoRA policy's adapters, but "
                                    "model.lora is not set"),
    (["rollout.lora_sync=adapter", "model.lora.rank=8", "placement.mode=split", "placement.rollout_ranks=1"],
     "rollout.lora_sync = 'adapter' is for colocated placement"),
    (["rollout.lora_sync=adapters"], "rollout.lora_sync: "),
])
def test_adapter_sync_mistakes_name_the_key(recipe, overrides, message):
    assert message in error_of(recipe(), overrides)


@pytest.mark.parametrize("overrides, message", [
    (["optim.cpu_offload=1.5"], "optim.cpu_offload: must be in [0, 1] (a fraction of the optimizer state), got 1.5"),
    (["optim.cpu_offload=-0.5"], "optim.cpu_offload: must be in [0, 1]"),
    (["optim.cpu_offload=1", "optim.distributed=false"],
     "optim.cpu_offload: needs the distributed optimizer (optim.distributed: true)"),
    (["optim.cpu_offload=0.5"], "optim.cpu_offload = 0.5 needs a 16-bit model.dtype (bfloat16 or float16)"),
])
def test_optimizer_offload_mistakes_name_the_key(recipe, overrides, message):
    assert message in error_of(recipe(), overrides)


def test_optimizer_offload_loads_as_a_fraction_with_a_16_bit_model(recipe):
    optim = load_config(recipe(), ["optim.cpu_offload=1", "model.dtype=bfloat16"]).optim
    assert optim.cpu_offload == 1.0 and type(optim.cpu_offload) is float
    assert load_config(recipe()).optim.cpu_offload == 0.0  # off by default


def test_mis_band_loads_at_either_level_and_with_gspo_at_sequence_level(recipe):
    path = recipe()
    algo = load_config(path, ["algo.mis_low=0.5", "algo.mis_high=2.0"]).algo
    assert (algo.mis_low, algo.mis_high, algo.mis_level) == (0.5, 2.0, "token")
    assert load_config(path).algo.mis_low is None  # off by default
    algo = load_config(path, ["algo.name=gspo", "algo.loss_agg=seq-mean-token-mean", "algo.mis_low=0.5",
                              "algo.mis_high=2.0", "algo.mis_level=sequence"]).algo
    assert algo.mis_level == "sequence"


def test_yaml_syntax_error_names_file_and_line(recipe):
    path = recipe("rollout:\n  temperature: [0.5\n")
    message = error_of(path)
    assert message.startswith(f"{path}: line 7, column 1: invalid YAML:")
    assert "flow sequence that starts on line 6" in message


def test_key_given_twice_is_an_error_not_a_silent_overwrite(recipe):
    path = recipe("model:\n  path: model\n")
    assert error_of(path) == f"{path}: line 5, column 1: invalid YAML: duplicate key 'model'"


def test_missing_recipe_and_malformed_override(recipe, tmp_path):
    assert error_of(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: recipe file not found"
    path = recipe("seed: 0\n")
    assert error_of(path, ["train.steps"]) == f"{path}: override 'train.steps': expected key.path=value"
    assert error_of(path, ["seed.x=1"]) == f"{path}: override 'seed.x=1': seed: is 0 (int), not a section"


def test_overrides_set_nested_values_parsed_as_yaml(recipe):
    cfg = load_config(
        recipe("seed: 3\n"),
        ["optim.lr=1e-5", "rollout.n_samples=2", "model.megatron.recompute=[1, 2]", "data.eval_path=null",
         "log.tensorboard=true", "run_dir=runs/x"],
    )
    assert cfg.optim.lr == 1e-5 and cfg.rollout.n_samples == 2 and cfg.seed == 3
    assert cfg.model.megatron == {"recompute": [1, 2]}
    assert cfg.data.eval_path is None and cfg.log.tensorboard is True and cfg.run_dir == "runs/x"


def test_dump_and_load_round_trip(recipe, tmp_path):
    cfg = load_config(recipe(), ["optim.lr=1e-5", "model.megatron.num_layers=2", "data.eval_path=train.jsonl"])
    dump_config(cfg, tmp_path / "run" / "recipe.yaml")
    os.chdir(tmp_path / "run")  # the dumped paths are absolute, so they load from anywhere
    assert load_config("recipe.yaml") == cfg
    assert config_to_dict(cfg)["optim"]["lr"] == 1e-5


def test_config_is_frozen(recipe):
    cfg = load_config(recipe())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.temperature = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1
    assert isinstance(cfg, Config)


def test_import_pulls_in_no_heavy_backend():
    heavy = ["torch", "megatron", "sglang", "transformer_engine", "apex", "ray"]
    code = (
        "import sys, megarl.config\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- reward terms -----------------------------------------------------------------------------------------
def test_reward_terms_load_with_their_options(recipe):
    cfg = load_config(recipe(
        "reward:\n  workers: 2\n  terms:\n"
        "    - {kind: math, weight: 1.0}\n"
        "    - {kind: format, weight: 0.1, pattern: '<answer>.*</answer>'}\n"
        "    - {kind: length_penalty, weight: 0.5, max_tokens: 512, cache_tokens: 128}\n"
        "    - {kind: code, sandbox: {cpu_s: 2}}\n"
        "    - {kind: custom, function: 'my_rewards:score'}\n"))
    kinds = [t.kind for t in cfg.reward.terms]
    assert kinds == ["math", "format", "length_penalty", "code", "custom"] and cfg.reward.workers == 2
    assert cfg.reward.terms[3].sandbox.cpu_s == 2 and cfg.reward.terms[3].sandbox.wall_s == 10.0


def test_default_reward_is_one_exact_answer_term(recipe):
    [only] = load_config(recipe()).reward.terms
    assert only.kind == "exact_answer" and only.weight == 1.0


@pytest.mark.parametrize("body, message", [
    ("    - {kind: mth}\n",
     "reward.terms[0].kind: expected one of 'exact_answer', 'math', 'format', 'length_penalty', 'code', 'custom',"
     " 'reward_model', 'judge', got 'mth' (str) (did you mean 'math'?)"),
    ("    - {kind: math, wieght: 2}\n", "reward.terms[0].wieght: unknown key (did you mean 'weight'?)"),
    ("    - {kind: math}\n    - {kind: math, pattern: x}\n",
     "reward.terms[1].pattern: is not an option of kind 'math' (its options: weight)"),
    ("    - {kind: format}\n", "reward.terms[0].pattern: required for kind 'format'"),
    ("    - {kind: format, pattern: '(unclosed'}\n",
     "reward.terms[0].pattern: invalid regex: missing ), unterminated subpattern at position 0"),
    ("    - {kind: length_penalty, max_tokens: 10, cache_tokens: 20}\n",
     "reward.terms[0].cache_tokens: must be <= max_tokens=10, got 20"),
    ("    - {kind: custom, function: my_rewards.score}\n",
     "reward.terms[0].function: expected 'module:function', got 'my_rewards.score'"),
    ("    - {kind: code, sandbox: {cpu_seconds: 1}}\n",
     "reward.terms[0].sandbox.cpu_seconds: unknown key (did you mean 'cpu_s'?)"),
])
def test_reward_term_mistakes_name_the_key_and_file(recipe, body, message):
    path = recipe("reward:\n  terms:\n" + body)
    assert error_of(path) == f"{path}: {message}"


def test_unfinished_reward_is_off_by_default_and_must_be_a_finite_number(recipe):
    path = recipe()
    assert load_config(path).reward.unfinished is None
    assert load_config(path, ["reward.unfinished=-10"]).reward.unfinished == -10
    assert error_of(path, ["reward.unfinished=.nan"]) == (
        f"{path}: override 'reward.unfinished=.nan': reward.unfinished: must be a finite number or null, got nan")
    assert "reward.unfinished: expected" in error_of(path, ["reward.unfinished=low"])


def test_old_reward_kind_key_is_an_error_naming_it(recipe):
    path = recipe("reward:\n  kind: exact_answer\n")
    assert error_of(path).startswith(f"{path}: reward.kind: unknown key (")


def test_data_file_must_be_jsonl_or_parquet(recipe, tmp_path):
    (tmp_path / "train.csv").write_text("prompt,answer\n")
    path = recipe()
    assert error_of(path, ["data.train_path=train.csv"]) == (
        f"{path}: override 'data.train_path=train.csv': data.train_path: expected a .jsonl or .parquet file, "
        f"got {tmp_path / 'train.csv'}")


def test_sequence_packing_key_replaces_the_micro_batch_size_divisibility(recipe):
    path = recipe("rollout:\n  n_samples: 3\n")
    overrides = ["data.prompts_per_step=6", "train.micro_batch_size=4"]
    cfg = load_config(path, [*overrides, "train.micro_batch_tokens=4096"])
    assert cfg.train.micro_batch_tokens == 4096
    assert load_config(path, ["train.micro_batch_tokens=0"]).train.micro_batch_tokens == 0  # 0 = off
    assert error_of(path, ["train.micro_batch_tokens=-1"]).endswith(
        "train.micro_batch_tokens: must be >= 0, got -1")
    assert load_config(path, ["algo.name=sft", "train.micro_batch_tokens=4096"]).train.micro_batch_tokens == 4096
    assert error_of(path, ["algo.name=dpo", "train.micro_batch_tokens=4096"]) == (
        f"{path}: train.micro_batch_tokens (sequence packing) is for the RL and SFT loops; algo.name = 'dpo' uses "
        "train.micro_batch_size")
    assert error_of(path, ["algo.name=sft", "train.micro_batch_tokens=4096", "parallel.cp=2"]).endswith(
        "train.micro_batch_tokens (sequence packing) cannot be combined with parallel.cp = 2 (context "
        "parallelism); turn one of them off")


def test_learning_rate_warms_up_linearly_then_holds():
    from megarl.config import OptimConfig

    optim = OptimConfig(lr=1e-3, warmup_steps=4)
    assert [optim.lr_at(step) for step in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert OptimConfig(lr=1e-3).lr_at(0) == 1e-3  # no warmup: the full rate from the first step
