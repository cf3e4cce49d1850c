"""The tokenizer half of a GGUF export: the ``tokenizer.*`` metadata llama.cpp reads, and the Ollama
Modelfile written beside the GGUF.

Two vocabulary kinds, as llama.cpp's converter writes them:

- ``gpt2``: byte-level BPE (Llama 3, Qwen, SmolLM, GPT-2/NeoX, OLMo): tokens, token types, merges, and the
  pre-tokenizer name llama.cpp identifies by the sha256 of the tokenizer's ids on a fixed text
  (``gguf_pretokenizers``). A pre-tokenizer llama.cpp does not know is an error, never a wrong file.
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1, Gemma) from its ``tokenizer.json``:
  tokens, scores (a token's score is minus the rank of the merge that makes it, so llama.cpp's
  highest-score-first merging takes the merges in Hugging Face's order), token types, ``add_space_prefix``.
  Known difference, which no GGUF setting removes: transformers 5's LlamaTokenizer class (Llama 2, Mistral
  v0.1) puts SentencePiece's space prefix only before the start of the input, and not before a leading
  space; llama.cpp (like SentencePiece) also puts it after every special token and before a leading space.

Special-token ids come from ``gguf.SpecialVocab``; the add-bos/eos flags from what the tokenizer does; the
chat template from the checkpoint (what training rendered conversations with: ``formats.format_record.read_format_record``).

``write_modelfile`` writes Ollama's ``Modelfile``: the chat template translated to a Go template where it
wraps each message alike (ChatML, Llama 3 style, slimtune's fallback), checked by rendering both."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
from gguf import GGUFValueType, Keys, TokenType

from slimtune.errors import SlimtuneError, first_line
from slimtune.fileio import atomic_file
from slimtune.formats.strict_json import json_kind, load_json
from slimtune.formats.tokenizer_files import check_chat_template, check_tokenizer_json
from slimtune.gguf.pretokenizers import CHECK_TEXT, PRE_TOKENIZER_BY_HASH

Field = tuple[str, object, "GGUFValueType | None"]

TOKENIZER_JSON_BYTES = 256 * 1024 * 1024  # Gemma 3's is 33 MB
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE = "\u2581"  # SentencePiece's visible space
_BPE_SPACE = "\u0120"  # a space in a byte-level BPE merge's half, as gguf writes it
_INERT_MERGE = "\u0120\u0120 \u0120\u0120"  # two-character halves: never adjacent symbols when no merge exists


def vocab_fields(model_dir: str | Path, hf_config, chat_template: str | None) -> list[Field]:
    """The GGUF ``tokenizer.*`` key/value pairs for the tokenizer in ``model_dir`` (``tokenizer.json`` and
    its config files), sized to ``hf_config``'s vocabulary, with ``chat_template`` (the one training used;
    None: the tokenizer's own, if any). Each item is (key, value, GGUF value type) for
    ``GGUFWriter.add_key_value``. A tokenizer llama.cpp cannot reproduce is one ``SlimtuneError`` line.

    Example: ``for key, value, vtype in vocab_fields(ckpt, config, template): writer.add_key_value(key, value, vtype)``"""
    model_dir = Path(model_dir)
    if chat_template is not None and not isinstance(chat_template, str):
        raise SlimtuneError(f"chat_template: expected a string, found {json_kind(chat_template)}")
    path = model_dir / "tokenizer.json"
    spec = load_json(path, expect=dict, max_bytes=TOKENIZER_JSON_BYTES, what="the tokenizer")
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        found = model.get("type") if isinstance(model, dict) else json_kind(model)
        raise SlimtuneError(f"{path}: model.type {found!r} cannot be exported to GGUF (BPE or SentencePiece BPE expected)")
    n_vocab = _config_vocab_size(hf_config, path)
    check_tokenizer_json(spec, path, n_vocab)
    _check_tokenizer_configs(model_dir)
    tokenizer = _load_tokenizer(model_dir)
    _check_ids_below(tokenizer, n_vocab, path)
    special = _special_vocab(model_dir, n_vocab)
    if model.get("byte_fallback") is True:
        fields = _sentencepiece_fields(tokenizer, model, n_vocab)
    else:
        merges = _gguf_merges(model.get("merges", []))
        # Without merges every token is one byte however the text is split: any pre-tokenizer gives the
        # same ids. llama.cpp needs a merges array all the same; one that can never apply stands in.
        pre = _pre_tokenizer_name(tokenizer, spec, path) if merges else "gpt-2"
        fields = _byte_level_fields(tokenizer, n_vocab, pre)
        fields.append((Keys.Tokenizer.MERGES, merges or [_INERT_MERGE], GGUFValueType.ARRAY))
    added = _added_special_tokens(tokenizer)
    _check_as_llama_cpp_loads(fields, special, added, path)
    fields += _special_fields(special, added)
    template = chat_template if chat_template else special.chat_template
    if template:
        where = "slimtune_format.json: chat_template" if chat_template else f"{model_dir / 'tokenizer_config.json'}: chat_template"
        check_chat_template(template, where)
        fields.append((Keys.Tokenizer.CHAT_TEMPLATE, template, GGUFValueType.STRING))
    return fields


def pre_tokenizer_name(model_dir: str | Path) -> str:
    """The name llama.cpp gives the byte-level BPE pre-tokenizer of the tokenizer in ``model_dir``.

    Example: ``pre_tokenizer_name(".cache/real-model/SmolLM2-135M-Instruct") == "smollm"``"""
    path = Path(model_dir) / "tokenizer.json"
    spec = load_json(path, expect=dict, max_bytes=TOKENIZER_JSON_BYTES, what="the tokenizer")
    return _pre_tokenizer_name(_load_tokenizer(Path(model_dir)), spec, path)


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer  # heavy: loaded only when a GGUF is written

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        tokenizer.decode(tokenizer.encode("a b", add_special_tokens=True))  # settings read only when used (model_max_length)
        return tokenizer
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers refuse with many types (tokenizers: plain Exception)
        raise SlimtuneError(f"{model_dir}: the tokenizer does not load in transformers: {first_line(e)}") from None


def _config_vocab_size(hf_config, path: Path) -> int:
    """The embedding's row count (the GGUF vocabulary is padded to it)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    n_vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(n_vocab, int) or isinstance(n_vocab, bool) or n_vocab <= 0:
        raise SlimtuneError(f"{path}: the model config has no positive integer vocab_size (found {n_vocab!r})")
    return n_vocab


