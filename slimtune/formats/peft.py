"""PEFT LoRA adapter files: adapter_config.json beside adapter_model.safetensors, keys
base_model.model.<module>.lora_A.weight [r, in] and lora_B.weight [out, r]."""

from __future__ import annotations

from torch import nn

from slimtune.lora import lora_modules

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


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
