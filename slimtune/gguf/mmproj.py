"""The GGUF of a vision-language model is two files, as llama.cpp's ``convert_hf_to_gguf.py`` writes them:
the language model's GGUF (the text part of the checkpoint under the text family's names, as any text
model) and its ``mmproj`` GGUF (``--mmproj``: the vision tower and the projector, architecture ``clip``),
which llama.cpp's multimodal library (mtmd) loads beside the model. Both are plans over the same merged
tensor stream: this module splits the stream, names the vision tensors as the ``gguf`` package's MMPROJ
tensor map does, and gives the ``clip.*`` metadata and each tensor's GGML type as the converter's class for
the family does (facts followed, not code copied).

Families (``_FAMILIES``, one ``_Family`` each: where the language model's and the vision tensors are in the
stream, how vision tensors are named and split, their shape checks, types and ``clip.*`` metadata):
SmolVLM / Idefics3 (``idefics3``: the converter's ``SmolVLMModel``, projector type ``idefics3``), Gemma 3
(``gemma3``: its ``Gemma3VisionModel``, projector type ``gemma3``: the SigLIP tower, the projector's RMSNorm
stored as 1 + w, its [vision, text] matrix always F16) and Qwen2.5-VL (``qwen2_5_vl``: its
``Qwen2VLVisionModel``, projector type ``qwen2.5vl``; the language model is ``qwen2vl``). Any other vision
family is refused in one line. Example::

    vision = vision_export(cfg, [ckpt])          # None for a text model
    text_cfg, text_stream = vision.text_part(stream)
    tensors = vision.tensors(stream)              # [(hf_key, GGUF entry)] of the mmproj file
    vision.kv("f16")                              # its clip.* metadata
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from slimtune.errors import SlimtuneError
from slimtune.formats.gguf_types import MMPROJ_TYPES
from slimtune.tensors import StreamTensor
from slimtune.vision_families import vision_parts

Q = gguf.GGMLQuantizationType
T = gguf.GGUFValueType
K = gguf.Keys

_QTYPES = {name: Q[name.upper()] for name in MMPROJ_TYPES}
"""Each mmproj type name (``slimtune.formats.gguf_types.MMPROJ_TYPES``) -> the GGML type of its weights."""
_FILE_TYPES = {name: gguf.LlamaFileType.ALL_F32 if name == "f32" else gguf.LlamaFileType[f"MOSTLY_{name.upper()}"] for name in MMPROJ_TYPES}
_LN_EPS = 1e-6  # transformers' Idefics3VisionConfig and SiglipVisionConfig default (the converter assumes 1e-5 for Idefics3)


@dataclass(frozen=True)
class _Family:
    """What differs between vision families in the split and the mmproj file (``VisionExport`` calls these)."""

    projector: gguf.VisionProjectorType
    text: tuple[str, str]
    """The language model's key prefix in the stream -> the text family's (the converter reads it so)."""
    vision: tuple[str, ...]
    """Key prefixes of the vision tower and the projector in the stream."""
    counts: Callable[[VisionExport], dict[str, int]]
    """image_size, patch_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads."""
    tensors: Callable[[VisionExport, StreamTensor], list[StreamTensor]]
    """One vision entry of the stream as the mmproj file's entries (GGUF names; split where the converter splits)."""
    check: Callable[[VisionExport, dict[str, tuple[int, ...]]], None]
    qtype: Callable[[str, StreamTensor, gguf.GGMLQuantizationType], gguf.GGMLQuantizationType]
    """(HF key, GGUF entry, the file's type) -> the entry's type."""
    kv: Callable[[VisionExport, str], list[tuple[str, object, gguf.GGUFValueType]]]
    """The family's ``clip.*`` keys after the projector type."""
    text_model_type: str | None = None
    """The language model's ``model_type`` for ``slimtune.gguf.arch`` where ``text_config``'s is not one."""
    blocks_key: str = "num_hidden_layers"
    """vision_config's key for the tower's block count."""


