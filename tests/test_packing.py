"""Sequence packing and token balancing: the partitions (hand-computed cases, every sample once, the
balance bounds), the packed layout, the exchange of rollout samples over gloo ranks, and the engine's
packed micro-batches against its padded ones (logprobs, entropy, critic values, a whole train step).

Tolerances: packing changes which sequences share a forward pass, so fp32 sums run in another order;
1e-5 on logprobs and values (observed: 0 to ~1e-7) and rel 1e-5 on loss and grad norm, as for the other
micro-batch invariance tests.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.batch import RolloutBatch
from megarl.packing import (balanced_partition, count_bins, pack, packed_row, plan_micro_batches,
                            zero_advantage_split,
                            redistribute, sequence_lengths, tokens_imbalance, unpack)

pytestmark = pytest.mark.timeout(180)

PACK_TOL = 1e-5


# ---- partitions ------------------------------------------------------------------------------------------
def test_greedy_partition_hand_computed():
    # 5 -> A, 4 -> B, 3 -> B (7), 3 -> A (8), 3 -> B (10)
    assert balanced_partition([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]
    # equal size: round 1 gives 8 and 7, round 2 the heavier 2 to the lighter part (7): 9 and 9
    assert balanced_partition([8, 1, 7, 2], 2, equal_size=True) == [[0, 1], [2, 3]]
    # more parts than weights: the extra parts stay empty
    assert balanced_partition([3, 9], 3) == [[1], [0], []]
    with pytest.raises(ValueError, match="5 weights cannot be split into 2 parts of equal size"):
        balanced_partition([1] * 5, 2, equal_size=True)


@pytest.mark.parametrize("equal_size", [False, True])
def test_partition_assigns_every_sample_once_within_the_bound(equal_size):
    rng = random.Random(0)
    for trial in range(200):
        n_parts = rng.randint(1, 6)
        n = n_parts * rng.randint(1, 8) if equal_size else rng.randint(0, 40)
        weights = [rng.randint(1, 500) for _ in range(n)]
        parts = balanced_partition(weights, n_parts, equal_size=equal_size)
        assert len(parts) == n_parts
        assert sorted(i for part in parts for i in part) == list(range(n)), trial
        if not weights:
            continue
        loads = [sum(weights[i] for i in part) for part in parts]
        mean = sum(weights) / n_parts
        if equal_size:
            assert {len(part) for part in parts} == {n // n_parts}
            assert max(loads) - min(loads) <= max(weights) - min(weights), trial
        else:
            assert max(loads) <= mean + max(weights) * (1 - 1 / n_parts) + 1e-9, trial


def test_micro_batch_plans_respect_the_token_budget():
    # first-fit-decreasing: [6, 4] and [5, 5]
    assert count_bins([6, 5, 5, 4], 10) == 2
    # FFD needs 3 bins of 12 for these, the balanced split fits in 2: [5, 4, 3] twice
    assert count_bins([5, 5, 4, 4, 3, 3], 12) == 3
    assert plan_micro_batches([5, 5, 4, 4, 3, 3], max_tokens=12, n_micro=2) == [[0, 2, 4], [1, 3, 5]]
    # two of three sixes exceed 10 in one of two micro-batches: the caller must ask for more
    assert plan_micro_batches([6, 6, 6], max_tokens=10, n_micro=2) is None
    assert plan_micro_batches([6, 6, 6], max_tokens=10, n_micro=3) == [[0], [1], [2]]
    assert count_bins([], 10) == 0
    with pytest.raises(ValueError, match="a sequence of 11 tokens does not fit in a micro-batch of "
                                         "micro_batch_tokens=10"):
        count_bins([3, 11], 10)


def test_tokens_imbalance_is_max_over_mean():
    assert tokens_imbalance([10, 30]) == 1.5
    assert tokens_imbalance([7, 7, 7]) == 1.0
    assert tokens_imbalance([0, 0]) == 1.0


# ---- the packed layout ---------------------------------------------------------------------------------------
def test_pack_and_unpack_round_trip_with_padding_as_its_own_segment():
    tokens = torch.arange(1, 31).reshape(3, 10)  # row i holds 10i+1 ... 10i+10
    lengths = torch.tensor([4, 10, 2])
    row = packed_row([2, 0], lengths, row_len=9)
    assert row.cu_seqlens.tolist() == [0, 2, 6, 9]  # sequence 2, sequence 0, then 3 padding tokens
    assert row.cu_seqlens.dtype == torch.int32 and row.max_seqlen == 4
    ids, positions = pack(tokens, row)
    assert ids.tolist() == [[21, 22, 1, 2, 3, 4, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1, 2]]  # restart in every segment
    # unpack puts row position start + t in column t; column 0 and columns past the end are 0
    values = torch.arange(9, dtype=torch.float32) + 100
    assert unpack(values, row, width=5).tolist() == [[0, 101, 0, 0, 0], [0, 103, 104, 105, 0]]
    assert packed_row([1], lengths, row_len=10).cu_seqlens.tolist() == [0, 10]  # full: no padding segment
    assert packed_row([], lengths, row_len=1).cu_seqlens.tolist() == [0, 1]     # padding only
    with pytest.raises(ValueError, match="14 tokens do not fit in a packed row of 12"):
        packed_row([0, 1], lengths, row_len=12)


def test_unpack_passes_gradients_to_the_packed_row():
    lengths = torch.tensor([3, 2])
    row = packed_row([0, 1], lengths, row_len=6)
    values = torch.zeros(6, requires_grad=True)
    unpack(values, row, width=4).sum().backward()
    # used: positions 1, 2 (sequence 0) and 4 (sequence 1); 0 and 3 are first tokens, 5 is padding
    assert values.grad.tolist() == [0, 1, 1, 0, 1, 0]


def rollout_batch(n: int, *, seed: int, width: int = 12) -> RolloutBatch:
    """Samples with prompts of 2-4 tokens and responses of 0-8: every field derived from a sample id so
    its rows can be checked after they move."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(n) + 100 * seed
    prompt_lens = torch.randint(2, 5, (n,), generator=gen)
    response_lens = torch.randint(0, 9, (n,), generator=gen)
    mask = torch.zeros(n, width)
    for i in range(n):
        mask[i, prompt_lens[i]: prompt_lens[i] + response_lens[i]] = 1.0
    tokens = ids[:, None].expand(n, width).clone()
    return RolloutBatch(tokens=tokens, response_mask=mask, prompt_lens=prompt_lens,
                        group_ids=torch.arange(n) // 2, rollout_logprobs=-mask, responses=[str(int(i)) for i in ids],
                        answers=["a"] * n, finish_reasons=["stop"] * n, prompt_texts=["p"] * n,
                        metadata=[{"id": int(i)} for i in ids], rewards=ids.float(),
                        advantages=ids[:, None].float() * mask)


