"""Context parallelism pieces: the load-balanced split, the differentiable gather of per-token outputs, the
key/value exchange of the CPU attention, and the engine's logprobs under CP=2.

The whole-run invariance (loss, grad norm and weights after two steps equal to one rank) is in
test_parallel.py; these tests pin each piece against an independent reference on two gloo ranks started with
torch.multiprocessing (one spawn for all of them, bounded by a deadline).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.engine.context_parallel import cp_positions, split_sequence

WORKER_DEADLINE_S = 180  # two ranks import Megatron and build a tiny model: ~20 s on 2 cores
SEQ_LEN = 8  # for the gather and attention checks: 2 * cp chunks of 2
ODD_LEN = 13  # for the engine: not a multiple of 2 * cp, so the engine pads the columns


def test_rank_r_holds_chunks_r_and_its_mirror():
    # 8 positions in 2 * cp = 4 chunks of 2: rank 0 holds the first and last chunk, rank 1 the middle two
    assert cp_positions(8, cp=2, rank=0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, cp=2, rank=1).tolist() == [2, 3, 4, 5]
    # every position is held by exactly one rank
    held = torch.cat([cp_positions(12, cp=3, rank=r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(12))
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 \* cp = 4"):
        cp_positions(10, cp=2, rank=0)
    values = torch.arange(16).reshape(2, 8)
    assert split_sequence(values, cp=2, rank=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert split_sequence(values, cp=1, rank=0) is values


def test_hierarchical_exchange_is_refused_naming_the_key(qwen2_dir):
    from megarl.engine.model import transformer_config
    from megarl.models.arch import read_shape

    with pytest.raises(ValueError, match=r"model.megatron.cp_comm_type = 'a2a\+p2p' .* is not supported"):
        transformer_config(read_shape(qwen2_dir), dtype="float32", tp=1, pp=1, cp=2,
                           megatron={"cp_comm_type": "a2a+p2p"})


def _worker(rank: int, init_file: str, out_dir: str, model_dir: str, tokens: torch.Tensor) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.engine.context_parallel import gather_sequence
    from megarl.engine.local_attention import PackedLocalAttention
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.engine.parallel import init_parallel

    groups = init_parallel(tp=1, pp=1, cp=2, seed=0)
    result = {}
    # Megatron's rotary table slice for this rank is the split the engine makes
    table = torch.arange(SEQ_LEN)[:, None]
    result["rope_positions"] = get_pos_emb_on_this_cp_rank(table, 0, groups.cp)[:, 0]

    # gather: the shares of both ranks back in sequence order; its gradient is this rank's positions
    gen = torch.Generator().manual_seed(7)
    full, weight = torch.randn(3, SEQ_LEN, 2, generator=gen), torch.randn(3, SEQ_LEN, 2, generator=gen)
    local = split_sequence(full, cp=2, rank=groups.cp_rank).requires_grad_()
    gathered = gather_sequence(local, group=groups.cp)
    (gathered * weight).sum().backward()
    result["gathered"], result["gather_grad"] = gathered.detach(), local.grad

    # attention: this rank's queries against the exchanged keys and values, GQA with 4 heads in 2 groups
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, context_parallel_size=2, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    attention = PackedLocalAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(SEQ_LEN, 2, heads, 16, generator=gen) for heads in (4, 2, 2))
    out_weight = torch.randn(SEQ_LEN, 2, 64, generator=gen)
    mine = cp_positions(SEQ_LEN, cp=2, rank=groups.cp_rank)
    local_qkv = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local_qkv, None)
    (out * out_weight[mine]).sum().backward()
    result["attention"] = out.detach()
    result["attention_grads"] = [t.grad for t in local_qkv]
    # the reference: Megatron's own local attention over the whole sequence under its causal mask
    whole = DotProductAttention(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                                  num_query_groups=2, kv_channels=16, attention_dropout=0.0,
                                                  masked_softmax_fusion=False, use_cpu_initialization=True),
                                1, AttnMaskType.causal, "self")
    full_qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = whole(*full_qkv, None)
    (ref * out_weight).sum().backward()
    result["attention_ref"] = ref.detach()[mine]
    result["attention_ref_grads"] = [t.grad[mine] for t in full_qkv]

    # the engine: logprobs of whole sequences on every CP rank, columns padded from 13 to 16 inside
    engine = TrainEngine(model_dir=model_dir, shape=read_shape(model_dir), dtype="float32", megatron={}, groups=groups)
    result["logprobs"] = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    try:
        engine.logprobs(tokens, temperature=1.0, micro_batch_size=2, micro_batch_tokens=64,
                        lengths=torch.full((len(tokens),), ODD_LEN))
    except ValueError as e:
        result["packing_error"] = str(e)
    result["mp_ranks"] = dist.get_process_group_ranks(groups.mp)
    result["mp_src"] = groups.mp_src_global_rank
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp2(qwen2_dir, tmp_path_factory):
    """Both ranks' results, and the inputs they were computed from."""
    out = tmp_path_factory.mktemp("cp2")
    tokens = torch.randint(3, 98, (4, ODD_LEN), generator=torch.Generator().manual_seed(1234))
    ctx = mp.start_processes(_worker, args=(str(out / "init"), str(out), str(qwen2_dir), tokens), nprocs=2,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + WORKER_DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"CP=2 workers did not finish within {WORKER_DEADLINE_S} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], tokens


def test_split_matches_megatron_rotary_slice_and_gather_round_trips(cp2):
    results, _ = cp2
    gen = torch.Generator().manual_seed(7)
    full, weight = torch.randn(3, SEQ_LEN, 2, generator=gen), torch.randn(3, SEQ_LEN, 2, generator=gen)
    for rank, result in enumerate(results):
        assert result["rope_positions"].tolist() == cp_positions(SEQ_LEN, cp=2, rank=rank).tolist()
        assert torch.equal(result["gathered"], full)  # a copy: exact
        # each rank's loss is the same function of the whole sequences: its gradient, on its positions
        assert torch.equal(result["gather_grad"], split_sequence(weight, cp=2, rank=rank))


def test_cp2_attention_equals_full_causal_attention(cp2):
    """Output and the gradients of query, key and value (the keys' and values' through the exchange's
    reduce-scatter) equal Megatron's attention over the whole sequence. Tolerance 1e-6: the same fp32
    products, summed over the keys in another order."""
    results, _ = cp2
    for result in results:
        torch.testing.assert_close(result["attention"], result["attention_ref"], atol=1e-6, rtol=0)
        for got, want in zip(result["attention_grads"], result["attention_ref_grads"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_cp2_engine_logprobs_equal_transformers(cp2, qwen2_dir):
    """Contract 1 under CP=2 with a length that is not a multiple of 2 * cp (fp32, <= 1e-4 as for every
    layout); both CP ranks return the whole sequences."""
    from transformers import AutoModelForCausalLM

    results, tokens = cp2
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens).logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    expected = torch.nn.functional.pad(lp, (1, 0))
    for result in results:
        assert result["logprobs"].shape == tokens.shape
        assert (result["logprobs"] - expected).abs().max() <= 1e-4


def test_cp_ranks_form_one_replica_and_refuse_packing(cp2):
    results, _ = cp2
    # both CP ranks belong to one data-parallel replica: one of them (rank 0) feeds the rollout engine
    assert [r["mp_ranks"] for r in results] == [[0, 1], [0, 1]]
    assert [r["mp_src"] for r in results] == [0, 0]
    for result in results:
        assert "train.micro_batch_tokens" in result["packing_error"]
        assert "parallel.cp = 2" in result["packing_error"]
