"""Every parallel layout gives the numbers of one rank: TP=2, PP=2, DP=2, TP2xPP2, DP2xTP2, virtual pipeline
stages PP2xVPP2, context parallel CP=2 and DP2xCP2, sequence parallel TP=2, expert parallel EP=2, EP2xPP2
and EP2xTP2 (with sequence parallelism) on MoE models, and expert tensor parallelism apart from TP (ETP=1 under
TP=2, ETP=2 under TP=1), on gloo ranks; and prompts held once per group
(train.share_prompts) against the unshared computation at TP=2 (with and without sequence parallelism),
PP=2, PP2xVPP2, DP=2, TP2xPP2 and DP2xTP2.

Each layout runs tests/parallel_worker.py under torchrun (two optimizer steps of the PPO + KL + entropy
policy loss on one fixed global batch; MoE models add their load-balancing loss; then three steps of a
critic with a scalar head) and is compared with the single-rank run of the same worker. Every rank's weight
handoff must reproduce the HF checkpoint bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, _tiny_model_tool, run_python

LAYOUT_TIMEOUT_S = 300  # 4 gloo ranks on 2 cores take ~30 s a layout; a hang fails the test instead of stalling CI
pytestmark = pytest.mark.timeout(7 * LAYOUT_TIMEOUT_S)  # a test may wait for the one-rank job and its own


def layout(*, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1,
           extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    expert_tp = ("--etp", str(etp)) if etp is not None else ()
    return ("--tp", str(tp), "--pp", str(pp), "--ep", str(ep), *expert_tp, "--cp", str(cp), *extra)


# Every run of the worker: name -> (model, processes, worker arguments). A checkpoint path is named relative to
# the runs' folder. One torchrun job per world size runs all its cases in turn (each rank pays its imports
# once, not once a layout): the single-rank runs first, which the others are compared with and the VPP run
# resumes from.
CASES = {
    **{f"single-{arch}": (arch, 1, ()) for arch in ("qwen2", "llama", "qwen3", "qwen2_moe", "mixtral", "glm4_moe",
                                                     "deepseek_v3", "gpt_oss", "gemma3")},
    "single-qwen2_4layers": ("qwen2_4layers", 1, ("--save", "{runs}/ckpt_single")),
    "qwen2-tp2": ("qwen2", 2, layout(tp=2, extra=("--share-prompts",))),
    "qwen2-pp2": ("qwen2", 2, layout(pp=2)),  # 4 micro-batches through the 1F1B schedule
    "qwen2-dp2": ("qwen2", 2, layout()),
    "qwen2-tp2pp2": ("qwen2", 4, layout(tp=2, pp=2, extra=("--share-prompts",))),
    "qwen2-dp2tp2": ("qwen2", 4, layout(tp=2, extra=("--share-prompts",))),
    "llama-tp2": ("llama", 2, layout(tp=2)),  # untied output layer split over the vocabulary
    "llama-pp2": ("llama", 2, layout(pp=2)),  # untied output layer on the last stage only
    # DP=2 for the dense weights: 2 of 4 experts per rank
    "qwen2_moe-ep2": ("qwen2_moe", 2, layout(ep=2, extra=("--share-prompts",))),
    "mixtral-ep2pp2": ("mixtral", 4, layout(pp=2, ep=2)),  # experts split inside each pipeline stage
    "qwen3-tp2sp-packed": ("qwen3", 2, layout(tp=2, extra=("--sequence-parallel", "--micro-batch-tokens", "24",
                                                                 "--share-prompts"))),
    "qwen2_moe-ep2tp2sp": ("qwen2_moe", 4, layout(tp=2, ep=2, extra=("--sequence-parallel",))),
    # sigmoid-routed MoE after a dense first layer: the dense layer on stage 0, the MoE layer's 8 experts over EP=2
    # on stage 1 (GLM-4.5); multi-latent attention split over TP with its latents sequence-parallel, packed
    # (DeepSeek-V3), and its dense and MoE layers on two stages
    "glm4_moe-ep2pp2": ("glm4_moe", 4, layout(pp=2, ep=2)),
    "deepseek_v3-pp2": ("deepseek_v3", 2, layout(pp=2)),
    "deepseek_v3-tp2sp-packed": ("deepseek_v3", 2, layout(tp=2, extra=("--sequence-parallel", "--micro-batch-tokens",
                                                                        "24"))),
    "glm4_moe-tp2sp": ("glm4_moe", 2, layout(tp=2, extra=("--sequence-parallel",))),
    "qwen2-cp2": ("qwen2", 2, layout(cp=2)),
    "qwen2-dp2cp2": ("qwen2", 4, layout(cp=2)),
    "qwen2-pp2-packed": ("qwen2", 2, layout(pp=2, extra=("--micro-batch-tokens", "24", "--share-prompts"))),
    "qwen2-dp2-balanced-packed": ("qwen2", 2, layout(extra=("--micro-batch-tokens", "24", "--redistribute",
                                                                     "--share-prompts"))),
    "qwen2-dp2-balanced": ("qwen2", 2, layout(extra=("--redistribute",))),
    "qwen2_4layers-pp2vpp2": ("qwen2_4layers", 2, layout(pp=2, extra=(
        "--vpp", "2", "--save", "{runs}/ckpt_vpp", "--resume-from", "{runs}/ckpt_single"))),
    "qwen2_4layers-pp2vpp2-packed": ("qwen2_4layers", 2, layout(pp=2, extra=("--vpp", "2", "--micro-batch-tokens",
                                                                             "24", "--share-prompts"))),
    # LoRA (model.lora): adapters split like their layers, and under sequence parallelism
    "single-qwen2-lora": ("qwen2", 1, ("--lora",)),
    # the TP=2 run's checkpoint (adapters and their Adam state) resumed at TP=2 with sequence parallelism and at PP=2
    "qwen2-lora-tp2": ("qwen2", 2, layout(tp=2, extra=("--lora", "--save", "{runs}/ckpt_lora_tp2"))),
    "qwen2-lora-tp2sp": ("qwen2", 2, layout(tp=2, extra=("--lora", "--sequence-parallel",
                                                         "--resume-from", "{runs}/ckpt_lora_tp2"))),
    "qwen2-lora-pp2": ("qwen2", 2, layout(pp=2, extra=("--lora", "--resume-from", "{runs}/ckpt_lora_tp2"))),
    # LoRA on a MoE model's experts (each expert's and the shared expert's fc1 and fc2, and attention): 2 of the
    # 4 experts and their adapters per rank; the EP=2 checkpoint resumed on 4 ranks (EP=2 x expert-DP 2)
    "single-qwen2_moe-lora": ("qwen2_moe", 1, ("--lora",)),
    "qwen2_moe-lora-ep2": ("qwen2_moe", 2, layout(ep=2, extra=("--lora", "--save", "{runs}/ckpt_lora_ep2"))),
    "qwen2_moe-lora-ep2dp2": ("qwen2_moe", 4, layout(ep=2, extra=("--lora", "--resume-from",
                                                                  "{runs}/ckpt_lora_ep2"))),
    # gpt-oss (biased experts: Megatron takes them at expert TP 1 only): a sliding-window stage and a full-attention
    # stage; 2 of each layer's 4 stacked experts per rank, in padded and in packed rows
    "gpt_oss-pp2": ("gpt_oss", 2, layout(pp=2)),
    "gpt_oss-ep2": ("gpt_oss", 2, layout(ep=2)),
    "gpt_oss-ep2-packed": ("gpt_oss", 2, layout(ep=2, extra=("--micro-batch-tokens", "24"))),
    # Expert tensor parallelism apart from TP (parallel.etp). ETP=1 under TP=2: attention (and shared experts) split
    # over the two ranks, each routed expert whole on one of them, the experts spread over EP=2 on the same ranks;
    # with gpt-oss's biased experts, LoRA on the experts, and multi-latent attention (DeepSeek-V3). On 4 ranks:
    # TP2xPP2 with the MoE stage's experts over EP=2 (GLM-4.5), EP=4 over both data-parallel replicas (one expert
    # per rank), and ETP=2 under TP=1: each expert split over two ranks of different replicas, which share tokens.
    **{f"{arch}-tp2etp1ep2sp": (arch, 2, layout(tp=2, etp=1, ep=2, extra=("--sequence-parallel",)))
       for arch in ("qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss")},
    "qwen2_moe-lora-tp2etp1ep2sp": ("qwen2_moe", 2, layout(tp=2, etp=1, ep=2, extra=("--lora", "--sequence-parallel"))),
    "glm4_moe-tp2pp2etp1ep2sp": ("glm4_moe", 4, layout(tp=2, pp=2, etp=1, ep=2, extra=("--sequence-parallel",))),
    "qwen2_moe-tp2etp1ep4sp": ("qwen2_moe", 4, layout(tp=2, etp=1, ep=4, extra=("--sequence-parallel",))),
    "mixtral-etp2ep2": ("mixtral", 4, layout(etp=2, ep=2)),
    # Gemma 3: a local (sliding-window of 8, sequences of 12) layer then a global one, post-attention and post-MLP
    # norms; PP=2 puts one kind on each stage
    "gemma3-tp2": ("gemma3", 2, layout(tp=2)),
    "gemma3-pp2": ("gemma3", 2, layout(pp=2)),
    "gemma3-tp2sp-packed": ("gemma3", 2, layout(tp=2, extra=("--sequence-parallel", "--micro-batch-tokens", "24"))),
}


def read_result(out_dir: Path) -> dict:
    result = json.loads((out_dir / "result.json").read_text())
    result["weights"] = torch.load(out_dir / "weights.pt", weights_only=True)
    return result


def run_job(nproc: int, cases: list[list[str]], *, cases_file: Path) -> None:
    """tests/parallel_worker.py on `nproc` ranks, running each argument list of `cases` in turn."""
    cases_file.write_text(json.dumps(cases))
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "parallel_worker.py"), "--cases", str(cases_file)]
    proc = run_python(args, timeout_s=LAYOUT_TIMEOUT_S * (1 + len(cases) // 4))
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def qwen2_4_layers(tiny_models):
    """The tiny Qwen2 with 4 layers: one per chunk of PP=2 x VPP=2."""
    return _tiny_model_tool().make_tiny_model(tiny_models / "qwen2_4layers_seed0", arch="qwen2", seed=0, layers=4)


@pytest.fixture(scope="module")
def runs(arch_dir, qwen2_4_layers, tmp_path_factory):
    """`runs(name)`: the result of that case of CASES (its folder is `runs.folder / name`). The first request of
    a world size runs that world's job, after the one-rank job."""
    folder, done = tmp_path_factory.mktemp("layouts"), set()

    def model(name: str) -> Path:
        return qwen2_4_layers if name == "qwen2_4layers" else arch_dir(name)

    def get(name: str) -> dict:
        for nproc in sorted({1, CASES[name][1]}):
            if nproc not in done:
                cases = [["--model", str(model(arch)), "--out", str(folder / case),
                          *(a.format(runs=folder) for a in args)]
                         for case, (arch, n, args) in CASES.items() if n == nproc]
                run_job(nproc, cases, cases_file=folder / f"cases{nproc}.json")
                done.add(nproc)
        return read_result(folder / name)
    get.folder = folder
    return get


