"""Row shapes -> token ids: which shape a row has, how it renders (Alpaca template, chat template,
plain text) and which tokens are trained on (prompt tokens masked out of the loss with ``IGNORE_INDEX``).

Row shapes (``dataset.format=auto`` decides per row from its keys; ``dataset.columns`` renames a
file's columns to these keys first):

- alpaca:     ``{"instruction", "input"? , "output"}``; the prompt is the Alpaca template.
- chat:       ``{"messages": [{"role", "content"}, ...]}``; rendered with the tokenizer's chat
  template when it has one, else the plain ``<|role|>`` format of ``prompts.FALLBACK_CHAT_TEMPLATE``.
  Only assistant turns are trained on.
- sharegpt:   ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``; as chat.
- completion: ``{"prompt", "completion"}`` (TRL): strings (the completion is trained on), or lists of
  messages (the completion's messages are trained on).
- text:       ``{"text"}``; every token is trained on.

``dataset.train_on_inputs=true`` trains on every token (prompts and user turns too).

Example: ``example = tokenize(record, detect_format(record), tokenizer, max_seq_len=512)``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimtune.data.readers import Record
from slimtune.errors import SlimtuneError
from slimtune.prompts import alpaca_prompt

IGNORE_INDEX = -100


FORMATS = ("alpaca", "chat", "sharegpt", "completion", "text")


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


@dataclass
class Example:
    input_ids: torch.Tensor  # int32, 1-D
    labels: torch.Tensor  # int32, IGNORE_INDEX where the token is not trained on
    position_ids: torch.Tensor | None = None  # packed rows only: restarts at 0 at each document
    images: tuple = ()  # vision rows: where each image is (data/vision.py's ImageRef), decoded per batch


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
        return templated_segments(record, messages, trained, tokenizer)
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


def templated_segments(record: Record, messages: list[dict], trained: list[bool], tokenizer) -> list[tuple[str, bool]]:
    """Render growing prefixes of the conversation; what each trained turn adds is trained on. Needs a
    template whose renderings of prefixes are prefixes of each other (true of the common ones).
    ``tokenizer``: anything with ``apply_chat_template`` (a vision model's processor too).

    Example: ``templated_segments(record, messages, [False, True], tokenizer)`` -> [(prompt, False), (answer, True)]"""

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
