"""Inputs of the GGUF export for its hostile-input tests and fuzzer: a tiny merged checkpoint (Llama,
64 wide, 2 layers) with a SentencePiece-style BPE tokenizer (byte fallback, real merges, so merges and
scores matter), its manifest as slimtune writes it, and the named mutations the export must refuse
(``BAD_INPUTS``: file, change, and a word the one error line must hold)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from slimtune.formats.manifest import FileRecord, sha256_file, write_manifest

CORPUS = [
    "Hello world, with a leading space and a tab\t.",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2\n",
    "naïve café — Grüße, ¿qué tal? Привет мир 日本語 🦙",
    "numbers 1 12 123 1234 it's I'll we've",
    "the quick brown fox jumps over the lazy dog",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def sentencepiece_tokenizer(out: Path) -> int:
    """A SentencePiece-style BPE tokenizer with byte fallback (Llama 2's layout), trained on CORPUS;
    saved to ``out``. Returns its vocabulary size."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    trainer_tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def with_manifest(d: Path, kind: str = "merged") -> Path:
    """Give ``d`` the manifest slimtune writes last (every file, size and sha256)."""
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != "slimtune_manifest.json")
    records = [FileRecord(p.relative_to(d).as_posix(), p.stat().st_size, sha256_file(p)) for p in files]
    write_manifest(d, records, {"kind": kind})
    return d


def tiny_merged(out: Path, seed: int = 0) -> Path:
    """A tiny merged Llama checkpoint (bf16 safetensors, config, tokenizer, chat template, manifest)."""
    out.mkdir(parents=True)
    n_vocab = sentencepiece_tokenizer(out)
    config = LlamaConfig(
        vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    return with_manifest(out)


# --- named bad inputs ----------------------------------------------------------------------------

Edit = Callable[[object], object]


def _tok(fn: Callable[[dict], None]) -> tuple[str, Edit]:
    def edit(spec):
        fn(spec)
        return spec

    return "tokenizer.json", edit


def _cfg(**changes) -> tuple[str, Edit]:
    return "config.json", lambda c: {**c, **changes}


def _set(path: tuple, value) -> Callable[[dict], None]:
    def fn(spec):
        node = spec
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value

    return fn


def _vocab_id(value) -> Callable[[dict], None]:
    def fn(spec):
        vocab = spec["model"]["vocab"]
        vocab[next(k for k, i in vocab.items() if i == 300)] = value

    return fn


def _merge(value) -> Callable[[dict], None]:
    def fn(spec):
        spec["model"]["merges"][3] = value

    return fn


def _added(value) -> Callable[[dict], None]:
    def fn(spec):
        spec["added_tokens"][1] = value

    return fn


def _added_id(value) -> Callable[[dict], None]:
    def fn(spec):
        spec["added_tokens"][1]["id"] = value

    return fn


def _duplicate_id(spec):
    vocab = spec["model"]["vocab"]
    vocab[next(k for k, i in vocab.items() if i == 301)] = 300


def _bos_unknown(spec):
    spec["post_processor"] = None


# (name, file, edit of its parsed JSON (or text), a word the error line must hold besides the file name)
BAD_INPUTS: list[tuple[str, str, Edit, str]] = [
    ("vocab-not-object", *_tok(_set(("model", "vocab"), ["a", "b"])), "model.vocab"),
    ("vocab-id-string", *_tok(_vocab_id("300")), "model.vocab"),
    ("vocab-id-negative", *_tok(_vocab_id(-1)), "model.vocab"),
    ("vocab-id-float", *_tok(_vocab_id(300.5)), "model.vocab"),
    ("vocab-id-huge", *_tok(_vocab_id(2**40 + 1)), "model.vocab"),
    ("merges-string", *_tok(_set(("model", "merges"), "a b")), "model.merges"),
    ("merges-null", *_tok(_set(("model", "merges"), None)), "model.merges"),
    ("merge-three-parts", *_tok(_merge("\u2581 t h")), "model.merges[3]"),
    ("merge-integer", *_tok(_merge(7)), "model.merges[3]"),
    ("merge-pair-length", *_tok(_merge(["\u2581", "t", "h"])), "model.merges[3]"),
    ("merge-unknown-token", *_tok(_merge(["\u2581", "\U0001f47e"])), "model.merges[3]"),
    ("added-tokens-string", *_tok(_set(("added_tokens",), "<s>")), "added_tokens"),
    ("added-token-no-content", *_tok(_added({"id": 1, "special": True})), "added_tokens[1]"),
    ("added-token-id-beyond", *_tok(_added_id(5000)), "added_tokens[1]"),
    ("added-token-id-negative", *_tok(_added_id(-3)), "added_tokens[1]"),
    ("pre-tokenizer-unknown", *_tok(_set(("pre_tokenizer",), {"type": "Shredder"})), "pre_tokenizer"),
    ("normalizer-unknown", *_tok(_set(("normalizer",), {"type": "Bleach"})), "normalizer"),
    (
        "split-bad-regex",
        *_tok(_set(("pre_tokenizer",), {"type": "Split", "pattern": {"Regex": "(?<x"}, "behavior": "Isolated", "invert": False})),
        "pre_tokenizer",
    ),
    ("decoder-integer", *_tok(_set(("decoder",), 3)), "decoder"),
    ("tokenizer-config-list", "tokenizer_config.json", lambda c: [c], "tokenizer_config.json"),
    ("head-dim-inconsistent", *_cfg(head_dim=24), "head_dim"),
    ("rms-norm-eps-string", *_cfg(rms_norm_eps="1e-5"), "rms_norm_eps"),
    # files llama.cpp refused or aborted on
    ("layers-beyond-tensors", *_cfg(num_hidden_layers=3), "num_hidden_layers"),
    ("vocab-size-beyond-embedding", *_cfg(vocab_size=600), "vocab_size"),
    ("rms-norm-eps-negative", *_cfg(rms_norm_eps=-1e-5), "rms_norm_eps"),
    # also seen
    ("vocab-empty", *_tok(_set(("model", "vocab"), {})), "model.vocab"),
    ("vocab-duplicate-id", *_tok(_duplicate_id), "model.vocab"),
    ("rope-theta-string", *_cfg(rope_parameters={"rope_theta": "10000", "rope_type": "default"}), "rope_theta"),
    ("rope-theta-negative", *_cfg(rope_parameters={"rope_theta": -1e4, "rope_type": "default"}), "rope_theta"),
    ("rope-theta-legacy-string", *_cfg(rope_parameters=None, rope_theta="10000"), "rope_theta"),
    ("rope-theta-nan", *_cfg(rope_theta=float("nan")), "NaN"),
    ("bos-token-id-unknown", *_cfg(bos_token_id=5000), "bos_token_id"),
    ("eos-token-id-negative", *_cfg(eos_token_id=-2), "eos_token_id"),
    ("heads-not-dividing", *_cfg(num_key_value_heads=3), "num_key_value_heads"),
    ("chat-template-syntax", "tokenizer_config.json", lambda c: {**c, "chat_template": "{% for m in messages %}{{ m }"}, "chat_template"),
]


def apply(src: Path, dst: Path, file: str, edit: Edit) -> Path:
    """A copy of ``src`` at ``dst`` with ``file``'s JSON changed by ``edit`` (manifest rewritten to match:
    the damage is in the content, not a changed byte the hash check would catch first)."""
    shutil.copytree(src, dst)
    path = dst / file
    path.write_text(json.dumps(edit(json.loads(path.read_text())), ensure_ascii=False))
    return with_manifest(dst)
