"""The Megatron train engine on tiny HF checkpoints (fp32, one rank: gloo on CPU, NCCL on a GPU): parity
with transformers, bit-exact HF round trip, the weight push into the native rollout engine, the step-0
contract, and micro-batch invariance of a training step. On a GPU also bf16 parity and trainer offload.

Tolerances: 1e-4 on logits/logprobs is DESIGN's contract for two fp32 implementations of the same function
(different matmul/softmax orders give ~1e-7 here); equality where the same code runs on the same weights.
bf16 (GPU): see BF16_MEAN_TOL.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from conftest import _tiny_model_tool, needs_cuda, run_python, with_score_head

pytestmark = pytest.mark.timeout(120)

FP32_TOL = 1e-4  # DESIGN contract 1/2: two fp32 implementations of one function
N_TOKENS = 98  # real tokens of the tiny tokenizer (the embedding is padded to 128 rows)


def make_engine(model_dir, groups, *, train: bool, dtype: str = "float32", megatron: dict | None = None):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True) if train else None
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, megatron=megatron or {}, groups=groups, optim=optim)


def fixed_tokens(batch: int = 4, seq_len: int = 16, seed: int = 1234) -> torch.Tensor:
    """[B, T] token ids drawn from the real vocabulary with a private generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, N_TOKENS, (batch, seq_len), generator=gen)


def response_mask(tokens: torch.Tensor, prompt_len: int = 5) -> torch.Tensor:
    """[B, T] 1.0 on the response tokens; responses of different lengths, like a real rollout."""
    batch, seq_len = tokens.shape
    mask = torch.zeros(batch, seq_len)
    for i in range(batch):
        mask[i, prompt_len: seq_len - i] = 1.0
    return mask


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Engine-aligned logprobs [B, T] from logits [B, T, V]: column t scores token t, column 0 is 0."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    lp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@torch.no_grad()
def hf_logits(model_dir, tokens, *, dtype=torch.float32, device="cpu"):
    """transformers' logits [B, T, V] of `tokens`, as fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    return model(tokens.to(device)).logits.float().cpu()


@torch.no_grad()
def native_logprobs(engine, tokens):
    """The rollout engine's own model, scored directly (temperature 1)."""
    logits = engine.model(tokens.to(engine.device)).logits.cpu()
    return token_logprobs(logits, tokens)


def engine_weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in engine.hf_tensors()}


ARCHS = ("qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
         "gpt_oss", "gemma3")




@pytest.fixture(params=ARCHS)
def model_dir(request, arch_dir):
    return arch_dir(request.param)


# ---- contract 1: Megatron == transformers ----------------------------------------------------------------
def test_logprobs_and_logits_equal_transformers(model_dir, groups):
    engine = make_engine(model_dir, groups, train=False)
    tokens = fixed_tokens()
    ref_logits = hf_logits(model_dir, tokens)

    for temperature in (1.0, 0.7):
        logprobs = engine.logprobs(tokens, temperature=temperature, micro_batch_size=2)
        assert logprobs.shape == tokens.shape
        assert torch.equal(logprobs[:, 0], torch.zeros(tokens.shape[0]))
        expected = token_logprobs(ref_logits, tokens, temperature=temperature)
        assert (logprobs - expected).abs().max() <= FP32_TOL, temperature

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    device = next(engine.module.parameters()).device
    with torch.no_grad():
        logits = engine.module(tokens.to(device), positions.to(device), None).cpu()  # [B, T, padded V]
    vocab = ref_logits.shape[-1]
    assert logits.shape[:2] == tokens.shape
    assert (logits[..., :vocab] - ref_logits).abs().max() <= FP32_TOL


def test_every_megatron_parameter_has_one_name_rule(model_dir, groups):
    from megarl.models.names import fill, name_rules

    from megarl.engine.model import named_weights

    engine = make_engine(model_dir, groups, train=False)
    shape, expected = engine.shape, set()
    for rule in name_rules(shape):
        layers = [i for i in range(shape.layers) if rule.moe in (None, shape.is_moe_layer(i))] \
            if "{}" in rule.megatron else [None]
        experts = range(shape.experts) if "{e}" in rule.megatron else [None]  # one EP rank: all local
        expected |= {fill(rule.megatron, layer=i, expert=j) for i in layers for j in experts}
    # the weights HF checkpoints hold: every parameter, and the sigmoid routers' expert bias buffers
    assert {name for name, _ in named_weights(engine.module)} == expected


# Each MoE router convention is a TransformerConfig field; flipping it (or dropping Qwen2-MoE's shared-expert
# gate) must move the logits far beyond FP32_TOL, so the parity test above really checks the mapping.
@pytest.mark.parametrize("arch,wrong", [
    ("mixtral", {"moe_router_pre_softmax": True}),     # renormalized top-k, not raw softmax probabilities
    ("qwen2_moe", {"moe_router_pre_softmax": False}),  # norm_topk_prob false: raw softmax probabilities
    ("qwen3_moe", {"moe_router_pre_softmax": True}),   # norm_topk_prob true
    ("qwen2_moe", {"moe_shared_expert_gate": False}),  # sigmoid gate on the shared expert
    ("glm4_moe", {"moe_router_enable_expert_bias": False}),  # experts chosen by the biased scores
    ("deepseek_v3", {"moe_router_num_groups": None, "moe_router_group_topk": None}),  # top-1 of 2 expert groups
    ("deepseek_v3", {"moe_router_topk_scaling_factor": None}),  # routed weights scaled by 2.5
], ids=["mixtral-pre-softmax", "qwen2_moe-renormalized", "qwen3_moe-pre-softmax", "qwen2_moe-ungated-shared",
        "glm4_moe-unbiased-choice", "deepseek_v3-ungrouped", "deepseek_v3-unscaled"])
