"""Run in a subprocess by test_sglang.py: the MoE routes SGLang returns against transformers' own routers.

    sglang_routes_worker.py --model DIR --out R.json

Starts one SGLangEngine with capture_routes, generates twice (the second round re-sends the first round's
prompts extended by their responses, so most of each prompt comes from SGLang's prefix cache), and forwards
every full sequence through transformers with a hook on each layer's router. Writes what the test asserts.

On CPU, SGLang's routes buffer is plain memory in its processes (megarl's SGLang plugin,
megarl/rollout/sglang_plugin.py); routing, capture and readback are SGLang's own code.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

warnings.filterwarnings("ignore")

from hf_routing import hf_router_outputs, routers_of  # noqa: E402

PROMPTS = [[21, 22, 15, 23, 25, 33], [30, 31, 15, 33], [24, 15, 24, 33, 4], [7, 9, 11, 13, 17, 19, 23, 29]]
EOS_ID = 0


def hf_routes(model_dir: str, sequences: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: the top-k experts [T, layers, k] transformers' routers pick for each token, and each
    router's logits [T, layers, experts] (to tell a near-tie from a real disagreement)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # a router in every layer: SGLang's rows are one per hidden layer
    assert len(routers_of(model)) == model.config.num_hidden_layers, [type(r).__name__ for r in routers_of(model)]
    outputs = [hf_router_outputs(model, seq) for seq in sequences]
    return [o[0] for o in outputs], [o[1] for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megarl.rollout.sglang_engine import SGLangEngine
    from megarl.models.arch import read_shape

    engine = SGLangEngine(args.model, shape=read_shape(args.model), dtype="float32", seed=0, capture_routes=True)
    sample = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, eos_id=EOS_ID, pad_id=0)
    try:
        first = engine.generate(PROMPTS, **sample)
        # Each second-round prompt is a first-round sequence plus one token: all of it but what SGLang never
        # fed in (the last response token) sits in the prefix cache, and must come back with its routes.
        extended = [p + r + [5] for p, r in zip(PROMPTS, first.response_ids)]
        second = engine.generate(extended, **sample)
        # The same request through SGLang directly, for the count of prompt tokens it took from the cache.
        probe = engine.engine.generate(input_ids=extended[0], sampling_params={"max_new_tokens": 1})
        cached_tokens = probe["meta_info"].get("cached_tokens", 0)
    finally:
        engine.shutdown()

    prompts = PROMPTS + extended
    responses = first.response_ids + second.response_ids
    routes = first.routes + second.routes
    sequences = [p + r for p, r in zip(prompts, responses)]
    ref_indices, ref_logits = hf_routes(args.model, sequences)

    rows = differing = 0
    margins = []  # per sequence: HF's k-th minus (k+1)-th router logit [T, layers]; small means a near-tie
    differing_margins = []  # those margins where SGLang picked other experts
    shapes, dtypes = [], []
    for got, want, logits, prompt, response in zip(routes, ref_indices, ref_logits, prompts, responses):
        fed = len(prompt) + len(response) - 1
        shapes.append([list(got.shape), [fed, want.shape[1], want.shape[2]]])
        dtypes.append(str(got.dtype))
        k = want.shape[-1]
        top = logits[:fed].topk(k + 1, dim=-1).values
        margins.append(top[..., k - 1] - top[..., k])
        same = (got.long().sort(-1).values == want[:fed].sort(-1).values).all(-1)  # [T, layers]: same set
        rows += same.numel()
        differing += int((~same).sum())
        differing_margins += margins[-1][~same].tolist()
    min_gap = min(float(m.min()) for m in margins)
    result = {
        "shapes": shapes, "dtypes": dtypes, "rows": rows, "differing": differing,
        "differing_margins": differing_margins, "min_topk_margin": min_gap,
        "cached_tokens": cached_tokens, "devices": sorted({str(r.device) for r in routes}),
        "response_lengths": [len(r) for r in responses], "finish_reasons": first.finish_reasons + second.finish_reasons,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
