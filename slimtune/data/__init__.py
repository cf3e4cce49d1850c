"""Local datasets for the recipe, in three steps: ``readers`` (files read row by row), ``shapes`` (each
row tokenized as it arrives: only token ids are kept, prompt tokens masked out of the loss) and
``packing`` (optional packing, deterministic seeded order, padded micro-batches). ``load_data`` joins
them as the config says: several files mixed by weight, an optional seeded held-out split.

Example: ``data = load_data(DataSpec.from_config(cfg), tokenizer)``
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from slimtune.data.packing import collate, epoch_order, epoch_steps, model_inputs, pack, rank_batch
from slimtune.data.pairs import BadPair, PairOptions, PreferencePair, rank_pairs, tokenize_pair
from slimtune.data.prompt_rows import BadPrompt, PromptOptions, PromptRow, tokenize_prompt
from slimtune.data.readers import (
    FILE_TYPES,
    MAX_LINE_BYTES,
    Record,
    builtin_tiny_records,
    jsonl_text,
    parse_json,
    parse_json_object,
    read_dataset,
    read_jsonl,
    read_rows,
    write_jsonl,
)
from slimtune.data.shapes import (
    FORMATS,
    IGNORE_INDEX,
    SHAREGPT_ROLES,
    Example,
    detect_format,
    encode_prefix,
    segments,
    tokenize,
)
from slimtune.data.vision import PIXEL_INPUTS, ImageInputs, ImageRef, decode_image, is_vision_row, read_image_bytes
from slimtune.errors import SlimtuneError
from slimtune.formats.hub import is_dataset_id, resolve_dataset
from slimtune.formats.manifest import sha256_bytes, sha256_file
from slimtune.prompts import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, FALLBACK_CHAT_TEMPLATE, alpaca_prompt

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_WITH_INPUT",
    "Data",
    "DataSpec",
    "Example",
    "PairOptions",
    "PreferencePair",
    "PromptOptions",
    "PromptRow",
    "FALLBACK_CHAT_TEMPLATE",
    "FILE_TYPES",
    "FORMATS",
    "IGNORE_INDEX",
    "ImageInputs",
    "ImageRef",
    "PIXEL_INPUTS",
    "MAX_LINE_BYTES",
    "Record",
    "SHAREGPT_ROLES",
    "alpaca_prompt",
    "builtin_tiny_records",
    "collate",
    "decode_image",
    "detect_format",
    "encode_prefix",
    "is_vision_row",
    "epoch_order",
    "epoch_steps",
    "jsonl_text",
    "load_data",
    "load_dataset",
    "model_inputs",
    "pack",
    "rank_batch",
    "rank_pairs",
    "parse_json",
    "parse_json_object",
    "read_dataset",
    "read_image_bytes",
    "read_jsonl",
    "read_rows",
    "segments",
    "tokenize",
    "write_jsonl",
]


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
    pairs: PairOptions | None = None  # preference pairs (training.objective dpo, ipo, simpo) instead of SFT rows
    drop_bad_pairs: bool = False  # preference.bad_rows=drop (grpo.bad_rows=drop): bad pairs (prompts) are skipped and counted
    prompts: PromptOptions | None = None  # prompt-only rows (training.objective grpo)

    @classmethod
    def from_config(cls, cfg) -> DataSpec:
        d, objective = cfg.dataset, cfg.training.objective
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
            pairs=None if objective in ("sft", "grpo") else PairOptions(d.max_seq_len, cfg.preference.truncation_mode),
            drop_bad_pairs=(cfg.grpo.bad_rows if objective == "grpo" else cfg.preference.bad_rows) == "drop",
            prompts=PromptOptions(cfg.grpo.max_prompt_length) if objective == "grpo" else None,
        )


@dataclass
class Data:
    """Tokenized train (and eval) examples, and what the run records about them."""

    train: list[Example]  # PreferencePair with spec.pairs
    eval: list[Example]
    dropped: int  # examples with no trained token (SFT), bad pairs dropped (preference.bad_rows=drop)
    files: list[tuple[str, str]]  # (path, sha256) of every file read, eval file included; hub: (org/name@commit:split, its sha256)
    sha256: str  # identifies the training data (files, weights, split, packing) for resume checks
    shapes: Counter  # rows per shape
    documents: int = 0  # training documents before packing
    datasets: list[dict] = field(default_factory=list)  # hub datasets read: DatasetSource.record() (name, revision, subset, split)
    images: ImageInputs | None = None  # a vision-language model's processor: vision rows' images, decoded per batch


def load_data(spec: DataSpec, tokenizer, rows: dict[str, list[dict]] | None = None, vocab_size: int | None = None, processor=None) -> Data:
    """Read, tokenize, split, weight and (optionally) pack every file of ``spec``. ``rows`` supplies the
    content of paths that are not files (the built-in dataset before it is written). Token ids at or
    above ``vocab_size`` (a tokenizer that does not belong to the model) are an error naming the row.
    ``processor``: a vision-language model's (``AutoProcessor``), which vision rows need (``data/vision.py``).

    >>> data = load_data(DataSpec(["train.jsonl"], eval_fraction=0.1), tokenizer)  # doctest: +SKIP
    """
    rows = rows or {}
    weights = spec.weights or [1.0] * len(spec.paths)
    if len(weights) != len(spec.paths):
        raise SlimtuneError(f"dataset.weights has {len(weights)} value(s) for {len(spec.paths)} file(s) (dataset.path and dataset.mix)")
    train: list[Example] = []
    held_out: list[Example] = []
    dropped, shapes, files, identity, hub = 0, Counter(), [], [], []
    images = ImageInputs(processor) if processor is not None else None
    for index, (path, weight) in enumerate(zip(spec.paths, weights, strict=True)):
        records, label, sha = _source(path, rows, hub)
        examples, n_dropped = _tokenize_all(records, tokenizer, spec, shapes, vocab_size, _vision(images, path, spec))
        dropped += n_dropped
        files.append((label, sha))
        identity.append(f"{sha}:{weight!r}")
        if spec.eval_fraction and spec.eval_path is None:
            examples, split = _split(examples, spec.eval_fraction, spec.seed + index)
            held_out += split
        train += _weighted(examples, weight, spec.seed + index)
    if spec.eval_path is not None:
        records, label, sha = _source(spec.eval_path, rows, hub)
        held_out, n_dropped = _tokenize_all(records, tokenizer, spec, Counter(), vocab_size, _vision(images, spec.eval_path, spec))
        files.append((label, sha))
    if not train:
        raise SlimtuneError(
            f"{', '.join(spec.paths)}: no training example has a trained token within dataset.max_seq_len={spec.max_seq_len} "
            f"({dropped} dropped)"
        )
    documents = len(train)
    if spec.packed and any(e.images for e in train + held_out):
        raise SlimtuneError(f"{', '.join(spec.paths)}: rows with images cannot be packed; set dataset.packed=false")
    if spec.packed:
        train, held_out = pack(train, spec.max_seq_len, spec.seed), pack(held_out, spec.max_seq_len, spec.seed)
    extra = f"|fraction={spec.eval_fraction!r}|packed={spec.packed}|inputs={spec.train_on_inputs}|columns={sorted(spec.columns.items())}"
    extra += f"|pairs={spec.pairs!r}" if spec.pairs is not None else ""
    extra += f"|prompts={spec.prompts!r}" if spec.prompts is not None else ""
    extra += f"|images={images.digest}" if images is not None and images.rows else ""
    sha = sha256_bytes(";".join(identity) + extra)
    return Data(train, held_out, dropped, files, sha, shapes, documents, hub, images if images is not None and images.rows else None)


def _vision(images: ImageInputs | None, path: str, spec: DataSpec):
    """How the file at ``path`` tokenizes its vision rows (images relative to its directory, or to a
    dataset directory itself), or None without a processor."""
    if images is None:
        return None
    base_dir = Path(path).parent if Path(path).is_file() else Path(path)
    return partial(images.tokenize, base_dir=base_dir, max_seq_len=spec.max_seq_len, train_on_inputs=spec.train_on_inputs)


def _source(path: str, rows: dict[str, list[dict]], hub: list[dict]) -> tuple[Iterable[Record], str, str]:
    """The rows of ``path``, what the checkpoint calls it and its sha256: the built-in rows, a local file
    (which wins over a hub dataset of the same name), or a hub dataset's split (identified by its commit,
    subset and split; its record appended to ``hub``)."""
    if path in rows and not Path(path).is_file():
        return (Record(r, f"built-in dataset:{i + 1}") for i, r in enumerate(rows[path])), path, sha256_bytes(jsonl_text(rows[path]))
    if Path(path).is_file() or not is_dataset_id(path):
        return read_rows(path), path, sha256_file(path)
    source = resolve_dataset(path)
    if source.hub_id is None:  # a local dataset directory: its files' contents identify it
        files = sorted(p for p in source.path.rglob("*") if p.is_file())
        return read_dataset(source), source.label, sha256_bytes(";".join(f"{p.relative_to(source.path)}:{sha256_file(p)}" for p in files))
    hub.append(source.record())
    return read_dataset(source), source.label, sha256_bytes(source.label)  # the commit identifies the content


def _tokenize_all(
    records: Iterable[Record], tokenizer, spec: DataSpec, shapes: Counter, vocab_size: int | None, vision=None
) -> tuple[list[Example], int]:
    if spec.pairs is not None:
        return _tokenize_pairs(records, tokenizer, spec, shapes, vocab_size)
    if spec.prompts is not None:
        return _tokenize_prompts(records, tokenizer, spec, shapes, vocab_size)
    examples, dropped = [], 0
    for record in records:
        record = _renamed(record, spec.columns)
        shape = detect_format(record, spec.fmt)
        if shape == "chat" and (vision is not None or is_vision_row(record)):  # a vision model's processor renders every chat row
            if vision is None:
                raise SlimtuneError(f"{record.where}: a row with images (content parts) needs a vision-language model's processor")
            example = vision(record)
        else:
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


def _tokenize_pairs(
    records: Iterable[Record], tokenizer, spec: DataSpec, shapes: Counter, vocab_size: int | None
) -> tuple[list[PreferencePair], int]:
    """Preference rows as TRL tokenizes them (``data/pairs.py``); a bad pair is an error, or with
    ``spec.drop_bad_pairs`` skipped and counted."""

    def pair(record: Record) -> tuple[PreferencePair, int]:
        made = tokenize_pair(record, tokenizer, spec.pairs)
        return made, max(int(made.chosen.input_ids.max()), int(made.rejected.input_ids.max()))

    return _tokenize_rows(records, spec, shapes, vocab_size, pair, BadPair)


def _tokenize_prompts(
    records: Iterable[Record], tokenizer, spec: DataSpec, shapes: Counter, vocab_size: int | None
) -> tuple[list[PromptRow], int]:
    """Prompt-only rows as TRL tokenizes them (``data/prompt_rows.py``); a bad row is an error, or with
    ``spec.drop_bad_pairs`` (grpo.bad_rows=drop) skipped and counted."""

    def prompt(record: Record) -> tuple[PromptRow, int]:
        made = tokenize_prompt(record, tokenizer, spec.prompts)
        return made, int(made.prompt_ids.max())

    return _tokenize_rows(records, spec, shapes, vocab_size, prompt, BadPrompt)


def _tokenize_rows(
    records: Iterable[Record], spec: DataSpec, shapes: Counter, vocab_size: int | None, tokenize, bad: type
) -> tuple[list, int]:
    """Each record renamed and ``tokenize``d (the row and its largest token id); a ``bad`` row is an error,
    or with ``spec.drop_bad_pairs`` skipped and counted; a token id beyond ``vocab_size`` is one line."""
    rows, dropped = [], 0
    for record in records:
        record = _renamed(record, spec.columns)
        try:
            row, top = tokenize(record)
        except bad:
            if not spec.drop_bad_pairs:
                raise
            dropped += 1
            continue
        if vocab_size is not None and top >= vocab_size:
            raise SlimtuneError(
                f"{record.where}: the tokenizer produced token id {top}, but the model's vocab_size is {vocab_size} "
                "(the tokenizer does not belong to this model)"
            )
        shapes[row.shape] += 1
        rows.append(row)
    return rows, dropped


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


def load_dataset(records: list[Record], tokenizer, fmt: str = "auto", max_seq_len: int = 512) -> tuple[list[Example], int]:
    """Tokenize records already read. Examples with no trained token left after truncation are dropped
    (their count is returned) since they add nothing to the loss."""
    spec = DataSpec(paths=[], fmt=fmt, max_seq_len=max_seq_len)
    examples, dropped = _tokenize_all(records, tokenizer, spec, Counter(), None)
    if not examples:
        raise SlimtuneError(f"no example has a trained token within max_seq_len={max_seq_len} ({dropped} dropped)")
    return examples, dropped