def test_a_wrong_router_convention_breaks_parity(arch, wrong, arch_dir, groups):
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    model_dir = arch_dir(arch)
    tokens = fixed_tokens()
    engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron=wrong, groups=groups)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = engine.module(tokens, positions, None)[..., :N_TOKENS]
    assert (logits - hf_logits(model_dir, tokens)[..., :N_TOKENS]).abs().max() > 100 * FP32_TOL


def test_sequence_longer_than_the_sliding_window_is_refused(arch_dir, groups):
    # The tiny Mistral has sliding_window 256; full causal attention equals it only up to 256 tokens.
    engine = make_engine(arch_dir("mistral"), groups, train=False)
    assert engine.shape.sliding_window == 256
    engine.logprobs(fixed_tokens(batch=1, seq_len=256), temperature=1.0, micro_batch_size=1)
    with pytest.raises(ValueError, match="sequence length 257 exceeds the checkpoint's sliding_window 256"):
        engine.logprobs(fixed_tokens(batch=1, seq_len=257), temperature=1.0, micro_batch_size=1)


# ---- the MoE load-balancing loss trains the routers ---------------------------------------------------
def test_moe_aux_loss_reaches_the_routers_averaged_over_micro_batches(arch_dir, groups):
    """A policy loss of exactly zero leaves only the router's load-balancing loss: with its HF coefficient
    the routers get a gradient, with coefficient 0 nothing does. Four copies of one sequence give every
    micro-batch the same aux loss, so Megatron's 1/n_micro scaling makes the gradient independent of the
    micro-batch size (a sum over micro-batches would double it at micro_batch_size 2)."""
    model_dir = arch_dir("mixtral")
    tokens = fixed_tokens(batch=1).expand(4, -1).contiguous()
    zero_loss = lambda logprobs, mb: ((logprobs * 0.0).sum(), {})  # noqa: E731

    def grad_norm(megatron: dict, micro_batch_size: int) -> float:
        from megarl.config import OptimConfig
        from megarl.engine.megatron import TrainEngine
        from megarl.models.arch import read_shape

        optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=0.0, distributed=True)
        engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron=megatron, groups=groups, optim=optim)
        assert engine.config.moe_aux_loss_coeff == megatron.get("moe_aux_loss_coeff", 0.02)  # HF's coefficient
        return engine.train_step(tokens, {}, zero_loss, temperature=1.0, micro_batch_size=micro_batch_size)["grad_norm"]

    one_micro, two_micro = grad_norm({}, 4), grad_norm({}, 2)
    assert one_micro > 0
    assert two_micro == pytest.approx(one_micro, rel=1e-5)  # fp32: the same sums in a different order
    assert grad_norm({"moe_aux_loss_coeff": 0.0}, 4) == 0.0


# ---- contract 5: HF -> Megatron -> HF is bit-exact -------------------------------------------------------
def test_hf_tensors_reproduce_the_checkpoint_bit_exact(model_dir, groups):
    engine = make_engine(model_dir, groups, train=False)
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    names = [name for name, _ in engine.hf_tensors()]
    assert len(names) == len(set(names)), "a tensor was yielded twice"
    out = engine_weights(engine)
    assert set(out) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


# ---- contract 2: after a push the rollout engine computes the trainer's logprobs -------------------------
def test_push_makes_rollout_engine_equal_trainer_before_and_after_a_train_step(qwen2_dir, qwen2_other_dir,
                                                                               groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.handoff import push_weights
    from megarl.objective import policy_objective
    from megarl.rollout.native import NativeEngine

    actor = make_engine(qwen2_dir, groups, train=True)
    rollout = NativeEngine(str(qwen2_other_dir), dtype="float32", seed=0, device="cpu")
    tokens = fixed_tokens()
    trainer_lp = actor.logprobs(tokens, temperature=1.0, micro_batch_size=4)
    # The two checkpoints differ, so the comparison below can fail.
    assert (native_logprobs(rollout, tokens) - trainer_lp).abs().max() > 1e-2

    stats = push_weights(rollout, actor.hf_tensors(), bucket_bytes=16 * 1024, version=1)
    assert stats["buckets"] >= 5 and stats["tensors"] == len(load_file(str(qwen2_dir / "model.safetensors")))
    assert rollout.weight_version == 1
    assert (native_logprobs(rollout, tokens) - trainer_lp).abs().max() <= FP32_TOL

    # One optimizer step on a PPO loss with nonzero advantages, then push again.
    before = engine_weights(actor)
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "old_logprobs": trainer_lp * mask,
              "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig()), norm=global_loss_norm(mask))
    metrics = actor.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=4)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = engine_weights(actor)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the train step changed no weight"
    updated_lp = actor.logprobs(tokens, temperature=1.0, micro_batch_size=4)
    assert (updated_lp - trainer_lp).abs().max() > FP32_TOL  # stale rollout weights would now be caught

    push_weights(rollout, actor.hf_tensors(), bucket_bytes=16 * 1024, version=2)
    assert rollout.weight_version == 2
    assert (native_logprobs(rollout, tokens) - updated_lp).abs().max() <= FP32_TOL


