"""`slimtune verify`: is a checkpoint directory exactly what its manifest says, are its safetensors
files and index well-formed, and (with base and adapter) does every merged tensor equal a fresh
recomputation from the sources, streamed chunk by chunk?"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slimtune.diskio import DEFAULT_CHUNK_BYTES
from slimtune.errors import SlimtuneError
from slimtune.formats.base_checkpoint import BaseCheckpoint
from slimtune.formats.hf import INDEX_NAME, index_problems, read_index
from slimtune.formats.manifest import manifest_problems, read_manifest
from slimtune.formats.merge_source import MergeSource
from slimtune.formats.peft import ADAPTER_WEIGHTS, read_adapter
from slimtune.formats.safetensors import COMPUTE_DTYPES, SafetensorsReader, read_header
from slimtune.merge import MergeBase, merged_file_stream
from slimtune.tensors import row_chunks


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    tensor_diffs: dict[str, float] = field(default_factory=dict)
    files_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_manifest(ckpt: Path, report: VerifyReport, progress: bool) -> None:
    report.problems += manifest_problems(ckpt, progress=progress)
    try:
        report.files_checked = sum((ckpt / f["path"]).is_file() for f in read_manifest(ckpt)["files"])
    except SlimtuneError:
        pass


def check_safetensors_and_index(ckpt: Path, report: VerifyReport) -> dict[str, Path]:
    """Every header against the format rules, and the index against the shards (``index_problems``, all
    of them). Returns key -> file."""
    location: dict[str, Path] = {}
    shards = {}  # the readable safetensors files beside the index (an adapter's weights are not shards)
    for path in sorted(ckpt.rglob("*.safetensors")):
        try:
            header = read_header(path)
        except SlimtuneError as e:
            report.problems.append(str(e))
            continue
        if path.parent == ckpt:
            location.update({k: path for k in header.tensors})
            if path.name != ADAPTER_WEIGHTS:
                shards[path.name] = header
    index_path = ckpt / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map, total = read_index(index_path)
        except SlimtuneError as e:
            report.problems.append(str(e))
            return location
        report.problems += index_problems(index_path, weight_map, shards, total)
    return location


def ulp_tolerance(reference: torch.Tensor, dtype: torch.dtype, ulps: int) -> torch.Tensor:
    """``ulps`` units in the last place of ``dtype`` at each reference value (0: exact)."""
    if not ulps or not dtype.is_floating_point:
        return torch.zeros_like(reference)
    return ulps * (reference.abs() * torch.finfo(dtype).eps + torch.finfo(dtype).tiny)


def _check_recomputed(ckpt: Path, location: dict[str, Path], source: MergeSource, ulps: int, report: VerifyReport, progress: bool) -> None:
    """slimtune's merge is deterministic (same stream, same chunks), so by default every element must
    match exactly; ``ulps`` allows merges made by other tools, which may round differently."""
    base = BaseCheckpoint(source.base)
    readers: dict[Path, SafetensorsReader] = {}
    try:
        # a merge casts every float tensor to one dtype: recompute in the dtype the checkpoint holds
        stored = {e.dtype for p in set(location.values()) if p.is_file() for e in read_header(p).tensors.values()}
        floats = [d for d in COMPUTE_DTYPES if d in stored]
        dtype = floats[0] if len(floats) == 1 else None
        stream = merged_file_stream(base, read_adapter(source.adapter), dtype, MergeBase.named(source.merge_base))
        total = sum(t.nbytes for t in stream)
        with tqdm(total=total, unit="B", unit_scale=True, desc="recompute", disable=not progress) as bar:
            for t in stream:
                if t.name not in location:
                    report.problems.append(f"{ckpt}: tensor {t.name} is missing")
                    continue
                path = location[t.name]
                reader = readers.setdefault(path, SafetensorsReader(path))
                entry = reader.entry(t.name)
                if tuple(entry.shape) != tuple(t.shape):
                    report.problems.append(f"{path}: tensor {t.name} has shape {list(entry.shape)}, recomputed {list(t.shape)}")
                    continue
                worst, bad, row = 0.0, False, 0
                for chunk in row_chunks(t, DEFAULT_CHUNK_BYTES):
                    n = chunk.shape[0] if chunk.dim() else 1
                    stored = reader.read(t.name, row, row + n) if chunk.dim() else reader.read(t.name)
                    row += n
                    if entry.dtype not in COMPUTE_DTYPES:  # passed through: the very same bytes
                        as_bytes = chunk.contiguous().reshape(-1).view(torch.uint8)
                        bad |= entry.dtype != chunk.dtype or not torch.equal(stored.reshape(-1).view(torch.uint8), as_bytes)
                        bar.update(chunk.numel() * chunk.element_size())
                        continue
                    expected = chunk.to(entry.dtype).float() if entry.dtype.is_floating_point else chunk
                    diff = (stored.float() - expected.float()).abs()
                    worst = max(worst, diff.max().item() if diff.numel() else 0.0)
                    bad |= bool((diff > ulp_tolerance(expected.float(), entry.dtype, ulps)).any())
                    bar.update(chunk.numel() * chunk.element_size())
                report.tensor_diffs[t.name] = worst
                if bad:
                    report.problems.append(
                        f"{path}: tensor {t.name} differs from the recomputed merge "
                        f"({f'more than {ulps} ulp' if ulps else 'not bit-identical'}; max |diff| {worst:.3g})"
                    )
    finally:
        base.close()
        for r in readers.values():
            r.close()


def verify_checkpoint(ckpt: str | Path, source: MergeSource | None = None, ulps: int = 0, progress: bool = True) -> VerifyReport:
    """Check the checkpoint ``ckpt`` against its manifest and the format rules, and with ``source`` (its
    base and adapter, as given to merge) every merged tensor against a fresh recomputation.
    Example: ``verify_checkpoint("merged", MergeSource(Path("base"), Path("adapter"))).ok``"""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise SlimtuneError(f"{ckpt}: no such checkpoint directory")
    if source is not None and (source.base is None) != (source.adapter is None):
        raise SlimtuneError("recomputing the merge needs both --base and --adapter")
    report = VerifyReport()
    check_manifest(ckpt, report, progress)
    location = check_safetensors_and_index(ckpt, report)
    if source is not None and source.base is not None:
        _check_recomputed(ckpt, location, source, ulps, report, progress)
    return report
