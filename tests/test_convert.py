"""The conversion tools: HF -> Megatron distributed checkpoint -> HF is bit-exact for every architecture and
across layouts (written at TP=2, EP=2 or TP=2 with each expert whole (ETP=1) over EP=2, read back on one rank;
written on one rank, loaded split two ways), and bad input stops with an error naming what is wrong without
overwriting anything. Also: no torch.load in megarl unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_python

pytestmark = pytest.mark.timeout(600)

ARCHS = ("qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
         "gpt_oss", "gemma3")
TOOL_TIMEOUT_S = 180


def to_megatron(hf: Path, out: Path, *, nproc: int = 1, **layout: int):
    args = [str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf", str(hf), "--out", str(out)]
    args += [f"--{k}={v}" for k, v in layout.items()]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return run_python(args, timeout_s=TOOL_TIMEOUT_S)


def to_hf(ckpt: Path, out: Path, *extra: str):
    return run_python([str(REPO / "tools" / "convert_megatron_to_hf.py"), "--ckpt", str(ckpt), "--out", str(out),
                       *extra], timeout_s=TOOL_TIMEOUT_S)


def hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    return {k: v for f in files for k, v in load_file(str(model_dir / f)).items()}


def assert_bit_exact(got_dir: Path, want_dir: Path) -> None:
    got, want = hf_weights(got_dir), hf_weights(want_dir)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert json.loads((got_dir / "config.json").read_text()) == json.loads((want_dir / "config.json").read_text())
    assert (got_dir / "tokenizer.json").read_bytes() == (want_dir / "tokenizer.json").read_bytes()


def made_once(make, out: Path):
    """`get(arch)`: the directory `out / arch`, written by `make(arch, out / arch)` (a tool's process, which
    must succeed) the first time it is asked for."""
    made: set[str] = set()

    def get(arch: str) -> Path:
        if arch not in made:
            result = make(arch, out / arch)
            assert result.returncode == 0, result.stderr[-3000:]
            made.add(arch)
        return out / arch
    return get


@pytest.fixture(scope="module")
def converted(arch_dir, tmp_path_factory):
    """`converted(arch)`: the one-process `to_megatron` checkpoint of that tiny architecture, made on first use
    and shared by the tests that only read it (each conversion is a fresh interpreter, ~5 s)."""
    return made_once(lambda arch, out: to_megatron(arch_dir(arch), out), tmp_path_factory.mktemp("converted"))


@pytest.fixture(scope="module")
def round_trip(converted, tmp_path_factory):
    """`round_trip(arch)`: `converted(arch)` exported back to HF by `to_hf`, made on first use."""
    return made_once(lambda arch, out: to_hf(converted(arch), out), tmp_path_factory.mktemp("round_trip"))


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact(arch, arch_dir, round_trip):
    assert_bit_exact(round_trip(arch), arch_dir(arch))


@pytest.mark.parametrize("arch, nproc, layout", [("qwen2", 2, {"tp": 2}), ("mixtral", 2, {"ep": 2}),
                                                  ("qwen3_moe", 2, {"tp": 2, "etp": 1, "ep": 2})],
                         ids=["qwen2-tp2", "mixtral-ep2", "qwen3_moe-tp2etp1ep2"])
def test_a_checkpoint_written_at_one_layout_reads_at_another(arch, nproc, layout, arch_dir, tmp_path):
    result = to_megatron(arch_dir(arch), tmp_path / "megatron", nproc=nproc, **layout)
    assert result.returncode == 0, result.stderr[-3000:]
    result = to_hf(tmp_path / "megatron", tmp_path / "hf", "--shard-gb", "0.0001")  # several shards
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_bit_exact(tmp_path / "hf", arch_dir(arch))


# qwen3_moe and gpt_oss: attention split over TP=2, each expert whole (ETP=1) on one of the EP=2 ranks
LOAD_LAYOUTS = {"qwen2": {"tp": 2}, "llama": {"pp": 2}, "mixtral": {"ep": 2}, "glm4_moe": {"ep": 2},
                "deepseek_v3": {"tp": 2}, "qwen3_moe": {"tp": 2, "etp": 1, "ep": 2},
                "gpt_oss": {"tp": 2, "etp": 1, "ep": 2}}


@pytest.fixture(scope="module")
def loaded_at_layouts(converted, tmp_path_factory) -> Path:
    """FOLDER/ARCH.safetensors: what a TrainEngine on two ranks at LOAD_LAYOUTS[ARCH] loaded from converted(ARCH)
    and handed off; one torchrun job loads them all in turn (each rank pays its imports once)."""
    folder = tmp_path_factory.mktemp("loaded")
    cases = [["--ckpt", str(converted(arch)), "--out", str(folder / f"{arch}.safetensors"),
              *[f"--{k}={v}" for k, v in layout.items()]] for arch, layout in LOAD_LAYOUTS.items()]
    (folder / "cases.json").write_text(json.dumps(cases))
    result = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         str(REPO / "tests" / "convert_load_worker.py"), "--cases", str(folder / "cases.json")],
                        timeout_s=len(cases) * TOOL_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.mark.parametrize("arch", LOAD_LAYOUTS, ids=["qwen2-tp2", "llama-pp2", "mixtral-ep2", "glm4_moe-ep2",
                                                   "deepseek_v3-tp2", "qwen3_moe-tp2etp1ep2", "gpt_oss-tp2etp1ep2"])
def test_a_converted_checkpoint_loads_bit_exact_at_another_layout(arch, arch_dir, loaded_at_layouts):
    """Written by one process (the streaming writer), read by a TrainEngine split two ways."""
    got, want = load_file(str(loaded_at_layouts / f"{arch}.safetensors")), hf_weights(arch_dir(arch))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch", ["qwen2", "glm4_moe", "deepseek_v3"])
def test_an_exported_checkpoint_loads_in_transformers_with_the_same_logits(arch, arch_dir, round_trip):
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(round_trip(arch)), dtype=torch.float32)(tokens).logits
        want = AutoModelForCausalLM.from_pretrained(str(arch_dir(arch)), dtype=torch.float32)(tokens).logits
    assert torch.equal(got, want)  # the same weights: the same function, exactly


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_megatron(converted) -> Path:
    return converted("llama")  # read or copied, never changed


def test_a_checkpoint_of_another_architecture_lists_the_mismatched_tensors(llama_megatron, arch_dir, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(llama_megatron, wrong)
    shutil.rmtree(wrong / "hf")
    shutil.copytree(arch_dir("qwen3"), wrong / "hf")  # q/k norms the llama checkpoint does not have
    result = to_hf(wrong, tmp_path / "hf")
    assert result.returncode != 0 and not (tmp_path / "hf").exists()
    assert "do not match this model" in result.stderr
    assert re.search(r"q_layernorm\.weight: not in the checkpoint", result.stderr), result.stderr[-2000:]


def test_missing_or_truncated_files_are_named(llama_megatron, tmp_path):
    no_metadata = tmp_path / "no_metadata"
    shutil.copytree(llama_megatron, no_metadata)
    (no_metadata / "actor" / "metadata.json").unlink()
    result = to_hf(no_metadata, tmp_path / "out1")
    assert result.returncode != 0 and f"{no_metadata / 'actor' / 'metadata.json'} is missing" in result.stderr

    truncated = tmp_path / "truncated"
    shutil.copytree(llama_megatron, truncated)
    shard = max((truncated / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = to_hf(truncated, tmp_path / "out2")
    assert result.returncode != 0 and not (tmp_path / "out2").exists()
    assert shard.name in result.stderr, result.stderr[-2000:]


def test_a_truncated_hf_weight_file_is_named(arch_dir, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(arch_dir("llama"), cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = to_megatron(cut, tmp_path / "out")
    assert result.returncode != 0 and not (tmp_path / "out").exists()
    assert f"{weights}: not a readable safetensors file" in result.stderr, result.stderr[-2000:]


def test_nothing_is_overwritten(llama_megatron, arch_dir, tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for result in (to_hf(llama_megatron, existing), to_megatron(arch_dir("llama"), existing)):
        assert result.returncode != 0 and "exists; choose a new directory" in result.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_every_torch_load_is_weights_only():
    """Weights come from safetensors or distributed checkpoints; a torch.load that could unpickle arbitrary
    objects would make loading a checkpoint code execution."""
    offenders = []
    for path in [*REPO.joinpath("megarl").rglob("*.py"), *REPO.joinpath("tools").rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, offenders