def test_push_restores_a_scrambled_rollout_engine_for_every_architecture(model_dir, groups):
    """The handoff's checkpoint names reach every parameter of the transformers model, including MoE
    experts that transformers stacks into one [experts, ...] parameter per projection."""
    from megarl.handoff import push_weights
    from megarl.rollout.native import NativeEngine

    trainer = make_engine(model_dir, groups, train=False)
    rollout = NativeEngine(str(model_dir), dtype="float32", seed=0, device="cpu")
    with torch.no_grad():
        for param in rollout.model.parameters():
            param.normal_()  # nothing of the checkpoint survives unless the push writes it
    tokens = fixed_tokens()
    trainer_lp = trainer.logprobs(tokens, temperature=1.0, micro_batch_size=4)
    assert (native_logprobs(rollout, tokens) - trainer_lp).abs().max() > 1e-2
    push_weights(rollout, trainer.hf_tensors(), bucket_bytes=16 * 1024, version=1)
    assert (native_logprobs(rollout, tokens) - trainer_lp).abs().max() <= FP32_TOL


# ---- contract 3: step 0 is on-policy ----------------------------------------------------------------------
def test_step0_reference_equals_actor_and_ppo_is_on_policy(qwen2_dir, groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    reference = make_engine(qwen2_dir, groups, train=False)
    actor = make_engine(qwen2_dir, groups, train=True)
    tokens = fixed_tokens()
    mask = response_mask(tokens)
    actor_lp = actor.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    ref_lp = reference.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    assert torch.equal(actor_lp, ref_lp)  # same weights, same code: identical, not just close

    old, ref = actor_lp * mask, ref_lp * mask
    advantages = torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask
    _, stats = ppo_clip_loss(old, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert torch.equal(stats["ratio"], mask)  # ratio exactly 1 on every response token, 0 elsewhere
    assert stats["clipped"].sum() == 0 and stats["approx_kl"].abs().max() == 0

    algo = AlgoConfig(kl_coef=0.1)
    metrics = actor.train_step(tokens, {"response_mask": mask, "old_logprobs": old, "ref_logprobs": ref,
                                        "advantages": advantages},
                               partial(policy_objective(algo), norm=global_loss_norm(mask)),
                               temperature=1.0, micro_batch_size=2)
    # The training forward recomputes the logprobs; 1e-7 allows fp32 rounding of a different kernel order.
    assert metrics["clipfrac"] == 0.0
    assert abs(metrics["kl"]) <= 1e-7
    assert abs(metrics["ppo_kl"]) <= 1e-7
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


# ---- core attention ------------------------------------------------------------------------------------------
def test_fused_core_attention_computes_megatrons_local_attention(qwen2_dir, groups):
    """The local spec's core attention runs torch's fused SDPA; Megatron's own three-matmul attention (the
    parent class) computes the same numbers under the causal mask and under a packed block mask, with
    grouped keys and values. 1e-6: fp32, the same sums in another kernel's order."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.engine.local_attention import block_causal_mask

    core = make_engine(qwen2_dir, groups, train=False).module.decoder.layers[0].self_attention.core_attention
    assert core.fused
    heads, groups_, dim = (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
                           core.hidden_size_per_attention_head)
    assert heads > groups_  # the model has grouped keys and values
    gen = torch.Generator().manual_seed(0)
    seq, batch = 12, 3
    q = torch.randn(seq, batch, heads, dim, generator=gen)
    k, v = (torch.randn(seq, batch, groups_, dim, generator=gen) for _ in range(2))
    causal = core.attend(q, k, v, None)
    assert causal.shape == (seq, batch, heads * dim)
    assert (causal - DotProductAttention.forward(core, q, k, v, None)).abs().max() <= 1e-6
    mask = block_causal_mask(torch.tensor([0, 5, 12]), seq, device="cpu")
    packed = core.attend(q, k, v, mask)
    assert (packed - DotProductAttention.forward(core, q, k, v, mask)).abs().max() <= 1e-6
    assert (packed - causal).abs().max() > 1e-3  # the mask acted: the second segment sees less


def test_packed_attention_segment_by_segment_equals_the_block_masked_row(qwen2_dir, groups):
    """Packed sequences attended segment by segment (one batch row per segment, causal) give the outputs and
    gradients of the whole row under the block-diagonal causal mask. 1e-6: fp32, another kernel's order. One
    long segment among short ones takes the masked row instead (fewer scores)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megarl.engine.local_attention import block_causal_mask, segment_rows

    core = make_engine(qwen2_dir, groups, train=False).module.decoder.layers[0].self_attention.core_attention
    heads, groups_, dim = (core.num_attention_heads_per_partition, core.num_query_groups_per_partition,
                           core.hidden_size_per_attention_head)
    bounds = torch.tensor([0, 3, 9, 10, 16], dtype=torch.int32)  # the last segment: a row's padding
    assert segment_rows(bounds.long(), 16) is not None  # 4 x 6^2 scores < 16^2
    assert segment_rows(torch.tensor([0, 14, 15, 16]), 16) is None  # 3 x 14^2 >= 16^2
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=6,
                             max_seqlen_kv=6)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(16, n, dim, generator=gen).requires_grad_() for n in (heads, groups_, groups_)]
    weights = torch.randn(16, 1, heads * dim, generator=gen)
    by_segment = core(*inputs, None, packed_seq_params=params)
    grads = torch.autograd.grad((by_segment * weights).sum(), inputs)
    masked = core.attend(*(t.unsqueeze(1) for t in inputs), block_causal_mask(bounds, 16, device="cpu"))
    masked_grads = torch.autograd.grad((masked * weights).sum(), inputs)
    assert by_segment.shape == masked.shape == (16, 1, heads * dim)
    assert (by_segment - masked).abs().max() <= 1e-6
    for got, want in zip(grads, masked_grads):
        assert (got - want).abs().max() <= 1e-6


