"""The train phase with shared prompts (train.share_prompts) on vs off, on the same batch and model.

    python tools/bench_shared_prompt.py                      # the three shapes below, tiny model, one thread
    python tools/bench_shared_prompt.py --shapes 128,32,8 --reps 9

For each (P, R, n) (prompt tokens, response tokens, samples per group), a batch of groups of n samples of one
prompt each, as many groups as make about --tokens tokens without sharing, trained by
TrainEngine.train_step with the GRPO policy loss in packed micro-batches of at most --micro-batch-tokens
tokens: once as packed sequences (n * (P + R) tokens a group), once with each group's prompt held once
(P + n * R). The two steps alternate (so load from other processes falls on both alike) and the median of
--reps is reported after --warmup untimed pairs. Token ratio: trained tokens off / on; time ratio: step time
off / on. Single process, fp32, the quickstart's model shape (hidden 128, 2 layers, 8 heads, 4 KV heads).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_train import paired_medians  # noqa: E402

from megarl.algo.aggregate import global_loss_norm  # noqa: E402
from megarl.config import AlgoConfig, OptimConfig  # noqa: E402
from megarl.objective import policy_objective  # noqa: E402
from megarl.packing import PromptGroups, prompt_units, unit_tokens  # noqa: E402

SHAPES = ((8, 5, 4), (128, 32, 8), (512, 64, 16))
MODEL = dict(hidden=128, layers=2, heads=8, kv_heads=4, ffn=256)  # the quickstart's


def make_model(out: Path) -> Path:
    if (out / "megarl_tiny.json").exists():
        return out
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.make_tiny_model(out, arch="qwen2", seed=0, **MODEL)


def group_batch(prompt: int, response: int, n: int, groups: int, *, vocab: int, seed: int = 0):
    """Tokens [groups * n, P + R] (each group's samples share P prompt tokens), the policy loss's extras and
    the prompt groups."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (groups, 1, prompt), generator=gen).expand(-1, n, -1)
    responses = torch.randint(3, vocab, (groups, n, response), generator=gen)
    tokens = torch.cat([prompts, responses], dim=2).reshape(groups * n, prompt + response)
    mask = (torch.arange(prompt + response) >= prompt).float().expand(len(tokens), -1).contiguous()
    advantages = torch.randn(len(tokens), 1, generator=gen) * mask
    old = -4.0 + 0.1 * torch.randn(tokens.shape, generator=gen)
    extras = {"response_mask": mask, "old_logprobs": old * mask, "advantages": advantages}
    prompt_groups = PromptGroups(torch.arange(groups).repeat_interleave(n), torch.full((len(tokens),), prompt))
    return tokens, extras, prompt_groups


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                        help="P,R,n triples (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=8192, help="about this many unshared tokens per step")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="train.micro_batch_tokens")
    parser.add_argument("--work-dir", default="/tmp/megarl_bench", help="where the model is made")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.engine.parallel import init_parallel

    model_dir = make_model(Path(args.work_dir) / "qwen2_quickstart_shape")
    optim = OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0, distributed=False)
    engine = TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={},
                         groups=init_parallel(tp=1, pp=1, seed=0), optim=optim)
    print(f"model {model_dir}, {torch.get_num_threads()} thread, micro_batch_tokens {args.micro_batch_tokens}, "
          f"median of {args.reps} after {args.warmup} warmup")
    results = []
    for shape in args.shapes:
        prompt, response, n = (int(x) for x in shape.split(","))
        groups = max(1, args.tokens // (n * (prompt + response)))
        tokens, extras, prompt_groups = group_batch(prompt, response, n, groups, vocab=engine.shape.vocab_size)
        lengths = torch.full((len(tokens),), prompt + response)
        loss_fn = partial(policy_objective(AlgoConfig()), norm=global_loss_norm(extras["response_mask"]))
        step = partial(engine.train_step, tokens, extras, loss_fn, temperature=1.0, micro_batch_size=1,
                       lengths=lengths, micro_batch_tokens=args.micro_batch_tokens)
        off_s, on_s = paired_medians(step, partial(step, prompt_groups=prompt_groups), warmup=args.warmup,
                                     reps=args.reps)
        units = prompt_units(tokens, lengths, prompt_groups, max_tokens=args.micro_batch_tokens)
        off_tokens, on_tokens = int(lengths.sum()), sum(unit_tokens(u, lengths, prompt_groups.prompt_lens) for u in units)
        results.append(dict(prompt=prompt, response=response, n=n, groups=groups, off_tokens=off_tokens,
                            on_tokens=on_tokens, off_s=off_s, on_s=on_s))
        print(f"(P, R, n) = ({prompt}, {response}, {n}) x {groups} groups: tokens {off_tokens} -> {on_tokens} "
              f"({off_tokens / on_tokens:.2f}x), step {off_s:.3f} s -> {on_s:.3f} s ({off_s / on_s:.2f}x)")
    return results


if __name__ == "__main__":
    main()