@pytest.mark.parametrize("name", ["qwen2-tp2", "qwen2-pp2", "qwen2-dp2", "qwen2-tp2pp2", "qwen2-dp2tp2", "llama-tp2",
                                  "llama-pp2", "qwen2_moe-ep2", "mixtral-ep2pp2", "glm4_moe-ep2pp2",
                                  "deepseek_v3-pp2", "gpt_oss-pp2", "gpt_oss-ep2", "gemma3-tp2", "gemma3-pp2"])
def test_layout_matches_single_rank(name, runs):
    assert_same_numbers(runs(name), runs(f"single-{CASES[name][0]}"))


# Sequence parallelism (model.megatron.sequence_parallel): outside attention and the MLPs, each TP rank holds
# every activation for its slice of the sequence; norm weights, the routers and the critic's value head see
# only that slice, and their gradients are summed over TP. Qwen3 adds q/k norms over TP-split heads; packed
# rows of 23 tokens (64 in rows of at most 24 make 18, 23, 23) are padded to split evenly. MoE layers train
# under TP only with sequence parallelism: EP2 x TP2 gathers each TP rank's routed tokens, as many as its
# router chose, inside the expert layer.
@pytest.mark.parametrize("name", ["qwen3-tp2sp-packed", "qwen2_moe-ep2tp2sp", "deepseek_v3-tp2sp-packed",
                                  "glm4_moe-tp2sp", "gemma3-tp2sp-packed"])
