"""Typed configs: YAML or dict -> nested dataclasses, rejecting unknown keys by name.

Why: a typo such as `optim.lrr` must stop the run with the key named, not be ignored;
`null` must stay None (never the string "None"); `a.b=c` overrides come from make ARGS.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from octfm.cli import UsageError

T = TypeVar("T")


class ConfigError(UsageError):
    """A config key is unknown, missing or of the wrong type."""


class FieldError(ConfigError):
    """A config dataclass's own check of one of its fields (raised in __post_init__);
    `from_dict` adds the file and the key's full path."""

    def __init__(self, key: str, message: str):
        super().__init__(f"key '{key}': {message}")
        self.key, self.message = key, message


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: key '{key}': {value!r} fits none of {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: key '{key}': {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: key '{key}': expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.", where=where)
    if origin in (list, tuple, Sequence, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: key '{key}': expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where}: key '{key}': expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]", where) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: key '{key}': expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: key '{key}': expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: key '{key}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: key '{key}': expected a string, got {value!r}")
    if value is None:
        raise ConfigError(f"{where}: key '{key}': may not be null")
    if not isinstance(value, tp):
        raise ConfigError(f"{where}: key '{key}': expected {_type_name(tp)}, got {value!r}")
    return value


def renamed(cls: type, data: dict, prefix: str = "", where: str = "config", say: bool = True) -> dict:
    """`data` with the keys `cls.RENAMED` (old name -> new name) lists under their new names, at every
    level of nested dataclasses: a key renamed in one release is read, with a message naming both, for
    that release. Both names at once is refused."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data
    out = dict(data)
    for old, new in getattr(cls, "RENAMED", {}).items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"{where}: both '{prefix}{old}' and '{prefix}{new}': '{old}' is the old name of "
                              f"'{new}'; keep '{new}'")
        if say:
            print(f"config: {where}: key '{prefix}{old}' is now '{prefix}{new}' (read under the old name for this "
                  "release; rename it)", file=sys.stderr)
        out[new] = out.pop(old)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)
        if f.name in out and dataclasses.is_dataclass(inner):
            out[f.name] = renamed(inner, out[f.name], f"{prefix}{f.name}.", where, say)
    return out


def from_dict(cls: type[T], data: dict, prefix: str = "", where: str = "config") -> T:
    """Build dataclass `cls` from `data`; unknown keys raise ConfigError naming them, renamed ones
    (`cls.RENAMED`) are read under their new name with a message."""
    if data is None:
        data = {}
    if not prefix:
        data = renamed(cls, data, where=where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(f"'{prefix}{k}'" for k in unknown)
        raise ConfigError(f"{where}: unknown key {names} (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], prefix + name, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing key '{prefix}{name}'")
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise ConfigError(f"{where}: key '{prefix}{exc.key}': {exc.message}") from None


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for YAML, JSON and checkpoints."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_overrides(items: Sequence[str], where: str = "ARGS") -> dict:
    """Turn ["a.b=1", "c=null"] into a nested dict; values parse as YAML scalars."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{where}: override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def merge(base: dict, over: dict) -> dict:
    """Recursive dict merge; `over` wins."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML at `path` (or defaults when None), apply overrides, type-check."""
    data: dict = {}
    where = "defaults"
    if path:
        where = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    if overrides:
        data = merge(data, parse_overrides(overrides))
        where = f"{where} + ARGS"
    return from_dict(cls, data, where=where)


def content_key(blob: Any, length: int = 20) -> str:
    """The one content key: sha256 of the blob's canonical JSON (sorted keys) cut to `length` hex
    digits. Cache keys, feature keys, probe settings keys and row fingerprints all use it, so two
    equal blobs always share a key."""
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:length]


REPO_ROOT = Path(__file__).resolve().parents[1]


def import_closure(*entries: str) -> list[str]:
    """The repository files that the entry files (repository paths) run: each `import` and `from ...
    import` of the project's own packages, a function's own included, followed through every file it
    reaches, with each package's __init__ on the way; read from the sources, nothing imported. A
    result keyed on these (source_digest) is made afresh after an edit to any file its code imports,
    not only to the files someone listed."""
    todo, files = [e[:-3].replace("/", ".").removesuffix(".__init__") for e in entries], set()
    while todo:
        for f in _module_files(todo.pop()):
            if f not in files:
                files.add(f)
                todo += _imported(f)
    return sorted(files)


def _module_files(name: str) -> list[str]:
    """The repository files that importing module `name` runs: each package's __init__ on the way
    and the module's own file ([] for a module of no package here: the standard library, torch)."""
    parts = name.split(".")
    if not (REPO_ROOT / parts[0] / "__init__.py").is_file():
        return []
    found = []
    for i in range(1, len(parts) + 1):
        path = REPO_ROOT.joinpath(*parts[:i])
        found += [f.relative_to(REPO_ROOT).as_posix() for f in (path / "__init__.py", path.with_suffix(".py"))
                  if f.is_file()]
    return found


def _imported(path: str) -> list[str]:
    """The module names a repository file imports, anywhere in it (`from a import b` names both a
    and a.b: b may be a module; a relative import is resolved against the file's package)."""
    package = path.rsplit("/", 1)[0].split("/")
    names = []
    for node in ast.walk(ast.parse((REPO_ROOT / path).read_text(), path)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: the file's package, or a package above it
                base = ".".join(package[:len(package) + 1 - node.level] + ([base] if base else []))
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return names


def source_digest(*files: str, length: int = 12) -> str:
    """A content key of the project's Python sources `files` (repository paths, e.g. an
    import_closure): results kept across runs (the learning check's cohort and runs) are keyed on
    the code that made them, so an edit makes them afresh instead of reusing what older code
    produced. Content, not the git commit: a README edit or an uncommitted change counts as what
    it is."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (REPO_ROOT / f).read_bytes() + b"\0")
    return h.hexdigest()[:length]


def code_key(entries: Sequence[str], exclude: Sequence[str] = (), length: int = 12) -> str:
    """The content key of the code `entries` (repository paths) run: their import_closure, less
    `exclude`. The one way kept results are keyed on the code that made them (the learning check's
    runs, the probes' features, the embeddings, the leaderboard's rows), so an edit to any file
    that code imports makes them afresh and an edit elsewhere keeps them."""
    return source_digest(*[f for f in import_closure(*entries) if f not in exclude], length=length)
