"""The GGUF of a vision-language model is two files, as llama.cpp's ``convert_hf_to_gguf.py`` writes them:
the language model's GGUF (the text part of the checkpoint under the text family's names, as any text
model) and its ``mmproj`` GGUF (``--mmproj``: the vision tower and the projector, architecture ``clip``),
which llama.cpp's multimodal library (mtmd) loads beside the model. Both are plans over the same merged
tensor stream: this module splits the stream, names the vision tensors as the ``gguf`` package's MMPROJ
tensor map does, and gives the ``clip.*`` metadata and each tensor's GGML type as the converter's class for
the family does (facts followed, not code copied).

Families: SmolVLM / Idefics3 (``idefics3``: the converter's ``SmolVLMModel``, projector type ``idefics3``) and
Gemma 3 (``gemma3``: its ``Gemma3VisionModel``, projector type ``gemma3``: the SigLIP tower, the projector's
RMSNorm stored as 1 + w, its [vision, text] matrix always F16). Any other vision family is refused in one
line. Example::

    vision = vision_export(cfg, [ckpt])          # None for a text model
    text_cfg, text_stream = vision.text_part(stream)
    tensors = vision.tensors(stream)              # [(hf_key, GGUF entry)] of the mmproj file
    vision.kv("f16")                              # its clip.* metadata
"""

from __future__ import annotations

import json
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
    """Where a family's tensors are in its checkpoint (published keys) and how the converter names them."""

    projector: gguf.VisionProjectorType
    text: tuple[str, str]  # the language model's key prefix -> the text family's (the converter reads it so)
    vision: tuple[str, ...]  # key prefixes of the vision tower and the projector
    published: tuple[str, str]  # a vision key prefix -> the one the gguf package's map knows ("": as it is)


