"""GGUF LoRA adapter export (``slimtune export --adapter-only``): a PEFT adapter as the GGUF file
llama.cpp applies to a GGUF of its base (``llama_cpp.Llama(model_path=base.gguf, lora_path=adapter.gguf)``,
Ollama's ``ADAPTER``), laid out as llama.cpp's ``convert_lora_to_gguf.py`` lays it out (facts followed,
not code copied):

- metadata ``general.architecture`` (the base's), ``general.type = adapter``, ``adapter.type = lora``,
  ``adapter.lora.alpha`` (float32) and ``general.quantization_version``; no vocabulary, no hyperparameters;
- for each adapted base weight of GGUF name N, the pair ``N.lora_a`` (A, [r, in]) and ``N.lora_b``
  (B, [out, r]); the rows of B take the family's row transformation of the base weight (Llama's Q/K
  permutation, GPT-NeoX's QKV regrouping) since B's rows are the weight's output rows; an embedding's A
  is stored transposed ([vocab, r]: llama.cpp gathers its rows by token);
- llama.cpp scales every pair by alpha / r (r read from B's shape, 1 where alpha is 0); a module PEFT
  scales otherwise (rsLoRA's alpha / sqrt(r), rank_pattern, alpha_pattern) has that ratio folded into B,
  in fp32, so each pair computes exactly PEFT's scaling * B @ A.

The file is another plan over the same writer: the pairs are stream entries (fp32 rows, read from the
adapter already in memory: A and B are small), planned by ``plan_slots`` and written by ``write_gguf``.
DoRA, ``modules_to_save`` (but an adapted embedding's own weight PEFT saves beside it, when it equals
the base's) and LoRA on a tied output head have no llama.cpp adapter form: one error line.

Example::

    result = export_gguf_adapter(Path("adapter-f16.gguf"), GGUFOptions("f16"), MergeSource(Path("base"), Path("run/step-10")))
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import torch

from slimtune.errors import SlimtuneError
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.gguf_types import ADAPTER_TYPES
from slimtune.formats.manifest import checks_done, read_check
from slimtune.formats.merge_source import MergeSource
from slimtune.formats.peft import Adapter, read_adapter
from slimtune.formats.strict_json import safe_name
from slimtune.gguf.arch import gguf_arch
from slimtune.gguf.export import TYPES, GGUFOptions, GGUFResult, plan_slots, planned_size, write_gguf
from slimtune.gguf.vocab import modelfile_path, write_modelfile
from slimtune.merge import adapter_targets, check_fits
from slimtune.tensors import StreamTensor
from slimtune.vision_families import vision_parts

Q = gguf.GGMLQuantizationType
T = gguf.GGUFValueType


def _fixed(name: str, shape: tuple[int, ...], rows: torch.Tensor) -> StreamTensor:
    return StreamTensor(name, shape, torch.float32, lambda s, e: rows[s:e].clone())


def adapter_tensors(lora: Adapter, base: BaseCheckpoint, arch) -> list[tuple[str, StreamTensor]]:
    """(HF key, GGUF entry) of every lora_a / lora_b tensor, in the base's tensor order."""
    targets, saved_modules = adapter_targets(lora, base)
    where = f"adapter {lora.path}"
    if lora.use_dora:
        raise SlimtuneError(f"{where}: a DoRA adapter has no llama.cpp adapter form; export the merged model instead")
    for key, saved in saved_modules.items():
        if key not in targets or not _same_as_base(saved, base, key):
            raise SlimtuneError(
                f"{where}: modules_to_save tensor {safe_name(key)} replaces the base's; llama.cpp's adapters hold LoRA pairs only: "
                "export the merged model instead"
            )
    alpha = float(lora.settings.lora_alpha)
    out: list[tuple[str, StreamTensor]] = []
    for key in [k for k in base.keys if k in targets]:
        m = targets[key]
        if key not in base.location and key not in base.bnb:
            raise SlimtuneError(f"{where}: module {m.name} adapts the tied output head; a tied GGUF has no output.weight to apply it to")
        out_f, in_f = check_fits(key, tuple(base.shape(key)), m, lora)
        name = arch.gguf_name(key)
        if name is None:
            raise SlimtuneError(f"{where}: module {m.name} adapts {key}, which llama.cpp does not read")
        llama_scale = alpha / m.rank if alpha else 1.0  # llama.cpp's scale of this pair
        a, b = m.lora_a.float(), m.lora_b.float()
        if m.scaling != llama_scale:
            b = b * (m.scaling / llama_scale)
        if m.embedding:
            out.append((key, _fixed(f"{name}.lora_a", (in_f, m.rank), a.t().contiguous())))
            out.append((key, _fixed(f"{name}.lora_b", (out_f, m.rank), b)))
            continue
        out.append((key, _fixed(f"{name}.lora_a", (m.rank, in_f), a)))
        b_entry = _fixed(key, (out_f, m.rank), b)
        if not m.transposed:  # a Conv1D's (B @ A)^T is already llama.cpp's [out, in] weight: no transpose of B
            b_entry = arch.tensor(b_entry)
        out.append((key, StreamTensor(f"{name}.lora_b", b_entry.shape, torch.float32, b_entry.rows)))
    if not out:
        raise SlimtuneError(f"{where}: no LoRA module lands on a base weight")
    return out


