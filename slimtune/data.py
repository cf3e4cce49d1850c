"""Local datasets for the recipe: files read row by row (JSONL strictly, line by line, and JSON arrays
with the same rules; Parquet, Arrow and CSV through Hugging Face ``datasets`` in streaming mode), each row tokenized as it
arrives (only token ids are kept), prompt tokens masked out of the loss, several files mixed by
weight, an optional seeded held-out split, optional packing, deterministic seeded order, padded
micro-batches.

Row shapes (``dataset.format=auto`` decides per row from its keys; ``dataset.columns`` renames a
file's columns to these keys first):

- alpaca:     ``{"instruction", "input"? , "output"}``; the prompt is the Alpaca template.
- chat:       ``{"messages": [{"role", "content"}, ...]}``; rendered with the tokenizer's chat
  template when it has one, else the plain ``<|role|>`` format of ``FALLBACK_CHAT_TEMPLATE``.
  Only assistant turns are trained on.
- sharegpt:   ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``; as chat.
- completion: ``{"prompt", "completion"}`` (TRL): strings (the completion is trained on), or lists of
  messages (the completion's messages are trained on).
- text:       ``{"text"}``; every token is trained on.

``dataset.train_on_inputs=true`` trains on every token (prompts and user turns too).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimtune.errors import SlimtuneError
from slimtune.formats.manifest import sha256_bytes, sha256_file
from slimtune.formats.strict_json import loads_json
from slimtune.tiny import DEMO_TEXTS

IGNORE_INDEX = -100
FORMATS = ("alpaca", "chat", "sharegpt", "completion", "text")
FILE_TYPES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
MAX_LINE_BYTES = 256 * 2**20  # one JSONL line; longer ones are refused before they are parsed

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
# The format chat rows train in when the tokenizer has no chat template, as a Jinja template: saved with
# the checkpoint's tokenizer, so `apply_chat_template` reproduces the training token ids.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Example:
    input_ids: torch.Tensor  # int32, 1-D
    labels: torch.Tensor  # int32, IGNORE_INDEX where the token is not trained on
    position_ids: torch.Tensor | None = None  # packed rows only: restarts at 0 at each document


@dataclass
class Record:
    """One parsed row, with where it came from (for error messages)."""

    data: dict[str, Any]
    where: str  # "path:line" or "path: row N"


@dataclass
class DataSpec:
    """What to read and how; built from the config's dataset section by ``DataSpec.from_config``."""

    paths: list[str]
    weights: list[float] | None = None
    eval_path: str | None = None
    eval_fraction: float = 0.0
    fmt: str = "auto"
    columns: dict[str, str] = field(default_factory=dict)
    max_seq_len: int = 512
    train_on_inputs: bool = False
    packed: bool = False
    seed: int = 0

    @classmethod
    def from_config(cls, cfg) -> DataSpec:
        d = cfg.dataset
        return cls(
            paths=[d.path, *(d.mix or [])],
            weights=d.weights,
            eval_path=d.eval_path,
            eval_fraction=d.eval_fraction,
            fmt=d.format,
            columns=dict(d.columns or {}),
            max_seq_len=d.max_seq_len,
            train_on_inputs=d.train_on_inputs,
            packed=d.packed,
            seed=cfg.seed,
        )


@dataclass
class Data:
    """Tokenized train (and eval) examples, and what the run records about them."""

    train: list[Example]
    eval: list[Example]
    dropped: int
    files: list[tuple[str, str]]  # (path, sha256) of every file read, eval file included
    sha256: str  # identifies the training data (files, weights, split, packing) for resume checks
    shapes: Counter  # rows per shape
    documents: int = 0  # training documents before packing