def test_sequence_lengths_run_through_the_last_response_token():
    batch = rollout_batch(6, seed=0)
    want = [max(int(p), int(p) + int(m.sum())) for p, m in zip(batch.prompt_lens, batch.response_mask)]
    assert sequence_lengths(batch.response_mask, batch.prompt_lens).tolist() == want


# ---- the exchange over data-parallel ranks -----------------------------------------------------------------
def _exchange_worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    mine, imbalance = redistribute(rollout_batch(8, seed=rank), group=dist.group.WORLD, pad_id=0)
    torch.save((mine, imbalance), f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(worker, world: int, out_dir) -> list:
    """Run `worker(rank, world, out_dir)` in `world` spawned processes (gloo over a file store) and return
    what each saved to OUT_DIR/rank{rank}.pt. A hang fails the test after 120 s."""
    ctx = mp.start_processes(worker, args=(world, str(out_dir)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{worker.__name__} did not finish within 120 s")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_redistribute_moves_every_sample_to_its_balanced_rank(tmp_path):
    world = 2
    results = dict(enumerate(spawn_ranks(_exchange_worker, world, tmp_path)))

    sources = [rollout_batch(8, seed=r) for r in range(world)]
    lengths = torch.cat([sequence_lengths(b.response_mask, b.prompt_lens) for b in sources]).tolist()
    parts = balanced_partition(lengths, world, equal_size=True)
    for rank, (mine, imbalance) in results.items():
        # the samples of the partition, in (source rank, index) order, every field moved with its sample
        want_ids = [100 * (g // 8) + g % 8 for g in parts[rank]]
        assert mine.tokens[:, 0].tolist() == want_ids
        assert mine.rewards.tolist() == [float(i) for i in want_ids]
        assert [m["id"] for m in mine.metadata] == want_ids and mine.responses == [str(i) for i in want_ids]
        for k, g in enumerate(parts[rank]):
            src = sources[g // 8].select(torch.tensor([g % 8]))
            assert torch.equal(mine.advantages[k], src.advantages[0])
            assert torch.equal(mine.response_mask[k], src.response_mask[0])
            assert int(mine.group_ids[k]) == int(src.group_ids[0]) * world + g // 8  # distinct over ranks
        loads = [sum(lengths[g] for g in part) for part in parts]
        assert imbalance == pytest.approx(max(loads) / (sum(loads) / world))
    assert len(results[0][0]) == len(results[1][0]) == 8
    before = [int(sequence_lengths(b.response_mask, b.prompt_lens).sum()) for b in sources]
    assert results[0][1] <= tokens_imbalance(before) + 1e-12


# ---- samples with a zero advantage ------------------------------------------------------------------------------
def with_advantages(batch: RolloutBatch, live: list[int]) -> RolloutBatch:
    """`batch` with a non-zero advantage (on its response tokens only) for the samples in `live`, zero
    advantage elsewhere; sample i's advantage outside its response is non-zero, which must not count."""
    per_sample = torch.tensor([1.0 + i if i in live else 0.0 for i in range(len(batch))])
    outside = 7.0 * (1.0 - batch.response_mask)
    return dataclasses.replace(batch, advantages=per_sample[:, None] * batch.response_mask + outside)


def test_zero_advantage_split_keeps_the_live_samples_and_their_order():
    batch = rollout_batch(8, seed=0)
    batch = dataclasses.replace(batch, response_mask=batch.response_mask.clone())
    batch.response_mask[5] = 0.0  # an empty response: nothing to train, whatever its advantage
    lengths = sequence_lengths(batch.response_mask, batch.prompt_lens).tolist()
    trained, frac = zero_advantage_split(with_advantages(batch, [2, 5, 6]), group=None)
    assert [m["id"] for m in trained.metadata] == [2, 6] and frac == pytest.approx(2 / 8)
    # padded micro-batches of 4 rows: two live samples and the two shortest others, in batch order
    trained, _ = zero_advantage_split(with_advantages(batch, [2, 6]), group=None, multiple=4)
    others = sorted((i for i in range(8) if i not in (2, 6)), key=lambda i: (lengths[i], i))[:2]
    assert [m["id"] for m in trained.metadata] == sorted([2, 6, *others])
    # the fillers run through their prompts only: their responses are masked out, the live ones' are kept
    for k, m in enumerate(trained.metadata):
        want = batch.response_mask[m["id"]] if m["id"] in (2, 6) else torch.zeros(batch.response_mask.shape[1])
        assert torch.equal(trained.response_mask[k], want), m["id"]
    # nothing to train: one sample still runs (the step's collectives and optimizer step happen everywhere)
    trained, frac = zero_advantage_split(with_advantages(batch, []), group=None)
    assert len(trained) == 1 and lengths[trained.metadata[0]["id"]] == min(lengths) and frac == 0.0
    assert trained.response_mask.sum() == 0
    # every sample with a response is live (1 and 5 have none); micro-batches of 8 rows keep the batch itself
    whole = with_advantages(batch, list(range(8)))
    assert [m["id"] for m in zero_advantage_split(whole, group=None)[0].metadata] == [0, 2, 3, 4, 6, 7]
    trained, frac = zero_advantage_split(whole, group=None, multiple=8)
    assert trained is whole and frac == pytest.approx(6 / 8)
    # kept whole, the samples with a zero advantage still run through their prompts only
    trained, _ = zero_advantage_split(with_advantages(batch, [2, 6]), group=None, multiple=8)
    assert len(trained) == 8 and trained.response_mask.sum(1).nonzero().flatten().tolist() == [2, 6]


def _zero_advantage_worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    batch = with_advantages(rollout_batch(8, seed=rank), [[0, 3, 4], [2]][rank])
    trained, frac = zero_advantage_split(batch, group=dist.group.WORLD)
    mine, _ = redistribute(trained, group=dist.group.WORLD, pad_id=0)
    torch.save(([m["id"] for m in trained.metadata], frac, [m["id"] for m in mine.metadata]),
               f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_zero_advantage_split_keeps_as_many_samples_on_every_data_parallel_rank(tmp_path):
    """Rank 0 has 3 samples to train, rank 1 one: both keep 3 (rank 1 adds its two shortest others), so the
    token balancing that follows can move them."""
    results = spawn_ranks(_zero_advantage_worker, 2, tmp_path)
    assert results[0][0] == [0, 3, 4]
    source = rollout_batch(8, seed=1)
    lengths = sequence_lengths(source.response_mask, source.prompt_lens).tolist()
    others = sorted((i for i in range(8) if i != 2), key=lambda i: (lengths[i], i))[:2]
    assert results[1][0] == sorted(100 + i for i in [2, *others])
    assert results[0][1] == results[1][1] == pytest.approx(4 / 16)
    assert len(results[0][2]) == len(results[1][2]) == 3
    assert sorted(results[0][2] + results[1][2]) == sorted(results[0][0] + results[1][0])


# ---- the engine: packed micro-batches against padded ones -------------------------------------------------------
N_TOKENS = 98  # real tokens of the tiny tokenizer


def ragged_batch(batch: int = 6, width: int = 20, seed: int = 3):
    """[B, T] tokens with real lengths 3..T (the rest padding), a response after a 2-token prompt, advantages
    of both signs, and a row id to find each row in any micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([20, 7, 13, 3, 16, 9])[:batch]
    tokens = torch.randint(3, N_TOKENS, (batch, width), generator=gen)
    tokens[torch.arange(width)[None] >= lengths[:, None]] = 0
    mask = ((torch.arange(width)[None] >= 2) & (torch.arange(width)[None] < lengths[:, None])).float()
    advantages = torch.linspace(-1.0, 1.0, batch)[:, None] * mask
    return tokens, lengths, mask, advantages


def valid(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width)[None] < lengths[:, None]


def make_engine(model_dir, groups, *, train: bool, value_head: bool = False):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True) if train else None
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups, optim=optim,
                       value_head=value_head)


def test_packed_attention_mask_is_block_diagonal_causal():
    from megarl.engine.local_attention import block_causal_mask

    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5, device="cpu")
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 1, 1, 0],
                       [0, 0, 1, 1, 1]]


def test_packed_logprobs_equal_padded_and_attention_stays_inside_each_sequence(qwen2_dir, groups):
    import megarl.engine.local_attention as local_attention

    engine = make_engine(qwen2_dir, groups, train=False)
    tokens, lengths, _, _ = ragged_batch()
    ok = valid(lengths, tokens.shape[1])
    padded = engine.logprobs(tokens, temperature=0.7, micro_batch_size=6)
    # 73 tokens under a budget of 32: three packed rows of two sequences each
    packed = engine.logprobs(tokens, temperature=0.7, micro_batch_size=6, lengths=lengths, micro_batch_tokens=32)
    assert (packed - padded)[ok].abs().max() <= PACK_TOL
    assert torch.equal(packed[~ok], torch.zeros(int((~ok).sum())))  # nothing past a sequence's end
    one_per_row = engine.logprobs(tokens, temperature=0.7, micro_batch_size=6, lengths=lengths,
                                  micro_batch_tokens=20)
    assert (one_per_row - padded)[ok].abs().max() <= PACK_TOL

    # The check has teeth: one segment over the whole row (plain causal attention) lets sequences see their
    # neighbours.
    bounds = local_attention.segment_bounds
    try:
        local_attention.segment_bounds = lambda params: torch.tensor([0, int(bounds(params)[-1])])
        leaky = engine.logprobs(tokens, temperature=0.7, micro_batch_size=6, lengths=lengths,
                                micro_batch_tokens=32)
    finally:
        local_attention.segment_bounds = bounds
    assert (leaky - padded)[ok].abs().max() > 1e-2


def test_a_sequence_longer_than_the_token_budget_is_refused(qwen2_dir, groups):
    engine = make_engine(qwen2_dir, groups, train=False)
    tokens, lengths, _, _ = ragged_batch()
    with pytest.raises(ValueError, match="a sequence of 20 tokens does not fit in a micro-batch of "
                                         "micro_batch_tokens=19"):
        engine.logprobs(tokens, temperature=1.0, micro_batch_size=6, lengths=lengths, micro_batch_tokens=19)
    with pytest.raises(ValueError, match="need the sequence lengths"):
        engine.logprobs(tokens, temperature=1.0, micro_batch_size=6, micro_batch_tokens=64)


def recording(loss_fn, seen: dict):
    """A loss function that also keeps the logprobs and entropy it saw, by row id."""
    def wrapped(logprobs, mb, **kwargs):
        for k, row in enumerate(mb["row_id"][:, 0].long().tolist()):
            seen[row] = (logprobs[k].detach().clone(), kwargs["entropy"][k].detach().clone())
        return loss_fn(logprobs, mb, **kwargs)
    return wrapped


def test_packed_train_step_equals_padded_with_entropy(qwen2_dir, groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens, lengths, mask, advantages = ragged_batch()
    ok = valid(lengths, tokens.shape[1])
    base = make_engine(qwen2_dir, groups, train=False).logprobs(tokens, temperature=1.0, micro_batch_size=6)
    noise = 0.3 * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(7))
    extras = {"response_mask": mask, "old_logprobs": (base + noise) * mask, "ref_logprobs": base * mask,
              "advantages": advantages, "row_id": torch.arange(6.0)[:, None].expand(-1, tokens.shape[1])}
    algo = AlgoConfig(kl_coef=0.1, entropy_coef=0.05)
    loss_fn = partial(policy_objective(algo), norm=global_loss_norm(mask))

    runs = {}
    for budget in (None, 32):
        actor, seen = make_engine(qwen2_dir, groups, train=True), {}
        metrics = [actor.train_step(tokens, extras, recording(loss_fn, seen), temperature=1.0, micro_batch_size=2,
                                    entropy=True, lengths=lengths, micro_batch_tokens=budget) for _ in range(2)]
        weights = {name: t.detach().clone() for name, t in actor.hf_tensors()}
        runs[budget] = metrics, seen, weights
    (padded, seen_p, w_p), (packed, seen_k, w_k) = runs[None], runs[32]
    for row in range(6):  # the last step's forward, row by row (before the second update)
        for got, want in zip(seen_k[row], seen_p[row]):
            assert (got - want)[ok[row]].abs().max() <= PACK_TOL
    assert packed[1]["clipfrac"] > 0  # the second step is off its old logprobs: clipping is exercised
    for got, want in zip(packed, padded):
        for key in ("loss", "grad_norm", "kl", "clipfrac", "entropy", "pg_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
    # Updated weights after two Adam steps of lr 1e-3, as in the parallel-layout test: almost every coordinate
    # agrees to 1e-6 (0.05% of one step). Adam divides each gradient by its own running scale, so where a
    # gradient is a near-cancelling sum, fp32 order noise is a visible part of the step: those may differ
    # by up to 5% of a step, and at most 0.1% of the model may.
    loose = total = 0
    for name, want in w_p.items():
        diff = (w_k[name] - want).abs()
        assert diff.max() <= 1e-4, f"{name}: max |diff| {diff.max():.3g}"
        loose += int((diff > 1e-6).sum())
        total += diff.numel()
    assert loose <= 1e-3 * total, f"{loose} of {total} coordinates differ by more than 1e-6"


def test_packed_critic_values_and_train_step_equal_padded(qwen2_dir, groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.objective import CriticObjective

    tokens, lengths, mask, advantages = ragged_batch()
    ok = valid(lengths, tokens.shape[1])
    results = {}
    for budget in (None, 32):
        critic = make_engine(qwen2_dir, groups, train=True, value_head=True)
        # a critic with a nonzero head, so values differ between positions
        critic.module.output_layer.weight.data.normal_(generator=torch.Generator().manual_seed(0))
        values = critic.values(tokens, micro_batch_size=3, lengths=lengths, micro_batch_tokens=budget)
        extras = {"response_mask": mask, "values": values * mask, "returns": advantages}
        step = critic.train_step(tokens, extras, partial(CriticObjective(value_clip=0.5), norm=global_loss_norm(mask)),
                                 temperature=1.0, micro_batch_size=3, lengths=lengths, micro_batch_tokens=budget)
        after = critic.values(tokens, micro_batch_size=3, lengths=lengths, micro_batch_tokens=budget)
        results[budget] = values, step, after
    (v_p, s_p, a_p), (v_k, s_k, a_k) = results[None], results[32]
    assert v_p[ok].abs().max() > 0.1
    assert (v_k - v_p)[ok].abs().max() <= PACK_TOL and (a_k - a_p)[ok].abs().max() <= PACK_TOL
    for key in ("critic/loss", "grad_norm", "critic/values_mean"):
        assert s_k[key] == pytest.approx(s_p[key], rel=1e-5, abs=1e-9), key


# ---- layouts the engine refuses ------------------------------------------------------------------------------
def test_bad_virtual_stage_count_is_refused_naming_the_key():
    from megarl.config import RecipeError
    from megarl.job import check_megatron_fields

    with pytest.raises(RecipeError, match=r"model.megatron.virtual_pipeline_model_parallel_size = 0: the number "
                                          r"of virtual pipeline stages per pipeline rank must be a whole number"):
        check_megatron_fields({"virtual_pipeline_model_parallel_size": 0})
    check_megatron_fields({"virtual_pipeline_model_parallel_size": 2})  # the layout checks come at launch
    check_megatron_fields({"recompute_granularity": None})  # other fields pass


# ---- the RL loop ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(420)
def test_ppo_run_on_two_dp_ranks_packs_and_balances(qwen2_dir, arithmetic_dir, tmp_path):
    """`megarl train` under torchrun with two DP ranks, PPO (actor, reference and critic all packed): the
    packed trainer logprobs equal the rollout engine's (contract 2), and samples are balanced by tokens."""
    from conftest import run_python
    from test_cli import read_metrics, write_recipe

    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "ppo.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "megarl", "train",
                       str(recipe), "algo.name=ppo", "train.steps=2", "warmup.sft_steps=0",
                       "train.micro_batch_tokens=40", "checkpoint.save_final=false", "data.eval_path=null"],
                      timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["rollout/logprob_diff_max"] <= 1e-4, record  # fp32, the same function
        # 8 short samples per rank: the spread between ranks is at most longest - shortest sample
        assert 1.0 <= record["train/tokens_imbalance"] <= 1.25, record
        for key in ("loss", "grad_norm", "critic/loss", "critic/grad_norm"):
            assert math.isfinite(record[key]), key