# ---- one-rank collectives --------------------------------------------------------------------------------------
def test_one_rank_gradient_and_parameter_collectives_are_skipped_without_changing_the_update(qwen2_dir, groups):
    """In a one-rank data-parallel group Megatron's gradient reduce-scatter and parameter all-gather are the
    identity; skipping them leaves every updated weight bit for bit what running them gives."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(), on_policy=True), norm=global_loss_norm(mask))
    skipping, syncing = make_engine(qwen2_dir, groups, train=True), make_engine(qwen2_dir, groups, train=True)
    for ddp in syncing.models:  # back to Megatron's own methods
        assert "finish_grad_sync" in vars(ddp) and "start_param_sync" in vars(ddp)
        del ddp.finish_grad_sync, ddp.start_param_sync
    for _ in range(2):
        metrics = [engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=2)
                   for engine in (skipping, syncing)]
        assert metrics[0] == metrics[1]
    synced = dict(syncing.hf_tensors())
    for name, tensor in skipping.hf_tensors():
        assert torch.equal(tensor, synced[name]), name


def torch_adam_groups(engine) -> list[dict]:
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    assert all(isinstance(o.optimizer, torch.optim.AdamW) for o in optimizers)  # Megatron's CPU fallback
    return [group for o in optimizers for group in o.optimizer.param_groups]


def test_torch_adam_steps_with_its_fused_kernel_also_after_loading_a_checkpoint(qwen2_dir, groups, tmp_path):
    """Megatron's fallback to torch's Adam (no Transformer Engine or apex) steps with torch's fused kernel:
    every updated weight within 1e-6 of torch's per-tensor loop (the same Adam arithmetic in another order;
    an update moves a weight by about lr = 1e-3, fp32 rounds that at about 1e-10, and 1e-6 still catches a
    wrong moment, bias correction or step count, which move it by about 1e-4 or more). A checkpoint saved by
    the per-tensor optimizer brings back its param groups, and the engine fuses them again."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(), on_policy=True), norm=global_loss_norm(mask))
    fused, looped = make_engine(qwen2_dir, groups, train=True), make_engine(qwen2_dir, groups, train=True)
    assert all(group["fused"] and not group["foreach"] for group in torch_adam_groups(fused))
    for group in torch_adam_groups(looped):
        group["fused"] = None

    def step_both() -> None:
        before = engine_weights(looped)
        for engine in (fused, looped):
            engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=2)
        reference = engine_weights(looped)
        moved = max((reference[name] - before[name]).abs().max().item() for name in reference)
        assert moved > 5e-4  # the step moved the weights: the comparison below is not of two copies of the start
        for name, tensor in fused.hf_tensors():
            assert torch.allclose(tensor, reference[name], rtol=0, atol=1e-6), name

    step_both()
    looped.save_checkpoint(tmp_path / "looped")
    fused.load_checkpoint(tmp_path / "looped")
    assert all(group["fused"] for group in torch_adam_groups(fused))
    assert not any(group["fused"] for group in torch_adam_groups(looped))
    step_both()


