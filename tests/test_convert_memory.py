"""The conversion tools stream: converting a 256 MB model in either direction raises the tool's peak
resident memory above that of a process that imports the same modules and builds the same weightless
(meta-device) skeleton by well under the model's size, where a tool that materializes the model needs at
least its size once.
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.timeout(600)

TOOL_TIMEOUT_S = 300
SHARD_GB = 1 / 64  # 16 MiB shards, so the export's bounded buffers are small next to the model
# Peak RSS of the process `ARGS` runs as, measured by its parent once it has exited (the only child the
# parent waits for, so RUSAGE_CHILDREN is that process alone).
PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print('peak_bytes', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")
SKELETON = ("import sys; sys.path.insert(0, sys.argv[2]); import convert_hf_to_megatron, convert_megatron_to_hf; "
            "import megarl.engine.lazy_checkpoint; from megarl.engine.megatron import meta_engine; "
            "from megarl.models.arch import read_shape; meta_engine(sys.argv[1], shape=read_shape(sys.argv[1]), "
            "dtype='float32')")


def peak_bytes(args: list[str]) -> int:
    result = run_python(["-c", PEAK, sys.executable, *args], timeout_s=TOOL_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split("peak_bytes")[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 16-layer Llama with hidden 512 and MLP 2048: 64M fp32 parameters, 256 MB, largest tensor 8 MB."""
    out = tmp_path_factory.mktemp("memory") / "llama"
    result = run_python([str(REPO / "tools" / "make_tiny_model.py"), "--out", str(out), "--arch", "llama",
                         "--hidden", "512", "--layers", "16", "--heads", "8", "--kv-heads", "8", "--ffn", "2048"],
                        timeout_s=TOOL_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_both_directions_convert_in_a_fraction_of_the_model_size(model, tmp_path):
    model_bytes = (model / "model.safetensors").stat().st_size
    baseline = peak_bytes(["-c", SKELETON, str(model), str(REPO / "tools")])
    to_megatron = peak_bytes([str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf", str(model),
                              "--out", str(tmp_path / "megatron")])
    to_hf = peak_bytes([str(REPO / "tools" / "convert_megatron_to_hf.py"), "--ckpt", str(tmp_path / "megatron"),
                        "--out", str(tmp_path / "hf"), "--shard-gb", str(SHARD_GB)])
    # Streaming holds about one tensor (HF -> Megatron: the HF parts, their fused copy and one chunk, 3 x 8 MB)
    # or a read bucket and a shard of 16 MiB each plus a tensor (Megatron -> HF): about 0.1-0.25 of the model
    # here, allocator slack included. Materializing the model, as a non-streaming tool does, is >= 1x.
    for direction, peak in (("HF -> Megatron", to_megatron), ("Megatron -> HF", to_hf)):
        extra = peak - baseline
        assert extra < 0.5 * model_bytes, (f"{direction}: peak RSS {peak / 2**20:.0f} MiB, {extra / 2**20:.0f} MiB "
                                           f"over the skeleton's {baseline / 2**20:.0f} MiB, for a "
                                           f"{model_bytes / 2**20:.0f} MiB model")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # the export really wrote shards
