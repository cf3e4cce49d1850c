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
from slimtune.errors import SlimtuneError
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
TINY_IMAGE_SIZE = 64  # pixels: one 64 x 64 tile of 16-pixel patches, pooled 2 x 2 into 4 image tokens

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


def make_tiny_vision_checkpoint(
    out_dir: str | Path, seed: int = 0, tokenizer=None, model_type: str = "idefics3", **config_overrides
) -> Path:
    """Write a randomly initialised tiny vision-language model in Hugging Face format, bf16, at the test
    widths of ``vision_families.TINY``, with its processor made locally (no network): the byte tokenizer
    plus the image tokens, the family's image processor at 64 x 64 pixels (every image is 4 image tokens,
    from PIL and numpy alone) and ``TINY_VISION_CHAT_TEMPLATE`` with the processor's image placeholder.
    ``model_type``: ``idefics3`` (SmolVLM: Idefics3's image processor, unsplit) or ``gemma3`` (Gemma 3:
    its image processor, no pan-and-scan; the tokenizer names ``boi_token``, ``image_token``, ``eoi_token``
    as Gemma's does). Written atomically, as ``make_tiny_checkpoint``. ``tokenizer``: another text tokenizer
    to add the image tokens to (a ``PreTrainedTokenizerFast``; the byte tokenizer by default).

    Example: ``make_tiny_vision_checkpoint("runs/vlm-base")`` then ``AutoProcessor.from_pretrained("runs/vlm-base")``"""
    from transformers import AutoModelForImageTextToText

    from slimtune.vision_families import IMAGE_TOKENS

    if model_type not in _TINY_PROCESSORS:
        raise SlimtuneError(f"model_type {model_type!r}: a tiny vision checkpoint is made for {', '.join(_TINY_PROCESSORS)} only")
    out_dir = Path(out_dir)
    tokenizer = byte_tokenizer() if tokenizer is None else tokenizer
    tokenizer.add_tokens([name for name, _ in IMAGE_TOKENS[model_type]], special_tokens=True)
    processor = _TINY_PROCESSORS[model_type](tokenizer)
    config = family_tiny_config(family_of(model_type), **config_overrides)
    config.text_config.vocab_size = len(processor.tokenizer)  # Idefics3's processor adds <end_of_utterance>: every token has a row
    for name, key in IMAGE_TOKENS[model_type]:
        if key:
            setattr(config, key, processor.tokenizer.convert_tokens_to_ids(name))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tokenizer's own (another tokenizer's differ)
        token_id = getattr(processor.tokenizer, key, None)
        if token_id is not None:
            setattr(config.text_config, key, token_id)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    if model_type == "gemma3":  # transformers starts the projector at zero: the images would not reach the language model
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=config.vision_config.hidden_size**-0.5)
    model = model.to(torch.bfloat16)
    with os_errors("write the tiny vision model", out_dir), atomic_directory(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
    return out_dir


def _idefics3_processor(tokenizer):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    size = {"longest_edge": TINY_IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(size=size, max_image_size=size, do_image_splitting=False)
    return Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=TINY_VISION_CHAT_TEMPLATE)


def _gemma3_processor(tokenizer):
    """Gemma 3's processor: the tokenizer re-made with Gemma's named image tokens (``boi_token`` is the
    chat template's image placeholder, ``image_token`` the 4 soft tokens it expands into)."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    from slimtune.vision_families import IMAGE_TOKENS

    (boi, _), (image, _), (eoi, _) = IMAGE_TOKENS["gemma3"]
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    named = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, **special, boi_token=boi, image_token=image, eoi_token=eoi
    )
    images = Gemma3ImageProcessorPil(size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE})
    template = TINY_VISION_CHAT_TEMPLATE.replace("<image>", boi)
    return Gemma3Processor(images, named, image_seq_length=4, chat_template=template)


_TINY_PROCESSORS = {"idefics3": _idefics3_processor, "gemma3": _gemma3_processor}
