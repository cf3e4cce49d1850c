"""Local data files read row by row: JSONL strictly, line by line, and JSON arrays with the same rules;
Parquet, Arrow and CSV through Hugging Face ``datasets`` in streaming mode (no cache written; image
features undecoded: ``{"bytes", "path"}``, decoded per batch by ``data/vision.py``); a dataset
directory's split (a hub dataset's snapshot, ``formats.hub.resolve_dataset``) through
``datasets.load_dataset`` the same way. Each row is a ``Record`` (its values and where it came from); the
built-in tiny dataset and the JSONL writer live here too.

Example: ``for record in read_rows("data/train.jsonl"): print(record.where, record.data)``
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimtune.errors import SlimtuneError
from slimtune.fileio import write_atomic
from slimtune.formats.hub import DatasetSource
from slimtune.formats.strict_json import loads_json
from slimtune.tiny import DEMO_TEXTS

FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


MAX_LINE_BYTES = 256 * 2**20  # one JSONL line; longer ones are refused before they are parsed


@dataclass
class Record:
    """One parsed row, with where it came from (for error messages)."""

    data: dict[str, Any]
    where: str  # "path:line" or "path: row N"


def read_rows(path: str | Path) -> Iterator[Record]:
    """The rows of a local data file, one at a time, as dicts; the file type comes from the suffix."""
    path = Path(path)
    if not path.is_file():
        raise SlimtuneError(f"{path}: no such dataset file")
    kind = FILE_TYPES.get(path.suffix.lower())
    if kind is None:
        raise SlimtuneError(f"{path}: unknown data file type {path.suffix!r}; expected one of {', '.join(FILE_TYPES)}")
    if kind == "json" and _first_byte(path) != b"[":
        kind = "jsonl"  # a .json file of one object per line
    if kind == "jsonl":
        return _read_jsonl(path)
    return _read_json_array(path) if kind == "json" else _read_with_datasets(path, kind)


def read_jsonl(path: str | Path) -> list[Record]:
    """Every non-blank line as a JSON object; a malformed line fails with its file and line number."""
    path = Path(path)
    if not path.is_file():
        raise SlimtuneError(f"{path}: no such dataset file")
    return list(_read_jsonl(path))


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]
    return b""


def _read_jsonl(path: Path) -> Iterator[Record]:
    count = 0
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            number += 1
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise SlimtuneError(f"{where}: line longer than {MAX_LINE_BYTES // 2**20} MiB")
            if not raw.strip():
                continue
            data = parse_json_object(raw, where)
            count += 1
            yield Record(data, where)
    if count == 0:
        raise SlimtuneError(f"{path}: no examples (the file is empty)")


def _read_json_array(path: Path) -> Iterator[Record]:
    """A JSON array of row objects, parsed strictly as JSONL lines are (the whole file at once: JSON
    arrays do not stream; pyarrow would also coerce rows of mixed types to strings)."""
    if path.stat().st_size > MAX_LINE_BYTES:
        raise SlimtuneError(f"{path}: a JSON array larger than {MAX_LINE_BYTES // 2**20} MiB; use JSONL (one object per line) or Parquet")
    rows = parse_json(path.read_bytes(), str(path))
    if not isinstance(rows, list):
        raise SlimtuneError(f"{path}: expected a JSON array of objects, got {type(rows).__name__}")
    if not rows:
        raise SlimtuneError(f"{path}: no examples (the array is empty)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SlimtuneError(f"{path}: element {i}: expected a JSON object, got {type(row).__name__}")
        yield Record(row, f"{path}: element {i}")


def parse_json_object(raw: bytes, where: str) -> dict:
    """One JSON object (see ``parse_json``)."""
    data = parse_json(raw, where)
    if not isinstance(data, dict):
        raise SlimtuneError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_json(raw: bytes, where: str) -> Any:
    """A JSON value from UTF-8 bytes by slimtune's strict rules (``formats.strict_json``: bounded nesting,
    no NaN/Infinity, no out-of-range numbers, no duplicate keys, no lone surrogates); every failure is
    one SlimtuneError naming ``where``."""
    return loads_json(raw, where)


def _read_with_datasets(path: Path, kind: str) -> Iterator[Record]:
    """Parquet, Arrow and CSV through ``datasets`` in streaming mode (no cache written)."""
    import datasets  # optional and heavy: only for parquet, arrow and csv files

    datasets.disable_progress_bars()
    builder = {"parquet": "parquet", "arrow": "arrow", "csv": "csv"}[kind]
    count = 0
    try:
        stream = _undecoded(datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True))
        for count, row in enumerate(stream, start=1):  # noqa: B007
            yield Record(dict(row), f"{path}: row {count}")
    except SlimtuneError:
        raise
    except Exception as e:  # datasets/pyarrow errors for a malformed file
        message = " ".join(str(e).split())[:300]
        raise SlimtuneError(f"{path}: cannot read as {kind} ({type(e).__name__}: {message})") from None
    if count == 0:
        raise SlimtuneError(f"{path}: no examples (the file is empty)")


def _undecoded(stream):
    """``stream`` with its image (and audio) features undecoded: an ``Image`` is ``{"bytes", "path"}``, decoded
    per batch by ``data/vision.py``; a stream of unknown features (CSV) decodes nothing anyway."""
    return stream.decode(False) if stream.features is not None else stream


def read_dataset(source: DatasetSource) -> Iterator[Record]:
    """The rows of ``source.split`` (of ``source.subset``) of a dataset directory, one at a time, through
    ``datasets.load_dataset`` in streaming mode (nothing written beside the hub's cache): the subsets and
    data files its README's ``configs`` name, else ``datasets``' file-name conventions (``train-*``,
    ``test-*``, ...). An unknown split or subset, or a directory ``datasets`` cannot read, is one line.

    Example: ``for record in read_dataset(resolve_dataset("org/name:train")): ...``"""
    import datasets  # optional and heavy: only for hub datasets and parquet, arrow and csv files

    label = source.label
    try:
        builder = datasets.load_dataset_builder(str(source.path), name=source.subset)
        splits = sorted((builder.config.data_files or {}).keys())
        if source.split not in splits:
            named = f" of subset {source.subset!r}" if source.subset else ""
            raise SlimtuneError(f"{label}: no split {source.split!r}{named}; the dataset has {', '.join(splits) or 'none'}")
        stream = _undecoded(builder.as_streaming_dataset(split=source.split))
        count = 0
        for count, row in enumerate(stream, start=1):  # noqa: B007
            yield Record(dict(row), f"{label}: row {count}")
    except SlimtuneError:
        raise
    except Exception as e:  # datasets/pyarrow errors: an unknown subset, malformed files
        message = " ".join(str(e).split())[:300]
        what = "no such subset" if "config" in message.lower() and source.subset else "cannot read it"
        raise SlimtuneError(f"{label}: {what} ({type(e).__name__}: {message})") from None
    if count == 0:
        raise SlimtuneError(f"{label}: no examples (the split is empty)")


def builtin_tiny_records() -> list[dict[str, Any]]:
    """The small built-in dataset: the demo sentences as text, plus a few alpaca and chat examples, so
    every line shape is exercised by `slimtune demo`."""
    rows: list[dict[str, Any]] = [{"text": t} for t in DEMO_TEXTS]
    facts = [
        ("What is written last in a checkpoint?", "", "The manifest."),
        ("What does a save hold in memory?", "", "One chunk at a time."),
        ("Name the format.", "Frozen weights.", "NF4."),
        ("How is LoRA merged?", "", "In fp32, rounded once."),
        ("Where do adapters go?", "", "In adapter/."),
        ("What happens if a save fails?", "", "The earlier checkpoint stays."),
    ]
    rows += [{"instruction": q, "input": i, "output": a} for q, i, a in facts]
    chats = [
        ("Is the merged model loadable?", "Yes, with transformers."),
        ("Is the adapter loadable?", "Yes, with peft."),
        ("Can training resume?", "Yes, exactly."),
        ("Does a kill corrupt a checkpoint?", "No, saves are atomic."),
    ]
    rows += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in chats]
    return rows


def jsonl_text(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Written whole or not at all (temporary sibling, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, jsonl_text(rows))
    return path
