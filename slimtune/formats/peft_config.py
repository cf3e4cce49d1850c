"""adapter_config.json, the one reader and writer of PEFT's LoraConfig: every field either means here what
it means to PEFT's ``merge_and_unload()`` (peft/tuners/tuners_utils.py ``check_target_module_exists``,
peft/utils/other.py ``get_pattern_key``, peft/tuners/lora/layer.py) or is refused with one line naming it;
and the config slimtune writes for its own adapters. The adapter's tensors are read by
``slimtune.formats.peft``; what vLLM's and SGLang's loaders make of the config, by ``slimtune.formats.serving``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from slimtune.errors import SlimtuneError
from slimtune.formats.layout import ADAPTER_CONFIG
from slimtune.formats.strict_json import json_kind, load_json, safe_name

ALL_LINEAR = "all-linear"  # PEFT's convention: every linear layer except the output head, resolved per family
# init_lora_weights values that change the base weights when PEFT loads the adapter (PiSSA, OLoRA, ...):
# the merge would have to redo that SVD/QR; slimtune refuses them.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
ZERO_DELTA_INITS = (True, "gaussian", "eva")  # inits with lora_B = 0: a module without saved weights is a no-op
# LoraConfig fields whose non-default value changes what merge_and_unload does in ways slimtune does not
# implement: refused when set.
_UNSUPPORTED_WHEN_SET = (
    "megatron_config",
    "trainable_token_indices",
    "layer_replication",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
    "ensure_weight_tying",
    "lora_bias",
)
# Fields with no effect on a merge (training, init of fresh adapters, bookkeeping); type-checked only.
_NO_MERGE_EFFECT = {
    "task_type": (str, type(None)),
    "peft_type": (str,),
    "auto_mapping": (dict, type(None)),
    "peft_version": (str, type(None)),
    "base_model_name_or_path": (str, type(None)),
    "revision": (str, type(None)),
    "inference_mode": (bool,),
    "lora_dropout": (int, float),
    "megatron_core": (str, type(None)),
    "loftq_config": (dict, type(None)),
    "eva_config": (dict, type(None)),
    "corda_config": (dict, type(None)),
    "lora_ga_config": (dict, type(None)),
    "qalora_group_size": (int,),
    "runtime_config": (dict, type(None)),
}


def adapter_config_dict(adapters: dict[str, nn.Module], base_model_name_or_path: str = "", exclude_modules: str | None = None) -> dict:
    """The config PEFT's LoraConfig reads, describing ``adapters`` (module path -> a LoRA linear with
    ``rank``, ``alpha``, ``dropout``, ``use_rslora``, ``fan_in_fan_out``: ``lora.lora_modules(model)``);
    ``exclude_modules`` (a regex PEFT full-matches): modules named like a target that hold no adapter
    (a vision-language model's frozen vision tower: ``families.peft_exclude_modules``).

    Example: ``adapter_config_dict(lora_modules(model), "meta-llama/Llama-3.2-1B")["r"]`` -> 8"""
    modules = list(adapters.values())
    if not modules:
        raise ValueError("model has no LoRA modules")
    first = modules[0]
    targets = sorted({name.rsplit(".", 1)[-1] for name in adapters})
    fan_in_fan_out = {getattr(m, "fan_in_fan_out", False) for m in modules}
    if len(fan_in_fan_out) > 1:  # PEFT has one flag per adapter
        raise SlimtuneError(f"adapters on both Conv1D and nn.Linear layers ({targets}) cannot be one PEFT adapter; target one kind")
    extra = {"exclude_modules": exclude_modules} if exclude_modules else {}
    return extra | {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": getattr(first.dropout, "p", 0.0),
        "use_rslora": first.use_rslora,
        "use_dora": False,  # slimtune trains plain LoRA (DoRA adapters are merged from files: merge.py)
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out.pop(),
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


@dataclass(frozen=True)
class LoraSettings:
    """adapter_config.json, checked field by field (PEFT's names and meanings)."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str  # a list (exact name or ".name" suffix), a regex (full match), or "all-linear"
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    init_lora_weights: bool | str = True

    def targets(self, module: str, kinds: dict[str, str], output_name: str | None) -> bool:
        """Does PEFT put a LoRA layer on ``module`` (check_target_module_exists)?"""
        if self.exclude_modules:
            if isinstance(self.exclude_modules, str):
                if re.fullmatch(self.exclude_modules, module):
                    return False
            elif module in self.exclude_modules or any(module.endswith(f".{k}") for k in self.exclude_modules):
                return False
        if self.modules_to_save and any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in self.modules_to_save):
            return False
        targets = self.target_modules
        if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
            return kinds.get(module) in ("linear", "conv1d") and module != output_name
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        if module in targets:
            return True
        found = any(module.endswith(f".{t}") for t in targets)
        indexes = self.layers_to_transform
        if found and indexes is not None and (not isinstance(indexes, list) or len(indexes) != 0):
            match = None
            if not self.layers_pattern:
                match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
            else:
                for pattern in [self.layers_pattern] if isinstance(self.layers_pattern, str) else self.layers_pattern:
                    match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
                    if match is not None:
                        break
            if match is None:
                return False
            index = int(match.group("idx"))
            return index == indexes if isinstance(indexes, int) else index in indexes
        return found

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """r and lora_alpha for ``module``: the first rank_pattern / alpha_pattern key matching the end of
        its path (PEFT's get_pattern_key), else r / lora_alpha."""
        return _pattern_value(self.rank_pattern, module, self.r), float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))


