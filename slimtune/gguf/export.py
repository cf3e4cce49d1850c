"""GGUF export: the merged model's tensor stream (the same stream the safetensors save and the offline
merge write, ``slimtune.checkpoint.stream`` / ``slimtune.merge``) written as one GGUF file that
llama.cpp, Ollama and LM Studio load, in bounded memory, with no intermediate 16-bit checkpoint.

The file is planned from shapes alone before any byte is made (every tensor's GGML type, size and
offset), written through the ``gguf`` package's own writer for the header, metadata and tensor infos,
then the data section by row chunks: each chunk is merged in fp32, transformed for llama.cpp
(``slimtune.gguf.arch``), encoded (quantized on whole rows by ``slimtune.gguf.ggml``, ggml's
reference quantizers in torch on every core, so the bytes equal llama.cpp's quantization of the whole
tensor) and written by a writer thread while the next chunk is made, with the alignment padding between
tensors. Temporary sibling, fsync, rename: never a partial ``.gguf`` under the final name.

Example::

    result = export_gguf(Path("model-q8_0.gguf"), GGUFOptions("q8_0"), src=Path("runs/1/step-000100"))
    result.tensors, result.bytes
"""

from __future__ import annotations

import gc
import math
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import torch

from slimtune.diskio import DEFAULT_CHUNK_BYTES, DEFAULT_INFLIGHT_BYTES, DirectAppend, pipelined_write
from slimtune.errors import SlimtuneError
from slimtune.fileio import atomic_file, check_free_space, os_errors
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.gguf_types import MMPROJ_TYPES, PLAIN_TYPES, TYPE_NAMES
from slimtune.formats.hf import export_config_dict, read_model_config
from slimtune.formats.layout import CheckpointLayout
from slimtune.formats.manifest import ReadCheck, checks_done, read_check
from slimtune.formats.merge_source import MergeSource
from slimtune.gguf import ggml
from slimtune.gguf.arch import GGUFArch, gguf_arch
from slimtune.gguf.header import TensorInfo, write_head
from slimtune.gguf.mix import MIXES, MixModel, mix_types
from slimtune.gguf.mmproj import VisionExport, mmproj_path, vision_export
from slimtune.gguf.vocab import vocab_fields, write_modelfile
from slimtune.merge import MergeBase, merged_file_stream
from slimtune.tensors import StreamTensor, all_finite, dtype_size, row_chunks, scalar_source

Q = gguf.GGMLQuantizationType
TYPES = {name: Q[name.upper()] for name in PLAIN_TYPES}
"""Plain type name (``slimtune.formats.gguf_types``) -> the GGML type every 2-D weight takes: ``q8_0`` is Q8_0."""
_FILE_TYPES = {
    **{name: gguf.LlamaFileType.ALL_F32 if name == "f32" else gguf.LlamaFileType[f"MOSTLY_{name.upper()}"] for name in PLAIN_TYPES},
    **{name: ftype for name, (_, ftype) in MIXES.items()},
}
"""Every type name -> the general.file_type llama.cpp's converter (or llama-quantize) writes."""
_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_F32_TENSORS = (gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.ROPE_FREQS)  # kept F32 by llama.cpp's converter


@dataclass(frozen=True)
class GGUFOptions:
    """How a GGUF file is written (what it is written from: ``MergeSource``). Example: ``GGUFOptions("q8_0", overwrite=True)``."""

    type: str = "f16"
    """One of ``slimtune.formats.gguf_types.TYPE_NAMES``: a plain type (``PLAIN_TYPES``), the type of every 2-D
    weight (norms, biases and position embeddings stay f32, as llama.cpp's converter keeps them); or a
    K-quant mix (``MIX_TYPES``): each tensor's type as llama-quantize chooses it (``slimtune.gguf.mix``)."""
    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES // 2
    """fp32 bytes of one chunk of rows (at least one row); the quantizers' numpy temporaries are several
    times this, hence half the safetensors writer's chunk."""
    progress: bool = False
    dry_run: bool = False
    """Plan only: the result holds the plan and the file's size; nothing is written."""
    mmproj_type: str = "f16"
    """A vision-language model's mmproj file (``slimtune.gguf.mmproj``): one of ``MMPROJ_TYPES``."""


