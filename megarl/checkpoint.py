"""Checkpoints on disk: resumable run checkpoints and HF exports, both published atomically.

RUN_DIR/checkpoints/ holds one directory per saved step (`step00000050/`, written by the training loop as
`.tmp-step00000050/` and published with one rename once every rank has finished writing), a `latest` file
naming the newest complete one (replaced atomically, after the rename), and `final/`, the HF export of the
finished policy. A crash at any moment leaves either the previous `latest` or the new one, never a
half-written checkpoint that resume would load; stale `.tmp-*` directories are removed at the next save.

Each step directory holds `manifest.json`: every other file's size and (with `checkpoint.checksums`) sha256,
computed by all ranks in parallel once every rank has finished writing. Resume checks a checkpoint against it
before loading anything: a truncated or damaged file (a disk that filled up under a writer that did not
notice, a bad copy, a flipped bit) is named, its checkpoint moved aside as `.corrupt-stepN`, and the run
resumes from the newest one that is whole.

HF exports are written to a temporary sibling directory and published with one rename too; config and
tokenizer files are copied from the source model.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

# Files of an HF checkpoint directory that are not weights.
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def save_hf(named_tensors: Iterable[tuple[str, Tensor]], *, source_dir: str | Path, out_dir: str | Path,
            shard_bytes: int = 2 * 2**30, meta: dict | None = None, config: dict | None = None) -> Path:
    """Write `named_tensors` as sharded safetensors with an index, plus `source_dir`'s side files.

    Tensors are streamed into shards of at most `shard_bytes`; only one shard is held in memory.
    `out_dir` is replaced atomically; `meta` goes to `megarl_checkpoint.json`; `config`, when given, is
    written as config.json instead of the source's (`classifier_config`).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = _fresh_tmp(out_dir)
    weight_map: dict[str, str] = {}
    shard: dict[str, Tensor] = {}
    shard_size, files, total = 0, [], 0

    def flush():
        nonlocal shard, shard_size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_size = {}, 0

    try:
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if shard and shard_size + nbytes > shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
            shard_size += nbytes
            total += nbytes
    except BaseException:
        shutil.rmtree(tmp)  # a source that fails midway (a damaged checkpoint) leaves nothing behind
        raise
    if shard:
        flush()
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copy_side_files(source_dir, tmp)
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "megarl_checkpoint.json").write_text(json.dumps(meta or {}, indent=2) + "\n")
    return _replace_dir(tmp, out_dir)


def _fresh_tmp(out_dir: Path) -> Path:
    """An empty directory beside `out_dir` to write it in (`_replace_dir` publishes it)."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _replace_dir(tmp: Path, out_dir: Path) -> Path:
    """Publish the fully written `tmp` as `out_dir`, replacing what was there: a reader sees the old directory
    or the new one, never part of either."""
    _fsync_dir(tmp)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out_dir)
    return out_dir


def classifier_config(source_dir: str | Path) -> dict:
    """The config.json of causal-LM checkpoint `source_dir` as a one-label sequence classifier's (a reward
    model's: `XForSequenceClassification`, num_labels 1), which transformers and the `reward_model` term load.

    HF's classifier scores the last token that is not padding. A reward model is trained to score the last
    token of the sequence, its EOS included; when the tokenizer pads with its EOS token that token would be
    taken for padding and the one before it scored, so pad_token_id is left out: transformers then scores
    the last token of one sequence per call, and refuses a padded batch rather than scoring the wrong token.
    """
    path = Path(source_dir) / "config.json"
    config = json.loads(path.read_text())
    # a causal LM's class, or a classifier's (a reward model trained further)
    names = [a.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification")
             for a in config.get("architectures") or [] if a.endswith(("ForCausalLM", "ForSequenceClassification"))]
    if not names:
        raise ValueError(f"{path}: architectures {config.get('architectures')} names no ...ForCausalLM class "
                         f"to derive the sequence classifier's from")
    eos = config.get("eos_token_id")
    pad_is_eos = config.get("pad_token_id") is not None and config["pad_token_id"] in (
        eos if isinstance(eos, list) else [eos])
    return {**{k: v for k, v in config.items() if not (k == "pad_token_id" and pad_is_eos)},
            "architectures": [names[0] + "ForSequenceClassification"],
            "num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def copy_side_files(source_dir: str | Path, out_dir: str | Path) -> None:
    """The config and tokenizer files of HF checkpoint `source_dir`, copied into `out_dir`."""
    for side in _SIDE_FILES:
        if (Path(source_dir) / side).exists():
            shutil.copy2(Path(source_dir) / side, Path(out_dir) / side)


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())



# ---- run checkpoints ---------------------------------------------------------------------------------------
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file."""


# Below this much free space a failed write is taken for a full disk: Megatron's writer processes and
# torch.save report one as "unexpected pos N vs M" or a worker failure, with the errno lost on the way.
_NEARLY_FULL_BYTES = 64 * 2**20