def _check_ids_below(tokenizer, n_vocab: int, path: Path) -> None:
    """Every token id of the loaded tokenizer (its added tokens included) is below the embedding's rows."""
    top = max(tokenizer.get_vocab().values(), default=-1)
    if top >= n_vocab:
        raise SlimtuneError(f"{path}: token id {top} is outside the model's vocab_size {n_vocab}")


_TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _check_tokenizer_configs(model_dir: Path) -> None:
    """The tokenizer's JSON side files transformers and gguf read, each an object as they expect."""
    for name in _TOKENIZER_CONFIGS:
        if (model_dir / name).exists():
            load_json(model_dir / name, expect=dict, what="the tokenizer's config")


def _pre_tokenizer_name(tokenizer, spec: dict, path: Path) -> str:
    """llama.cpp's identification: sha256 of ``str(tokenizer.encode(CHECK_TEXT))`` looked up in its table."""
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    name = PRE_TOKENIZER_BY_HASH.get(digest)
    if name is None:
        raise SlimtuneError(
            f"{path}: pre-tokenizer {_describe_pre_tokenizer(spec)} is not one llama.cpp knows "
            f"(check-text sha256 {digest}); its GGUF would tokenize differently"
        )
    return name


def _describe_pre_tokenizer(spec: dict) -> str:
    pre = spec.get("pre_tokenizer")
    if not isinstance(pre, dict):
        return json_kind(pre) if pre is not None else "none"
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    names = [p.get("type", "?") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
    options = "".join(f"({k}={pre[k]})" for k in ("use_regex", "add_prefix_space") if k in pre)
    return f"{pre.get('type', '?')}{options}" + (f"[{', '.join(names)}]" if pre.get("type") == "Sequence" else "")


def _added_token(tokenizer, decoder: dict, token_id: int, token: str, byte_level: bool) -> tuple[str, TokenType]:
    """An added token as llama.cpp matches it, and its type, as the converter writes them: CONTROL when
    special (or looking special), else USER_DEFINED with SentencePiece's spaces as spaces; in a byte-level
    vocabulary pre-normalized (encoded and decoded back) when the tokenizer does not normalize it."""
    added = decoder[token_id]
    if byte_level and not added.normalized:
        token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
    if added.special or _looks_special(token):
        return token, TokenType.CONTROL
    return token.replace(_SPACE, " "), TokenType.USER_DEFINED


def _looks_special(token: str) -> bool:
    """Added tokens llama.cpp's converter makes control tokens although the tokenizer does not mark them special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _byte_level_fields(tokenizer, n_vocab: int, pre: str) -> list[Field]:
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    decoder = tokenizer.added_tokens_decoder  # built anew on each access: once here
    tokens, types = [], []
    for i in range(n_vocab):
        token = reverse.get(i)
        kind = TokenType.NORMAL
        if token is None:
            token, kind = f"[PAD{i}]", TokenType.UNUSED
        elif i in decoder:
            token, kind = _added_token(tokenizer, decoder, i, token, byte_level=True)
        tokens.append(token)
        types.append(int(kind))
    return [
        (Keys.Tokenizer.MODEL, "gpt2", GGUFValueType.STRING),
        (Keys.Tokenizer.PRE, pre, GGUFValueType.STRING),
        (Keys.Tokenizer.LIST, tokens, GGUFValueType.ARRAY),
        (Keys.Tokenizer.TOKEN_TYPE, types, GGUFValueType.ARRAY),
    ]


def _merge_scores(model: dict) -> dict[str, float]:
    """Minus the rank of the first merge that makes each token (Hugging Face merges lowest rank first)."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(model.get("merges") or []):
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair):
            scores.setdefault(pair[0] + pair[1], -float(rank))
    return scores


