"""Preference pairs -> token ids, as TRL 1.16's ``DPOTrainer`` makes them (its ``_prepare_dataset`` and
``DataCollatorForPreference``), for the preference objectives (``training.objective`` dpo, ipo, simpo).

Row shapes (TRL's preference formats; ``dataset.columns`` renames a file's columns to these keys first):

- standard:       ``{"prompt": str, "chosen": str, "rejected": str}``; the tokenizer's eos is appended to
  each answer that does not end with it, and ``tokenizer(prompt)``, ``tokenizer(prompt + answer)`` are
  tokenized (special tokens as the tokenizer adds them).
- conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``; the chat
  template renders the prompt (with the generation prompt) and prompt + answer (the tokenizer's template,
  else ``prompts.FALLBACK_CHAT_TEMPLATE``).

The answer starts where the tokenized prompt and prompt + answer diverge (TRL's ``common_prefix_length``);
only answer tokens are scored (the prompt is masked). Each sequence, prompt + answer, is cut to
``max_length`` (dataset.max_seq_len): its start kept (``keep_start``) or its end (``keep_end``).

A bad pair (a missing or mistyped key, an empty answer, chosen identical to rejected, a prompt that
fills the whole length under keep_start, where TRL drops the row) is a ``BadPair``: one line naming
file and row.

Example: ``pair = tokenize_pair(record, tokenizer, PairOptions(max_length=512))``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimtune.data.packing import collate
from slimtune.data.readers import Record
from slimtune.data.shapes import IGNORE_INDEX, Example
from slimtune.distributed import Ranks, split_rows
from slimtune.errors import SlimtuneError
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE

PAIR_KEYS = ("prompt", "chosen", "rejected")


class BadPair(SlimtuneError):
    """A preference row that cannot train (its message names the file and row)."""


@dataclass(frozen=True)
class PairOptions:
    """How pairs are cut: TRL's max_length (dataset.max_seq_len) and truncation_mode."""

    max_length: int = 512
    truncation_mode: str = "keep_start"


@dataclass
class PreferencePair:
    """One tokenized pair: prompt + chosen and prompt + rejected (labels: the answer's tokens, the prompt
    masked), and the reference's summed log-probabilities of each answer once the recipe computed them."""

    chosen: Example
    rejected: Example
    shape: str  # "standard" or "conversational"
    ref_logps: tuple[float, float] | None = None


def pair_shape(record: Record) -> str:
    """standard (three strings) or conversational (three lists of messages); otherwise a ``BadPair``."""
    data = record.data
    missing = [k for k in PAIR_KEYS if k not in data]
    if missing:
        found = ", ".join(sorted(data)) or "no keys"
        raise BadPair(f"{record.where}: a preference row needs prompt, chosen and rejected; missing {', '.join(missing)} (found {found})")
    if all(isinstance(data[k], str) for k in PAIR_KEYS):
        return "standard"
    if all(isinstance(data[k], list) for k in PAIR_KEYS):
        for key in PAIR_KEYS:
            _check_messages(record, key)
        return "conversational"
    kinds = ", ".join(f"{k} is {type(data[k]).__name__}" for k in PAIR_KEYS)
    raise BadPair(f"{record.where}: prompt, chosen and rejected must be all strings or all lists of messages ({kinds})")


def _check_messages(record: Record, key: str) -> None:
    messages = record.data[key]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadPair(f"{record.where}: {key}[{i}] must be a message {{role: str, content: str}}")
    if key != "prompt" and not any(m["content"].strip() for m in messages):
        raise BadPair(f"{record.where}: {key} is empty")


