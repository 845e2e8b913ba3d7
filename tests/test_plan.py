"""`megarl plan`: every shipped GPU recipe (and the 7B SFT and DPO recipes) fits the cluster its header names,
with the exact command the header gives, GPU and host memory both; broken layouts exit 2 naming which number
does not divide which; a plan that does not fit exits 1 with the reason; SFT and DPO are planned with the
models their loops build and no rollout engine, multi-turn recipes with env.max_tokens; SGLang's KV cache is
sized as SGLang sizes it; a split placement lays the trainer out on the training world and plans its GPUs
and the rollout GPUs apart, both of which must fit; overrides are taken before or after the flags; and the
estimate of parameters, gradients and optimizer state equals what a real TrainEngine allocates for the tiny
models (differences below are each explained and bounded).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.timeout(120)

GPU_RECIPES = sorted((REPO / "recipes" / "gpu").glob("*.yaml"))
# recipes outside recipes/gpu/ whose header names a cluster and its `megarl plan` command
CHECKED_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if "Check:" in p.read_text())
OFFLINE_RECIPES = [REPO / "recipes" / "sft_7b.yaml", REPO / "recipes" / "dpo_7b.yaml"]
CONFIGS = REPO / "recipes" / "gpu" / "configs"


def header_command(recipe: Path) -> list[str]:
    """The `megarl plan ...` command of a recipe's `Check:` header line, as arguments after `megarl`."""
    line = next(ln for ln in recipe.read_text().splitlines() if ln.startswith("#") and "Check:" in ln)
    words = shlex.split(line.split("Check:", 1)[1])
    assert words[:2] == ["megarl", "plan"], line
    return words[1:]


def megarl(args: list[str], capsys) -> tuple[int, str, str]:
    """`megarl ARGS` in this process (planning imports no heavy backend): (exit code, stdout, stderr)."""
    from megarl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def plan_args(name: str, model: str, nodes: int, *overrides: str, gpu_mem_gb: float = 80) -> list[str]:
    return ["plan", str(REPO / "recipes" / "gpu" / f"{name}.yaml"), *overrides, "--nodes", str(nodes),
            "--gpus-per-node", "8", "--gpu-mem-gb", str(gpu_mem_gb),
            "--model-config", str(CONFIGS / model / "config.json")]


