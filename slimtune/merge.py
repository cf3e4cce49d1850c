"""Offline merge straight from files: a Hugging Face base checkpoint (bf16/fp16/fp32, or bitsandbytes
NF4) plus a PEFT LoRA adapter -> merged sharded safetensors, through the same tensor stream and writer
as the in-training save. Base tensors are read by row range into small buffers (never whole files),
so memory is one chunk plus the adapter, whatever the model size."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slimtune.checkpoint.save import CheckpointParts, SaveResult, write_checkpoint
from slimtune.checkpoint.staging import pool_for
from slimtune.checkpoint.staging import to_host as plain_to_host
from slimtune.checkpoint.writer import WriteOptions
from slimtune.diskio import DEFAULT_CHUNK_BYTES
from slimtune.distributed import SINGLE, Ranks
from slimtune.errors import SlimtuneError
from slimtune.families import frozen_nf4_keys, model_key_names
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.hf import export_config_dict, read_model_config
from slimtune.formats.manifest import TAP_HOLDS, checks_done, read_check
from slimtune.formats.merge_source import MERGE_BASES, MergeSource, check_merge_base
from slimtune.formats.peft import Adapter, AdapterModule, SavedTensor, read_adapter, resolve
from slimtune.formats.safetensors import COMPUTE_DTYPES
from slimtune.formats.strict_json import safe_name
from slimtune.lora import lora_row_merge
from slimtune.tensors import StreamTensor, ToHost, all_finite, scalar_source

log = logging.getLogger(__name__)

# Tied checkpoints store only the input embedding (Llama, Mistral, Qwen2 names); an adapter that changes
# lm_head unties them, and lm_head is then written from the embedding's rows.
INPUT_EMBEDDING, OUTPUT_EMBEDDING = "model.embed_tokens.weight", "lm_head.weight"


def _finite(rows: torch.Tensor, key: str, adapter: Adapter) -> torch.Tensor:
    if not all_finite(rows):
        raise SlimtuneError(f"adapter {adapter.path}: modules_to_save tensor {safe_name(key)} holds NaN or infinite values")
    return rows


@dataclass(frozen=True)
class MergeBase:
    """``merge_base`` resolved once into the row reader it selects: ``original`` merges into W itself,
    ``quantized`` into dequant(NF4(W)), the weights a QLoRA adapter was trained against (computed
    ``chunk_bytes`` at a time; bitsandbytes bases are NF4 already and read as they are).

    Example: ``rows = MergeBase.named("quantized").reader(base, "model.layers.0.mlp.up_proj.weight")``"""

    quantized: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @classmethod
    def named(cls, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> MergeBase:
        """The row reader of a merge base's name (``original`` or ``quantized``, ``check_merge_base``)."""
        return cls(check_merge_base(name) == "quantized", chunk_bytes)

    @property
    def name(self) -> str:
        return MERGE_BASES[self.quantized]

    def reader(self, base: BaseCheckpoint, key: str) -> Callable[[int, int], torch.Tensor]:
        """Rows of the base weight ``key`` that the adapter is merged into."""
        if not self.quantized or key in base.bnb:
            return lambda s, e: base.rows(key, s, e)
        if base.dtype(key) is None or not base.dtype(key).is_floating_point:
            raise SlimtuneError(
                f"{base.dir}: tensor {safe_name(key)} has dtype {base.location[key].entry(key).type_name}; "
                "--merge-base quantized rounds a floating-point weight through NF4, an integer one has no NF4 form"
            )
        # torchao (~80 MB of RSS) is imported only when a merge needs NF4: never for an original-base merge
        from slimtune.quant.nf4 import NF4RoundTrip, can_quantize, not_quantizable_reason

        shape = base.shape(key)
        if not can_quantize(shape):  # training kept it in its dtype too
            why = not_quantizable_reason(shape)
            log.warning("%s: %s %s cannot be NF4 (%s); merged into the original weight", base.dir, key, list(shape), why)
            return lambda s, e: base.rows(key, s, e)
        state: dict[str, NF4RoundTrip] = {}

        def rows(s: int, e: int) -> torch.Tensor:
            if "rt" not in state:  # first pass over W only when the tensor's turn comes
                row_bytes = shape[1] * 2
                state["rt"] = NF4RoundTrip(lambda a, b: base.rows(key, a, b), shape, base.dtype(key), max(1, self.chunk_bytes // row_bytes))
            return state["rt"].rows(s, e)

        return rows


def check_fits(key: str, shape: tuple[int, ...], m: AdapterModule, adapter: Adapter) -> tuple[int, int]:
    """(out, in) of the LoRA target ``key`` of base ``shape``: A must be [r, in] and B [out, r] (one error line otherwise)."""
    where = f"adapter {adapter.path}, module {m.name}"
    if len(shape) != 2:
        raise SlimtuneError(f"{where}: base tensor {key} has shape {list(shape)}, a LoRA target must be 2-D")
    out_f, in_f = (shape[1], shape[0]) if m.transposed else shape
    if tuple(m.lora_a.shape) != (m.rank, in_f) or tuple(m.lora_b.shape) != (out_f, m.rank):
        raise SlimtuneError(
            f"{where}: lora_A {list(m.lora_a.shape)} and lora_B {list(m.lora_b.shape)} do not fit base {key} {list(shape)} "
            f"(expected [{m.rank}, {in_f}] and [{out_f}, {m.rank}])"
        )
    return out_f, in_f


def adapter_targets(adapter: Adapter, base: BaseCheckpoint) -> tuple[dict[str, AdapterModule], dict[str, SavedTensor]]:
    """The adapter resolved against ``base`` as PEFT would (``resolve``), in the model's names (a
    vision-language base's keys renamed as transformers loads them, ``model_key_names``): its LoRA modules
    and modules_to_save tensors keyed by the base's tensor keys (a key the base lacks, such as a tied
    ``lm_head.weight``, as it is).

    Example: ``targets, saved = adapter_targets(read_adapter("run/step-10"), BaseCheckpoint("base"))``"""
    kinds, output_name = base.module_kinds
    present = set(base.location) | set(base.bnb)
    names = model_key_names(base.dir, present)
    if names:
        kinds = {names.get(f"{m}.weight", f"{m}.weight").removesuffix(".weight"): kind for m, kind in kinds.items()}
        present = set(names.values())
    resolve(adapter, kinds, output_name, present)
    to_base = {name: key for key, name in names.items()}
    targets = {to_base.get(f"{name}.weight", f"{name}.weight"): m for name, m in adapter.modules.items()}
    return targets, {to_base.get(key, key): t for key, t in adapter.saved_modules.items()}


@dataclass(frozen=True)
class MergeDevice:
    """Where the merge math of each chunk runs and how its rows come back to the host (``ToHost``): the
    two travel together. Example: ``MergeDevice(torch.device("cuda"), pool.to_host)``"""

    device: torch.device = torch.device("cpu")
    to_host: ToHost = plain_to_host


def _merged_source(
    key: str,
    base: BaseCheckpoint,
    m: AdapterModule,
    adapter: Adapter,
    dtype: torch.dtype,
    merge_base: MergeBase,
    on: MergeDevice,
    replaced: SavedTensor | None = None,
):
    shape = base.shape(key)
    if replaced is not None and tuple(replaced.shape) != tuple(shape):
        raise SlimtuneError(f"adapter {adapter.path}: saved weight of {key} {list(replaced.shape)} vs base {list(shape)}")
    where = f"adapter {adapter.path}, module {m.name}"
    out_f, _ = check_fits(key, tuple(shape), m, adapter)
    if m.magnitude is not None and tuple(m.magnitude.shape) != (out_f,):
        raise SlimtuneError(f"{where}: DoRA magnitude {list(m.magnitude.shape)} does not fit base {key} {list(shape)}")
    if replaced is not None:
        read_rows = replaced.rows
    else:
        read_rows = merge_base.reader(base, key)
    device, to_host = on.device, on.to_host
    a, b = m.lora_a.float().to(device), m.lora_b.float().to(device)
    magnitude = None if m.magnitude is None else m.magnitude.to(device)
    merged = lora_row_merge(a, b, m.scaling, transposed=m.transposed, magnitude=magnitude)  # W [in, out] when transposed

    def rows(s: int, e: int) -> torch.Tensor:
        w = read_rows(s, e).to(device)
        out = to_host(merged(w, s, e), dtype)
        if not all_finite(out) and all_finite(w):
            raise SlimtuneError(
                f"{where}: merging into {key} gives non-finite values in {dtype} "
                f"(scaling {m.scaling:g} from lora_alpha {m.alpha:g}, r {m.rank})"
            )
        return out

    return StreamTensor(key, tuple(shape), dtype, rows)


def merged_file_stream(
    base: BaseCheckpoint,
    adapter: Adapter,
    dtype: torch.dtype | None = None,
    merge_base: MergeBase = MergeBase(),
    on: MergeDevice = MergeDevice(),
    keep_dtype: bool = False,
) -> list[StreamTensor]:
    """The merged model as a tensor stream, in the base's tensor order. Every adapter module must land
    on a base weight of the right shape; errors name the module, the tensor and the shapes. With a CUDA
    device in ``on`` the merge math of each chunk runs there (reads and writes stay on the host). With
    ``keep_dtype``, the tensors no adapter computes (read as they are stored) keep their stored dtype
    rather than ``dtype``: no rounding and no wider copy of them (the GGUF export widens a piece at a
    time, in its quantizer's cache-sized pieces).

    Example: ``stream = merged_file_stream(BaseCheckpoint(base_dir), read_adapter(adapter_dir), torch.bfloat16)``"""
    to_host = on.to_host
    targets, saved = adapter_targets(adapter, base)
    keys = list(base.keys)
    tied = base.config.get("tie_word_embeddings", False)
    wanted_extra = [k for k in list(targets) + list(saved) if k not in base.location and k not in keys]
    for key in wanted_extra:
        if tied and key == OUTPUT_EMBEDDING and INPUT_EMBEDDING in base.location:
            keys.append(key)  # untie: the adapter changes lm_head but not the embedding
        else:
            raise SlimtuneError(f"adapter {adapter.path}: target module {key.rsplit('.', 1)[0]} is missing from base {base.dir}")
    frozen_nf4 = set()
    # MoE experts were NF4 in training too (slimtune.families); transformers is imported only for a base
    # that has expert tensors at all
    if merge_base.quantized and any(".experts." in k for k in base.keys):
        frozen_nf4 = frozen_nf4_keys(read_model_config(base.dir))
    stream = []
    for key in keys:
        source_key = INPUT_EMBEDDING if key not in base.location and key not in base.bnb else key
        src_dtype = base.dtype(source_key)
        if src_dtype is None:
            name = base.location[source_key].entry(source_key).dtype_name
            raise SlimtuneError(f"{base.dir}: tensor {safe_name(source_key)} has dtype {name}, which slimtune cannot pass through a merge")
        # only the float formats a merge computes in are cast; int, fp8 and complex tensors pass through unchanged
        out_dtype = (dtype or src_dtype) if src_dtype in COMPUTE_DTYPES else src_dtype
        read_dtype = src_dtype if keep_dtype else out_dtype  # a tensor only read
        if key in saved and key not in targets:
            t = saved.pop(key)
            if tuple(t.shape) != tuple(base.shape(source_key)):
                raise SlimtuneError(
                    f"adapter {adapter.path}: modules_to_save tensor {key} {list(t.shape)} vs base {list(base.shape(source_key))}"
                )
            stream.append(
                StreamTensor(
                    key,
                    tuple(t.shape),
                    out_dtype,
                    lambda s, e, t=t, d=out_dtype, k=key: _finite(t.rows(s, e), k, adapter).to(d).contiguous(),
                )
            )
        elif key in targets:
            m = targets[key]
            if source_key != key:
                raise SlimtuneError(f"adapter {adapter.path}: LoRA on tied {key} is not supported; untie the model first")
            replaced = saved.pop(key, None)  # an adapted embedding's weight saved with the adapter replaces the base's
            stream.append(_merged_source(key, base, m, adapter, out_dtype, merge_base, on, replaced))
        elif key in frozen_nf4 and key not in base.bnb:
            read = merge_base.reader(base, key)
            stream.append(StreamTensor(key, tuple(base.shape(key)), read_dtype, lambda s, e, r=read, d=read_dtype: to_host(r(s, e), d)))
        elif not base.shape(source_key):
            stream.append(scalar_source(key, read_dtype, lambda k=source_key: base.rows(k, 0, None)))
        else:
            stream.append(
                StreamTensor(
                    key, tuple(base.shape(source_key)), read_dtype, lambda s, e, k=source_key, d=read_dtype: to_host(base.rows(k, s, e), d)
                )
            )
    return stream


def _checked(checks) -> list[str]:
    checks_done(*checks)
    return []  # no files of its own


def merge_from_files(source: MergeSource, out_dir: str | Path, options: WriteOptions = WriteOptions(), ranks: Ranks = SINGLE) -> SaveResult:
    """Merge ``source.adapter`` into ``source.base`` (a directory or a hub id) and write ``out_dir`` as a Hugging Face checkpoint
    (sharded safetensors, index, config without quantization_config, tokenizer files, manifest).
    ``options`` says how (shard size, dtype, overwrite, the device of the merge math); ``source.merge_base``
    which base weights the adapter is merged into (``original`` W, or ``quantized`` dequant(NF4(W))).
    With ``ranks`` of a process group (``slimtune merge --nproc N``), every rank calls this and merges
    its row range of every tensor into the same files (see ``write_checkpoint``). With ``source.verify``, the
    adapter and the base, where they are slimtune checkpoints with a manifest, have every file hashed (on
    the coordinator; one process hashes the base's shards from the merge's own reads, so each byte is read
    once), and a mismatch leaves no output.

    Example: ``merge_from_files(MergeSource("base", Path("run/step-000100/adapter")), "merged", WriteOptions(dtype="bf16"))``"""
    options.shard_bytes  # noqa: B018 - parsed (and checked) once, before anything is read
    base_dir, merge_base, verify = source.base, source.merge_base, source.verify
    if base_dir is None or source.adapter_dir is None:
        raise SlimtuneError("merge: needs a base and an adapter (--base and --adapter)")
    rows_of = MergeBase.named(merge_base, options.chunk_bytes)
    dtype, device, chunk_bytes = options.torch_dtype, options.device, options.chunk_bytes
    if device == "cuda" and not torch.cuda.is_available():
        raise SlimtuneError("--device cuda: no CUDA device is available here; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise SlimtuneError(f"device {device!r}: expected 'cpu' or 'cuda'")
    out_dir = Path(out_dir)
    if out_dir.exists() and not options.overwrite:
        raise SlimtuneError(f"{out_dir} already exists; pass --overwrite to replace it")
    # one process reads every byte of the base in file order: its reads are hashed as they are made (on
    # the check's thread, which holds TAP_HOLDS of the pool's buffers at most); with ranks each reads its
    # rows only, and the coordinator's check reads the files beside the work; with one process, nothing
    # reads the base again: its pages are let go as they are read
    alone = ranks.world_size == 1
    checks = [read_check(base_dir, verify, fold=alone)] if ranks.is_coordinator else []
    held = TAP_HOLDS * chunk_bytes if alone and checks and checks[0] is not None else 0
    pool = pool_for(chunk_bytes, options.inflight_bytes + held, pin_memory=device == "cuda")
    base = BaseCheckpoint(base_dir, pool, checks[0] if checks else None, drop_behind=alone)
    try:
        if base.bnb and ranks.is_coordinator:
            log.info(
                "%s: a bitsandbytes 4-bit base: the merge base is the file's dequantized weight (bitsandbytes' own dequantization, "
                "what training saw; --merge-base %s means it too)",
                base.dir,
                merge_base,
            )
        adapter = read_adapter(source.adapter_dir)
        if ranks.is_coordinator:  # the adapter is small and read whole already: checked now
            checks_done(read_check(adapter.path, verify))
        stream = merged_file_stream(base, adapter, dtype, rows_of, MergeDevice(torch.device(device), pool.to_host))
        parts = CheckpointParts(
            merged=stream,
            config=export_config_dict(base.config, stream),
            tokenizer_dir=base.dir,
            manifest_extra={"kind": "merged", "merge_base": merge_base, "base": base.source.name, "adapter": str(adapter.path)}
            | ({"base_revision": base.source.revision} if base.source.revision else {}),
            whole_below=chunk_bytes,  # every rank can make any rows: small tensors go whole to one rank
            shared_write=lambda tmp: _checked(checks),  # the hashes, once every byte was read: before the manifest
        )
        return write_checkpoint(out_dir, parts, options, ranks)
    finally:
        base.close()