# ---- the on-policy shortcut -----------------------------------------------------------------------------------
def test_on_policy_step_takes_its_old_logprobs_from_the_training_forward(qwen2_dir, groups):
    """One optimizer step per batch: the loss that takes its old logprobs from its own forward (detached)
    has the loss, gradients and update of the loss given the logprobs of a separate forward of the same
    weights, and the step returns those logprobs. Tolerance 1e-6: the eval and the training forward are the
    same fp32 math (no dropout), run once without and once with autograd."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    reference = make_engine(qwen2_dir, groups, train=False)
    ref = reference.logprobs(tokens, temperature=1.0, micro_batch_size=2) * mask
    noise = 0.2 * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(3))
    # KL to the reference in the loss and TIS against rollout logprobs: every term that reads the old logprobs
    algo = AlgoConfig(kl_coef=0.1, tis_cap=1.5)
    assert algo.on_policy
    batch = {"response_mask": mask, "ref_logprobs": ref, "rollout_logprobs": (ref + noise) * mask,
             "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    norm = global_loss_norm(mask)

    recomputed = make_engine(qwen2_dir, groups, train=True)
    old = recomputed.logprobs(tokens, temperature=1.0, micro_batch_size=2) * mask
    objective = policy_objective(algo)
    assert "old_logprobs" in objective.fields
    expected = recomputed.train_step(tokens, batch | {"old_logprobs": old}, partial(objective, norm=norm),
                                     temperature=1.0, micro_batch_size=2)

    shortcut = make_engine(qwen2_dir, groups, train=True)
    objective = policy_objective(algo, on_policy=True)
    assert "old_logprobs" not in objective.fields
    metrics, logprobs = shortcut.train_step(tokens, batch, partial(objective, norm=norm), temperature=1.0,
                                            micro_batch_size=2, return_outputs=True)
    assert (logprobs * mask - old).abs().max() <= 1e-6
    assert expected["grad_norm"] > 0 and expected["tis_weight_mean"] < 1.0  # TIS acted
    for key in ("loss", "pg_loss", "kl", "grad_norm", "tis_weight_mean", "clipfrac"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6), key
    updated = dict(shortcut.hf_tensors())
    for name, tensor in recomputed.hf_tensors():
        assert (updated[name] - tensor).abs().max() <= 1e-6, name


# ---- zero-advantage samples ----------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_agg,layout", [("token-mean", "padded"), ("seq-mean-token-mean", "padded"),
                                             ("token-mean", "packed")])
def test_training_without_the_zero_advantage_samples_gives_the_same_update(qwen2_dir, groups, loss_agg, layout):
    """A sample whose advantage is zero everywhere adds exactly zero to a surrogate-only loss and to its
    gradients, so a step on the other samples, with the whole batch's counts as denominators, has the loss,
    gradient norm and update of the step on all of them; its statistics are means over the samples it ran.
    Tolerance 1e-6 on loss and gradient norm: the same fp32 math over differently composed micro-batches
    (the sums run in another order). 1e-5 (1% of lr) on the updated weights: Adam's first step divides each
    gradient by its own magnitude plus eps = 1e-8, so on a weight whose gradient is near eps a rounding
    difference of a fraction of that tiny gradient moves its update by the same fraction of lr (1.8e-6
    seen); a wrong denominator shows in the loss and the gradient norm, which Adam's update would hide. TIS
    is on, so the statistics of the skipped samples are not trivially zero."""
    from megarl.algo.aggregate import global_loss_norm, masked_sum
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens(batch=6)
    mask = response_mask(tokens)
    reference = make_engine(qwen2_dir, groups, train=False)
    rollout = reference.logprobs(tokens, temperature=1.0, micro_batch_size=2) * mask
    rollout = (rollout + 0.3 * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(5))) * mask
    advantages = torch.tensor([1.0, 0.0, -0.5, 0.8, 0.0, -1.2])[:, None] * mask
    objective = policy_objective(AlgoConfig(loss_agg=loss_agg, tis_cap=1.5), on_policy=True)
    assert objective.inert_at_zero_advantage
    assert not policy_objective(AlgoConfig(kl_coef=0.1), on_policy=True).inert_at_zero_advantage
    assert not policy_objective(AlgoConfig(entropy_coef=0.01), on_policy=True).inert_at_zero_advantage
    inputs = {"response_mask": mask, "rollout_logprobs": rollout, "advantages": advantages}
    norm = global_loss_norm(mask)
    lengths = mask.shape[1] - torch.arange(6)  # response_mask: sample i ends at T - i
    micro = (dict(micro_batch_size=2) if layout == "padded" else dict(micro_batch_size=1, micro_batch_tokens=40))

    whole = make_engine(qwen2_dir, groups, train=True)
    expected, logprobs = whole.train_step(tokens, inputs, partial(objective, norm=norm), temperature=1.0,
                                          return_outputs=True, lengths=lengths, **micro)
    live = torch.tensor([0, 2, 3, 5])
    part = make_engine(qwen2_dir, groups, train=True)
    ran = global_loss_norm(mask[live])
    metrics = part.train_step(tokens[live], {k: v[live] for k, v in inputs.items()},
                              partial(objective, norm=norm, stats_norm=ran), temperature=1.0, lengths=lengths[live],
                              **micro)
    assert expected["grad_norm"] > 0
    for key in ("loss", "pg_loss", "grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6), key
    updated = dict(part.hf_tensors())
    for name, tensor in whole.hf_tensors():
        assert (updated[name] - tensor).abs().max() <= 1e-5, name
    # the TIS weight is a token mean over the samples run: the whole batch's mean, less the skipped tokens
    weights = torch.clamp(torch.exp(logprobs - rollout), max=1.5) * mask
    skipped = torch.tensor([1, 4])
    tis_sum = expected["tis_weight_mean"] * norm.tokens - float(masked_sum(weights[skipped], mask[skipped]))
    assert metrics["tis_weight_mean"] == pytest.approx(tis_sum / ran.tokens, abs=1e-6)
    assert abs(metrics["tis_weight_mean"] - expected["tis_weight_mean"]) > 1e-4  # the skipped samples' weights differ


# ---- micro-batch invariance ------------------------------------------------------------------------------
def test_train_step_is_invariant_to_micro_batch_size(qwen2_dir, groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    reference = make_engine(qwen2_dir, groups, train=False)
    base = reference.logprobs(tokens, temperature=1.0, micro_batch_size=4)
    # Off-policy old logprobs so the ratio moves and some tokens clip: every loss branch contributes.
    noise = 0.3 * torch.randn(tokens.shape, generator=torch.Generator().manual_seed(7))
    extras = {"response_mask": mask, "old_logprobs": (base + noise) * mask, "ref_logprobs": base * mask,
              "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(kl_coef=0.1)), norm=global_loss_norm(mask))

    results = {}
    for micro_batch_size in (2, 3, 4):  # 3: micro-batches of 3 and 1 rows (one pipeline stage takes a ragged one)
        actor = make_engine(qwen2_dir, groups, train=True)
        results[micro_batch_size] = actor.train_step(tokens, extras, loss_fn, temperature=1.0,
                                                     micro_batch_size=micro_batch_size)
    full = results[4]
    assert full["clipfrac"] > 0
    # rel 1e-5: the same global sums in a different order, in fp32
    for size in (2, 3):
        for key in ("loss", "grad_norm", "kl", "clipfrac"):
            assert results[size][key] == pytest.approx(full[key], rel=1e-5, abs=1e-9), (size, key)


# ---- fp16 --------------------------------------------------------------------------------------------------
def test_fp16_step_scales_the_loss_and_moves_the_weights_as_far_as_fp32(qwen2_dir, groups):
    """`model.dtype: float16`: Megatron's optimizer divides the gradients by its dynamic loss scale, so the
    schedule must multiply each loss by it (TransformerConfig.grad_scale_func); without that the gradients are
    the true ones over the scale and Adam barely moves. The first step is taken (the scale starts where fp16
    gradients do not overflow), with fp32's gradient norm and an update of fp32's size."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(), on_policy=True), norm=global_loss_norm(mask))
    grad_norm, moved = {}, {}
    for dtype in ("float32", "float16"):
        engine = make_engine(qwen2_dir, groups, train=True, dtype=dtype)
        before = {name: t.float().clone() for name, t in engine.hf_tensors()}
        metrics = engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=2)
        assert "skipped_step" not in metrics, dtype
        grad_norm[dtype] = metrics["grad_norm"]
        moved[dtype] = torch.stack([(t.float() - before[name]).norm() for name, t in engine.hf_tensors()]).norm()
    # fp16 rounding: 1e-4 (gradient norm) and 3e-3 (update) relative here
    assert grad_norm["float16"] == pytest.approx(grad_norm["float32"], rel=0.02)
    assert 0.8 < float(moved["float16"] / moved["float32"]) < 1.25