# ---- shipped recipes -----------------------------------------------------------------------------------------
def test_every_issue_target_has_a_recipe():
    names = {p.stem for p in GPU_RECIPES}
    assert names == {"qwen2.5-7b-grpo-gsm8k", "llama-3.3-70b-grpo", "llama-3.3-70b-ppo", "qwen3-30b-a3b-dapo",
                     "qwen3-235b-a22b-grpo", "qwen2.5-7b-grpo-gsm8k-async",  # placement split
                     "glm-4.5-grpo", "gpt-oss-120b-grpo",  # sigmoid-routed MoE; sinks and sliding windows
                     "deepseek-v3-grpo", "kimi-k2-grpo",  # MLA; engines over whole nodes
                     "gpt-oss-120b-grpo-1node",  # optim.cpu_offload: the 117B on one node
                     "llama-3.3-70b-lora-grpo",  # LoRA: the 70B on 2 nodes, adapters alone to SGLang
                     # a 7B-class recipe per policy-gradient algorithm (SFT and DPO: recipes/sft_7b.yaml, dpo_7b.yaml)
                     *(f"qwen2.5-7b-{a}-gsm8k" for a in ("ppo", "dr-grpo", "dapo", "gspo", "reinforce-pp", "rloo"))}


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_shipped_recipe_fits_the_cluster_its_header_names(recipe, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the header's paths are relative to the repository
    args = header_command(recipe)
    code, out, err = megarl(args, capsys)
    assert code == 0, out + err
    assert "fits: yes" in out and "DOES NOT FIT" not in out
    code, out, err = megarl([*args, "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["fits"] and result["problems"] == []
    assert result["peak_gib"] <= result["usable_gib"]
    assert result["rollout"]["samples"] >= 1
    assert 0 < result["host"]["per_node"] <= result["host"]["limit"]
    # every GPU generates (placement split: every rollout GPU): engines x GPUs per engine = those GPUs
    generating = result["layout"]["rollout_ranks"] or result["cluster"]["nodes"] * 8
    assert result["rollout"]["engines"] * result["rollout"]["gpus"] == generating
    # The cluster in the header comment is the one the command plans.
    nodes, gpus = int(args[args.index("--nodes") + 1]), int(args[args.index("--gpus-per-node") + 1])
    assert re.search(rf"\b{nodes} nodes? x {gpus} H", recipe.read_text().splitlines()[0])


@pytest.mark.parametrize("recipe", CHECKED_RECIPES, ids=lambda p: p.stem)
def test_7b_recipe_fits_the_node_its_header_names(recipe, capsys, monkeypatch):
    assert {p.stem for p in CHECKED_RECIPES} == {"sft_7b", "dpo_7b", "agent_python_7b"}
    monkeypatch.chdir(REPO)
    code, out, err = megarl([*header_command(recipe), "--json"], capsys)
    result = json.loads(out)
    assert code == 0 and result["fits"] and result["problems"] == [], out + err
    header = re.sub(r"\s*#\s*", " ", recipe.read_text().split("Check:", 1)[0])
    assert re.search(r"one node of 8 H(100|200)", header)  # the cluster the command plans


def test_docs_table_gives_the_planned_engines_and_kv_cache(capsys, monkeypatch):
    """The table of GPU recipes in docs/parallelism.md states each one's rollout engines and KV cache per GPU as
    planned."""
    monkeypatch.chdir(REPO)
    rows = re.findall(r"^\| `([\w.-]+)` \|.*\| (\d+) x (\d+) GPUs \| ([\d.]+) GiB \|$",
                      (REPO / "docs" / "parallelism.md").read_text(), flags=re.M)
    assert {name for name, *_ in rows} == {"qwen2.5-7b-grpo-gsm8k", "llama-3.3-70b-grpo", "llama-3.3-70b-ppo",
                                           "llama-3.3-70b-lora-grpo", "qwen3-30b-a3b-dapo", "qwen3-235b-a22b-grpo",
                                           "glm-4.5-grpo", "gpt-oss-120b-grpo", "gpt-oss-120b-grpo-1node",
                                           "deepseek-v3-grpo", "kimi-k2-grpo"}
    for name, engines, gpus, kv_gib in rows:
        _, out, _ = megarl([*header_command(REPO / "recipes" / "gpu" / f"{name}.yaml"), "--json"], capsys)
        rollout = json.loads(out)["rollout"]
        assert (rollout["engines"], rollout["gpus"]) == (int(engines), int(gpus)), name
        assert f"{rollout['kv_bytes'] / 2**30:.1f}" == kv_gib, name


def test_readme_scale_table_is_what_the_plan_gives(capsys, monkeypatch):
    """Each row of the README's table of large-model clusters: the recipe's header command on that many nodes of that
    GPU, with the row's overrides, fits, with the row's engines and peak."""
    monkeypatch.chdir(REPO)
    rows = re.findall(r"^\| `([\w.-]+)` \| [^|]+ \| (\d+) x (H100|H200) \| (?:`([^`]*)`|\(the recipe\)) \| "
                      r"(\d+) x (\d+) GPUs \| ([\d.]+) GiB \|$", (REPO / "README.md").read_text(), flags=re.M)
    assert len(rows) >= 19 and {row[0] for row in rows} >= {"deepseek-v3-grpo", "kimi-k2-grpo"}
    for recipe, nodes, gpu, overrides, engines, gpus, peak in rows:
        args = header_command(REPO / "recipes" / "gpu" / f"{recipe}.yaml")
        args[args.index("--nodes") + 1] = nodes
        args[args.index("--gpu-mem-gb") + 1] = {"H200": "140", "H100": "80"}[gpu]
        code, out, err = megarl([*args, *overrides.split(), "--json"], capsys)
        result = json.loads(out)
        assert code == 0 and result["fits"], (recipe, nodes, gpu, result["problems"])
        assert (result["rollout"]["engines"], result["rollout"]["gpus"]) == (int(engines), int(gpus)), recipe
        assert f"{result['peak_gib']:.1f}" == peak, (recipe, nodes, gpu)


def test_shipped_recipes_stop_on_placeholder_paths_but_load_for_planning():
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    for recipe in GPU_RECIPES:
        with pytest.raises(ConfigError, match=r"model.path: directory not found: /SET-ME/"):
            load_config(recipe)
        cfg = load_config(recipe, check_paths=False)
        assert cfg.model.path.startswith("/SET-ME/") and cfg.data.train_path.startswith("/SET-ME/")


# ---- the weight push's calls into SGLang ------------------------------------------------------------------------
# Every handoff bucket is one `update_weights_from_tensor` call into SGLang: a request through its tokenizer
# manager, a barrier over the engine's TP ranks and a CUDA IPC open per rank, tens of ms each. A push of
# at most this many calls spends well under a minute on them, however large the model.
MAX_PUSH_CALLS = 1000
SGLANG_RECIPES = [p for p in (*GPU_RECIPES, *CHECKED_RECIPES) if "engine: sglang" in p.read_text()]


def hf_tensor_elements(shape) -> list[int]:
    """Elements of every HF tensor a weight push sends (tied embeddings once), layer by layer in the order
    megarl.engine.hf_weights gathers them."""
    h, d, e, f = shape.hidden, shape.head_dim, shape.experts, shape.moe_ffn
    out = [shape.vocab_size * h]
    for layer in range(shape.layers):
        out += [h]  # input norm
        if shape.mla:  # q down, its norm, q up; kv down, its norm, kv up; o
            q_lora, kv_lora = shape.q_lora_rank, shape.kv_lora_rank
            out += [q_lora * h, q_lora, shape.heads * d * q_lora, (kv_lora + shape.qk_rope_dim) * h, kv_lora,
                    shape.heads * (shape.qk_nope_dim + shape.v_head_dim) * kv_lora, h * shape.heads * shape.v_head_dim]
        else:
            out += [shape.heads * d * h, shape.kv_heads * d * h, shape.kv_heads * d * h]  # q, k, v
            if shape.qkv_bias:
                out += [shape.heads * d, shape.kv_heads * d, shape.kv_heads * d]
            out += [h * shape.heads * d] + ([d, d] if shape.qk_norm else [])  # o, q/k norms
            out += [h, shape.heads] if shape.attention_sinks else []  # o bias, sinks (gpt-oss)
        out += [h]  # post-attention norm
        if not shape.is_moe_layer(layer):
            out += [shape.ffn * h] * 3
        elif shape.linear_bias:  # gpt-oss: router and its bias; each layer's experts stacked, with biases
            out += [e * h, e, e * h * 2 * f, e * 2 * f, e * f * h, e * h]
        else:
            out += [e * h] + ([e] if shape.expert_bias else [])  # router (and its expert bias)
            out += [f * h] * 2 * e + [h * f] * e  # gate, up; down
            if shape.shared_ffn:  # shared gate, up, down (and its gate)
                out += [shape.shared_ffn * h] * 3 + ([h] if shape.shared_gate else [])
    return out + [h] + ([] if shape.tied_embeddings else [shape.vocab_size * h])


@pytest.mark.parametrize("recipe", SGLANG_RECIPES, ids=lambda p: p.stem)
def test_a_push_into_sglang_takes_a_bounded_number_of_calls(recipe):
    """Every recipe that generates with SGLang on GPUs pushes its weights in buckets of at least 512 MiB, and in
    at most MAX_PUSH_CALLS buckets (counted by the handoff's own bucketing over the model's HF tensors): 30 for
    7B, 322 for 70B, 888 for the 235B MoE. At the 64 MiB default they were 115, 643 and 7,523."""
    import torch

    from megarl.config import load_config
    from megarl.handoff import buckets
    from megarl.plan import DTYPE_BYTES, read_model, stage_params

    cfg = load_config(recipe, check_paths=False)
    args = header_command(recipe)
    shape = read_model(REPO / args[args.index("--model-config") + 1])
    elements = hf_tensor_elements(shape)
    # the same parameters as the plan counts for one unsplit copy of the model
    assert sum(elements) == stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
    dtype = {2: torch.bfloat16, 4: torch.float32}[DTYPE_BYTES[cfg.model.dtype]]
    tensors = [(str(i), torch.empty(n, dtype=dtype, device="meta")) for i, n in enumerate(elements)]
    assert cfg.rollout.bucket_bytes >= 512 * 2**20
    calls = sum(1 for _ in buckets(tensors, bucket_bytes=cfg.rollout.bucket_bytes))
    assert calls <= MAX_PUSH_CALLS, (calls, sum(elements))


@pytest.mark.parametrize("model,total,active", [
    # Totals of the published bf16 checkpoints (safetensors index total_size / 2); active = dense + top-k of
    # the experts, the "A3B"/"A22B" of the names.
    ("qwen2.5-7b", 7_615_616_512, None),
    ("llama-3.3-70b", 70_553_706_496, None),
    ("qwen3-30b-a3b", 30_532_122_624, 3.35e9),
    ("qwen3-235b-a22b", 235_093_634_560, 22.19e9),
])
def test_shipped_configs_have_the_published_parameter_counts(model, total, active):
    from megarl.plan import read_model, stage_params

    shape = read_model(CONFIGS / model / "config.json")
    counts = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size)
    assert counts.total == total
    if active is not None:
        assert abs(counts.dense + counts.expert * shape.topk // shape.experts - active) < 0.01e9


@pytest.mark.parametrize("model,total,active", [
    # The model cards' rounded figures: DeepSeek-V3 671B in the main model (its 14B MTP module excluded, as megarl
    # excludes it), 37B active; gpt-oss-120b 116.83B, 5.13B active without its 0.58B embedding table; Kimi-K2 32B
    # activated. Totals within 0.5%, actives within 5% (the cards round to whole billions and do not say which
    # embeddings they count; GLM-4.5's card counts its MTP layer, which megarl drops, so it is not compared).
    ("deepseek-v3", 671e9, 37e9),
    ("gpt-oss-120b", 116.83e9, 5.13e9 + 201088 * 2880),
    ("kimi-k2", None, 32e9),
])
def test_frontier_configs_have_the_published_sizes(model, total, active):
    """Multi-latent attention, dense first layers, shared experts, biases and sinks counted as the models have
    them: the plan's parameter count is the published size."""
    from megarl.plan import read_model, stage_params

    shape = read_model(CONFIGS / model / "config.json")
    counts = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size)
    if total is not None:
        assert abs(counts.total - total) <= 0.005 * total
    assert abs(counts.dense + counts.expert * shape.topk // shape.experts - active) <= 0.05 * active


def test_plan_counts_every_tensor_of_every_architecture(arch_dir):
    """The parameters the plan counts are the checkpoint's, tensor by tensor, for every architecture."""
    from safetensors.torch import load_file

    from megarl.models.arch import read_shape
    from megarl.plan import stage_params

    for arch in ("qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
                 "gpt_oss", "gemma3"):
        shape = read_shape(arch_dir(arch))
        tensors = load_file(str(arch_dir(arch) / "model.safetensors"))
        counted = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
        assert counted == sum(t.numel() for t in tensors.values()), arch


def test_plan_imports_no_torch_megatron_or_sglang():
    code = ("import sys, megarl.cli, megarl.plan\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'sglang')))")
    result = run_python(["-c", code], timeout_s=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# ---- broken layouts: exit 2 and the message names both numbers ------------------------------------------------
SEVEN_B = ("qwen2.5-7b-grpo-gsm8k", "qwen2.5-7b", 1)
LLAMA = ("llama-3.3-70b-grpo", "llama-3.3-70b", 8)
MOE30 = ("qwen3-30b-a3b-dapo", "qwen3-30b-a3b", 2)
MOE235 = ("qwen3-235b-a22b-grpo", "qwen3-235b-a22b", 16)


@pytest.mark.parametrize("target,overrides,message", [
    (SEVEN_B, ["parallel.tp=3"], "world size 8 is not divisible by parallel.tp * parallel.pp * parallel.cp = 3"),
    (SEVEN_B, ["parallel.tp=8", "rollout.tp=4"], "attention heads 28 is not divisible by parallel.tp = 8"),
    (LLAMA, ["parallel.tp=16", "parallel.pp=1"],
     "key/value heads (query groups) 8 is not divisible by parallel.tp = 16"),
    (MOE235, ["parallel.pp=4", "parallel.ep=8"], "layers 94 is not divisible by parallel.pp = 4"),
    (LLAMA, ["model.megatron.virtual_pipeline_model_parallel_size=3"],
     "layers 80 is not divisible by parallel.pp * model.megatron.virtual_pipeline_model_parallel_size = 2 * 3 = 6"),
    (LLAMA, ["model.megatron.num_layers_per_virtual_pipeline_stage=10"],
     "num_layers_per_virtual_pipeline_stage is not a TransformerConfig field: set "
     "virtual_pipeline_model_parallel_size (= layers / (pp * 10) = 4)"),
    (MOE30, ["parallel.ep=3"], "experts 128 is not divisible by parallel.ep = 3"),
    (MOE30, ["parallel.ep=16"], "world size 16 is not divisible by parallel.tp * parallel.ep * parallel.pp = 32"),
    (SEVEN_B, ["parallel.ep=2"], "parallel.ep = 2 needs a mixture-of-experts model; qwen2 has no experts"),
    (SEVEN_B, ["data.prompts_per_step=6"], "data.prompts_per_step 6 is not divisible by the data-parallel size 4"),
    (SEVEN_B, ["train.micro_batch_size=256"], "samples per data-parallel rank 128 (data.prompts_per_step / 4 * "
                                            "rollout.n_samples) is not divisible by train.micro_batch_size = 256"),
    # engines sit on every group of rollout.tp GPUs, whatever the trainer's tp * cp (here 2, then 4)
    (SEVEN_B, ["rollout.tp=4"], None),
    (SEVEN_B, ["rollout.tp=4", "parallel.cp=2"], None),
    (SEVEN_B, ["parallel.cp=2", "train.micro_batch_tokens=4096"],
     "train.micro_batch_tokens (sequence packing) cannot be combined with parallel.cp = 2"),
    (LLAMA, ["rollout.tp=16"], None),  # an engine on two whole nodes
    (LLAMA, ["rollout.tp=12"], "attention heads 64 is not divisible by rollout.tp = 12"),
    (SEVEN_B, ["rollout.tp=7"], "key/value heads 4 and rollout.tp = 7: neither divides the other"),
    (MOE30, ["rollout.tp=4", "parallel.tp=4", "parallel.ep=4"], None),  # a valid variation: no error
    (SEVEN_B, ["rollout.tpp=2"], "rollout.tpp: unknown key (did you mean 'tp'?)"),
])
def test_broken_layout_exits_2_naming_the_numbers(target, overrides, message, capsys):
    name, model, nodes = target
    code, out, err = megarl(plan_args(name, model, nodes, *overrides), capsys)
    if message is None:
        assert code == 0, out + err
        return
    assert code == 2, out + err
    assert message in err
    assert err.startswith("megarl: plan error: ") and out == ""


def test_missing_model_config_exits_2_and_says_how_to_plan(capsys):
    recipe = REPO / "recipes" / "gpu" / "llama-3.3-70b-grpo.yaml"
    code, _, err = megarl(["plan", str(recipe), "--nodes", "8", "--gpus-per-node", "8"], capsys)
    assert code == 2
    assert "model.path: no config.json at /SET-ME/Llama-3.3-70B-Instruct/config.json" in err
    assert "--model-config" in err


# ---- does not fit: exit 1 -----------------------------------------------------------------------------------
def test_too_little_memory_exits_1_and_names_the_phase(capsys):
    # 235B on 80 GiB GPUs: a 4-GPU rollout engine's bf16 weights (110 GiB per GPU) leave no KV cache.
    code, out, _ = megarl(plan_args(*MOE235, "rollout.tp=4", gpu_mem_gb=80), capsys)
    assert code == 1
    assert "the KV cache holds no full-length sample" in out
    assert "fits: no" in out
    # 70B PPO with PP=2: actor, critic and reference states alone exceed 76 GiB in the train phase.
    code, out, _ = megarl(plan_args("llama-3.3-70b-ppo", "llama-3.3-70b", 8, "parallel.pp=2"), capsys)
    assert code == 1
    assert re.search(r"train\s+[\d.]+\s+DOES NOT FIT", out) and "fits: no" in out
    assert "raise rollout.mem_fraction or rollout.tp" in megarl(plan_args(*MOE235, "rollout.tp=4", gpu_mem_gb=80),
                                                                 capsys)[1]


def test_a_model_larger_than_a_node_takes_an_engine_over_whole_nodes(capsys):
    """DeepSeek-V3 at bf16 on 32 H200 nodes (TP8 x EP32): a rollout engine on one node holds 156 GiB of weights per
    GPU and no KV cache; the plan names the rollout.tp that halves it, and at that rollout.tp (an engine over two
    whole nodes) the run fits, each GPU holding half the weights of one node's engine."""
    deepseek = ("glm-4.5-grpo", "deepseek-v3", 32)
    layout = ["parallel.pp=1", "parallel.tp=8", "parallel.ep=32"]
    code, out, _ = megarl(plan_args(*deepseek, *layout, "rollout.tp=8", gpu_mem_gb=140), capsys)
    one_node = float(re.search(r"weights ([\d.]+) GiB/GPU", out).group(1))
    assert code == 1 and re.search(r"train\s+[\d.]+\s+ok", out)
    assert f"raise rollout.mem_fraction or rollout.tp (rollout.tp = 16: {one_node / 2:.1f} GiB of weights per GPU)" in out
    code, out, _ = megarl(plan_args(*deepseek, *layout, "rollout.tp=16", gpu_mem_gb=140), capsys)
    assert code == 0 and "fits: yes" in out
    assert f"16 sglang engine(s) x 16 GPU(s); weights {one_node / 2:.1f} GiB/GPU" in out


def test_pipeline_and_expert_sharding_divide_the_model_state():
    """The per-GPU numbers scale as the layout says: PP halves the layers, EP the experts, and the
    distributed optimizer divides optimizer state by the data-parallel sizes."""
    from megarl.plan import read_model, stage_params

    shape = read_model(CONFIGS / "qwen3-30b-a3b" / "config.json")
    one = stage_params(shape, tp=1, pp=1, ep=1, stage=0)
    ep8 = stage_params(shape, tp=1, pp=1, ep=8, stage=0)
    assert ep8.expert * 8 == one.expert and ep8.dense == one.dense
    shape = read_model(CONFIGS / "llama-3.3-70b" / "config.json")
    full = stage_params(shape, tp=8, pp=1, ep=1, stage=0)
    first, last = (stage_params(shape, tp=8, pp=2, ep=1, stage=s) for s in (0, 1))
    assert first.total + last.total == full.total  # the same tensors, split in two


def test_expert_tensor_parallelism_splits_the_experts_by_etp_and_their_state_by_expert_dp(capsys):
    """parallel.etp 1 under TP 4: attention and the shared parts split over TP as before, each expert whole, so a
    GPU at the same ep holds 4 times the expert parameters; over 4 times the ranks (ep 128) it holds the same, and
    the expert data-parallel size is world / (etp * ep * pp) either way, which divides the experts' optimizer
    state (the test of the count against a real engine at ETP 1 is test_parallel's)."""
    from megarl.plan import read_model, stage_params

    shape = read_model(CONFIGS / "qwen3-235b-a22b" / "config.json")
    by_tp = stage_params(shape, tp=4, pp=1, ep=32, stage=0)
    whole = stage_params(shape, tp=4, pp=1, ep=32, etp=1, stage=0)
    assert whole.dense == by_tp.dense and whole.expert == 4 * by_tp.expert
    assert stage_params(shape, tp=4, pp=1, ep=128, etp=1, stage=0) == by_tp
    layouts = {}
    for overrides in ([], ["parallel.etp=1"], ["parallel.etp=1", "parallel.ep=128"]):
        code, out, err = megarl(plan_args(*MOE235, *overrides, "--json", gpu_mem_gb=140), capsys)
        assert code in (0, 1), out + err
        result = json.loads(out)
        layouts[tuple(overrides)] = (result["layout"]["etp"], result["layout"]["expert_dp"],
                                     result["models"][0]["optim"])
    (etp4, dp4, optim4), (etp1, dp1, optim1), (etp1_ep128, dp1_ep128, optim_ep128) = layouts.values()
    assert (etp4, dp4) == (4, 1) and (etp1, dp1) == (1, 4) and (etp1_ep128, dp1_ep128) == (1, 1)
    assert optim1 == optim4 and optim_ep128 == optim4  # 4x the experts over 4x the ranks; the same experts
    code, out, _ = megarl(plan_args(*MOE235, "parallel.etp=1", gpu_mem_gb=140), capsys)
    assert "experts: etp 1 x ep 32 x pp 1 x expert-dp 4" in out


# ---- the estimate against a real TrainEngine -------------------------------------------------------------------
def measured_state(engine) -> dict[str, int]:
    """Bytes a built, once-stepped TrainEngine really holds: parameters, DDP gradient buffers, and the
    optimizer's fp32 master shards (storage not shared with the model's parameters) plus Adam moments."""
    import torch

    buffers = engine.model.buffers + engine.model.expert_parallel_buffers
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    model_storage = {b.param_data.untyped_storage().data_ptr() for b in buffers}
    optim = 0
    for opt in engine.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storage:
                    optim += p.numel() * p.element_size()
                optim += sum(v.numel() * v.element_size() for v in opt.optimizer.state[p].values()
                             if torch.is_tensor(v) and v.dim() > 0)
    return {"params": params, "grads": grads, "optim": optim, "tensors": sum(1 for _ in engine.module.parameters()),
            "buckets": sum(len(b.buckets) for b in buffers)}


def one_train_step(engine) -> None:
    """Adam allocates its moments on the first step."""
    import torch

    tokens = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))

    def loss_fn(logprobs, mb):
        loss = -logprobs.sum() / logprobs.numel()
        return loss, {"loss": loss.detach()}

    engine.train_step(tokens, {}, loss_fn, temperature=1.0, micro_batch_size=2)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_estimate_equals_measured_memory_of_the_tiny_model(arch, dtype, request, groups, tmp_path):
    from megarl.config import OptimConfig, load_config
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.plan import Cluster, plan, read_model

    model_dir = request.getfixturevalue(f"{arch}_dir")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"model:\n  path: {model_dir}\n  dtype: {dtype}\ndata:\n  train_path: unused.jsonl\n"
                      "  prompts_per_step: 1\nrollout:\n  n_samples: 2\ntrain:\n  micro_batch_size: 2\n")
    cfg = load_config(recipe, check_paths=False)
    shape = read_model(Path(model_dir) / "config.json")
    actor = plan(cfg, shape, Cluster(nodes=1, gpus_per_node=1)).models[0]

    engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, megatron={}, groups=groups,
                         optim=OptimConfig(lr=1e-3, distributed=cfg.optim.distributed))
    one_train_step(engine)
    real = measured_state(engine)
    n_params = sum(p.numel() for p in engine.module.parameters())
    assert actor.params == n_params * (4 if dtype == "float32" else 2)  # the count itself is exact

    # Megatron's CPU layer spec (no Transformer Engine) keeps RMSNorm weights in fp32 whatever params_dtype
    # says; on GPU, TE's fused norms are bf16 like the estimate. Those weights cost 2 more bytes each as
    # parameters and need no fp32 master copy (4 bytes fewer in the optimizer).
    fp32_norms = sum(p.numel() for n, p in engine.module.named_parameters()
                     if dtype != "float32" and p.dtype.itemsize == 4)
    if fp32_norms:
        assert all("layernorm" in n for n, p in engine.module.named_parameters() if p.dtype.itemsize == 4)
    assert real["params"] == actor.params + 2 * fp32_norms
    assert real["optim"] == actor.optim - 4 * fp32_norms

    # Gradients: DDP's fp32 buffer pads each parameter's start to 64 elements and each bucket's end to
    # lcm(dp, 128) for the distributed optimizer; the estimate counts the parameters only.
    padding_bound = 4 * (63 * real["tensors"] + 127 * real["buckets"])
    assert 0 <= real["grads"] - actor.grads <= padding_bound
    print(f"{arch} {dtype}: params {real['params']} measured / {actor.params} estimated bytes; grads "
          f"{real['grads']} / {actor.grads}; optimizer {real['optim']} / {actor.optim}")


