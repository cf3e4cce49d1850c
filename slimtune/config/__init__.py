"""Recipe configuration, typed: each section is a frozen dataclass whose fields carry the key's name, type,
default, description and limits. Validation, `slimtune finetune --help` and the key table of
docs/configuration.md are all generated from those fields.

A config is a YAML file of nested sections (``optimizer: {lr: 2e-4}``), or the name of a shipped one
(``tiny``), plus dotted ``key=value`` overrides whose values are read as YAML scalars. Every key is
checked before any work starts: an unknown key or a value of the wrong type is an error naming the key.

Example: ``cfg = load_config("tiny", ["optimizer.lr=1e-4"]); cfg.optimizer.lr, cfg.checkpoint.async_``"""

from __future__ import annotations

import difflib
import re
import textwrap
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from slimtune.config.keys import KEYS, SCHEMA, Config
from slimtune.config.schema import DATA, MODEL, PATH, PLACEHOLDER, Key, build
from slimtune.errors import SlimtuneError

__all__ = [
    "DATA",
    "KEYS",
    "MODEL",
    "PATH",
    "PLACEHOLDER",
    "SCHEMA",
    "Config",
    "Key",
    "flatten",
    "load_config",
    "parse_override",
    "read_config_source",
    "schema_help",
    "schema_markdown",
    "shipped_configs",
    "validate",
]


def shipped_configs() -> list[str]:
    """Names of the configs that come with the package (slimtune/configs/*.yaml)."""
    folder = resources.files("slimtune") / "configs"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def read_config_source(path_or_name: str) -> tuple[str, dict]:
    """The raw YAML mapping of a config file, or of a shipped config by name."""
    if "\x00" in path_or_name:
        raise SlimtuneError(f"config path {path_or_name!r} contains a NUL byte")
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        raise SlimtuneError(f"{path}: is a directory, expected a YAML config file")
    if path.is_file():
        label = str(path)
        try:
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise SlimtuneError(f"{path}: {path.stat().st_size:,} bytes; a config file may have at most {MAX_CONFIG_BYTES:,}")
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise SlimtuneError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise SlimtuneError(f"{path}: cannot read: {e.strerror or e}") from None
    elif path_or_name in shipped_configs():
        text = (resources.files("slimtune") / "configs" / f"{path_or_name}.yaml").read_text()
        label = f"{path_or_name}.yaml"
    else:
        raise SlimtuneError(
            f"no config file {path_or_name!r}, and no shipped config of that name (shipped: {', '.join(shipped_configs())})"
        )
    data = _safe_yaml(text, label)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SlimtuneError(f"{label}: expected a mapping of config keys at the top level, got {type(data).__name__}")
    return label, data


def flatten(data: dict, label: str, prefix: str = "") -> dict[str, Any]:
    """{"optimizer": {"lr": 1}} -> {"optimizer.lr": 1}; sections are the prefixes of schema keys."""
    sections = {k.name.rsplit(".", n)[0] for k in SCHEMA for n in range(1, k.name.count(".") + 1)}
    flat: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = f"{prefix}{raw_key}"
        if key in sections:
            if not isinstance(value, dict):
                raise SlimtuneError(f"{label}: {key} must be a mapping of its keys ({_section_keys(key)}), got {value!r}")
            flat.update(flatten(value, label, f"{key}."))
        else:
            _check_known(key, label)
            flat[key] = value
    return flat


