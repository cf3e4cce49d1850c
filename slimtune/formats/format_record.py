"""``slimtune_format.json``, the prompt format a checkpoint's training used: made and written by each save
(``checkpoint/extras.py``), read back by generate, chat and both GGUF exports. One module writes it and
reads it.

Example::

    write_format_record(path / FORMAT_NAME, new_format_record({"chat": 4}, None))
    read_format_record(path)["prompt_format"]  # "chat"
"""

from __future__ import annotations

import json
from pathlib import Path

from slimtune.formats.layout import CheckpointLayout
from slimtune.formats.strict_json import loads_json
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE, alpaca_prompt

FORMAT_VERSION = "slimtune-format/1"


# The prompt format each row shape trains (SFT shapes: data/shapes.py; preference pairs: data/pairs.py):
# conversations train the chat template, so a plain prompt is rendered with it at generation.
SHAPE_FORMATS = {
    "chat": "chat",
    "sharegpt": "chat",
    "completion": "chat",
    "conversational": "chat",  # preference pairs (or prompts) of messages (TRL's conversational form)
    "alpaca": "alpaca",
    "text": "text",
    "standard": "text",  # preference pairs of strings
}
_FORMAT_ORDER = ("chat", "alpaca", "text")  # several shapes in one run: the first of these any row trained


def prompt_format_of(shapes: dict[str, int]) -> str:
    """The prompt format that matches training data of these row shapes (counts per shape), for every
    objective: chat when any row was a conversation (SFT messages, ShareGPT, TRL completions, preference
    pairs in conversational form), else alpaca when any row was Alpaca, else text. What
    ``slimtune_format.json`` records and ``generate``, ``chat``, the training samples and the Modelfile follow.

    Example: ``prompt_format_of({"alpaca": 10}) == "alpaca"``; ``prompt_format_of({"conversational": 300}) == "chat"``"""
    trained = {SHAPE_FORMATS.get(shape, "text") for shape, n in shapes.items() if n}
    return next((f for f in _FORMAT_ORDER if f in trained), "text")


def new_format_record(shapes: dict[str, int], chat_template: str | None) -> dict:
    """What ``slimtune_format.json`` holds: the training data's shapes, the prompt format, the chat
    template training rendered conversations with, and the Alpaca prompt.

    Example: ``new_format_record({"chat": 4}, None)["prompt_format"] == "chat"``"""
    return {
        "format": FORMAT_VERSION,
        "prompt_format": prompt_format_of(shapes),
        "shapes": dict(shapes),
        "chat_template": chat_template or FALLBACK_CHAT_TEMPLATE,
        "alpaca_prompt": alpaca_prompt("{instruction}"),
    }


def write_format_record(path: Path, record: dict) -> None:
    """``record`` as the JSON file ``path`` (a save's staged copy; the save puts it under its manifest).
    Example: ``write_format_record(tmp / FORMAT_NAME, record)``"""
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def read_format_record(path: str | Path) -> dict:
    """``slimtune_format.json`` of the checkpoint at ``path`` (or of the directory above it, for its
    ``adapter/``); empty when there is none. The chat template training used is its ``chat_template``.

    Example: ``read_format_record("runs/x/step-10").get("chat_template")``"""
    candidate = CheckpointLayout(path).format_record
    if candidate is None:
        return {}
    record = loads_json(candidate.read_bytes(), str(candidate))
    return record if isinstance(record, dict) else {}
