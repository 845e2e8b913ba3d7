"""MoE routing replay (algo.router_replay): the rollout engine's routes are each token's experts exactly, the
trainer routes by them when told to (and only then), at every parallel layout, and records its own for R2.

Forced routing is checked against transformers itself: an HF forward whose routers are made to choose the
given experts (their gate weights computed as HF computes them) is what a replaying trainer must equal.
The routes given are random distinct experts, so most differ from the model's own choice: a replay that did
nothing, or put a token's routes on another token, would not match.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_python
from hf_routing import hf_router_outputs, routers_of
from router_replay_worker import PROMPT, fixed_inputs

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
LAYOUT_TIMEOUT_S = 300


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_forced_logprobs(model, ids: list[int], routes: torch.Tensor) -> torch.Tensor:
    """Token logprobs [len(ids)] (column 0 is 0) of a transformers forward whose routers choose `routes`
    [rows, layers, top_k] for the first rows tokens (their own choice after), gates computed as HF does."""
    def force(layer, router, inputs, out):
        logits, _, own = out
        chosen = own.clone()
        chosen[: len(routes)] = routes[:, layer].long()
        if hasattr(router, "e_score_correction_bias"):  # GLM-4.5, DeepSeek-V3: sigmoid scores, renormalized, scaled
            probs = logits.float().sigmoid().gather(1, chosen)
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
            return logits, probs.to(logits.dtype), chosen
        probs = F.softmax(logits.float(), dim=-1).gather(1, chosen)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalizes
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return logits, probs.to(logits.dtype), chosen

    hooks = [r.register_forward_hook(lambda m, i, o, layer=layer: force(layer, m, i, o))
             for layer, r in enumerate(routers_of(model))]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    for h in hooks:
        h.remove()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return F.pad(lp, (1, 0))


@pytest.mark.parametrize("arch", MOE_ARCHS + ("glm4_moe",))  # glm4_moe: routes of its MoE layer only, not layer 0
def test_native_engine_routes_are_the_experts_a_transformers_forward_chooses(arch, arch_dir):
    from megarl.models.arch import read_shape
    from megarl.rollout.native import NativeEngine
    from megarl.routing import route_dtype

    model_dir = arch_dir(arch)
    engine = NativeEngine(str(model_dir), capture_routes=True, seed=1)
    # left padded to 5: routes must skip the padding. Repeated prompts are read once by the first forward, whose
    # routes are then copied to each repeat; the samples differ, and so do the routes after the prompt.
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]] * 2
    generation = engine.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=6, eos_id=0, pad_id=0)
    assert generation.response_ids[:3] != generation.response_ids[3:]
    model = hf_model(model_dir)
    for prompt, response, routes in zip(prompts, generation.response_ids, generation.routes, strict=True):
        ids = prompt + response
        shape = read_shape(model_dir)
        assert routes.shape == (len(ids) - 1, shape.moe_layers, 2) and routes.dtype == route_dtype(shape.experts)
        # expert sets per (token, layer): the same model's top-k, fed as one sequence instead of a padded
        # batch and a KV cache; no near-ties at this size, so exact
        want = hf_router_outputs(model, ids)[0][: len(ids) - 1]
        assert torch.equal(routes.long().sort(-1).values, want.sort(-1).values)


def test_a_dense_model_has_no_routes(qwen2_dir):
    from megarl.rollout.native import NativeEngine

    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        NativeEngine(str(qwen2_dir), capture_routes=True)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_the_trainer_replays_given_routes_token_by_token(arch, arch_dir, groups):
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.routing import RouteUse

    model_dir = arch_dir(arch)
    actor = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups)
    shape = actor.shape
    tokens, mask, lengths, routes = fixed_inputs(shape.vocab_size, layers=shape.moe_layers, experts=shape.experts,
                                                 top_k=shape.topk)
    model = hf_model(model_dir)
    forced = torch.zeros(tokens.shape)
    for i, n in enumerate(lengths.tolist()):
        forced[i, :n] = hf_forced_logprobs(model, tokens[i, :n].tolist(), routes[i])
    forced *= mask

    own = actor.logprobs(tokens, temperature=1.0, micro_batch_size=2, routes=RouteUse(routes=routes)) * mask
    agreement = actor.routing_agreement()
    replayed = actor.logprobs(tokens, temperature=1.0, micro_batch_size=2,
                              routes=RouteUse(routes=routes, replay=True)) * mask
    packed = actor.logprobs(tokens, temperature=1.0, micro_batch_size=2, micro_batch_tokens=24, lengths=lengths,
                            routes=RouteUse(routes=routes, replay=True)) * mask
    # Megatron vs transformers differ in fp32 summation order only (the engine parity tests' 1e-4)
    assert (replayed - forced).abs().max() <= 1e-4
    assert (packed - forced).abs().max() <= 1e-4
    # without replay the trainer routes by its own choice, which random routes mostly are not
    assert 0.2 < agreement < 0.8
    assert (own - forced).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"])
def test_r3_with_the_engines_routes_gives_the_engines_logprobs(arch, arch_dir, groups):
    from megarl.batch import pack_sequences
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.routing import RouteUse
    from megarl.rollout.native import NativeEngine

    model_dir = arch_dir(arch)
    engine = NativeEngine(str(model_dir), capture_routes=True, seed=2)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]
    gen = engine.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=0, pad_id=0)
    tokens, mask, rollout_logprobs = pack_sequences(prompts, gen.response_ids, gen.logprobs, pad_id=0)
    actor = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups)
    replayed = actor.logprobs(tokens, temperature=1.0, micro_batch_size=2,
                              routes=RouteUse(routes=gen.routes, replay=True))
    assert actor.routing_agreement() == 1.0  # same weights: the trainer would have chosen the same experts
    assert ((replayed - rollout_logprobs) * mask).abs().max() <= 1e-4


def test_r2_records_the_trainers_own_routing(arch_dir, groups):
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.routing import RouteUse

    model_dir = arch_dir("qwen3_moe")
    actor = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups)
    shape = actor.shape
    tokens, _, lengths, _ = fixed_inputs(shape.vocab_size, layers=shape.moe_layers, experts=shape.experts,
                                         top_k=shape.topk)
    model = hf_model(model_dir)
    for micro in ({"micro_batch_size": 2}, {"micro_batch_size": 2, "micro_batch_tokens": 24, "lengths": lengths}):
        actor.logprobs(tokens, temperature=1.0, routes=RouteUse(record=True), **micro)
        recorded = actor.recorded_routes()
        for i, n in enumerate(lengths.tolist()):
            want = hf_router_outputs(model, tokens[i, :n].tolist())[0]
            assert torch.equal(recorded[i][:n].sort(-1).values, want.sort(-1).values), micro


# Every run of the worker: name -> (model, processes, worker arguments). One torchrun job per world size runs
# all its cases in turn (each rank pays its imports once, not once a layout); the layouts compare with the
# single-rank run of their model, which takes no layout argument.
CASES = {
    **{f"single-{arch}": (arch, 1, ()) for arch in MOE_ARCHS},
    "qwen2_moe-ep2": ("qwen2_moe", 2, ("--ep", "2")),                  # EP=2 (DP=2 for the dense weights)
    "mixtral-pp2": ("mixtral", 2, ("--pp", "2")),                      # each stage replays and records its layers
    "mixtral-pp2-recompute": ("mixtral", 2, ("--pp", "2", "--recompute")),  # recomputed layers route as before
    "qwen2_moe-tp2sp": ("qwen2_moe", 2, ("--tp", "2")),                # sequence parallel: a TP rank routes its slice
    "qwen3_moe-cp2": ("qwen3_moe", 2, ("--cp", "2")),                  # each CP rank routes its two chunks
    "qwen3_moe-packed": ("qwen3_moe", 1, ("--micro-batch-tokens", "24")),  # packed rows
}


def read_result(out_dir) -> dict:
    dp = json.loads((out_dir / "agreement.json").read_text())
    parts = [torch.load(out_dir / f"dp{r}.pt", weights_only=True) for r in range(dp["dp"])]
    return {"agreement": dp["agreement"], "loss": dp["loss"], "grad_norm": dp["grad_norm"],
            "own": torch.cat([p["own"] for p in parts]), "replayed": torch.cat([p["replayed"] for p in parts]),
            "recorded": [r for p in parts for r in p["recorded"]]}


@pytest.fixture(scope="module")
def runs(arch_dir, tmp_path_factory):
    """`runs(name)`: the result of that case of CASES; the first request of a world size runs its job."""
    folder, done = tmp_path_factory.mktemp("replay_layouts"), set()

    def get(name: str) -> dict:
        nproc = CASES[name][1]
        if nproc not in done:
            cases = [["--model", str(arch_dir(arch)), "--out", str(folder / case), *args]
                     for case, (arch, n, args) in CASES.items() if n == nproc]
            (folder / f"cases{nproc}.json").write_text(json.dumps(cases))
            proc = run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                               str(REPO / "tests" / "router_replay_worker.py"), "--cases",
                               str(folder / f"cases{nproc}.json")], timeout_s=LAYOUT_TIMEOUT_S * (1 + len(cases) // 4))
            assert proc.returncode == 0, proc.stderr[-4000:]
            done.add(nproc)
        return read_result(folder / name)
    return get


@pytest.mark.timeout(4 * LAYOUT_TIMEOUT_S)  # the first test of a world size waits for its whole job
@pytest.mark.parametrize("name", ["qwen2_moe-ep2", "mixtral-pp2", "mixtral-pp2-recompute", "qwen2_moe-tp2sp",
                                  "qwen3_moe-cp2", "qwen3_moe-packed"])
def test_replay_and_recording_match_single_rank_at_every_layout(name, runs):
    single, result = runs(f"single-{CASES[name][0]}"), runs(name)
    # sharded vs whole matmuls differ in fp32 summation order only (the layout tests' bound)
    assert (result["replayed"] - single["replayed"]).abs().max() <= 1e-4
    assert (result["own"] - single["own"]).abs().max() <= 1e-4
    # the routes a layout replays went to the right tokens: replaying changed the logprobs the same way
    assert (single["replayed"] - single["own"]).abs().max() > 1e-2
    assert len(result["recorded"]) == len(single["recorded"])
    for got, want in zip(result["recorded"], single["recorded"]):
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert result["agreement"] == pytest.approx(single["agreement"], abs=1e-12)
    # a training step under replay: the layout tests' bounds for the loss and the gradient norm
    assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)


def test_recomputed_layers_replay_the_routes_of_their_forward(arch_dir, groups):
    """With activation recompute a MoE layer routes again in the backward pass; replayed, its gradient is the
    one without recompute. Measured without the fix (own routing in the recomputation): grad norm 2.6923 vs
    2.6881, so a rel 1e-6 bound tells them apart."""
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.routing import RouteUse

    norms = []
    for recompute in (False, True):
        megatron = {"moe_aux_loss_coeff": 0.0}
        if recompute:
            megatron.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        actor = TrainEngine(model_dir=str(arch_dir("mixtral")), shape=read_shape(str(arch_dir("mixtral"))), dtype="float32", megatron=megatron, groups=groups,
                            optim=OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=0.0, distributed=True))
        shape = actor.shape
        tokens, mask, _, routes = fixed_inputs(shape.vocab_size, layers=shape.moe_layers, experts=shape.experts,
                                               top_k=shape.topk)

        def loss_fn(logprobs, mb):
            loss = -(logprobs * mb["response_mask"]).sum() / mask.sum()
            return loss, {"loss": loss.detach()}

        step = actor.train_step(tokens, {"response_mask": mask}, loss_fn, temperature=1.0, micro_batch_size=2,
                                routes=RouteUse(routes=routes, replay=True))
        norms.append(step["grad_norm"])
    # the same computation, recomputed: only fp32 reordering could differ
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.timeout(2 * 420)
@pytest.mark.parametrize("arch,nproc,overrides", [
    # LoRA on every linear, the experts' included: the merged push at EP=2 is what the engine then serves
    ("qwen2_moe", 2, ("parallel.ep=2", "algo.router_replay=r3", "model.lora.rank=4")),
    # R2 records the routing of shared rows in the old-logprob pass and replays it in both epochs' (the
    # load-balancing loss off, as train.share_prompts needs)
    ("mixtral", 2, ("parallel.pp=2", "algo.router_replay=r2", "algo.epochs=2", "train.micro_batch_tokens=64",
                    "train.share_prompts=true", "model.megatron.moe_aux_loss_coeff=0")),
    ("qwen3_moe", 1, ("algo.router_replay=none", "train.micro_batch_tokens=64")),
], ids=["qwen2_moe-ep2-r3-lora", "mixtral-pp2-r2-two-epochs-shared", "qwen3_moe-packed-none"])
def test_moe_grpo_runs_with_router_replay_and_logs_routing_agreement(arch, nproc, overrides, tmp_path, arch_dir,
                                                                       arithmetic_dir):
    from test_placement import run_rl

    records = run_rl(tmp_path, arch_dir(arch), arithmetic_dir, nproc=nproc, overrides=overrides)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        # the engine and the trainer hold the same weights after every push, so they route alike but for
        # near-ties in fp32 (measured: at most 1 of ~2,000 choices)
        assert 0.99 <= record["moe/routing_agreement"] <= 1.0, record
        assert record["rollout/logprob_diff_max"] <= 1e-4, record
        assert record["grad_norm"] > 0, record


def test_router_replay_on_a_dense_model_is_refused(tmp_path, qwen2_dir, arithmetic_dir):
    from test_cli import megarl_train, write_recipe

    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=tmp_path / "run")
    proc = megarl_train(recipe, "algo.router_replay=r3", "warmup.sft_steps=0", cwd=tmp_path)
    assert proc.returncode != 0
    assert "algo.router_replay = 'r3'" in proc.stderr and "has no experts" in proc.stderr


@pytest.mark.parametrize("mode,on_policy,source,replay", [
    ("none", True, "routes", False),       # compared in the one training forward (the agreement metric)
    ("none", False, None, False),          # compared in the old-logprob forward already
    ("r3", True, "routes", True),
    ("r3", False, "routes", True),
    ("r2", True, "routes", False),         # one forward: its own routing is the one r2 would replay
    ("r2", False, "trainer_routes", True),
])
def test_training_forwards_route_by_the_recipes_choice(mode, on_policy, source, replay):
    from megarl.routing import RoutePlan

    engine_routes, recorded = [torch.zeros(3, 2, 2, dtype=torch.uint8)], [torch.ones(4, 2, 2, dtype=torch.uint8)]
    use = RoutePlan(mode, on_policy=on_policy).training(engine_routes, None if on_policy else recorded)
    assert use.routes is {"routes": engine_routes, "trainer_routes": recorded, None: None}[source]
    assert use.replay is replay and not use.record
    old = RoutePlan(mode, on_policy=on_policy).old_logprobs(engine_routes)
    assert old.routes is engine_routes and old.replay is (mode == "r3") and old.record is (mode == "r2")


def test_r3_without_engine_routes_fails_loudly():
    from megarl.routing import RoutePlan

    with pytest.raises(RuntimeError, match="returned no routes"):
        RoutePlan("r3", on_policy=True).training(None, None)
