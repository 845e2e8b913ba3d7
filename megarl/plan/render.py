"""`megarl plan`'s output: a plan as the table people read, or as JSON for tools."""

from __future__ import annotations

import json
from dataclasses import asdict

from megarl.plan.estimate import Plan, gib, rank_range
from megarl.plan.memory import GIB, HOST_RESERVE_GIB, RESERVE_GIB

# the layout's fields in the JSON; then the sequence length and the ranks of the SGLang engines
LAYOUT_KEYS = ("world", "rollout_ranks", "tp", "pp", "cp", "ep", "etp", "dp", "expert_dp", "vpp", "micro_batches")

def render_table(p: Plan) -> str:
    """The plan as `megarl plan` prints it: cluster, model, layout, each model's bytes, each phase's verdict, the
    host memory, whether it fits and why not, and the assumptions."""
    c, lay, r, m, h = p.cluster, p.layout, p.rollout, p.model, p.host
    split = lay.rollout_ranks > 0
    trainers, generators = rank_range(0, lay.world), rank_range(lay.world, c.world)
    experts = (f", {m['experts']} experts top-{m['topk']} (width {m['moe_ffn']})" if m["experts"] else "")
    if r is None:
        rollout = "rollout: none (trained on a fixed data set)"
    else:
        rollout = (f"rollout: {r.engines} {r.engine} engine(s) x {r.gpus} GPU(s)"
                   + (f" on the rollout GPUs ({generators})" if split else "")
                   + f"; weights {gib(r.weights)} GiB/GPU, "
                   f"KV cache {gib(r.kv_bytes)} GiB = {r.kv_tokens} tokens = {r.samples} full-length samples")
    world = f"training world {lay.world}" if split else f"world {c.world}"
    per_gpu = f"GiB per training GPU (stage {p.stage})" if split else f"GiB per GPU (pipeline stage {p.stage})"
    lines = [
        f"megarl plan: {p.recipe} on {c.nodes} node(s) x {c.gpus_per_node} GPUs, {c.gpu_mem_gib:g} GiB each, "
        f"{c.host_mem_gib:g} GiB host memory per node",
        f"model: {m['arch']}, {m['params'] / 1e9:.2f}B parameters, {m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']} heads / {m['kv_heads']} query groups{experts}",
        f"layout: {world} = tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp}"
        + (f"; experts: etp {lay.etp} x ep {lay.ep} x pp {lay.pp} x expert-dp {lay.expert_dp}" if m["experts"] else "")
        + (f"; {lay.vpp} virtual stages" if lay.vpp > 1 else "")
        + (f" ({trainers}); placement split: {generators} of world {c.world} only generate" if split else ""),
        f"batch: {lay.micro_batches} micro-batches per data-parallel rank, {p.seq_len} tokens per sequence",
        rollout,
        "",
        f"{per_gpu:<30}  params   grads   optim   activations",
    ]
    for mm in p.models:
        lines.append(f"  {mm.name:<30}{gib(mm.params):>7} {gib(mm.grads):>7} {gib(mm.optim):>7} "
                     f"{gib(mm.activations):>13}")
    lines.append(f"  {'reserve (contexts, NCCL)':<30}{RESERVE_GIB:>7.1f}")
    for mm in p.models:
        if mm.host_optim:
            lines.append(f"  {mm.name}: optimizer {gib(mm.host_optim)} GiB on the host, stepped there (optim.cpu_offload "
                         f"{p.job.cfg.optim.cpu_offload:g}: moments, master copy, gradient copy)")
    lines.append("")
    lines.append(f"phase      GiB per GPU   (usable {gib(p.limit)})")
    kinds = [(f"training GPUs ({trainers}): no rollout engine, nothing offloaded", p.phases),
             (f"rollout GPUs ({generators}): the engine alone", p.rollout_phases)] if split else [("", p.phases)]
    for title, phases in kinds:
        lines += [title] if title else []
        for name, nbytes in phases.items():
            lines.append(f"  {name:<9}{gib(nbytes):>12}   {'ok' if nbytes <= p.limit else 'DOES NOT FIT'}")
    lines.append(f"host memory per node: {gib(h.per_node)} GiB (usable {gib(h.limit)})   "
                 f"{'ok' if h.per_node <= h.limit else 'DOES NOT FIT'}")
    routes = f"MoE routes {gib(h.routes)}, " if p.routing else ""
    kept = f"optimizer {gib(h.kept)} kept by optim.cpu_offload, " if h.kept else ""
    if split:
        lines.append(f"  per GPU: nothing offloaded (placement split), {kept}{routes}processes {HOST_RESERVE_GIB:g}")
    elif r is not None:
        kept = f" ({gib(h.kept)} of it kept there by optim.cpu_offload)" if h.kept else ""
        lines.append(f"  per GPU: parameters {gib(h.params)} pinned, optimizer {gib(h.optim)}{kept}, first offload "
                     f"{gib(h.first_offload)}, {routes}processes {HOST_RESERVE_GIB:g}")
    elif kept:
        lines.append(f"  per GPU: nothing offloaded, {kept}processes {HOST_RESERVE_GIB:g}")
    if p.routing is not None:
        rt = p.routing
        lines.append(f"MoE routes: {rt.bytes_per_token} bytes/token; host {rt.host_per_rank / GIB:.2f} GiB per rank "
                     f"({rt.tokens_per_rank} tokens), {rt.host_per_node / GIB:.2f} GiB per node; device "
                     f"{rt.device_train / GIB:.3f} GiB per GPU in train (one micro-batch, int64)")
    peaks = (f": training GPUs {gib(max(p.phases.values()))}, rollout GPUs {gib(max(p.rollout_phases.values()))}"
             if split else "")
    lines.append(f"fits: {'yes' if p.fits else 'no'} (peak {gib(p.peak)} of {gib(p.limit)} GiB usable per GPU"
                 f"{peaks})")
    lines += [f"  - {problem}" for problem in p.problems]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def to_json(p: Plan) -> str:
    """The plan as JSON. `layout` holds the layout's sizes, the sequence length and the rank of every SGLang
    engine (empty for the native engine, SFT and DPO). `phases_gib` are the phases of the GPUs that train (all
    of them unless placement is split); with placement split `gpus` gives each kind, training and rollout, its
    ranks, phases and peak (null otherwise)."""
    lay, split = p.layout, p.layout.rollout_ranks > 0

    def kind(first: int, stop: int, phases: dict[str, int]) -> dict:
        return {"ranks": [first, stop - 1], "count": stop - first,
                "phases_gib": {k: v / GIB for k, v in phases.items()}, "peak_gib": max(phases.values()) / GIB}

    layout = {**{key: getattr(lay, key) for key in LAYOUT_KEYS}, "seq_len": p.seq_len,
              "rollout_engines": lay.engine_ranks if p.rollout is not None and p.rollout.engine == "sglang" else []}
    gpus = {"training": kind(0, lay.world, p.phases),
            "rollout": kind(lay.world, p.cluster.world, p.rollout_phases)} if split else None
    out = {
        "recipe": p.recipe, "fits": p.fits, "problems": p.problems, "peak_gib": p.peak / GIB,
        "usable_gib": p.limit / GIB, "cluster": asdict(p.cluster), "model": p.model, "layout": layout,
        "stage": p.stage, "models": [{**asdict(m), "state": m.state} for m in p.models],
        "rollout": asdict(p.rollout) if p.rollout is not None else None,
        "routing": asdict(p.routing) if p.routing is not None else None,
        "phases_gib": {k: v / GIB for k, v in p.phases.items()},
        "gpus": gpus,
        "host": {**asdict(p.host), "per_node_gib": p.host.per_node / GIB, "usable_gib": p.host.limit / GIB},
        "assumptions": p.assumptions,
    }
    return json.dumps(out, indent=2)
