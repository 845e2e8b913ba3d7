"""Every install line of the README and of the docs/ pages resolves, and the GPU image's pins sit inside the ranges
their packages declare. Nothing is installed: each line goes through pip's resolver with `--dry-run
--ignore-installed --report`, which reads package metadata only (no multi-GB CUDA wheel is downloaded).

    python tools/check_install.py            # a few minutes; needs the package index
    python tools/check_install.py --list     # the commands it would resolve, and nothing else

Checked:
1. every `pip install` command in the bash blocks of README.md and docs/*.md resolves with no missing extra,
   installs no distribution named `apex` (PyPI's is another project) and, with `-c constraints.txt`, the CPU
   torch pinned there;
2. `pip install -e .` accepts the torch of a GPU container (GPU_TORCHES): pip keeps it instead of replacing it;
3. the Dockerfile's pins: Transformer Engine exists, its metapackage's extras name the distributions the
   image installs by name at its version, and it is inside megatron-core's declared range; the `wheel` its
   build needs exists; its onnx pins need nothing that SGLang's release does not install; the image's torch
   is the one its SGLang release pins.
Exits 1 naming every command or pin that failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a bare interpreter: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
# The torches of the GPU environments megarl is installed into: the device check's machine and SGLang's image.
GPU_TORCHES = ("2.11.0", "2.14.1")
TIMEOUT_S = 600


def doc_pages() -> list[Path]:
    """The README and the manual's pages, where the install commands are written."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def pip_commands(pages: list[Path]) -> list[list[str]]:
    """argv of every `pip install` command in the ```bash blocks of `pages`, in order, without repeats."""
    blocks = [block for page in pages
              for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S)]
    commands: list[list[str]] = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            if "pip install" not in line:
                continue
            words = shlex.split(line, comments=True)
            starts = [0] + [i + 1 for i, word in enumerate(words) if word == "&&"]
            for start in starts:
                end = words.index("&&", start) if "&&" in words[start:] else len(words)
                argv = words[start:end]
                if argv[:2] == ["pip", "install"] and argv not in commands:
                    commands.append(argv)
    return commands


def dockerfile_args(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(encoding="utf-8"), re.M))


def constraint_of(path: Path, name: str) -> SpecifierSet | None:
    """What a constraints file allows for `name`, if it names it."""
    for line in path.read_text(encoding="utf-8").splitlines():
        req = line.split("#", 1)[0].strip()
        if req and Requirement(req).name.lower() == name:
            return Requirement(req).specifier
    return None


def resolve(argv: list[str], errors: list[str]) -> dict[str, dict]:
    """Run `pip install ARGV` through the resolver only; metadata of every distribution it would install,
    by lower-case name. A failure is appended to `errors`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # fast-deps reads a wheel's metadata with HTTP range requests where the index serves no separate
        # metadata file (PEP 658): without it the SGLang line downloads about 2 GB of CUDA wheels.
        cmd = [sys.executable, "-m", "pip", "install", *argv[2:], "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--use-feature=fast-deps", "--report", str(report)]
        shown = shlex.join(argv)
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            errors.append(f"{shown}: the resolver ran past {TIMEOUT_S} s")
            return {}
        if proc.returncode != 0:
            errors.append(f"{shown}: does not resolve\n{proc.stderr.strip()[-2000:]}")
            return {}
        missing = [ln for ln in proc.stderr.splitlines() if "does not provide the extra" in ln]
        if missing:
            errors.append(f"{shown}: {'; '.join(missing)}")
        return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]
                for item in json.loads(report.read_text())["install"]}


def check_install_line(argv: list[str], errors: list[str]) -> dict[str, dict]:
    installed = resolve(argv, errors)
    if "apex" in installed:
        errors.append(f"{shlex.join(argv)}: installs PyPI's `apex`, which is not NVIDIA apex")
    if "-c" in argv and "torch" in installed:
        pin = constraint_of(REPO / argv[argv.index("-c") + 1], "torch")
        if pin is not None and not pin.contains(installed["torch"]["version"]):
            errors.append(f"{shlex.join(argv)}: resolves torch {installed['torch']['version']}, "
                          f"not the pinned {pin}")
    return installed


def requirement_of(metadata: dict, name: str, *, extra: str | None = None) -> Requirement | None:
    """The Requires-Dist entry for `name` (under `extra`, if given) in a report's metadata."""
    for line in metadata.get("requires_dist", []):
        req = Requirement(line)
        if req.name.lower().replace("_", "-") != name:
            continue
        in_extra = req.marker is not None and f'extra == "{extra}"' in str(req.marker)
        if (extra is None and req.marker is None) or (extra is not None and in_extra):
            return req
    return None