def _sentencepiece_fields(tokenizer, model: dict, n_vocab: int) -> list[Field]:
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    decoder = tokenizer.added_tokens_decoder  # built anew on each access: once here
    scores_by_token = _merge_scores(model)
    floor = -float(len(scores_by_token) + 1)  # below every merge: single characters are never merged into
    tokens, scores, types = [], [], []
    for i in range(n_vocab):
        token = reverse.get(i)
        score, kind = -1000.0, TokenType.NORMAL
        if token is None:
            token, kind = f"[PAD{i}]", TokenType.UNUSED
        elif token == model.get("unk_token"):
            score, kind = 0.0, TokenType.UNKNOWN
        elif i in decoder:
            token, kind = _added_token(tokenizer, decoder, i, token, byte_level=False)
        elif _BYTE_TOKEN.fullmatch(token):
            score, kind = 0.0, TokenType.BYTE
        else:
            score = scores_by_token.get(token, floor)
        tokens.append(token)
        scores.append(score)
        types.append(int(kind))
    return [
        (Keys.Tokenizer.MODEL, "llama", GGUFValueType.STRING),
        (Keys.Tokenizer.PRE, "default", GGUFValueType.STRING),
        (Keys.Tokenizer.LIST, tokens, GGUFValueType.ARRAY),
        (Keys.Tokenizer.SCORES, scores, GGUFValueType.ARRAY),
        (Keys.Tokenizer.TOKEN_TYPE, types, GGUFValueType.ARRAY),
        (Keys.Tokenizer.ADD_PREFIX, _adds_space_prefix(tokenizer), GGUFValueType.BOOL),
    ]