def _pattern_value(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_pos_int(v: object) -> bool:
    return type(v) is int and v > 0


def _check_regex(pattern: str, where: str, name: str, wrap: str = "{}") -> None:
    try:
        re.compile(wrap.format(pattern))
    except (re.error, RecursionError, OverflowError) as e:
        raise SlimtuneError(f"{where}: {name} {safe_name(pattern)!r} is not a valid regular expression ({e})") from None


def _str_list_or_str(value: object, where: str, name: str, regex_if_str: bool) -> list[str] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if regex_if_str and value.lower() != ALL_LINEAR:
            _check_regex(value, where, name)
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise SlimtuneError(f"{where}: {name} must be a list of module names or a regular expression string, found {json_kind(value)}")


def parse_lora_config(config: object, where: str) -> LoraSettings:
    """Check adapter_config.json's fields against PEFT's LoraConfig: types, ranges, and whether
    slimtune's merge implements what each set field means. One clear line for the first fault."""
    if not isinstance(config, dict):
        raise SlimtuneError(f"{where}: expected a JSON object, found {json_kind(config)}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise SlimtuneError(f"{where}: peft_type {safe_name(peft_type)!r}; only LORA adapters can be merged")
    for name, types in _NO_MERGE_EFFECT.items():
        value = config.get(name)
        if name in config and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise SlimtuneError(f"{where}: {name} has the wrong type ({json_kind(value)})")
    if "lora_dropout" in config and not (math.isfinite(config["lora_dropout"]) and 0 <= config["lora_dropout"] <= 1):
        raise SlimtuneError(f"{where}: lora_dropout must be in [0, 1], found {config['lora_dropout']}")
    for name in _UNSUPPORTED_WHEN_SET:
        value = config.get(name)
        if value not in (None, False, [], {}):
            raise SlimtuneError(f"{where}: {name} is set ({safe_name(str(value))[:60]}); slimtune's merge does not implement it")
    r = config.get("r", 8)
    if not _is_pos_int(r):
        raise SlimtuneError(f"{where}: r must be a positive integer, found {r if _is_number(r) else json_kind(r)}")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise SlimtuneError(f"{where}: lora_alpha must be a finite number, found {alpha if _is_number(alpha) else json_kind(alpha)}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise SlimtuneError(f"{where}: bias={safe_name(str(bias))!r}: adapters that train biases are not supported (expected 'none')")
    for name in ("fan_in_fan_out", "use_rslora", "use_dora"):
        if name in config and not isinstance(config[name], bool):
            raise SlimtuneError(f"{where}: {name} must be true or false, found {json_kind(config[name])}")
    if "target_modules" not in config or config["target_modules"] is None:
        raise SlimtuneError(f"{where}: target_modules is missing; PEFT would pick defaults by model type; name the modules")
    targets = _str_list_or_str(config["target_modules"], where, "target_modules", regex_if_str=True)
    exclude = _str_list_or_str(config.get("exclude_modules"), where, "exclude_modules", regex_if_str=True)
    layers = config.get("layers_to_transform")
    if layers is not None and not (type(layers) is int or (isinstance(layers, list) and all(type(i) is int for i in layers))):
        raise SlimtuneError(f"{where}: layers_to_transform must be an integer or a list of integers, found {json_kind(layers)}")
    pattern = _str_list_or_str(config.get("layers_pattern"), where, "layers_pattern", regex_if_str=False)
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _check_regex(p, where, "layers_pattern")
    if isinstance(targets, str) and layers is not None:
        raise SlimtuneError(f"{where}: layers_to_transform cannot be used when target_modules is a string (as PEFT refuses)")
    if isinstance(targets, str) and pattern is not None:
        raise SlimtuneError(f"{where}: layers_pattern cannot be used when target_modules is a string (as PEFT refuses)")
    if pattern and layers is None:
        raise SlimtuneError(f"{where}: layers_pattern needs layers_to_transform (as PEFT requires)")
    rank_pattern, alpha_pattern = _patterns(config, where)
    modules_to_save = config.get("modules_to_save")
    if modules_to_save is not None and not (isinstance(modules_to_save, list) and all(isinstance(m, str) and m for m in modules_to_save)):
        raise SlimtuneError(f"{where}: modules_to_save must be a list of module names, found {json_kind(modules_to_save)}")
    for m in modules_to_save or []:
        _check_regex(m, where, "modules_to_save entry", "(^|.*\\.){}($|\\..*)")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise SlimtuneError(f"{where}: init_lora_weights must be true, false or a method name, found {json_kind(init)}")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise SlimtuneError(
            f"{where}: init_lora_weights={init!r} changes the base weights when PEFT loads the adapter; "
            "convert it to a plain LoRA adapter first (PEFT's path_initial_model_for_weight_conversion)"
        )
    return LoraSettings(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        exclude_modules=exclude,
        layers_to_transform=layers,
        layers_pattern=pattern,
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
        fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
        use_rslora=bool(config.get("use_rslora", False)),
        use_dora=bool(config.get("use_dora", False)),
        modules_to_save=modules_to_save,
        init_lora_weights=init,
    )


def _patterns(config: dict, where: str) -> tuple[dict, dict]:
    """rank_pattern and alpha_pattern: objects of module pattern (a regex PEFT matches as it does) ->
    a positive integer rank / a finite alpha."""
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for name, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(patterns, dict):
            raise SlimtuneError(f"{where}: {name} must be an object of module pattern -> value, found {json_kind(patterns)}")
        for key, value in patterns.items():
            _check_regex(key, where, f"{name} key", "(.*\\.)?({})$")
            if name == "rank_pattern" and not _is_pos_int(value):
                raise SlimtuneError(f"{where}: rank_pattern[{safe_name(key)!r}] must be a positive integer, found {value!r}")
            if name == "alpha_pattern" and (not _is_number(value) or not math.isfinite(value)):
                raise SlimtuneError(f"{where}: alpha_pattern[{safe_name(key)!r}] must be a finite number, found {safe_name(repr(value))}")
    return rank_pattern, alpha_pattern


def read_adapter_config(path: str | Path) -> tuple[dict, LoraSettings]:
    """adapter_config.json of an adapter directory, strictly parsed and checked."""
    config_path = Path(path) / ADAPTER_CONFIG
    config = load_json(config_path, expect=None, max_bytes=16 * 1024 * 1024, what=ADAPTER_CONFIG)
    return config, parse_lora_config(config, str(config_path))