def disk_full_error(exc: BaseException, path: Path) -> CheckpointError | None:
    """A CheckpointError saying that the disk is full and where, when `exc`, raised while writing `path`,
    is ENOSPC (anywhere in its chain) or the filesystem of `path` is nearly full; None otherwise."""
    chain, seen = exc, set()
    nospace = False
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        nospace |= isinstance(chain, OSError) and chain.errno == errno.ENOSPC
        chain = chain.__cause__ or chain.__context__
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    usage = shutil.disk_usage(existing)
    if not nospace and usage.free >= _NEARLY_FULL_BYTES:
        return None
    first_line = (str(exc).strip().splitlines() or [""])[-1]
    return CheckpointError(f"the disk is full: writing {path} failed with {usage.free / 2**20:.1f} MiB free of "
                           f"{usage.total / 2**20:.1f} MiB on that filesystem ({type(exc).__name__}: "
                           f"{first_line}); free space (or lower checkpoint.keep_last, or move run_dir) and "
                           f"run again to resume from the last complete checkpoint")


MANIFEST = "manifest.json"


def checkpoint_files(root: Path) -> list[str]:
    """The files under checkpoint directory `root` that its manifest describes (all but the manifest)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def describe_files(root: Path, names: Iterable[str], *, checksums: bool) -> dict[str, dict]:
    """Each named file's size in bytes and, with `checksums`, its sha256: a share of the manifest."""
    described = {}
    for name in names:
        path = root / name
        described[name] = {"bytes": path.stat().st_size}
        if checksums:
            described[name]["sha256"] = _sha256(path)
    return described


def check_files(root: Path, manifest: dict, names: Iterable[str]) -> list[str]:
    """What is wrong with the named files of checkpoint `root` against its `manifest` (empty: nothing)."""
    problems = []
    for name in names:
        want, path = manifest["files"][name], root / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif (size := path.stat().st_size) != want["bytes"]:
            problems.append(f"{path}: {size} bytes, written with {want['bytes']}")
        elif "sha256" in want and _sha256(path) != want["sha256"]:
            problems.append(f"{path}: its sha256 differs from the one written with it")
    return problems


def read_manifest(root: Path) -> dict | None:
    """The manifest of checkpoint `root`; None for a checkpoint written before manifests; CheckpointError when
    it cannot be read."""
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    return manifest


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def set_latest(root: Path, name: str) -> None:
    """Point `root/latest` at step directory `name`, atomically."""
    pointer_tmp = root / f".{LATEST}.tmp"
    pointer_tmp.write_text(name + "\n")
    with open(pointer_tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(pointer_tmp, root / LATEST)


def set_aside(path: Path) -> Path:
    """Move a damaged checkpoint out of resume's way, kept for inspection as `.corrupt-NAME` (numbered when
    there is one already)."""
    target, n = path.with_name(f".corrupt-{path.name}"), 1
    while target.exists():
        target, n = path.with_name(f".corrupt-{path.name}.{n}"), n + 1
    os.rename(path, target)
    return target


def step_dir_name(step: int) -> str:
    return f"step{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint `root/latest` names, None when nothing was saved yet."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which has no state.json: the checkpoint directory "
                              f"was removed or damaged after it was published")
    return path


def temporary_dir(root: str | Path, step: int) -> Path:
    """A fresh directory to write step `step` into; earlier unfinished ones (a crash mid-write) are removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step*"):
        shutil.rmtree(stale)
    tmp = root / f".tmp-{step_dir_name(step)}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, *, step: int, keep_last: int) -> Path:
    """Make a fully written `tmp` the checkpoint of `step`: one rename, then `latest`, then pruning of all
    but the newest `keep_last` step directories (0 keeps all)."""
    root = tmp.parent
    _fsync_tree(tmp)
    final = root / step_dir_name(step)
    if final.exists():  # the same step saved again (a resumed run that re-reached it)
        old = root / f".old-{final.name}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    set_latest(root, final.name)
    if keep_last:
        steps = sorted(p for p in root.glob("step*") if p.is_dir())
        for old in steps[:-keep_last]:
            shutil.rmtree(old)
    return final


def _fsync_tree(path: Path) -> None:
    for child in path.rglob("*"):
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())


def peft_adapter_config(names: Iterable[str], *, rank: int, alpha: float, base_model: str | Path) -> dict:
    """PEFT's `adapter_config.json` for LoRA adapters of rank `rank` and `alpha` under these tensor `names`
    (`base_model.model.{module}.lora_A.weight`, ...) on the HF model in `base_model`: what `peft` and SGLang's
    adapter loading read."""
    modules = sorted({name.split(".")[-3] for name in names})  # ...layers.0.self_attn.q_proj.lora_A.weight
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model), "r": rank,
            "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


def save_peft_adapter(named_tensors: Iterable[tuple[str, Tensor]], *, rank: int, alpha: float, base_model: str,
                      out_dir: str | Path) -> Path:
    """Write LoRA adapters in PEFT's adapter-directory format: `adapter_model.safetensors` (`base_model.model.
    {module}.lora_A.weight` [r, in], `.lora_B.weight` [out, r]) and `adapter_config.json` (a LoRA of rank `rank`
    and `alpha` on the modules the tensors name, for the HF model in `base_model`), published atomically."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
    config = peft_adapter_config(tensors, rank=rank, alpha=alpha, base_model=base_model)
    tmp = _fresh_tmp(out_dir)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return _replace_dir(tmp, out_dir)