def _adds_space_prefix(tokenizer) -> bool:
    """Whether the tokenizer puts SentencePiece's space before the text (Llama 2 does, Gemma does not)."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
    return bool(pieces) and pieces[0].startswith(_SPACE)


def _gguf_merges(merges: list) -> list[str]:
    """tokenizer.json's ``model.merges`` (checked by ``check_tokenizer_json``) as the converter writes them
    (``gguf.SpecialVocab``'s reading): "a b" strings; a pair [a, b] joined by a space, a space inside a
    half written as U+0120 (the byte-level alphabet's space). Taken from the tokenizer.json already parsed,
    not parsed again by gguf, and pair by pair (gguf's reading follows the first item's form)."""
    return [m if isinstance(m, str) else f"{m[0].replace(' ', _BPE_SPACE)} {m[1].replace(' ', _BPE_SPACE)}" for m in merges]


def _special_vocab(model_dir: Path, n_vocab: int) -> gguf.SpecialVocab:
    """gguf's reading of the special-token ids and add-token flags; its errors as one line."""
    try:
        return gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=n_vocab)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OSError) as e:
        first = first_line(e)
        raise SlimtuneError(f"{model_dir}: the tokenizer's special tokens or merges are not readable: {first}") from None


def _added_special_tokens(tokenizer) -> dict[str, bool]:
    """Whether encoding adds BOS and EOS, as the tokenizer does it (llama.cpp's default depends on the
    pre-tokenizer, so both flags are always written)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    start = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), None)
    if start is None:
        return {}
    prefix, suffix = full[:start], full[start + len(plain) :]
    return {
        "bos": tokenizer.bos_token_id is not None and prefix == [tokenizer.bos_token_id],
        "eos": tokenizer.eos_token_id is not None and suffix == [tokenizer.eos_token_id],
    }


def _check_as_llama_cpp_loads(fields: list[Field], special: gguf.SpecialVocab, added: dict[str, bool], path: Path) -> None:
    """What llama.cpp's vocabulary loader (llama-vocab.cpp) aborts on, refused first: a token text written
    twice (it asserts one id per text; an empty text becomes ``[EMPTY_i]``), and BOS/EOS added by the
    tokenizer without an id for them (it asserts the id when it adds one)."""
    tokens = next(v for k, v, _ in fields if k == Keys.Tokenizer.LIST)
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        text = token or f"[EMPTY_{i}]"
        if text in seen:
            raise SlimtuneError(
                f"{path}: tokens {seen[text]} and {i} would both be {text!r} in the GGUF vocabulary (as llama.cpp matches them); "
                "llama.cpp aborts on a repeated token"
            )
        seen[text] = i
    for kind in ("bos", "eos"):
        if added.get(kind) and kind not in special.special_token_ids:
            raise SlimtuneError(f"{path}: the tokenizer adds {kind.upper()} but its {kind}_token has no id llama.cpp can be told")


def _special_fields(special: gguf.SpecialVocab, added: dict[str, bool]) -> list[Field]:
    fields: list[Field] = []
    for kind, token_id in special.special_token_ids.items():
        key = getattr(Keys.Tokenizer, f"{kind.upper()}_ID", None)
        if key is not None:
            fields.append((key, token_id, GGUFValueType.UINT32))
    for kind, flag in {**special.add_special_token, **added}.items():
        key = getattr(Keys.Tokenizer, f"ADD_{kind.upper()}", None)
        if key is not None:
            fields.append((key, bool(flag), GGUFValueType.BOOL))
    return fields


# --- Ollama Modelfile ---------------------------------------------------------------------------------

_MARK = "\x02{}\x03"  # message contents the chat template is rendered with, to find what it puts around them


@dataclass(frozen=True)
class _Turns:
    """A chat template that wraps each message alike: ``lead`` once, then per message ``prefix[role]``,
    the content and ``suffix``; then ``generation`` (the assistant's opening). ``default_system`` is the
    system message the template inserts when a conversation has none. A template without a system role
    (Gemma's) has no ``prefix["system"]``."""

    lead: str
    prefix: dict[str, str]
    suffix: str
    generation: str
    default_system: str | None = None

    def render(self, messages: list[dict[str, str]], system: str | None = None) -> str:
        if messages[0]["role"] != "system" and system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        body = "".join(self.prefix[m["role"]] + m["content"] + self.suffix for m in messages if m["role"] in self.prefix)
        return self.lead + body + self.generation

    def go_template(self) -> str:
        """The same in Ollama's Go template language (``.Messages``: each with ``.Role`` and ``.Content``)."""
        body = f"{{{{ .Content }}}}{self.suffix}"
        branches = "{{ else if".join(f' eq .Role "{role}" }}}}{prefix}{body}' for role, prefix in self.prefix.items())
        return f"{self.lead}{{{{ range .Messages }}}}{{{{ if{branches}{{{{ end }}}}{{{{ end }}}}{self.generation}"


def write_modelfile(
    gguf_path: str | Path,
    model_dir: str | Path,
    chat_template: str | None,
    system_prompt: str | None = None,
    base_gguf: str | None = None,
    projector: Path | None = None,
) -> Path:
    """Write ``Modelfile`` beside ``gguf_path`` for ``ollama create NAME -f Modelfile``: ``FROM`` the GGUF,
    ``TEMPLATE`` (the chat template translated to Go where it wraps each message alike, checked by
    rendering both), ``PARAMETER stop`` for the template's end-of-turn token and EOS, and ``SYSTEM``
    (``system_prompt``, else the system message the template inserts by default). Atomic. Returns its path.
    With ``base_gguf``, ``gguf_path`` is a LoRA adapter: ``FROM base_gguf`` and ``ADAPTER ./gguf_path``. With
    ``projector`` (a vision-language model's mmproj file beside it), a second ``FROM`` names it, as Ollama
    takes a vision model's projector.

    Example: ``write_modelfile(out / "model-q8_0.gguf", ckpt, template)  # -> out/Modelfile``"""
    gguf_path = Path(gguf_path)
    tokenizer = _load_tokenizer(Path(model_dir))
    turns = _turns(tokenizer, chat_template) if chat_template else None
    lines = [f"FROM ./{gguf_path.name}"] if base_gguf is None else [f"FROM {modelfile_path(base_gguf)}", f"ADAPTER ./{gguf_path.name}"]
    lines += [] if projector is None else [f"FROM ./{Path(projector).name}"]
    if turns is not None:
        lines.append(f'TEMPLATE """{_triple_quoted(turns.go_template(), "TEMPLATE")}"""')
    elif chat_template:
        lines.append("# no TEMPLATE: the chat template does not wrap each message alike; the GGUF carries it (tokenizer.chat_template)")
    stops = [turns.suffix.strip()] if turns is not None and turns.suffix.strip() else []
    stops += [t for t in [getattr(tokenizer, "eos_token", None)] if t and t not in stops]
    lines += [f"PARAMETER stop {json.dumps(s, ensure_ascii=False)}" for s in stops]
    system = system_prompt if system_prompt is not None else (turns.default_system if turns else None)
    if system and turns is not None and "system" not in turns.prefix:
        raise SlimtuneError("Modelfile SYSTEM: the chat template has no system role, so Ollama would drop the system prompt")
    if system:
        lines.append(f'SYSTEM """{_triple_quoted(system, "SYSTEM")}"""')
    target = gguf_path.with_name("Modelfile")
    with atomic_file(target) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


def modelfile_path(path: str) -> str:
    """A Modelfile ``FROM``: a relative path as Ollama reads one (``./`` first); absolute paths and model
    names as given; a line break is one error line (callers check it before writing anything).
    Example: ``modelfile_path("model-f16.gguf") == "./model-f16.gguf"``"""
    if "\n" in path or "\r" in path:
        raise SlimtuneError(f"Modelfile FROM {path!r}: a line break cannot be in a Modelfile line")
    return path if path.startswith(("/", "./", "../")) or "/" not in path and not path.endswith(".gguf") else f"./{path}"


def _triple_quoted(text: str, what: str) -> str:
    if '"""' in text:
        raise SlimtuneError(f'Modelfile {what}: contains """, which a Modelfile cannot quote')
    return text


def _turns(tokenizer, template: str) -> _Turns | None:
    """The per-message wrapping of ``template`` (with a system role, else without one), found by rendering
    conversations with marked contents, and kept only if it renders several conversations exactly as the
    Jinja template does. BOS is left to llama.cpp where the tokenizer adds it itself."""
    for roles in (("system", "user", "assistant", "user"), ("user", "assistant", "user")):
        turns = _wrapping(tokenizer, template, roles)
        if turns is not None and "system" in turns.prefix:
            turns = _with_default_system(tokenizer, template, turns)
        if turns is not None and _renders_alike(tokenizer, template, turns):
            return replace(turns, lead="") if turns.lead and _added_special_tokens(tokenizer).get("bos") else turns
    return None


def _wrapping(tokenizer, template: str, roles: tuple[str, ...]) -> _Turns | None:
    """Prefixes, suffix and lead read off one rendered conversation of ``roles`` (the text after each
    message is the suffix, then the next message's prefix; a system prefix is the user's, renamed)."""
    conversation = [_msg(role, f"M{i}") for i, role in enumerate(roles)]
    rendered = _render(tokenizer, template, conversation, True)
    closed = _render(tokenizer, template, conversation, False)
    if rendered is None or closed is None or not rendered.startswith(closed):
        return None
    head, *between, suffix = re.split("\x02M[0-9]\x03", closed)
    if len(between) != len(roles) - 1 or "{{" in closed + rendered or any(not b.startswith(suffix) for b in between):
        return None
    prefix: dict[str, str] = {}
    for role, text in zip(roles[1:], between, strict=True):
        if prefix.setdefault(role, text[len(suffix) :]) != text[len(suffix) :]:
            return None
    if roles[0] == "system":
        if "user" not in prefix["user"]:
            return None
        prefix = {"system": prefix["user"].replace("user", "system"), **prefix}
    if not head.endswith(prefix[roles[0]]) or head[: len(head) - len(prefix[roles[0]])] not in ("", tokenizer.bos_token):
        return None
    return _Turns(head[: len(head) - len(prefix[roles[0]])], prefix, suffix, rendered[len(closed) :])


def _with_default_system(tokenizer, template: str, turns: _Turns) -> _Turns | None:
    """The system message the template inserts into a conversation without one (SmolLM2's does)."""
    alone = _render(tokenizer, template, [_msg("user", "M0")], False)
    plain = turns.prefix["user"] + _MARK.format("M0") + turns.suffix
    if alone is None or alone == turns.lead + plain:
        return turns
    start, end = turns.lead + turns.prefix["system"], turns.suffix + plain
    if not (alone.startswith(start) and alone.endswith(end)) or len(alone) < len(start) + len(end):
        return None
    return replace(turns, default_system=alone[len(start) : len(alone) - len(end)])


def _renders_alike(tokenizer, template: str, turns: _Turns) -> bool:
    conversations = [
        [_msg("user", "Hi there")],
        [_msg("user", "Q1"), _msg("assistant", "R1"), _msg("user", "Q2 {{ x }}")],
    ]
    if "system" in turns.prefix:
        conversations.append([_msg("system", "Be brief."), _msg("user", "Q1"), _msg("assistant", "R1"), _msg("user", "Q2")])
    for conversation in conversations:
        want = _render(tokenizer, template, conversation, True)
        if want is None or want != turns.render(conversation, turns.default_system):
            return False
    return True


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": _MARK.format(content) if re.fullmatch("M[0-9]", content) else content}


def _render(tokenizer, template: str, messages: list[dict[str, str]], generation: bool) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=generation)
    except Exception:  # noqa: BLE001 - a template that rejects a conversation is one this cannot translate
        return None
