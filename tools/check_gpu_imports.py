"""Every GPU module of the image imports: Transformer Engine, NVIDIA apex with its CUDA extensions, SGLang,
megatron-core with its Transformer Engine layers, and megarl's modules that use them. The Dockerfile runs
it as the image's last build step, where no GPU is visible: a stand-in for the CUDA driver
(megarl.device) lets CUDA builds load there; on a machine with a driver the driver is used.

    python tools/check_gpu_imports.py

Prints each module with its version and exits 1 naming every module that failed to import.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# module -> the distribution whose version is printed beside it
MODULES = {
    "transformer_engine.pytorch": "transformer_engine",  # the trainer's layers on GPU
    "megatron.core.extensions.transformer_engine": "megatron-core",  # megatron-core's TE layer spec
    "megatron.core.optimizer": "megatron-core",
    "apex.normalization": "apex",  # NVIDIA apex (PyPI's `apex` has no such module)
    "amp_C": "apex",  # apex's fused multi-tensor kernels: built only with its CUDA extensions
    "fused_layer_norm_cuda": "apex",
    "fused_weight_gradient_mlp_cuda": "apex",  # gradient accumulation fusion: the trainer turns it on where it imports
    "sglang.srt.entrypoints.engine": "sglang",  # the rollout engine
    "torch_memory_saver": "torch_memory_saver",  # SGLang's memory release
    "megarl.engine.megatron": "megarl",
    "megarl.engine.model": "megarl",
    "megarl.engine.te_attention": "megarl",  # shared-prompt rows through TE's packed attention
    "megarl.rollout.sglang_engine": "megarl",
    "megarl.handoff": "megarl",
}
# megatron-core imports without Transformer Engine and falls back quietly: these flags must say it found TE.
FLAGS = {
    "megatron.core.extensions.transformer_engine": ("HAVE_TE", True),
    "megatron.core.optimizer": ("USING_PYTORCH_OPTIMIZER", False),  # fused Adam from TE (or apex)
}


def main() -> int:
    from megarl.device import load_cuda_driver_stand_in

    load_cuda_driver_stand_in()
    failed = []
    for module, dist in MODULES.items():
        try:
            imported = importlib.import_module(module)
            version = md.version(dist)
        except Exception:  # noqa: BLE001  an import error of any kind is this check's finding
            failed.append(module)
            print(f"FAILED {module}\n{traceback.format_exc(limit=3)}", file=sys.stderr)
            continue
        if module in FLAGS:
            name, expected = FLAGS[module]
            if getattr(imported, name, None) is not expected:
                failed.append(module)
                print(f"FAILED {module}: {name} is {getattr(imported, name, None)}, not {expected} "
                      "(megatron-core fell back to its implementation without Transformer Engine)", file=sys.stderr)
                continue
        print(f"ok     {module:48s} {dist} {version}")
    if failed:
        print(f"{len(failed)} GPU module(s) do not import: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