_FAMILIES = {
    "idefics3": _Family(
        gguf.VisionProjectorType.IDEFICS3, ("model.text_model.", "model."), ("model.vision_model.", "model.connector."), ("", "")
    ),
    # transformers 5 saves SigLIP's tensors without the ``vision_model.`` its published checkpoints hold (and
    # the gguf package's map names); the converter also reads ``mm_input_projection_weight`` as ``.weight``
    "gemma3": _Family(
        gguf.VisionProjectorType.GEMMA3,
        ("language_model.", ""),
        ("vision_tower.", "multi_modal_projector."),
        ("vision_tower.", "vision_tower.vision_model."),
    ),
}


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
        self.text = cfg.get("text_config")
        for key, value in (("vision_config", self.vision), ("text_config", self.text)):
            if not isinstance(value, dict):
                raise SlimtuneError(f"{where}: {key} must be an object, found {type(value).__name__}")
        self.blocks = _number(self.vision.get("num_hidden_layers"), "vision_config.num_hidden_layers", where)
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, self.blocks)
        self.processor, self.processor_file = _processor_config(dirs)

    def text_config(self) -> dict:
        """The language model's config as the converter reads it: the top level with ``text_config`` over it."""
        return {**self.cfg, **self.text}

    def text_part(self, stream: list[StreamTensor]) -> list[StreamTensor]:
        """The language model's entries of ``stream``, named as the text family's (``model.text_model.x``,
        ``language_model.model.x`` -> ``model.x``); the vision tower and projector left out."""
        (prefix, to), out = self.family.text, []
        for t in stream:
            if self._in_vision(t.name):
                continue
            name = to + t.name.removeprefix(prefix) if t.name.startswith(prefix) else t.name
            out.append(t if name == t.name else StreamTensor(name, t.shape, t.dtype, t.rows))
        return out

    def _in_vision(self, key: str) -> bool:
        return key.startswith(self.family.vision)

    def tensors(self, stream: list[StreamTensor]) -> list[tuple[str, StreamTensor]]:
        """(HF key, GGUF entry) of the mmproj file: the vision tower's and projector's entries of ``stream``
        in its order, under the ``gguf`` package's MMPROJ names (Gemma 3's projector norm as 1 + w, as
        llama.cpp reads it). An entry with no name there is one line."""
        (old, new), out = self.family.published, []
        for t in stream:
            if not self._in_vision(t.name):
                continue
            renamed = old and t.name.startswith(old) and not t.name.startswith(new)  # a published checkpoint has them already
            key = new + t.name.removeprefix(old) if renamed else t.name
            if self.model_type == "gemma3":
                key = key.replace("_weight", ".weight")
            name = self.names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise SlimtuneError(f"{self.where}: tensor {t.name} has no name in llama.cpp's mmproj ({self.name}) file")
            if not t.dtype.is_floating_point:
                raise SlimtuneError(f"tensor {t.name}: dtype {t.dtype} cannot be written to GGUF")
            if name == "mm.soft_emb_norm.weight":  # Gemma3RMSNorm computes x * (1 + w); f32, one rounding (the file's)
                out.append((t.name, StreamTensor(name, t.shape, torch.float32, lambda s, e, t=t: t.rows(s, e).float() + 1.0)))
                continue
            out.append((t.name, StreamTensor(name, t.shape, t.dtype, t.rows)))
        if not out:
            raise SlimtuneError(f"{self.where}: a {self.model_type} model, but the checkpoint holds no vision tensors")
        return out

    def check_tensors(self, tensors: list[tuple[str, StreamTensor]]) -> None:
        """The mmproj tensors against the shapes llama.cpp computes from the file's metadata (``kv``), before a
        byte is written: blocks 0..n-1 and no other, the patch and position embeddings, each block's
        projections and the projector's (Idefics3: the tower's width times the pixel shuffle's scale squared in;
        Gemma 3: a [width, text width] matrix after its RMSNorm)."""
        v, where = self.vision, self.where
        n = {k: _number(v.get(k), f"vision_config.{k}", where) for k in _VISION_COUNTS}
        width, ff, patch = n["hidden_size"], n["intermediate_size"], n["patch_size"]
        text = _number(self.text.get("hidden_size"), "text_config.hidden_size", where)
        if self.model_type == "gemma3":
            self._gemma3_scale()  # the pooling divides the patch grid
            projector = {"mm.input_projection.weight": (width, text), "mm.soft_emb_norm.weight": (width,)}
        else:
            scale = _number(self.cfg.get("scale_factor", 2), "scale_factor", where)
            projector = {"mm.model.fc.weight": (text, width * scale * scale)}
        shapes = {t.name: tuple(t.shape) for _, t in tensors}
        held = sorted({int(name.split(".")[2]) for name in shapes if name.startswith("v.blk.")})
        if held != list(range(self.blocks)):
            raise SlimtuneError(f"{where}: vision_config.num_hidden_layers is {self.blocks}, the checkpoint holds vision blocks {held}")
        want = {
            "v.patch_embd.weight": (width, v.get("num_channels", 3), patch, patch),
            "v.position_embd.weight": ((n["image_size"] // patch) ** 2, width),
            **projector,
        }
        for i in held:
            want |= {f"v.blk.{i}.attn_{x}.weight": (width, width) for x in ("q", "k", "v", "out")}
            want |= {f"v.blk.{i}.ffn_up.weight": (ff, width), f"v.blk.{i}.ffn_down.weight": (width, ff)}
        for name, shape in want.items():
            if shapes.get(name) != shape:
                found = "is missing" if name not in shapes else f"is {list(shapes[name])}"
                raise SlimtuneError(
                    f"{where}: mmproj tensor {name} {found}; vision_config (image_size, patch_size, hidden_size, intermediate_size), "
                    f"{'' if self.model_type == 'gemma3' else 'scale_factor '}and text_config.hidden_size need {list(shape)}"
                )

    def qtypes(self, tensors: list[tuple[str, StreamTensor]], type_name: str) -> list[gguf.GGMLQuantizationType]:
        """Each tensor's GGML type in an mmproj file of ``type_name``, as the converter chooses it: the
        embeddings (patch and position), 1-D tensors and norms F32; Gemma 3's projection matrix F16 whatever
        the type (as the converter forces it); every other tensor the file's type, F16 where a q8_0 row does not
        divide into blocks of 32 (the converter's fallback)."""
        want = _QTYPES[type_name]
        out = []
        for key, t in tensors:
            if t.name == "mm.input_projection.weight":
                out.append(Q.F16)
            elif ".embeddings." in key or len(t.shape) <= 1 or t.name.endswith("_norm.weight") or not t.name.endswith(".weight"):
                out.append(Q.F32)
            elif want == Q.Q8_0 and t.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
                out.append(Q.F16)
            else:
                out.append(want)
        return out

    def kv(self, type_name: str) -> list[tuple[str, object, gguf.GGUFValueType]]:
        """The mmproj file's metadata, in the converter's order (``general.name`` and ``general.size_label``,
        which it makes up from the directory's name and the parameter count, are not written)."""
        v, where, CV = self.vision, self.where, K.ClipVision
        need = {k: _number(v.get(k), f"vision_config.{k}", where) for k in _VISION_COUNTS}
        hidden = _number(self.text.get("hidden_size"), "text_config.hidden_size", where)
        mean, std = (self._stats(k) for k in ("image_mean", "image_std"))
        eps = _number(v.get("layer_norm_eps", _LN_EPS), "vision_config.layer_norm_eps", where, float)
        common = [
            (K.General.TYPE, gguf.GGUFType.MMPROJ, T.STRING),
            (K.General.FILE_TYPE, int(_FILE_TYPES[type_name]), T.UINT32),
            (K.Clip.HAS_VISION_ENCODER, True, T.BOOL),
            (CV.PROJECTION_DIM, hidden, T.UINT32),
            (CV.IMAGE_SIZE, need["image_size"], T.UINT32),
            (CV.PATCH_SIZE, need["patch_size"], T.UINT32),
            (CV.EMBEDDING_LENGTH, need["hidden_size"], T.UINT32),
            (CV.FEED_FORWARD_LENGTH, need["intermediate_size"], T.UINT32),
            (CV.BLOCK_COUNT, need["num_hidden_layers"], T.UINT32),
            (CV.Attention.HEAD_COUNT, need["num_attention_heads"], T.UINT32),
            (CV.IMAGE_MEAN, mean, T.FLOAT32),
            (CV.IMAGE_STD, std, T.FLOAT32),
            (K.Clip.PROJECTOR_TYPE, str(self.family.projector), T.STRING),
            (CV.Attention.LAYERNORM_EPS, float(eps), T.FLOAT32),
        ]
        if self.model_type == "gemma3":  # the pooling's kernel only where it is not the published 4 (896 / 14 / 16)
            scale = self._gemma3_scale()
            tail = [(CV.USE_GELU, True, T.BOOL)] + ([(CV.Projector.SCALE_FACTOR, scale, T.UINT32)] if scale != 4 else [])
        else:
            size = self.processor.get("size") if isinstance(self.processor.get("size"), dict) else {}
            preproc = _number(size.get("longest_edge", need["image_size"]), f"{self.processor_file}: size.longest_edge", where)
            scale = _number(self.cfg.get("scale_factor", 2), "scale_factor", where)
            tail = [(CV.Projector.SCALE_FACTOR, scale, T.UINT32), (CV.USE_GELU, True, T.BOOL), (CV.PREPROC_IMAGE_SIZE, preproc, T.UINT32)]
        return [*common, *tail, (K.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, T.UINT32)]

    def _gemma3_scale(self) -> int:
        """Gemma 3's pooling kernel, as the converter computes it: patches a side over image tokens a side
        (``image_seq_length`` of the processor's config, 256 when absent); one line where it does not divide."""
        tokens = _number(self.processor.get("image_seq_length", 256), f"{self.processor_file}: image_seq_length", self.where)
        side = (self.vision["image_size"] // self.vision["patch_size"], int(tokens**0.5))
        if side[1] * side[1] != tokens or side[0] % side[1]:
            raise SlimtuneError(
                f"{self.processor_file}: image_seq_length {tokens} must be a square whose side divides the {side[0]} patches a side "
                "(vision_config.image_size / patch_size)"
            )
        return side[0] // side[1]

    def _stats(self, key: str) -> list[float]:
        value = self.processor.get(key)
        if not (isinstance(value, list) and len(value) == 3 and all(type(x) in (int, float) for x in value)):
            raise SlimtuneError(f"{self.processor_file}: {key} must be a list of 3 numbers (one per channel), found {value!r}")
        return [float(x) for x in value]


_VISION_COUNTS = ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


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
