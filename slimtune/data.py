"""Local JSONL datasets for the recipe: three line shapes, tokenized once, prompt tokens masked out of the
loss, deterministic seeded order, padded micro-batches.

Line shapes (``dataset.format=auto`` decides per line from its keys):

- alpaca: ``{"instruction": ..., "input": ... (optional), "output": ...}``; the prompt is the Alpaca template.
- chat:   ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}``;
  rendered with the tokenizer's chat template when it has one, else a plain ``<|role|>`` format.
  Only assistant turns are trained on.
- text:   ``{"text": ...}``; every token is trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimtune.errors import SlimtuneError
from slimtune.tiny import DEMO_TEXTS

IGNORE_INDEX = -100
FORMATS = ("alpaca", "chat", "text")

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


@dataclass
class Example:
    input_ids: torch.Tensor  # int32, 1-D
    labels: torch.Tensor  # int32, IGNORE_INDEX where the token is prompt


@dataclass
class Record:
    """One parsed JSONL line, with where it came from (for error messages)."""

    data: dict[str, Any]
    where: str  # "path:line"


def read_jsonl(path: str | Path) -> list[Record]:
    """Every non-blank line as a JSON object; a malformed line fails with its file and line number."""
    path = Path(path)
    if not path.is_file():
        raise SlimtuneError(f"{path}: no such dataset file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise SlimtuneError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(data, dict):
                raise SlimtuneError(f"{where}: expected a JSON object, got {type(data).__name__}")
            records.append(Record(data, where))
    if not records:
        raise SlimtuneError(f"{path}: no examples (the file is empty)")
    return records


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def detect_format(record: Record, wanted: str = "auto") -> str:
    """The line's shape: the configured one (checked), or, with auto, the one its keys say."""
    keys = record.data.keys()
    shape = "chat" if "messages" in keys else "alpaca" if "instruction" in keys else "text" if "text" in keys else None
    if wanted != "auto":
        if shape != wanted:
            raise SlimtuneError(f"{record.where}: dataset.format is {wanted} but the line has keys {sorted(keys)}; {_shapes()}")
        return wanted
    if shape is None:
        raise SlimtuneError(f"{record.where}: cannot tell the line's shape from keys {sorted(keys)}; {_shapes()}")
    return shape


def _shapes() -> str:
    return 'expected {"instruction", "input"?, "output"}, {"messages": [{"role", "content"}, ...]} or {"text"}'


def _string(record: Record, key: str, optional: bool = False) -> str:
    value = record.data.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise SlimtuneError(f"{record.where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def segments(record: Record, fmt: str, tokenizer) -> list[tuple[str, bool]]:
    """The example as (text, trained) pieces in order; special-token text (bos, eos) is included."""
    bos = tokenizer.bos_token or ""
    eos = tokenizer.eos_token or ""
    if fmt == "text":
        return [(bos, False), (_string(record, "text") + eos, True)]
    if fmt == "alpaca":
        instruction, extra = _string(record, "instruction"), _string(record, "input", optional=True)
        output = _string(record, "output")
        prompt = (
            ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra)
            if extra
            else ALPACA_PROMPT.format(instruction=instruction)
        )
        return [(bos + prompt, False), (output + eos, True)]
    messages = _messages(record)
    if getattr(tokenizer, "chat_template", None):
        return _templated_segments(record, messages, tokenizer)
    pieces: list[tuple[str, bool]] = [(bos, False)]
    for m in messages:
        pieces.append((f"<|{m['role']}|>\n", False))
        pieces.append((m["content"] + eos + "\n", m["role"] == "assistant"))
    return pieces


def _messages(record: Record) -> list[dict[str, str]]:
    messages = record.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SlimtuneError(f"{record.where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SlimtuneError(f"{record.where}: messages[{i}] must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise SlimtuneError(f"{record.where}: no assistant message to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _templated_segments(record: Record, messages: list[dict[str, str]], tokenizer) -> list[tuple[str, bool]]:
    """Render growing prefixes of the conversation; what each assistant turn adds is trained on. Needs a
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
        pieces.append((full[len(done) :], m["role"] == "assistant"))
        done = full
    return pieces


def tokenize(record: Record, fmt: str, tokenizer, max_seq_len: int) -> Example:
    """Token ids and labels (prompt pieces masked), truncated to max_seq_len."""
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in segments(record, fmt, tokenizer):
        if not text:
            continue
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    return Example(torch.tensor(ids, dtype=torch.int32), torch.tensor(labels, dtype=torch.int32))


def load_dataset(records: list[Record], tokenizer, fmt: str = "auto", max_seq_len: int = 512) -> tuple[list[Example], int]:
    """Tokenize every record. Examples with no trained token left after truncation are dropped (their
    count is returned) since they add nothing to the loss."""
    examples, dropped = [], 0
    for record in records:
        example = tokenize(record, detect_format(record, fmt), tokenizer, max_seq_len)
        if int((example.labels[1:] != IGNORE_INDEX).sum()) == 0:
            dropped += 1
            continue
        examples.append(example)
    if not examples:
        raise SlimtuneError(f"no example has a trained token within max_seq_len={max_seq_len} ({dropped} dropped)")
    return examples, dropped


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
    """Right-padded input_ids, attention_mask and labels (IGNORE_INDEX on padding)."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = e.input_ids
        labels[row, :n] = e.labels
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


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
