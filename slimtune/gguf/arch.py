"""What llama.cpp expects of each model family in a GGUF file: the architecture, its metadata keys from
the Hugging Face config, each tensor's GGUF name (the ``gguf`` package's own HF -> GGUF name map) and
the few row transformations llama.cpp's ``convert_hf_to_gguf.py`` applies (facts followed, not code
copied): Llama's Q/K row permutation, Gemma's norm weights stored as ``1 + w``, GPT-NeoX's fused QKV
regrouped from per-head [q k v] to [Q K V], GPT-2's Conv1D weights transposed, mixture-of-experts
layers' per-expert weights stacked into llama.cpp's 3-D ``ffn_{gate,up,down}_exps`` (``stack_experts``).

Every transformation is a row map over a tensor stream entry (``StreamTensor``), so the export stays a
stream: rows in, rows out, one chunk at a time. Example::

    arch = gguf_arch(config_dict)              # SlimtuneError for a family llama.cpp cannot take
    arch.kv()                                  # [(key, value, GGUFValueType), ...]
    arch.tensor(stream_entry)                  # the GGUF-named, transformed entry, or None (dropped)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from slimtune.errors import SlimtuneError
from slimtune.tensors import StreamTensor

ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,  # llama.cpp's converter reads HF Mistral as Llama
    "mixtral": gguf.MODEL_ARCH.LLAMA,  # and Mixtral as Llama with experts
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "gpt_neox": gguf.MODEL_ARCH.GPTNEOX,
    "gpt2": gguf.MODEL_ARCH.GPT2,
}
VISION_TEXT_ARCHS = {"qwen2_5_vl_text": gguf.MODEL_ARCH.QWEN2VL}
"""The language models of vision-language families that are no text family of their own (their model_type as
``slimtune.gguf.mmproj`` names it); exported beside their mmproj file."""
# tensors the HF checkpoint may hold that llama.cpp does not read (attention masks saved as buffers)
_DROPPED = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
# llama.cpp hard-codes which Gemma layers use the sliding window: every layer i with i % n < n - 1
_SWA_PERIOD = {"gemma2": 2, "gemma3_text": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
_MROPE = ("qwen2_5_vl_text",)  # rope over (time, height, width) sections of each head: rope.dimension_sections

_LLAMA_LIKE = ("llama", "mistral", "mixtral")
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")

T = gguf.GGUFValueType
_KEYS = {
    False: {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads"},
    True: {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head"},  # GPT-2's names
}


def _ranges(held: list[int]) -> str:
    if not held:
        return "none"
    return f"{held[0]}..{held[-1]}" + ("" if held == list(range(held[0], held[-1] + 1)) else f" ({len(held)} of them, with gaps)")


def _need(cfg: dict, key: str, where: str):
    value = cfg.get(key)
    if value is None:
        raise SlimtuneError(f"{where}: config.json has no {key!r}, which the GGUF metadata needs")
    return value


def _count(value: object, key: str, where: str, minimum: int = 1) -> int:
    """An integer setting llama.cpp reads as uint32 (a JSON integer, never a string, float or bool)."""
    if type(value) is not int or not minimum <= value < 2**32:
        raise SlimtuneError(f"{where}: {key} must be an integer in [{minimum}, 2**32), found {value!r}")
    return value


def _object(value: object, key: str, where: str) -> dict:
    if value is not None and not isinstance(value, dict):
        raise SlimtuneError(f"{where}: {key} must be an object, found {type(value).__name__}")
    return value or {}


def _positive(value: object, key: str, where: str) -> float:
    """A float setting (epsilon, rope base, scaling factor) llama.cpp computes with: finite and > 0 as
    float32 (a negative epsilon aborts llama.cpp's norm; a string is no number)."""
    as32 = float(torch.tensor(value, dtype=torch.float32)) if type(value) in (int, float) and abs(value) < 3.4e38 else math.nan
    if not (math.isfinite(as32) and as32 > 0):
        raise SlimtuneError(f"{where}: {key} must be a finite positive number, found {value!r}")
    return float(value)


class GGUFArch:
    """One model's GGUF architecture: metadata and tensor mapping (build with ``gguf_arch``)."""

    def __init__(self, cfg: dict, where: str = "config.json"):
        self.cfg, self.where = cfg, where
        self.model_type = cfg.get("model_type")
        if self.model_type not in ARCHS and self.model_type not in VISION_TEXT_ARCHS:
            names = ", ".join(sorted(ARCHS))
            raise SlimtuneError(f"{where}: model_type {self.model_type!r} cannot be exported to GGUF; families that can: {names}")
        self.arch = ARCHS.get(self.model_type) or VISION_TEXT_ARCHS[self.model_type]
        self.name = gguf.MODEL_ARCH_NAMES[self.arch]
        gpt2 = self.model_type == "gpt2"
        keys = ("n_embd", "n_layer", "n_head") if gpt2 else ("hidden_size", "num_hidden_layers", "num_attention_heads")
        self.hidden, self.layers, self.heads = (_count(_need(cfg, k, where), k, where) for k in keys)
        self.kv_heads = _count(cfg.get("num_key_value_heads") or self.heads, "num_key_value_heads", where)
        if self.heads % self.kv_heads:
            raise SlimtuneError(f"{where}: num_key_value_heads {self.kv_heads} does not divide {keys[2]} {self.heads}")
        self.head_dim = _count(cfg.get("head_dim") or self.hidden // self.heads, "head_dim", where)
        self.rope = self._rope_parameters()
        if self.model_type != "gpt2" and (self.rope_dims() % 2 or not 0 < self.rope_dims() <= self.head_dim):
            raise SlimtuneError(
                f"{where}: head_dim {self.head_dim} gives {self.rope_dims()} rotary dimensions; "
                "rope rotates pairs: an even count up to head_dim"
            )
        self.names = gguf.get_tensor_name_map(self.arch, self.layers)
        self._check_attention()
        self.experts, self.experts_used = self._experts()

    def _experts(self) -> tuple[int, int]:
        """(experts per layer, experts used per token): (0, 0) for a dense model. Settings llama.cpp's MoE
        graph cannot be told are refused: dense layers between MoE ones, unnormalized top-k weights."""
        cfg, where = self.cfg, self.where
        if self.model_type not in ("mixtral", "qwen3_moe"):
            return 0, 0
        key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
        n = _count(_need(cfg, key, where), key, where)
        used = _count(_need(cfg, "num_experts_per_tok", where), "num_experts_per_tok", where)
        if used > n:
            raise SlimtuneError(f"{where}: num_experts_per_tok {used} exceeds {key} {n}")
        if self.model_type == "qwen3_moe":
            if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                raise SlimtuneError(
                    f"{where}: mlp_only_layers {cfg.get('mlp_only_layers')} / decoder_sparse_step {cfg.get('decoder_sparse_step')}: "
                    "llama.cpp's qwen3moe makes every layer a mixture of experts, so this model cannot be exported to GGUF"
                )
            if cfg.get("norm_topk_prob") is not True:
                raise SlimtuneError(
                    f"{where}: norm_topk_prob {cfg.get('norm_topk_prob')!r}: llama.cpp's qwen3moe always normalizes the top-k "
                    "expert weights, so this model cannot be exported to GGUF"
                )
        return n, used

    # --- metadata ---------------------------------------------------------------------------------

    def _rope_parameters(self) -> dict:
        """The rope settings of full-attention layers (transformers 5 ``rope_parameters``, or the older
        ``rope_theta`` / ``rope_scaling`` keys), with ``theta_swa`` for Gemma 3's sliding layers."""
        cfg = self.cfg
        params = dict(_object(cfg.get("rope_parameters"), "rope_parameters", self.where))
        swa = None
        if "full_attention" in params:
            swa = _object(params.get("sliding_attention"), "rope_parameters.sliding_attention", self.where).get("rope_theta")
            params = dict(_object(params["full_attention"], "rope_parameters.full_attention", self.where))
        legacy = _object(cfg.get("rope_scaling"), "rope_scaling", self.where)
        params = {**legacy, **params}
        params.setdefault("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
        params["rope_theta"] = _positive(params["rope_theta"], "rope_theta", self.where)
        params["theta_swa"] = None if swa is None else _positive(swa, "sliding_attention.rope_theta", self.where)
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if self.model_type in _MROPE and kind == "mrope":  # the published configs' name for it (transformers 5: "default")
            kind = "default"
        if kind not in ("default", "linear", "llama3"):
            raise SlimtuneError(f"{self.where}: rope scaling {kind!r} is not supported by slimtune's GGUF export (default, linear, llama3)")
        params["rope_type"] = kind
        return params

    def _check_attention(self) -> None:
        """Settings llama.cpp cannot be told: refuse them rather than write a model that computes otherwise."""
        cfg, mt = self.cfg, self.model_type
        if mt in _SWA_PERIOD:
            scalar = cfg.get("query_pre_attn_scalar", self.head_dim)
            big = self.layers == _GEMMA_27B_LAYERS[mt] and scalar == self.hidden // self.heads
            if scalar != self.head_dim and not big:
                raise SlimtuneError(
                    f"{self.where}: query_pre_attn_scalar {scalar} differs from head_dim {self.head_dim}; llama.cpp scales "
                    f"attention by head_dim (27B models excepted), so this model cannot be exported to GGUF"
                )
            n = _SWA_PERIOD[mt]
            want = ["sliding_attention" if i % n < n - 1 else "full_attention" for i in range(self.layers)]
            if cfg.get("layer_types") not in (None, want):
                raise SlimtuneError(f"{self.where}: layer_types {cfg['layer_types']} differ from llama.cpp's fixed pattern {want}")
        if mt == "phi3" and self.rope.get("long_factor") is not None:
            raise SlimtuneError(f"{self.where}: Phi-3 longrope scaling is not supported by slimtune's GGUF export")

    def rope_dims(self) -> int:
        factor = self.rope.get("partial_rotary_factor", self.cfg.get("partial_rotary_factor", self.cfg.get("rotary_pct", 1.0)))
        if _positive(factor, "partial_rotary_factor", self.where) > 1:
            raise SlimtuneError(f"{self.where}: partial_rotary_factor must be in (0, 1], found {factor!r}")
        if self.model_type in ("phi3", "gpt_neox"):  # as llama.cpp's converter computes them
            return int(factor * self.hidden) // self.heads if self.model_type == "phi3" else int(factor * (self.hidden // self.heads))
        return int(factor * self.head_dim)

    def kv(self) -> list[tuple[str, object, gguf.GGUFValueType]]:
        """The architecture's metadata as llama.cpp's converter writes it for this family."""
        cfg, a, mt = self.cfg, self.name, self.model_type
        K = gguf.Keys
        gpt2 = mt == "gpt2"
        ff = 4 * self.hidden if gpt2 else _count(_need(cfg, "intermediate_size", self.where), "intermediate_size", self.where)
        ctx_key = "n_positions" if gpt2 else "max_position_embeddings"
        ctx = _count(_need(cfg, ctx_key, self.where), ctx_key, self.where)
        out = [
            (K.LLM.CONTEXT_LENGTH.format(arch=a), ctx, T.UINT32),
            (K.LLM.EMBEDDING_LENGTH.format(arch=a), self.hidden, T.UINT32),
            (K.LLM.BLOCK_COUNT.format(arch=a), self.layers, T.UINT32),
            (K.LLM.FEED_FORWARD_LENGTH.format(arch=a), ff, T.UINT32),
            (K.Attention.HEAD_COUNT.format(arch=a), self.heads, T.UINT32),
            (K.Attention.HEAD_COUNT_KV.format(arch=a), self.kv_heads, T.UINT32),
        ]
        if "rms_norm_eps" in cfg:
            out.append(
                (K.Attention.LAYERNORM_RMS_EPS.format(arch=a), _positive(cfg["rms_norm_eps"], "rms_norm_eps", self.where), T.FLOAT32)
            )
        eps_key = "layer_norm_eps" if "layer_norm_eps" in cfg else "layer_norm_epsilon"
        if cfg.get(eps_key) is not None:
            out.append((K.Attention.LAYERNORM_EPS.format(arch=a), _positive(cfg[eps_key], eps_key, self.where), T.FLOAT32))
        if cfg.get("head_dim") is not None:
            out += [
                (K.Attention.KEY_LENGTH.format(arch=a), self.head_dim, T.UINT32),
                (K.Attention.VALUE_LENGTH.format(arch=a), self.head_dim, T.UINT32),
            ]
        if not gpt2:
            out += [
                (K.Rope.DIMENSION_COUNT.format(arch=a), self.rope_dims(), T.UINT32),
                (K.Rope.FREQ_BASE.format(arch=a), float(self.rope["rope_theta"]), T.FLOAT32),
            ]
        if self.rope.get("theta_swa") is not None:
            out.append((K.Rope.FREQ_BASE_SWA.format(arch=a), float(self.rope["theta_swa"]), T.FLOAT32))
        if self.rope["rope_type"] == "linear":
            out += [
                (K.Rope.SCALING_TYPE.format(arch=a), "linear", T.STRING),
                (K.Rope.SCALING_FACTOR.format(arch=a), _positive(self.rope.get("factor"), "rope_scaling.factor", self.where), T.FLOAT32),
            ]
        return out + self._family_kv()

    def _family_kv(self) -> list[tuple[str, object, gguf.GGUFValueType]]:
        cfg, a, mt = self.cfg, self.name, self.model_type
        K = gguf.Keys
        out: list[tuple[str, object, gguf.GGUFValueType]] = []
        if mt in _LLAMA_LIKE:  # the converter's LlamaModel writes {arch}.vocab_size (llama.cpp's n_vocab when present)
            out.append((K.LLM.VOCAB_SIZE.format(arch=a), int(_need(cfg, "vocab_size", self.where)), T.UINT32))
        if self.experts:
            out += [
                (K.LLM.EXPERT_COUNT.format(arch=a), self.experts, T.UINT32),
                (K.LLM.EXPERT_USED_COUNT.format(arch=a), self.experts_used, T.UINT32),
            ]
        if mt == "qwen3_moe":
            ff = _count(_need(cfg, "moe_intermediate_size", self.where), "moe_intermediate_size", self.where)
            out.append((K.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=a), ff, T.UINT32))
        if mt in _SWA_PERIOD:
            out.append(
                (
                    K.Attention.SLIDING_WINDOW.format(arch=a),
                    _count(_need(cfg, "sliding_window", self.where), "sliding_window", self.where),
                    T.UINT32,
                )
            )
            for key, gkey in (
                ("attn_logit_softcapping", K.LLM.ATTN_LOGIT_SOFTCAPPING),
                ("final_logit_softcapping", K.LLM.FINAL_LOGIT_SOFTCAPPING),
            ):
                if cfg.get(key) is not None:
                    if mt == "gemma3_text":
                        raise SlimtuneError(f"{self.where}: Gemma 3 with {key} {cfg[key]}: llama.cpp's gemma3 does not apply it")
                    out.append((gkey.format(arch=a), _positive(cfg[key], key, self.where), T.FLOAT32))
        if mt == "phi3":
            orig = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            out += [
                (K.Rope.SCALING_ORIG_CTX_LEN.format(arch=a), _count(orig, "original_max_position_embeddings", self.where), T.UINT32),
                (
                    K.Attention.SLIDING_WINDOW.format(arch=a),
                    _count(cfg.get("sliding_window") or 0, "sliding_window", self.where, 0),
                    T.UINT32,
                ),
            ]
        if mt == "gpt_neox":
            out.append((K.LLM.USE_PARALLEL_RESIDUAL.format(arch=a), bool(cfg.get("use_parallel_residual", True)), T.BOOL))
        if mt in _MROPE:
            out.append((K.Rope.DIMENSION_SECTIONS.format(arch=a), self._mrope_sections(), T.INT32))
        return out

    def _mrope_sections(self) -> list[int]:
        """``mrope_section`` (rotary pairs per time, height and width section) padded to llama.cpp's 4 with 0, as the
        converter writes it; they must cover the head's rotary pairs, as transformers splits them."""
        sections = self.rope.get("mrope_section")
        ok = isinstance(sections, list) and 0 < len(sections) <= 4 and all(type(n) is int and n >= 0 for n in sections)
        if not ok or sum(sections) != self.rope_dims() // 2:
            raise SlimtuneError(
                f"{self.where}: rope mrope_section {sections!r}: expected up to 4 counts of rotary pairs summing to "
                f"head_dim / 2 = {self.rope_dims() // 2}"
            )
        return [*sections, *[0] * (4 - len(sections))]

    # --- tensors ----------------------------------------------------------------------------------

    def check_tensors(self, tensors: list[StreamTensor]) -> None:
        """The GGUF tensors (``tensor``'s entries) against the shapes llama.cpp computes from the metadata,
        before a byte is written: every layer 0..n-1 and no other, the embedding's rows = vocab_size (the
        token list's length), the head, the attention and MLP projections; config token ids in range."""
        shapes = {t.name: tuple(t.shape) for t in tensors}
        where, keys = self.where, _KEYS[self.model_type == "gpt2"]
        held = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("blk.")})
        if held != list(range(self.layers)):
            raise SlimtuneError(f"{where}: {keys['layers']} is {self.layers}, the checkpoint holds layers {_ranges(held)}")
        vocab = _count(self.cfg.get("vocab_size"), "vocab_size", where)
        embedding = shapes.get("token_embd.weight")
        if embedding != (vocab, self.hidden):
            found = "no token embedding" if embedding is None else f"an embedding of {list(embedding)}"
            raise SlimtuneError(
                f"{where}: vocab_size {vocab} and {keys['hidden']} {self.hidden} need an embedding of [{vocab}, {self.hidden}], "
                f"the checkpoint has {found}"
            )
        head = shapes.get("output.weight")
        if head is not None and head != (vocab, self.hidden):
            raise SlimtuneError(f"{where}: the output head is {list(head)}, vocab_size and {keys['hidden']} need [{vocab}, {self.hidden}]")
        if head is None and self.cfg.get("tie_word_embeddings") is False:
            raise SlimtuneError(f"{where}: tie_word_embeddings is false but the checkpoint has no output head (lm_head.weight)")
        want = self._projection_shapes()
        for name, shape in shapes.items():
            kind = name.split(".")[2] if name.startswith("blk.") and name.endswith(".weight") else None
            if kind in want and shape != want[kind]:
                raise SlimtuneError(
                    f"{where}: tensor {name} is {list(shape)}; {keys['heads']} {self.heads}, num_key_value_heads {self.kv_heads}, "
                    f"head_dim {self.head_dim} and {keys['hidden']} {self.hidden} need {list(want[kind])}"
                )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = self.cfg.get(key)
            for i in ids if isinstance(ids, list) else [ids]:
                if i is not None and (type(i) is not int or not 0 <= i < vocab):
                    raise SlimtuneError(f"{where}: {key} {ids!r} is not a token id below vocab_size {vocab}")

    def _projection_shapes(self) -> dict[str, tuple[int, ...]]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        ff = 4 * h if self.model_type == "gpt2" else self.cfg.get("intermediate_size")
        shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q), "ffn_gate": (ff, h), "ffn_up": (ff, h)}
        shapes |= {"ffn_down": (h, ff), "attn_norm": (h,), "ffn_norm": (h,)}
        if self.model_type == "phi3":
            shapes |= {"attn_qkv": (q + 2 * kv, h), "ffn_up": (2 * ff, h)}  # fused q|k|v and gate|up
        elif self.model_type in ("gpt_neox", "gpt2"):
            shapes |= {"attn_qkv": (3 * h, h)}
        if self.experts:  # the stacked experts as streamed: [experts * rows, row length]
            n, fx = self.experts, self.cfg.get("moe_intermediate_size", ff)
            shapes |= {"ffn_gate_inp": (n, h), "ffn_gate_exps": (n * fx, h), "ffn_up_exps": (n * fx, h), "ffn_down_exps": (n * h, fx)}
        return shapes

    def gguf_name(self, key: str) -> str | None:
        """The GGUF name of an HF tensor key; None for tensors llama.cpp does not read."""
        if key.endswith(_DROPPED):
            return None
        name = self.names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SlimtuneError(f"{self.where}: tensor {key} has no GGUF name for llama.cpp's {self.name} architecture")
        return name

    def tensor(self, t: StreamTensor) -> StreamTensor | None:
        """``t`` (float rows: float32, or a stored 16-bit tensor as it is) under its GGUF name, with the
        family's row transformation applied (row permutations keep the dtype; arithmetic is in float32)."""
        name = self.gguf_name(t.name)
        if name is None:
            return None
        key, mt = t.name, self.model_type
        if mt in _LLAMA_LIKE and key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            t = _grouped(t, self.head_dim, _llama_perm(self.head_dim), lambda g: g, f"{self.where}: head_dim {self.head_dim}")
        elif mt == "gpt_neox" and key.endswith(("query_key_value.weight", "query_key_value.bias")):
            heads = self.heads
            t = _grouped(t, self.hidden // heads, None, lambda g: (g % heads) * 3 + g // heads, f"{self.where}: n_embd / n_head")
        elif mt == "gpt2" and key.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = _transposed(t)
        elif mt in _SWA_PERIOD and key.endswith("norm.weight"):
            t = _mapped(t, lambda rows: rows + 1.0)  # Gemma's RMSNorm computes x * (1 + w): llama.cpp stores 1 + w
        if isinstance(t, Stacked):
            return Stacked(name, t.shape, t.dtype, t.rows, t.file_shape)
        return StreamTensor(name, t.shape, t.dtype, t.rows)

    def stack_experts(self, stream: list[StreamTensor]) -> list[StreamTensor]:
        """``stream`` with each MoE layer's per-expert weights (``...experts.E.w1.weight``, as published)
        replaced by one ``Stacked`` entry (``...experts.w1.weight``) where its expert 0 was: llama.cpp's
        3-D [experts, rows, row length] tensor, streamed by rows across the experts, so a chunk holds rows
        of one or two experts, never a layer's."""
        groups: dict[str, list[StreamTensor | None]] = {}
        out: list[StreamTensor | str] = []
        for t in stream:
            m = _EXPERT.match(t.name)
            if m is None or not self.experts:
                out.append(t)
                continue
            key, e = f"{m['prefix']}.{m['proj']}.weight", int(m["expert"])
            if key not in groups:
                groups[key] = [None] * self.experts
                out.append(key)
            if e >= self.experts or groups[key][e] is not None:
                raise SlimtuneError(f"{self.where}: tensor {t.name}: expert {e} of {self.experts} experts (or twice)")
            groups[key][e] = t
        return [x if isinstance(x, StreamTensor) else _stack(x, groups[x], self.where) for x in out]

    def extra_tensors(self) -> list[StreamTensor]:
        """Tensors llama.cpp needs that the checkpoint does not hold: Llama 3's rope frequency factors."""
        if self.rope["rope_type"] != "llama3":
            return []
        factors = torch.tensor(_llama3_rope_factors(self.rope, self.head_dim), dtype=torch.float32)
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        return [StreamTensor(name, tuple(factors.shape), torch.float32, lambda s, e: factors[s:e].clone())]


@dataclass(frozen=True)
class Stacked(StreamTensor):
    """Experts stacked: streamed as 2-D rows ``shape`` = [experts * rows, row length], written with the
    3-D ``file_shape`` [experts, rows, row length] (the same bytes: row-major)."""

    file_shape: tuple[int, ...] = ()


def _stack(key: str, parts: list[StreamTensor | None], where: str) -> Stacked:
    missing = [e for e, p in enumerate(parts) if p is None]
    if missing:
        raise SlimtuneError(f"{where}: {key}: the checkpoint lacks experts {missing} of {len(parts)}")
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise SlimtuneError(f"{where}: {key}: the experts' weights differ in shape or are not 2-D ({sorted(shapes)})")
    rows_per, cols = next(iter(shapes))
    dtypes = {p.dtype for p in parts}
    dtype = parts[0].dtype if len(dtypes) == 1 else torch.float32  # merged experts beside stored ones: all float32

    def rows(s: int, e: int) -> torch.Tensor:
        chunks = []
        for x in range(s // rows_per, (e - 1) // rows_per + 1):
            lo, hi = max(s, x * rows_per) - x * rows_per, min(e, (x + 1) * rows_per) - x * rows_per
            chunks.append(parts[x].rows(lo, hi).to(dtype))
        return torch.cat(chunks) if len(chunks) > 1 else chunks[0]

    return Stacked(key, (len(parts) * rows_per, cols), dtype, rows, (len(parts), rows_per, cols))


def gguf_arch(cfg: dict, where: str = "config.json") -> GGUFArch:
    """The GGUF architecture of a model from its config.json contents; one error line if llama.cpp
    cannot take it. Example: ``gguf_arch(json.loads(Path("m/config.json").read_text())).name``"""
    return GGUFArch(cfg, where)


def _llama3_rope_factors(rope: dict, head_dim: int) -> list[float]:
    """Llama 3.1's per-frequency rope scaling, as llama.cpp's ``rope_freqs`` tensor holds it."""
    base, factor = float(rope["rope_theta"]), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama_perm(head_dim: int) -> torch.Tensor:
    """Within one head: output row 2i + j is input row j * head_dim/2 + i (HF's rotate-half layout to
    llama.cpp's interleaved pairs)."""
    half = head_dim // 2
    return torch.arange(head_dim).view(2, half).t().reshape(-1)


def _grouped(t: StreamTensor, group: int, perm: torch.Tensor | None, source_group: Callable[[int], int], why: str) -> StreamTensor:
    """A row permutation in groups of ``group`` rows: output group g is input group ``source_group(g)``,
    its rows reordered by ``perm``. Each chunk reads only the groups it covers."""
    if t.num_rows % group:
        raise SlimtuneError(f"{why}: tensor {t.name} has {t.num_rows} rows, which do not divide into heads of {group}")

    def rows(s: int, e: int) -> torch.Tensor:
        parts = []
        for g in range(s // group, (e - 1) // group + 1):
            src = source_group(g) * group
            block = t.rows(src, src + group)
            if perm is not None:
                block = block[perm]
            lo, hi = max(s, g * group) - g * group, min(e, (g + 1) * group) - g * group
            parts.append(block[lo:hi])
        return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()

    return StreamTensor(t.name, t.shape, t.dtype, rows)


def _transposed(t: StreamTensor, pass_bytes: int = 4 * 1024 * 1024) -> StreamTensor:
    """The transpose of a 2-D entry: output rows [s, e) are input columns [s, e), gathered by a pass over
    the input rows in chunks of ``pass_bytes`` (GPT-2's Conv1D weights, a few MB each)."""
    n_in, n_out = t.shape
    pass_rows = max(1, pass_bytes // (4 * n_out))

    def rows(s: int, e: int) -> torch.Tensor:
        out = torch.empty((e - s, n_in), dtype=t.dtype)
        for a in range(0, n_in, pass_rows):
            b = min(a + pass_rows, n_in)
            out[:, a:b] = t.rows(a, b)[:, s:e].t()
        return out

    return StreamTensor(t.name, (n_out, n_in), t.dtype, rows)


def _mapped(t: StreamTensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> StreamTensor:
    """``fn`` of the rows, computed in float32 (a 16-bit entry is widened first: one rounding, the file's)."""
    return StreamTensor(t.name, t.shape, torch.float32, lambda s, e: fn(t.rows(s, e).float()))