@pytest.mark.parametrize("target,overrides,engines", [
    (LLAMA, [], 8),                        # pp = 2: both pipeline stages' GPUs generate (64 GPUs / rollout.tp 8)
    (LLAMA, ["rollout.tp=4"], 16),
    (SEVEN_B, ["rollout.tp=1"], 8),        # trainer tp = 2: every GPU runs its own engine
    (MOE30, [], 8),
])
def test_every_gpu_belongs_to_a_rollout_engine(target, overrides, engines, capsys):
    name, model, nodes = target
    code, out, err = megarl(plan_args(name, model, nodes, *overrides, "--json"), capsys)
    assert code in (0, 1), out + err
    rollout = json.loads(out)["rollout"]
    assert rollout["engines"] == engines and rollout["engines"] * rollout["gpus"] == nodes * 8


# ---- SGLang's KV cache, as SGLang sizes it ----------------------------------------------------------------------
@pytest.mark.parametrize("gpu_mem_gb,fraction", [(80, 0.7), (80, 0.5), (140, 0.88)])
def test_sglang_pool_is_mem_fraction_of_the_memory_free_when_the_engine_starts(gpu_mem_gb, fraction, capsys):
    """SGLang's KV budget is free-after-weights - free-before * (1 - f) = f * free-before - weights, with
    free-before the GPU less the contexts: the engines start before the trainer builds its models."""
    from megarl.plan import ENGINE_START_USED_GIB, GIB

    code, out, err = megarl(plan_args(*SEVEN_B, f"rollout.mem_fraction={fraction}", "--json",
                                      gpu_mem_gb=gpu_mem_gb), capsys)
    assert code in (0, 1), out + err
    r = json.loads(out)["rollout"]
    free_at_start = (gpu_mem_gb - ENGINE_START_USED_GIB) * GIB
    assert r["kv_bytes"] + r["weights"] == r["static"] == int(fraction * free_at_start)
    assert r["static"] < fraction * gpu_mem_gb * GIB
    assert r["weights"] == 7_615_616_512 * 2 // 2  # bf16 Qwen2.5-7B over rollout.tp = 2 GPUs


