"""Vision-language families: which modules of transformers' image-text-to-text model are the vision
tower and the projector. The language model's linears take NF4 and LoRA as in a text family; the
vision tower and projector stay frozen in the base dtype (their tensors are more entries of the same
checkpoint layout and stream like any other), unless ``LoRAConfig.vision`` puts LoRA (on NF4) on the
tower's linears too. The projector is never adapted.

PEFT selects modules by name over the whole model (``all-linear`` takes the vision tower as well), so
an adapter that leaves the tower frozen records the tower in ``exclude_modules`` (``peft_exclude_modules``):
``PeftModel.from_pretrained`` then adapts exactly the modules slimtune trained.

Example::

    parts = vision_parts("qwen2_5_vl")
    parts.in_tower("model.visual.blocks.0.attn.qkv")   # True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class VisionParts:
    """Module name prefixes of a vision-language model (transformers' names): ``tower`` holds the linears
    ``LoRAConfig.vision`` adapts, ``projector`` the ones never adapted; ``frozen`` every vision module."""

    tower: tuple[str, ...]
    projector: tuple[str, ...]
    frozen: tuple[str, ...]

    def in_tower(self, name: str) -> bool:
        return _under(name, self.tower)

    def in_vision(self, name: str) -> bool:
        return _under(name, self.frozen)

    def adaptable(self, name: str, vision: bool) -> bool:
        """Whether the linear ``name`` may hold NF4 and LoRA: the language model's, and the tower's with ``vision``."""
        return not self.in_vision(name) or (vision and self.in_tower(name))


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


_TEXT_TEST = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

VISION: dict[str, VisionParts] = {
    "qwen2_5_vl": VisionParts(tower=("model.visual.blocks",), projector=("model.visual.merger",), frozen=("model.visual",)),
    "idefics3": VisionParts(
        tower=("model.vision_model.encoder",), projector=("model.connector",), frozen=("model.vision_model", "model.connector")
    ),
    # SigLIP's encoder; the projector (average pool, RMSNorm, one [vision, text] matrix) is never adapted
    "gemma3": VisionParts(
        tower=("model.vision_tower.encoder",),
        projector=("model.multi_modal_projector",),
        frozen=("model.vision_tower", "model.multi_modal_projector"),
    ),
}

_SIGLIP_TEST = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16)

# Test widths: every language-model projection divides into NF4 blocks; the vision tower as small as
# TRL's tiny test models (2 blocks, 64 wide, 14-pixel patches merged 2 x 2).
TINY: dict[str, dict] = {
    "qwen2_5_vl": dict(
        text_config=dict(_TEXT_TEST, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=128,
            fullatt_block_indexes=[1],
            window_size=112,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        tie_word_embeddings=False,
    ),
    "idefics3": dict(
        text_config=_TEXT_TEST,
        vision_config=_SIGLIP_TEST,
        scale_factor=2,
        tie_word_embeddings=False,
    ),
    # Gemma 3: 2 sliding-window layers (llama.cpp's fixed 5 : 1 pattern), attention scaled by head_dim, the
    # head tied to the embeddings; SigLIP without its pooling head (as published), 16 patches average-pooled
    # 2 x 2 into 4 image tokens
    "gemma3": dict(
        text_config=dict(_TEXT_TEST, head_dim=32, query_pre_attn_scalar=32),
        vision_config=dict(_SIGLIP_TEST, vision_use_head=False),
        mm_tokens_per_image=4,
        tie_word_embeddings=True,  # as every published Gemma 3
    ),
}

# The tokens a test tokenizer adds after the text ones, in order, and the config keys that name their ids.
IMAGE_TOKENS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (
        ("<|vision_start|>", "vision_start_token_id"),
        ("<|image_pad|>", "image_token_id"),
        ("<|vision_end|>", "vision_end_token_id"),
        ("<|video_pad|>", "video_token_id"),
    ),
    "idefics3": (("<image>", "image_token_id"), ("<fake_token_around_image>", "")),  # "": no config key
    "gemma3": (("<start_of_image>", "boi_token_id"), ("<image_soft_token>", "image_token_id"), ("<end_of_image>", "eoi_token_id")),
}


def vision_parts(model_type: str) -> VisionParts | None:
    """The family's vision parts, or None for a text family."""
    return VISION.get(model_type)


def tiny_values(model_type: str, text_values: dict) -> dict:
    """The test config of a vision family: ``text_values`` (vocabulary, special tokens, positions) go to
    the language model's config; the image tokens take the ids after the ``vocab_size`` text tokens
    (the model's vocabulary holds both)."""
    tiny, tokens = TINY[model_type], IMAGE_TOKENS[model_type]
    values = {k: v for k, v in tiny.items() if k != "text_config"}
    text_values = dict(text_values)
    dtype = text_values.pop("dtype", None)
    first = text_values["vocab_size"]
    text_values["vocab_size"] = first + len(tokens)
    values["text_config"] = dict(tiny["text_config"], **text_values)
    values.update({key: first + i for i, (_, key) in enumerate(tokens) if key})
    if dtype is not None:
        values["dtype"] = dtype
    return values


def _exclude_pattern(parts: VisionParts, vision: bool, unadapted: list[str]) -> str | None:
    """``exclude_modules`` for PEFT (a regex it full-matches) naming ``unadapted``, the vision modules named
    like a target but left without an adapter: the frozen vision prefixes that hold them (the projector's
    with ``vision``), and any others by their exact name (Qwen2.5-VL's ``patch_embed.proj``, a Conv3d,
    when the tower's ``proj`` is a target); None when there are none."""
    prefixes = parts.projector if vision else parts.frozen
    hit = [p for p in prefixes if any(_under(n, (p,)) for n in unadapted)]
    exact = sorted(n for n in unadapted if not _under(n, tuple(hit)))
    if not hit and not exact:
        return None
    return "^(?:" + "|".join([*(re.escape(p) + r"\..*" for p in hit), *(re.escape(n) for n in exact)]) + ")$"


def peft_exclude_modules(model: nn.Module, adapters: dict[str, nn.Module]) -> str | None:
    """PEFT's ``exclude_modules`` for the ``adapters`` (module name -> LoRA linear) of a vision-language
    model: the vision modules (linear or not) named like a target but without an adapter, which PEFT's
    name matching would otherwise adapt; None for a text family or when there are none."""
    parts = vision_parts(getattr(getattr(model, "config", None), "model_type", ""))
    if parts is None or not adapters:
        return None
    leaves = {n.rsplit(".", 1)[-1] for n in adapters}
    unadapted = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in leaves and n not in adapters and parts.in_vision(n)]
    return _exclude_pattern(parts, any(parts.in_tower(n) for n in adapters), unadapted)
