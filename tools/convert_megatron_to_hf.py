"""Convert a megarl checkpoint (a run's `checkpoints/stepN`, or the output of convert_hf_to_megatron.py)
into a HuggingFace checkpoint: sharded safetensors with an index, config.json and tokenizer files.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--tp N] [--pp N] [--ep N] [--shard-gb 5]
    torchrun --nproc_per_node=N tools/convert_megatron_to_hf.py --ckpt DIR --out DIR --tp N ...

The policy (`DIR/actor`) is exported; a critic is not a causal LM and is refused. Tensors are gathered and
written one at a time into shards of at most --shard-gb, so the writing rank holds one shard plus one full
tensor; with torchrun the model itself is split over the processes. The output is published with one
rename and loads in transformers, SGLang or vLLM. OUT must not exist: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.checkpoint import CheckpointError, save_hf  # noqa: E402
from megarl.models.arch import check_layout, read_shape  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory holding actor/ and hf/")
    parser.add_argument("--out", required=True, help="output HF directory (must not exist)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="dtype of the exported weights (default: the config's torch_dtype, else float32)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard, GiB")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

    ckpt, out = Path(args.ckpt), Path(args.out)
    if ckpt.name == "critic" or (not (ckpt / "actor").exists() and (ckpt / "critic").exists()):
        sys.exit(f"convert: {ckpt} is a critic (a value model with a scalar head), not a causal LM; "
                 f"export the policy: --ckpt {ckpt.parent if ckpt.name == 'critic' else ckpt} (its actor/)")
    if ckpt.name == "actor":
        ckpt = ckpt.parent
    for needed in (ckpt / "actor" / "metadata.json", ckpt / "hf" / "config.json"):
        if not needed.is_file():
            sys.exit(f"convert: {needed} is missing: {ckpt} is not a megarl checkpoint (actor/ and hf/)")
    if out.exists():
        sys.exit(f"convert: {out} exists; choose a new directory (nothing is overwritten)")
    try:
        shape = read_shape(ckpt / "hf")
        check_layout(shape, tp=args.tp, pp=args.pp, cp=1, ep=args.ep,
                     world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        sys.exit(f"convert: {e}")

    import torch.distributed as dist
    from tqdm import tqdm

    from megarl.engine.megatron import TrainEngine, init_parallel

    dtype = args.dtype or _config_dtype(ckpt / "hf")
    groups = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep)
    engine = TrainEngine(model_dir=str(ckpt / "hf"), dtype=dtype, megatron={}, groups=groups, load_weights=False)
    try:
        engine.load_checkpoint(ckpt / "actor")
    except CheckpointError as e:
        sys.exit(f"convert: {e}")
    tensors = engine.pipeline_hf_tensors()
    if dist.get_rank() == 0:
        bar = tqdm(tensors, desc="convert", unit="tensor")
        save_hf(bar, source_dir=ckpt / "hf", out_dir=out, shard_bytes=int(args.shard_gb * 2**30),
                meta={"converted_from": str(ckpt)})
        print(f"convert: wrote {out}", flush=True)
    else:
        for _ in tensors:  # drive the gathers
            pass
    dist.barrier()
    dist.destroy_process_group()


def _config_dtype(hf_dir: Path) -> str:
    import json

    dtype = json.loads((hf_dir / "config.json").read_text()).get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


if __name__ == "__main__":
    main()
