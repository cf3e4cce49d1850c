"""PEFT LoRA adapter files: adapter_config.json beside adapter_model.safetensors, keys
base_model.model.<module>.lora_A.weight [r, in] and lora_B.weight [out, r]."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimtune.errors import SlimtuneError
from slimtune.formats.safetensors import SafetensorsReader
from slimtune.lora import lora_modules, lora_scaling

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_DIR_NAME = "adapter"  # where a slimtune checkpoint keeps its adapter
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector", ".lora_magnitude_vector.weight")


def adapter_config_dict(model: nn.Module, base_model_name_or_path: str = "") -> dict:
    """The config PEFT's LoraConfig reads, describing the model's adapters."""
    modules = list(lora_modules(model).values())
    if not modules:
        raise ValueError("model has no LoRA modules")
    first = modules[0]
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora_modules(model)})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": getattr(first.dropout, "p", 0.0),
        "use_rslora": first.use_rslora,
        "use_dora": first.magnitude is not None,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


@dataclass(frozen=True)
class SavedTensor:
    """A modules_to_save tensor (an embedding or lm_head can be large): read by rows, never held."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]


@dataclass
class AdapterModule:
    """One LoRA module of an adapter on disk: A [r, in], B [out, r], its scaling, DoRA magnitude."""

    name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    rank: int
    alpha: float
    magnitude: torch.Tensor | None = None


@dataclass
class Adapter:
    path: Path
    config: dict
    modules: dict[str, AdapterModule]
    saved_modules: dict[str, SavedTensor]  # modules_to_save: base key -> replacement, read by rows
    fan_in_fan_out: bool
    use_rslora: bool
    use_dora: bool


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _is_lora_key(key: str) -> bool:
    return key.endswith(LORA_SUFFIXES)


def _load_adapter_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, SavedTensor]]:
    """LoRA tensors (small) in memory; any other tensor (modules_to_save) as a row reader."""
    st, binary = path / ADAPTER_WEIGHTS, path / "adapter_model.bin"
    if st.is_file():
        reader = SafetensorsReader(st)  # stays open while the merge reads saved modules by rows
        small = {k: reader.read(k) for k in reader.tensors if _is_lora_key(k)}
        large = {
            k: SavedTensor(e.shape, e.dtype, lambda s, t, k=k: reader.read(k, s, t))
            for k, e in reader.tensors.items()
            if not _is_lora_key(k)
        }
        return small, large
    if binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is bad input
            raise SlimtuneError(f"{binary}: cannot read ({e})") from None
        small = {k: v.clone() for k, v in state.items() if _is_lora_key(k)}
        large = {k: SavedTensor(tuple(v.shape), v.dtype, lambda s, t, v=v: v[s:t].clone()) for k, v in state.items() if not _is_lora_key(k)}
        return small, large
    raise SlimtuneError(f"{path}: no {ADAPTER_WEIGHTS} or adapter_model.bin")


def read_adapter(path: str | Path) -> Adapter:
    """A PEFT LoRA adapter directory (slimtune's own ``adapter/`` or any PEFT save), checked."""
    path = Path(path)
    if (path / ADAPTER_DIR_NAME / ADAPTER_CONFIG).is_file() and not (path / ADAPTER_CONFIG).is_file():
        path = path / ADAPTER_DIR_NAME  # a slimtune checkpoint directory
    config_path = path / ADAPTER_CONFIG
    if not path.is_dir():
        raise SlimtuneError(f"{path}: no such adapter directory")
    if not config_path.is_file():
        raise SlimtuneError(f"{config_path}: missing (a PEFT adapter needs adapter_config.json)")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SlimtuneError(f"{config_path}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise SlimtuneError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters can be merged")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise SlimtuneError(f"{config_path}: missing or invalid {key!r} (got {config.get(key)!r})")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise SlimtuneError(f"{config_path}: adapters that train biases (bias={config.get('bias')!r}) are not supported")
    weights, others = _load_adapter_weights(path)
    use_rslora, use_dora = bool(config.get("use_rslora")), bool(config.get("use_dora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules: dict[str, AdapterModule] = {}
    saved: dict[str, SavedTensor] = {}
    for key in list(weights) + list(others):
        if not key.startswith(PEFT_PREFIX):
            raise SlimtuneError(f"{path}: tensor {key} does not start with {PEFT_PREFIX!r}")
    for key, tensor in others.items():
        saved[key[len(PEFT_PREFIX) :].replace(".modules_to_save.default", "")] = tensor
    for key, tensor in weights.items():
        rest = key[len(PEFT_PREFIX) :]
        suffix = next(s for s in LORA_SUFFIXES if rest.endswith(s))
        module = rest[: -len(suffix)]
        entry = modules.setdefault(module, AdapterModule(module, None, None, 0.0, 0, 0.0))  # type: ignore[arg-type]
        if suffix == ".lora_A.weight":
            entry.lora_a = tensor
        elif suffix == ".lora_B.weight":
            entry.lora_b = tensor
        else:
            entry.magnitude = tensor
    for name, m in modules.items():
        if m.lora_a is None or m.lora_b is None:
            raise SlimtuneError(f"{path}: module {name} lacks its lora_A or lora_B weight")
        m.rank = int(_pattern_value(rank_pattern, name, config["r"]))
        m.alpha = float(_pattern_value(alpha_pattern, name, config["lora_alpha"]))
        if m.lora_a.dim() != 2 or m.lora_b.dim() != 2 or m.lora_a.shape[0] != m.rank or m.lora_b.shape[1] != m.rank:
            raise SlimtuneError(
                f"{path}: module {name}: lora_A {list(m.lora_a.shape)} / lora_B {list(m.lora_b.shape)} "
                f"do not match rank {m.rank} from adapter_config.json"
            )
        if use_dora and m.magnitude is None:
            raise SlimtuneError(f"{path}: use_dora is set but module {name} has no lora_magnitude_vector")
        m.scaling = lora_scaling(m.rank, m.alpha, use_rslora)
    if not modules and not saved:
        raise SlimtuneError(f"{path}: the adapter holds no LoRA weights")
    return Adapter(path, config, modules, saved, bool(config.get("fan_in_fan_out")), use_rslora, use_dora)
