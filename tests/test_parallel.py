"""Every parallel layout gives the numbers of one rank: TP=2, PP=2, DP=2, TP2xPP2, DP2xTP2, virtual pipeline
stages PP2xVPP2, context parallel CP=2 and DP2xCP2, sequence parallel TP=2, and expert parallel EP=2, EP2xPP2
and EP2xTP2 (with sequence parallelism) on MoE models, on gloo ranks.

Each layout runs tests/parallel_worker.py under torchrun (two optimizer steps of the PPO + KL + entropy
policy loss on one fixed global batch; MoE models add their load-balancing loss; then three steps of a
critic with a scalar head) and is compared with the single-rank run of the same worker. Every rank's weight
handoff must reproduce the HF checkpoint bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, _tiny_model_tool, run_python

LAYOUT_TIMEOUT_S = 300  # 4 gloo ranks on 2 cores take ~30 s; a hang fails the test instead of stalling CI


def run_layout(model_dir, out_dir, *, nproc: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
               extra: tuple[str, ...] = ()) -> dict:
    args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "parallel_worker.py"), "--model", str(model_dir), "--out", str(out_dir),
            "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--cp", str(cp), *extra]
    proc = run_python(args, timeout_s=LAYOUT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out_dir / "result.json").read_text())
    result["weights"] = torch.load(out_dir / "weights.pt", weights_only=True)
    return result


@pytest.fixture(scope="module")
def single_rank(arch_dir, tmp_path_factory):
    """The single-rank run of each architecture, made on first use."""
    out, runs = tmp_path_factory.mktemp("layout_single"), {}

    def get(arch: str) -> dict:
        if arch not in runs:
            runs[arch] = run_layout(arch_dir(arch), out / arch, nproc=1)
        return runs[arch]
    return get


@pytest.mark.timeout(2 * LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("arch,nproc,tp,pp,ep", [
    ("qwen2", 2, 2, 1, 1),      # TP=2
    ("qwen2", 2, 1, 2, 1),      # PP=2, 4 micro-batches through the 1F1B schedule
    ("qwen2", 2, 1, 1, 1),      # DP=2
    ("qwen2", 4, 2, 2, 1),      # TP2 x PP2
    ("qwen2", 4, 2, 1, 1),      # DP2 x TP2
    ("llama", 2, 2, 1, 1),      # untied output layer split over the vocabulary
    ("llama", 2, 1, 2, 1),      # untied output layer on the last stage only
    ("qwen2_moe", 2, 1, 1, 2),  # EP=2 (DP=2 for the dense weights): 2 of 4 experts per rank, shared expert
    ("mixtral", 4, 1, 2, 2),    # EP2 x PP2: experts split inside each pipeline stage
], ids=["qwen2-tp2", "qwen2-pp2", "qwen2-dp2", "qwen2-tp2pp2", "qwen2-dp2tp2", "llama-tp2", "llama-pp2",
        "qwen2_moe-ep2", "mixtral-ep2pp2"])
def test_layout_matches_single_rank(arch, nproc, tp, pp, ep, single_rank, arch_dir, tmp_path):
    result = run_layout(arch_dir(arch), tmp_path, nproc=nproc, tp=tp, pp=pp, ep=ep)
    assert_same_numbers(result, single_rank(arch))


# Sequence parallelism (model.megatron.sequence_parallel): outside attention and the MLPs, each TP rank holds
# every activation for its slice of the sequence; norm weights, the routers and the critic's value head see
# only that slice, and their gradients are summed over TP. Qwen3 adds q/k norms over TP-split heads; packed
# rows of 23 tokens (64 in rows of at most 24 make 18, 23, 23) are padded to split evenly. MoE layers train
# under TP only with sequence parallelism: EP2 x TP2 gathers each TP rank's routed tokens, as many as its
# router chose, inside the expert layer.
@pytest.mark.timeout(2 * LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("arch,nproc,ep,extra", [
    ("qwen3", 2, 1, ("--micro-batch-tokens", "24")),
    ("qwen2_moe", 4, 2, ()),
], ids=["qwen3-tp2sp-packed", "qwen2_moe-ep2tp2sp"])
def test_sequence_parallel_matches_single_rank(arch, nproc, ep, extra, single_rank, arch_dir, tmp_path):
    from megarl.packing import count_bins, plan_micro_batches

    result = run_layout(arch_dir(arch), tmp_path, nproc=nproc, tp=2, ep=ep, extra=("--sequence-parallel", *extra))
    assert_same_numbers(result, single_rank(arch), lengths=result["lengths"] if extra else None)
    if extra:
        lengths = result["lengths"]
        rows = plan_micro_batches(lengths, max_tokens=24, n_micro=count_bins(lengths, 24))
        assert any(sum(lengths[i] for i in row) % 2 for row in rows)  # a row the engine pads for tp = 2


# Context parallelism: every sequence cut into 2 * cp chunks (rank r holds r and 2 * cp - 1 - r), keys and
# values exchanged in the local attention, per-token outputs gathered back; with DP=2, gradients are reduced
# and the distributed optimizer sharded over DP x CP = 4 ranks while the data is split over DP only.
@pytest.mark.timeout(2 * LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("nproc", [2, 4], ids=["qwen2-cp2", "qwen2-dp2cp2"])
def test_context_parallel_matches_single_rank(nproc, single_rank, arch_dir, tmp_path):
    result = run_layout(arch_dir("qwen2"), tmp_path, nproc=nproc, cp=2)
    assert_same_numbers(result, single_rank("qwen2"))


# Packed micro-batches (train.micro_batch_tokens) and token balancing over DP ranks against the padded
# single-rank run. The fixed batch has 64 real tokens (8 sequences of 6 to 11): a budget of 24 makes 3 to 4
# packed rows, which pipeline stages pad to one length.
@pytest.mark.timeout(2 * LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("pp,extra", [
    (2, ("--micro-batch-tokens", "24")),                      # PP=2, one DP rank
    (1, ("--micro-batch-tokens", "24", "--redistribute")),    # DP=2, samples balanced by tokens, packed
    (1, ("--redistribute",)),                                 # DP=2, balanced, padded rows of 2
], ids=["qwen2-pp2-packed", "qwen2-dp2-balanced-packed", "qwen2-dp2-balanced"])
def test_packing_and_dp_balancing_match_single_rank(pp, extra, single_rank, arch_dir, tmp_path):
    from megarl.packing import balanced_partition

    reference = single_rank("qwen2")
    result = run_layout(arch_dir("qwen2"), tmp_path, nproc=2, pp=pp, extra=extra)
    lengths = result["lengths"]
    assert_same_numbers(result, reference, lengths=lengths if "--micro-batch-tokens" in extra else None)
    if "--redistribute" in extra:
        # each rank trained on its part of the balanced partition of the global batch; unbalanced, rank 0
        # would hold 6+7+8+9 = 30 tokens and rank 1 34
        parts = balanced_partition(lengths, 2, equal_size=True)
        assert result["trained_rows"] == parts
        loads = [sum(lengths[i] for i in part) for part in parts]
        assert max(loads) - min(loads) < 34 - 30


@pytest.fixture(scope="module")
def qwen2_4_layers(tiny_models):
    """The tiny Qwen2 with 4 layers: one per chunk of PP=2 x VPP=2."""
    return _tiny_model_tool().make_tiny_model(tiny_models / "qwen2_4layers_seed0", arch="qwen2", seed=0, layers=4)


@pytest.fixture(scope="module")
def single_4_layers(qwen2_4_layers, tmp_path_factory):
    """The single-rank run of the 4-layer model, and the actor checkpoint it saved after its two steps."""
    out = tmp_path_factory.mktemp("layout_single_4_layers")
    return run_layout(qwen2_4_layers, out / "run", nproc=1, extra=("--save", str(out / "ckpt"))), out / "ckpt"


@pytest.mark.timeout(4 * LAYOUT_TIMEOUT_S)
def test_virtual_pipeline_stages_match_single_rank_and_checkpoints_change_layout(qwen2_4_layers, single_4_layers,
                                                                                 tmp_path):
    """PP=2 x VPP=2: each rank holds two chunks of one layer (rank 0 layers 0 and 2, rank 1 layers 1 and 3)
    and 4 micro-batches go through the interleaved 1F1B schedule; the numbers are the single-rank ones.
    The actor checkpoint written at PP2xVPP2 loads at PP=1 and the single-rank one at PP2xVPP2: the loaded
    weights are the saver's bit for bit, and the third step each then takes (restored Adam moments
    included) agrees."""
    single, single_ckpt = single_4_layers
    vpp = run_layout(qwen2_4_layers, tmp_path / "vpp", nproc=2, pp=2,
                     extra=("--vpp", "2", "--save", str(tmp_path / "ckpt_vpp"),
                            "--resume-from", str(single_ckpt)))
    assert_same_numbers(vpp, single)
    pp1 = run_layout(qwen2_4_layers, tmp_path / "pp1", nproc=1, extra=("--resume-from", str(tmp_path / "ckpt_vpp")))

    vpp_resumed = torch.load(tmp_path / "vpp" / "resumed.pt", weights_only=True)
    pp1_resumed = torch.load(tmp_path / "pp1" / "resumed.pt", weights_only=True)
    for loaded, saved in ((vpp_resumed["loaded"], single["weights"]), (pp1_resumed["loaded"], vpp["weights"])):
        assert set(loaded) == set(saved)
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    for key, want in pp1["resumed_step"].items():
        assert vpp["resumed_step"][key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert_same_weights(vpp_resumed["stepped"], pp1_resumed["stepped"])


@pytest.mark.timeout(2 * LAYOUT_TIMEOUT_S)
def test_virtual_pipeline_stages_with_packing_match_single_rank(qwen2_4_layers, single_4_layers, tmp_path):
    """Packed micro-batches through the interleaved schedule: 64 tokens in rows of at most 24 fit in 3, which
    the engine raises to 4 (the schedule takes a multiple of pp = 2)."""
    from megarl.packing import count_bins

    single, _ = single_4_layers
    result = run_layout(qwen2_4_layers, tmp_path, nproc=2, pp=2, extra=("--vpp", "2", "--micro-batch-tokens", "24"))
    assert count_bins(result["lengths"], 24) == 3
    assert_same_numbers(result, single, lengths=result["lengths"])


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
