"""Seeded mutators for the reader fuzzers and the differential test: structured mutations of JSON values
(the kinds of faults people's files have: wrong types, negative, huge, float, non-finite and
duplicated values, deep nesting, lone surrogates) and byte-level damage of the serialized text."""

from __future__ import annotations

import json
import random
import struct

NASTY_NUMBERS = ["-1", "-0", "0", "1.0", "2.9", "1e400", "-1e400", "1e2", "18446744073709551615", "18446744073709551616",
                 "4611686018427387904", "9" * 30, "9" * 400, "NaN", "Infinity", "-Infinity", "true", "false", "null",
                 '"2"', '"x"', "[]", "{}", "[1]", '{"a":1}', "1e-400", "0.5"]  # fmt: skip
NASTY_STRINGS = ["\ud800", "\udc00", "", "x" * 300, "\x00", "a\nb", "\u00e9", "\U0001f600", "__metadata__"]


def dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def _paths(value, prefix=()):
    """Every path to a JSON value inside ``value`` (dict keys and list indexes)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


_MARK = "\u0001MARK\u0001"


def mutate_json(value, rng: random.Random) -> str:
    """One structured mutation of ``value``, returned as JSON text (may be invalid JSON on purpose)."""
    value = json.loads(json.dumps(value))
    paths = list(_paths(value))
    path = rng.choice(paths)
    kind = rng.randrange(12)
    if kind == 11:  # duplicate a key in an object
        objs = [p for p in paths if isinstance(_get(value, p), dict) and _get(value, p)]
        if objs:
            p = rng.choice(objs)
            text = dumps(value)
            obj = _get(value, p)
            k = rng.choice(list(obj))
            sub = dumps(obj)
            dup = sub[:-1] + "," + dumps(k) + ":" + rng.choice([dumps(obj[k]), rng.choice(NASTY_NUMBERS)]) + "}"
            return text.replace(sub, dup, 1) if sub in text else text
    if kind == 10:  # deep nesting somewhere
        depth = rng.choice([5, 100, 126, 127, 128, 129, 200, 1000, 5000])
        return _set_raw(value, path, "[" * depth + "]" * depth)
    if kind == 9:  # a nasty string as a key or value
        s = rng.choice(NASTY_STRINGS)
        parent = path[:-1]
        if path and isinstance(_get(value, parent), dict) and rng.random() < 0.5:
            obj = _get(value, parent)
            obj[s] = obj.pop(path[-1])
            return dumps(value)
        return _set(value, path, s)
    if kind in (0, 1, 2, 3, 4):  # nasty number or literal in place of a value
        return _set_raw(value, path, rng.choice(NASTY_NUMBERS))
    if kind == 5:  # small integer change
        v = _get(value, path)
        if type(v) is int:
            return _set(value, path, v + rng.choice([-2, -1, 1, 2, 7, 2**32, -(2**40)]))
        return _set(value, path, rng.randrange(-3, 10))
    if kind == 6:  # drop a key / element
        if path:
            parent = _get(value, path[:-1])
            del parent[path[-1]]
        return dumps(value)
    if kind == 7:  # wrap in a list or object
        v = _get(value, path)
        return _set(value, path, rng.choice([[v], {"x": v}, [v, v]]))
    if kind == 8:  # swap two values of the same container
        v = _get(value, path)
        if isinstance(v, list) and len(v) > 1:
            v.reverse()
        elif isinstance(v, dict) and len(v) > 1:
            ks = list(v)
            a, b = rng.sample(ks, 2)
            v[a], v[b] = v[b], v[a]
        return dumps(value)
    return dumps(value)


def _get(value, path):
    for p in path:
        value = value[p]
    return value


def _set(value, path, new) -> str:
    if not path:
        return dumps(new)
    _get(value, path[:-1])[path[-1]] = new
    return dumps(value)


def _set_raw(value, path, raw: str) -> str:
    text = _set(value, path, _MARK)
    return text.replace(dumps(_MARK), raw, 1)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Byte-level damage: flips, truncation, insertion, deletion."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(4)
        if not b:
            b += b"{"
        i = rng.randrange(len(b))
        if kind == 0:
            b[i] = rng.randrange(256)
        elif kind == 1:
            del b[i:]
        elif kind == 2:
            b[i:i] = bytes([rng.choice(b'{}[]",:0123456789-e.\\ ')])
        else:
            del b[i : i + rng.randint(1, 4)]
    return bytes(b)


# ---- safetensors ---------------------------------------------------------------------------------

BITS = {"F32": 32, "BF16": 16, "F16": 16, "U8": 8, "I64": 64, "U16": 16, "U32": 32, "U64": 64, "F8_E4M3": 8,
        "F8_E5M2": 8, "C64": 64, "BOOL": 8, "F4": 4, "F64": 64, "I8": 8}  # fmt: skip


def random_header(rng: random.Random) -> tuple[dict, int]:
    """A valid header (as a dict) and the number of data bytes it declares."""
    header: dict = {}
    if rng.random() < 0.5:
        header["__metadata__"] = {"format": "pt", "k": "v"} if rng.random() < 0.8 else None
    offset = 0
    for i in range(rng.randint(0, 4)):
        dtype = rng.choice(list(BITS))
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.1:
            shape = [2**62, 0] if rng.random() < 0.5 else [4, 0]
        n = 1
        for d in shape:
            n *= d
        if dtype == "F4" and n % 2:
            shape = shape + [2]
            n *= 2
        nbytes = n * BITS[dtype] // 8
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    items = list(header.items())
    rng.shuffle(items)
    return dict(items), offset


def safetensors_file(header_text: str | bytes, data_len: int, pad: bool = True) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass") if isinstance(header_text, str) else header_text
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(data_len)


def mutated_safetensors(rng: random.Random) -> bytes:
    """A safetensors file whose header is valid, structurally mutated, or byte-damaged."""
    header, data_len = random_header(rng)
    r = rng.random()
    if r < 0.1:
        return safetensors_file(dumps(header), data_len)
    if r < 0.8:
        text = mutate_json(header, rng)
        if rng.random() < 0.2:
            text = mutate_json(json.loads(text), rng) if _is_json(text) else text
        return safetensors_file(text, data_len + rng.choice([0, 0, 0, 1, -1]) if data_len else data_len)
    if r < 0.95:
        return safetensors_file(mutate_bytes(dumps(header).encode(), rng), data_len)
    whole = bytearray(safetensors_file(dumps(header), data_len))
    return mutate_bytes(bytes(whole), rng)  # the length prefix and the data too


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False
