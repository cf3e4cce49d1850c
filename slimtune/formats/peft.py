"""PEFT LoRA adapter files: adapter_config.json (read and checked by ``slimtune.formats.peft_config``)
beside adapter_model.safetensors (or .bin), keys base_model.model.<module>.lora_A.weight [r, in] and
lora_B.weight [out, r] (lora_embedding_A/B on embeddings): the one spelling of those keys, and the reader
of an adapter's tensors, checked against its config and resolved against a base as PEFT would."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.layout import ADAPTER_BIN, ADAPTER_CONFIG, ADAPTER_WEIGHTS, CheckpointLayout
from slimtune.formats.peft_config import ZERO_DELTA_INITS, LoraSettings, read_adapter_config
from slimtune.formats.safetensors import COMPUTE_DTYPES, SafetensorsReader
from slimtune.formats.strict_json import safe_name

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
# The one spelling of PEFT's tensor names: part -> suffix after the module path.
LORA_PARTS = {
    "lora_A": ".lora_A.weight",
    "lora_B": ".lora_B.weight",
    "lora_embedding_A": ".lora_embedding_A",
    "lora_embedding_B": ".lora_embedding_B",
    "magnitude": ".lora_magnitude_vector",
    "magnitude_weight": ".lora_magnitude_vector.weight",  # older PEFT versions
}


def lora_key(module: str, part: str) -> str:
    """The PEFT file's name for ``part`` ("lora_A", "lora_B", "magnitude", ...) of ``module``.

    Example: ``lora_key("model.layers.0.self_attn.q_proj", "lora_A")`` ->
    ``"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"``."""
    return f"{PEFT_PREFIX}{module}{LORA_PARTS[part]}"


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (rank-stabilised), as PEFT scales an adapter.

    Example: ``lora_scaling(8, 16.0, False)`` -> 2.0"""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class SavedTensor:
    """A modules_to_save tensor (an embedding or lm_head can be large): read by rows, never held."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]


@dataclass
class AdapterModule:
    """One LoRA module of an adapter on disk: A [r, in], B [out, r], its scaling, DoRA magnitude.
    ``transposed``: the base weight is [in, out] (an embedding, or a Conv1D with fan_in_fan_out), so
    the delta is (B @ A)^T."""

    name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    rank: int
    alpha: float
    magnitude: torch.Tensor | None = None
    embedding: bool = False
    transposed: bool = False


@dataclass
class Adapter:
    path: Path
    config: dict
    settings: LoraSettings
    modules: dict[str, AdapterModule]
    saved_modules: dict[str, SavedTensor]  # modules_to_save: base key -> replacement, read by rows
    use_rslora: bool
    use_dora: bool


def _split_key(key: str) -> tuple[str, str | None]:
    """(module, part) of a LoRA tensor key (prefix removed), part None for other tensors."""
    for part, suffix in LORA_PARTS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    return key, None


def _load_adapter_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, SavedTensor]]:
    """LoRA tensors (small) in memory; any other tensor (modules_to_save) as a row reader."""
    st, binary = path / ADAPTER_WEIGHTS, path / ADAPTER_BIN
    if st.is_file():
        reader = SafetensorsReader(st)  # stays open while the merge reads saved modules by rows
        for k, e in reader.tensors.items():
            if e.dtype is None:
                raise SlimtuneError(f"{st}: tensor {safe_name(k)} has dtype {e.dtype_name}, not a float dtype an adapter can hold")
        small = {k: reader.read(k) for k in reader.tensors if _split_key(k)[1]}
        large = {
            k: SavedTensor(e.shape, e.dtype, lambda s, t, k=k: reader.read(k, s, t))
            for k, e in reader.tensors.items()
            if not _split_key(k)[1]
        }
        return small, large
    if binary.is_file():
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is bad input
            raise SlimtuneError(f"{binary}: cannot read ({type(e).__name__}: {safe_name(first_line(e))[:200]})") from None
        if not isinstance(state, dict):
            raise SlimtuneError(f"{binary}: holds a {type(state).__name__}, expected a dict of tensor name -> tensor")
        for k, v in state.items():
            if not isinstance(k, str):
                raise SlimtuneError(f"{binary}: key {safe_name(repr(k))} is a {type(k).__name__}, expected tensor names (strings)")
            if not isinstance(v, torch.Tensor):
                raise SlimtuneError(f"{binary}: {safe_name(k)} holds a {type(v).__name__}, expected a tensor")
            if v.layout != torch.strided or v.is_quantized or v.is_nested:
                raise SlimtuneError(f"{binary}: {safe_name(k)} is not a plain dense tensor")
        small = {k: v.clone() for k, v in state.items() if _split_key(k)[1]}
        large = {
            k: SavedTensor(tuple(v.shape), v.dtype, lambda s, t, v=v: v[s:t].clone()) for k, v in state.items() if not _split_key(k)[1]
        }
        return small, large
    raise SlimtuneError(f"{path}: no {ADAPTER_WEIGHTS} or {ADAPTER_BIN}")


def read_adapter(path: str | Path) -> Adapter:
    """A PEFT LoRA adapter directory (slimtune's own ``adapter/`` or any PEFT save), checked: the config
    field by field, every tensor name a LoRA part or a saved module, shapes matching the ranks, values
    finite. Which base modules the adapter lands on is decided against the base (``resolve``)."""
    path = CheckpointLayout(path).adapter_dir or Path(path)  # a slimtune checkpoint directory: its adapter/
    if not path.is_dir():
        raise SlimtuneError(f"{path}: no such adapter directory")
    config_path = path / ADAPTER_CONFIG
    if not config_path.exists():
        raise SlimtuneError(f"{config_path}: missing (a PEFT adapter needs adapter_config.json)")
    config, settings = read_adapter_config(path)
    weights, others = _load_adapter_weights(path)
    modules: dict[str, AdapterModule] = {}
    saved: dict[str, SavedTensor] = {}
    for key in list(weights) + list(others):
        if not key.startswith(PEFT_PREFIX):
            raise SlimtuneError(f"{path}: tensor {safe_name(key)} does not start with {PEFT_PREFIX!r}")
    lora_modules_in_file = {_split_key(k[len(PEFT_PREFIX) :])[0] for k in weights}
    for key, tensor in others.items():
        rest = key[len(PEFT_PREFIX) :].replace(".modules_to_save.default", "")
        module = rest.rsplit(".", 1)[0]
        if module.endswith(".base_layer") and module[: -len(".base_layer")] in lora_modules_in_file:
            # PEFT saves an adapted embedding's own weight too (save_embedding_layers) and loads it over the base's
            rest = module[: -len(".base_layer")] + "." + rest.rsplit(".", 1)[1]
        elif not settings.modules_to_save or not any(module.endswith(m) for m in settings.modules_to_save):
            raise SlimtuneError(
                f"{path}: tensor {safe_name(key)} is neither a LoRA weight nor part of a module in modules_to_save "
                f"({settings.modules_to_save}); PEFT would ignore it"
            )
        if tensor.dtype not in COMPUTE_DTYPES:
            raise SlimtuneError(f"{path}: modules_to_save tensor {safe_name(key)} is {tensor.dtype}, expected a float dtype")
        saved[rest] = tensor
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        module, part = _split_key(key[len(PEFT_PREFIX) :])
        part = "magnitude" if part == "magnitude_weight" else part
        if part in parts.setdefault(module, {}):
            raise SlimtuneError(f"{path}: module {safe_name(module)} has its {part} twice")
        if tensor.dtype not in COMPUTE_DTYPES:
            raise SlimtuneError(f"{path}: tensor {safe_name(key)} is {tensor.dtype}, expected a float dtype")
        if not bool(torch.isfinite(tensor).all()):
            raise SlimtuneError(f"{path}: tensor {safe_name(key)} holds NaN or infinite values")
        parts[module][part] = tensor
    for name, p in parts.items():
        embedding = "lora_embedding_A" in p or "lora_embedding_B" in p
        a = p.get("lora_embedding_A" if embedding else "lora_A")
        b = p.get("lora_embedding_B" if embedding else "lora_B")
        if a is None or b is None or (embedding and ("lora_A" in p or "lora_B" in p)):
            raise SlimtuneError(f"{path}: module {safe_name(name)} lacks its lora_A or lora_B weight (or mixes linear and embedding parts)")
        magnitude = p.get("magnitude")
        if magnitude is not None and not settings.use_dora:
            raise SlimtuneError(
                f"{path}: module {safe_name(name)} has a lora_magnitude_vector but use_dora is false; "
                "PEFT would ignore it (set use_dora: true if the adapter is DoRA)"
            )
        if settings.use_dora and magnitude is None:
            raise SlimtuneError(f"{path}: use_dora is set but module {safe_name(name)} has no lora_magnitude_vector")
        if settings.use_dora and embedding:
            raise SlimtuneError(f"{path}: module {safe_name(name)}: DoRA on an embedding is not supported by slimtune's merge")
        rank, alpha = settings.rank_alpha(name)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise SlimtuneError(
                f"{path}: module {safe_name(name)}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                f"do not match rank {rank} ({_rank_source(settings, config, name)} in adapter_config.json)"
            )
        scaling = lora_scaling(rank, alpha, settings.use_rslora)
        if not math.isfinite(scaling):
            raise SlimtuneError(f"{path}: module {safe_name(name)}: scaling lora_alpha/r = {alpha}/{rank} is not finite")
        modules[name] = AdapterModule(name, a, b, scaling, rank, alpha, magnitude, embedding=embedding)
    if not modules and not saved:
        raise SlimtuneError(f"{path}: the adapter holds no LoRA weights")
    return Adapter(path, config, settings, modules, saved, settings.use_rslora, settings.use_dora)


def _rank_source(settings: LoraSettings, config: dict, module: str) -> str:
    for key in settings.rank_pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return f"rank_pattern[{key!r}]"
    return "'r'" if "r" in config else "'r' absent: PEFT's default 8"


def resolve(adapter: Adapter, kinds: dict[str, str], output_name: str | None, base_keys: set[str]) -> None:
    """Decide, as PEFT's LoRA injection would, which base module each adapter module lands on: every
    module with weights must be one target_modules/layers_to_transform/exclude_modules select and of a
    kind PEFT adapts (Linear, Conv1D, Embedding); a targeted module without weights must be a no-op
    (PEFT's default init: B = 0). Sets each module's layout (fan_in_fan_out as PEFT forces it)."""
    s = adapter.settings
    where = f"adapter {adapter.path}"
    for name, m in adapter.modules.items():
        kind = kinds.get(name)
        if kind is None:
            raise SlimtuneError(f"{where}: module {safe_name(name)} is missing from base model (no such module)")
        if not s.targets(name, kinds, output_name):
            raise SlimtuneError(
                f"{where}: module {safe_name(name)} has LoRA weights but target_modules={s.target_modules!r}"
                f"{' with layers_to_transform=' + repr(s.layers_to_transform) if s.layers_to_transform is not None else ''} "
                "does not select it; PEFT would ignore them"
            )
        if m.embedding != (kind == "embedding"):
            wanted = "an embedding" if m.embedding else "a linear layer"
            raise SlimtuneError(f"{where}: module {safe_name(name)} is a {kind} but its LoRA weights are for {wanted}")
        if kind not in ("linear", "conv1d", "embedding"):
            raise SlimtuneError(f"{where}: module {safe_name(name)} is a {kind}; PEFT's LoRA does not adapt it")
        if kind == "linear" and s.fan_in_fan_out:
            log.warning(
                "%s: fan_in_fan_out is set but %s is an nn.Linear; as PEFT does, it is merged with fan_in_fan_out=False", where, name
            )
        m.transposed = kind in ("conv1d", "embedding")  # PEFT forces fan_in_fan_out=True on Conv1D
        if m.magnitude is not None and m.transposed:
            raise SlimtuneError(f"{where}: module {safe_name(name)}: DoRA on a {kind} is not supported by slimtune's merge")
    adapted = [n for n, k in kinds.items() if k in ("linear", "conv1d", "embedding") and s.targets(n, kinds, output_name)]
    if not adapted and adapter.modules:
        raise SlimtuneError(f"{where}: target_modules={s.target_modules!r} selects no module of the base model")
    missing = [n for n in adapted if n not in adapter.modules]
    if missing and (s.use_dora or s.init_lora_weights not in ZERO_DELTA_INITS or not adapter.modules):
        raise SlimtuneError(
            f"{where}: module {safe_name(missing[0])} is selected by target_modules but the adapter has no weights for it"
            f"{' (' + str(len(missing)) + ' modules)' if len(missing) > 1 else ''}; PEFT would merge freshly initialised ones"
        )
    for key in adapter.saved_modules:
        if key not in base_keys and not (key == "lm_head.weight" and output_name == "lm_head"):
            raise SlimtuneError(f"{where}: modules_to_save tensor {safe_name(key)} has no counterpart in the base model")