def load_data(spec: DataSpec, tokenizer, rows: dict[str, list[dict]] | None = None, vocab_size: int | None = None) -> Data:
    """Read, tokenize, split, weight and (optionally) pack every file of ``spec``. ``rows`` supplies the
    content of paths that are not files (the built-in dataset before it is written). Token ids at or
    above ``vocab_size`` (a tokenizer that does not belong to the model) are an error naming the row.

    >>> data = load_data(DataSpec(["train.jsonl"], eval_fraction=0.1), tokenizer)  # doctest: +SKIP
    """
    rows = rows or {}
    weights = spec.weights or [1.0] * len(spec.paths)
    if len(weights) != len(spec.paths):
        raise SlimtuneError(f"dataset.weights has {len(weights)} value(s) for {len(spec.paths)} file(s) (dataset.path and dataset.mix)")
    train: list[Example] = []
    held_out: list[Example] = []
    dropped, shapes, files, identity = 0, Counter(), [], []
    for index, (path, weight) in enumerate(zip(spec.paths, weights, strict=True)):
        records, sha = _source(path, rows)
        examples, n_dropped = _tokenize_all(records, tokenizer, spec, shapes, vocab_size)
        dropped += n_dropped
        files.append((path, sha))
        identity.append(f"{sha}:{weight!r}")
        if spec.eval_fraction and spec.eval_path is None:
            examples, split = _split(examples, spec.eval_fraction, spec.seed + index)
            held_out += split
        train += _weighted(examples, weight, spec.seed + index)
    if spec.eval_path is not None:
        records, sha = _source(spec.eval_path, rows)
        held_out, n_dropped = _tokenize_all(records, tokenizer, spec, Counter(), vocab_size)
        files.append((spec.eval_path, sha))
    if not train:
        raise SlimtuneError(f"no training example has a trained token within dataset.max_seq_len={spec.max_seq_len} ({dropped} dropped)")
    documents = len(train)
    if spec.packed:
        train, held_out = pack(train, spec.max_seq_len, spec.seed), pack(held_out, spec.max_seq_len, spec.seed)
    extra = f"|fraction={spec.eval_fraction!r}|packed={spec.packed}|inputs={spec.train_on_inputs}|columns={sorted(spec.columns.items())}"
    sha = sha256_bytes(";".join(identity) + extra)
    return Data(train, held_out, dropped, files, sha, shapes, documents)


def _source(path: str, rows: dict[str, list[dict]]) -> tuple[Iterable[Record], str]:
    if path in rows and not Path(path).is_file():
        return (Record(r, f"built-in dataset:{i + 1}") for i, r in enumerate(rows[path])), sha256_bytes(jsonl_text(rows[path]))
    return read_rows(path), sha256_file(path)


def _tokenize_all(
    records: Iterable[Record], tokenizer, spec: DataSpec, shapes: Counter, vocab_size: int | None
) -> tuple[list[Example], int]:
    examples, dropped = [], 0
    for record in records:
        record = _renamed(record, spec.columns)
        shape = detect_format(record, spec.fmt)
        example = tokenize(record, shape, tokenizer, spec.max_seq_len, spec.train_on_inputs)
        if vocab_size is not None and len(example.input_ids) and int(example.input_ids.max()) >= vocab_size:
            raise SlimtuneError(
                f"{record.where}: the tokenizer produced token id {int(example.input_ids.max())}, but the model's vocab_size is "
                f"{vocab_size} (the tokenizer does not belong to this model)"
            )
        shapes[shape] += 1
        if int((example.labels[1:] != IGNORE_INDEX).sum()) == 0:
            dropped += 1
            continue
        examples.append(example)
    return examples, dropped


def _renamed(record: Record, columns: dict[str, str]) -> Record:
    """Apply ``dataset.columns`` ({shape key: file column}); missing values (None, NaN from CSV) are dropped."""
    data = {k: v for k, v in record.data.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
    for key, column in columns.items():
        if column in data:
            data[key] = data.pop(column)
    return Record(data, record.where)


def _split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded held-out split: round(fraction * n) examples (at least 1, and at least 1 left to train)."""
    n = len(examples)
    k = min(n - 1, max(1, round(fraction * n))) if n > 1 else 0
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 17)).tolist()
    held = set(order[:k])
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def _weighted(examples: list[Example], weight: float, seed: int) -> list[Example]:
    """``weight`` times the file's examples per epoch: whole repeats, then a seeded subset for the fraction."""
    if weight == 1.0:
        return examples
    whole, fraction = int(weight), weight - int(weight)
    out = examples * whole
    k = round(fraction * len(examples))
    if k:
        chosen = sorted(torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed * 104729 + 3))[:k].tolist())
        out += [examples[i] for i in chosen]
    return out


# ---------------------------------------------------------------------------------------------------
# Reading files


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
        stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        for count, row in enumerate(stream, start=1):  # noqa: B007
            yield Record(dict(row), f"{path}: row {count}")
    except SlimtuneError:
        raise
    except Exception as e:  # datasets/pyarrow errors for a malformed file
        message = " ".join(str(e).split())[:300]
        raise SlimtuneError(f"{path}: cannot read as {kind} ({type(e).__name__}: {message})") from None
    if count == 0:
        raise SlimtuneError(f"{path}: no examples (the file is empty)")


# ---------------------------------------------------------------------------------------------------
# Shapes and tokenization