@dataclass(frozen=True)
class GGUFSlot:
    """One tensor of the file: its rows (fp32, GGUF name), GGML type, bytes and offset in the data section."""

    source: StreamTensor
    hf_key: str
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    offset: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // max(1, self.source.num_rows)


@dataclass(frozen=True)
class GGUFPlan:
    slots: tuple[GGUFSlot, ...]
    data_bytes: int
    alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT


@dataclass(frozen=True)
class GGUFResult:
    path: Path
    type: str
    tensors: int
    bytes: int
    """Bytes written, header and padding included (equals the file's size)."""
    seconds: float
    modelfile: Path | None
    plan: GGUFPlan | None = None
    mmproj: GGUFResult | None = None
    """A vision-language model's mmproj file (its path, tensors, bytes and plan), written beside ``path``."""


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def tensor_type(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """The GGML type of one tensor in a file of ``qtype``: 1-D tensors, norms, the MoE router, position
    embeddings and rope factors stay F32 (llama.cpp's converter rule); every other tensor takes ``qtype``."""
    f32_names = tuple(gguf.TENSOR_NAMES[t] + "." for t in _F32_TENSORS)
    if len(shape) <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight")) or name.startswith(f32_names):
        return Q.F32
    return qtype


def _check_type(type_name: str) -> None:
    if type_name not in TYPE_NAMES:
        raise SlimtuneError(f"GGUF type {type_name!r}: expected one of {', '.join(TYPE_NAMES)}")


def plan_gguf(tensors: list[tuple[str, StreamTensor]], type_name: str, model: MixModel | None = None) -> GGUFPlan:
    """Types, sizes and data offsets of every tensor, from shapes alone. ``tensors`` pairs each HF key
    with its GGUF entry; a mix needs the ``model`` its rules look at. A row that does not divide into a
    plain type's blocks is one error line (a mix falls back as llama.cpp does)."""
    _check_type(type_name)
    if type_name in MIXES:
        if model is None:
            raise ValueError("a K-quant mix needs the model (MixModel)")
        chosen = mix_types(type_name, [(t.name, t.shape) for _, t in tensors], model)
        qtypes = [Q.F32 if q is None else q for q in chosen]
    else:
        qtypes = [tensor_type(t.name, t.shape, TYPES[type_name]) for _, t in tensors]
    return plan_slots(tensors, qtypes, type_name)


def plan_slots(tensors: list[tuple[str, StreamTensor]], qtypes: list[gguf.GGMLQuantizationType], type_name: str) -> GGUFPlan:
    """The plan of ``tensors`` (HF key, GGUF entry) with the GGML types chosen: sizes and aligned offsets.
    A row that does not divide into its type's blocks is one error line."""
    slots, offset = [], 0
    for (key, t), qtype in zip(tensors, qtypes, strict=True):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        cols = t.shape[-1] if t.shape else 1
        if cols % block:
            raise SlimtuneError(
                f"tensor {key} ({t.name} {list(t.shape)}): rows of {cols} values do not divide into {type_name}'s blocks of {block}; "
                f"choose f16, bf16 or f32"
            )
        nbytes = math.prod(t.shape) // block * size
        slots.append(GGUFSlot(t, key, qtype, nbytes, offset))
        offset += _pad(nbytes, gguf.GGUF_DEFAULT_ALIGNMENT)
    return GGUFPlan(tuple(slots), offset)


def encode_rows(rows: torch.Tensor, qtype: gguf.GGMLQuantizationType, quantizer: ggml.Quantizer | None = None):
    """Float rows (float32, or 16-bit as stored: exact in float32) as the file stores them (one rounding):
    a cast for F32/F16/BF16, ``slimtune.gguf.ggml`` (ggml's reference quantizers in torch) for the block
    types. Returns a function that gives the bytes as flat uint8 tensors, in order (a block type goes to
    ``quantizer``'s threads meanwhile, when one is given, and comes back as its pieces, not joined); it
    raises ``FloatingPointError`` where a value (or a legacy block's scale) overflows float16, and a block
    type ``ggml.NonFiniteError`` where a value is NaN or infinite (the F32/F16/BF16 casts do not check:
    ``_data_chunks`` does)."""
    if qtype in _TORCH:
        out = rows.to(_TORCH[qtype]).contiguous()
        if qtype == Q.F16 and not all_finite(out):
            raise FloatingPointError("float16 overflow")
        data = [out.view(-1).view(torch.uint8)]
        return lambda: data
    if quantizer is not None:
        return quantizer.submit_parts(rows, qtype.name, finite=True)
    data = [ggml.quantize(rows, qtype.name, finite=True)]
    return lambda: data


def _data_chunks(plan: GGUFPlan, chunk_bytes: int, start: int, quantizer: ggml.Quantizer | None = None) -> Iterator[torch.Tensor]:
    """The data section: alignment padding, then each tensor by row chunks, each followed by its padding.
    A chunk is quantized on ``quantizer``'s threads while the next one is made (two in flight at most).
    A block type's quantizer finds NaN and infinities from its own block reductions, on its threads;
    F32/F16/BF16 rows are checked here."""
    yield torch.zeros(_pad(start, plan.alignment) - start, dtype=torch.uint8)
    for slot in plan.slots:
        t = slot.source
        cols = t.shape[-1] if len(t.shape) > 1 else 1
        made, pending = 0, deque()
        nonfinite = f"tensor {slot.hf_key}: holds NaN or infinite values; llama.cpp would compute garbage from them"
        try:
            for rows in row_chunks(t, chunk_bytes * dtype_size(t.dtype) // 4):  # as many rows as chunk_bytes of fp32
                if slot.qtype in _TORCH and not all_finite(rows):
                    raise SlimtuneError(nonfinite)
                pending.append(encode_rows(rows.reshape(-1, cols), slot.qtype, quantizer))
                while len(pending) > (1 if quantizer is not None else 0):
                    for out in pending.popleft()():
                        made += out.numel()
                        yield out
            while pending:
                for out in pending.popleft()():
                    made += out.numel()
                    yield out
        except ggml.NonFiniteError:
            raise SlimtuneError(nonfinite) from None
        except FloatingPointError:
            raise SlimtuneError(
                f"tensor {slot.hf_key}: values too large for {slot.qtype.name} (they overflow float16); choose bf16 or f32"
            ) from None
        if made != slot.nbytes:
            raise SlimtuneError(f"tensor {slot.hf_key}: {made} bytes made, the plan says {slot.nbytes}")
        yield torch.zeros(_pad(slot.nbytes, plan.alignment) - slot.nbytes, dtype=torch.uint8)


def write_gguf(path: Path, arch: GGUFArch, kv: list[tuple], plan: GGUFPlan, options: GGUFOptions, before_rename=None) -> int:
    """Header, metadata and tensor infos through ``gguf.GGUFWriter`` (``slimtune.gguf.header``), then the
    data by row chunks appended through a descriptor of its own, into a temporary sibling renamed onto
    ``path`` once complete (and ``before_rename()`` returned: the sources' hash checks). Returns the
    bytes written (the file size)."""
    check_free_space(path.parent, plan.data_bytes)
    with atomic_file(path) as tmp, os_errors("write", path, plan.data_bytes):
        with _collector_paused():
            start = write_head(tmp, arch.name, kv, _tensor_infos(plan))
        fd = os.open(tmp, os.O_WRONLY)
        try:
            sink = DirectAppend(tmp, fd, start)  # the data bypass the page cache: nothing reads them back
            try:
                with ggml.Quantizer() as quantizer:
                    pipelined_write(sink, _data_chunks(plan, options.chunk_bytes, start, quantizer), DEFAULT_INFLIGHT_BYTES)
            except BaseException:
                sink.abandon()
                raise
            size = sink.close()
        finally:
            os.close(fd)
        if size != _pad(start, plan.alignment) + plan.data_bytes or os.path.getsize(tmp) != size:
            raise SlimtuneError(f"{path}: wrote {size:,} bytes, the plan says {_pad(start, plan.alignment) + plan.data_bytes:,}")
        if before_rename is not None:
            before_rename()
    return size


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the metadata is made and packed (the vocabulary's and
    merges' ~10^5 small objects): each collection they trigger walks the whole process's objects (torch's
    and transformers' too) for nothing, ~0.2-0.3 s of an 8B export's serial set-up. Reference counting
    still frees what is dropped; the collector is back on (if it was) before the data phase."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tensor_infos(plan: GGUFPlan) -> list[TensorInfo]:
    """Every tensor's info in the file's order: its GGUF name, shape as the file lists it, bytes and type."""
    return [(s.source.name, getattr(s.source, "file_shape", None) or s.source.shape or (1,), s.nbytes, s.qtype) for s in plan.slots]


def planned_size(arch: GGUFArch, kv: list[tuple], plan: GGUFPlan) -> int:
    """The size of the file ``write_gguf`` would write: the header, metadata and tensor infos (serialized
    by the gguf package into a scratch file, a few MB at most), padded, then the planned data."""
    with tempfile.TemporaryDirectory(prefix="slimtune-gguf-plan-") as scratch:
        start = write_head(Path(scratch) / "header.gguf", arch.name, kv, _tensor_infos(plan))
    return _pad(start, plan.alignment) + plan.data_bytes


# --- sources ---------------------------------------------------------------------------------------------


@dataclass
class _Source:
    config: dict
    stream: list[StreamTensor]
    model_dir: Path
    """Where the tokenizer files are."""
    config_dir: Path
    record: dict
    """What training recorded in slimtune_format.json (chat template), if anything."""
    checks: tuple[ReadCheck | None, ...] = ()
    """The sha256 checks of the checkpoints read (``read_check``), done before the file is renamed into place."""


@contextmanager
def open_source(source: MergeSource, one_pass: bool = True) -> Iterator[_Source]:
    """The merged model as an fp32 tensor stream: the checkpoint's merged model, or an adapter
    (``source.adapter``, or the checkpoint's ``adapter/``) merged on the fly into ``source.base`` exactly as
    ``slimtune merge`` merges it. With ``source.verify``, each checkpoint read that has a manifest is checked
    (``_Source.checks``): its small files before anything parses them, its weights, with ``one_pass`` (the
    caller reads the stream once), hashed from the bytes the export reads (no second read), else by a pass
    of their own. With ``one_pass`` the files are read ahead and let go behind
    (``BaseCheckpoint(drop_behind=True)``)."""
    resolved = MergeBase.named(source.merge_base)  # the row reader it means
    src, base, verify = source.checkpoint, source.base, source.verify
    if src is not None and not src.is_dir():
        raise SlimtuneError(f"{src}: no such checkpoint directory")
    if src is not None and source.adapter is None and base is None and CheckpointLayout(src).has_merged:
        check = read_check(src, verify, fold=one_pass)  # one pass: hashed from the export's own reads
        reader = BaseCheckpoint(src, check=check, drop_behind=one_pass)
        try:
            stream = [_plain(reader, k) for k in reader.keys]
            yield _Source(reader.config, stream, src, src, source.record, (check,))
        finally:
            reader.close()
        return
    adapter = source.adapter_dir
    if adapter is None:
        raise SlimtuneError(f"{src}: neither a merged model (config.json, *.safetensors) nor an adapter; pass --base and --adapter")
    if base is None:
        raise SlimtuneError(f"{adapter}: an adapter needs the base it was trained on: pass --base DIR (or a hub id)")
    from slimtune.formats.peft import read_adapter

    lora = read_adapter(adapter)
    checks = (read_check(lora.path, verify), read_check(base, verify, fold=one_pass))
    reader = BaseCheckpoint(base, check=checks[1], drop_behind=one_pass)
    try:
        stream = merged_file_stream(reader, lora, torch.float32, resolved, keep_dtype=True)  # widened a piece at a time
        config = export_config_dict(reader.config, stream)
        yield _Source(config, stream, source.tokenizer_dir(reader.dir), reader.dir, source.record, checks)
    finally:
        reader.close()


def _plain(reader: BaseCheckpoint, key: str) -> StreamTensor:
    """A merged checkpoint's tensor: rows as stored when a float type the encoders take (widened to float32
    a piece at a time by the quantizer, or cast once by ``encode_rows``), float32 otherwise."""
    shape = tuple(reader.shape(key))
    if not shape:
        return scalar_source(key, torch.float32, lambda: reader.rows(key, 0, None))
    if reader.dtype(key) in _TORCH.values():
        return StreamTensor(key, shape, reader.dtype(key), lambda s, e: reader.rows(key, s, e))
    return StreamTensor(key, shape, torch.float32, lambda s, e: reader.rows(key, s, e).float())


def gguf_tensors(arch: GGUFArch, stream: list[StreamTensor]) -> list[tuple[str, StreamTensor]]:
    """(HF key, GGUF entry) for every tensor llama.cpp reads, in the stream's order, extras first."""
    out = [(t.name, t) for t in arch.extra_tensors()]
    for t in arch.stack_experts(stream):
        if not t.dtype.is_floating_point:
            raise SlimtuneError(f"tensor {t.name}: dtype {t.dtype} cannot be written to GGUF")
        g = arch.tensor(t)
        if g is not None:
            out.append((t.name, g))
    names = [g.name for _, g in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SlimtuneError(f"GGUF tensor {dup} would be written twice")
    return out


def _with_norm_eps(cfg: dict, hf_config) -> dict:
    """config.json with the norm epsilon transformers computes with where the file has none (its config
    class's default): llama.cpp requires the key, and refuses a file without it."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    defaults = {k: getattr(text_config, k, None) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if k not in cfg}
    return {**cfg, **{k: v for k, v in defaults.items() if v is not None}}


def export_gguf(out: Path, options: GGUFOptions, source: MergeSource) -> GGUFResult:
    """Write the merged model of ``source`` (a checkpoint's merged model, or an adapter merged into its
    base) as one GGUF file at ``out``, with the tokenizer's vocabulary and chat template, and a Modelfile
    beside it for Ollama. A vision-language model's language model goes to ``out`` and its vision tower and
    projector to the mmproj file beside it (``slimtune.gguf.mmproj``; ``GGUFResult.mmproj``), from the same
    stream; neither file is renamed into place before both are complete and the sources' hashes matched.
    Example: ``export_gguf(Path("m.gguf"), GGUFOptions("bf16"), MergeSource(Path("base"), Path("run/step-000010")))``"""
    out = Path(out)
    _check_type(options.type)
    if options.mmproj_type not in MMPROJ_TYPES:
        raise SlimtuneError(f"mmproj type {options.mmproj_type!r}: expected one of {', '.join(MMPROJ_TYPES)}")
    if out.exists() and not options.overwrite and not options.dry_run:
        raise SlimtuneError(f"{out} already exists; pass --overwrite to replace it")
    started = time.perf_counter()
    with open_source(replace(source, verify=source.verify and not options.dry_run)) as source:
        hf_config = read_model_config(source.config_dir)
        where = str(source.model_dir / "config.json")
        vision = vision_export(source.config, [source.model_dir, source.config_dir], where)
        text_config = source.config if vision is None else vision.text_config()
        arch = gguf_arch(_with_norm_eps(text_config, hf_config), where)
        tensors = gguf_tensors(arch, source.stream if vision is None else vision.text_part(source.stream))
        arch.check_tensors([g for _, g in tensors])
        plan = plan_gguf(tensors, options.type, MixModel(arch.name, arch.layers, arch.heads, arch.kv_heads, arch.experts))
        mm = None if vision is None else _mmproj_plan(out, options, vision, source.stream)
        template = source.record.get("chat_template")
        with _collector_paused():
            kv = [
                (gguf.Keys.General.TYPE, gguf.GGUFType.MODEL, gguf.GGUFValueType.STRING),  # as llama.cpp's converter writes it
                (gguf.Keys.General.FILE_TYPE, int(_FILE_TYPES[options.type]), gguf.GGUFValueType.UINT32),
                (gguf.Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, gguf.GGUFValueType.UINT32),
                *arch.kv(),
                *vocab_fields(source.model_dir, hf_config, template),
            ]
        if options.dry_run:
            seconds = time.perf_counter() - started
            side = None if mm is None else GGUFResult(mm.path, options.mmproj_type, len(mm.plan.slots), mm.size(), seconds, None, mm.plan)
            return GGUFResult(out, options.type, len(plan.slots), planned_size(arch, kv, plan), seconds, None, plan, side)
        try:
            size, mm_size = _write_files(out, (arch, kv, plan), mm, options, source.checks)
        except SlimtuneError:
            checks_done(*source.checks)  # damaged bytes are the cause of what they made fail: say so
            raise
    projector = None if mm is None else mm.path
    modelfile = write_modelfile(out, source.model_dir, template, source.record.get("system_prompt"), projector=projector)
    seconds = time.perf_counter() - started
    side = None if mm is None else GGUFResult(mm.path, options.mmproj_type, len(mm.plan.slots), mm_size, seconds, None, mm.plan)
    return GGUFResult(out, options.type, len(plan.slots), size, seconds, modelfile, plan, side)


def _write_files(out: Path, model: tuple, mm: _MmprojPlan | None, options: GGUFOptions, checks: tuple) -> tuple[int, int | None]:
    """The model's file (``model``: its arch, metadata and plan), then the mmproj file if any, each complete
    in its temporary sibling, then the sources' hashes; only then the mmproj and the model's file are
    renamed into place. Returns both sizes (None: no mmproj)."""
    sizes = []

    def then() -> None:  # the model's file is complete: the mmproj (if any), then the hashes, before any rename
        if mm is not None:
            sizes.append(write_gguf(mm.path, mm.vision, mm.kv, mm.plan, options, lambda: checks_done(*checks)))
        else:
            checks_done(*checks)

    size = write_gguf(out, *model, options, then)
    return size, sizes[0] if sizes else None


@dataclass(frozen=True)
class _MmprojPlan:
    path: Path
    vision: VisionExport
    kv: list[tuple]
    plan: GGUFPlan

    def size(self) -> int:
        return planned_size(self.vision, self.kv, self.plan)


def _mmproj_plan(out: Path, options: GGUFOptions, vision: VisionExport, stream: list[StreamTensor]) -> _MmprojPlan:
    """The mmproj file of a vision-language model: its path beside ``out``, metadata and plan."""
    path = mmproj_path(out, options.type, options.mmproj_type)
    if path.exists() and not options.overwrite and not options.dry_run:
        raise SlimtuneError(f"{path} already exists; pass --overwrite to replace it")
    tensors = vision.tensors(stream)
    vision.check_tensors(tensors)
    plan = plan_slots(tensors, vision.qtypes(tensors, options.mmproj_type), options.mmproj_type)
    return _MmprojPlan(path, vision, vision.kv(options.mmproj_type), plan)


def export_checkpoint_gguf(checkpoint: Path, type_name: str, base: Path, verify: bool = True) -> GGUFResult:
    """What ``checkpoint.gguf: TYPE`` writes after training: ``model-TYPE.gguf`` (+ Modelfile) beside the
    final checkpoint (in the run directory: the checkpoint stays as its manifest lists it), from its
    merged model, or from its adapter merged into dequant(NF4(base)) (the weights training saw) when
    the checkpoint holds no merged model. ``verify``: the checkpoint's hashes checked while it is read
    (``checkpoint.gguf_verify``).
    Example: ``export_checkpoint_gguf(Path("runs/1/step-000100"), "q8_0", Path("base"))``"""
    out = Path(checkpoint).parent / f"model-{type_name}.gguf"
    merged = CheckpointLayout(checkpoint).has_merged
    source = MergeSource.resolve(checkpoint, None if merged else Path(base), verify=verify)
    return export_gguf(out, GGUFOptions(type_name, overwrite=True), source)
