"""``python -m bench gguf-stages``: where a GGUF export's time goes, stage by stage, on the synthetic base +
adapter ``bench gguf`` makes (same ``--preset``/``--layers``/``--out``): each stage is a full pass over every
tensor the file holds, adding one step to the one before, on one torch thread (the export's data phase runs
torch with intra-op threads off: ``slimtune.gguf.ggml.Quantizer``), so the differences are each step's cost:

- ``read_s``: the base's rows read (bf16, page cache) and upcast to fp32, no merge;
- ``rows_s``: the merged rows in GGUF order (LoRA merge in fp32, llama.cpp's Q/K permutation; a tensor no
  adapter touches stays in its stored 16-bit dtype, as the export hands it to the quantizer);
- ``rows_finite_s``: plus the export's finite check of each chunk;
- ``rows_quantize_s``: plus the quantizer of ``--type`` (a plain block type, e.g. Q8_0) on this thread;
- ``sha256_s``: the hash check's pass over the base file alone.

The export itself overlaps these on a pool and a writer thread (``bench gguf`` times it whole)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from bench.common import synthetic_base_and_adapter
from bench.gguf_export import _default_gguf_tokenizer, _tokenizer_vocab
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.hf import read_model_config
from slimtune.formats.merge_source import MergeSource
from slimtune.gguf import ggml
from slimtune.gguf.arch import gguf_arch
from slimtune.gguf.export import GGUFOptions, _with_norm_eps, gguf_tensors, open_source
from slimtune.tensors import all_finite, row_chunks


def _pass(tensors, step) -> float:
    t0 = time.perf_counter()
    for _, t in tensors:
        cols = t.shape[-1] if len(t.shape) > 1 else 1
        for rows in row_chunks(t, GGUFOptions().chunk_bytes):
            step(rows, cols, len(t.shape) > 1)
    return round(time.perf_counter() - t0, 2)


def bench_gguf_stages(preset: str, out: Path, layers: int | None, block_type: str = "Q8_0") -> dict:
    """Seconds per cumulative stage (module docstring). Example: ``bench_gguf_stages("tiny", Path("bench-out"), None)``"""
    _, base, adapter = synthetic_base_and_adapter(preset, out, layers, _tokenizer_vocab(_default_gguf_tokenizer()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reader = BaseCheckpoint(base)
        t0 = time.perf_counter()
        for key in reader.keys:
            shape = reader.shape(key)
            step = max(1, GGUFOptions().chunk_bytes // (4 * (shape[1] if len(shape) > 1 else 1)))
            for s in range(0, shape[0] if shape else 1, step):
                reader.rows(key, s, min(s + step, shape[0])).float()
        reader.close()
        figures = {"read_s": round(time.perf_counter() - t0, 2)}
        with open_source(MergeSource(base, adapter), one_pass=False) as src:  # passes from the page cache
            arch = gguf_arch(_with_norm_eps(src.config, read_model_config(src.config_dir)), str(src.model_dir / "config.json"))
            tensors = gguf_tensors(arch, src.stream)
            figures["rows_s"] = _pass(tensors, lambda rows, cols, q: None)
            figures["rows_finite_s"] = _pass(tensors, lambda rows, cols, q: all_finite(rows))
            figures["rows_quantize_s"] = _pass(
                tensors, lambda rows, cols, q: all_finite(rows) and q and ggml.quantize(rows.reshape(-1, cols), block_type, threads=1)
            )
    finally:
        torch.set_num_threads(before)
    t0, h = time.perf_counter(), hashlib.sha256()
    for f in sorted(base.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while block := fh.read(16 << 20):
                h.update(block)
    figures["sha256_s"] = round(time.perf_counter() - t0, 2)
    return {"preset": preset + (f"[{layers} layers]" if layers else ""), "type": block_type, **figures}
