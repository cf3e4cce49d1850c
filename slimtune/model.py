"""A QLoRA model from a local Hugging Face checkpoint: built on the meta device, then filled tensor by
tensor from the safetensors files, quantizing target weights to NF4 as they arrive. The bf16 model is
never held: at most one source tensor (and its quantization temporaries) is in memory beside the result."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig

from slimtune.errors import SlimtuneError
from slimtune.formats.hf import checkpoint_files, load_config
from slimtune.formats.safetensors import SafetensorsReader
from slimtune.lora import LoRAConfig, LoRALinear, lora_modules, qlora_linears
from slimtune.quant.nf4 import can_quantize, quantize_nf4

log = logging.getLogger(__name__)


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def build_qlora_skeleton(config: PretrainedConfig, lora: LoRAConfig) -> nn.Module:
    """The transformers model with every target nn.Linear replaced by a LoRALinear, all parameters on
    the meta device (no memory), buffers (rotary tables) real."""
    dtype = config_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _rebuild_meta_buffers(model)
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    found = set()
    wanted = set(lora.target_modules) | set(lora.quantize_modules)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in wanted and isinstance(module, nn.Linear):
            found.add(leaf)
            replacement = LoRALinear(
                module.in_features,
                module.out_features,
                lora.rank if leaf in lora.target_modules else 0,
                lora.alpha,
                lora.dropout,
                lora.use_rslora,
                bias=module.bias is not None,
                dtype=dtype,
                device="meta",
            )
            model.set_submodule(name, replacement)
    missing = [t for t in sorted(wanted) if t not in found]
    if missing:
        raise SlimtuneError(f"target module(s) {missing} not found in {type(model).__name__}; its linear layers are {linears}")
    return model


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Buffers computed in __init__ (rotary inv_freq) are empty on meta: rebuild their modules on CPU."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            config = getattr(module, "config", None)
            if config is None:
                bad = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
                raise SlimtuneError(f"cannot materialise buffer(s) {bad} of {name or type(module).__name__}")
            with torch.device("cpu"):
                model.set_submodule(name, type(module)(config))


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, trainable: bool = False) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=trainable)
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise SlimtuneError(f"model has no parameter {name}")


def init_lora(model: nn.Module, seed: int = 0, device: torch.device | str = "cpu") -> None:
    """Materialise and initialise every adapter (A Kaiming-uniform, B zero), reproducibly from seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    for module in lora_modules(model).values():
        for lin in (module.lora_a, module.lora_b):
            lin.weight = nn.Parameter(torch.empty(lin.weight.shape, dtype=torch.float32, device=device))
        module.reset_lora_parameters()
    torch.random.set_rng_state(generator_state)


def expected_checkpoint_keys(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Names, shapes and dtypes the base checkpoint must provide (tied copies and adapters excluded)."""
    keys = {}
    for name, p in model.named_parameters():
        if ".lora_a." in name or ".lora_b." in name:
            continue
        keys[name] = (p.shape, p.dtype)
    return keys


def load_qlora_model(
    model_dir: str | Path,
    lora: LoRAConfig | None = None,
    seed: int = 0,
    progress: bool = True,
) -> nn.Module:
    """Load a local HF causal-LM checkpoint as a QLoRA model (NF4 targets + fresh LoRA adapters)."""
    model_dir = Path(model_dir)
    lora = lora or LoRAConfig()
    config = load_config(model_dir)
    headers = checkpoint_files(model_dir)
    model = build_qlora_skeleton(config, lora)
    expected = expected_checkpoint_keys(model)
    targets = {f"{name}.weight" for name in qlora_linears(model)}
    loaded: set[str] = set()
    total = sum(e.nbytes for h in headers for e in h.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="load", disable=not progress) as bar:
        for header in headers:
            with SafetensorsReader(header.path) as reader:
                for key, entry in reader.tensors.items():
                    if key not in expected:
                        log.warning("%s: tensor %s is not used by %s; skipped", header.path, key, type(model).__name__)
                        bar.update(entry.nbytes)
                        continue
                    shape, dtype = expected[key]
                    if tuple(entry.shape) != tuple(shape):
                        raise SlimtuneError(f"{header.path}: tensor {key} has shape {list(entry.shape)}, the model expects {list(shape)}")
                    value = reader.read(key)
                    if value.dtype != dtype:
                        value = value.to(dtype)
                    if key in targets:
                        if can_quantize(value.shape):
                            value = quantize_nf4(value)
                        else:
                            log.warning("%s: %s %s does not divide into NF4 blocks; kept in %s", header.path, key, list(value.shape), dtype)
                    set_tensor(model, key, value)
                    loaded.add(key)
                    bar.update(entry.nbytes)
    tied = _tie_embeddings(model, config)
    missing = sorted(set(expected) - loaded - tied)
    if missing:
        raise SlimtuneError(f"{model_dir}: checkpoint lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    init_lora(model, seed)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_a." in name or ".lora_b." in name)
    model.slimtune_source_dir = model_dir
    return model


def _tie_embeddings(model: nn.Module, config: PretrainedConfig) -> set[str]:
    """Tie lm_head to the input embedding when the config says so; returns the keys that were tied."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or isinstance(out, LoRALinear):
        return set()
    out.weight = inp.weight
    return {f"{name}.weight" for name, m in model.named_modules() if m is out}
