"""A YAML file mapped one-to-one onto a tree of small frozen dataclasses, and written back (the recipe's loader,
megarl.config holds the tree).

    cfg = load_dataclass(Config, "recipes/grpo_tiny.yaml", ["rollout.temperature=0.7", "optim.lr=1e-5"])
    dump_config(cfg, Path(cfg.run_dir) / "recipe.yaml")   # loading it back gives an equal Config

Every mistake in a file is a ConfigError that names the file and the dotted key, and the override when
one set it:

    recipes/q.yaml: rollout.temprature: unknown key (did you mean 'temperature'?)
    recipes/q.yaml: override 'train.steps=ten': train.steps: expected int, got 'ten' (str)

The loader is generic over the dataclass tree. A field's annotation is its type check (int, float, str,
bool, Literal[...], X | None, list[...], dict[str, ...], Any, nested dataclasses); `field(metadata=
{"path": "dir"})` or `{"path": "file"}` marks a path that must exist; a dataclass may define
`check(self)` that raises FieldError(field, message) for one bad field or ValueError(message) for a
relation between fields, whose message then names them. Imports only the standard library and yaml.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(Exception):
    """A recipe that cannot be run; the message names the file, the dotted key and the problem."""


class FieldError(ValueError):
    """Raised by a section's `check()` when one field has an impossible value."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float, only true / false as booleans, and rejects a key given twice in
    one mapping.

    YAML 1.1 (PyYAML) needs a dot in a float (`1.0e-5`); the spelling everyone writes for a learning rate
    would otherwise arrive as the string '1e-5'. It also reads yes / no / on / off as booleans, which would
    turn a choice such as `verify_weights: off` into false (YAML 1.2 reads them as strings, as here). A
    repeated key would silently drop the first section.
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _yaml_error_text(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None and (mark is None or start.line != mark.line):
        problem += f" ({context} that starts on line {start.line + 1})"
    return f"{where}invalid YAML: {problem}"


# ---------------------------------------------------------------------------------------------- loading


@dataclass
class _Source:
    """Where values came from, so that an error names the file and, when it applies, the override."""

    file: str
    overrides: list[tuple[tuple, str]]  # (key path, override text), in the order applied
    check_paths: bool = True  # False: path fields are taken as written, the disk is not looked at

    def error(self, key: tuple, message: str, *, beneath: bool = True) -> ConfigError:
        # An override is to blame when it set this key or a section containing it, or something beneath
        # it (`rolout.temperature=1` creates the unknown key `rolout`). A section's own check() names
        # no one field, so there only an override of the whole section is to blame.
        blamed = None
        for path, text in self.overrides:
            if key[: len(path)] == path or (beneath and path[: len(key)] == key):
                blamed = text
        where = f"override {blamed!r}: " if blamed else ""
        dotted = f"{_dotted(key)}: " if key else ""
        return ConfigError(f"{self.file}: {where}{dotted}{message}")


def _dotted(key: tuple) -> str:
    out = ""
    for part in key:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "Any"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", repr(tp))


def _convert(tp: Any, value: Any, key: tuple, src: _Source) -> Any:
    """`value` read from YAML, checked against the annotation `tp` and converted (int -> float, dicts ->
    dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def mismatch() -> ConfigError:
        hint = ""
        if origin is Literal and isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        return src.error(key, f"expected {_type_name(tp)}, got {_show(value)}{hint}")

    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if value is None:  # a section whose keys are all commented out
            value = {}
        if not isinstance(value, dict):
            raise mismatch()
        return _build(tp, value, key, src)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise mismatch()
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # X | None: report X's own error, which is more precise
            return _convert(arms[0], value, key, src)
        for arm in arms:
            try:
                return _convert(arm, value, key, src)
            except ConfigError:
                pass
        raise mismatch()
    if origin is list:
        if not isinstance(value, list):
            raise mismatch()
        return [_convert(args[0], v, (*key, i), src) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise mismatch()
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise src.error(key, f"keys must be str, got {_show(k)}")
            out[k] = _convert(args[1], v, (*key, k), src)
        return out
    if tp is bool:  # no coercion: `1` is not a bool
        if type(value) is not bool:
            raise mismatch()
        return value
    if tp is int:
        if type(value) is not int:
            raise mismatch()
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise mismatch()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise mismatch()
        return value
    raise TypeError(f"{_dotted(key)}: the config loader does not support the annotation {tp!r}")


def _check_path(kind: str, value: str, key: tuple, src: _Source) -> str:
    path = os.path.abspath(os.path.expanduser(value))
    noun = "directory" if kind == "dir" else "file"
    if not os.path.exists(path):
        raise src.error(key, f"{noun} not found: {path}")
    if not (os.path.isdir(path) if kind == "dir" else os.path.isfile(path)):
        raise src.error(key, f"not a {noun}: {path}")
    return path


def _build(cls: type, data: dict, key: tuple, src: _Source) -> Any:
    """One dataclass from one YAML mapping: known keys only, types checked, paths found, `check()` passed."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in data:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "known keys: " + ", ".join(fields)
            raise src.error((*key, str(name)), f"unknown key ({hint})")
    kwargs = {}
    for name, f in fields.items():
        fkey = (*key, name)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in data and not required:
            continue
        if name not in data and not dataclasses.is_dataclass(hints[name]):
            raise src.error(fkey, f"required key missing (expected {_type_name(hints[name])})")
        # A required section left out is built empty, so the error names the key inside it that is missing.
        value = _convert(hints[name], data.get(name), fkey, src)
        if "path" in f.metadata and value is not None and src.check_paths:
            value = _check_path(f.metadata["path"], value, fkey, src)
        kwargs[name] = value
    try:
        obj = cls(**kwargs)
        if hasattr(obj, "check"):
            obj.check()
    except FieldError as err:
        raise src.error((*key, err.field), str(err)) from None
    except ValueError as err:
        raise src.error(key, str(err), beneath=False) from None
    return obj


def _apply_override(tree: dict, text: str, src: _Source) -> None:
    name, eq, raw = text.partition("=")
    path = tuple(name.strip().split("."))
    if not eq or not all(path):
        raise ConfigError(f"{src.file}: override {text!r}: expected key.path=value")
    try:
        value = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{src.file}: override {text!r}: {_yaml_error_text(err)}") from None
    src.overrides.append((path, text))
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise src.error(path[: i + 1], f"is {_show(child)}, not a section")
        node = child
    node[path[-1]] = value


def load_dataclass(cls: type[T], path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> T:
    """Read a YAML file, apply `key.path=value` overrides (values parsed as YAML), and build a checked `cls`
    from it.

    Path fields come back absolute (resolved against the current directory). Raises ConfigError.
    `check_paths=False` checks everything but the existence of the files and directories the file names,
    and leaves those paths as written.
    """
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: recipe file not found") from None
    except OSError as err:
        raise ConfigError(f"{file}: cannot read recipe: {err.strerror}") from None
    try:
        tree = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: {_yaml_error_text(err)}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{file}: a recipe is a mapping of sections, got {_show(tree)}")
    src = _Source(file, [], check_paths)
    for override in overrides:
        _apply_override(tree, override, src)
    return _build(cls, tree, (), src)


def config_to_dict(cfg: Any) -> dict:
    """The config as plain dicts, lists and scalars, ready for yaml.safe_dump."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved recipe as YAML (creating parent directories); load_dataclass (megarl.config.load_config)
    reads it back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")