def parse_override(text: str) -> tuple[str, Any]:
    """'optimizer.lr=1e-4' -> ('optimizer.lr', 1e-4): the value is a YAML scalar (or flow list)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SlimtuneError(f"override {text!r} must look like key=value (e.g. optimizer.lr=1e-4)")
    _check_known(key, f"override {text!r}")
    value = _safe_yaml(raw, f"override {text!r}") if raw.strip() else None
    return key, value


MAX_CONFIG_BYTES = 1024 * 1024
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _safe_yaml(text: str, label: str) -> Any:
    """yaml.safe_load, refusing what a config never needs and PyYAML handles badly: anchors and aliases
    (exponential expansion), nesting deeper than 64, integers of thousands of digits."""
    if _flow_depth(text) > 64:  # PyYAML's scanner is quadratic in flow nesting: refuse before it runs
        raise SlimtuneError(f"{label}: YAML nested deeper than 64 levels")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise SlimtuneError(f"{label}: YAML anchors and aliases (& and *) are not allowed in a config")
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > 64:
                    raise SlimtuneError(f"{label}: YAML nested deeper than 64 levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (libyaml's when present)
    except yaml.YAMLError as e:
        raise SlimtuneError(f"{label}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    except (ValueError, RecursionError, OverflowError) as e:  # e.g. int() of a 5,000-digit number
        raise SlimtuneError(f"{label}: YAML value cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def load_config(path_or_name: str, overrides: list[str] | tuple[str, ...] = (), values: dict[str, Any] | None = None) -> Config:
    """Read, override (``key=value`` texts, then ``values`` from code), type-check and resolve a config.
    Raises SlimtuneError naming the key on any problem."""
    label, data = read_config_source(path_or_name)
    merged = {k.name: k.default for k in SCHEMA}
    merged.update(flatten(data, label))
    for text in overrides:
        key, value = parse_override(text)
        merged[key] = value
    for key, value in (values or {}).items():
        _check_known(key, label)
        merged[key] = value
    return validate(merged, label)


def validate(values: dict[str, Any], label: str = "config") -> Config:
    """Coerce and check every value against the schema; resolve paths (placeholder, ~, absolute); then
    the rules between keys (``Config.check``)."""
    checked = {key.name: key.check(values.get(key.name, key.default), label) for key in SCHEMA}
    root = Path(checked["output_dir"])  # where {output_dir} and relative paths point
    for key in SCHEMA:
        if key.kind.resolve is not None and checked[key.name] is not None:
            try:
                checked[key.name] = key.kind.resolve(checked[key.name], root)
            except (OSError, RuntimeError, ValueError) as e:  # a name too long, a loop of links, ...
                raise SlimtuneError(f"{label}: config key {key.name!r} cannot be used as a path ({type(e).__name__}: {e})"[:400]) from None
    cfg = build(Config, checked)
    cfg.check()
    return cfg


def _check_known(key: str, label: str) -> None:
    if key in KEYS:
        return
    close = difflib.get_close_matches(key, list(KEYS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(KEYS)}"
    raise SlimtuneError(f"{label}: unknown config key {key!r}{hint}")


def _section_keys(section: str) -> str:
    return ", ".join(k.name.rpartition(".")[2] for k in SCHEMA if k.name.rpartition(".")[0] == section)


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\']|\'\')*\'', re.S)


def _flow_depth(text: str) -> int:
    depth = deepest = 0
    for ch in re.sub(r"[^\[\]{}]+", "", _QUOTED.sub("", text)):
        depth = depth + 1 if ch in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def _default_text(key: Key) -> str:
    if key.required:
        return "required"
    if key.default is None:
        return "null"
    if isinstance(key.default, list | dict):
        return "[" + ", ".join(key.default) + "]"
    return str(key.default).lower() if isinstance(key.default, bool) else str(key.default)


def schema_help() -> str:
    """Plain-text description of every key, for `slimtune finetune --help`."""
    lines = [
        "config keys: YAML sections (optimizer: {lr: 2.0e-4}) or key=value overrides read as YAML scalars.",
        "A default applies where the config file does not set the key; 'fixed on resume' keys must match the checkpoint.",
    ]
    for key in SCHEMA:
        kind = "|".join(key.choices) if key.choices else key.kind.label
        notes = [kind, f"default {_default_text(key)}" if not key.required else "required"]
        if key.fixed:
            notes.append("fixed on resume")
        lines.append(f"  {key.name}  ({'; '.join(notes)})")
        lines += textwrap.wrap(key.help, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def schema_markdown() -> str:
    """The same descriptions as a Markdown table, for docs/configuration.md (tests keep the two in step)."""
    rows = ["| key | type | default | resume | description |", "| --- | --- | --- | --- | --- |"]
    for key in SCHEMA:
        kind = " \\| ".join(key.choices) if key.choices else key.kind.label
        rows.append(f"| `{key.name}` | {kind} | {_default_text(key)} | {'fixed' if key.fixed else 'may change'} | {key.help} |")
    return "\n".join(rows)
