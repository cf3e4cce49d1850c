"""A QLoRA model from a local Hugging Face checkpoint: built on the meta device, then filled tensor by
tensor from the safetensors files, quantizing target weights to NF4 as they arrive (a bitsandbytes 4-bit
checkpoint's 4-bit weights are kept as the file stores them). The bf16 model is
never held: at most one source tensor (and its quantization temporaries) is in memory beside the result.

Under a process group (torchrun) the meta model is FSDP2-sharded *before* any tensor is read
(``shard_model``: ``fully_shard`` per decoder layer and at the root), so every parameter is a meta
DTensor that knows its rows on this rank. Each source tensor is then read whole, quantized whole (NF4's
double quantization depends on every block of the tensor, so a rank's rows are bit-identical to the
same rows of a single-process load) and cut to this rank's rows, ``torch.chunk`` as FSDP2 cuts; the
whole tensor is dropped before the next is read. A rank never holds more than one full source tensor
and its NF4 beyond its own shards (a parameter fused from several checkpoint tensors is assembled whole
first, then cut). FSDP2 re-reads the swapped-in shards at its lazy initialisation, as after
``load_state_dict(assign=True)``."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PretrainedConfig
from transformers.pytorch_utils import Conv1D

from slimtune.distributed import SINGLE, Ranks, is_dtensor, shard_model, unsplittable_nf4
from slimtune.errors import SlimtuneError
from slimtune.facts import ModelFacts, facts_of, remember
from slimtune.families import (
    NF4Experts,
    Placement,
    adaptable_linear,
    check_supported,
    checkpoint_layout,
    family_name,
    forward_renamings,
    fused_experts,
    is_linear,
    materialise_buffers,
    meta_model,
    output_head,
    resolve_targets,
)
from slimtune.formats.bnb import BnbNF4Weight, aux_owner, bnb_4bit_settings, four_bit_keys, is_aux_key, read_4bit_weights
from slimtune.formats.hf import checkpoint_files, read_config_dict, read_model_config
from slimtune.formats.hub import ModelSource, resolve_model
from slimtune.formats.peft import lora_key
from slimtune.formats.peft_config import ALL_LINEAR
from slimtune.formats.safetensors import SafetensorsReader
from slimtune.lora import LoRAConfig, LoRALinear, lora_modules, qlora_linears
from slimtune.quant import is_nf4
from slimtune.quant.bnb4 import Bnb4bitTensor, is_bnb4
from slimtune.quant.nf4 import BLOCK_SIZE, can_quantize, not_quantizable_reason, quantize_nf4
from slimtune.tensors import DTYPES

log = logging.getLogger(__name__)


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def build_qlora_skeleton(config: PretrainedConfig, lora: LoRAConfig) -> nn.Module:
    """The transformers model with every target linear (nn.Linear, or Conv1D with fan_in_fan_out)
    replaced by a LoRALinear and fused MoE experts by frozen NF4Experts, all parameters on the meta
    device (no memory), buffers (rotary tables, embed_scale) computed as transformers does. The
    published checkpoint layout and the resolved targets are kept beside the model (``facts_of(model)``)."""
    dtype = config_dtype(config)
    model = meta_model(config, dtype)
    check_supported(model)
    layout = checkpoint_layout(model)  # from the pristine transformers model, before any replacement
    rename = forward_renamings(model)
    materialise_buffers(model)
    targets = resolve_targets(model, lora.target_modules, lora.vision)
    wanted = set(targets) | set(resolve_targets(model, lora.quantize_modules, lora.vision))
    head = output_head(model) if ALL_LINEAR in list(lora.target_modules) + list(lora.quantize_modules) else None
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m) and adaptable_linear(model, n, lora.vision)})
    found = set()
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in wanted and is_linear(module) and module is not head and adaptable_linear(model, name, lora.vision):
            found.add(leaf)
            conv = isinstance(module, Conv1D)
            in_f, out_f = (module.weight.shape[0], module.nf) if conv else (module.in_features, module.out_features)
            replacement = LoRALinear(
                in_f,
                out_f,
                lora.rank if leaf in targets else 0,
                lora.alpha,
                lora.dropout,
                lora.use_rslora,
                bias=module.bias is not None,
                dtype=dtype,
                device="meta",
                fan_in_fan_out=conv,
            )
            model.set_submodule(name, replacement)
    missing = [t for t in sorted(wanted) if t not in found]
    if missing:
        raise _missing_targets(model, missing, lora.vision, linears)
    for name in fused_experts(model):
        model.set_submodule(name, NF4Experts(model.get_submodule(name)))
    _check_adapter_size(model, lora)
    remember(model, ModelFacts(layout=layout, targets=targets, rename=rename))
    return model


def _missing_targets(model: nn.Module, missing: list[str], vision: bool, linears: list[str]) -> SlimtuneError:
    """Targets that name no linear slimtune may adapt: what they are, the linears that can be targets
    (``linears``, named before any was replaced), and (a vision-language model) whether they are the frozen
    vision tower's (``LoRAConfig.vision``)."""
    adaptable = [(n, m) for n, m in model.named_modules() if adaptable_linear(model, n, vision)]
    others = sorted({type(m).__name__ for n, m in adaptable if n.rsplit(".", 1)[-1] in missing})
    kind = f" (they are {others}, not linear layers)" if others else ""
    frozen = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m) and not adaptable_linear(model, n, vision)}
    if set(missing) & frozen:
        kind += f" ({sorted(set(missing) & frozen)} are vision linears, frozen; LoRAConfig.vision adapts the vision tower's)"
    return SlimtuneError(
        f"target module(s) {missing} not found in {family_name(model.config)} ({type(model).__name__}){kind}; "
        f"its linear layers are {linears}, or use all-linear"
    )


