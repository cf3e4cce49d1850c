"""How a section field becomes a checked config key: the kinds of value a key holds (each parses a
YAML value or says what it expected), ``setting`` (a field's default, description and limits), and
``Key``, generated from a field, which checks one value."""

from __future__ import annotations

import functools
import math
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from slimtune.errors import SlimtuneError
from slimtune.formats.hub import is_dataset_id, is_hub_id
from slimtune.memory import parse_size

PLACEHOLDER = "{output_dir}"
REQUIRED: Any = MISSING  # the default of a key the config must set


# --- kinds: what a key holds, how a YAML value becomes one -----------------------------------------


class _Invalid(ValueError):
    """A value a kind refuses; its text completes "config key 'k' ..."."""


def _must(expected: str, value: Any) -> _Invalid:
    return _Invalid(f"must be {expected}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Kind:
    """What a config key holds. ``label`` names it in the docs, ``expected`` in the error for a missing
    value; ``parse`` coerces a YAML value or raises _Invalid; ``resolve`` (paths) places it under output_dir."""

    label: str
    expected: str
    parse: Callable[[Any], Any]
    resolve: Callable[[Any, Path], Any] | None = None


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _must("true or false", value)
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _must("an integer", value)
    if not -(2**63) <= value < 2**64:
        raise _Invalid(f"must be a 64-bit integer, got {value}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        value = float(value)  # PyYAML reads 1e-4 (no dot) as a string
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise _must("a number", value)
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _must("a non-empty string", value)
    if "\x00" in value or not _encodable(value):
        raise _Invalid("holds a NUL byte or invalid Unicode")
    return value


def _size(value: Any) -> str:
    try:
        parse_size(_str(value))
    except _Invalid:
        raise
    except ValueError as e:
        raise _Invalid(f"is not a size: {e}") from None
    return value


def _run_dir(value: Any) -> str:
    """output_dir, absolute; it (or its nearest existing parent) must be a directory."""
    try:
        output_dir = Path(_str(value)).expanduser().resolve()
        existing = next((p for p in (output_dir, *output_dir.parents) if p.exists()), output_dir)
        is_dir = existing.is_dir()
    except _Invalid:
        raise
    except (OSError, RuntimeError, ValueError) as e:  # a name too long, a loop of links, ...
        raise _Invalid(f"cannot be used as a path ({type(e).__name__}: {e})"[:300]) from None
    if not is_dir:
        what = "output_dir" if existing == output_dir else f"output_dir's parent {existing}"
        raise _Invalid(f"= {output_dir}: {what} exists and is not a directory")
    return str(output_dir)


def _split(value: Any) -> Any:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


def _str_list(value: Any) -> list[str]:
    value = _split(value)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _must("a non-empty list of strings", value)
    return list(value)


def _float_list(value: Any) -> list[float]:
    value = _split(value)
    value = [float(v) if isinstance(v, str) and _NUMBER.match(v.strip()) else v for v in value] if isinstance(value, list) else value
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value)
    ):
        raise _must("a non-empty list of numbers >= 0", value)
    return [float(v) for v in value]


def _map(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        pairs = [p.partition("=") for p in value.split(",") if p.strip()]
        if not all(sep for _, sep, _ in pairs):
            raise _must("a mapping, or key=column pairs separated by commas", value)
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()):
        raise _must("a mapping of strings to strings", value)
    return dict(value)


def _resolve(path: str, output_dir: Path) -> str:
    return str(Path(path.replace(PLACEHOLDER, str(output_dir))).expanduser().resolve())


def _resolve_model(name: str, output_dir: Path) -> str:
    """A hub id (org/name[@revision]) stays as written: ``formats.hub.resolve_model`` decides between it
    and a local directory of that name when the model is loaded. Any other value is a path."""
    return name if is_hub_id(name) else _resolve(name, output_dir)


def _resolve_data(name: str, output_dir: Path) -> str:
    """A dataset hub id (org/name[@revision][:split]) stays as written: the data reader decides between it
    and a local file of that name. Any other value is a path."""
    return name if is_dataset_id(name) else _resolve(name, output_dir)


BOOL = Kind("bool", "true or false", _bool)
INT = Kind("int", "an integer", _int)
FLOAT = Kind("float", "a number", _float)
STR = Kind("str", "a string", _str)
SIZE = Kind("size", "a string", _size)
RUN_DIR = Kind("path", "a string", _run_dir)
PATH = Kind("path", "a string", _str, _resolve)
MODEL = Kind("model", "a string", _str, _resolve_model)  # a path or a hub id
DATA = Kind("data", "a string", _str, _resolve_data)  # a data file or a dataset hub id
STR_LIST = Kind("list[str]", "a list of strings", _str_list)
DATA_LIST = Kind("list[data]", "a list of strings", _str_list, lambda names, root: [_resolve_data(n, root) for n in names])
PATH_LIST = Kind("list[path]", "a list of strings", _str_list, lambda paths, root: [_resolve(p, root) for p in paths])
FLOAT_LIST = Kind("list[float]", "a list of numbers", _float_list)
MAP = Kind("map", "a mapping", _map)

