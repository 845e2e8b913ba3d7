"""Convert a HuggingFace checkpoint into a Megatron distributed checkpoint that megarl loads at any layout.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N] [--pp N] [--ep N] [--dtype bfloat16]
    torchrun --nproc_per_node=N tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp N ...

OUT gets `actor/` (the distributed checkpoint: each rank writes its own shards) and `hf/` (config and
tokenizer files, so the checkpoint describes itself). The layout only decides how the work and the memory
are split: under torchrun each process reads from the safetensors files just the slices its shard needs,
so a model larger than one process's memory converts with enough processes. The result loads at any
TP/PP/EP layout. OUT must not exist: nothing is overwritten; the output is published with one rename.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.checkpoint import copy_side_files  # noqa: E402
from megarl.models.arch import check_layout, read_shape  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

    out = Path(args.out)
    if out.exists():
        sys.exit(f"convert: {out} exists; choose a new directory (nothing is overwritten)")
    try:
        shape = read_shape(args.hf)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        check_layout(shape, tp=args.tp, pp=args.pp, cp=1, ep=args.ep, world_size=world)
    except ValueError as e:
        sys.exit(f"convert: {e}")

    import torch.distributed as dist

    from megarl.engine.megatron import TrainEngine, init_parallel

    groups = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep)
    rank0 = dist.get_rank() == 0
    tmp = out.with_name(f".{out.name}.tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"convert: {shape.arch}, {shape.layers} layers, hidden {shape.hidden}, from {args.hf} "
              f"at tp={args.tp} pp={args.pp} ep={args.ep} on {world} process(es)", flush=True)
    dist.barrier()
    start = time.perf_counter()
    engine = TrainEngine(model_dir=args.hf, dtype=args.dtype, megatron={}, groups=groups)
    if rank0:
        print(f"convert: read the HF weights in {time.perf_counter() - start:.1f} s; writing", flush=True)
    engine.save_checkpoint(tmp / "actor")
    if rank0:
        (tmp / "hf").mkdir()
        copy_side_files(args.hf, tmp / "hf")
    dist.barrier()
    if rank0:
        os.rename(tmp, out)
        print(f"convert: wrote {out} in {time.perf_counter() - start:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
