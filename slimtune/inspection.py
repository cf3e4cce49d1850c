"""`slimtune inspect`: what a checkpoint, shard or adapter holds (tensors, dtypes, shapes, bytes, totals;
for adapters r, alpha, targets, rsLoRA/DoRA), from headers only: nothing is loaded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from slimtune.errors import SlimtuneError
from slimtune.formats.layout import ADAPTER_CONFIG, CheckpointLayout
from slimtune.formats.manifest import read_manifest
from slimtune.formats.safetensors import read_header
from slimtune.formats.strict_json import load_json, safe_name


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n}"


def describe_adapter(directory: Path) -> list[str]:
    config = load_json(directory / ADAPTER_CONFIG, expect=dict, max_bytes=16 * 1024 * 1024, what=ADAPTER_CONFIG)
    lines = [
        f"adapter {directory}",
        f"  peft_type {config.get('peft_type')}  r {config.get('r')}  lora_alpha {config.get('lora_alpha')}  "
        f"rsLoRA {bool(config.get('use_rslora'))}  DoRA {bool(config.get('use_dora'))}",
        f"  target_modules {config.get('target_modules')}",
    ]
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if config.get(key):
            lines.append(f"  {key} {config[key]}")
    return lines


def describe_files(files: list[Path], root: Path, label: str = "") -> list[str]:
    """Each file's tensors (name, dtype, shape, bytes) and a total line (``total (label): ...``)."""
    lines, dtypes = [], Counter()
    tensors = params = nbytes = 0
    for path in files:
        header = read_header(path)
        lines.append(f"{path.relative_to(root) if path != root else path.name}  ({_human(path.stat().st_size)})")
        for name, e in header.tensors.items():
            lines.append(f"  {safe_name(name):64s} {e.type_name:5s} {str(list(e.shape)):20s} {e.nbytes:>14,d}")
            tensors, params, nbytes = tensors + 1, params + e.numel, nbytes + e.nbytes
            dtypes[e.type_name] += e.nbytes
    by_dtype = ", ".join(f"{d} {_human(b)}" for d, b in dtypes.most_common())
    what = f" ({label})" if label else ""
    lines.append(f"total{what}: {tensors} tensors, {params:,d} parameters, {nbytes:,d} bytes ({by_dtype})")
    return lines


def inspect_path(path: str | Path) -> list[str]:
    path = Path(path)
    if path.is_file():
        return describe_files([path], path)
    if not path.is_dir():
        raise SlimtuneError(f"{path}: no such file or directory")
    lines: list[str] = []
    layout = CheckpointLayout(path)
    if layout.manifest.is_file():
        manifest = read_manifest(path)
        lines.append(f"slimtune checkpoint {path}: {len(manifest['files'])} files in the manifest ({manifest.get('kind', '?')})")
    if layout.adapter_dir is not None:
        lines += describe_adapter(layout.adapter_dir)
    files = sorted(path.rglob("*.safetensors"))
    if not files and not lines:
        raise SlimtuneError(f"{path}: no safetensors files, adapter or manifest")
    adapter = [f for f in files if (f.parent / ADAPTER_CONFIG).is_file()]
    model = [f for f in files if f not in adapter]
    if adapter and model:  # a checkpoint: the merged model and its adapter are two things, counted apart
        return lines + describe_files(model, path, "merged model") + describe_files(adapter, path, "adapter")
    return lines + describe_files(files, path) if files else lines