# Field types that name a kind beyond Python's own (a path is a str to its reader, but resolved and checked)
ConfigPath = Annotated[str, PATH]
ModelPath = Annotated[str, MODEL]
DataPath = Annotated[str, DATA]
RunDir = Annotated[str, RUN_DIR]
Size = Annotated[str, SIZE]
_KINDS: dict[Any, Kind] = {
    bool: BOOL,
    int: INT,
    float: FLOAT,
    str: STR,
    list[str]: STR_LIST,
    list[ConfigPath]: PATH_LIST,
    list[DataPath]: DATA_LIST,
    list[float]: FLOAT_LIST,
    dict[str, str]: MAP,
}


def setting(
    default: Any, help: str, *, name: str | None = None, minimum: float | None = None, maximum: float | None = None, fixed=False
) -> Any:
    """A config key as a section field: its default (REQUIRED: none), description, key name when it is
    not the field's (``async_`` is ``async``), limits (``maximum`` exclusive) and whether it is ``fixed``
    (must not change on resume: it defines the model, the data order or the step arithmetic). The field's
    type is the key's: int, float, bool, str, a Literal of choices, ConfigPath, Size, lists; ``| None`` allows null."""
    meta = {"help": help, "name": name, "minimum": minimum, "maximum": maximum, "fixed": fixed}
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(type(default), default), metadata=meta)
    return field(default=default, metadata=meta)


# --- the schema, generated from the sections --------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One config key as validation, the resume check and the docs see it; generated from a section field
    (``attrs`` is its attribute path in Config: ``("checkpoint", "async_")`` for ``checkpoint.async``)."""

    name: str
    attrs: tuple[str, ...]
    kind: Kind
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    nullable: bool = False
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None  # exclusive
    fixed: bool = False

    def check(self, value: Any, label: str) -> Any:
        """The value, coerced to this key's kind; else SlimtuneError naming the key and what was expected."""
        if value is None:
            if self.required:
                raise SlimtuneError(f"{label}: config key {self.name!r} is required: {self.help} (set it with {self.name}=...)")
            if self.nullable:
                return None
            raise SlimtuneError(f"{label}: config key {self.name!r} {_must(self.kind.expected, value)}")
        try:
            value = self.kind.parse(value)
        except _Invalid as e:
            raise SlimtuneError(f"{label}: config key {self.name!r} {e}") from None
        if self.choices and value not in self.choices:
            raise SlimtuneError(f"{label}: config key {self.name!r} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise SlimtuneError(f"{label}: config key {self.name!r} must be >= {self.minimum:g}, got {value!r}")
        if self.maximum is not None and value >= self.maximum:
            raise SlimtuneError(f"{label}: config key {self.name!r} must be < {self.maximum:g}, got {value!r}")
        return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _name(f: Any) -> str:
    return f.metadata.get("name") or f.name


def _key(name: str, attrs: tuple[str, ...], hint: Any, f: Any) -> Key:
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if nullable:
        (hint,) = [a for a in args if a is not type(None)]
    choices: tuple[str, ...] = ()
    if typing.get_origin(hint) is Literal:
        choices, hint = typing.get_args(hint), str
    kind = typing.get_args(hint)[1] if typing.get_origin(hint) is Annotated else _KINDS.get(hint)
    if not isinstance(kind, Kind):
        raise TypeError(f"config key {name}: no kind for the type {hint!r}")
    required = f.default is MISSING and f.default_factory is MISSING
    default = None if required else f.default if f.default_factory is MISSING else f.default_factory()
    if default is None and not (nullable or required):
        raise TypeError(f"config key {name}: default null, but its type does not allow null")
    m = f.metadata
    return Key(name, attrs, kind, default, m["help"], choices, nullable, required, m["minimum"], m["maximum"], m["fixed"])


def walk(cls: type, prefix: str = "", attrs: tuple[str, ...] = ()) -> Iterator[Key]:
    """The keys of a config dataclass, sections flattened in field order: ``walk(Config)`` is the schema."""
    hints = _hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            yield from walk(hints[f.name], f"{prefix}{_name(f)}.", (*attrs, f.name))
        else:
            yield _key(prefix + _name(f), (*attrs, f.name), hints[f.name], f)


def build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """The config dataclass holding checked flat values: ``build(Config, {"seed": 0, "model.path": ...})``."""
    hints = _hints(cls)
    return cls(
        **{
            f.name: build(hints[f.name], values, f"{prefix}{_name(f)}.") if is_dataclass(hints[f.name]) else values[prefix + _name(f)]
            for f in fields(cls)
        }
    )


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