def detect_format(record: Record, wanted: str = "auto") -> str:
    """The row's shape: the configured one (checked), or, with auto, the one its keys say."""
    keys = record.data.keys()
    shape = (
        "chat"
        if "messages" in keys
        else "sharegpt"
        if "conversations" in keys
        else "alpaca"
        if "instruction" in keys
        else "completion"
        if "prompt" in keys and "completion" in keys
        else "text"
        if "text" in keys
        else None
    )
    if wanted != "auto":
        if shape != wanted:
            raise SlimtuneError(f"{record.where}: dataset.format is {wanted} but the row has keys {sorted(keys)}; {_shapes()}")
        return wanted
    if shape is None:
        raise SlimtuneError(
            f"{record.where}: cannot tell the row's shape from keys {sorted(keys)}; {_shapes()} (or map columns with dataset.columns)"
        )
    return shape


def _shapes() -> str:
    return (
        'expected {"instruction", "input"?, "output"}, {"messages": [{"role", "content"}, ...]}, '
        '{"conversations": [{"from", "value"}, ...]}, {"prompt", "completion"} or {"text"}'
    )


def _string(record: Record, key: str, optional: bool = False) -> str:
    value = record.data.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise SlimtuneError(f"{record.where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def alpaca_prompt(instruction: str, extra: str = "") -> str:
    """The Alpaca prompt training uses (and ``slimtune generate`` for models trained on alpaca rows)."""
    return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra) if extra else ALPACA_PROMPT.format(instruction=instruction)