def mmproj_path(out: Path, type_name: str, mmproj_type: str) -> Path:
    """Where the mmproj file of the model GGUF ``out`` goes: beside it, its stem without the ``-TYPE`` suffix,
    then ``-mmproj-TYPE.gguf``. Example: ``mmproj_path(Path("r/model-q8_0.gguf"), "q8_0", "f16") == Path("r/model-mmproj-f16.gguf")``"""
    stem = Path(out).stem.removesuffix(f"-{type_name}")
    return Path(out).with_name(f"{stem}-mmproj-{mmproj_type}.gguf")


def vision_export(cfg: dict, dirs: list[Path], where: str = "config.json") -> VisionExport | None:
    """The mmproj side of a vision-language checkpoint's config.json ``cfg`` (its processor files are looked
    for in ``dirs``, first found wins); None for a text model. A vision family llama.cpp's converter has no
    mmproj class for here is one error line."""
    model_type = cfg.get("model_type")
    if vision_parts(model_type) is None:
        return None
    if model_type not in _FAMILIES:
        raise SlimtuneError(
            f"{where}: model_type {model_type!r}: slimtune writes the GGUF + mmproj of {', '.join(sorted(_FAMILIES))} only; "
            "export the merged checkpoint with safetensors instead"
        )
    return VisionExport(cfg, dirs, where)


def _number(value: object, key: str, where: str, kind: type = int) -> int | float:
    ok = type(value) is int and value > 0 if kind is int else type(value) in (int, float) and 0 < value < float("inf")
    if not ok:
        raise SlimtuneError(f"{where}: {key} must be a positive {'integer' if kind is int else 'number'}, found {value!r}")
    return value


