"""The per-tensor GGML types of llama.cpp's K-quant mixes (``llama-quantize``'s ``Q4_K_M``, ``Q4_K_S``,
``Q5_K_M``, ``Q5_K_S``, ``Q6_K``, ``Q3_K_S``, ``Q3_K_M``, ``Q3_K_L``, ``Q2_K``), as ``llama_tensor_get_type``
in ``src/llama-quant.cpp`` of the llama.cpp that llama-cpp-python 0.3.36 vendors chooses them without an
importance matrix (facts followed, not code copied; its Falcon-only branches are left out, Falcon is not a
slimtune family):

- only tensors of 2 or more dimensions whose name ends in ``weight`` are quantized, norms
  (``_norm.weight``), the MoE router (``ffn_gate_inp``) and position embeddings excepted: those keep their
  type (f32 in slimtune's files);
- ``output.weight`` (and ``token_embd.weight`` when the embeddings are tied: no ``output.weight``) is Q6_K,
  or Q8_0 when its rows do not divide into the mix's blocks of 256;
- ``attn_v`` (and fused ``attn_qkv``, which llama.cpp counts as attn_v: its own QKV rule is never reached),
  counted in llama.cpp's tensor order (by layer): Q6_K where ``use_more_bits`` picks the layer (Q4_K_M,
  Q5_K_M), Q5_K on the first 4 (Q4_K_S), Q5_K on the first 2 and Q4_K after (Q3_K_M), Q5_K (Q3_K_L),
  Q4_K with 4 or more query heads per KV head and Q3_K below (Q2_K); 70B-class models (Llama with 80
  layers and GQA, Qwen2 with 80) get Q5_K for a Q3_K or Q4_K choice; 8-expert models get Q8_0 for attn_v
  and attn_k;
- ``ffn_down``: Q6_K where ``use_more_bits`` picks the layer (Q4_K_M, Q5_K_M), Q5_K on the first eighth
  of the layers (Q4_K_S), Q5_K on the first sixteenth and Q4_K after (Q3_K_M), Q5_K (Q3_K_L), Q3_K (Q2_K);
- ``attn_output``: Q3_K (Q2_K), Q4_K (Q3_K_M), Q5_K (Q3_K_L); in 8-expert models Q5_K for Q2_K, Q3_K_S,
  Q3_K_M, Q4_K_S and Q4_K_M;
- every other weight takes the mix's type; then a row length that does not divide into the type's
  blocks falls back: Q2_K and Q3_K -> Q4_0 (this llama.cpp's choice; older ones took IQ4_NL), Q4_K ->
  Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 where even 32 does not divide.

Example::

    types = mix_types("q4_k_m", [("token_embd.weight", (49152, 576)), ...], MixModel("llama", 30, 9, 3))
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import gguf

from slimtune.formats.gguf_types import MIX_TYPES

Q = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

MIXES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    name: (Q[name[:4].upper()], FT[f"MOSTLY_{name.upper()}"])
    for name in MIX_TYPES  # q4_k_m: Q4_K, MOSTLY_Q4_K_M
}
"""Mix name -> (its default tensor type, the general.file_type llama-quantize writes)."""

_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class MixModel:
    """What of the model llama.cpp's choice looks at. Example: ``MixModel("llama", 32, 32, 8)``."""

    arch: str
    """The GGUF architecture name (``llama``, ``qwen2``, ...)."""
    layers: int
    heads: int
    kv_heads: int
    experts: int = 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B (the only size its quantization rules look at)."""
        return self.layers == 80 and (self.arch == "qwen2" or (self.arch == "llama" and self.heads != self.kv_heads))


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes this tensor at all (else it keeps the input's type)."""
    pos_embd = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.POS_EMBD] + ".weight"
    token_types = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_TYPES] + ".weight"
    return (
        len(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and name not in (pos_embd, token_types)
    )


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_v"),  # llama.cpp's attn_v-like categories: qkv, kv_b, v
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2  # i - n // 8 >= 0 here: C's % and Python's agree


def _llama_order(names: list[str]) -> list[int]:
    """Indices of ``names`` in llama.cpp's tensor order (its loader's map: by layer, non-layer tensors first, then by name)."""

    def key(i: int):
        m = _LAYER.match(names[i])
        return (int(m.group(1)) if m else -1, names[i])

    return sorted(range(len(names)), key=key)


def mix_types(mix: str, tensors: list[tuple[str, tuple[int, ...]]], model: MixModel) -> list[gguf.GGMLQuantizationType | None]:
    """The GGML type of each (GGUF name, shape) in a ``mix`` file, in the given order; None for a tensor the
    mix does not quantize (it keeps its own type). Shapes are row-major (the row length last)."""
    default, _ = MIXES[mix]
    names = [n for n, _ in tensors]
    cats = [_category(n) for n in names]
    tied = "output.weight" not in names
    n_wv = sum(c == "attn_v" for c in cats)
    state = {"wv": 0, "down": 0}
    out: list[gguf.GGMLQuantizationType | None] = [None] * len(tensors)
    for i in _llama_order(names):
        name, shape = tensors[i]
        if not quantizable(name, shape):
            continue
        t = _choose(mix, default, name, shape, cats[i], tied, n_wv, model, state)
        out[i] = _fallback(t, shape[-1])
    return out


def _choose(mix, default, name, shape, cat, tied, n_wv, model: MixModel, state: dict) -> gguf.GGMLQuantizationType:
    """llama.cpp's choice for one tensor before the shape fallback; ``state`` holds its attn_v / ffn_down counters."""
    t = default
    if cat == "output" or (tied and cat == "token_embd"):
        return Q.Q8_0 if shape[-1] % gguf.GGML_QUANT_SIZES[default][0] else Q.Q6_K
    if cat == "attn_v":
        if mix == "q2_k":
            t = Q.Q4_K if model.heads // model.kv_heads >= 4 else Q.Q3_K
        elif mix == "q3_k_m":
            t = Q.Q5_K if state["wv"] < 2 else Q.Q4_K
        elif mix == "q3_k_l":
            t = Q.Q5_K
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(state["wv"], n_wv):
            t = Q.Q6_K
        elif mix == "q4_k_s" and state["wv"] < 4:
            t = Q.Q5_K
        if model.is_70b and t in (Q.Q3_K, Q.Q4_K):
            t = Q.Q5_K
        if model.experts == 8:
            t = Q.Q8_0
        state["wv"] += 1
    elif cat == "attn_k" and model.experts == 8:
        t = Q.Q8_0
    elif cat == "ffn_down":
        layer, n = state["down"], model.layers
        if model.experts > 1:
            m = _LAYER.match(name)
            layer = int(m.group(1)) if m else -1
        if mix == "q2_k":
            t = Q.Q3_K
        elif mix == "q3_k_m":
            t = Q.Q5_K if layer < n // 16 else Q.Q4_K  # (Q3_K only on Falcon, not a slimtune family)
        elif mix == "q3_k_l":
            t = Q.Q5_K
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n):
            t = Q.Q6_K
        elif mix == "q4_k_s" and layer < n // 8:
            t = Q.Q5_K
        state["down"] += 1
    elif cat == "attn_output":
        if model.experts == 8:
            t = Q.Q5_K if mix in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m") else t
        else:
            t = {"q2_k": Q.Q3_K, "q3_k_m": Q.Q4_K, "q3_k_l": Q.Q5_K}.get(mix, t)
    return t


def _fallback(t: gguf.GGMLQuantizationType, cols: int) -> gguf.GGMLQuantizationType:
    """llama.cpp's fallback for rows that do not divide into the type's blocks."""
    block = gguf.GGML_QUANT_SIZES[t][0]
    if cols % block == 0:
        return t
    t = _FALLBACK.get(t, t)
    return t if cols % gguf.GGML_QUANT_SIZES[t][0] == 0 else Q.F16
