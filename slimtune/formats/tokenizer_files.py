"""The tokenizer files a GGUF export reads, checked by the rules of the libraries that read them next,
before anything is built from them: ``tokenizer.json`` as the ``tokenizers`` library parses it (its BPE
model's vocabulary and merges checked field by field here, for a message with the key path; every other
part handed to the library itself, and a part it refuses located by parsing it alone), and the chat
template as transformers compiles it (its sandboxed Jinja environment). Each failure is one
``SlimtuneError`` line naming the file, the key path inside it and what was expected.

Example::

    spec = load_json(path, expect=dict)
    check_tokenizer_json(spec, path, n_vocab=49152)   # SlimtuneError("tokenizer.json: model.merges[3]: ...")
    check_chat_template(template, "slimtune_format.json: chat_template")
"""

from __future__ import annotations

import json
from pathlib import Path

from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.strict_json import json_kind, safe_repr

_U32 = 2**32
# the parts of tokenizer.json besides the model, each parsed by the tokenizers library on its own to say
# which one it refuses; a Sequence's items under these keys
_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding")
_SEQUENCE_ITEMS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers", "post_processor": "processors", "decoder": "decoders"}
_EMPTY_MODEL = {"type": "BPE", "vocab": {}, "merges": []}


def check_tokenizer_json(spec: dict, path: Path, n_vocab: int) -> None:
    """``spec`` (tokenizer.json's object) is a BPE tokenizer the tokenizers library loads, whose ids all
    lie below ``n_vocab`` (the embedding's rows) and name one token each."""
    model = spec.get("model")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise SlimtuneError(f"{path}: model.vocab must be an object of token -> id, found {json_kind(vocab)}")
    if not vocab:
        raise SlimtuneError(f"{path}: model.vocab is empty; a GGUF vocabulary needs tokens")
    by_id: dict[int, str] = {}
    for token, i in vocab.items():
        _check_id(i, f"{path}: model.vocab[{safe_repr(token, 60)}]", n_vocab)
        if i in by_id:
            raise SlimtuneError(
                f"{path}: model.vocab: tokens {safe_repr(by_id[i], 40)} and {safe_repr(token, 40)} both have id {i}; "
                "each id names one token"
            )
        by_id[i] = token
    _check_merges(model.get("merges", []), vocab, path)
    added = spec.get("added_tokens", [])
    if not isinstance(added, list):
        raise SlimtuneError(f"{path}: added_tokens must be a list of objects, found {json_kind(added)}")
    for k, entry in enumerate(added):
        where = f"{path}: added_tokens[{k}]"
        if not isinstance(entry, dict):
            raise SlimtuneError(f"{where}: expected an object with id and content, found {json_kind(entry)}")
        if not isinstance(entry.get("content"), str) or not entry["content"]:
            raise SlimtuneError(f"{where}.content: expected a non-empty string, found {json_kind(entry.get('content'))}")
        _check_id(entry.get("id"), f"{where}.id", n_vocab)
    _check_with_library(spec, path)


def _check_id(i: object, where: str, n_vocab: int) -> None:
    if type(i) is not int or not 0 <= i < _U32:
        raise SlimtuneError(
            f"{where}: expected a token id, an integer in [0, 2**32), found {safe_repr(i, 40) if isinstance(i, str) else i!r}"
        )
    if i >= n_vocab:
        raise SlimtuneError(f"{where}: token id {i} is outside the model's vocab_size {n_vocab} (the embedding's rows)")


def _check_merges(merges: object, vocab: dict, path: Path) -> None:
    """As the tokenizers library reads BPE merges: a list of "a b" strings (one space) or [a, b] pairs,
    both halves and their concatenation tokens of the vocabulary."""
    if not isinstance(merges, list):
        raise SlimtuneError(f'{path}: model.merges must be a list of "a b" strings or [a, b] pairs, found {json_kind(merges)}')
    for k, merge in enumerate(merges):
        where = f"{path}: model.merges[{k}]"
        if isinstance(merge, str):
            pair = merge.split(" ")
            if len(pair) != 2:
                raise SlimtuneError(f'{where}: {safe_repr(merge, 60)} must be two tokens separated by one space ("a b")')
        elif isinstance(merge, list) and len(merge) == 2 and all(isinstance(p, str) for p in merge):
            pair = merge
        else:
            raise SlimtuneError(f'{where}: expected a string "a b" or a pair [a, b] of strings, found {json_kind(merge)}')
        for token in (*pair, pair[0] + pair[1]):
            if token not in vocab:
                raise SlimtuneError(f"{where}: token {safe_repr(token, 60)} is not in model.vocab")


def _check_with_library(spec: dict, path: Path) -> None:
    """The tokenizers library parses the whole file (``path``, which ``spec`` was read from: read again by
    the library, not written out of ``spec`` and parsed); what it refuses is named by the part (and the
    item of a Sequence) it refuses when parsed alone."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
        return
    except Exception as e:  # noqa: BLE001 - the library raises plain Exception for every refusal
        whole = first_line(e)
    for part in _PARTS:
        value = spec.get(part)
        if value is None or _parses({part: value}):
            continue
        items = value.get(_SEQUENCE_ITEMS.get(part, "")) if isinstance(value, dict) and value.get("type") == "Sequence" else None
        for k, item in enumerate(items if isinstance(items, list) else []):
            if not _parses({part: item}):
                raise SlimtuneError(f"{path}: {part}.{_SEQUENCE_ITEMS[part]}[{k}]: {_refusal({part: item}, part, item)}")
        raise SlimtuneError(f"{path}: {part}: {_refusal({part: value}, part, value)}")
    raise SlimtuneError(f"{path}: the tokenizers library cannot load it: {whole}")


def _minimal(parts: dict) -> str:
    return json.dumps({"version": "1.0", "added_tokens": [], "model": _EMPTY_MODEL, **parts})


def _parses(parts: dict) -> bool:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(_minimal(parts))
        return True
    except Exception:  # noqa: BLE001 - see _check_with_library
        return False


def _refusal(parts: dict, part: str, value: object) -> str:
    from tokenizers import Tokenizer

    kind = value.get("type") if isinstance(value, dict) else None
    what = f"type {safe_repr(kind, 40)}" if isinstance(kind, str) else json_kind(value)
    try:
        Tokenizer.from_str(_minimal(parts))
        detail = ""
    except Exception as e:  # noqa: BLE001 - see _check_with_library
        detail = first_line(e)
    return f"{what} is not a {part.replace('_', '-')} the tokenizers library reads ({detail})"


def check_chat_template(template: object, where: str) -> str:
    """``template`` compiles in transformers' sandboxed Jinja environment (what ``apply_chat_template``
    renders with). Returns it; a syntax error is one line with its line number."""
    if not isinstance(template, str):
        raise SlimtuneError(f"{where}: expected a string (a Jinja template), found {json_kind(template)}")
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise SlimtuneError(f"{where}: Jinja syntax error on line {e.lineno}: {first_line(e)}") from None
    except (jinja2.TemplateError, ValueError, TypeError, RecursionError) as e:
        raise SlimtuneError(f"{where}: the chat template does not compile: {first_line(e)}") from None
    return template