def tokenize_pair(record: Record, tokenizer, options: PairOptions) -> PreferencePair:
    """The pair's two sequences as TRL 1.16 tokenizes and truncates them; a bad pair is a ``BadPair``.

    Example: ``tokenize_pair(Record({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "f.jsonl:1"), tok, PairOptions())``"""
    shape = pair_shape(record)
    data = record.data
    if data["chosen"] == data["rejected"]:
        raise BadPair(f"{record.where}: chosen and rejected are identical")
    if shape == "standard":
        for key in ("chosen", "rejected"):
            if not data[key].strip():
                raise BadPair(f"{record.where}: {key} is empty")
        prompt, chosen, rejected = _standard_ids(tokenizer, data)
    else:
        prompt, chosen, rejected = _chat_ids(record, tokenizer)
    n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    prompt, chosen, rejected = prompt[:n], chosen[n:], rejected[n:]
    if not chosen or not rejected:
        raise BadPair(f"{record.where}: {'chosen' if not chosen else 'rejected'} adds no token to the prompt")
    if chosen == rejected:
        raise BadPair(f"{record.where}: chosen and rejected tokenize to the same ids")
    if options.truncation_mode == "keep_start" and len(prompt) >= options.max_length:
        raise BadPair(
            f"{record.where}: the prompt ({len(prompt)} tokens) fills dataset.max_seq_len={options.max_length}: no answer token is left "
            "(keep_start; preference.bad_rows=drop skips such rows, as TRL does)"
        )
    return PreferencePair(_sequence(prompt, chosen, options), _sequence(prompt, rejected, options), shape)


def _standard_ids(tokenizer, data: dict) -> tuple[list[int], list[int], list[int]]:
    eos = tokenizer.eos_token or ""
    answers = [a if a.endswith(eos) else a + eos for a in (data["chosen"], data["rejected"])]
    prompt = data["prompt"]
    return tuple(tokenizer(text=t)["input_ids"] for t in (prompt, prompt + answers[0], prompt + answers[1]))


def _chat_ids(record: Record, tokenizer) -> tuple[list[int], list[int], list[int]]:
    extra = {} if getattr(tokenizer, "chat_template", None) else {"chat_template": FALLBACK_CHAT_TEMPLATE}
    prompt = record.data["prompt"]

    def render(messages: list, generation_prompt: bool) -> list[int]:
        try:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 - jinja errors, templates that refuse a role order, ...
            raise BadPair(f"{record.where}: the chat template failed on this conversation ({' '.join(str(e).split())[:200]})") from None
        return list(out["input_ids"])

    return render(prompt, True), render(prompt + record.data["chosen"], False), render(prompt + record.data["rejected"], False)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _sequence(prompt: list[int], answer: list[int], options: PairOptions) -> Example:
    ids = prompt + answer
    labels = [IGNORE_INDEX] * len(prompt) + answer
    cut = slice(None, options.max_length) if options.truncation_mode == "keep_start" else slice(-options.max_length, None)
    return Example(torch.tensor(ids[cut], dtype=torch.int32), torch.tensor(labels[cut], dtype=torch.int32))


def rank_pairs(pairs: list[PreferencePair], batch: list[int], ranks: Ranks, pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of a global micro-batch of pairs, collated as TRL's collator lays it
    out: the chosen sequences, then the rejected ones, right-padded; ``ref_logps`` [2, n] (chosen, rejected;
    zeros before the reference is computed) and ``live`` [n] (1 per pair; a rank whose slice is empty runs
    one pair FSDP2's collectives need with ``live`` 0: it adds nothing).

    Example: ``rank_pairs(data.train, [0, 1], SINGLE, pad_id=0)["input_ids"].shape[0] == 4``"""
    start, end = split_rows(len(batch), ranks.world_size)[ranks.rank]
    chosen = [pairs[i] for i in batch[start:end]] or [pairs[batch[0]]]
    out = collate([p.chosen for p in chosen] + [p.rejected for p in chosen], pad_id)
    out["ref_logps"] = torch.tensor([p.ref_logps or (0.0, 0.0) for p in chosen], dtype=torch.float32).t().contiguous()
    out["live"] = torch.full((len(chosen),), 1.0 if end > start else 0.0)
    return out