def test_sequence_parallel_matches_single_rank(name, runs):
    from megarl.packing import count_bins, plan_micro_batches

    result, packed = runs(name), "--micro-batch-tokens" in CASES[name][2]
    assert_same_numbers(result, runs(f"single-{CASES[name][0]}"), lengths=result["lengths"] if packed else None)
    if packed:
        lengths = result["lengths"]
        rows = plan_micro_batches(lengths, max_tokens=24, n_micro=count_bins(lengths, 24))
        assert any(sum(lengths[i] for i in row) % 2 for row in rows)  # a row the engine pads for tp = 2


def test_sigmoid_routers_keep_their_expert_bias_while_the_experts_train(runs, arch_dir):
    """The expert bias that picks experts (e_score_correction_bias) is a buffer with update rate 0: two steps
    leave it bit-identical to the checkpoint's, on one rank and at EP2 x PP2, while the routers and experts move."""
    from safetensors.torch import load_file

    checkpoint = load_file(str(arch_dir("glm4_moe") / "model.safetensors"))
    for name in ("single-glm4_moe", "glm4_moe-ep2pp2"):
        weights = runs(name)["weights"]
        assert all(torch.equal(weights[n], w) for n, w in checkpoint.items() if n.endswith("e_score_correction_bias"))
        assert not torch.equal(weights["model.layers.1.mlp.gate.weight"], checkpoint["model.layers.1.mlp.gate.weight"])
        assert not torch.equal(weights["model.layers.1.mlp.experts.5.up_proj.weight"],
                               checkpoint["model.layers.1.mlp.experts.5.up_proj.weight"])


