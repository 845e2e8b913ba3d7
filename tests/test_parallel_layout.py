"""One layout: `megarl plan` and the launch judge every parallel layout alike. Each row of the table is a recipe
on a cluster (colocated and split, dense and MoE, RL, SFT and DPO, valid and not); the plan's check (megarl.plan,
in this process) and the launch's (megarl.job.Job.of with the ranks torchrun would give) must
both accept it, or both refuse it with the same text, the one the row expects."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO

CONFIGS = REPO / "recipes" / "gpu" / "configs"
DENSE, LLAMA, MOE = "qwen2.5-7b", "llama-3.3-70b", "qwen3-30b-a3b"  # 28, 64 and 32 heads; MoE: 128 experts

# GRPO with SGLang engines of 2 GPUs, tp 2: on one node of 8 GPUs dp is 4, a rank's 8 prompts make 64 samples
RECIPE = """\
model:
  path: {model}
  dtype: bfloat16
data:
  train_path: unused.jsonl
  prompts_per_step: 32
rollout:
  engine: sglang
  tp: 2
  n_samples: 8
  max_new_tokens: 256
parallel:
  tp: 2
train:
  micro_batch_size: 4
"""
SPLIT = ("placement.mode=split", "placement.rollout_ranks=2", "data.prompts_per_step=48")  # 6 ranks train: dp 3
MOE_EP = ("parallel.tp=1", "parallel.ep=8")
MOE_ETP = ("parallel.tp=2", "parallel.etp=1", "model.megatron.sequence_parallel=true")
DP = "(world size 8 / (parallel.tp * parallel.pp * parallel.cp))"
SPLIT_DP = ("(training world size 6 / (parallel.tp * parallel.pp * parallel.cp); placement.rollout_ranks 2 of the 8 "
            "ranks only generate)")
VPP = "model.megatron.virtual_pipeline_model_parallel_size"

# (model, nodes, GPUs per node, overrides, the error both give; None: both accept it)
LAYOUTS = [
    # colocated, dense, RL
    (DENSE, 1, 8, [], None),
    (DENSE, 1, 8, ["parallel.tp=3"], "world size 8 is not divisible by parallel.tp * parallel.pp * parallel.cp = 3"),
    (DENSE, 1, 8, ["parallel.tp=8", "rollout.tp=4"], "attention heads 28 is not divisible by parallel.tp = 8"),
    (DENSE, 1, 8, ["parallel.ep=2"], "parallel.ep = 2 needs a mixture-of-experts model; qwen2 has no experts"),
    (DENSE, 1, 8, ["data.prompts_per_step=6"], f"data.prompts_per_step 6 is not divisible by the data-parallel size 4 {DP}"),
    (DENSE, 1, 8, ["train.micro_batch_size=128"], "samples per data-parallel rank 64 (data.prompts_per_step / 4 * "
                                                  "rollout.n_samples) is not divisible by train.micro_batch_size = 128"),
    # packed micro-batches are cut by tokens: any count of samples per rank
    (DENSE, 1, 8, ["train.micro_batch_size=128", "train.micro_batch_tokens=8192"], None),
    (DENSE, 1, 8, ["warmup.sft_steps=10", "warmup.batch_size=6"],
     f"warmup.batch_size 6 is not divisible by the data-parallel size 4 {DP}"),
    # rollout engines: SGLang splits the model over rollout.tp GPUs of one node; the native engine does not
    (DENSE, 1, 8, ["rollout.tp=7"], "key/value heads 4 and rollout.tp = 7: neither divides the other (SGLang splits "
                                    "the KV heads over its TP ranks or replicates them)"),
    (DENSE, 1, 8, ["rollout.tp=8"], "attention heads 28 is not divisible by rollout.tp = 8"),
    (DENSE, 1, 8, ["rollout.engine=native", "rollout.tp=8"], None),
    (DENSE, 1, 8, ["rollout.engine=native", "rollout.tp=7"],
     "world size 8 is not divisible by rollout.tp = 7: every rank belongs to one rollout engine"),
    (DENSE, 1, 6, ["data.prompts_per_step=48", "rollout.tp=4"],
     "GPUs per node 6 is not divisible by rollout.tp = 4: an engine's GPUs must be on one node or span whole "
     "nodes"),
    # an engine that spans whole nodes (colocated): SGLang's nnodes
    (LLAMA, 2, 4, ["rollout.tp=8"], None),
    (LLAMA, 1, 4, ["rollout.tp=8"], "world size 4 is not divisible by rollout.tp = 8: every rank belongs to one "
                                    "rollout engine"),
    (LLAMA, 4, 6, ["rollout.tp=8", "data.prompts_per_step=48"],
     "rollout.tp = 8 is not divisible by the 6 GPUs of a node: an engine's GPUs must be on one node or span whole "
     "nodes"),
    # virtual pipeline stages
    (LLAMA, 1, 8, ["parallel.pp=2", f"{VPP}=2"], None),
    (LLAMA, 1, 8, ["parallel.pp=2", f"{VPP}=2", "data.prompts_per_step=6", "train.micro_batch_size=8"],
     "micro-batches per data-parallel rank 3 is not divisible by parallel.pp = 2 (interleaved pipeline schedule)"),
    (LLAMA, 1, 8, [f"{VPP}=2"], f"{VPP} = 2 needs parallel.pp >= 2, got parallel.pp = 1"),
    (LLAMA, 1, 8, ["parallel.pp=2", "model.megatron.num_layers_per_virtual_pipeline_stage=10"],
     "model.megatron.num_layers_per_virtual_pipeline_stage is not a TransformerConfig field: set "
     "virtual_pipeline_model_parallel_size (= layers / (pp * 10) = 4)"),
    # colocated, MoE, RL
    (MOE, 2, 8, [*MOE_EP], None),
    (MOE, 2, 8, [*MOE_EP, "rollout.tp=8"], None),  # 4 KV heads replicated over 8 GPUs
    (MOE, 2, 8, ["parallel.tp=1", "parallel.ep=3"], "experts 128 is not divisible by parallel.ep = 3"),
    (MOE, 2, 8, ["parallel.tp=1", "parallel.ep=32"],
     "world size 16 is not divisible by parallel.tp * parallel.ep * parallel.pp = 32"),
    (MOE, 2, 8, ["parallel.ep=8"], "parallel.tp = 2 with a mixture-of-experts model (qwen3_moe) needs "
                                   "model.megatron.sequence_parallel: true"),
    # each expert whole (parallel.etp 1) while attention splits over TP 2: the expert grid is etp * ep * pp
    (MOE, 2, 8, [*MOE_ETP, "parallel.ep=16"], None),
    (MOE, 2, 8, [*MOE_ETP, "parallel.ep=32"],
     "world size 16 is not divisible by parallel.etp * parallel.ep * parallel.pp = 32"),
    (MOE, 2, 8, [*MOE_ETP, "parallel.ep=1"], "parallel.etp = 1 differs from parallel.tp = 2 with parallel.ep = 1: "
     "Megatron reduces the experts' gradients over their own data-parallel ranks only under expert parallelism; set "
     "parallel.ep > 1, or leave parallel.etp unset"),
    # placement split: the job's last placement.rollout_ranks ranks generate, the others train
    (DENSE, 1, 8, [*SPLIT], None),
    (DENSE, 1, 8, [*SPLIT, "placement.rollout_ranks=8"],
     "placement.rollout_ranks = 8 leaves no training rank in a job of 8 ranks"),
    (DENSE, 1, 8, [*SPLIT, "data.prompts_per_step=64"],
     f"data.prompts_per_step 64 is not divisible by the data-parallel size 3 {SPLIT_DP}"),
    (DENSE, 1, 8, [*SPLIT, "parallel.tp=4"], "world size 6 is not divisible by parallel.tp * parallel.pp * "
                                             "parallel.cp = 4 (training world size = 8 ranks - placement.rollout_ranks 2)"),
    (DENSE, 4, 2, [*SPLIT, "placement.rollout_ranks=4", "rollout.tp=4"],
     "rollout.tp = 4 is more than the 2 GPUs of a node, with placement.mode = 'split': an engine spans nodes only "
     "in colocated placement"),
    (MOE, 2, 8, [*SPLIT, *MOE_EP, "placement.rollout_ranks=8"], None),
    (MOE, 2, 8, [*SPLIT, *MOE_EP], "world size 14 is not divisible by parallel.tp * parallel.ep * parallel.pp = 8 "
                                   "(training world size = 16 ranks - placement.rollout_ranks 2)"),
    # SFT and DPO: no rollout engine, so rollout.tp is not theirs to divide
    (DENSE, 1, 8, ["algo.name=sft", "rollout.tp=7"], None),
    (DENSE, 1, 8, ["algo.name=sft", "train.micro_batch_size=16"],
     "sequences per data-parallel rank 8 (data.prompts_per_step / 4) is not divisible by train.micro_batch_size = 16"),
    (MOE, 2, 8, ["algo.name=sft", *MOE_EP, "data.prompts_per_step=12"],
     "data.prompts_per_step 12 is not divisible by the data-parallel size 16 (world size 16 / (parallel.tp * "
     "parallel.pp * parallel.cp))"),
    (DENSE, 1, 8, ["algo.name=dpo"], None),
    (DENSE, 1, 8, ["algo.name=dpo", "train.micro_batch_size=6"], "sequences per data-parallel rank 16 "
     "(data.prompts_per_step / 4 * 2 (chosen and rejected)) is not divisible by train.micro_batch_size = 6"),
    (DENSE, 1, 8, ["algo.name=dpo", "data.prompts_per_step=6"],
     f"data.prompts_per_step 6 is not divisible by the data-parallel size 4 {DP}"),
]


def plan_verdict(cfg, nodes: int, gpus_per_node: int) -> str | None:
    """What `megarl plan --nodes NODES --gpus-per-node GPUS` says of the layout: None, or its error."""
    from megarl.plan import Cluster, PlanError, plan, read_model

    try:
        plan(cfg, read_model(Path(cfg.model.path) / "config.json"), Cluster(nodes, gpus_per_node))
    except PlanError as e:
        return str(e)
    return None


def launch_verdict(cfg, nodes: int, gpus_per_node: int) -> str | None:
    """What the launch says of the layout under torchrun on NODES nodes of GPUS ranks: None, or its error."""
    from megarl.config import RecipeError
    from megarl.job import Job

    try:
        Job.of(cfg, world=nodes * gpus_per_node, ranks_per_node=gpus_per_node)
    except RecipeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("model,nodes,gpus_per_node,overrides,error", LAYOUTS,
                         ids=[f"{m}-{n}x{g}-{' '.join(o) or 'recipe'}" for m, n, g, o, _ in LAYOUTS])
def test_plan_and_launch_give_one_verdict(model, nodes, gpus_per_node, overrides, error, tmp_path):
    from megarl.config import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=CONFIGS / model))
    cfg = load_config(recipe, overrides, check_paths=False)
    assert plan_verdict(cfg, nodes, gpus_per_node) == error
    assert launch_verdict(cfg, nodes, gpus_per_node) == error


def test_the_table_has_valid_and_invalid_layouts_of_every_kind():
    def kind(model: str, overrides: list[str]) -> tuple[str, str, str]:
        algo = next((o.split("=")[1] for o in overrides if o.startswith("algo.name=")), "rl")
        return ("moe" if model == MOE else "dense", "split" if "placement.mode=split" in overrides else "colocated",
                algo)

    verdicts = {}
    for model, _, _, overrides, error in LAYOUTS:
        verdicts.setdefault(kind(model, overrides), set()).add(error is None)
    assert len(LAYOUTS) >= 20
    for seen in [("dense", "colocated", "rl"), ("moe", "colocated", "rl"), ("dense", "split", "rl"),
                 ("moe", "split", "rl"), ("dense", "colocated", "sft"), ("dense", "colocated", "dpo")]:
        assert verdicts.get(seen) == {True, False}, seen