def check_image_pins(args: dict[str, str], sglang_meta: dict | None, errors: list[str]) -> list[str]:
    """The Dockerfile's Transformer Engine, megatron-core and torch pins against their packages' metadata."""
    notes = []
    # The image installs the metapackage's two extras by name, without dependencies: they must be the very
    # distributions and version the metapackage names.
    te_version = args["TE_VERSION"]
    te = resolve(["pip", "install", "--no-deps", f"transformer_engine[pytorch,core_cu13]=={te_version}"], errors)
    if te:
        for extra, dist in (("pytorch", "transformer-engine-torch"), ("core-cu13", "transformer-engine-cu13")):
            req = requirement_of(te["transformer-engine"], dist, extra=extra)
            if req is None or str(req.specifier) != f"=={te_version}":
                errors.append(f"transformer_engine {te_version}'s extra {extra} is {req}, not {dist}=={te_version}")
        notes.append(f"TE {te_version}: transformer_engine_torch and transformer_engine_cu13 of the same version")
    resolve(["pip", "install", "--no-deps", f"wheel=={args['WHEEL_VERSION']}"], errors)  # TE's build needs it
    # The image installs Transformer Engine's onnx packages without dependencies, beside SGLang: with SGLang
    # they must resolve to SGLang's own environment plus themselves, nothing added and nothing moved.
    onnx = {"onnx": args["ONNX_VERSION"], "onnx-ir": args["ONNX_IR_VERSION"], "onnxscript": args["ONNXSCRIPT_VERSION"]}
    sglang = f"sglang=={args['SGLANG_VERSION']}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        alone, with_onnx = pool.map(lambda names: resolve(["pip", "install", *names], errors),
                                    [[sglang], [sglang, *(f"{name}=={v}" for name, v in onnx.items())]])
    if alone and with_onnx:
        others = {name: meta["version"] for name, meta in with_onnx.items()
                  if name not in onnx and alone.get(name, {}).get("version") != meta["version"]}
        if others:
            errors.append(f"Dockerfile's onnx pins {onnx} need more than {sglang} installs: {others}")
        else:
            notes.append(f"onnx pins {onnx} need nothing beyond {sglang}'s environment")
    mcore = resolve(["pip", "install", "--no-deps", f"megatron-core=={args['MCORE_VERSION']}"], errors)
    if mcore:
        req = requirement_of(mcore["megatron-core"], "transformer-engine", extra="dev")
        if req is None:
            errors.append(f"megatron-core {args['MCORE_VERSION']} declares no Transformer Engine range")
        elif not req.specifier.contains(args["TE_VERSION"], prereleases=True):
            errors.append(f"Dockerfile TE_VERSION={args['TE_VERSION']} is outside megatron-core "
                          f"{args['MCORE_VERSION']}'s tested range {req.specifier}")
        else:
            notes.append(f"TE {args['TE_VERSION']} in megatron-core {args['MCORE_VERSION']}'s range {req.specifier}")
    if sglang_meta is not None:
        req = requirement_of(sglang_meta, "torch")
        if req is None or not req.specifier.contains(args["TORCH_VERSION"]):
            errors.append(f"Dockerfile TORCH_VERSION={args['TORCH_VERSION']} is not the torch SGLang "
                          f"{sglang_meta['version']} pins ({req})")
        else:
            notes.append(f"torch {args['TORCH_VERSION']} is SGLang {sglang_meta['version']}'s pin {req.specifier}")
    return notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the commands it would resolve and exit")
    parser.add_argument("--pages", type=Path, nargs="+", default=None,
                        help="the Markdown files to read (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    pages = args.pages or doc_pages()
    commands = pip_commands(pages)
    container = [["pip", "install", "-e", ".", f"torch=={v}"] for v in GPU_TORCHES]
    if args.list:
        for cmd in commands + container:
            print(shlex.join(cmd))
        return 0
    if not commands:
        print(f"{', '.join(map(str, pages))}: no `pip install` command in a bash block", file=sys.stderr)
        return 1

    # The resolver mostly waits on the index: the commands run side by side, each with its own error list.
    def check(cmd: list[str]) -> tuple[list[str], list[str], dict[str, dict]]:
        cmd_errors: list[str] = []
        return cmd, cmd_errors, check_install_line(cmd, cmd_errors)

    with ThreadPoolExecutor(max_workers=4) as pool:
        checked = list(pool.map(check, commands + container))
    errors: list[str] = []
    sglang_meta = None
    for cmd, cmd_errors, installed in checked:
        errors += cmd_errors
        sglang_meta = installed.get("sglang", sglang_meta)
        status = "FAILED" if cmd_errors else "ok"
        torch_version = installed.get("torch", {}).get("version", "-")
        print(f"{status:6s} {shlex.join(cmd)}   ({len(installed)} distributions, torch {torch_version})")
    if sglang_meta is None:
        errors.append("no install line installs SGLang: the Dockerfile's torch pin was not checked against it")
    for note in check_image_pins(dockerfile_args(REPO / "Dockerfile"), sglang_meta, errors):
        print(f"ok     {note}")
    for error in errors:
        print(f"\nFAILED: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
