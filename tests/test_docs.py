"""The manual holds together: the README stays short and links every page of docs/, every relative link of the
README and the pages reaches a file (and a heading, for a `#anchor`), the recipe reference is what
tools/recipe_reference.py writes from megarl/config.py today, and tools/check_install.py finds every install
command the pages write."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys

import pytest

from conftest import REPO

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 200


def tool(name: str):
    """The module tools/NAME.py (registered under NAME: its dataclasses look their module up)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def prose(text: str) -> str:
    """Markdown without its fenced blocks and code spans, where a link is only text."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as dashes, a
    repeated one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the manual's pages are in docs/"


def test_every_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)(?:#[\w-]*)?\)", README.read_text()))
    assert PAGES and {page.name for page in PAGES} <= linked, \
        f"pages not linked from README.md: {sorted({page.name for page in PAGES} - linked)}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in set(anchors(file.read_text()))):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_recipe_reference_is_up_to_date():
    reference = tool("recipe_reference")
    assert reference.OUT.read_text() == reference.render(), \
        f"docs/recipe-reference.md differs from megarl/config.py: run {reference.COMMAND}"


def test_the_recipe_reference_lists_every_key_of_the_config():
    import dataclasses

    from megarl.config import Config

    reference = tool("recipe_reference")
    listed = {key.path for section in reference.sections(Config) for key in section.keys}
    for name in ("model.path", "rollout.verify_weights", "model.lora.targets", "reward.terms[].judge.url",
                 "log.wandb.project", "env.sandbox.cpu_s", "run_dir"):
        assert name in listed
    top = {f.name for f in dataclasses.fields(Config)}
    assert top <= {key.split(".")[0].removesuffix("[]") for key in listed}
    assert all(key.doc for key in reference.sections(Config)[1].keys)  # model's keys have their comments


def test_check_install_finds_every_install_command_of_the_pages():
    found = tool("check_install").pip_commands([README, *PAGES])
    written = []
    for page in [README, *PAGES]:
        for block in re.findall(r"^```bash\n(.*?)^```$", page.read_text(), flags=re.M | re.S):
            for segment in re.findall(r"pip install[^&#\n]*", block):
                written.append(shlex.split(segment))
    assert written and all(command in found for command in written), (written, found)
    # the README's two test commands install this way
    assert ["pip", "install", "-e", ".[test]", "-c", "constraints.txt"] in found
    assert ["pip", "install", "-r", "requirements-sglang.txt"] in found
