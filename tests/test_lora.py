"""LoRA on the policy (model.lora, megarl.engine.lora): a fresh adapter is the base model exactly, the merged
weights are the adapted model, the adapters' gradients are those of a plain PyTorch LoRA on the transformers
model, the base never moves and the optimizer holds the adapters alone, the reference is the actor with its
adapters off, a checkpoint resumes exactly, and what cannot be adapted is refused naming the key.

Tolerances (fp32 CPU): equality where the same code runs on the same weights (B = 0 adds exact zeros, the
adapters-off pass is the base model's code); 1e-6 on logprobs between merged weights and base + adapters
(W x + s B (A x) against (W + s B A) x: the same function, summed in another order); 1e-5 on gradients between
Megatron and transformers (two implementations of one function, DESIGN contract 1 at gradient scale).
"""

from __future__ import annotations

import pytest
import torch

from megarl.config import LoraConfig, OptimConfig

pytestmark = pytest.mark.timeout(120)

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, targets=["qkv", "proj", "fc1", "fc2"])
N_TOKENS = 98  # real tokens of the tiny tokenizer


def make_engine(model_dir, groups, *, lora: LoraConfig | None = LORA, lr: float = 1e-2, seed: int = 0):
    """A LoRA policy engine (or, with `lora` None, the frozen base model)."""
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=lr, weight_decay=0.0, grad_clip=1e9, distributed=True) if lora else None
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups, optim=optim,
                       lora=lora, seed=seed)


