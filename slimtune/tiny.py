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

# The tiny vision model's chat template: the fallback ``<|role|>`` format (prompts.FALLBACK_CHAT_TEMPLATE)
# with TRL's content parts, an image part rendered as the processor's ``<image>`` token.
TINY_VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_IMAGE_SIZE = 64  # pixels: one 64 x 64 tile of 16-pixel patches, pixel-shuffled 2 x 2 into 4 image tokens

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


def make_tiny_vision_checkpoint(out_dir: str | Path, seed: int = 0, tokenizer=None, **config_overrides) -> Path:
    """Write a randomly initialised tiny SmolVLM (transformers' Idefics3 at the test widths of
    ``vision_families.TINY``) in Hugging Face format, bf16, with its processor made locally (no network):
    the byte tokenizer plus the image tokens, Idefics3's image processor at 64 x 64 pixels, unsplit
    (every image is 4 image tokens, from PIL and numpy alone), and ``TINY_VISION_CHAT_TEMPLATE``.
    Written atomically, as ``make_tiny_checkpoint``. ``tokenizer``: another text tokenizer to add the image
    tokens to (a ``PreTrainedTokenizerFast``; the byte tokenizer by default).

    Example: ``make_tiny_vision_checkpoint("runs/vlm-base")`` then ``AutoProcessor.from_pretrained("runs/vlm-base")``"""
    from transformers import AutoModelForImageTextToText, Idefics3ImageProcessorPil, Idefics3Processor

    from slimtune.vision_families import IMAGE_TOKENS

    out_dir = Path(out_dir)
    tokenizer = byte_tokenizer() if tokenizer is None else tokenizer
    tokenizer.add_tokens([name for name, _ in IMAGE_TOKENS["idefics3"]], special_tokens=True)
    size = {"longest_edge": TINY_IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(size=size, max_image_size=size, do_image_splitting=False)
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=TINY_VISION_CHAT_TEMPLATE)
    config = family_tiny_config(family_of("idefics3"), **config_overrides)
    config.text_config.vocab_size = len(processor.tokenizer)  # the processor adds <end_of_utterance>: every token has a row
    config.image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKENS["idefics3"][0][0])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's own (another tokenizer's differ)
        token_id = getattr(processor.tokenizer, key, None)
        if token_id is not None:
            setattr(config.text_config, key, token_id)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.bfloat16)
    with os_errors("write the tiny vision model", out_dir), atomic_directory(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out_dir