# Expert tensor parallelism (parallel.etp) apart from TP. Megatron's expert layers communicate over their own groups
# (the dispatcher over the expert tensor and expert parallel ranks, the experts' gradients over the expert
# data-parallel ones), so the numbers are the single rank's at the tolerances of every layout above; and the
# logprobs before training are transformers' within 1e-5 (measured: up to 9.5e-7; fp32 reordering of sharded sums,
# where a routing or split error moves them by more than 1e-3). Each rank holds experts / ep experts, each split
# over etp, as the plan counts them (megarl.plan.stage_params).
ETP = [name for name in CASES if "etp" in name and "lora" not in name]


@pytest.mark.parametrize("name", ETP)
def test_expert_tensor_parallel_layout_matches_single_rank_and_transformers(name, runs, arch_dir):
    from megarl.models.arch import read_shape
    from megarl.plan import stage_params
    from test_engine import hf_logits, token_logprobs

    arch, args = CASES[name][0], CASES[name][2]
    result = runs(name)
    assert_same_numbers(result, runs(f"single-{arch}"))
    tokens = torch.tensor(result["tokens"])
    reference = token_logprobs(hf_logits(arch_dir(arch), tokens), tokens)
    assert (torch.tensor(result["logprobs"]) - reference).abs().max() <= 1e-5

    size = {key: int(args[args.index(f"--{key}") + 1]) for key in ("tp", "pp", "ep", "etp")}
    shape = read_shape(arch_dir(arch))
    for rank in result["ranks"]:
        experts = rank["experts"]
        if experts is not None:  # a pipeline stage without MoE layers holds none
            assert experts["count"] == shape.experts // size["ep"]
            assert experts["fc1_rows"] == 2 * shape.moe_ffn // size["etp"]  # gate and up
        assert rank["params"] == stage_params(shape, tp=size["tp"], pp=size["pp"], ep=size["ep"], etp=size["etp"],
                                              stage=rank["pp_rank"]).total


# LoRA: A replicated and B split on a column-parallel linear's output, A split and B replicated on a row-parallel
# one's input, the replicated factor's gradient summed over TP under sequence parallelism. Two steps (A gets a
# gradient from the second, once B has left zero); the trained weights compared are the merged ones the push sends.
@pytest.mark.parametrize("name", ["qwen2-lora-tp2", "qwen2-lora-tp2sp", "qwen2-lora-pp2"])
def test_lora_layout_matches_single_rank(name, runs, arch_dir):
    moved = lora_run_matches(runs(name), runs("single-qwen2-lora"), base_dir=arch_dir("qwen2"))
    assert {n.split(".")[-2] for n in moved} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"}


