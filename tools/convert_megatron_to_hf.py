"""Convert a megarl checkpoint (a run's `checkpoints/stepN`, or the output of convert_hf_to_megatron.py)
into a HuggingFace checkpoint: sharded safetensors with an index, config.json and tokenizer files.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--shard-gb 5] [--dtype bfloat16]

The policy (`DIR/actor`) is exported; a critic is not a causal LM and is refused. The model is never
built: its Megatron skeleton lives on the meta device, the distributed checkpoint (saved at any layout)
is read a bucket of at most min(--shard-gb, 1 GiB) at a time, and the HF tensors are written into
safetensors shards of at most --shard-gb as they fill, so memory holds about one bucket plus one shard
whatever the model size. It runs in one process: the checkpoint's tensors are global, so extra processes
would only split the reading of what one writer must receive anyway. The output is published with one
rename and loads in transformers, SGLang or vLLM. OUT must not exist: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.checkpoint import CheckpointError, save_hf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory holding actor/ and hf/")
    parser.add_argument("--out", required=True, help="output HF directory (must not exist)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="dtype of the exported weights (default: the config's torch_dtype, else float32)")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors shard, GiB")
    args = parser.parse_args()

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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit("convert: the export streams the checkpoint through one process; run it without torchrun")
    from tqdm import tqdm

    from megarl.engine.megatron import meta_engine
    from megarl.models.arch import read_shape

    shard_bytes = int(args.shard_gb * 2**30)
    try:
        engine = meta_engine(ckpt / "hf", shape=read_shape(ckpt / "hf"), dtype=args.dtype or _config_dtype(ckpt / "hf"))
        tensors = engine.hf_tensors(checkpoint=ckpt / "actor", bucket_bytes=min(shard_bytes, 2**30))
        save_hf(tqdm(tensors, desc="convert", unit="tensor"), source_dir=ckpt / "hf", out_dir=out,
                shard_bytes=shard_bytes, meta={"converted_from": str(ckpt)})
    except (CheckpointError, ValueError) as e:
        sys.exit(f"convert: {e}")
    print(f"convert: wrote {out}", flush=True)


def _config_dtype(hf_dir: Path) -> str:
    dtype = json.loads((hf_dir / "config.json").read_text()).get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


if __name__ == "__main__":
    main()
