"""GGUF tokenizer metadata, with llama.cpp as the oracle: a GGUF holding only ``vocab_fields``' metadata
(plus the few architecture keys llama.cpp needs to open it) is loaded vocab-only by llama.cpp, whose
token ids for a mixed corpus (text, code, non-ASCII, special tokens, leading spaces, the rendered chat
template) must equal the Hugging Face tokenizer's."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from slimtune.data import FALLBACK_CHAT_TEMPLATE
from slimtune.errors import SlimtuneError
from slimtune.gguf import pretokenizers as gguf_pretokenizers
from slimtune.gguf import vocab as gguf_vocab
from slimtune.gguf.vocab import pre_tokenizer_name, vocab_fields, write_modelfile
from slimtune.tiny import byte_tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extras: pip install -e '.[dev]'")

CORPUS = [
    "Hello world",
    " Hello world, with a leading space",
    "   three leading spaces\tand a tab",
    "\n\nblank lines\n \n  \n end",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # π r²\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "naïve café — Grüße, ¿qué tal? Привет мир 日本語のテキスト 한국어 🦙🚀 (emoji) 😶\u200d🌫️",
    "numbers 1 12 123 1234 12345 3.5e-9 0x1F 1,000,000",
    "it's I'll we've they'RE ''' ``` \"\"\" ... !!! ???",
    "trailing spaces   ",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": " Hi! What's 2+2?\n```py\nprint(2+2)\n```"},
    {"role": "assistant", "content": "4 — vier, 四."},
    {"role": "user", "content": "Danke 🙂"},
]


def _vocab_gguf(path: Path, fields, n_vocab: int) -> Path:
    """A GGUF with the tokenizer metadata and just enough of a (weightless) llama architecture to open."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    for key, value, vtype in fields:
        w.add_key_value(key, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _check_with_llama_cpp(model_dir: Path, tmp_path: Path, n_vocab: int, chat_template: str | None = None) -> dict:
    """Export the vocabulary, load it in llama.cpp and compare token ids with Hugging Face's on CORPUS,
    the special tokens between text, and the rendered chat template. Returns the fields as a dict."""
    fields = vocab_fields(model_dir, SimpleNamespace(vocab_size=n_vocab), chat_template)
    assert len({k for k, _, _ in fields}) == len(fields)
    path = _vocab_gguf(tmp_path / "vocab.gguf", fields, n_vocab)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    specials = [t for t in (tok.bos_token, tok.eos_token) if t]
    texts = CORPUS + [f"{s}inside{s} after {s}\n{s}" for s in specials] + [" ".join(specials) + " x"]
    for text in texts:
        for add_special in (False, True):
            want = tok.encode(text, add_special_tokens=add_special)
            got = llm.tokenize(text.encode(), add_bos=add_special, special=True)
            assert got == want, (text, add_special)
    template = chat_template or tok.chat_template
    rendered = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    want = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == want
    return {k: v for k, v, _ in fields}


def _smollm2_tokenizer(tmp_path: Path, smollm2_dir: Path) -> Path:
    out = tmp_path / "smollm2-tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.mark.real_model
def test_smollm2_bpe_matches_llama_cpp(tmp_path, smollm2_dir):
    model_dir = _smollm2_tokenizer(tmp_path, smollm2_dir)
    fields = _check_with_llama_cpp(model_dir, tmp_path, 49152)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smollm"
    assert len(fields["tokenizer.ggml.tokens"]) == 49152 and fields["tokenizer.ggml.merges"]
    assert fields["tokenizer.chat_template"] == (smollm2_dir / "chat_template.jinja").read_text()
    # the training template (the checkpoint's record) wins over the tokenizer's own
    trained = vocab_fields(model_dir, SimpleNamespace(vocab_size=49152), "{{ x }}")
    assert trained[-1] == ("tokenizer.chat_template", "{{ x }}", gguf.GGUFValueType.STRING)


# Pre-tokenizers as Llama 3 and Qwen2 ship them in tokenizer.json (llama.cpp's "llama-bpe" and "qwen2").
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _split_then_bytes(pattern: str) -> dict:
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL]}


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("name", "pre_tokenizer"),
    [("gpt-2", None), ("llama-bpe", _split_then_bytes(_LLAMA3_SPLIT)), ("qwen2", _split_then_bytes(_QWEN2_SPLIT))],
)
def test_bpe_pre_tokenizers_match_llama_cpp(tmp_path, smollm2_dir, monkeypatch, name, pre_tokenizer):
    """GPT-2's, Llama 3's and Qwen2's splitting on SmolLM2's vocabulary. llama.cpp's table knows each
    by the ids of that model's own vocabulary (not available offline), so the table is given this
    vocabulary's hash for the name; llama.cpp's splitting of that name must then give the same ids."""
    model_dir = _smollm2_tokenizer(tmp_path, smollm2_dir)
    if pre_tokenizer is not None:
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        spec["pre_tokenizer"] = pre_tokenizer
        (model_dir / "tokenizer.json").write_text(json.dumps(spec))
        with pytest.raises(SlimtuneError, match=r"pre-tokenizer Sequence\[Split, ByteLevel\] is not one llama.cpp knows"):
            pre_tokenizer_name(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    digest = hashlib.sha256(str(tok.encode(gguf_pretokenizers.CHECK_TEXT)).encode()).hexdigest()
    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZER_BY_HASH, digest, name)
    assert _check_with_llama_cpp(model_dir, tmp_path, 49152)["tokenizer.ggml.pre"] == name


