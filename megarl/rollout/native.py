"""The native rollout engine: a transformers causal LM sampling in-process (CPU or GPU).

It implements the rollout-engine interface (megarl.rollout.engine.RolloutEngine) and serves when SGLang is
not installed; on small models it also starts fastest.

Logprobs are those of the distribution sampling draws from before top-p truncation, i.e.
log_softmax(logits / temperature), which is what SGLang reports and what the trainer recomputes; with
top_p = 1 they are exactly the sampling distribution. Temperature 0 decodes greedily (the most likely token;
its logprob under the untempered distribution): what a judge model grading responses asks for
(megarl.rewards.judge), never a rollout (rollout.temperature is positive).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import Tensor

from megarl.device import current_device
from megarl.rollout.decode import FusedWeights, LeanDecoder, covers, fusable
from megarl.rollout.engine import Generation, ResponseCallback, released_weights
from megarl.routing import compact



# transformers 5 keeps a MoE layer's experts as two stacked parameters, `mlp.experts.gate_up_proj`
# [E, 2*I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], while
# checkpoints, and so the weight handoff, name every expert's projections on their own (Mixtral: w1 gate,
# w3 up, w2 down, inside `block_sparse_moe`, which transformers calls `mlp`).
_CHECKPOINT_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|w1|up_proj|w3|down_proj|w2)\.weight$")
_STACKED = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
            "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def _slot(name: str) -> tuple[str, int | None, int | None]:
    """Where a checkpoint-named tensor goes: (model parameter, expert index, half of gate_up) or (name, None,
    None) for a tensor that is a whole parameter."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _CHECKPOINT_EXPERT.match(name)
    if match is None:
        return name, None, None
    stacked, half = _STACKED[match.group(3)]
    return f"{match.group(1)}.experts.{stacked}", int(match.group(2)), half


def _slots_of(name: str, param: Tensor) -> set[tuple[str, int | None, int | None]]:
    """Every slot a full weight push fills in one model parameter."""
    if name.endswith("experts.gate_up_proj"):
        return {(name, e, half) for e in range(param.shape[0]) for half in (0, 1)}
    if name.endswith("experts.down_proj"):
        return {(name, e, None) for e in range(param.shape[0])}
    return {(name, None, None)}


def _routing_biases(model) -> dict[str, Tensor]:
    """The routers' load-balancing biases (GLM-4.5, DeepSeek-V3 `e_score_correction_bias`): buffers in
    transformers, weights to a push."""
    return {name: buffer for name, buffer in model.named_buffers() if name.endswith(".e_score_correction_bias")}


class RouteRecorder:
    """The experts every MoE layer of a transformers model routes each fed-in token to, during one `generate`.

    transformers' MoE routers (Mixtral, Qwen2-MoE, Qwen3-MoE: `*TopKRouter`) return (logits, scores, top-k
    expert ids) over the flattened [batch * positions] tokens of a forward; a hook per router keeps the ids the
    model itself used, so they are the engine's routing exactly, with no second computation to disagree."""

    def __init__(self, model):
        # Mixtral/Qwen: *TopKRouter; GLM-4.5, DeepSeek-V3: *TopkRouter (the MoE layers only, after dense ones)
        routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
        if not routers:
            raise ValueError(f"capture_routes: {type(model).__name__} has no mixture-of-experts router "
                             "(a *TopKRouter module); routes exist for MoE models only")
        self.experts = routers[0].weight.shape[0]  # the router's logits are one per expert
        self._calls: list[list[Tensor]] = [[] for _ in routers]  # per layer, per forward: [tokens, top_k]
        for layer, router in enumerate(routers):
            router.register_forward_hook(partial(self._keep, layer))

    def _keep(self, layer: int, module, inputs, output) -> None:
        self._calls[layer].append(output[2].to(torch.int32))

    def start(self) -> None:
        self._calls = [[] for _ in self._calls]

    def expand_first(self, source: Tensor, *, width: int) -> None:
        """The first forward fed each distinct prompt once: give row i the routes of prompt `source[i]`."""
        for calls in self._calls:
            first = calls[0].view(-1, width, calls[0].shape[-1])
            calls[0] = first[source].reshape(-1, first.shape[-1])

    def per_sequence(self, prompt_lens: list[int], response_lens: list[int], *, width: int) -> list[Tensor]:
        """Routes [prompt + response - 1, layers, top_k] per row of a left-padded batch of prompts `width`
        wide: the first forward fed every prompt, forward s >= 1 fed each row's response token s - 1."""
        batch = len(prompt_lens)
        layers = [torch.cat([call.view(batch, -1, call.shape[-1]) for call in calls], dim=1) for calls in self._calls]
        routes = torch.stack(layers, dim=2)  # [batch, width + forwards - 1, layers, top_k]
        self.start()
        return [compact(routes[i, width - p: width + r - 1], self.experts)
                for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]