class VisionExport:
    """One vision-language model's split for GGUF: the language model's config and stream, and the mmproj
    file's tensors, types and metadata (build with ``vision_export``)."""

    name = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]  # "clip": general.architecture of the mmproj file

    def __init__(self, cfg: dict, dirs: list[Path], where: str):
        self.cfg, self.where, self.model_type = cfg, where, cfg["model_type"]
        self.family = _FAMILIES[self.model_type]
        self.vision = cfg.get("vision_config")
        self.text = cfg.get("text_config", {})  # none: the top level is the language model's (published Qwen2.5-VL configs)
        for key, value in (("vision_config", self.vision), ("text_config", self.text)):
            if not isinstance(value, dict):
                raise SlimtuneError(f"{where}: {key} must be an object, found {type(value).__name__}")
        self.counts = self.family.counts(self)
        self.blocks = self.counts["num_hidden_layers"]
        # at least 3 blocks' names: Qwen2.5-VL's merger is `mm.0` and `mm.2`, numbered as blocks in the name map
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(self.blocks, 3))
        self.processor, self.processor_file = _processor_config(dirs)

    def text_config(self) -> dict:
        """The language model's config as the converter reads it: the top level with ``text_config`` over it."""
        out = {**self.cfg, **self.text}
        return out if self.family.text_model_type is None else out | {"model_type": self.family.text_model_type}

    def text_hidden(self) -> int:
        """The language model's width (``clip.vision.projection_dim``)."""
        return _number(self.text_config().get("hidden_size"), "text_config.hidden_size", self.where)

    def text_part(self, stream: list[StreamTensor]) -> list[StreamTensor]:
        """The language model's entries of ``stream``, named as the text family's (``model.text_model.x``,
        ``language_model.model.x``, ``model.language_model.x`` -> ``model.x``; ``lm_head`` as it is); the vision
        tower and projector left out."""
        (prefix, to), out = self.family.text, []
        for t in stream:
            if self.in_vision(t.name):
                continue
            name = to + t.name.removeprefix(prefix) if t.name.startswith(prefix) else t.name
            out.append(t if name == t.name else StreamTensor(name, t.shape, t.dtype, t.rows))
        return out

    def in_vision(self, key: str) -> bool:
        """Whether the stream's ``key`` is the vision tower's or the projector's."""
        return key.startswith(self.family.vision)

    def tensors(self, stream: list[StreamTensor]) -> list[tuple[str, StreamTensor]]:
        """(HF key, GGUF entry) of the mmproj file: the vision tower's and projector's entries of ``stream``
        in its order, under the ``gguf`` package's MMPROJ names (split where the converter splits one). An
        entry with no name there is one line."""
        out = []
        for t in stream:
            if not self.in_vision(t.name):
                continue
            if not t.dtype.is_floating_point:
                raise SlimtuneError(f"tensor {t.name}: dtype {t.dtype} cannot be written to GGUF")
            out += [(t.name, g) for g in self.family.tensors(self, t)]
        if not out:
            raise SlimtuneError(f"{self.where}: a {self.model_type} model, but the checkpoint holds no vision tensors")
        return out

    def gguf_name(self, key: str) -> str:
        """The MMPROJ name of a vision tensor's HF key; one line where it has none."""
        name = self.names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SlimtuneError(f"{self.where}: tensor {key} has no name in llama.cpp's mmproj ({self.name}) file")
        return name

    def check_tensors(self, tensors: list[tuple[str, StreamTensor]]) -> None:
        """The mmproj tensors against the shapes llama.cpp computes from the file's metadata (``kv``), before a
        byte is written: blocks 0..n-1 and no other, then the family's (``_Family.check``: embeddings, each
        block's projections, the projector)."""
        shapes = {t.name: tuple(t.shape) for _, t in tensors}
        held = sorted({int(name.split(".")[2]) for name in shapes if name.startswith("v.blk.")})
        if held != list(range(self.blocks)):
            raise SlimtuneError(
                f"{self.where}: vision_config.{self.family.blocks_key} is {self.blocks}, the checkpoint holds vision blocks {held}"
            )
        self.family.check(self, shapes)

    def require(self, want: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], why: str) -> None:
        """Each tensor of ``want`` present with its shape, else one line naming it and the keys (``why``) behind it."""
        for name, shape in want.items():
            if shapes.get(name) != shape:
                found = "is missing" if name not in shapes else f"is {list(shapes[name])}"
                raise SlimtuneError(f"{self.where}: mmproj tensor {name} {found}; {why} need {list(shape)}")

    def qtypes(self, tensors: list[tuple[str, StreamTensor]], type_name: str) -> list[gguf.GGMLQuantizationType]:
        """Each tensor's GGML type in an mmproj file of ``type_name``, as the converter chooses it: the
        family's rule (``_Family.qtype``; 1-D tensors and norms F32 in every family), F16 where a q8_0 row
        does not divide into blocks of 32 (the converter's fallback)."""
        want = _QTYPES[type_name]
        out = []
        for key, t in tensors:
            q = self.family.qtype(key, t, want)
            out.append(Q.F16 if q == Q.Q8_0 and t.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] else q)
        return out

    def kv(self, type_name: str) -> list[tuple[str, object, gguf.GGUFValueType]]:
        """The mmproj file's metadata, in the converter's order (``general.name`` and ``general.size_label``,
        which it makes up from the directory's name and the parameter count, are not written)."""
        CV, n = K.ClipVision, self.counts
        mean, std = (self._stats(k) for k in ("image_mean", "image_std"))
        return [
            (K.General.TYPE, gguf.GGUFType.MMPROJ, T.STRING),
            (K.General.FILE_TYPE, int(_FILE_TYPES[type_name]), T.UINT32),
            (K.Clip.HAS_VISION_ENCODER, True, T.BOOL),
            (CV.PROJECTION_DIM, self.text_hidden(), T.UINT32),
            (CV.IMAGE_SIZE, n["image_size"], T.UINT32),
            (CV.PATCH_SIZE, n["patch_size"], T.UINT32),
            (CV.EMBEDDING_LENGTH, n["hidden_size"], T.UINT32),
            (CV.FEED_FORWARD_LENGTH, n["intermediate_size"], T.UINT32),
            (CV.BLOCK_COUNT, n["num_hidden_layers"], T.UINT32),
            (CV.Attention.HEAD_COUNT, n["num_attention_heads"], T.UINT32),
            (CV.IMAGE_MEAN, mean, T.FLOAT32),
            (CV.IMAGE_STD, std, T.FLOAT32),
            (K.Clip.PROJECTOR_TYPE, str(self.family.projector), T.STRING),
            *self.family.kv(self, type_name),
            (K.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, T.UINT32),
        ]

    def _stats(self, key: str) -> list[float]:
        value = self.processor.get(key)
        if not (isinstance(value, list) and len(value) == 3 and all(type(x) in (int, float) for x in value)):
            raise SlimtuneError(f"{self.processor_file}: {key} must be a list of 3 numbers (one per channel), found {value!r}")
        return [float(x) for x in value]