def tokens_and_mask(batch: int = 4, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] token ids of the real vocabulary and a response mask of rows of different lengths."""
    tokens = torch.randint(3, N_TOKENS, (batch, seq_len), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(batch, seq_len)
    for i in range(batch):
        mask[i, 5: seq_len - i] = 1.0
    return tokens, mask


def neg_logprob_loss(logprobs, mb):
    """-(sum of the response logprobs): the same loss is written on the transformers side."""
    loss = -(logprobs * mb["response_mask"]).sum()
    return loss, {"loss": loss.detach()}


def train(engine, tokens, mask, steps: int) -> None:
    for _ in range(steps):
        engine.train_step(tokens, {"response_mask": mask}, neg_logprob_loss, temperature=1.0,
                          micro_batch_size=len(tokens))


def logprobs(policy, tokens) -> torch.Tensor:
    return policy.logprobs(tokens, temperature=1.0, micro_batch_size=len(tokens))


def adapters(engine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in engine.module.named_parameters() if "lora_" in name}


def test_fresh_adapters_are_the_base_model_exactly(qwen2_dir, groups):
    from safetensors.torch import load_file

    tokens, _ = tokens_and_mask()
    base, policy = make_engine(qwen2_dir, groups, lora=None), make_engine(qwen2_dir, groups)
    assert len(adapters(policy)) == 2 * 4 * 2  # A and B of 4 linears in each of 2 layers
    assert torch.equal(logprobs(policy, tokens), logprobs(base, tokens))
    checkpoint = load_file(str(qwen2_dir / "model.safetensors"))
    merged = dict(policy.hf_tensors())
    assert merged.keys() == checkpoint.keys()
    assert all(torch.equal(merged[name], checkpoint[name]) for name in checkpoint)


def test_training_moves_only_the_adapters_and_the_optimizer_holds_only_them(qwen2_dir, groups):
    tokens, mask = tokens_and_mask()
    policy = make_engine(qwen2_dir, groups)
    base = {name: p.detach().clone() for name, p in policy.stage.named_parameters()}
    fresh = adapters(policy)
    train(policy, tokens, mask, steps=5)
    assert all(torch.equal(p, base[name]) for name, p in policy.stage.named_parameters())
    assert all(not torch.equal(p, fresh[name]) for name, p in adapters(policy).items())
    assert all(not p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None
               for _, p in policy.stage.named_parameters())
    adapter_elems = sum(t.numel() for t in fresh.values())
    optimizer_params = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimizer_params) == adapter_elems
    states = policy.optimizer.optimizer.state.values()
    assert sum(s["exp_avg"].numel() for s in states) == sum(s["exp_avg_sq"].numel() for s in states) == adapter_elems
    grad_elems = sum(b.grad_data.numel() for b in policy.model.buffers)
    assert adapter_elems <= grad_elems < adapter_elems + 128 * len(fresh)  # DDP pads each parameter to 64


def test_merged_weights_after_training_give_the_adapted_models_logprobs(qwen2_dir, groups, tmp_path):
    from megarl.checkpoint import save_hf
    from megarl.engine.roles import BasePolicy

    tokens, mask = tokens_and_mask()
    policy, base = make_engine(qwen2_dir, groups), make_engine(qwen2_dir, groups, lora=None)
    train(policy, tokens, mask, steps=3)
    adapted = logprobs(policy, tokens)
    assert (adapted - logprobs(base, tokens)).abs().max() > 1e-2  # the adapters moved the policy
    save_hf(policy.hf_tensors(), source_dir=qwen2_dir, out_dir=tmp_path / "merged")
    merged = make_engine(tmp_path / "merged", groups, lora=None)
    assert (logprobs(merged, tokens) - adapted).abs().max() <= 1e-6
    # the reference of a LoRA run: the policy with its adapters off is the base model, and they come back on
    assert torch.equal(logprobs(BasePolicy(policy), tokens), logprobs(base, tokens))
    assert torch.equal(logprobs(policy, tokens), adapted)


def test_a_moe_policys_experts_train_their_adapters_and_export_merged(arch_dir, groups, tmp_path):
    """The tiny Qwen2-MoE (4 experts, top-2, and a shared expert) with adapters on every linear: each expert's
    and the shared expert's fc1 and fc2 take one, the base stays frozen, the adapters of the experts that saw
    tokens move, and the merged export, loaded as a plain model, gives the adapted policy's logprobs (1e-6, the
    fp32 order of W x + s B A x against (W + s B A) x)."""
    import re

    from megarl.checkpoint import save_hf
    from megarl.plan.memory import lora_params

    model_dir = arch_dir("qwen2_moe")
    tokens, mask = tokens_and_mask()
    policy, base = make_engine(model_dir, groups), make_engine(model_dir, groups, lora=None)
    fresh = adapters(policy)
    experts = {n for n in fresh if ".local_experts." in n}
    shared = {n for n in fresh if ".shared_experts." in n}
    # per layer: qkv and proj, then fc1 and fc2 of 4 experts and of the shared expert; A and B each
    assert len(fresh) == 2 * 2 * (2 + 2 * 5) and len(experts) == 2 * 2 * 2 * 4 and len(shared) == 2 * 2 * 2
    # what `megarl plan` counts, at EP=2 each rank half of the experts' (tiny: moe_ffn 32, shared_ffn 64)
    elems = sum(t.numel() for t in fresh.values())
    assert lora_params(policy.shape, LORA, tp=1, pp=1) == elems
    assert lora_params(policy.shape, LORA, tp=1, pp=1, ep=2) == elems - sum(
        fresh[n].numel() for n in experts if re.search(r"local_experts\.[23]\.", n))
    frozen = {name: p.detach().clone() for name, p in policy.stage.named_parameters()}
    train(policy, tokens, mask, steps=3)
    assert all(torch.equal(p, frozen[name]) for name, p in policy.stage.named_parameters())
    moved = {n for n, p in adapters(policy).items() if not torch.equal(p, fresh[n])}
    assert shared <= moved and len(experts & moved) >= len(experts) // 2, sorted(experts - moved)
    adapted = logprobs(policy, tokens)
    assert (adapted - logprobs(base, tokens)).abs().max() > 1e-2
    save_hf(policy.hf_tensors(), source_dir=model_dir, out_dir=tmp_path / "merged")
    merged = make_engine(tmp_path / "merged", groups, lora=None)
    assert (logprobs(merged, tokens) - adapted).abs().max() <= 1e-6


def plain_lora_hf(model_dir, factors: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], *, scale: float):
    """The transformers model with a plain PyTorch LoRA: per layer and Megatron module kind, one A shared by the
    HF projections fused in that module (q/k/v, gate/up) and B cut into their rows. Returns the model and the
    (A, [B parts]) leaf tensors per (layer, kind)."""
    from transformers import AutoModelForCausalLM

    from megarl.models import layout
    from megarl.models.arch import read_shape

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.requires_grad_(False)
    shape = read_shape(model_dir)
    leaves = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for kind, (a, b) in factors[i].items():
            a = a.clone().requires_grad_(True)
            match kind:
                case "qkv":
                    parts = layout.split_qkv(b, groups=shape.kv_heads, head_dim=shape.head_dim)
                    linears = [attn.q_proj, attn.k_proj, attn.v_proj]
                case "fc1":
                    parts, linears = layout.split_gate_up(b), [mlp.gate_proj, mlp.up_proj]
                case "proj":
                    parts, linears = (b,), [attn.o_proj]
                case "fc2":
                    parts, linears = (b,), [mlp.down_proj]
            parts = [p.clone().requires_grad_(True) for p in parts]
            for linear, part in zip(linears, parts):
                linear.register_forward_hook(
                    lambda mod, args, out, a=a, part=part: out + scale * (args[0] @ a.T) @ part.T)
            leaves[i, kind] = (a, parts)
    return model, leaves


def test_adapter_gradients_equal_a_plain_pytorch_lora_on_transformers(qwen2_dir, groups):
    from megarl.models import layout
    from megarl.models.arch import read_shape

    tokens, mask = tokens_and_mask()
    policy = make_engine(qwen2_dir, groups)
    kinds = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    gen = torch.Generator().manual_seed(3)
    factors: dict[int, dict] = {0: {}, 1: {}}
    with torch.no_grad():  # B != 0 so that A gets a gradient
        for name, layer in policy.stage.adapted_layers():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.1)
            factors[int(name.split(".")[2])][kinds[name.split(".")[-1]]] = (layer.lora_a.clone(), layer.lora_b.clone())
    policy.schedule.run(tokens, {"response_mask": mask}, neg_logprob_loss, temperature=1.0,
                        micro_batch_size=len(tokens), forward_only=False)
    model, leaves = plain_lora_hf(qwen2_dir, factors, scale=LORA.alpha / LORA.rank)
    logits = model(tokens).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (-(lp * mask[:, 1:]).sum()).backward()
    shape = read_shape(qwen2_dir)
    for name, layer in policy.stage.adapted_layers():
        a, parts = leaves[int(name.split(".")[2]), kinds[name.split(".")[-1]]]
        grads = [p.grad for p in parts]
        match kinds[name.split(".")[-1]]:
            case "qkv":
                grad_b = layout.join_qkv(*grads, groups=shape.kv_heads, head_dim=shape.head_dim)
            case "fc1":
                grad_b = layout.join_gate_up(*grads)
            case _:
                grad_b = grads[0]
        assert a.grad.abs().max() > 1e-3 and grad_b.abs().max() > 1e-3, name
        torch.testing.assert_close(layer.lora_a.main_grad, a.grad, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(layer.lora_b.main_grad, grad_b, atol=1e-5, rtol=0, msg=name)
    for model_chunk in policy.models:
        model_chunk.zero_grad_buffer()


class ExpertDeltas(torch.nn.Module):
    """A parametrization of a transformers MoE layer's fused expert weight [experts, out, in]: each expert's
    W_e + scale B_e A_e, from leaf factors (A_e, B_e), so the gradient reaches them as a plain LoRA's would."""

    def __init__(self, factors: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        super().__init__()
        self.factors, self.scale = factors, scale

    def forward(self, weight):
        return weight + self.scale * torch.stack([b @ a for a, b in self.factors])


def test_expert_adapter_gradients_equal_a_plain_pytorch_lora_on_transformers(arch_dir, groups):
    """The tiny Qwen2-MoE with adapters on the MLPs: each expert's fc1 (gate and up) and fc2, and the shared
    expert's. transformers holds a layer's experts as fused [experts, out, in] tensors, so its plain LoRA adds
    scale B_e A_e to expert e's slice (a parametrization); the shared expert's projections take forward hooks.
    One backward of the same loss: every A and B gradient equal within 1e-5 (measured at most 5.4e-7)."""
    from torch.nn.utils import parametrize
    from transformers import AutoModelForCausalLM

    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.models import layout

    model_dir = arch_dir("qwen2_moe")
    tokens, mask = tokens_and_mask()
    lora = LoraConfig(rank=4, alpha=8.0, targets=["fc1", "fc2"])
    # the load-balancing loss off: its gradient would reach layer 0's adapters through layer 1's router, and
    # transformers adds none without output_router_logits
    policy = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={"moe_aux_loss_coeff": 0.0},
                         groups=groups, optim=OptimConfig(lr=1e-2, weight_decay=0.0, grad_clip=1e9, distributed=True),
                         lora=lora)
    gen = torch.Generator().manual_seed(3)
    layers = dict(policy.stage.adapted_layers())
    with torch.no_grad():  # B != 0 so that A gets a gradient
        for layer in layers.values():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.1)
    policy.schedule.run(tokens, {"response_mask": mask}, neg_logprob_loss, temperature=1.0,
                        micro_batch_size=len(tokens), forward_only=False)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.requires_grad_(False)
    scale, leaves = lora.alpha / lora.rank, {}

    def leaf(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        leaves[name] = tuple(t.detach().clone().requires_grad_(True) for t in (layers[name].lora_a, layers[name].lora_b))
        return leaves[name]

    for i, hf_layer in enumerate(model.model.layers):
        mlp, prefix = hf_layer.mlp, f"decoder.layers.{i}.mlp"
        for kind, fused in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            factors = [leaf(f"{prefix}.experts.local_experts.{e}.{kind}") for e in range(mlp.experts.num_experts)]
            parametrize.register_parametrization(mlp.experts, fused, ExpertDeltas(factors, scale))
        a, b = leaf(f"{prefix}.shared_experts.linear_fc1")
        for linear, rows in zip((mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj), layout.split_gate_up(b)):
            linear.register_forward_hook(lambda mod, args, out, a=a, rows=rows: out + scale * (args[0] @ a.T) @ rows.T)
        a, b = leaf(f"{prefix}.shared_experts.linear_fc2")
        mlp.shared_expert.down_proj.register_forward_hook(
            lambda mod, args, out, a=a, b=b: out + scale * (args[0] @ a.T) @ b.T)
    logits = model(tokens).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (-(lp * mask[:, 1:]).sum()).backward()
    assert len(leaves) == len(layers) == 2 * 2 * (4 + 1)
    for name, layer in layers.items():
        a, b = leaves[name]
        assert a.grad.abs().max() > 1e-3 and b.grad.abs().max() > 1e-3, name
        torch.testing.assert_close(layer.lora_a.main_grad, a.grad, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(layer.lora_b.main_grad, b.grad, atol=1e-5, rtol=0, msg=name)
    for model_chunk in policy.models:
        model_chunk.zero_grad_buffer()


def test_checkpoint_holds_the_adapters_and_resumes_exactly(qwen2_dir, groups, tmp_path):
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from megarl.checkpoint import CheckpointError

    tokens, mask = tokens_and_mask()
    policy = make_engine(qwen2_dir, groups)
    train(policy, tokens, mask, steps=2)
    policy.save_checkpoint(tmp_path / "ckpt")
    train(policy, tokens, mask, steps=2)
    resumed = make_engine(qwen2_dir, groups, seed=5)  # other adapters until the checkpoint replaces them
    resumed.load_checkpoint(tmp_path / "ckpt")
    train(resumed, tokens, mask, steps=2)
    assert all(torch.equal(p, adapters(policy)[name]) for name, p in adapters(resumed).items())
    assert torch.equal(logprobs(resumed, tokens), logprobs(policy, tokens))
    model_keys = [k for k in load_tensors_metadata(str(tmp_path / "ckpt")) if not k.startswith("optimizer.")]
    assert model_keys and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in model_keys), model_keys
    with pytest.raises(CheckpointError, match="LoRA run's checkpoint"):  # e.g. the conversion tool's full model
        make_engine(qwen2_dir, groups, lora=None).load_checkpoint(tmp_path / "ckpt")


def test_adapters_are_drawn_from_the_seed(qwen2_dir, groups):
    one, same, other = (adapters(make_engine(qwen2_dir, groups, seed=s)) for s in (0, 0, 1))
    assert all(torch.equal(one[n], same[n]) for n in one)
    assert all(not torch.equal(one[n], other[n]) for n in one if n.endswith("lora_a"))
    assert all(not one[n].any() for n in one if n.endswith("lora_b"))


def test_what_cannot_take_adapters_is_refused_naming_the_key(arch_dir):
    from megarl.job import check_lora
    from megarl.models.arch import read_shape

    moe, dense = read_shape(arch_dir("mixtral")), read_shape(arch_dir("qwen2"))
    check_lora(LORA, moe, te=False)  # experts at expert tensor parallelism 1 (any expert parallelism): fine
    with pytest.raises(ValueError, match=r"model\.lora\.targets.*experts' linears \(fc1, fc2\).*expert tensor "
                                          r"parallelism 1 only \(here 2"):
        check_lora(LORA, moe, te=False, etp=2)
    check_lora(LoraConfig(targets=["qkv", "proj"]), moe, te=False, etp=2)  # attention alone: fine
    with pytest.raises(ValueError, match=r"model\.lora.*Transformer Engine"):
        check_lora(LORA, dense, te=True)
    with pytest.raises(ValueError, match=r"model\.lora.*critic"):
        check_lora(LORA, dense, te=False, value_head=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_counts_a_lora_actors_memory_as_the_engine_holds_it(dtype, qwen2_dir, groups, tmp_path):
    """`megarl plan` with model.lora: the frozen base and the adapters as parameters, gradients and Adam state
    for the adapters alone (measured on a real engine, as tests/test_plan.py does for full training), and no
    reference model beside the actor even with a KL term."""
    from test_plan import measured_state

    from megarl.config import load_config
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.plan import Cluster, plan, read_model

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"model:\n  path: {qwen2_dir}\n  dtype: {dtype}\n  lora: {{rank: 4, targets: [qkv, proj, fc1, "
                      "fc2]}\ndata:\n  train_path: unused.jsonl\n  prompts_per_step: 1\nrollout:\n  n_samples: 2\n"
                      "algo:\n  kl_coef: 0.1\ntrain:\n  micro_batch_size: 2\n")
    cfg = load_config(recipe, check_paths=False)
    models = plan(cfg, read_model(qwen2_dir / "config.json"), Cluster(nodes=1, gpus_per_node=1)).models
    assert [m.name for m in models] == ["actor"]
    engine = TrainEngine(model_dir=str(qwen2_dir), shape=read_shape(str(qwen2_dir)), dtype=dtype, megatron={}, groups=groups,
                         optim=OptimConfig(lr=1e-3, distributed=cfg.optim.distributed), lora=cfg.model.lora)
    train(engine, *tokens_and_mask(2, 8), steps=1)
    real, actor = measured_state(engine), models[0]
    # Megatron's CPU norms stay fp32 in a bf16 model (see tests/test_plan.py): 2 more bytes each, all frozen.
    fp32_norms = sum(p.numel() for p in engine.module.parameters() if dtype != "float32" and p.dtype.itemsize == 4)
    assert real["params"] == actor.params + 2 * fp32_norms
    assert real["optim"] == actor.optim  # adapters only: moments (+ fp32 master copies in bf16)
    assert 0 <= real["grads"] - actor.grads <= 4 * (63 * real["tensors"] + 127 * real["buckets"])
    assert actor.grads == 4 * sum(p.numel() for n, p in engine.module.named_parameters() if "lora_" in n)


def test_peft_adapter_directory_applied_to_the_base_model_gives_the_merged_export(qwen2_dir, groups, tmp_path):
    """The adapter directory, applied as PEFT applies a LoRA (W + lora_alpha / r * lora_B @ lora_A on every module
    of target_modules), gives transformers the logits of the merged HF export (1e-5: two fp32 models), and with
    `peft` installed PeftModel loads it to the same logits."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint import save_hf, save_peft_adapter

    tokens, mask = tokens_and_mask()
    policy = make_engine(qwen2_dir, groups)
    train(policy, tokens, mask, steps=3)
    save_hf(policy.pipeline_hf_tensors(), source_dir=qwen2_dir, out_dir=tmp_path / "merged")
    save_peft_adapter(policy.pipeline_adapter_tensors(), rank=LORA.rank, alpha=LORA.alpha, base_model=str(qwen2_dir),
                      out_dir=tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers

    def load(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    base, merged = load(qwen2_dir), load(tmp_path / "merged")
    with torch.no_grad():
        for module_name, module in base.named_modules():
            key = f"base_model.model.{module_name}"
            if f"{key}.lora_A.weight" in adapter:
                delta = adapter[f"{key}.lora_B.weight"] @ adapter[f"{key}.lora_A.weight"]
                module.weight += config["lora_alpha"] / config["r"] * delta
        want = merged(tokens).logits
        assert (base(tokens).logits - want).abs().max() <= 1e-5
        assert (load(qwen2_dir)(tokens).logits - want).abs().max() > 1e-3  # the adapters are not a no-op
    from peft import PeftModel  # the `peft` extra, part of the `test` extra

    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(load(qwen2_dir), str(tmp_path / "adapter")).eval()
        assert (peft_model(tokens).logits - want).abs().max() <= 1e-5


@pytest.mark.parametrize("key", [None, "model.lora", "train.share_prompts"])
def test_a_run_that_needs_the_local_layers_gets_them_where_transformer_engine_is_installed(key, qwen2_dir, tmp_path,
                                                                                          monkeypatch, caplog):
    """On a GPU with Transformer Engine installed (megarl's image) a run builds on TE's layers. model.lora runs on
    Megatron's local layers only, so launch (megarl.job resolves the layer spec once for the run's models) builds
    such a run's models on those, with a warning naming the key, instead of refusing the run. train.share_prompts
    keeps TE's layers (megarl.engine.te_attention) with RoPE unfused, and refuses a recipe that asks for the fused
    kernel. The recipe as written is left as it was. Stood in: the GPU (megarl.engine.model.on_gpu) and an
    importable transformer_engine."""
    import logging
    import sys
    import types

    from megarl.config import RecipeError, load_config
    from megarl.engine import model
    from megarl.loops.launch import resolve_job

    monkeypatch.setattr(model, "on_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert model.uses_transformer_engine()

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: {qwen2_dir}}}\ndata: {{train_path: unused.jsonl}}\n"
                      "train: {micro_batch_tokens: 256}\n")
    overrides = {None: [], "model.lora": ["model.lora.rank=4"], "train.share_prompts": ["train.share_prompts=true"]}
    cfg = load_config(recipe, overrides[key], check_paths=False)
    with caplog.at_level(logging.WARNING, logger="megarl.loops.launch"):
        job = resolve_job(cfg)
    assert cfg.model.megatron == {}  # the recipe as the user wrote it
    if key != "model.lora":
        assert job.te_layers and not caplog.records
        assert job.megatron == ({"apply_rope_fusion": False} if key else {})
        if key:
            fused = load_config(recipe, [*overrides[key], "model.megatron.apply_rope_fusion=true"], check_paths=False)
            with pytest.raises(RecipeError, match="model.megatron.apply_rope_fusion: true cannot be combined with "
                                                  "train.share_prompts"):
                resolve_job(fused)
        return
    assert not job.te_layers  # and the adapters' check passed on the local layers
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage().startswith(f"{key} runs on Megatron's local layer spec"), caplog.text


def test_adapter_dropout_drops_in_training_forwards_only_and_keeps_the_expected_output(qwen2_dir, groups):
    """model.lora.dropout drops the adapters' input in a training forward only (gradients on): the logprob passes
    (old logprobs, the reference, rollout parity) give exactly what no dropout gives; each training forward draws
    a new mask, at rate p, and the mean of many is the undropped output (inverted dropout: kept inputs scaled by
    1 / (1 - p)).

    Tolerances, from the draws' own statistics: output i of an adapter's delta s B A (m * x) / (1 - p), m_j kept
    with probability 1 - p, has variance v_i = p / (1 - p) sum_j (s B A)_ij^2 x_j^2. The mean of N draws is within
    6 standard errors (sqrt(v_i / N)) of the undropped output (about 1e-5 of failing somewhere among the layer's
    outputs, at a fixed seed), and the draws' variance, averaged over the outputs, is v's within 10% (its
    relative standard error is about sqrt(2 / N) per output, far less averaged)."""
    from megarl.engine.lora_layers import LoraColumnParallelLinear

    tokens, mask = tokens_and_mask()
    spec = dict(rank=4, alpha=8.0, targets=["qkv", "proj", "fc1", "fc2"])
    p = 0.5
    dropped = make_engine(qwen2_dir, groups, lora=LoraConfig(dropout=p, **spec))
    plain = make_engine(qwen2_dir, groups, lora=LoraConfig(dropout=0.0, **spec))
    train(plain, tokens, mask, steps=2)  # B != 0: the adapters add something to drop
    trained = adapters(plain)
    with torch.no_grad():
        for name, param in dropped.module.named_parameters():
            if name in trained:
                param.copy_(trained[name])
    assert torch.equal(logprobs(dropped, tokens), logprobs(plain, tokens))

    layer = next(m for m in dropped.module.modules() if isinstance(m, LoraColumnParallelLinear))
    assert not layer.training  # a forward-only pass leaves the model in eval mode; a training pass sets train mode
    dropped.module.train()
    x = torch.randn(6, 2, layer.input_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        undropped = layer(x)[0]
    n = 2000
    draws = torch.stack([layer(x)[0].detach() for _ in range(n)])  # gradients on: a training forward
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], undropped)
    delta = layer.adapter.scale * (layer.lora_b.detach() @ layer.lora_a.detach())  # [out, in]
    variance = p / (1 - p) * (x.pow(2) @ delta.pow(2).T)  # [s, b, out]
    assert (draws.mean(0) - undropped).abs().le(6 * (variance / n).sqrt() + 1e-7).all()
    assert draws.var(0).mean() / variance.mean() == pytest.approx(1.0, rel=0.1)


def test_a_bf16_lora_policy_on_local_layers_keeps_its_norms_in_bf16(qwen2_dir, groups):
    """Megatron's local layers have no Float16Module: megarl's RMSNorm takes the model's dtype itself, so bf16
    activations meet a bf16 weight (torch's fused kernel) and a push or an export carries no fp32 norms."""
    from megarl.config import LoraConfig, OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    policy = TrainEngine(model_dir=str(qwen2_dir), shape=read_shape(str(qwen2_dir)), dtype="bfloat16", megatron={}, groups=groups,
                         lora=LoraConfig(rank=4, alpha=8.0, targets=["qkv"]), optim=OptimConfig(lr=1e-3), seed=0)
    norms = {name: p.dtype for chunk in policy.chunks for name, p in chunk.named_parameters() if "norm" in name}
    assert norms and set(norms.values()) == {torch.bfloat16}, norms
    assert {t.dtype for name, t in policy.hf_tensors() if "norm" in name} == {torch.bfloat16}