def segments(record: Record, fmt: str, tokenizer) -> list[tuple[str, bool]]:
    """The example as (text, trained) pieces in order; special-token text (bos, eos) is included."""
    bos = tokenizer.bos_token or ""
    eos = tokenizer.eos_token or ""
    if fmt == "text":
        return [(bos, False), (_string(record, "text") + eos, True)]
    if fmt == "alpaca":
        prompt = alpaca_prompt(_string(record, "instruction"), _string(record, "input", optional=True))
        return [(bos + prompt, False), (_string(record, "output") + eos, True)]
    if fmt == "completion" and isinstance(record.data.get("prompt"), str):
        return [(bos + _string(record, "prompt"), False), (_string(record, "completion") + eos, True)]
    if fmt == "completion":
        prompt = _messages(record, "prompt", need_assistant=False)
        completion = _messages(record, "completion", need_assistant=False)
        messages, trained = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    else:
        messages = _sharegpt(record) if fmt == "sharegpt" else _messages(record, "messages")
        trained = [m["role"] == "assistant" for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return _templated_segments(record, messages, trained, tokenizer)
    pieces: list[tuple[str, bool]] = [(bos, False)]
    for m, train in zip(messages, trained, strict=True):
        pieces.append((f"<|{m['role']}|>\n", False))
        pieces.append((m["content"] + eos + "\n", train))
    return pieces


def _messages(record: Record, key: str, need_assistant: bool = True) -> list[dict[str, str]]:
    messages = record.data.get(key)
    if not isinstance(messages, list) or not messages:
        raise SlimtuneError(f"{record.where}: {key!r} must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SlimtuneError(f"{record.where}: {key}[{i}] must be an object with string 'role' and 'content'")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise SlimtuneError(f"{record.where}: no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt(record: Record) -> list[dict[str, str]]:
    turns = record.data.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise SlimtuneError(f"{record.where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise SlimtuneError(f"{record.where}: conversations[{i}] must be an object with string 'from' and 'value'")
        role = SHAREGPT_ROLES.get(t["from"].lower())
        if role is None:
            raise SlimtuneError(f"{record.where}: conversations[{i}] is from {t['from']!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": t["value"]})
    if not any(m["role"] == "assistant" for m in messages):
        raise SlimtuneError(f"{record.where}: no assistant ('gpt') turn to train on")
    return messages


def _templated_segments(record: Record, messages: list[dict[str, str]], trained: list[bool], tokenizer) -> list[tuple[str, bool]]:
    """Render growing prefixes of the conversation; what each trained turn adds is trained on. Needs a
    template whose renderings of prefixes are prefixes of each other (true of the common ones)."""

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja errors, templates that refuse a role order, ...
            raise SlimtuneError(f"{record.where}: the tokenizer's chat template failed on this conversation ({e})") from None

    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = render(i, True)
            if not prompt.startswith(done):
                raise SlimtuneError(f"{record.where}: the tokenizer's chat template does not render this conversation prefix by prefix")
            pieces.append((prompt[len(done) :], False))
            done = prompt
        full = render(i + 1, False)
        if not full.startswith(done):
            raise SlimtuneError(f"{record.where}: the tokenizer's chat template does not render this conversation prefix by prefix")
        pieces.append((full[len(done) :], trained[i]))
        done = full
    return pieces


def tokenize(record: Record, fmt: str, tokenizer, max_seq_len: int, train_on_inputs: bool = False) -> Example:
    """Token ids and labels (untrained pieces masked), truncated to max_seq_len. Each piece is tokenized
    only as far as the remaining budget needs (a 5 MB line costs no more than a short one)."""
    ids: list[int] = []
    labels: list[int] = []
    pieces = segments(record, fmt, tokenizer)
    for text, trained in pieces:
        room = max_seq_len - len(ids)
        if room <= 0:
            break
        if not text:
            continue
        piece = encode_prefix(tokenizer, text, room)
        ids += piece
        trained = trained or train_on_inputs  # (the first token is never a target either way)
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return Example(torch.tensor(ids, dtype=torch.int32), torch.tensor(labels, dtype=torch.int32))


def encode_prefix(tokenizer, text: str, n: int, margin: int = 8) -> list[int]:
    """The first ``n`` token ids of ``text`` (as encoding all of it would give), encoding a growing
    prefix of the characters: enough that ``margin`` more tokens follow the ones kept, so the cut
    cannot change them."""
    budget = 8 * (n + margin) + 64
    while True:
        if budget >= len(text):
            return tokenizer.encode(text, add_special_tokens=False)[:n]
        ids = tokenizer.encode(text[:budget], add_special_tokens=False)
        if len(ids) >= n + margin:
            return ids[:n]
        budget *= 4


def load_dataset(records: list[Record], tokenizer, fmt: str = "auto", max_seq_len: int = 512) -> tuple[list[Example], int]:
    """Tokenize records already read. Examples with no trained token left after truncation are dropped
    (their count is returned) since they add nothing to the loss."""
    spec = DataSpec(paths=[], fmt=fmt, max_seq_len=max_seq_len)
    examples, dropped = _tokenize_all(records, tokenizer, spec, Counter(), None)
    if not examples:
        raise SlimtuneError(f"no example has a trained token within max_seq_len={max_seq_len} ({dropped} dropped)")
    return examples, dropped


# ---------------------------------------------------------------------------------------------------
# Packing, order, batches


def pack(examples: list[Example], max_seq_len: int, seed: int) -> list[Example]:
    """Documents concatenated into rows of at most ``max_seq_len`` tokens (seeded order, first fit in
    order: a row is closed when the next document does not fit). ``position_ids`` restart at 0 at each
    document, which is what makes transformers' attention block-diagonal (no token attends across a
    document boundary); the first token of each document is never a target, as unpacked."""
    if not examples:
        return []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed * 31 + 7)).tolist()
    rows: list[list[Example]] = [[]]
    used = 0
    for i in order:
        e = examples[i]
        if used + len(e.input_ids) > max_seq_len and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(e)
        used += len(e.input_ids)
    packed = []
    for docs in rows:
        labels = [d.labels.clone() for d in docs]
        for lab in labels:
            lab[0] = IGNORE_INDEX
        packed.append(
            Example(
                torch.cat([d.input_ids for d in docs]),
                torch.cat(labels),
                torch.cat([torch.arange(len(d.input_ids), dtype=torch.int32) for d in docs]),
            )
        )
    return packed


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The example order of one epoch: a function of (seed, epoch) only, so a resumed run sees the same."""
    if not shuffle:
        return list(range(num_examples))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def epoch_steps(order: list[int], batch_size: int, accumulation: int) -> list[list[list[int]]]:
    """The epoch as optimizer steps, each a list of micro-batches of example indices. The last step of an
    epoch may hold fewer micro-batches (and the last micro-batch fewer examples)."""
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (IGNORE_INDEX on padding). Packed rows get
    position_ids instead of an attention mask (the padding tail is one more document of its own)."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    packed = examples[0].position_ids is not None
    positions = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = e.input_ids
        labels[row, :n] = e.labels
        mask[row, :n] = 1
        if packed:
            positions[row, :n] = e.position_ids
            positions[row, n:] = torch.arange(length - n)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if packed:
        batch["position_ids"] = positions
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the forward pass gets from a collated batch: packed rows pass position_ids and no attention
    mask, and no cache: transformers then builds the block-diagonal causal mask from the position resets
    (with a cache it would not look for them)."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


# ---------------------------------------------------------------------------------------------------
# The built-in dataset


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
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(jsonl_text(rows), encoding="utf-8")
    tmp.replace(path)
    return path
