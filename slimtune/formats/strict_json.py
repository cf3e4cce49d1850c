"""Strict JSON, as serde_json (the safetensors reference's parser) reads it, for every JSON file slimtune
reads: nesting at most 127 deep, no NaN/Infinity literals, no number outside the float range, integers
beyond 64 bits read as floats (so they never pass as a size), no lone surrogates, and (by default) no
duplicate keys. Every failure is a SlimtuneError naming the file.

Example::

    from slimtune.formats.strict_json import load_json, loads_json
    config = load_json(Path("model/config.json"), expect=dict)
    row = loads_json(line, where="data.jsonl line 3")
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from slimtune.errors import SlimtuneError

MAX_DEPTH = 127  # serde_json's recursion limit, measured against the safetensors reference
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024  # config.json, indexes, manifests: far larger than any real one
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class Pairs(list):
    """An object's (key, value) pairs in file order, duplicates kept (``duplicates="keep"``)."""


class _JSONFault(ValueError):
    pass


def _depth_ok(text: str) -> int:
    """Deepest nesting of arrays/objects (strings skipped); 0 when there are few brackets."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        else:
            depth -= 1
    return deepest


def _parse_int(s: str) -> int | float:
    # serde_json: integers that fit i64/u64 are integers, "-0" and anything larger are floats.
    if len(s) <= 20:
        v = int(s)
        if (-(2**63) <= v <= 2**64 - 1) and s != "-0":
            return v
    v = float(s)
    if not math.isfinite(v):
        raise _JSONFault(f"number {s[:24]}{'...' if len(s) > 24 else ''} out of range")
    return v


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _JSONFault(f"number {s[:24]}{'...' if len(s) > 24 else ''} out of range")
    return v


def _no_constants(s: str):
    raise _JSONFault(f"{s} is not JSON (non-finite numbers are refused)")


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _JSONFault(f"string {safe_repr(s)} holds a lone surrogate escape") from None


def _check_strings(value: object) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            _check_str(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_str(k)
                stack.append(x)
        elif isinstance(v, list):  # Pairs included: its items are (key, value) tuples
            for x in v:
                if isinstance(v, Pairs):
                    _check_str(x[0])
                    stack.append(x[1])
                else:
                    stack.append(x)


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _JSONFault(f"duplicate key {safe_repr(k)}")
        out[k] = v
    return out


def loads_json(data: str | bytes, where: str, *, duplicates: str = "error", expect: type | None = None):
    """Parse ``data`` strictly; errors are SlimtuneErrors starting with ``where``. ``duplicates="keep"``
    returns objects as lists of (key, value) pairs (for formats whose own rules decide about them).
    ``expect`` (e.g. ``dict``) checks the top-level type."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SlimtuneError(f"{where}: not UTF-8 text (byte {e.start})") from None
    depth = _depth_ok(data)
    if depth > MAX_DEPTH:
        raise SlimtuneError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(
            data,
            object_pairs_hook=Pairs if duplicates == "keep" else _unique_pairs,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_no_constants,
        )
        _check_strings(value)
    except _JSONFault as e:
        raise SlimtuneError(f"{where}: invalid JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise SlimtuneError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (RecursionError, ValueError) as e:  # belt and braces: the depth check runs first
        raise SlimtuneError(f"{where}: invalid JSON ({type(e).__name__})") from None
    if expect is not None and not isinstance(value, Pairs if (expect is dict and duplicates == "keep") else expect):
        raise SlimtuneError(f"{where}: expected a JSON {_KIND.get(expect, expect.__name__)}, found {json_kind(value)}")
    return value


_KIND = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}


def json_kind(value: object) -> str:
    """How JSON would name the type of ``value`` (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, (dict, Pairs)):
        return "object"
    return _KIND.get(type(value), type(value).__name__)


def load_json(path: str | Path, *, expect: type | None = dict, max_bytes: int = MAX_JSON_FILE_BYTES, what: str = "file"):
    """Read and strictly parse a JSON file: it must be a regular file of at most ``max_bytes``."""
    path = Path(path)
    try:
        if not path.exists():
            raise SlimtuneError(f"{path}: missing ({what})")
        if not path.is_file():
            raise SlimtuneError(f"{path}: is not a regular file ({what})")
        size = path.stat().st_size
        if size > max_bytes:
            raise SlimtuneError(f"{path}: {size:,} bytes, more than the {max_bytes:,} a {what} may have")
        raw = path.read_bytes()
    except OSError as e:
        raise SlimtuneError(f"{path}: cannot read: {e.strerror or e}") from None
    return loads_json(raw, str(path), expect=expect)


def safe_repr(name: object, limit: int = 200) -> str:
    """A name made printable whatever it holds (lone surrogates, control characters), quoted like repr."""
    text = repr(name) if isinstance(name, str) else repr(str(name))
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def safe_name(name: object, limit: int = 200) -> str:
    """A tensor, key or file name as it is when printable, else escaped (lone surrogates, control
    characters) so that printing it can never fail."""
    text = name if isinstance(name, str) else str(name)
    if not text.isprintable():
        text = repr(text)[1:-1]
    text = safe_text(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def safe_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (lone surrogates) escaped, so it always prints."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
