"""Convert a HuggingFace checkpoint into a Megatron distributed checkpoint that megarl loads at any layout.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N] [--pp N] [--ep N] [--etp N] [--dtype bfloat16]
    torchrun --nproc_per_node=N tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp N ...

OUT gets `actor/` (the distributed checkpoint) and `hf/` (config and tokenizer files, so the checkpoint
describes itself). The model is never built: its Megatron skeleton lives on the meta device, and each
tensor is read from the safetensors files (memory-mapped) when the writer reaches it and dropped once
written, so memory holds about one tensor whatever the model size. The result loads at any TP/PP/EP/ETP
layout. The layout only splits the writing: under torchrun each process writes its own shard of the
checkpoint, reading from the safetensors files just the tensors that shard needs. OUT must not exist:
nothing is overwritten; the output is published with one rename.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.checkpoint import copy_side_files  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()

    out = Path(args.out)
    if out.exists():
        sys.exit(f"convert: {out} exists; choose a new directory (nothing is overwritten)")
    import torch.distributed as dist
    from tqdm import tqdm

    from megarl.engine.megatron import meta_engine
    from megarl.models.arch import read_shape

    try:
        engine = meta_engine(args.hf, shape=read_shape(args.hf), dtype=args.dtype, tp=args.tp, pp=args.pp, ep=args.ep,
                             etp=args.etp)
    except ValueError as e:
        sys.exit(f"convert: {e}")
    rank0 = dist.get_rank() == 0
    tmp = out.with_name(f".{out.name}.tmp")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        shape = engine.shape
        print(f"convert: {shape.arch}, {shape.layers} layers, hidden {shape.hidden}, from {args.hf} "
              f"at tp={args.tp} pp={args.pp} ep={args.ep} etp={engine.stage.groups.etp_size} "
              f"on {dist.get_world_size()} process(es)", flush=True)
    dist.barrier()
    start = time.perf_counter()
    bar = tqdm(desc="convert", unit="tensor", disable=not rank0)
    try:
        engine.save_checkpoint(tmp / "actor", hf_dir=args.hf, progress=bar.update)
    except (FileNotFoundError, KeyError, ValueError) as e:  # a missing, truncated or foreign weight file
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"convert: {e}")
    bar.close()
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
