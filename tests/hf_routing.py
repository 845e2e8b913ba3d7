"""What transformers' own MoE routers choose: the reference the engines' and the trainer's routing is tested against.

transformers 5's MoE routers (Mixtral, Qwen2-MoE, Qwen3-MoE: `*TopKRouter`) return (logits, scores, top-k expert ids)
over the flattened tokens of a forward.
"""

from __future__ import annotations

import torch


def routers_of(model) -> list:
    """The model's MoE routers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def hf_router_outputs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward of the one sequence `ids`: the experts every router picks for each token [T, layers, top_k] and
    its logits [T, layers, experts] (to tell a near-tie from a real disagreement)."""
    routers = routers_of(model)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append((out[2], out[0]))) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(routers) > 0, (len(seen), len(routers))
    return (torch.stack([s[0].reshape(len(ids), -1) for s in seen], dim=1),
            torch.stack([s[1].reshape(len(ids), -1) for s in seen], dim=1))