def test_every_pipeline_stage_plans_a_rollout_engine_and_its_weight_push(capsys):
    """The last pipeline stage's GPUs hold engines too. One micro-batch per step keeps a single micro-batch in
    flight on the first stage, so the last stage (output layer, logprob head) is the fullest one the plan
    reports: its push and rollout phases hold the engine's weights and pool."""
    from megarl.plan import GIB, RESERVE_GIB

    overrides = ["data.prompts_per_step=4", "train.micro_batch_size=8", "rollout.mem_fraction=0.6", "--json"]
    code, out, _ = megarl(plan_args(*LLAMA, *overrides), capsys)
    result = json.loads(out)
    assert code == 0 and (result["layout"]["pp"], result["stage"], result["layout"]["micro_batches"]) == (2, 1, 1)
    rollout, phases = result["rollout"], result["phases_gib"]
    assert phases["rollout"] * GIB == rollout["static"] + RESERVE_GIB * GIB
    params = sum(m["params"] for m in result["models"])
    assert phases["push"] * GIB > params + rollout["weights"] + RESERVE_GIB * GIB


# ---- SFT and DPO: no rollout engine; DPO's frozen reference ----------------------------------------------------
@pytest.mark.parametrize("recipe", OFFLINE_RECIPES, ids=lambda p: p.stem)
def test_sft_and_dpo_are_planned_without_a_rollout_engine(recipe, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    args = header_command(recipe)
    code, out, err = megarl(args, capsys)
    assert code == 0, out + err
    assert "rollout: none" in out and "fits: yes" in out and "push" not in out.split("assumptions:")[0]
    code, out, _ = megarl([*args, "--json"], capsys)
    result = json.loads(out)
    assert result["rollout"] is None and result["layout"]["rollout_engines"] == []
    assert list(result["phases_gib"]) == ["train"]
    assert result["host"]["params"] == result["host"]["optim"] == 0  # nothing is offloaded
    models = {m["name"]: m for m in result["models"]}
    if recipe.stem == "sft_7b":
        assert list(models) == ["actor"]
        assert result["layout"]["micro_batches"] == 128 // 4 // 2  # rows / dp / micro_batch_size
    else:
        assert list(models) == ["actor", "reference"]
        ref, actor = models["reference"], models["actor"]
        assert ref["params"] == actor["params"] and ref["grads"] == ref["optim"] == ref["activations"] == 0
        assert result["layout"]["micro_batches"] == 64 // 2 * 2 // 2  # pairs / dp * 2 sequences / micro
    assert result["layout"]["seq_len"] == 4096


def plan_json(args: list[str], capsys) -> dict:
    code, out, err = megarl([*args, "--json"], capsys)
    assert code in (0, 1), out + err  # fits or not: only the figures matter
    return json.loads(out)


def optimizer_elements(config_json: Path, *, tp: int = 1, pp: int, ep: int, dp: int, expert_dp: int) -> list[int]:
    """Each pipeline stage's optimizer elements on one GPU: its parameters as Megatron's GPTModel holds them
    (megarl.plan.stage_params, checked against a real engine below), sharded by the distributed optimizer."""
    from megarl.models.arch import read_shape
    from megarl.plan import stage_params

    shape = read_shape(str(config_json.parent))
    counts = [stage_params(shape, tp=tp, pp=pp, ep=ep, stage=s) for s in range(pp)]
    return [-(-c.dense // dp) + -(-c.expert // expert_dp) for c in counts]


def test_optimizer_offload_moves_its_share_of_adam_from_the_gpus_to_the_host(capsys):
    """optim.cpu_offload f keeps f of each GPU's optimizer elements on the host, their moments and master copy
    (12 bytes each) and a copy of their gradients (4): the GPU's optimizer state, and every phase that holds it,
    is lighter by exactly 12 bytes per offloaded element, and the host carries 16 (an RL run moved the 12 there
    while generating before, so its node gains the 4 of the gradient copy; SFT offloaded nothing before)."""
    from megarl.plan import GIB

    half = 0.5
    args = plan_args("gpt-oss-120b-grpo-1node", "gpt-oss-120b", 1, "parallel.pp=2", "parallel.ep=4",
                     gpu_mem_gb=140)
    resident, offloaded = (plan_json([*args, f"optim.cpu_offload={f}"], capsys) for f in (0, half))
    elements = optimizer_elements(CONFIGS / "gpt-oss-120b" / "config.json", pp=2, ep=4, dp=4, expert_dp=1)
    on_host = [int(half * n) for n in elements]
    stage = resident["stage"]
    assert offloaded["stage"] == stage == 1  # the stage with the output layer and the logprob head
    before, after = resident["models"][0], offloaded["models"][0]
    assert before["optim"] == 12 * elements[stage] and before["host_optim"] == 0
    assert after["optim"] == 12 * (elements[stage] - on_host[stage])
    assert after["host_optim"] == 16 * on_host[stage]
    assert (before["params"], before["grads"], before["activations"]) == (
        after["params"], after["grads"], after["activations"])
    moved = 12 * on_host[stage] / GIB
    assert resident["phases_gib"]["train"] - offloaded["phases_gib"]["train"] == pytest.approx(moved, abs=1e-9)
    assert offloaded["phases_gib"]["rollout"] == resident["phases_gib"]["rollout"]  # the trainer is offloaded
    # the node: 4 GPUs per stage (Megatron's rank order puts stages outermost)
    assert offloaded["host"]["kept"] == 16 * on_host[stage]
    assert offloaded["host"]["per_node"] - resident["host"]["per_node"] == sum(4 * 4 * h for h in on_host)

    sft = ["plan", str(OFFLINE_RECIPES[0]), "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
           "--model-config", str(CONFIGS / "qwen2.5-7b" / "config.json")]
    resident, offloaded = (plan_json([*sft, f"optim.cpu_offload={f}"], capsys) for f in (0, 1))
    layout = resident["layout"]
    (elements,) = optimizer_elements(CONFIGS / "qwen2.5-7b" / "config.json", tp=layout["tp"], pp=1, ep=1,
                                     dp=layout["dp"] * layout["cp"], expert_dp=1)
    assert resident["models"][0]["optim"] == 12 * elements
    assert offloaded["models"][0]["optim"] == 0
    assert resident["phases_gib"]["train"] - offloaded["phases_gib"]["train"] == pytest.approx(
        12 * elements / GIB, abs=1e-9)
    assert offloaded["host"]["per_node"] - resident["host"]["per_node"] == 8 * 16 * elements


def test_dpo_plans_its_reference_even_without_a_kl_coefficient(capsys):
    """algo.kl_coef builds an RL reference; DPO's reference is always built (megarl.loops.dpo.build_run)."""
    args = ["plan", str(OFFLINE_RECIPES[1]), "algo.kl_coef=0", "--nodes", "1", "--gpus-per-node", "8",
            "--model-config", str(CONFIGS / "qwen2.5-7b" / "config.json"), "--json"]
    code, out, _ = megarl(args, capsys)
    assert code == 0 and [m["name"] for m in json.loads(out)["models"]] == ["actor", "reference"]


def test_seq_tokens_sets_the_offline_sequence_and_is_refused_for_rl(capsys):
    base = ["plan", str(OFFLINE_RECIPES[0]), "--nodes", "1", "--gpus-per-node", "8",
            "--model-config", str(CONFIGS / "qwen2.5-7b" / "config.json"), "--json"]
    acts = {}
    for tokens in (2048, 8192):
        code, out, _ = megarl([*base, "--seq-tokens", str(tokens)], capsys)
        result = json.loads(out)
        assert code == 0 and result["layout"]["seq_len"] == tokens
        acts[tokens] = result["models"][0]["activations"]
    assert acts[8192] == pytest.approx(4 * acts[2048], rel=1e-6)  # linear in tokens (no seq^2 term)
    code, _, err = megarl(plan_args(*SEVEN_B, "--seq-tokens", "2048"), capsys)
    assert code == 2 and "--seq-tokens is for SFT and DPO recipes" in err
    code, _, err = megarl(plan_args(*SEVEN_B, "algo.name=sft"), capsys)  # the same recipe, planned as SFT
    assert code == 0, err
    code, _, err = megarl([*base, "--seq-tokens", "0"], capsys)
    assert code == 2 and "--seq-tokens 0 must be >= 1" in err


# ---- multi-turn: the sequence is the prompt and env.max_tokens -------------------------------------------------
def agent_args(*extra: str) -> list[str]:
    return ["plan", str(REPO / "recipes" / "agent_python_7b.yaml"), *extra, "--nodes", "1", "--gpus-per-node", "8",
            "--model-config", str(CONFIGS / "qwen2.5-7b" / "config.json")]


def test_multi_turn_sequences_are_the_prompt_and_env_max_tokens(capsys):
    code, out, err = megarl(agent_args("--json"), capsys)
    result = json.loads(out)
    assert code == 0, err
    assert result["layout"]["seq_len"] == 1024 + 6144  # env.max_tokens, not rollout.max_new_tokens 2048
    assert any("env.max_tokens 6144" in a for a in result["assumptions"])
    code, out, _ = megarl(agent_args("env.max_tokens=3000", "--prompt-tokens", "500", "--json"), capsys)
    assert code == 0 and json.loads(out)["layout"]["seq_len"] == 3500
    code, out, _ = megarl(agent_args("env.name=single_turn", "env.sandbox=null", "--json"), capsys)
    assert code == 0 and json.loads(out)["layout"]["seq_len"] == 1024 + 2048  # one turn: max_new_tokens


def test_multi_turn_without_env_max_tokens_exits_2(capsys):
    code, out, err = megarl(agent_args("env.max_tokens=null"), capsys)
    assert code == 2 and out == ""
    assert "env.max_tokens is null" in err and "env.name python" in err


# ---- host memory of the offloaded trainer state ------------------------------------------------------------
def test_host_memory_counts_what_the_offload_moves(capsys):
    """Per GPU: every trainer model's parameters (the frozen reference's too), the trained models' optimizer
    state (not their gradients: the buffers are freed), one parameter buffer's first-offload copy; per node:
    the GPUs of the node and the process reserve."""
    from megarl.plan import GIB, HOST_RESERVE_GIB

    code, out, _ = megarl(plan_args("llama-3.3-70b-ppo", "llama-3.3-70b", 8, "--json"), capsys)
    result = json.loads(out)
    host, models = result["host"], {m["name"]: m for m in result["models"]}
    assert code == 0 and set(models) == {"actor", "reference", "critic"}
    assert host["params"] == sum(m["params"] for m in models.values())
    assert host["optim"] == models["actor"]["optim"] + models["critic"]["optim"]
    assert 0 < host["first_offload"] <= models["actor"]["params"]
    # pp = 4 on 8 nodes: each node holds 8 GPUs of one stage; the fullest is the stage the plan reports
    assert host["per_node"] == 8 * (host["params"] + host["optim"] + host["first_offload"] + HOST_RESERVE_GIB * GIB)


def test_host_memory_sums_the_stages_a_node_holds(capsys):
    """pp = 2 on 2 nodes x 4 GPUs: node 0 holds stage 0, node 1 stage 1 (Megatron's outermost rank axis); on one
    node x 8 GPUs the node holds 4 GPUs of each stage."""
    from megarl.plan import GIB, HOST_RESERVE_GIB

    args = ["plan", str(REPO / "recipes" / "gpu" / "qwen2.5-7b-grpo-gsm8k.yaml"), "parallel.pp=2", "rollout.tp=2",
            "--model-config", str(CONFIGS / "qwen2.5-7b" / "config.json"), "--json"]
    code, out, _ = megarl([*args, "--nodes", "1", "--gpus-per-node", "8"], capsys)
    one_node = json.loads(out)["host"]["per_node"]
    code, out, _ = megarl([*args, "--nodes", "2", "--gpus-per-node", "4"], capsys)
    host = json.loads(out)["host"]
    assert code == 0
    assert host["per_node"] == 4 * (host["params"] + host["optim"] + host["first_offload"] + HOST_RESERVE_GIB * GIB)
    # one node holds both stages, which differ (embedding vs output layer): less than twice the fuller one
    assert host["per_node"] < one_node < 2 * host["per_node"]


def test_too_little_host_memory_exits_1_and_says_so(capsys):
    code, out, _ = megarl(plan_args(*LLAMA, "--host-mem-gb", "256"), capsys)
    assert code == 1
    assert re.search(r"host memory per node: [\d.]+ GiB \(usable 230.4\)\s+DOES NOT FIT", out)
    assert "fits: no" in out and "host: the offloaded trainer state takes" in out
    code, out, _ = megarl(plan_args(*LLAMA, "--host-mem-gb", "256", "--json"), capsys)
    result = json.loads(out)
    assert not result["fits"] and len(result["problems"]) == 1 and result["problems"][0].startswith("host:")
    assert result["host"]["per_node_gib"] > result["host"]["usable_gib"] == pytest.approx(0.9 * 256)
    # the GPU phases are unchanged: only the host does not fit
    assert result["peak_gib"] <= result["usable_gib"]


# ---- overrides before, between and after the flags -------------------------------------------------------------
def test_overrides_are_taken_before_between_and_after_the_flags(capsys):
    recipe = str(REPO / "recipes" / "gpu" / "qwen2.5-7b-grpo-gsm8k.yaml")
    config = str(CONFIGS / "qwen2.5-7b" / "config.json")
    orders = [
        ["plan", recipe, "parallel.tp=4", "rollout.tp=4", "--nodes", "1", "--gpus-per-node", "8",
         "--model-config", config, "--json"],
        ["plan", recipe, "--nodes", "1", "--gpus-per-node", "8", "--model-config", config, "--json",
         "parallel.tp=4", "rollout.tp=4"],
        ["plan", recipe, "parallel.tp=4", "--nodes", "1", "--gpus-per-node", "8", "rollout.tp=4",
         "--model-config", config, "--json"],
        ["plan", "--nodes", "1", recipe, "--gpus-per-node", "8", "--model-config", config, "parallel.tp=4",
         "--json", "rollout.tp=4"],
    ]
    for args in orders:
        code, out, err = megarl(args, capsys)
        result = json.loads(out)
        assert code == 0, err
        assert (result["layout"]["tp"], result["rollout"]["gpus"]) == (4, 4), args
    # the later of two overrides of one key wins, wherever they stand
    code, out, _ = megarl([*orders[0], "rollout.tp=2"], capsys)
    assert json.loads(out)["rollout"]["gpus"] == 2


def test_an_unknown_flag_or_word_among_the_overrides_is_an_error(capsys):
    for stray in (["--nodez", "3"], ["stray"]):
        code, out, err = megarl([*plan_args(*SEVEN_B), *stray], capsys)
        assert code == 2 and out == ""
        assert f"unrecognized arguments: {' '.join(stray)}" in err


def test_reward_models_are_planned_resident_in_every_phase_and_not_offloaded(capsys):
    """A reward_model term is a frozen scalar-head model at the trainer's layout that stays on the device the
    whole step: its parameters add to every phase and to no host-memory figure. Its checkpoint is not on this
    machine here, so it is planned with the policy's architecture (a value head in place of the vocabulary)."""
    from megarl.plan import DTYPE_BYTES, read_model, stage_params

    base = plan_args("llama-3.3-70b-grpo", "llama-3.3-70b", 8, "--json")
    judged = plan_args("llama-3.3-70b-grpo", "llama-3.3-70b", 8, "--json",
                       "reward.terms=[{kind: exact_answer}, {kind: reward_model, path: /nowhere/rm, weight: 0.5}]")
    (code_a, out_a, _), (code_b, out_b, _) = megarl(base, capsys), megarl(judged, capsys)
    assert code_a == 0 and code_b == 0
    a, b = json.loads(out_a), json.loads(out_b)
    assert [m["name"] for m in b["models"]] == ["actor", "reference", "reward_model (reward.terms[1])"]
    shape = read_model(CONFIGS / "llama-3.3-70b" / "config.json")
    lay = b["layout"]
    expected = stage_params(shape, tp=lay["tp"], pp=lay["pp"], ep=lay["ep"], stage=b["stage"],
                            value_head=True).total * DTYPE_BYTES["bfloat16"]
    judge = b["models"][-1]
    assert judge["params"] == expected and judge["grads"] == judge["optim"] == judge["activations"] == 0
    for phase in a["phases_gib"]:
        assert b["phases_gib"][phase] == pytest.approx(a["phases_gib"][phase] + expected / 2**30), phase
    assert b["host"] == a["host"]


# ---- MoE routes (megarl.routing): host memory per rank and node, one micro-batch on the device ------------------
def small_moe(tmp_path: Path, *, experts: int, layers: int = 6, topk: int = 4) -> Path:
    """A small Qwen3-MoE config.json (the 30B's keys, smaller numbers) in `tmp_path`."""
    config = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    config.update(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=experts, num_experts_per_tok=topk)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def small_moe_recipe(tmp_path: Path, *, algo: str = "grpo", max_new_tokens: int = 156, prompts: int = 8,
                     n_samples: int = 4) -> Path:
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(f"model:\n  path: /nowhere/moe\n  dtype: bfloat16\nalgo:\n  name: {algo}\n"
                      f"data:\n  train_path: unused.jsonl\n  prompts_per_step: {prompts}\n"
                      f"rollout:\n  engine: sglang\n  n_samples: {n_samples}\n  max_new_tokens: {max_new_tokens}\n"
                      "train:\n  micro_batch_size: 2\n")
    return recipe


@pytest.mark.parametrize("experts,id_bytes", [(64, 1), (300, 2)])  # 300 ids do not fit in a byte
def test_moe_routes_are_the_formula_per_rank_and_node(experts, id_bytes, tmp_path, capsys):
    from megarl.plan import GIB, HOST_RESERVE_GIB
    from megarl.routing import route_bytes_per_token

    args = ["plan", str(small_moe_recipe(tmp_path)), "--nodes", "1", "--gpus-per-node", "2", "--prompt-tokens",
            "100", "--model-config", str(small_moe(tmp_path, experts=experts))]
    code, out, err = megarl([*args, "--json"], capsys)
    result = json.loads(out)
    assert code == 0, out + err
    assert result["layout"]["dp"] == 2 and result["layout"]["seq_len"] == 100 + 156
    # 6 MoE layers x top-4 ids of `id_bytes` each
    per_token = 6 * 4 * id_bytes
    # 8 prompts x 4 samples over dp = 2 ranks: 16 samples of 256 tokens each
    tokens = 16 * 256
    routing = result["routing"]
    assert routing["bytes_per_token"] == per_token == route_bytes_per_token(moe_layers=6, top_k=4, experts=experts)
    assert routing["tokens_per_rank"] == tokens
    assert routing["host_per_rank"] == tokens * per_token
    assert routing["host_per_node"] == 2 * tokens * per_token  # two GPUs, each holding its rank's routes
    # a micro-batch of 2 samples x 256 tokens, top-4 int64 ids at each of the 6 layers
    assert routing["device_train"] == 2 * 256 * 4 * 6 * 8
    host = result["host"]
    assert host["routes"] == tokens * per_token
    assert host["per_node"] == 2 * (host["params"] + host["optim"] + host["first_offload"] + host["routes"]
                                    + HOST_RESERVE_GIB * GIB)
    states = sum(m["params"] + m["grads"] + m["optim"] for m in result["models"])
    acts = max(m["activations"] for m in result["models"])
    assert result["phases_gib"]["train"] * GIB == pytest.approx(states + acts + 2 * 256 * 4 * 6 * 8 + 4 * GIB)
    assert any(a.startswith(f"MoE routes: {per_token} bytes per token") for a in result["assumptions"])

    code, out, _ = megarl(args, capsys)
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("MoE routes:"))
    assert line.startswith(f"MoE routes: {per_token} bytes/token; host {tokens * per_token / GIB:.2f} GiB per rank "
                           f"({tokens} tokens), {2 * tokens * per_token / GIB:.2f} GiB per node")


def test_dense_models_and_offline_recipes_plan_no_routes(tmp_path, capsys):
    code, out, _ = megarl(plan_args(*LLAMA, "--json"), capsys)
    result = json.loads(out)
    assert code == 0 and result["routing"] is None and result["host"]["routes"] == 0
    assert not any("MoE routes" in a for a in result["assumptions"])
    code, out, _ = megarl(plan_args(*LLAMA), capsys)
    assert code == 0 and "MoE routes" not in out
    # a MoE model trained by SFT has no rollout engine, so no routes
    code, out, _ = megarl(["plan", str(small_moe_recipe(tmp_path, algo="sft")), "--nodes", "1", "--gpus-per-node", "2",
                           "--model-config", str(small_moe(tmp_path, experts=64)), "--json"], capsys)
    assert code == 0 and json.loads(out)["routing"] is None


def test_moe_routes_can_push_a_node_over_its_host_memory(tmp_path, capsys):
    """Long rollouts of many samples: the routes alone (hand-computed here) decide whether the node fits."""
    from megarl.plan import GIB, HOST_USABLE_FRACTION

    # 64 prompts x 16 samples over dp = 2: 512 samples per rank of 1024 + 31744 = 32768 tokens, 6 x 4 x 2 bytes
    # each (300 experts): 768 MiB per rank, 1.5 GiB on the node's 2 GPUs.
    routes_per_node = 2 * 512 * 32768 * 48
    assert routes_per_node == 1.5 * GIB
    recipe = small_moe_recipe(tmp_path, max_new_tokens=31744, prompts=64, n_samples=16)
    args = ["plan", str(recipe), "--nodes", "1", "--gpus-per-node", "2", "--model-config",
            str(small_moe(tmp_path, experts=300)), "--json"]
    code, out, err = megarl(args, capsys)
    result = json.loads(out)
    assert code == 0 and result["routing"]["host_per_node"] == routes_per_node, out + err
    with_routes = result["host"]["per_node"]
    # a node whose usable host memory lies halfway between the state without routes and with them
    host_mem_gb = (with_routes - routes_per_node / 2) / HOST_USABLE_FRACTION / GIB
    code, out, _ = megarl([*args, "--host-mem-gb", f"{host_mem_gb:.6f}"], capsys)
    result = json.loads(out)
    assert code == 1 and not result["fits"]
    assert result["host"]["per_node"] - routes_per_node < result["host"]["limit"] < result["host"]["per_node"]
    (problem,) = result["problems"]
    assert problem.startswith(f"host: the offloaded trainer state and the step's MoE routes (1.5 GiB per node) take "
                              f"{with_routes / GIB:.1f} GiB per node, more than the "
                              f"{result['host']['limit'] / GIB:.1f} GiB usable of --host-mem-gb ")
    assert "fewer or shorter samples per step" in problem
    assert result["peak_gib"] <= result["usable_gib"]  # only the host does not fit


# ---- placement split: a training world, and rollout GPUs of their own -------------------------------------------
SPLIT = ("placement.mode=split", "placement.rollout_ranks=2")  # 1 node x 8 GPUs: ranks 0-5 train, 6-7 generate


@pytest.mark.parametrize("rollout_tp,engines", [(2, [6]), (1, [6, 7])])
def test_split_plan_trains_on_the_training_world_and_generates_on_the_rest(rollout_tp, engines, capsys):
    """The trainer is laid out on the 6 training ranks (dp 3) exactly as a colocated plan of a 6-GPU node lays it
    out. Its GPUs hold no engine and nothing leaves them: train is every trainer model's state and the actor's
    activations, push adds the bucket and the gathered tensors. A rollout GPU holds SGLang's static memory,
    sized as on any GPU, plus the bucket it receives. Nothing is offloaded to the host."""
    from megarl.plan import (ADAM_BYTES, ENGINE_START_USED_GIB, GIB, GRAD_BYTES, HOST_RESERVE_GIB, MASTER_BYTES,
                             RESERVE_GIB, read_model, stage_params)

    overrides = ["data.prompts_per_step=48", f"rollout.tp={rollout_tp}"]  # 48 prompts: dp 3 divides them
    code, out, err = megarl(plan_args(*SEVEN_B, *SPLIT, *overrides, "--json"), capsys)
    result = json.loads(out)
    assert code == 0 and result["fits"], out + err
    lay = result["layout"]
    assert (lay["world"], lay["rollout_ranks"], lay["tp"], lay["dp"]) == (6, 2, 2, 3)
    assert lay["rollout_engines"] == engines and result["rollout"]["engines"] == len(engines)

    # bf16 actor and reference at tp 2; fp32 gradients; Adam and master copy sharded over dp 3, not 4
    shape = read_model(CONFIGS / "qwen2.5-7b" / "config.json")
    counts = stage_params(shape, tp=2, pp=1, ep=1, stage=0)
    models = {m["name"]: m for m in result["models"]}
    actor = models["actor"]
    assert (actor["params"], actor["grads"]) == (2 * counts.total, GRAD_BYTES * counts.total)
    assert actor["optim"] == (ADAM_BYTES + MASTER_BYTES) * -(-counts.dense // 3)
    assert models["reference"]["params"] == 2 * counts.total
    code, out, _ = megarl([*plan_args(*SEVEN_B, *overrides, "--json"), "--gpus-per-node", "6"], capsys)
    colocated = json.loads(out)
    assert code == 0 and colocated["layout"]["dp"] == 3 and colocated["models"] == result["models"]

    reserve, bucket = RESERVE_GIB * GIB, 512 * 2**20  # the recipe's rollout.bucket_bytes
    state = sum(m["state"] for m in result["models"])
    training = {"train": state + actor["activations"] + reserve,
                "push": state + bucket + 2 * shape.vocab_size * shape.hidden * 2 + reserve}
    assert training["train"] == colocated["phases_gib"]["train"] * GIB
    static = int(0.7 * (80 - ENGINE_START_USED_GIB) * GIB)  # rollout.mem_fraction of the GPU at start-up
    assert result["rollout"]["static"] == static == colocated["rollout"]["static"]
    rollout = {"rollout": static + reserve, "push": static + bucket + reserve}
    gpus = result["gpus"]
    assert (gpus["training"]["ranks"], gpus["training"]["count"]) == ([0, 5], 6)
    assert (gpus["rollout"]["ranks"], gpus["rollout"]["count"]) == ([6, 7], 2)
    for kind, phases in (("training", training), ("rollout", rollout)):
        assert gpus[kind]["phases_gib"] == pytest.approx({k: v / GIB for k, v in phases.items()}, abs=1e-9), kind
        assert gpus[kind]["peak_gib"] == pytest.approx(max(phases.values()) / GIB, abs=1e-9), kind
    assert gpus["training"]["peak_gib"] * GIB == pytest.approx(training["train"])  # train outweighs the push
    assert result["phases_gib"] == gpus["training"]["phases_gib"]
    assert result["peak_gib"] == max(gpus["training"]["peak_gib"], gpus["rollout"]["peak_gib"])

    host = result["host"]
    assert host["params"] == host["optim"] == host["first_offload"] == 0
    assert host["per_node"] == 8 * HOST_RESERVE_GIB * GIB
    assert colocated["host"]["params"] > 0  # the colocated trainer does offload

    code, out, _ = megarl(plan_args(*SEVEN_B, *SPLIT, *overrides), capsys)
    assert code == 0 and "fits: yes" in out
    assert "layout: training world 6 = tp 2 x pp 1 x cp 1 x dp 3 (ranks 0-5); placement split: ranks 6-7" in out
    table = out.split("phase ", 1)[1]
    assert re.search(r"training GPUs \(ranks 0-5\).*\n  train\s+[\d.]+\s+ok\n  push\s+[\d.]+\s+ok\n"
                     r"rollout GPUs \(ranks 6-7\).*\n  rollout\s+[\d.]+\s+ok\n  push\s+[\d.]+\s+ok\n", table)


@pytest.mark.parametrize("overrides,gpu_mem_gb,kind", [
    # SGLang's pool alone: 0.99 x 78.5 GiB + the reserve, more than 76 GiB usable; the trainer fits
    (["rollout.mem_fraction=0.99"], 80, "rollout"),
    # the trainer's 7B state does not fit 45.6 GiB; the engine's 0.7 x 46.5 GiB does
    ([], 48, "training"),
])
def test_split_plan_fits_only_when_both_kinds_of_gpu_fit(overrides, gpu_mem_gb, kind, capsys):
    other = {"training": "rollout", "rollout": "training"}[kind]
    args = plan_args(*SEVEN_B, *SPLIT, "data.prompts_per_step=48", *overrides, gpu_mem_gb=gpu_mem_gb)
    code, out, _ = megarl([*args, "--json"], capsys)
    result = json.loads(out)
    assert code == 1 and not result["fits"] and result["problems"]
    assert result["gpus"][kind]["peak_gib"] > result["usable_gib"] >= result["gpus"][other]["peak_gib"]
    assert all(problem.startswith(f"{kind} GPUs, ") for problem in result["problems"]), result["problems"]
    code, out, _ = megarl(args, capsys)
    assert code == 1 and "fits: no" in out
    verdicts = {}  # each kind's phase lines in the table: ok or DOES NOT FIT
    for line in out.split("\nphase ", 1)[1].split("\nhost memory", 1)[0].splitlines()[1:]:
        if not line.startswith("  "):
            title = line.split(" GPUs (")[0]
        else:
            verdicts.setdefault(title, []).append(line.endswith("DOES NOT FIT"))
    assert set(verdicts) == {"training", "rollout"}
    assert any(verdicts[kind]) and not any(verdicts[other])


@pytest.mark.parametrize("overrides,message", [
    (["placement.rollout_ranks=8"], "placement.rollout_ranks = 8 leaves no training rank in a job of 8 ranks"),
    (["placement.rollout_ranks=10"], "placement.rollout_ranks = 10 leaves no training rank in a job of 8 ranks"),
    # 64 prompts over the dp 3 of 6 training ranks (over the 8 GPUs' dp 4 they divide)
    ([], "data.prompts_per_step 64 is not divisible by the data-parallel size 3 (training world size 6 / "
         "(parallel.tp * parallel.pp * parallel.cp); placement.rollout_ranks 2 of the 8 ranks only generate)"),
    # 384 samples per step divide by 3, a rank's 128 do not
    (["data.prompts_per_step=48", "train.micro_batch_size=3"],
     "samples per data-parallel rank 128 (data.prompts_per_step / 3 * rollout.n_samples, data-parallel size 3 = "
     "training world size 6 / (parallel.tp * parallel.pp * parallel.cp); placement.rollout_ranks 2 of the 8 ranks "
     "only generate) is not divisible by train.micro_batch_size = 3"),
    (["parallel.tp=4", "rollout.tp=4", "placement.rollout_ranks=4", "data.prompts_per_step=48"], None),
    (["parallel.tp=4"], "world size 6 is not divisible by parallel.tp * parallel.pp * parallel.cp = 4 "
                        "(training world size = 8 ranks - placement.rollout_ranks 2)"),
    (["placement.rollout_ranks=3"], "placement.rollout_ranks = 3 is not a multiple of rollout.tp = 2"),
    (["algo.name=sft"], "algo.name = 'sft' generates nothing: use placement.mode: colocated"),  # the recipe's check
])
def test_broken_split_layout_exits_2_naming_the_training_world(overrides, message, capsys):
    code, out, err = megarl(plan_args(*SEVEN_B, *SPLIT, *overrides), capsys)
    if message is None:
        assert code == 0, out + err
        return
    assert code == 2 and out == "", out + err
    assert message in err


def test_split_native_engines_and_moe_routes_live_where_the_ranks_say(tmp_path, capsys):
    """Native engines: one per rollout.tp rollout ranks, each holding its weights and the KV of its share of the
    step. MoE routes: only the training ranks' processes hold them on the host (one node: 2 of its 4 GPUs)."""
    from megarl.plan import GIB, HOST_RESERVE_GIB, RESERVE_GIB

    args = ["plan", str(small_moe_recipe(tmp_path)), *SPLIT, "rollout.engine=native", "rollout.tp=1", "--nodes", "1",
            "--gpus-per-node", "4", "--prompt-tokens", "100", "--model-config", str(small_moe(tmp_path, experts=64)),
            "--json"]
    code, out, err = megarl(args, capsys)
    result = json.loads(out)
    assert code == 0, out + err
    assert (result["layout"]["world"], result["layout"]["dp"]) == (2, 2)
    rollout = result["rollout"]
    assert rollout["engines"] == 2  # rollout ranks 2 / rollout.tp 1
    # 8 prompts x 4 samples over 2 engines, 256 tokens each; K and V of 6 layers x 2 KV heads x 64, bf16
    assert rollout["kv_bytes"] == 16 * 256 * 2 * 6 * 2 * 64 * 2
    assert rollout["static"] == rollout["weights"] + rollout["kv_bytes"]
    assert result["gpus"]["rollout"]["phases_gib"]["rollout"] * GIB == rollout["static"] + RESERVE_GIB * GIB
    states = sum(m["state"] for m in result["models"])  # the native engine is not on the training GPUs
    acts = max(m["activations"] for m in result["models"])
    routing = result["routing"]
    assert result["phases_gib"]["train"] * GIB == pytest.approx(states + acts + routing["device_train"]
                                                                + RESERVE_GIB * GIB)
    per_rank = 16 * 256 * 6 * 4  # a dp rank's 16 samples of 256 tokens, top-4 byte ids at 6 layers
    assert routing["host_per_rank"] == per_rank and routing["host_per_node"] == 2 * per_rank
    host = result["host"]
    assert host["per_node"] == 2 * per_rank + 4 * HOST_RESERVE_GIB * GIB