def _same_as_base(saved, base: BaseCheckpoint, key: str, rows: int = 4096) -> bool:
    """Whether a weight saved with the adapter (PEFT's save_embedding_layers: an adapted embedding's own
    weight) equals the base's, compared by row chunks: then the base's GGUF already holds it."""
    if key not in base.location or tuple(saved.shape) != tuple(base.shape(key)):
        return False
    n = saved.shape[0]
    return all(torch.equal(saved.rows(s, min(s + rows, n)).float(), base.rows(key, s, min(s + rows, n)).float()) for s in range(0, n, rows))


def _adapter_types(tensors: list[tuple[str, StreamTensor]], type_name: str) -> list[gguf.GGMLQuantizationType]:
    qtype = TYPES[type_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return [qtype if t.shape[-1] % block == 0 else Q.F16 for _, t in tensors]


def export_gguf_adapter(out: Path, options: GGUFOptions, source: MergeSource, base_gguf: str | None = None) -> GGUFResult:
    """Write the adapter of ``source`` (``source.adapter``, or its checkpoint's ``adapter/``) as a GGUF LoRA
    adapter for ``source.base`` (only its config and tensor headers are read), and a Modelfile beside it:
    ``FROM base_gguf`` (default: ``model-f16.gguf`` beside the base, where ``slimtune export BASE --type f16``
    writes it) and ``ADAPTER``.
    Example: ``export_gguf_adapter(Path("a.gguf"), GGUFOptions("f16"), MergeSource(Path("base"), Path("run/step-10")))``"""
    out = Path(out)
    if options.type not in ADAPTER_TYPES:
        raise SlimtuneError(f"GGUF adapter type {options.type!r}: expected one of {', '.join(ADAPTER_TYPES)}")
    if out.exists() and not options.overwrite and not options.dry_run:
        raise SlimtuneError(f"{out} already exists; pass --overwrite to replace it")
    adapter, base = source.adapter_dir, source.base
    if adapter is None:
        raise SlimtuneError(f"{source.checkpoint}: holds no adapter/ for --adapter-only; pass --adapter DIR")
    if base is None:
        raise SlimtuneError(f"{adapter}: --adapter-only needs the base the adapter was trained on (its config and names): pass --base DIR")
    if base_gguf is not None:
        modelfile_path(base_gguf)  # the Modelfile's FROM is checked before the adapter is written, not after
    started = time.perf_counter()
    lora = read_adapter(adapter)
    check = read_check(lora.path, source.verify and not options.dry_run)
    reader = BaseCheckpoint(base)
    try:
        if vision_parts(reader.config.get("model_type")) is not None:
            raise SlimtuneError(
                f"{reader.dir / 'config.json'}: --adapter-only of a vision-language model is not supported; "
                "export the merged model (its GGUF and mmproj) without --adapter-only"
            )
        arch = gguf_arch(reader.config, str(reader.dir / "config.json"))
        tensors = adapter_tensors(lora, reader, arch)
        plan = plan_slots(tensors, _adapter_types(tensors, options.type), options.type)
        kv = [
            (gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER, T.STRING),
            (gguf.Keys.Adapter.TYPE, "lora", T.STRING),
            (gguf.Keys.Adapter.LORA_ALPHA, float(lora.settings.lora_alpha), T.FLOAT32),
            (gguf.Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION, T.UINT32),
        ]
        if options.dry_run:
            return GGUFResult(out, options.type, len(plan.slots), planned_size(arch, kv, plan), time.perf_counter() - started, None, plan)
        size = write_gguf(out, arch, kv, plan, options, lambda: checks_done(check))
    finally:
        reader.close()
    tok_dir, record = source.tokenizer_dir(reader.dir), source.record
    if base_gguf is None:
        base_gguf = os.path.relpath(Path(reader.dir).resolve().parent / "model-f16.gguf", out.resolve().parent)
    modelfile = write_modelfile(out, tok_dir, record.get("chat_template"), record.get("system_prompt"), base_gguf=base_gguf)
    return GGUFResult(out, options.type, len(plan.slots), size, time.perf_counter() - started, modelfile, plan)
