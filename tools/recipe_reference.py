"""Write docs/recipe-reference.md, the reference of every recipe key, from the dataclasses of megarl/config.py.

    python tools/recipe_reference.py            # rewrite docs/recipe-reference.md
    python tools/recipe_reference.py --check    # exit 1 when the checked-in page differs from what it writes

Each key's type and default come from the dataclass field, its description from the code: the field's comment
(the comment lines just above it and the comment at the end of its line) or a string just below it, and each
section's from its class docstring. Sections are the dataclass-valued fields of `Config`, nested ones included
(`model.lora`, `reward.terms[]`, ...). Imports megarl.config and nothing else of megarl.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "recipe-reference.md"
COMMAND = "python tools/recipe_reference.py"


@dataclasses.dataclass(frozen=True)
class Key:
    path: str  # dotted recipe key, `[]` for the items of a list
    type: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class Section:
    path: str  # "" for the top-level keys
    doc: str
    keys: list[Key]


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description as written in the class's source: the comment lines directly above it (not
    those that continue the previous field's end-of-line comment), its end-of-line comments, and a string
    statement just below it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    body = ast.parse(source).body[0].body
    fields = [(i, node) for i, node in enumerate(body)
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    docs: dict[str, list[str]] = {}
    previous = None  # (name, last line) of the field before, when it has an end-of-line comment
    for i, node in fields:
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments and n in code_lines]
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        # A comment block right under a field with an end-of-line comment, above a field with one of its own,
        # continues the first field's comment.
        if above and trailing and previous is not None and line == previous[1]:
            docs[previous[0]] += above
            above = []
        docs[node.target.id] = above + trailing
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id].append(inspect.cleandoc(after.value.value))
        previous = (node.target.id, node.end_lineno) if trailing else None
    return {name: " ".join(" ".join(parts).split()) for name, parts in docs.items()}


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    return getattr(tp, "__name__", repr(tp))


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, list) and any(dataclasses.is_dataclass(item) for item in value):  # reward.terms
        return json.dumps([{k: v for k, v in dataclasses.asdict(item).items() if v is not None} for item in value])
    return json.dumps(value)


def section_types(tp: Any) -> tuple[type, str] | None:
    """(dataclass, path suffix) when a field holds a section: a dataclass, one or null, or a list of them."""
    arms = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else [tp]
    if len(arms) == 1 and dataclasses.is_dataclass(arms[0]):
        return arms[0], ""
    if len(arms) == 1 and typing.get_origin(arms[0]) is list and dataclasses.is_dataclass(typing.get_args(arms[0])[0]):
        return typing.get_args(arms[0])[0], "[]"
    return None


def sections(cls: type, path: str = "") -> list[Section]:
    """The section of `cls` at `path`, then its nested sections, depth first in field order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    keys, nested = [], []
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        found = section_types(hints[f.name])
        if not path and dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], key))  # a top-level section: its own table only
            continue
        keys.append(Key(key, type_name(hints[f.name]), default_text(f), docs.get(f.name, "")))
        if found is not None:
            nested.append((found[0], key + found[1]))
    # the class's own docstring, read from its source: dataclasses writes a signature into a missing __doc__
    doc = ast.get_docstring(ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]) or ""
    return [Section(path, doc, keys)] + [s for sub_cls, sub_path in nested for s in sections(sub_cls, sub_path)]


def cell(text: str) -> str:
    """`text` inside a table cell, where a `|` (even in a code span) would end the cell."""
    return text.replace("|", "\\|")


def render() -> str:
    from megarl.config import Config

    out = [
        "# Recipe reference",
        "",
        f"<!-- Written by `{COMMAND}` from megarl/config.py; edit the comments there, not this page. -->",
        "",
        ("Every key a recipe may set, section by section, with its type, its default and the comment its field has "
         "in `megarl/config.py`. A key is written `section.key` in an override on the command line "
         "(`rollout.temperature=0.7`) and nested in the YAML file; `[]` stands for each item of a list. How the "
         "sections fit together is in [Recipes](recipes.md)."),
    ]
    for section in sections(Config):
        title = section.path or "Top level"
        out += ["", f"## {title}", ""]
        if section.doc:
            out += [" ".join(section.doc.split()), ""]
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        out += [f"| `{k.path}` | {cell(k.type)} | `{cell(k.default)}` | {cell(k.doc)} |" for k in section.keys]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in page instead of writing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    text = render()
    if args.check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