@pytest.mark.real_model
def test_smollm2_fields_equal_llama_cpp_converters(smollm2_dir, smollm2_gguf):
    """The published SmolLM2 GGUF was written by llama.cpp's own converter: every tokenizer key it has is
    the same here (add_space_prefix=False, which it writes, is llama.cpp's default for BPE; add_eos_token,
    written here, is False as llama.cpp's default is)."""
    reader = gguf.GGUFReader(smollm2_gguf)
    theirs = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    ours = {k: v for k, v, _ in vocab_fields(smollm2_dir, SimpleNamespace(vocab_size=49152), None)}
    assert theirs.pop("tokenizer.ggml.add_space_prefix") is False and ours.pop("tokenizer.ggml.add_eos_token") is False
    assert sorted(ours) == sorted(theirs) and len(theirs) == 11
    assert {k: v for k, v in ours.items() if v != theirs[k]} == {}


@pytest.mark.parametrize(
    "merges", [["a b", "ab c"], [["a", "b"], ["ab", "c"]], [["a b", "c"], [" ", "x y"]]], ids=["strings", "pairs", "spaces"]
)
def test_merges_read_as_gguf_reads_them(tmp_path, merges):
    """The merges taken from the tokenizer.json already parsed are gguf.SpecialVocab's reading of that
    file (a space inside a pair's half as U+0120), in either form tokenizers accepts."""
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": merges}}))
    assert gguf_vocab._gguf_merges(merges) == gguf.SpecialVocab(tmp_path, load_merges=True).merges


@pytest.mark.real_model
def test_unknown_pre_tokenizer_is_one_line(tmp_path, smollm2_dir):
    model_dir = _smollm2_tokenizer(tmp_path, smollm2_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, _BYTE_LEVEL]}
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(SlimtuneError) as e:
        vocab_fields(model_dir, SimpleNamespace(vocab_size=49152), None)
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer.json" in msg and "Sequence[WhitespaceSplit, ByteLevel]" in msg
    assert "not one llama.cpp knows" in msg


def test_byte_tokenizer_without_merges_matches_llama_cpp(tmp_path):
    """slimtune's tiny byte-level tokenizer (no merges): every pre-tokenizer gives the same ids."""
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    fields = _check_with_llama_cpp(tmp_path / "tok", tmp_path, 259, FALLBACK_CHAT_TEMPLATE)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"


def _sentencepiece_bpe(out: Path, prefix_space: bool) -> Path:
    """A SentencePiece-style BPE tokenizer with byte fallback, as Llama 2 / Mistral (``prefix_space``) and
    Gemma (none) ship it in tokenizer.json, trained here on a small corpus."""
    corpus = [t for t in CORPUS if t] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("\u2581")] if prefix_space else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return out