def _adapter_slot(name: str) -> tuple[str, str]:
    """(HF module, "lora_A" or "lora_B") of a PEFT adapter tensor name."""
    module, factor, weight = name.removeprefix("base_model.model.").rsplit(".", 2)
    if factor not in ("lora_A", "lora_B") or weight != "weight" or not name.startswith("base_model.model."):
        raise KeyError(f"{name!r} is not a PEFT LoRA tensor name (base_model.model.MODULE.lora_A.weight)")
    return module, factor


def _distinct(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The first row of every distinct prompt, and for each row the index of its prompt among those."""
    index: dict[tuple[int, ...], int] = {}
    firsts, source = [], []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        source.append(index[key])
    return firsts, source


class NativeEngine:
    """A transformers model that samples batches and takes weights pushed by the trainer."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0, device: str | None = None,
                 capture_routes: bool = False, lean_decode: bool = True, keep_weights: bool = False):
        """`keep_weights`: the weights stay on the device through `release_memory` (an engine that takes a LoRA
        policy's adapters alone, rollout.lora_sync: adapter, merges them over base weights it must keep)."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device) if device else current_device()
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(self.device).eval()
        with torch.no_grad():
            # a tied weight is one Parameter: it stays tied
            for param in [*self.model.parameters(), *_routing_biases(self.model).values()]:
                if not param.untyped_storage().resizable():  # mapped from the checkpoint's file on a CPU
                    param.data = param.data.clone()  # memory of its own, which release_memory can free
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = 0
        # transformers 5.20+ names the KV cache argument `cache`; earlier releases `past_key_values`.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Sampling reads the last position's logits only; models that can skip the vocabulary projection of
        # the others (the prompt's, at the first step) are told so.
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._routes = RouteRecorder(self.model) if capture_routes else None
        # the prefill and the decode steps skip transformers' per-forward plumbing where megarl.rollout.decode
        # covers the model (routes are recorded by hooks on transformers' own forward)
        self._fused = FusedWeights(self.model) if lean_decode and not capture_routes and fusable(self.model) else None
        self.lean_decode = self._fused is not None
        self._params = dict(self.model.named_parameters()) | _routing_biases(self.model)
        self._base: dict[str, Tensor] = {}  # the adapted modules' own weights (update_adapter)
        self.keeps_weights = keep_weights
        # Every distinct storage of the weights (the fused matrices hold the projections' rows), with its size:
        # what release_memory frees and resume_weights allocates again.
        storages = {p.untyped_storage()._cdata: p.untyped_storage() for p in self._params.values()}
        self._storages = [(storage, storage.nbytes()) for storage in storages.values()]
        self.weight_bytes = sum(nbytes for _, nbytes in self._storages)
        self._released = False
        self.garbage = False  # resumed weights that no full push has filled since: not the policy of any version
        config = self.model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = torch.finfo(torch_dtype).bits // 8
        self._kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
        self.kv_bytes = 0  # the KV cache of the last generation: its rows x (prompt width + new tokens)

    @torch.no_grad()
    def rng_state(self) -> Tensor:
        """The sampler's random state, for checkpoints: restoring it reproduces the next samples exactly."""
        return self.generator.get_state()

    def set_rng_state(self, state: Tensor) -> None:
        self.generator.set_state(state)

    # Sampling needs no autograd: under inference mode no graph is recorded for the forward passes and the
    # KV cache, and tensors skip version counting (the same numbers, less work per decoded token).
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float, max_new_tokens: int,
                 eos_id: int, pad_id: int, on_response: ResponseCallback | None = None) -> Generation:
        """Sample one response per prompt (repeat a prompt to get a group). `on_response(i, ids, logprobs,
        finish_reason)` gets response i at the step it ends, while the others are still sampled."""
        if self.garbage or self._released:
            raise released_weights(still_released=self._released)
        batch = len(prompts)
        width = max(len(p) for p in prompts)
        self.kv_bytes = batch * (width + max_new_tokens) * self._kv_bytes_per_token
        # Left padding keeps every prompt's last token in the last column, so one step feeds one column.
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        # the attention mask of the prompts and of every token still to come (each step reads a longer prefix)
        attention = torch.zeros((batch, width + max_new_tokens), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention[:, :width].cumsum(-1) - 1).clamp(min=0)
        out_ids = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=self.device)
        out_logprobs = torch.zeros((batch, max_new_tokens), device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        responses: dict[int, tuple[list[int], list[float], str]] = {}

        def ended(rows: Tensor, reason: str) -> None:
            for i in rows.tolist():
                responses[i] = (out_ids[i, : lengths[i]].tolist(), out_logprobs[i, : lengths[i]].tolist(), reason)
                if on_response is not None:
                    on_response(i, *responses[i])

        if self._routes is not None:
            self._routes.start()
        lean = None
        if self.lean_decode and covers(self.model, width + max_new_tokens):
            lean = LeanDecoder(self.model, self._fused, batch=batch, width=width, new_tokens=max_new_tokens)
        cache, logits = self._prefill(ids, attention[:, :width], positions, prompts, lean)
        for t in range(max_new_tokens):
            if t > 0 and lean is not None:
                logits = lean.step(token, positions, attention, t)
            elif t > 0:
                out = self.model(input_ids=token[:, None], attention_mask=attention[:, : width + t],
                                 position_ids=positions, use_cache=True, **{self._cache_arg: cache},
                                 **self._last_logits)
                cache, logits = self._cache_of(out), out.logits[:, -1]
            logprobs = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)  # [B, V]
            token = logprobs.argmax(-1) if temperature == 0 else self._sample(logprobs, top_p)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            out_ids[:, t] = token
            out_logprobs[:, t] = torch.where(done, 0.0, logprobs.gather(-1, token[:, None]).squeeze(-1))
            lengths += (~done).long()
            stopped = ~done & (token == eos_id)  # [B] rows whose EOS is this step's token
            done |= stopped
            ended(stopped.nonzero().squeeze(1), "stop")
            if bool(done.all()):
                break
            positions = positions[:, -1:] + 1
        ended((~done).nonzero().squeeze(1), "length")
        ordered = [responses[i] for i in range(batch)]
        routes = None
        if self._routes is not None:
            routes = self._routes.per_sequence([len(p) for p in prompts], [len(r[0]) for r in ordered], width=width)
        return Generation(response_ids=[r[0] for r in ordered], logprobs=[r[1] for r in ordered],
                          finish_reasons=[r[2] for r in ordered], routes=routes,
                          versions=[[self.weight_version] * len(r[0]) for r in ordered])

    def _prefill(self, ids: Tensor, attention: Tensor, positions: Tensor, prompts: list[list[int]],
                 lean: LeanDecoder | None):
        """The first forward over the left-padded prompts: (its KV cache, the last position's logits [B, V]);
        with `lean`, that decoder's pass, which fills its own cache (None is returned for the cache).
        A group's samples share their prompt, so it reads each distinct prompt once; the cache, logits and
        routes are then copied out to every row that asked for it."""
        firsts, source = _distinct(prompts)
        source_rows = None
        if len(firsts) < len(prompts):
            rows = torch.tensor(firsts, device=self.device)
            source_rows = torch.tensor(source, device=self.device)
            ids, attention, positions = ids[rows], attention[rows], positions[rows]
        if lean is not None:
            return None, lean.prefill(ids, attention, positions, source_rows)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         **self._last_logits)
        cache = self._cache_of(out)
        if source_rows is None:
            return cache, out.logits[:, -1]
        cache.reorder_cache(source_rows)
        if self._routes is not None:
            self._routes.expand_first(source_rows, width=ids.shape[1])
        return cache, out.logits[source_rows, -1]

    def _cache_of(self, out):
        return out.cache if self._cache_arg == "cache" else out.past_key_values

    def _sample(self, logprobs: Tensor, top_p: float) -> Tensor:
        """Draw from the distribution truncated to the smallest set with mass >= top_p."""
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], *, version: int,
                       expected: dict | None = None) -> None:
        """Copy HF-named full tensors (checkpoint names) into the model, bucket by bucket; every parameter,
        and every expert of a stacked expert parameter, must arrive."""
        missing = set().union(*(_slots_of(n, p) for n, p in self._params.items()))
        for bucket in buckets:
            for name, tensor in bucket:
                param_name, expert, half = slot = _slot(name)
                target = self._params.get(param_name)
                if target is None:
                    if name == "lm_head.weight":  # tied to the embedding: arrives under that name
                        continue
                    raise KeyError(f"rollout model has no parameter {name!r}")
                if expert is not None:
                    target = target[expert] if half is None else target[expert].chunk(2, dim=0)[half]
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: pushed shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor.to(target.device, target.dtype))
                # a whole stacked expert tensor (gpt-oss's checkpoint names it so) fills every expert's slot
                missing -= _slots_of(param_name, target) if expert is None else {slot}
        if missing:
            raise ValueError(f"weight push of version {version} missed parameters: {sorted({m[0] for m in missing})[:5]}")
        self.weight_version = version
        self.garbage = False

    @torch.no_grad()
    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], *, rank: int, alpha: float,
                       version: int) -> None:
        """Merge the adapters into the model: each adapted weight becomes base + (alpha / rank) B A, the product
        in fp32, as the trainer merges (megarl.engine.lora_layers). The base weights of the adapted modules are
        kept at the first call (the engine holds them twice)."""
        factors: dict[str, dict[str, Tensor]] = {}
        for name, tensor in named_tensors:
            module, factor = _adapter_slot(name)
            factors.setdefault(module, {})[factor] = tensor
        for module, pair in factors.items():
            param = self._params.get(f"{module}.weight")
            if param is None:
                raise KeyError(f"adapter push of version {version}: the rollout model has no module {module!r}")
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"adapter push of version {version}: {module} came without its "
                                 f"{({'lora_A', 'lora_B'} - set(pair)).pop()}")
            base = self._base.setdefault(module, param.detach().clone())
            delta = pair["lora_B"].to(param.device).float() @ pair["lora_A"].to(param.device).float()
            param.copy_((base.float() + (alpha / rank) * delta).to(param.dtype))
        self.weight_version = version

    def read_weights(self, names: list[str]) -> Iterator[tuple[str, Tensor | None]]:
        """Views of the model's parameters under their checkpoint names (an expert's slice of a stacked
        parameter; a tied output layer is the embedding it shares)."""
        for name in names:
            param_name, expert, half = _slot(name)
            target = self._params.get(param_name)
            if target is None and name == "lm_head.weight":
                target = self.model.get_output_embeddings().weight
            elif target is not None and expert is not None:
                target = target[expert] if half is None else target[expert].chunk(2, dim=0)[half]
            yield name, None if target is None else target.detach()

    # The memory choreography of co-located engines, on a GPU and on the CPU alike: released weights are really
    # freed (their storages resized to zero), and resumed ones hold NaN until a full push fills them, as a GPU
    # engine's pages come back with undefined contents. A run that generates in between fails (`generate`).
    def release_memory(self) -> int:
        """Free the weights' storages (unless the engine keeps its weights); the KV cache of a generation is
        freed when it returns. Returns the bytes given back."""
        self.kv_bytes = 0
        if self.keeps_weights or self._released:
            return 0
        for storage, _ in self._storages:
            storage.resize_(0)
        self._released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the driver: the trainer allocates through its own caching allocator
        return self.weight_bytes

    def resume_weights(self) -> None:
        """Allocate the weights again, filled with NaN: garbage until `update_weights` fills every one."""
        if not self._released:
            return
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
        with torch.no_grad():
            for param in self._params.values():
                param.fill_(float("nan"))
        self._released, self.garbage = False, True

    def resume_cache(self) -> None:
        """Nothing to take back: a generation allocates its own KV cache."""

    def device_bytes(self) -> dict[str, int]:
        """What the engine holds on its device now, by kind: its weights while they are not released, and the KV
        cache of its last generation until the next release."""
        return {"weights": 0 if self._released else self.weight_bytes, "kv_cache": self.kv_bytes}

    def flush_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def abandon(self) -> None:
        """Drop the model and its fused copies: their memory goes back to the allocator (the engine is unusable)."""
        self.model = self._fused = self._routes = None
        self._params = {}

