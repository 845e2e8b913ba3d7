"""The frontier's MoE architectures end to end: GLM-4.5 (sigmoid grouped routing with the expert bias, shared
experts, a dense first layer, partial RoPE, q/k norm) and DeepSeek-V3 (the same routing, multi-latent attention
with YaRN RoPE) each train a few GRPO steps through `megarl train` with routing replay (R3), the rollout engine's
logprobs match the trainer's after every push, and the final HF export loads in transformers with the trained
weights. Refusals of what megarl does not train name the config key.

Parity with transformers, name tables, round trips and layouts are in test_engine, test_layout, test_convert,
test_parallel and test_router_replay, parametrized over every architecture.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import run_python
from test_cli import read_metrics, write_recipe
from test_placement import ENGINE_RUN_TIMEOUT_S


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_logits_equal_transformers_within_1e_5(arch, arch_dir, groups):
    """fp32, one rank: the engine's logits and logprobs against transformers' on the same weights (measured: 1.2e-7
    and 4.8e-7 for both); 1e-5 leaves fp32 reordering room and no room for a wrong routing or RoPE convention,
    each of which moves them by more than 1e-3 (test_engine's wrong-convention tests)."""
    from test_engine import fixed_tokens, hf_logits, make_engine, token_logprobs

    engine = make_engine(arch_dir(arch), groups, train=False)
    tokens = fixed_tokens()
    reference = hf_logits(arch_dir(arch), tokens)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = engine.module(tokens, positions, None)[..., :reference.shape[-1]]
    assert (logits - reference).abs().max() <= 1e-5
    logprobs = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    assert (logprobs - token_logprobs(reference, tokens)).abs().max() <= 1e-5


@pytest.mark.timeout(2 * ENGINE_RUN_TIMEOUT_S)
@pytest.mark.parametrize("arch, nproc, overrides", [
    ("glm4_moe", 2, ("parallel.ep=2",)),
    ("deepseek_v3", 2, ("parallel.tp=2", "model.megatron.sequence_parallel=true")),
], ids=["glm4_moe-ep2", "deepseek_v3-tp2sp"])
def test_grpo_trains_and_exports_the_architecture(arch, nproc, overrides, arch_dir, arithmetic_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=arch_dir(arch), data_dir=arithmetic_dir,
                          run_dir=run_dir)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "megarl",
                       "train", str(recipe), "train.steps=3", "warmup.sft_steps=0", "algo.entropy_coef=0.1",
                       "optim.lr=1e-3", "algo.router_replay=r3", *overrides], timeout_s=ENGINE_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert math.isfinite(record["reward/mean"]) and record["grad_norm"] > 0, record
        assert record["rollout/logprob_diff_max"] <= 1e-4, record  # the push made the engine the trainer's policy
        assert 0.99 <= record["moe/routing_agreement"] <= 1.0, record
    export = run_dir / "checkpoints" / "final"  # the HF export of the trained policy
    exported, initial = load_file(str(export / "model.safetensors")), load_file(str(arch_dir(arch) / "model.safetensors"))
    assert set(exported) == set(initial)
    moved = {n for n in initial if not torch.equal(exported[n], initial[n])}
    assert "model.layers.1.mlp.gate.weight" in moved and "model.layers.0.mlp.gate_proj.weight" in moved
    # the expert bias is not trained (its update rate is 0)
    assert not any(n.endswith("e_score_correction_bias") for n in moved)
    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch, key, value, message", [
    ("deepseek_v3", "num_nextn_predict_layers", 1, "num_nextn_predict_layers = 1: multi-token-prediction layers"),
    ("deepseek_v3", "rope_interleave", False, "rope_interleave false is not supported"),
    ("glm4_moe", "norm_topk_prob", False, "norm_topk_prob false is not supported"),
    ("glm4_moe", "topk_group", 2, "num_experts_per_tok 2 / topk_group 2 must be 2"),
    ("deepseek_v3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0}, "rope type 'longrope'"),
])
def test_what_megarl_does_not_train_is_refused_naming_the_key(arch, key, value, message, arch_dir, tmp_path):
    from megarl.models.arch import read_shape

    model_dir = tmp_path / arch
    shutil.copytree(arch_dir(arch), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        read_shape(model_dir)
    assert str(model_dir / "config.json") in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("arch, recipe, message", [
    ("deepseek_v3", "train: {micro_batch_tokens: 256, share_prompts: true}\n",
     "train.share_prompts with multi-latent attention"),
    ("deepseek_v3", "parallel: {cp: 2}\n", "parallel.cp = 2 with multi-latent attention"),
    ("deepseek_v3", "model: {lora: {rank: 4, targets: [qkv, fc1]}}\n", "multi-latent attention .deepseek_v3. has no"),
    ("gpt_oss", "model: {lora: {rank: 4, targets: [qkv, fc1]}}\n", "experts are stacked in one HF tensor"),
    ("gpt_oss", "parallel: {tp: 2}\nmodel: {megatron: {sequence_parallel: true}}\n",
     r"parallel.tp = 2 \(parallel.etp unset: the experts split over the TP ranks\) with a gpt_oss model: Megatron "
     "takes biased experts at expert tensor-parallel size 1 only; set parallel.etp: 1"),
    ("gpt_oss", "parallel: {tp: 2, etp: 2}\nmodel: {megatron: {sequence_parallel: true}}\n",
     "parallel.etp = 2 with a gpt_oss model: Megatron takes biased experts at expert tensor-parallel size 1 only"),
], ids=["mla-shared-prompts", "mla-cp", "mla-lora-qkv", "gpt_oss-expert-lora", "gpt_oss-tp", "gpt_oss-etp2"])
def test_what_a_layout_or_option_cannot_train_is_refused_at_launch(arch, recipe, message, arch_dir, tmp_path):
    """Refused by the Job before any work, naming the recipe key: options whose math megarl does not keep for
    the architecture (its attention's own RoPE, stacked expert tensors, biased experts split over TP: parallel.etp
    1 keeps them whole under parallel.tp 2, test_parallel's gpt_oss-tp2etp1ep2sp)."""
    import yaml

    from megarl.config import RecipeError, load_config
    from megarl.job import Job

    sections = yaml.safe_load(recipe)
    sections.setdefault("model", {})["path"] = str(arch_dir(arch))
    sections["data"] = {"train_path": "unused.jsonl"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(sections))
    world = sections.get("parallel", {}).get("cp", 1) * sections.get("parallel", {}).get("tp", 1)
    with pytest.raises(RecipeError, match=message):
        Job.of(load_config(path, check_paths=False), world=world, ranks_per_node=world)


def test_biased_experts_take_tensor_parallelism_with_each_expert_whole(arch_dir, tmp_path):
    """gpt-oss at parallel.tp 2 with parallel.etp 1: the Job resolves it (test_parallel's gpt_oss-tp2etp1ep2sp trains
    it against one rank), each expert whole on one of the EP=2 ranks."""
    import yaml

    from megarl.config import load_config
    from megarl.job import Job

    path = tmp_path / "recipe.yaml"
    model = {"path": str(arch_dir("gpt_oss")), "megatron": {"sequence_parallel": True}}
    path.write_text(yaml.safe_dump({"model": model, "data": {"train_path": "unused.jsonl"},
                                    "parallel": {"tp": 2, "etp": 1, "ep": 2}}))
    layout = Job.of(load_config(path, check_paths=False), world=2, ranks_per_node=2).layout
    assert (layout.tp, layout.etp, layout.ep, layout.dp, layout.expert_dp) == (2, 1, 2, 1, 1)