def lora_run_matches(result: dict, reference: dict, *, base_dir: Path) -> set[str]:
    """A LoRA layout's run equals the single-rank one: logprobs, both steps, the merged weights. Returns the HF
    names of the weights the reference moved from the base checkpoint in `base_dir`."""
    from safetensors.torch import load_file

    assert (torch.tensor(result["logprobs"]) - torch.tensor(reference["logprobs"])).abs().max() <= 1e-4
    for got, want in zip(result["steps"], reference["steps"], strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(result["weights"], reference["weights"])
    base = load_file(str(base_dir / "model.safetensors"))
    return {n for n, w in reference["weights"].items() if not torch.equal(w, base[n])}


@pytest.mark.parametrize("name", ["qwen2_moe-lora-ep2", "qwen2_moe-lora-ep2dp2", "qwen2_moe-lora-tp2etp1ep2sp"])
def test_expert_lora_under_expert_parallelism_matches_single_rank(name, runs, arch_dir):
    """Adapters on the experts at EP=2 (and EP=2 with the experts' data parallelism 2 on 4 ranks, and EP=2 at
    ETP=1 under TP=2, the shared expert's adapters split over TP with sequence parallelism): the steps' loss and
    gradient norm and the merged weights are the single rank's (the tolerances of every layout above: the expert
    adapters' gradients are reduced over the ranks holding the same experts, not over all, and the norm counts
    each expert's replicated factor once per expert, not once per TP group); every expert's and the shared
    expert's projections moved. The EP=2 checkpoint loads on 4 ranks bit for bit."""
    from safetensors.torch import load_file

    moved = lora_run_matches(runs(name), runs("single-qwen2_moe-lora"), base_dir=arch_dir("qwen2_moe"))
    experts = {n for n in load_file(str(arch_dir("qwen2_moe") / "model.safetensors")) if ".experts." in n}
    assert experts and experts <= moved  # each of the 4 experts saw tokens in 2 steps
    assert any(".shared_expert." in n for n in moved), sorted(moved)
    if name.endswith("ep2dp2"):
        saver = runs("qwen2_moe-lora-ep2")
        loaded = torch.load(runs.folder / name / "resumed.pt", weights_only=True)["loaded"]
        assert set(loaded) == set(saver["weights"])
        assert all(torch.equal(loaded[k], w) for k, w in saver["weights"].items())


def test_a_lora_checkpoint_resumes_at_another_layout(runs):
    """The adapters and their Adam state saved at TP=2 load at TP=2 with sequence parallelism and at PP=2 over
    the base read from model.path: the merged weights are the saver's bit for bit (B A of a shard is that shard
    of B A, whatever the split), and the third step each then takes agrees (1e-5: two layouts' fp32 sums)."""
    saver, resumed = runs("qwen2-lora-tp2"), {name: runs(name) for name in ("qwen2-lora-tp2sp", "qwen2-lora-pp2")}
    stepped = {}
    for name, result in resumed.items():
        loaded = torch.load(runs.folder / name / "resumed.pt", weights_only=True)
        assert set(loaded["loaded"]) == set(saver["weights"])
        assert all(torch.equal(loaded["loaded"][k], w) for k, w in saver["weights"].items()), name
        stepped[name] = loaded["stepped"]
    sp, pp = resumed["qwen2-lora-tp2sp"]["resumed_step"], resumed["qwen2-lora-pp2"]["resumed_step"]
    for key in ("loss", "grad_norm", "kl", "entropy"):
        assert sp[key] == pytest.approx(pp[key], rel=1e-5, abs=1e-7), key
    assert_same_weights(stepped["qwen2-lora-tp2sp"], stepped["qwen2-lora-pp2"])


# Context parallelism: every sequence cut into 2 * cp chunks (rank r holds r and 2 * cp - 1 - r), keys and
# values exchanged in the local attention, per-token outputs gathered back; with DP=2, gradients are reduced
# and the distributed optimizer sharded over DP x CP = 4 ranks while the data is split over DP only.
@pytest.mark.parametrize("name", ["qwen2-cp2", "qwen2-dp2cp2"])
def test_context_parallel_matches_single_rank(name, runs):
    assert_same_numbers(runs(name), runs("single-qwen2"))


# Packed micro-batches (train.micro_batch_tokens) and token balancing over DP ranks against the padded
# single-rank run. The fixed batch has 64 real tokens (8 sequences of 6 to 11): a budget of 24 makes 3 to 4
# packed rows, which pipeline stages pad to one length.
@pytest.mark.parametrize("name", [
    "qwen2-pp2-packed",            # PP=2, one DP rank
    "qwen2-dp2-balanced-packed",   # DP=2, samples balanced by tokens, packed
    "qwen2-dp2-balanced",          # DP=2, balanced, padded rows of 2
    "gpt_oss-ep2-packed",          # EP=2, packed rows through sliding-window layers
])
def test_packing_and_dp_balancing_match_single_rank(name, runs):
    from megarl.packing import balanced_partition

    extra = CASES[name][2]
    result = runs(name)
    lengths = result["lengths"]
    assert_same_numbers(result, runs(f"single-{CASES[name][0]}"),
                        lengths=lengths if "--micro-batch-tokens" in extra else None)
    if "--redistribute" in extra:
        # each rank trained on its part of the balanced partition of the global batch; unbalanced, rank 0
        # would hold 6+7+8+9 = 30 tokens and rank 1 34
        parts = balanced_partition(lengths, 2, equal_size=True)
        assert result["trained_rows"] == parts
        loads = [sum(lengths[i] for i in part) for part in parts]
        assert max(loads) - min(loads) < 34 - 30


def test_virtual_pipeline_stages_match_single_rank_and_checkpoints_change_layout(qwen2_4_layers, runs, tmp_path):
    """PP=2 x VPP=2: each rank holds two chunks of one layer (rank 0 layers 0 and 2, rank 1 layers 1 and 3)
    and 4 micro-batches go through the interleaved 1F1B schedule; the numbers are the single-rank ones.
    The actor checkpoint written at PP2xVPP2 loads at PP=1 and the single-rank one at PP2xVPP2: the loaded
    weights are the saver's bit for bit, and the third step each then takes (restored Adam moments
    included) agrees."""
    single, vpp = runs("single-qwen2_4layers"), runs("qwen2_4layers-pp2vpp2")
    assert_same_numbers(vpp, single)
    run_job(1, [["--model", str(qwen2_4_layers), "--out", str(tmp_path / "pp1"),
                 "--resume-from", str(runs.folder / "ckpt_vpp")]], cases_file=tmp_path / "cases.json")
    pp1 = read_result(tmp_path / "pp1")

    vpp_resumed = torch.load(runs.folder / "qwen2_4layers-pp2vpp2" / "resumed.pt", weights_only=True)
    pp1_resumed = torch.load(tmp_path / "pp1" / "resumed.pt", weights_only=True)
    for loaded, saved in ((vpp_resumed["loaded"], single["weights"]), (pp1_resumed["loaded"], vpp["weights"])):
        assert set(loaded) == set(saved)
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    for key, want in pp1["resumed_step"].items():
        assert vpp["resumed_step"][key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert_same_weights(vpp_resumed["stepped"], pp1_resumed["stepped"])


def test_virtual_pipeline_stages_with_packing_match_single_rank(runs):
    """Packed micro-batches through the interleaved schedule: 64 tokens in rows of at most 24 fit in 3, which
    the engine raises to 4 (the schedule takes a multiple of pp = 2)."""
    from megarl.packing import count_bins

    result = runs("qwen2_4layers-pp2vpp2-packed")
    assert count_bins(result["lengths"], 24) == 3
    assert_same_numbers(result, runs("single-qwen2_4layers"), lengths=result["lengths"])


# Shared prompts (train.share_prompts) at every layout of model and data parallelism: the worker's cases with
# --share-prompts also run GRPO groups of 3, 2 and 3 samples (the DP=2 split cuts the middle one between
# ranks; with --redistribute the RL loop's token balancing moves samples of a group between ranks too)
# through one forward and backward of the clipped-ratio + KL + entropy loss with the prompts held once and
# not, packed in rows of at most 24 tokens, on the same weights, and the critic's values (see
# parallel_worker.shared_prompt_check). The MoE case (qwen2_moe-ep2: 2 of 4 experts per rank, its
# load-balancing loss off as train.share_prompts needs) replays random routes in every pass of the actor and
# compares the routing recorded (R2) with and without sharing, sample by sample.
#
# Tolerance, fp32, the single-rank tests' 1e-6 absolute: both passes run the same sharded weights through
# the same collectives; a shared row only changes the row's length and where each sequence sits in it, so
# each token's sums may run in another order. Observed: per-token logprobs and entropy equal (0), but for
# 4.8e-7 (one ulp at ~5) at PP2xVPP2; gradients (after the schedule's reduction over DP, the TP sum of
# sequence-parallel weights and the tied embedding's over stages; largest |g| ~0.2) up to 7.5e-8, critic
# values up to 7.5e-9. The global loss statistics are fp32 sums of order-1 terms, each a few ulps apart
# (the entropy, 4.8, by 4.8e-7 = 1 ulp): compared at 1e-6 relative.
SHARED = [name for name, (_, _, args) in CASES.items() if "--share-prompts" in args]


@pytest.mark.parametrize("name", SHARED)
def test_shared_prompts_match_unshared_under_model_and_data_parallelism(name, runs):
    shared = runs(name)["shared_prompts"]
    diff = shared["max_diff"]
    # a MoE model's: its recorded routing, samples whose routes differ between the layouts (none may)
    moe = {"routes_recorded"} if "moe" in name else set()
    assert set(diff) == {"logprobs", "train_logprobs", "entropy", "grads", "values"} | moe
    for key, worst in diff.items():
        assert worst <= 1e-6, (key, worst)
    assert shared["grad_max"] > 1e-2 and shared["values_max"] > 1e-2  # not all ~0
    for key, want in shared["stats_off"].items():
        assert shared["stats_on"][key] == pytest.approx(want, rel=1e-6, abs=1e-7), key
    assert shared["stats_off"]["clipfrac"] > 0 and shared["stats_off"]["kl"] > 0  # the clip and KL are exercised
    # every rank trained fewer tokens, each group's prompt once per row
    assert all(rank["on"] < rank["off"] for rank in shared["row_tokens"])


def assert_same_numbers(result: dict, reference: dict, *, lengths: list[int] | None = None) -> None:
    """A layout's run equals the single-rank run: logprobs, both models' steps, the trained weights.
    `lengths` restricts the logprob comparison to real tokens (packed rows have no output past them)."""
    assert reference["handoff_exact_on_every_rank"] and result["handoff_exact_on_every_rank"]

    # Logprobs before training: sharded vs whole matmuls differ only in fp32 summation order.
    lp_diff = (torch.tensor(result["logprobs"]) - torch.tensor(reference["logprobs"])).abs()
    if lengths is not None:
        lp_diff = lp_diff[torch.arange(lp_diff.shape[1])[None] < torch.tensor(lengths)[:, None]]
    assert lp_diff.max() <= 1e-4
    for got, want in zip(result["steps"], reference["steps"], strict=True):
        for key in ("loss", "grad_norm", "kl", "clipfrac", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # the critic: loss, value clipping and grad norm over three steps, then the sum of its values
    for got, want in zip(result["critic_steps"], reference["critic_steps"], strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert result["critic_steps"][2]["critic/clipfrac"] > 0  # value clipping is exercised
    assert result["steps"][1]["clipfrac"] > 0  # the second step is off-policy: clipping is exercised
    assert_same_weights(result["weights"], reference["weights"])


def assert_same_weights(weights: dict, reference: dict) -> None:
    """Trained HF state dicts of two layouts agree."""
    assert set(weights) == set(reference)
    # Updated weights: almost every coordinate agrees to 1e-6 (0.05% of one lr=1e-3 Adam step). Adam divides
    # each gradient by its own running scale, so on the few coordinates whose gradient is a near-cancelling
    # sum (true value ~0: key biases, unused vocabulary rows), fp32 reduction-order noise becomes a visible
    # part of the step; those may differ by up to 5% of one step, and at most 0.1% of the model may do so.
    loose = total = 0
    for name, want in reference.items():
        diff = (weights[name] - want).abs()
        assert diff.max() <= 1e-4, f"{name}: max |diff| {diff.max():.3g}"
        loose += int((diff > 1e-6).sum())
        total += diff.numel()
    assert loose <= 1e-3 * total, f"{loose} of {total} coordinates differ by more than 1e-6"
