"""The embedded default: a tiny Llama-architecture checkpoint with a byte-level tokenizer and a small
built-in dataset, made locally (no network), so the demo and the tests have a real HF model to load."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from slimtune.checkpoint.atomic import atomic_directory
from slimtune.families import family_of
from slimtune.families import tiny_config as family_tiny_config
from slimtune.fileio import os_errors

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]

DEMO_TEXTS = [
    "Bounded memory is the product: a checkpoint never holds the whole model.",
    "A checkpoint is an ordered stream of named tensors, each produced on demand.",
    "The writer knows every shape up front and writes the header first.",
    "Large tensors are written in row chunks straight into their shard files.",
    "NF4 weights are dequantized, merged with LoRA in fp32 and rounded once.",
    "A save that fails leaves the earlier checkpoint untouched.",
    "The manifest is written last; a directory without it is not a checkpoint.",
    "Small machines can fine-tune large models when nothing is held twice.",
]


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The embedded tiny Llama: the Llama family's test config (``families.tiny_config``: 128 wide,
    2 layers, 4 heads, byte vocabulary + pad/bos/eos) with a 512-wide MLP, untied; every projection
    (128x128, 512x128, 128x512) divides into NF4 blocks."""
    values = dict(intermediate_size=512, rms_norm_eps=1e-5, tie_word_embeddings=False, vocab_size=256 + len(SPECIAL_TOKENS))
    values.update(overrides)
    return family_tiny_config(family_of("llama"), **values)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens (GPT-2 byte alphabet) plus pad, bos, eos."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_unicode = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(byte_to_unicode)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>")


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(ch))]


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a randomly initialised tiny Llama in Hugging Face format (bf16 safetensors + tokenizer),
    atomically: ``out_dir`` appears whole (replacing an earlier one) or not at all. A failed write is
    one ``SlimtuneError`` line.

    Example: ``make_tiny_checkpoint("runs/base", seed=0)``"""
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**config_overrides)).to(torch.bfloat16)
    with os_errors("write the tiny base model", out_dir), atomic_directory(out_dir, overwrite=True) as tmp:
        try:
            model.save_pretrained(tmp)
        except SafetensorError as e:  # safetensors reports an I/O error as its own type: "... (os error 28)"
            m = re.search(r"os error (\d+)", str(e))
            if m is None:
                raise
            raise OSError(int(m.group(1)), os.strerror(int(m.group(1)))) from None
        byte_tokenizer().save_pretrained(tmp)
    return out_dir