@pytest.mark.parametrize("prefix_space", [True, False], ids=["llama2", "gemma"])
def test_sentencepiece_bpe_matches_llama_cpp(tmp_path, prefix_space):
    model_dir = _sentencepiece_bpe(tmp_path / "tok", prefix_space)
    n_vocab = len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]) + 5  # padded rows
    fields = _check_with_llama_cpp(model_dir, tmp_path, n_vocab, FALLBACK_CHAT_TEMPLATE)
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    assert fields["tokenizer.ggml.add_space_prefix"] is prefix_space
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.bos_token_id"] == 1
    types = fields["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == gguf.TokenType.CONTROL and types[3] == gguf.TokenType.BYTE
    assert types[-1] == gguf.TokenType.UNUSED and fields["tokenizer.ggml.tokens"][-1] == f"[PAD{n_vocab - 1}]"


def test_sentencepiece_model_converted_by_transformers_matches_llama_cpp(tmp_path):
    """A real SentencePiece BPE model (trained here with the sentencepiece library, with Llama 2's trainer
    settings: identity normalization, byte fallback, whitespace-only pieces), converted to tokenizer.json
    by transformers (whose merges come from the pieces' scores, several per piece): llama.cpp's ids equal
    SentencePiece's own on every text, and transformers' except before a leading space."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is in the dev extras")
    import inspect
    import json as json_module
    import textwrap

    corpus = [line for m in (json_module, textwrap, inspect) for line in inspect.getsource(m).splitlines() if line.strip()]
    corpus += [t for t in CORPUS if t] * 5
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=2000, model_type="bpe", byte_fallback=True,
        character_coverage=0.98, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True}
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "src"))
    tok.save_pretrained(tmp_path / "saved")
    fields = vocab_fields(tmp_path / "saved", SimpleNamespace(vocab_size=sp.vocab_size()), FALLBACK_CHAT_TEMPLATE)
    assert fields[0][1] == "llama" and len(json.loads((tmp_path / "saved" / "tokenizer.json").read_text())["model"]["merges"]) > 2000
    llm = llama_cpp.Llama(str(_vocab_gguf(tmp_path / "vocab.gguf", fields, sp.vocab_size())), vocab_only=True, verbose=False)
    texts = [t for t in CORPUS if t] + corpus[::5]
    assert [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts] == [sp.encode(t) for t in texts]
    # transformers matches both except before a leading space (the pinned difference below)
    plain = [t for t in texts if not t.startswith(" ")]
    spaced = [t for t in texts if t.startswith(" ")]
    assert len(plain) > 20 and len(spaced) > 20
    assert [llm.tokenize(t.encode(), add_bos=True, special=True) for t in plain] == [tok.encode(t) for t in plain]
    assert [llm.tokenize(t.encode(), add_bos=False) for t in spaced] == [tok.encode(" " + t, add_special_tokens=False) for t in spaced]


def test_transformers_llama_tokenizer_differs_from_llama_cpp_only_in_prefix_spaces(tmp_path):
    """transformers 5's LlamaTokenizer class (Llama 2, Mistral v0.1 checkpoints) rebuilds the pipeline as
    Metaspace(prepend_scheme="first"): the space prefix goes before the input's start only, and not
    before one that starts with a space. llama.cpp's SentencePiece tokenizer (like SentencePiece itself)
    puts it before every text after a special token and before a leading space; no GGUF setting changes
    that. Elsewhere the ids agree; these are the known, pinned differences."""
    model_dir = _sentencepiece_bpe(tmp_path / "tok", True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "tokenizer.json").read_text())["pre_tokenizer"]["prepend_scheme"] == "first"
    fields = vocab_fields(tmp_path / "saved", SimpleNamespace(vocab_size=700), None)
    llm = llama_cpp.Llama(str(_vocab_gguf(tmp_path / "vocab.gguf", fields, 700)), vocab_only=True, verbose=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    for text in [t for t in CORPUS if t and not t.startswith(" ")]:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok.encode(text)
    for text in (" Hello world", "  two spaces"):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(" " + text, add_special_tokens=False)
        assert tok.encode(" " + text, add_special_tokens=False) != tok.encode(text, add_special_tokens=False)
    after_special = llm.tokenize(b"</s>hi there", add_bos=False, special=True)
    assert after_special == [2, *tok.encode(" hi there", add_special_tokens=False)] != tok.encode("</s>hi there", add_special_tokens=False)


def test_token_ids_beyond_the_vocab_size_are_one_line(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    with pytest.raises(SlimtuneError, match=r"tokenizer.json: model.vocab\['.'\]: token id 200 is outside the model's vocab_size 200 "):
        vocab_fields(tmp_path / "tok", SimpleNamespace(vocab_size=200), None)


def test_unigram_tokenizer_is_one_line(tmp_path):
    tok = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    with pytest.raises(SlimtuneError, match=r"model.type 'Unigram' cannot be exported to GGUF"):
        vocab_fields(tmp_path / "tok", SimpleNamespace(vocab_size=2), None)


# --- Modelfile ----------------------------------------------------------------------------------------


def _go_branches(roles: dict[str, str], suffix: str) -> str:
    body = "{{ .Content }}" + suffix
    return "{{ if" + "{{ else if".join(f' eq .Role "{r}" }}}}{p}{body}' for r, p in roles.items()) + "{{ end }}"


_CHATML_GO = (
    "{{ range .Messages }}"
    + _go_branches({r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}, "<|im_end|>\n")
    + "{{ end }}<|im_start|>assistant\n"
)
_LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_GEMMA_STYLE = (  # no system role
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_LLAMA2_STYLE = (  # user and assistant turns end differently: not one wrapper for every message
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.real_model
def test_modelfile_for_smollm2(tmp_path, smollm2_dir):
    template = (smollm2_dir / "chat_template.jinja").read_text()
    path = write_modelfile(tmp_path / "model-q8_0.gguf", smollm2_dir, template)
    assert path == tmp_path / "Modelfile" and sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile"]
    assert path.read_text() == (
        f'FROM ./model-q8_0.gguf\nTEMPLATE """{_CHATML_GO}"""\nPARAMETER stop "<|im_end|>"\n'
        'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""\n'
    )


def test_modelfile_for_the_fallback_template(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    path = write_modelfile(tmp_path / "out" / "model-f16.gguf", tmp_path / "tok", FALLBACK_CHAT_TEMPLATE, "Be terse.")
    roles = {r: f"<|{r}|>\n" for r in ("system", "user", "assistant")}
    go = "<|bos|>{{ range .Messages }}" + _go_branches(roles, "<|eos|>\n") + "{{ end }}<|assistant|>\n"
    want = f'FROM ./model-f16.gguf\nTEMPLATE """{go}"""\nPARAMETER stop "<|eos|>"\nSYSTEM """Be terse."""\n'
    assert path.read_text() == want  # the tokenizer does not add BOS: the template keeps it


def test_modelfile_leaves_bos_to_llama_cpp_and_stops_at_end_of_turn(tmp_path):
    model_dir = _sentencepiece_bpe(tmp_path / "tok", True)  # adds <s> itself, as llama.cpp will
    text = write_modelfile(tmp_path / "model.gguf", model_dir, _LLAMA3_STYLE).read_text()
    roles = {r: f"<|start_header_id|>{r}<|end_header_id|>\n\n" for r in ("system", "user", "assistant")}
    go = "{{ range .Messages }}" + _go_branches(roles, "<|eot_id|>") + "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert text == f'FROM ./model.gguf\nTEMPLATE """{go}"""\nPARAMETER stop "<|eot_id|>"\nPARAMETER stop "</s>"\n'


def test_modelfile_for_a_template_without_system_role(tmp_path):
    model_dir = _sentencepiece_bpe(tmp_path / "tok", False)
    text = write_modelfile(tmp_path / "model.gguf", model_dir, _GEMMA_STYLE).read_text()
    roles = {"assistant": "<start_of_turn>model\n", "user": "<start_of_turn>user\n"}
    go = "{{ range .Messages }}" + _go_branches(roles, "<end_of_turn>\n") + "{{ end }}<start_of_turn>model\n"
    assert text == f'FROM ./model.gguf\nTEMPLATE """{go}"""\nPARAMETER stop "<end_of_turn>"\nPARAMETER stop "</s>"\n'
    with pytest.raises(SlimtuneError, match="^Modelfile SYSTEM: the chat template has no system role"):
        write_modelfile(tmp_path / "model.gguf", model_dir, _GEMMA_STYLE, "Be terse.")


def test_modelfile_without_a_translatable_template(tmp_path):
    model_dir = _sentencepiece_bpe(tmp_path / "tok", True)
    text = write_modelfile(tmp_path / "model.gguf", model_dir, _LLAMA2_STYLE).read_text()
    assert text.splitlines()[0] == "FROM ./model.gguf" and "TEMPLATE" not in text.replace("# no TEMPLATE", "")
    assert text.splitlines()[1].startswith("# no TEMPLATE: ") and text.endswith('PARAMETER stop "</s>"\n')


def test_modelfile_write_is_atomic(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "Modelfile").write_text("FROM ./old.gguf\n")
    with pytest.raises(SlimtuneError, match=r'^Modelfile SYSTEM: contains """'):
        write_modelfile(tmp_path / "model.gguf", tmp_path / "tok", FALLBACK_CHAT_TEMPLATE, 'say """hi"""')
    assert (tmp_path / "Modelfile").read_text() == "FROM ./old.gguf\n"
    write_modelfile(tmp_path / "model.gguf", tmp_path / "tok", None)
    assert (tmp_path / "Modelfile").read_text() == 'FROM ./model.gguf\nPARAMETER stop "<|eos|>"\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Modelfile", "tok"]


def test_chat_template_must_be_a_string(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    with pytest.raises(SlimtuneError, match=r"^chat_template: expected a string, found"):
        vocab_fields(tmp_path / "tok", SimpleNamespace(vocab_size=259), ["not", "a", "template"])


def test_unreadable_special_tokens_are_one_line(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"bos_token_id": -3}))
    with pytest.raises(SlimtuneError, match=r"special tokens or merges are not readable: invalid value for special token type bos: -3$"):
        vocab_fields(tmp_path / "tok", SimpleNamespace(vocab_size=259), None)
