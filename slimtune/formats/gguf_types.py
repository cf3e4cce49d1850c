"""The GGUF type names, defined here once: ``slimtune export --type``, the config's ``checkpoint.gguf``
and the export read them (no import but the standard library's, so the config and the CLI read them
without loading the ``gguf`` package or torch).

Each name is the GGML type (``PLAIN_TYPES``: every 2-D weight takes it) or the llama-quantize mix
(``MIX_TYPES``) of the same name in lower case: ``q8_0`` is ``GGMLQuantizationType.Q8_0``, ``q4_k_m`` is
``LlamaFileType.MOSTLY_Q4_K_M`` (``slimtune.gguf.export`` and ``slimtune.gguf.mix`` look them up by
that name). ``ADAPTER_TYPES`` are those a GGUF LoRA adapter takes.

Example::

    "q4_k_m" in TYPE_NAMES, "q4_k_m" in MIX_TYPES  # True, True
"""

from __future__ import annotations

from typing import Literal

PLAIN_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
"""The types every 2-D weight of the file takes (norms, biases and position embeddings stay f32)."""
MIX_TYPES = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_s", "q3_k_m", "q3_k_l", "q2_k")
"""llama.cpp's K-quant mixes: each tensor's type as llama-quantize chooses it (``slimtune.gguf.mix``)."""
TYPE_NAMES = (*PLAIN_TYPES, *MIX_TYPES)
"""Every ``--type``: the plain types, then the mixes."""
ADAPTER_TYPES = ("f32", "f16", "bf16", "q8_0")
"""The types of a GGUF LoRA adapter (``--adapter-only``): those convert_lora_to_gguf.py writes (--outtype);
a row q8_0's blocks do not divide falls back to F16, as there."""

MMPROJ_TYPES = ADAPTER_TYPES
"""The types of a vision-language model's mmproj file (``--mmproj-type``): convert_hf_to_gguf.py's --outtype
choices, as for an adapter (f16 is what llama.cpp's published mmproj files hold)."""

GgufType = Literal[TYPE_NAMES]  # type: ignore[valid-type]  # the same as Literal["f32", "f16", ...]
"""A config key that takes one of ``TYPE_NAMES``."""


def types_help() -> str:
    """The names as ``--type``'s help lists them. Example: ``types_help().startswith("f32, f16")``"""
    return f"{', '.join(PLAIN_TYPES)} (every 2-D weight), or llama.cpp's mixes {', '.join(MIX_TYPES)}"