def _check_adapter_size(model: nn.Module, lora: LoRAConfig) -> None:
    """On the meta skeleton, before anything is allocated: refuse adapters larger than the whole model they
    adapt (a rank typo such as 1000000000 would otherwise try to allocate terabytes)."""
    adapters = lora_modules(model).values()
    size = sum(m.rank * (m.in_features + m.out_features) for m in adapters)
    base = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
    if adapters and size > base:
        narrowest = min(min(m.in_features, m.out_features) for m in adapters)
        raise SlimtuneError(
            f"LoRA rank {lora.rank} (lora.rank; r in an adapter_config.json): the adapters would hold {size:,} parameters "
            f"({size * 4 / 2**30:,.1f} GiB in fp32), more than the whole base model ({base:,}); "
            f"a useful rank is far below the narrowest target's width ({narrowest})"
        )


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, trainable: bool = False) -> None:
    """Put ``value`` (the whole tensor) at parameter or buffer ``name``; where the model is sharded
    (the parameter is a DTensor) only this rank's rows of it are kept."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        current = module._parameters[attr]
        if is_dtensor(current):
            value = _local_shard(value, current)
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
    """Names, shapes and dtypes the base checkpoint provides, in the family's published layout (tied
    copies and adapters excluded)."""
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    dtype = config_dtype(model.config)
    return {p.key: (torch.Size(p.shape), dtypes.get(p.param, dtype)) for p in facts_of(model).layout}


def load_qlora_model(
    model_dir: str | Path | ModelSource,
    lora: LoRAConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    ranks: Ranks = SINGLE,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Load a HF causal-LM checkpoint (a directory, or a hub id resolved by ``resolve_model``) as a QLoRA
    model (NF4 targets + fresh LoRA adapters).
    Each tensor is read, converted as transformers converts it (renamed, or placed as rows of a fused
    parameter), quantized when it is an NF4 weight, and dropped before the next one is read. With the
    ``ranks`` of a process group the model comes out FSDP2-sharded, each rank holding only its rows
    (see the module docstring); the adapters start the same on every rank (from ``seed``). ``dtype``:
    the compute dtype the frozen weights that stay unquantized (embeddings, norms) are held in, cast
    from the checkpoint's dtype as they arrive (default: the checkpoint's dtype). A bitsandbytes 4-bit
    checkpoint (``quantization_config.load_in_4bit``) keeps its 4-bit weights as stored (``quant.bnb4``):
    every linear the file holds in 4-bit is a frozen 4-bit weight (with an adapter where targeted), the
    others (an ``llm_int8_skip_modules`` lm_head) keep the file's dtype; nothing is quantized again.

    Example: ``model = load_qlora_model("path/to/Qwen3-0.6B", LoRAConfig(rank=16, alpha=32))``"""
    source = resolve_model(model_dir)
    model_dir = source.path
    lora = lora or LoRAConfig()
    prequantized = bnb_4bit_settings(read_config_dict(model_dir), str(model_dir / "config.json"))  # 8-bit refused here
    config = read_model_config(model_dir)
    headers = checkpoint_files(model_dir) if prequantized else None
    four_bit = four_bit_keys([k for h in headers for k in h.tensors]) if prequantized else set()
    if four_bit:  # every linear the file holds in 4-bit stays 4-bit: frozen, with or without an adapter
        leaves = sorted({k.rsplit(".", 2)[-2] for k in four_bit})
        lora = dataclasses.replace(lora, quantize_modules=[*lora.quantize_modules, *leaves])
        log.info("%s: bitsandbytes 4-bit (%s): %d weights read as stored", model_dir, prequantized, len(four_bit))
    model = build_qlora_skeleton(config, lora)  # an unsupported architecture fails here, before any tensor is read
    if dtype is not None:
        _hold_frozen_in(model, dtype)
    facts = facts_of(model)
    layout = {p.key: p for p in facts.layout}
    sharded = ranks.distributed
    if sharded:
        whole = _unshardable_nf4(model, ranks, model_dir) | {model.get_parameter(layout[k].param) for k in four_bit if k in layout}
        _tie_embeddings(model, config)  # one parameter before sharding: FSDP2 then holds it once
        init_lora(model, seed)
        shard_model(model, ranks, keep_whole=whole)
    headers = headers or checkpoint_files(model_dir)
    targets = set() if prequantized else {f"{name}.weight" for name in qlora_linears(model)}  # a 4-bit base's others stay as stored
    loaded = _load_tensors(model, headers, targets, bool(four_bit), progress, model_dir)
    tied = _tie_embeddings(model, config)  # sharded: ties the loaded shard again (loading replaced the parameter)
    missing = [p.key for p in facts.layout if p.key not in loaded and p.param not in tied]
    if missing:
        raise SlimtuneError(f"{model_dir}: checkpoint lacks tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if not sharded:
        init_lora(model, seed)
    elif ranks.device_type == "cuda":  # weights FSDP2 left whole: to this rank's GPU, as FSDP2 put its shards
        for name, p in list(model.named_parameters()):
            if not is_dtensor(p) and not p.is_cuda:
                set_tensor(model, name, p.data.to(torch.device("cuda", torch.cuda.current_device())))
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_a." in name or ".lora_b." in name)
    facts.source_dir, facts.base_name = model_dir, source.name
    log.debug("%s", nf4_summary_line(nf4_report(model)))  # the recipe states it at INFO, once
    return model


def _load_tensors(model: nn.Module, headers: list, targets: set[str], four_bit: bool, progress: bool, model_dir: Path) -> set[str]:
    """Every tensor of the checkpoint's files into the model, one at a time, in file order: converted as
    transformers converts it (``_place``; ``targets`` quantized to NF4) or, with ``four_bit``, the file's
    bitsandbytes 4-bit weights held as stored (``_place_4bit``). Returns the layout keys filled."""
    facts = facts_of(model)
    layout = {p.key: p for p in facts.layout}
    by_param = {p.param: p for p in facts.layout if p.whole}
    loaded: set[str] = set()
    total = sum(e.nbytes for h in headers for e in h.tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="load", disable=not progress) as bar, ExitStack() as files:
        readers = [files.enter_context(SafetensorsReader(h.path)) for h in headers]
        location = {key: r for r in readers for key in r.tensors}
        bnb = read_4bit_weights(location, str(model_dir)) if four_bit else {}
        for reader in readers:
            for key, entry in reader.tensors.items():
                bar.update(entry.nbytes)
                if is_aux_key(key) and aux_owner(key) in bnb:  # read with its weight
                    continue
                place = layout.get(key)
                if place is None:  # the model's own names, or legacy names transformers renames on load
                    renamed = facts.rename(key)
                    place = layout.get(renamed) or by_param.get(renamed)
                if place is None or place.key in loaded:
                    log.warning("%s: tensor %s is not used by %s; skipped", reader.path, key, type(model).__name__)
                    continue
                shape = bnb[key].shape if key in bnb else tuple(entry.shape)
                if tuple(shape) != tuple(place.shape):
                    what = "4-bit weight (its quant state's shape)" if key in bnb else "shape"
                    raise SlimtuneError(f"{reader.path}: tensor {key} has {what} {list(shape)}, the model expects {list(place.shape)}")
                if key in bnb:
                    _place_4bit(model, place, bnb[key], reader.path)
                else:
                    _place(model, place, reader.read(key), place.param in targets, reader.path)
                loaded.add(place.key)
    return loaded


def _place_4bit(model: nn.Module, place: Placement, weight: BnbNF4Weight, path: Path) -> None:
    """A bitsandbytes 4-bit weight as the frozen weight of its linear: its packed bytes read whole (the
    file's bytes, held as they are) with the block state ``read_4bit_weights`` checked."""
    module_name, _, attr = place.param.rpartition(".")
    module = model.get_submodule(module_name)
    if not (place.whole and attr == "weight" and isinstance(module, LoRALinear) and not module.fan_in_fan_out):
        raise SlimtuneError(
            f"{path}: tensor {place.key} is bitsandbytes 4-bit, but {place.param} is not the weight of a linear layer "
            "slimtune holds whole (4-bit embeddings, fused or Conv1D weights are not supported)"
        )
    packed = weight.read_bytes(0, (weight.shape[0] * weight.shape[1] + 1) // 2)
    set_tensor(model, place.param, Bnb4bitTensor(weight, packed))


def nf4_report(model: nn.Module) -> dict:
    """What the load made of each frozen-base linear (adapter targets and quantize_modules), read from
    the loaded weights: the per-tensor scaler block of the NF4 ones, and why the others kept their dtype.
    This is what the model card and ``slimtune_format.json`` record.

    Example: ``nf4_report(model)["scaler_blocks"] == {"256": 90, "216": 120}`` on SmolLM2-135M"""
    tensors: dict[str, int] = {}
    kept: dict[str, str] = {}
    bnb4: dict[str, int] = {}  # bitsandbytes 4-bit as the base file stores it: name -> block size
    for name, module in qlora_linears(model).items():
        weight = module.weight.data
        local = weight.to_local() if is_dtensor(weight) else weight
        if is_nf4(local):
            tensors[f"{name}.weight"] = int(local.scaler_block_size)
        elif is_bnb4(local):
            bnb4[f"{name}.weight"] = local.state.blocksize
        else:
            shape = tuple(weight.shape)
            reason = not_quantizable_reason(shape) or "not quantized"
            kept[f"{name}.weight"] = f"{list(shape)} {str(weight.dtype).removeprefix('torch.')}: {reason}"
    counts: dict[str, int] = {}
    for sbs in sorted(tensors.values(), reverse=True):
        counts[str(sbs)] = counts.get(str(sbs), 0) + 1
    extra = {"bnb4": len(bnb4)} if bnb4 else {}  # a pre-quantized base: its 4-bit weights are the file's, not NF4
    return extra | {
        "block_size": BLOCK_SIZE,
        "targets": len(tensors) + len(kept) + len(bnb4),
        "nf4": len(tensors),
        "scaler_blocks": counts,
        "kept": kept,
        "tensors": tensors,
    }


def nf4_summary_line(report: dict) -> str:
    """One line for the log: ``NF4: 210 of 210 targets (scaler blocks: 256 x 90, 216 x 120)``, and the
    ones kept in their dtype with the reason (the first three named)."""
    blocks = ", ".join(f"{sbs} x {n}" for sbs, n in report["scaler_blocks"].items())
    line = f"NF4: {report['nf4']} of {report['targets']} targets" + (f" (scaler blocks: {blocks})" if blocks else "")
    if report.get("bnb4"):
        line = f"bitsandbytes 4-bit, as the base file stores it: {report['bnb4']} of {report['targets']} targets" + (
            f"; NF4: {report['nf4']}" if report["nf4"] else ""
        )
    kept = report["kept"]
    if kept:
        named = "; ".join(f"{k} {why}" for k, why in list(kept.items())[:3])
        line += f"; {len(kept)} kept in their dtype: {named}" + (" ..." if len(kept) > 3 else "")
    return line


def _place(model: nn.Module, place: Placement, value: torch.Tensor, nf4_target: bool, path: Path) -> None:
    """Put one checkpoint tensor where transformers' conversion puts it, in the model dtype."""
    module_name, _, attr = place.param.rpartition(".")
    module = model.get_submodule(module_name)
    dtype = config_dtype(model.config)
    if isinstance(module, NF4Experts):
        module.add_piece(attr, place.row0, value.to(dtype) if value.dtype != dtype else value)
        return
    target = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    if target is None and attr not in module._buffers:
        raise SlimtuneError(f"model has no parameter {place.param}")
    if value.dtype != dtype:
        value = value.to(dtype)  # the checkpoint's dtype first, so a frozen weight held in another is rounded as a cast of it
    if value.dtype != target.dtype:
        value = value.to(target.dtype)
    if place.whole:
        value = value.reshape(place.param_shape)
        if nf4_target and can_quantize(value.shape):  # the others keep their dtype (nf4_report says which and why)
            value = quantize_nf4(value)
        set_tensor(model, place.param, value)
        return
    if isinstance(module, LoRALinear):
        raise SlimtuneError(f"{path}: {place.key} is part of linear {module_name}, which slimtune holds whole; not supported")
    if is_dtensor(target):  # sharded: assemble the whole parameter, then keep this rank's rows of it
        staging = facts_of(model).staging
        whole, filled = staging.get(place.param) or (torch.empty(place.param_shape, dtype=target.dtype), 0)
        whole.view(-1, place.cols)[place.row0 : place.row0 + place.num_rows] = value.reshape(-1, place.cols)
        filled += value.numel()
        staging[place.param] = (whole, filled)
        if filled == whole.numel():
            set_tensor(model, place.param, staging.pop(place.param)[0])
        return
    if target.is_meta:  # a parameter assembled from several checkpoint tensors: rows as they arrive
        set_tensor(model, place.param, torch.empty(place.param_shape, dtype=target.dtype))
        target = getattr(module, attr)
    target.data.view(-1, place.cols)[place.row0 : place.row0 + place.num_rows] = value.reshape(-1, place.cols)


def _hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """On the meta skeleton: frozen floating weights that will not be NF4 (embeddings, norms, weights
    that do not divide into NF4 blocks) take the compute dtype; NF4 targets stay in the checkpoint's
    dtype (quantized from it) and the adapters in fp32. Tied weights are one Parameter, cast once."""
    quantized = {f"{name}.weight" for name, m in qlora_linears(model).items() if can_quantize(m.weight.shape)}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or name in quantized or ".lora_" in name or not p.dtype.is_floating_point or p.dtype == dtype:
            continue
        seen.add(id(p))
        p.data = p.data.to(dtype)


def _local_shard(value: torch.Tensor, like) -> torch.Tensor:
    """This rank's rows of the whole tensor ``value``, as a DTensor laid out like the sharded ``like``
    (``torch.chunk`` on dim 0; a rank past the last chunk gets no rows)."""
    from torch.distributed.tensor import DTensor  # only where FSDP2 may have sharded: not loaded by a one-process run

    mesh = like.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    chunks = value.chunk(world, dim=0) if value.dim() else (value,)
    local = chunks[rank] if rank < len(chunks) else value.new_empty((0, *value.shape[1:]))
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    local = local.to(device) if local.device != device else local
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=value.shape, stride=value.stride())


def _unshardable_nf4(model: nn.Module, ranks: Ranks, model_dir: Path) -> set[nn.Parameter]:
    """The (still meta) weights that will be NF4 but that FSDP2 cannot cut among the ranks
    (``unsplittable_nf4``): held whole on every rank instead. Experts are refused here."""
    if any(isinstance(m, NF4Experts) for m in model.modules()):
        raise SlimtuneError(f"{model_dir}: sharding mixture-of-experts models over several ranks is not supported yet; run one process")
    whole = unsplittable_nf4(model, ranks.world_size)
    if whole:
        log.debug(
            "%d NF4 weight(s) do not split into %d equal parts of whole scaler blocks: held whole on every rank",
            len(whole),
            ranks.world_size,
        )
    return whole


def _tie_embeddings(model: nn.Module, config: PretrainedConfig) -> set[str]:
    """Tie lm_head to the input embedding when the config says so; returns the keys that were tied."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or isinstance(out, LoRALinear):
        return set()
    out.weight = inp.weight
    return {f"{name}.weight" for name, m in model.named_modules() if m is out}


# --- Loading helpers shared by training and generation ----------------------------------------------


def pick_device(name: str) -> torch.device:
    """``auto``: cuda where torch sees a GPU, else cpu; ``cuda`` without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SlimtuneError("device is cuda but torch sees no CUDA GPU (use device=cpu or device=auto)")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: x86's AVX512_BF16 or AMX-BF16, Arm's BF16 extension (read
    from /proc/cpuinfo; Apple silicon counts as having it). Elsewhere torch's bf16 matrix products take a
    slow path: on an AVX2-only AMD EPYC they took ~18x fp32's time (docs/training.md).

    Example: ``torch.bfloat16 if cpu_has_native_bf16() else torch.float32``"""
    return _cpu_flags_have_bf16(_cpu_flags())


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), or None where /proc/cpuinfo is absent."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _cpu_flags_have_bf16(flags: set[str] | None) -> bool:
    if flags is None:  # no /proc/cpuinfo: macOS (Apple silicon has bf16) or another system (bf16, as before)
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: on a GPU bf16 where it has it, fp16 (with loss scaling) where not; on the CPU bf16 where
    it multiplies bf16 natively (``cpu_has_native_bf16``), fp32 where not (bf16 there is many times slower).

    Example: ``pick_dtype("auto", torch.device("cpu"))``"""
    if name == "auto":
        if device.type != "cuda":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "fp16" and device.type != "cuda":
        raise SlimtuneError("dtype fp16 is for GPUs without bf16; on the CPU use bf16 or fp32")
    return DTYPES[name]


def load_tokenizer(model_dir: Path, chat_template: str | None = None):
    """The tokenizer of a local model directory (``chat_template``: this one instead of the files');
    unusable files are one ``SlimtuneError`` line.

    Example: ``tokenizer = load_tokenizer(Path("models/SmolLM2-135M-Instruct"))``"""
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **extra)
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise many types (KeyError...) for bad files
        raise SlimtuneError(f"{model_dir}: no usable tokenizer files ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    if type(tokenizer.model_max_length) is not int:  # compared with sequence lengths when tokenizing
        found = type(tokenizer.model_max_length).__name__
        raise SlimtuneError(f"{model_dir}/tokenizer_config.json: model_max_length must be an integer, found {found}")
    return tokenizer


def load_processor(model_dir: Path):
    """A vision-language model's processor (``AutoProcessor``: tokenizer, image processor, chat template)
    from its local directory; unusable or missing files are one ``SlimtuneError`` line.

    Example: ``processor = load_processor(Path("runs/vlm-base"))``"""
    from transformers import AutoProcessor  # lazy: text models never build one

    try:
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types (ImportError for a missing backend, ...)
        raise SlimtuneError(f"{model_dir}: no usable processor files ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    if getattr(processor, "image_processor", None) is None:
        raise SlimtuneError(f"{model_dir}: the processor has no image processor (preprocessor_config.json or processor_config.json)")
    return processor


def load_adapter_weights(model: nn.Module, path: Path) -> None:
    """The fp32 adapters from the checkpoint's PEFT file, bit for bit."""
    tensors = load_file(str(path))
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            for attr, peft_name in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                key = lora_key(name, peft_name)
                if key not in tensors:
                    raise SlimtuneError(f"{path}: no tensor {key}")
                getattr(module, attr).weight.copy_(tensors[key])