# ---- the CPU compatibility layer -------------------------------------------------------------------------
def test_cpu_compat_is_installed_only_because_cuda_is_absent(groups):
    from megarl.engine import cpu_compat

    assert cpu_compat.is_installed() == (not torch.cuda.is_available())


def test_cpu_compat_refuses_to_install_on_a_cuda_machine():
    code = (
        "import sys, torch\n"
        "original_current_device = torch.cuda.current_device\n"
        "torch.cuda.is_available = lambda: True\n"
        "from megarl.engine import cpu_compat\n"
        "try:\n"
        "    cpu_compat.install()\n"
        "except RuntimeError as e:\n"
        "    assert 'CUDA' in str(e), e\n"
        "    assert not cpu_compat.is_installed()\n"
        "    assert torch.cuda.current_device is original_current_device  # nothing was patched\n"
        "    print('refused')\n"
        "    sys.exit(0)\n"
        "sys.exit('install() did not refuse')\n"
    )
    result = run_python(["-c", code], timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert "refused" in result.stdout


FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


def test_megatron_fused_kernels_are_on_where_a_gpu_install_has_them(qwen2_dir, monkeypatch):
    """Megatron leaves its fused kernels off unless told. On a GPU the engine's config turns on the compiled
    SwiGLU and residual add (they need only torch), apex's gradient accumulation GEMM where apex was built with
    it (Megatron's linear layers refuse the switch without it), and Transformer Engine's RoPE with TE's layers;
    the recipe's `model.megatron` has the last word. A CPU run keeps every one off. What is installed is
    stood in for, so the test means the same on any machine."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.engine import model
    from megarl.models.arch import read_shape

    shape = read_shape(qwen2_dir)

    def switches(**megatron) -> dict:
        config = model.transformer_config(shape, dtype="bfloat16", tp=1, pp=1, megatron=megatron)
        return {name: getattr(config, name) for name in FUSIONS}

    def te_rope(present: bool) -> None:
        for name in ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"):
            monkeypatch.setattr(rope_utils, name, (lambda *args, **kwargs: None) if present else None)

    monkeypatch.setattr(model, "uses_transformer_engine", lambda: False)
    monkeypatch.setattr(model, "has_apex_wgrad_kernel", lambda: False)
    monkeypatch.setattr(model, "on_gpu", lambda: False)
    assert switches() == dict.fromkeys(FUSIONS, False)
    monkeypatch.setattr(model, "on_gpu", lambda: True)
    assert switches() == dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=False,
                              gradient_accumulation_fusion=False)
    assert switches(bias_activation_fusion=False)["bias_activation_fusion"] is False
    monkeypatch.setattr(model, "has_apex_wgrad_kernel", lambda: True)
    assert switches()["gradient_accumulation_fusion"] is True
    assert switches(gradient_accumulation_fusion=False)["gradient_accumulation_fusion"] is False
    # Transformer Engine's layers, without and with its fused RoPE (Megatron's config refuses the switch when
    # the kernel is missing)
    monkeypatch.setattr(model, "uses_transformer_engine", lambda: True)
    te_rope(False)
    assert switches()["apply_rope_fusion"] is False
    te_rope(True)
    assert switches()["apply_rope_fusion"] is True


# ---- critic: a scalar head on the same trunk ----------------------------------------------------------------
def test_critic_values_equal_transformers_sequence_classifier(qwen2_dir, groups, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    scored = with_score_head(qwen2_dir, tmp_path / "scored")
    critic = TrainEngine(model_dir=str(scored), shape=read_shape(str(scored)), dtype="float32", megatron={}, groups=groups, value_head=True)
    tokens = fixed_tokens()
    values = critic.values(tokens, micro_batch_size=2)
    assert values.shape == tokens.shape and torch.equal(values[:, 0], torch.zeros(tokens.shape[0]))
    hf = AutoModelForSequenceClassification.from_pretrained(str(scored), dtype=torch.float32).eval()
    hf.config.pad_token_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state
        per_position = hf.score(hidden)[..., 0]  # [B, T]: the head on every position, not only the last
    # column t of the critic is the value of the prefix tokens[:t], i.e. the head on position t - 1
    assert (values[:, 1:] - per_position[:, :-1]).abs().max() <= FP32_TOL
    with pytest.raises(ValueError, match="not a causal LM"):
        next(critic.hf_tensors())
    with pytest.raises(ValueError, match="use values"):
        critic.logprobs(tokens, temperature=1.0, micro_batch_size=2)


def test_critic_without_a_score_head_starts_at_zero_and_fits_returns(qwen2_dir, groups):
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.objective import CriticObjective

    critic = TrainEngine(model_dir=str(qwen2_dir), shape=read_shape(str(qwen2_dir)), dtype="float32", megatron={}, groups=groups,
                         optim=OptimConfig(lr=1e-2), value_head=True)
    tokens = fixed_tokens()
    mask = response_mask(tokens)
    old_values = critic.values(tokens, micro_batch_size=4)
    assert torch.equal(old_values, torch.zeros_like(old_values))
    returns = torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask
    extras = {"response_mask": mask, "values": old_values * mask, "returns": returns}
    loss_fn = partial(CriticObjective(value_clip=None), norm=global_loss_norm(mask))
    losses = [critic.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=2)["critic/loss"]
              for _ in range(20)]
    # at V = 0 the loss is the token mean of 0.5 * R^2, computed here from the returns themselves
    assert losses[0] == pytest.approx(float(0.5 * returns.square().sum() / mask.sum()), rel=1e-6)
    assert losses[-1] < 0.25 * losses[0]


# ---- entropy over the vocabulary -------------------------------------------------------------------------
def test_entropy_bonus_equals_transformers_entropy_and_its_gradient(qwen2_dir, groups):
    """The engine's entropy (vocab-parallel formula) and its gradient against autograd through the HF model."""
    from transformers import AutoModelForCausalLM

    from megarl.algo.aggregate import aggregate, global_loss_norm
    from megarl.algo.kl import entropy_from_logits

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    norm = global_loss_norm(mask)

    def entropy_loss(logprobs, mb, *, entropy):
        mean = aggregate(entropy, mb["response_mask"], mode="token-mean", norm=norm)
        return -mean, {"entropy": mean.detach()}

    actor = make_engine(qwen2_dir, groups, train=True)
    before = engine_weights(actor)
    metrics = actor.train_step(tokens, {"response_mask": mask}, entropy_loss, temperature=0.7,
                               micro_batch_size=2, entropy=True)

    hf = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32)
    logits = hf(tokens).logits[:, :-1] / 0.7
    entropy = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0))
    expected = (entropy * mask).sum() / mask.sum()
    assert metrics["entropy"] == pytest.approx(float(expected), abs=FP32_TOL)
    (-expected).backward()
    hf_norm = torch.sqrt(sum(p.grad.square().sum() for p in hf.parameters() if p.grad is not None))
    # grad-norm clipping does not change the norm it reports; 1e-4 relative: fp32 sums in another order
    assert metrics["grad_norm"] == pytest.approx(float(hf_norm), rel=1e-4)
    assert any(not torch.equal(before[k], v) for k, v in engine_weights(actor).items())


