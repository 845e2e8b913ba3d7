"""Loss aggregation: hand-computed modes, micro-batch invariance, and DP=2 equivalence on gloo."""

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.algo.advantages import whiten
from megarl.algo.aggregate import AGGREGATION_MODES, LossNorm, aggregate, global_loss_norm, masked_mean

NAN = math.nan


def test_modes_hand_computed_with_empty_sequence_and_nan_padding():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    norm = global_loss_norm(mask)
    # 4 valid tokens, 2 non-empty sequences, padded length 3
    assert norm == LossNorm(tokens=4.0, seqs=2.0, max_len=3)
    expected = {
        "token-mean": 10 / 4,  # (1+2+3+4) / tokens
        "seq-mean-token-sum": 10 / 2,  # (6 + 4) / seqs
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,  # (2 + 4) / seqs = 3
        "seq-mean-token-sum-norm": 10 / (2 * 3),  # (6 + 4) / (seqs * max_len)
    }
    for mode, value in expected.items():
        assert aggregate(values, mask, mode=mode, norm=norm).item() == pytest.approx(value), mode


def test_all_empty_batch_gives_zero_not_nan():
    mask = torch.zeros(2, 3)
    norm = global_loss_norm(mask)
    for mode in AGGREGATION_MODES:
        assert aggregate(torch.ones(2, 3), mask, mode=mode, norm=norm).item() == 0.0


def test_unknown_mode_names_the_allowed_modes():
    norm = LossNorm(tokens=1.0, seqs=1.0, max_len=1)
    allowed = "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=allowed):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), mode="sum", norm=norm)


def test_masked_mean_per_row_and_whole():
    values = torch.tensor([[1.0, 3.0, 9.0], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([2.0, 0.0]))
    assert masked_mean(values, mask).item() == 2.0


def _random_batch(seed: int, batch: int, length: int, dim: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, dim, generator=gen)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = 0, length  # always one empty and one full sequence
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return x, mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_split_gives_same_loss_and_gradient(mode):
    x, mask = _random_batch(seed=0, batch=8, length=6, dim=4)
    weight = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(1)))
    norm = global_loss_norm(mask)  # from the whole mini-batch, before splitting

    results = {}
    for n_micro in (1, 2, 4):
        weight.grad = None
        total = 0.0
        for xs, ms in zip(x.chunk(n_micro), mask.chunk(n_micro)):
            contribution = aggregate(torch.tanh(xs @ weight), ms, mode=mode, norm=norm)
            contribution.backward()  # gradients accumulate across micro-batches, as in training
            total += contribution.item()
        results[n_micro] = (total, weight.grad.clone())

    # reference straight from the mode's definition, per sequence, in float64
    per_token = torch.tanh(x.double() @ weight.detach().double())
    seq_sums = [per_token[i][mask[i]].sum().item() for i in range(8)]
    seq_lens = [int(mask[i].sum()) for i in range(8)]
    nonempty = sum(n > 0 for n in seq_lens)
    reference = {
        "token-mean": sum(seq_sums) / sum(seq_lens),
        "seq-mean-token-sum": sum(seq_sums) / nonempty,
        "seq-mean-token-mean": sum(s / n for s, n in zip(seq_sums, seq_lens) if n) / nonempty,
        "seq-mean-token-sum-norm": sum(seq_sums) / (nonempty * 6),
    }[mode]

    # fp32: |values| <= 1 and at most 48 terms, so reordering the sums moves the O(1) result by a few ulps
    # (~1e-7); 1e-6 leaves margin yet would catch any wrong denominator (which changes it by >= 1/48)
    for n_micro, (total, grad) in results.items():
        assert total == pytest.approx(reference, abs=1e-6), n_micro
        torch.testing.assert_close(grad, results[1][1], atol=1e-6, rtol=0)


def _dp_worker(rank: int, world: int, init_file: str, out_dir: str, shards):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    try:
        values, mask = shards[rank]
        group = dist.group.WORLD
        norm = global_loss_norm(mask, group=group)
        losses = {}
        for mode in AGGREGATION_MODES:
            loss = aggregate(values, mask, mode=mode, norm=norm).reshape(1)
            dist.all_reduce(loss, group=group)
            losses[mode] = loss.item()
        result = {"norm": norm, "whiten": whiten(values, mask, group=group), "losses": losses}
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, length - t.shape[1]))


def test_dp2_global_counts_whiten_and_loss_match_one_process(tmp_path):
    # the two ranks hold shards padded to different lengths (5 and 7), as real DP ranks do
    x0, m0 = _random_batch(seed=2, batch=3, length=5, dim=1)
    x1, m1 = _random_batch(seed=3, batch=4, length=7, dim=1)
    shards = [(x0[..., 0], m0), (x1[..., 0], m1)]

    ctx = mp.start_processes(
        _dp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), shards), nprocs=2, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 60
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("DP=2 workers did not finish within 60 s")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    values = torch.cat([_pad(x0[..., 0], 7), _pad(x1[..., 0], 7)])
    mask = torch.cat([_pad(m0, 7), _pad(m1, 7)])
    norm = global_loss_norm(mask)
    whitened = whiten(values, mask)
    for r, result in enumerate(results):
        assert result["norm"] == norm
        for mode in AGGREGATION_MODES:
            expected = aggregate(values, mask, mode=mode, norm=norm).item()
            assert result["losses"][mode] == pytest.approx(expected, abs=1e-6), mode
    torch.testing.assert_close(results[0]["whiten"], whitened[:3, :5], atol=1e-6, rtol=0)
    torch.testing.assert_close(results[1]["whiten"], whitened[3:], atol=1e-6, rtol=0)