_VISION_COUNTS = ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _plain_qtype(t: StreamTensor, want: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The converter's rule for every family: 1-D tensors, norms and what is not a ``.weight`` F32, else ``want``."""
    return Q.F32 if len(t.shape) <= 1 or t.name.endswith("_norm.weight") or not t.name.endswith(".weight") else want


# --- SmolVLM / Idefics3 -----------------------------------------------------------------------------------


# --- SigLIP towers: SmolVLM / Idefics3 and Gemma 3 ---------------------------------------------------------


def _siglip_counts(x: VisionExport) -> dict[str, int]:
    return {k: _number(x.vision.get(k), f"vision_config.{k}", x.where) for k in _VISION_COUNTS}


def _siglip_check(x: VisionExport, shapes: dict[str, tuple[int, ...]], projector: dict, why: str) -> None:
    """The patch and position embeddings, each block's projections and the family's ``projector`` shapes."""
    n, v = x.counts, x.vision
    width, ff, patch = n["hidden_size"], n["intermediate_size"], n["patch_size"]
    want = {
        "v.patch_embd.weight": (width, v.get("num_channels", 3), patch, patch),
        "v.position_embd.weight": ((n["image_size"] // patch) ** 2, width),
        **projector,
    }
    for i in range(x.blocks):
        want |= {f"v.blk.{i}.attn_{p}.weight": (width, width) for p in ("q", "k", "v", "out")}
        want |= {f"v.blk.{i}.ffn_up.weight": (ff, width), f"v.blk.{i}.ffn_down.weight": (width, ff)}
    x.require(want, shapes, f"vision_config (image_size, patch_size, hidden_size, intermediate_size), {why}")


def _siglip_qtype(key: str, t: StreamTensor, want: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The embeddings (patch and position) F32 too (the converter's ``SmolVLMModel`` and ``Gemma3VisionModel``);
    Gemma 3's projection matrix F16 whatever the type (as the converter forces it)."""
    if t.name == "mm.input_projection.weight":
        return Q.F16
    return Q.F32 if ".embeddings." in key else _plain_qtype(t, want)


def _siglip_eps(x: VisionExport) -> tuple[str, object, gguf.GGUFValueType]:
    eps = _number(x.vision.get("layer_norm_eps", _LN_EPS), "vision_config.layer_norm_eps", x.where, float)
    return (K.ClipVision.Attention.LAYERNORM_EPS, float(eps), T.FLOAT32)


def _idefics3_tensors(x: VisionExport, t: StreamTensor) -> list[StreamTensor]:
    return [StreamTensor(x.gguf_name(t.name), t.shape, t.dtype, t.rows)]


def _idefics3_check(x: VisionExport, shapes: dict[str, tuple[int, ...]]) -> None:
    """The projector's input: the tower's width times the pixel shuffle's scale squared."""
    scale = _number(x.cfg.get("scale_factor", 2), "scale_factor", x.where)
    projector = {"mm.model.fc.weight": (x.text_hidden(), x.counts["hidden_size"] * scale * scale)}
    _siglip_check(x, shapes, projector, "scale_factor and text_config.hidden_size")


def _idefics3_kv(x: VisionExport, type_name: str) -> list[tuple[str, object, gguf.GGUFValueType]]:
    CV, where = K.ClipVision, x.where
    size = x.processor.get("size") if isinstance(x.processor.get("size"), dict) else {}
    preproc = _number(size.get("longest_edge", x.counts["image_size"]), f"{x.processor_file}: size.longest_edge", where)
    return [
        _siglip_eps(x),
        (CV.Projector.SCALE_FACTOR, _number(x.cfg.get("scale_factor", 2), "scale_factor", where), T.UINT32),
        (CV.USE_GELU, True, T.BOOL),
        (CV.PREPROC_IMAGE_SIZE, preproc, T.UINT32),
    ]


def _gemma3_tensors(x: VisionExport, t: StreamTensor) -> list[StreamTensor]:
    """transformers 5 saves SigLIP's tensors without the ``vision_model.`` its published checkpoints hold (and
    the gguf package's map names); the converter also reads ``mm_input_projection_weight`` as ``.weight``.
    The projector's norm as 1 + w (Gemma3RMSNorm computes x * (1 + w)), f32, one rounding (the file's)."""
    old, new = "vision_tower.", "vision_tower.vision_model."
    key = new + t.name.removeprefix(old) if t.name.startswith(old) and not t.name.startswith(new) else t.name
    name = x.gguf_name(key.replace("_weight", ".weight"))
    if name == "mm.soft_emb_norm.weight":
        return [StreamTensor(name, t.shape, torch.float32, lambda s, e: t.rows(s, e).float() + 1.0)]
    return [StreamTensor(name, t.shape, t.dtype, t.rows)]


def _gemma3_check(x: VisionExport, shapes: dict[str, tuple[int, ...]]) -> None:
    """The projector: a [width, text width] matrix after its RMSNorm; the pooling divides the patch grid."""
    _gemma3_scale(x)
    width = x.counts["hidden_size"]
    projector = {"mm.input_projection.weight": (width, x.text_hidden()), "mm.soft_emb_norm.weight": (width,)}
    _siglip_check(x, shapes, projector, "and text_config.hidden_size")


def _gemma3_kv(x: VisionExport, type_name: str) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """The pooling's kernel only where it is not the published 4 (896 / 14 / 16)."""
    scale = _gemma3_scale(x)
    return [_siglip_eps(x), (K.ClipVision.USE_GELU, True, T.BOOL)] + (
        [(K.ClipVision.Projector.SCALE_FACTOR, scale, T.UINT32)] if scale != 4 else []
    )


def _gemma3_scale(x: VisionExport) -> int:
    """Gemma 3's pooling kernel, as the converter computes it: patches a side over image tokens a side
    (``image_seq_length`` of the processor's config, 256 when absent); one line where it does not divide."""
    tokens = _number(x.processor.get("image_seq_length", 256), f"{x.processor_file}: image_seq_length", x.where)
    side = (x.vision["image_size"] // x.vision["patch_size"], int(tokens**0.5))
    if side[1] * side[1] != tokens or side[0] % side[1]:
        raise SlimtuneError(
            f"{x.processor_file}: image_seq_length {tokens} must be a square whose side divides the {side[0]} patches a side "
            "(vision_config.image_size / patch_size)"
        )
    return side[0] // side[1]


# --- Qwen2.5-VL -------------------------------------------------------------------------------------------

_QWEN25VL_IMAGE_SIZE = 560  # the converter's value where vision_config has no image_size
_QWEN25VL_NORM_EPS = 1e-6  # transformers' Qwen2.5-VL vision blocks and merger (fixed there, not a config key)
_QWEN25VL_FIXED = {"temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112, "hidden_act": "silu"}
"""vision_config values llama.cpp's qwen2.5vl graph assumes (its file has no key for them): two frames per
patch (the Conv3d split in two), 2 x 2 patches merged, windows of 112 pixels, the SiLU-gated MLP."""


def _qwen25vl_counts(x: VisionExport) -> dict[str, int]:
    v, where = x.vision, x.where
    keys = {"image_size": "image_size", "num_hidden_layers": "depth", "num_attention_heads": "num_heads"}
    out = {k: _number(v.get(keys.get(k, k)), f"vision_config.{keys.get(k, k)}", where) for k in _VISION_COUNTS if k != "image_size"}
    return {"image_size": _number(v.get("image_size", _QWEN25VL_IMAGE_SIZE), "vision_config.image_size", where), **out}


def _qwen25vl_tensors(x: VisionExport, t: StreamTensor) -> list[StreamTensor]:
    """The fused ``attn.qkv`` (weight and bias) as three entries of its thirds (q, k, v); the Conv3d patch
    embedding [width, channels, 2, patch, patch] as two Conv2d entries, one per frame
    (``v.patch_embd.weight`` and ``v.patch_embd.weight.1``); every other entry under its MMPROJ name."""
    key = t.name.removeprefix("model.")  # model.visual.x -> visual.x, the name map's
    if ".attn.qkv." in key:
        if t.num_rows % 3:
            raise SlimtuneError(f"{x.where}: tensor {t.name} has {t.num_rows} rows, not three equal parts (q, k, v)")
        third = t.num_rows // 3
        return [_row_range(t, x.gguf_name(key.replace(".qkv.", f".{p}.")), i * third, third) for i, p in enumerate("qkv")]
    if key.endswith("patch_embed.proj.weight"):
        if len(t.shape) != 5 or t.shape[2] != 2:
            raise SlimtuneError(
                f"{x.where}: tensor {t.name} is {list(t.shape)}; llama.cpp's qwen2.5vl takes a Conv3d of 2 frames "
                "[width, channels, 2, patch, patch] (vision_config.temporal_patch_size 2)"
            )
        name = x.gguf_name(key)
        return [_frame(t, name, 0), _frame(t, f"{name}.1", 1)]
    return [StreamTensor(x.gguf_name(key), t.shape, t.dtype, t.rows)]


def _row_range(t: StreamTensor, name: str, first: int, count: int) -> StreamTensor:
    """Rows [first, first + count) of ``t`` as an entry of their own."""
    return StreamTensor(name, (count, *t.shape[1:]), t.dtype, lambda s, e: t.rows(first + s, first + e))


def _frame(t: StreamTensor, name: str, frame: int) -> StreamTensor:
    """One frame of a Conv3d weight [out, in, frames, h, w]: the Conv2d weight [out, in, h, w]."""
    out, channels, _, h, w = t.shape
    return StreamTensor(name, (out, channels, h, w), t.dtype, lambda s, e: t.rows(s, e)[:, :, frame].contiguous())


def _qwen25vl_check(x: VisionExport, shapes: dict[str, tuple[int, ...]]) -> None:
    """The settings llama.cpp assumes (``_QWEN25VL_FIXED``), then the patch embedding's two frames, each
    block's projections, the merger's norm and MLP (its input: the tower's width times the 2 x 2 merge)
    and its output: the language model's width."""
    v, n = x.vision, x.counts
    for key, value in _QWEN25VL_FIXED.items():
        if v.get(key, value) != value:
            raise SlimtuneError(
                f"{x.where}: vision_config.{key} is {v[key]!r}; llama.cpp's qwen2.5vl mmproj assumes {value!r} "
                "(no key of its file says otherwise)"
            )
    width, ff, patch = n["hidden_size"], n["intermediate_size"], n["patch_size"]
    merged = width * 4
    want = {name: (width, v.get("in_channels", 3), patch, patch) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1")}
    for i in range(x.blocks):
        want |= {f"v.blk.{i}.attn_{p}.weight": (width, width) for p in ("q", "k", "v", "out")}
        want |= {f"v.blk.{i}.ffn_{p}.weight": (ff, width) for p in ("gate", "up")} | {f"v.blk.{i}.ffn_down.weight": (width, ff)}
    want |= {"v.post_ln.weight": (width,), "mm.0.weight": (merged, merged), "mm.2.weight": (x.text_hidden(), merged)}
    x.require(want, shapes, "vision_config (hidden_size, intermediate_size, patch_size, in_channels) and the language model's hidden_size")


def _qwen25vl_qtype(key: str, t: StreamTensor, want: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Both frames of the patch embedding F16 in an f16 file, F32 in any other (the converter's ``MmprojModel``)."""
    if t.name.startswith("v.patch_embd.weight"):
        return Q.F16 if want == Q.F16 else Q.F32
    return _plain_qtype(t, want)


def _qwen25vl_kv(x: VisionExport, type_name: str) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """``clip.use_silu``, the window attention's period (``n_wa_pattern``: every n-th block attends to the
    whole image, the others within windows) and the norms' epsilon."""
    full = x.vision.get("fullatt_block_indexes")
    if not (isinstance(full, list) and full and all(type(i) is int for i in full) and full[0] >= 0):
        raise SlimtuneError(f"{x.where}: vision_config.fullatt_block_indexes must be a non-empty list of block indexes, found {full!r}")
    period = full[0] + 1
    want = [i for i in range(x.blocks) if (i + 1) % period == 0]
    if full != want:
        raise SlimtuneError(
            f"{x.where}: vision_config.fullatt_block_indexes {full}: llama.cpp's qwen2.5vl attends to the whole image in "
            f"every {period}-th block from block {period - 1} on ({want} of {x.blocks} blocks), in no other pattern"
        )
    return [
        (K.ClipVision.USE_SILU, True, T.BOOL),
        (K.ClipVision.N_WA_PATTERN, period, T.UINT32),
        (K.ClipVision.Attention.LAYERNORM_EPS, _QWEN25VL_NORM_EPS, T.FLOAT32),
    ]


_FAMILIES: dict[str, _Family] = {
    "idefics3": _Family(
        gguf.VisionProjectorType.IDEFICS3,
        ("model.text_model.", "model."),
        ("model.vision_model.", "model.connector."),
        _siglip_counts,
        _idefics3_tensors,
        _idefics3_check,
        _siglip_qtype,
        _idefics3_kv,
    ),
    "gemma3": _Family(
        gguf.VisionProjectorType.GEMMA3,
        ("language_model.", ""),
        ("vision_tower.", "multi_modal_projector."),
        _siglip_counts,
        _gemma3_tensors,
        _gemma3_check,
        _siglip_qtype,
        _gemma3_kv,
    ),
    "qwen2_5_vl": _Family(
        gguf.VisionProjectorType.QWEN25VL,
        ("model.language_model.", "model."),  # transformers 5's module names; the published keys are the text family's
        ("visual.", "model.visual."),  # the published keys; transformers 5's module names
        _qwen25vl_counts,
        _qwen25vl_tensors,
        _qwen25vl_check,
        _qwen25vl_qtype,
        _qwen25vl_kv,
        text_model_type="qwen2_5_vl_text",
        blocks_key="depth",
    ),
}
"""Each vision family's ``_Family`` (the converter's mmproj class for it, its facts followed)."""


def _processor_config(dirs: list[Path]) -> tuple[dict, str]:
    """The image processor's settings as the converter merges them: preprocessor_config.json, then
    processor_config.json's ``image_processor`` over it, from the first of ``dirs`` that has either."""
    for d in dirs:
        merged, found = {}, None
        for name, inner in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
            path = Path(d) / name
            if path.is_file():
                try:
                    cfg = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    raise SlimtuneError(f"{path}: cannot read it as JSON: {e}") from None
                if not isinstance(cfg, dict):
                    raise SlimtuneError(f"{path}: expected a JSON object")
                sub = cfg.get(inner)
                merged |= {**cfg, **sub} if isinstance(sub, dict) else cfg
                found = str(path)
        if found is not None:
            return merged, found
    raise SlimtuneError(f"{dirs[0]}: no preprocessor_config.json or processor_config.json: the mmproj needs the image mean and std")