# ---- a vocabulary Megatron must pad -----------------------------------------------------------------------
def test_vocabulary_padding_takes_no_probability_mass(qwen2_dir, groups, tmp_path):
    """A 100-token vocabulary is padded to 128 rows; the padding must not change logprobs or entropy."""
    import json
    import shutil

    from safetensors.torch import save_file

    from megarl.algo.kl import entropy_from_logits
    from megarl.models.arch import padded_vocab_size

    small = tmp_path / "vocab100"
    shutil.copytree(qwen2_dir, small)
    tensors = load_file(str(small / "model.safetensors"))
    tensors = {k: (v[:100].contiguous() if k in ("model.embed_tokens.weight", "lm_head.weight") else v)
               for k, v in tensors.items()}
    save_file(tensors, str(small / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 100
    (small / "config.json").write_text(json.dumps(config))
    assert padded_vocab_size(100, tp=1) > 100

    engine = make_engine(small, groups, train=False)
    tokens = fixed_tokens()
    ref_logits = hf_logits(small, tokens)
    assert (engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
            - token_logprobs(ref_logits, tokens)).abs().max() <= FP32_TOL
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = engine.module(tokens, positions, None)
        labels = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # the token after each position
        _, extra = engine.schedule.token_logprobs(logits, labels, temperature=1.0, entropy=True)
    expected = entropy_from_logits(ref_logits)  # per position: the next-token distribution's entropy
    assert (extra["entropy"] - expected).abs().max() <= FP32_TOL


def test_reward_model_scores_equal_transformers_sequence_classifier(qwen2_dir, groups, tmp_path):
    """A reward_model term: the Megatron scalar-head model scores each sequence where HF's sequence
    classifier does, on its last token (here the last response token, responses of different lengths)."""
    from transformers import AutoModelForSequenceClassification

    from megarl.batch import RolloutBatch
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.loops.samples import reward_model_scores

    scored = with_score_head(qwen2_dir, tmp_path / "rm", seed=5)
    model = TrainEngine(model_dir=str(scored), shape=read_shape(str(scored)), dtype="float32", megatron={}, groups=groups, value_head=True)
    tokens = fixed_tokens()
    mask = response_mask(tokens)
    ends = (mask * torch.arange(tokens.shape[1])).argmax(dim=1) + 1  # one past each sequence's last token
    pad = 0
    padded = torch.where(torch.arange(tokens.shape[1]) < ends[:, None], tokens, pad)
    batch = RolloutBatch(tokens=padded, response_mask=mask, prompt_lens=torch.full((4,), 5),
                         group_ids=torch.zeros(4, dtype=torch.long), rollout_logprobs=torch.zeros_like(mask),
                         responses=[""] * 4, answers=[""] * 4, finish_reasons=["stop"] * 4, prompt_texts=[""] * 4,
                         metadata=[{}] * 4)
    scores = reward_model_scores(model, batch, pad_id=pad, micro_batch_size=2)
    hf = AutoModelForSequenceClassification.from_pretrained(str(scored), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack([hf(padded[i:i + 1, :int(ends[i])]).logits[0, 0] for i in range(4)])
    assert scores.shape == (4,) and (scores - expected).abs().max() <= FP32_TOL
    assert scores.std() > 0  # four different sequences, four different scores: the test can fail


# ---- on a GPU (tools/device_check/run.sh) ----------------------------------------------------------------
# bf16 keeps 8 significant bits, so two bf16 implementations of one function round at different points.
# Megatron's bf16 logprobs must be no further from the fp32 reference than twice transformers' own bf16
# error (mean over tokens), and within 0.1 (mean) and 0.6 (max) nats of transformers in bf16: the bound of
# the SGLang push parity test, for the same kind of model (weights of std 0.2, logits of order 1).
BF16_MEAN_TOL, BF16_MAX_TOL = 0.1, 0.6


@pytest.fixture(scope="module")
def wide_qwen2_dir(tmp_path_factory):
    """Tiny Qwen2 with weights of std 0.2: logits of order 1, so bf16 rounding shows and parity can fail."""
    return _tiny_model_tool().make_tiny_model(tmp_path_factory.mktemp("wide") / "qwen2", arch="qwen2", seed=0,
                                              init_std=0.2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_logprobs_match_transformers(wide_qwen2_dir, groups):
    tokens = fixed_tokens(batch=8, seq_len=40)
    megatron = make_engine(wide_qwen2_dir, groups, train=False, dtype="bfloat16").logprobs(
        tokens, temperature=1.0, micro_batch_size=4)[:, 1:]
    ref = token_logprobs(hf_logits(wide_qwen2_dir, tokens, device="cuda"), tokens)[:, 1:]
    hf16 = token_logprobs(hf_logits(wide_qwen2_dir, tokens, dtype=torch.bfloat16, device="cuda"), tokens)[:, 1:]
    hf_err, megatron_err = (hf16 - ref).abs().mean(), (megatron - ref).abs().mean()
    assert hf_err > 1e-3, hf_err  # bf16 really rounds here: the comparison below can fail
    assert megatron_err <= 2 * hf_err, (megatron_err, hf_err)
    diff = (megatron - hf16).abs()
    assert diff.mean() <= BF16_MEAN_TOL and diff.max() <= BF16_MAX_TOL, (diff.mean(), diff.max())


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_kernels_train_as_the_unfused_ones(qwen2_dir, groups):
    """The GPU config runs Megatron's fused kernels (the compiled SwiGLU and residual add, and apex's and TE's
    where installed) with the numbers of the same engine with every fusion off: token logprobs within 1e-5 and
    the gradient norm within 1e-5 relative (fp32 on both sides, the same math in fewer kernels: rounding), and
    the logprobs after an optimizer step within 1e-4 (a step of lr 1e-3 moves each weight by up to 1e-3, and
    a gradient that is only rounding, such as the key bias's, can point either way)."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens(batch=8, seq_len=40)
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(), on_policy=True), norm=global_loss_norm(mask))
    fused = make_engine(qwen2_dir, groups, train=True)
    plain = make_engine(qwen2_dir, groups, train=True, megatron=dict.fromkeys(FUSIONS, False))
    assert fused.config.bias_activation_fusion and fused.config.bias_dropout_fusion
    assert not any(getattr(plain.config, name) for name in FUSIONS)

    def logprobs(engine):
        return engine.logprobs(tokens, temperature=1.0, micro_batch_size=4)[:, 1:]

    assert (logprobs(fused) - logprobs(plain)).abs().max() <= 1e-5
    got, want = (engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=4)["grad_norm"]
                 for engine in (fused, plain))
    assert want > 0 and abs(got - want) <= 1e-5 * want, (got, want)
    assert (logprobs(fused) - logprobs(plain)).abs().max() <= 1e-4


@pytest.mark.gpu
@needs_cuda
def test_gpu_trainer_offload_frees_memory_and_onload_restores_it_exactly(qwen2_dir, groups):
    engine = make_engine(qwen2_dir, groups, train=True, dtype="bfloat16")
    tokens = fixed_tokens()
    mask = response_mask(tokens)

    def loss_fn(logprobs, mb):
        loss = -(logprobs * mb["response_mask"]).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    step = dict(temperature=1.0, micro_batch_size=2)
    engine.train_step(tokens, {"response_mask": mask}, loss_fn, **step)  # the optimizer now has state
    before = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    engine.offload_training_state()
    engine.offload_params()
    freed = allocated - torch.cuda.memory_allocated()
    engine.onload()
    # bf16 parameters (2 bytes) and fp32 gradients (4 bytes) at least; Adam state and main params add more.
    assert freed >= 6 * sum(p.numel() for p in engine.module.parameters()), freed
    assert torch.equal(engine.logprobs(tokens, temperature=1.0, micro_batch_size=2), before)  # the same bytes
    metrics = engine.train_step(tokens, {"response_mask": mask}, loss_fn, **step)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), metrics
