"""Prompt-only rows -> prompt token ids, as TRL 1.16's ``GRPOTrainer`` renders and tokenizes them, for the
online objective (``training.objective`` grpo).

Row shapes (TRL's prompt-only formats; ``dataset.columns`` renames a file's columns to these keys first):

- standard:       ``{"prompt": str, ...}``: ``tokenizer(text=prompt)`` (special tokens as the tokenizer adds them);
- conversational: ``{"prompt": [messages], ...}``: the chat template renders and tokenizes the messages
  with the generation prompt (the tokenizer's template, else ``prompts.FALLBACK_CHAT_TEMPLATE``).

Every other column (``answer`` ...) is kept as it is and goes to the reward functions as a keyword list.
A prompt longer than ``max_prompt_length`` (grpo.max_prompt_length; TRL 1.16 has no such cut) keeps its end.

A bad row (no prompt, a prompt neither a string nor a list of messages, an empty prompt, a chat template
that fails on it) is a ``BadPrompt``: one line naming file and row.

Example: ``row = tokenize_prompt(Record({"prompt": "2+2=", "answer": "4"}, "f.jsonl:1"), tok, PromptOptions())``
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slimtune.data.readers import Record
from slimtune.errors import SlimtuneError
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE


class BadPrompt(SlimtuneError):
    """A prompt row that cannot be sampled from (its message names the file and row)."""


@dataclass(frozen=True)
class PromptOptions:
    """How prompts are cut: grpo.max_prompt_length (None: never, as TRL 1.16)."""

    max_prompt_length: int | None = None


@dataclass
class PromptRow:
    """One tokenized prompt, the prompt as the row gave it (what reward functions receive), its other columns."""

    prompt_ids: torch.Tensor  # int32
    prompt: str | list
    columns: dict = field(default_factory=dict)
    shape: str = "standard"  # or "conversational"
    where: str = ""


def prompt_shape(record: Record) -> str:
    """standard (a string prompt) or conversational (a list of messages); otherwise a ``BadPrompt``."""
    data = record.data
    if "prompt" not in data:
        found = ", ".join(sorted(data)) or "no keys"
        raise BadPrompt(f"{record.where}: a prompt-only row needs a prompt column (found {found})")
    prompt = data["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadPrompt(f"{record.where}: prompt is empty")
        return "standard"
    if isinstance(prompt, list):
        if not prompt:
            raise BadPrompt(f"{record.where}: prompt is an empty list of messages")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadPrompt(f"{record.where}: prompt[{i}] must be a message {{role: str, content: str}}")
        return "conversational"
    raise BadPrompt(f"{record.where}: prompt must be a string or a list of messages, not {type(prompt).__name__}")


def tokenize_prompt(record: Record, tokenizer, options: PromptOptions) -> PromptRow:
    """The row's prompt ids as TRL renders and tokenizes them, cut to keep the end; a bad row is a ``BadPrompt``.

    Example: ``tokenize_prompt(Record({"prompt": [{"role": "user", "content": "Hi"}]}, "f.jsonl:2"), tok, PromptOptions(64))``"""
    shape = prompt_shape(record)
    prompt = record.data["prompt"]
    ids = list(tokenizer(text=prompt)["input_ids"]) if shape == "standard" else _render(record, tokenizer)
    if not ids:
        raise BadPrompt(f"{record.where}: prompt tokenizes to no token")
    if options.max_prompt_length is not None:
        ids = ids[-options.max_prompt_length :]
    columns = {k: v for k, v in record.data.items() if k != "prompt"}
    return PromptRow(torch.tensor(ids, dtype=torch.int32), prompt, columns, shape, record.where)


def _render(record: Record, tokenizer) -> list[int]:
    extra = {} if getattr(tokenizer, "chat_template", None) else {"chat_template": FALLBACK_CHAT_TEMPLATE}
    try:
        out = tokenizer.apply_chat_template(record.data["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True, **extra)
        return list(out["input_ids"])
    except Exception as e:  # noqa: BLE001 - jinja errors, templates that refuse a role order, ...
        raise BadPrompt(f"{record.where}: the chat template failed on this conversation ({' '.join(str(e).split())[:200]})") from None
