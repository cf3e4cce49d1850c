"""Model families: the table of supported ones (the README's table and the tests read it), the default
LoRA targets (PEFT's ``all-linear``), the published checkpoint layout of a model (transformers' own key
and weight conversions, reversed as ``save_pretrained`` does), buffers computed in ``__init__`` and
frozen NF4 mixture-of-experts layers.

Layout: transformers 5 loads a checkpoint through a per-family list of renamings and converters (e.g.
Mixtral's ``experts.3.w1.weight`` -> rows of the fused ``experts.gate_up_proj``) and reverses that list on
save. ``checkpoint_layout`` runs that reversal on a meta state dict whose parameters are views of one
meta arena, so every published tensor comes out as a view whose offset and shape say which rows of which
model parameter it is. Loading reads tensor by tensor into those rows; saving streams them back out."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.hf import read_config_dict, read_model_config
from slimtune.formats.peft_config import ALL_LINEAR
from slimtune.quant import base_rows, is_nf4
from slimtune.vision_families import tiny_values, vision_parts

log = logging.getLogger(__name__)


_DENSE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
_MOE = dict(_DENSE, intermediate_size=128)


@dataclass(frozen=True)
class Family:
    """A model family slimtune loads, trains and saves; ``tiny`` are the config values of the test model."""

    name: str
    model_type: str
    tiny: dict = field(default_factory=dict)
    notes: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", _DENSE),
    Family("Mistral", "mistral", _DENSE),
    Family("Qwen2", "qwen2", _DENSE),
    Family("Qwen3", "qwen3", dict(_DENSE, head_dim=32)),
    Family("Gemma 2", "gemma2", dict(_DENSE, head_dim=32), "tied embeddings; `embed_scale` and rotary buffers built as transformers does"),
    Family("Gemma 3 (text)", "gemma3_text", dict(_DENSE, head_dim=32), "`Gemma3ForCausalLM`; tied embeddings"),
    Family("Phi-3", "phi3", _DENSE, "fused `qkv_proj` and `gate_up_proj` are single targets"),
    Family("OLMo 2", "olmo2", _DENSE),
    Family("GPT-NeoX", "gpt_neox", dict(_DENSE, intermediate_size=512), "head saved as `embed_out` (transformers' renaming, reversed)"),
    Family(
        "GPT-2",
        "gpt2",
        dict(n_embd=128, n_layer=2, n_head=4, n_positions=256),
        "`Conv1D` projections (weights [in, out]): adapters use PEFT's `fan_in_fan_out`; tied embeddings",
    ),
    Family(
        "Mixtral",
        "mixtral",
        dict(_MOE, num_local_experts=4, num_experts_per_tok=2),
        "experts frozen in NF4 (one tensor per expert and projection, as published); router in bf16; no LoRA on experts",
    ),
    Family(
        "Qwen3-MoE",
        "qwen3_moe",
        dict(_MOE, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1]),
        "as Mixtral; dense `mlp_only_layers` MLPs stay frozen too: PEFT maps `gate_proj`/`up_proj`/`down_proj` of MoE models "
        "to the experts, so an adapter on them would not load in PEFT",
    ),
)


# Vision-language families (slimtune.vision_families): transformers' image-text-to-text class; the
# language model as a text family, the vision tower and projector frozen in the base dtype.
VISION_FAMILIES: tuple[Family, ...] = (
    Family(
        "Qwen2.5-VL",
        "qwen2_5_vl",
        notes="`Qwen2_5_VLForConditionalGeneration`; vision tower and merger frozen in the base dtype (`LoRAConfig.vision`: "
        "LoRA on the tower's linears too); image rows need its full processor (torchvision; not tested here); GGUF (`qwen2vl`) + mmproj",
    ),
    Family(
        "SmolVLM / Idefics3",
        "idefics3",
        notes="`Idefics3ForConditionalGeneration`; vision encoder and connector frozen in the base dtype (`LoRAConfig.vision`: "
        "LoRA on the encoder's linears too); `finetune` on image + text rows, `generate --image`; GGUF + mmproj",
    ),
    Family(
        "Gemma 3 (vision)",
        "gemma3",
        notes="`Gemma3ForConditionalGeneration`; SigLIP tower and projector frozen in the base dtype (`LoRAConfig.vision`: "
        "LoRA on the tower's linears too); tied embeddings; image tokens attend to each other both ways (`token_type_ids`); "
        "`finetune` on image + text rows, `generate --image`",
    ),
)


def family_of(model_type: str) -> Family | None:
    return next((f for f in FAMILIES + VISION_FAMILIES if f.model_type == model_type), None)


def family_name(config) -> str:
    fam = family_of(getattr(config, "model_type", ""))
    return fam.name if fam else f"{getattr(config, 'model_type', '?')} ({', '.join(getattr(config, 'architectures', None) or [])})".strip()


def supported_names() -> str:
    return ", ".join(f.name for f in FAMILIES + VISION_FAMILIES)


# --- Targets -------------------------------------------------------------------------------------------


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2): the layers PEFT's all-linear takes."""
    from transformers.pytorch_utils import Conv1D  # lazy: the merge path imports this module, never transformers

    return isinstance(module, (nn.Linear, Conv1D))


def output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def resolve_targets(model: nn.Module, targets: list[str] | str, vision: bool = False) -> list[str]:
    """The leaf names of the layers that get an adapter. ``all-linear`` (PEFT's convention): every
    nn.Linear / Conv1D except the output head; in a vision-language family only the language model's
    (and the vision tower's with ``vision``: ``adaptable_linear``). On a mixture-of-experts model, names
    that the published layout gives the experts (Qwen3-MoE's gate_proj/up_proj/down_proj, Mixtral's
    w1/w2/w3) are left out: PEFT maps those names to the fused experts, so an adapter on a dense layer of
    that name would not load in PEFT. Example: ``resolve_targets(model, "all-linear")``."""
    if isinstance(targets, str):
        targets = [targets]
    reserved = expert_leaf_names(model)
    explicit = sorted(set(targets) & reserved)
    if explicit:
        raise SlimtuneError(
            f"{family_name(model.config)}: target(s) {explicit} name the mixture-of-experts projections in PEFT's adapter "
            f"format; slimtune keeps the experts frozen (no LoRA on experts); target the attention layers or use all-linear"
        )
    if ALL_LINEAR not in targets:
        return list(targets)
    head = output_head(model)
    named = model.named_modules()
    leaves = {n.rsplit(".", 1)[-1] for n, m in named if is_linear(m) and m is not head and adaptable_linear(model, n, vision)}
    if leaves & reserved:
        names = sorted(leaves & reserved)
        log.debug("%s: layers named %s stay frozen: PEFT maps these names to the experts", family_name(model.config), names)
    leaves -= reserved
    extra = [t for t in targets if t != ALL_LINEAR]
    if not leaves:
        raise SlimtuneError(f"{family_name(model.config)}: has no linear layers for all-linear; list lora.target_modules explicitly")
    return sorted(leaves | set(extra))


def adaptable_linear(model: nn.Module, name: str, vision: bool = False) -> bool:
    """Whether linear ``name`` may be NF4 with an adapter: every one of a text family; in a vision-language
    family the language model's, and the vision tower's with ``vision`` (never the projector's)."""
    parts = vision_parts(getattr(model.config, "model_type", ""))
    return parts is None or parts.adaptable(name, vision)


def expert_leaf_names(model: nn.Module) -> set[str]:
    """Module names the published layout gives the MoE experts' tensors (``experts.3.w1.weight`` -> w1)."""
    experts = fused_experts(model)
    if not experts:
        return set()
    prefixes = tuple(f"{name}." for name in experts)
    return {p.key.rsplit(".", 2)[-2] for p in checkpoint_layout(model) if p.param.startswith(prefixes)}


def default_targets(model_type: str, vision: bool = False) -> list[str]:
    """all-linear resolved for a family (README table)."""
    fam = family_of(model_type)
    return resolve_targets(meta_model(tiny_config(fam)), ALL_LINEAR, vision)


# --- Building ------------------------------------------------------------------------------------------


def meta_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The transformers model for ``config`` with every tensor on the meta device (no memory): the
    causal-LM class, or the image-text-to-text class of a vision-language family."""
    # lazy: the merge path imports this module, never transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision_parts(getattr(config, "model_type", "")) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype)
    except ValueError as e:
        raise SlimtuneError(
            f"model type {getattr(config, 'model_type', '?')!r} has no causal-LM class in transformers ({first_line(e)}); "
            f"supported families: {supported_names()}"
        ) from None


def check_supported(model: nn.Module) -> None:
    """Clear errors for layer types slimtune cannot quantize, train or save."""
    name = family_name(model.config)
    if family_of(getattr(model.config, "model_type", "")) is None:
        log.warning("%s is not among the tested families (%s); trying it as a generic causal LM", name, supported_names())
    parts = vision_parts(getattr(model.config, "model_type", ""))
    for mod_name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if parts is not None and parts.in_vision(mod_name):  # frozen in the base dtype: any layer type streams
            continue
        if _is_fused_experts(module, params):
            bad = [a for a in ("has_bias", "is_transposed", "has_post_expert_norm") if getattr(module, a, False)]
            if bad or not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True):
                raise SlimtuneError(
                    f"{name}: MoE experts {mod_name} ({type(module).__name__}, {bad or 'non-concatenated gate/up'}) are not "
                    f"supported; supported MoE layouts are Mixtral's and Qwen3-MoE's (gate_up_proj [E, 2I, H], down_proj [E, H, I])"
                )
        elif any(p.dim() >= 3 for p in params.values()):
            shapes = {n: list(p.shape) for n, p in params.items()}
            raise SlimtuneError(
                f"{name}: layer {mod_name} ({type(module).__name__}, {shapes}) is not supported; supported families: {supported_names()}"
            )


def _is_fused_experts(module: nn.Module, params: dict) -> bool:
    return set(params) == {"gate_up_proj", "down_proj"} and all(p.dim() == 3 for p in params.values()) and hasattr(module, "act_fn")


def materialise_buffers(model: nn.Module) -> None:
    """Buffers computed in __init__ (rotary inv_freq, Gemma's embed_scale, SigLIP's position ids) are empty
    on meta: allocate them on CPU and let transformers' own ``_init_weights`` compute them, as from_pretrained
    does: the ``_init_weights`` of the (sub)model that holds the module (a vision tower is a model of its own,
    with its own init, as transformers' ``initialize_weights`` dispatches)."""
    from transformers import PreTrainedModel  # lazy: the merge path imports this module, never transformers

    owners = [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel)]
    for name, module in model.named_modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not metas:
            continue
        for n in metas:  # NaN (an integer's least value) marks what _init_weights does not compute
            buf = module._buffers[n]
            module._buffers[n] = torch.full_like(buf, _unset(buf.dtype) or 0, device="cpu")
        owner = max((o for o in owners if not o[0] or name == o[0] or name.startswith(f"{o[0]}.")), key=lambda o: len(o[0]))[1]
        with torch.no_grad():
            owner._init_weights(module)
        for n in metas:  # refuse to guess a buffer transformers' own init does not compute
            buf, mark = module._buffers[n], _unset(module._buffers[n].dtype)
            if mark is not None and (buf.isnan() if buf.is_floating_point() else buf == mark).any():
                raise SlimtuneError(f"{family_name(model.config)}: cannot compute buffer {name}.{n} of {type(module).__name__}")


def _unset(dtype: torch.dtype) -> float | int | None:
    """What marks a buffer element ``_init_weights`` left alone: NaN, a signed integer's least value; None
    where no value can (bool, unsigned)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool or torch.iinfo(dtype).min == 0:
        return None
    return torch.iinfo(dtype).min


# --- Published layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """One tensor of the published checkpoint: ``shape``, stored at rows ``row0 ..`` of model parameter
    ``param`` viewed as [-1, last dim] (1-D parameters: elements)."""

    key: str
    param: str
    row0: int
    shape: tuple[int, ...]
    param_shape: tuple[int, ...]

    @property
    def cols(self) -> int:
        return param_cols(self.param_shape)

    @property
    def num_rows(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n // self.cols

    @property
    def whole(self) -> bool:
        return self.row0 == 0 and tuple(self.shape) == tuple(self.param_shape)


def param_cols(shape: tuple[int, ...]) -> int:
    return shape[-1] if len(shape) >= 2 else 1


def model_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameters (tied ones once) and persistent buffers, as transformers' state dict names them."""
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, buf in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        if attr not in model.get_submodule(module_name)._non_persistent_buffers_set:
            out[name] = tuple(buf.shape)
    return out


def checkpoint_layout(model: nn.Module) -> list[Placement]:
    """Where each tensor of the family's published checkpoint lives in the model, from transformers'
    own reversed conversions (what save_pretrained writes for this model). The conversion runs twice:
    on meta tensors (names and shapes) and on row-id tensors (each parameter viewed [-1, last dim] with
    its last dimension collapsed to one global row number), which says which rows each output holds."""
    from transformers.core_model_loading import revert_weight_conversion  # lazy: the merge path imports this module, never transformers

    tensors = model_tensors(model)
    fam = family_name(model.config)
    starts, names, total = [], [], 0
    ids = {}
    for name, shape in tensors.items():
        rows = _numel(shape) // param_cols(shape) if shape else 1
        starts.append(total)
        names.append(name)
        id_shape = shape[:-1] + (1,) if len(shape) >= 2 else shape
        ids[name] = torch.arange(total, total + rows, dtype=torch.int32).view(id_shape)
        total += rows
    try:
        with torch.device("meta"):
            metas = {n: torch.empty(s) for n, s in tensors.items()}
            shapes = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, metas).items()}
        reverted = revert_weight_conversion(model, ids)
    except Exception as e:  # noqa: BLE001 - any failure of the conversion is an unsupported family
        raise SlimtuneError(f"{fam}: transformers' weight conversion cannot be reversed ({e})") from None
    if set(shapes) != set(reverted):
        raise SlimtuneError(f"{fam}: transformers' weight conversion acts on the last dimension of a weight; not supported")
    layout = []
    for key, t in reverted.items():
        t = (t[0] if isinstance(t, list) else t).reshape(-1)
        i = bisect.bisect_right(starts, int(t[0])) - 1 if t.numel() else -1
        name = names[i]
        shape, out_shape = tensors[name], shapes[key]
        row0 = int(t[0]) - starts[i]
        cols = param_cols(shape)
        ok = (
            t.numel() * cols == _numel(out_shape)
            and torch.equal(t, torch.arange(int(t[0]), int(t[0]) + t.numel(), dtype=t.dtype))
            and row0 + t.numel() <= _numel(shape) // cols
            and (cols == 1 or (len(out_shape) >= 2 and out_shape[-1] == cols))
        )
        if not ok:
            raise SlimtuneError(f"{fam}: checkpoint tensor {key} {list(out_shape)} is not whole rows of one parameter; not supported")
        layout.append(Placement(key, name, row0, out_shape, shape))
    return layout


def forward_renamings(model: nn.Module):
    """transformers' load-time renamings (legacy names included), for checkpoints not in the published layout."""
    from transformers.conversion_mapping import get_model_conversion_mapping  # lazy: the merge path imports this module, never transformers
    from transformers.core_model_loading import WeightRenaming  # lazy: the merge path imports this module, never transformers

    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]

    def rename(key: str) -> str:  # each renaming in turn, as from_pretrained does (apply_renamings, 5.2x only)
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    return rename


def model_key_names(model_dir, keys) -> dict[str, str]:
    """A vision-language base's tensor ``keys`` -> the model's names for them (transformers' load-time
    renamings, ``forward_renamings``): PEFT names an adapter's modules as the model does
    (``model.language_model.layers.0...``) where the file has the published keys (``model.layers.0...``).
    Empty for a text family, whose file keys are the model's names (and transformers is not imported).

    Example: ``model_key_names("qwen-vl", ["model.layers.0.mlp.up_proj.weight"])`` ->
    ``{"model.layers.0.mlp.up_proj.weight": "model.language_model.layers.0.mlp.up_proj.weight"}``"""
    if vision_parts(read_config_dict(model_dir).get("model_type", "")) is None:
        return {}
    rename = forward_renamings(meta_model(read_model_config(model_dir)))
    names = {k: rename(k) for k in keys}
    seen: dict[str, str] = {}
    for key, name in names.items():
        if seen.setdefault(name, key) != key:
            raise SlimtuneError(f"{model_dir}: tensors {seen[name]} and {key} are both the model's {name}")
    return names


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- Frozen NF4 experts ----------------------------------------------------------------------------------


class NF4Experts(nn.Module):
    """A transformers fused-experts layer (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) held as
    the checkpoint's own pieces (one tensor per expert and projection), each NF4 as it is read, frozen.
    The forward is transformers' eager loop; each piece's matmul dequantizes only that piece."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.shapes = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)}
        self.pieces = nn.ParameterDict()
        self.index: dict[str, list[tuple[int, int, str]]] = {n: [] for n in self.shapes}  # (row0, rows, piece)

    def add_piece(self, attr: str, row0: int, value: torch.Tensor) -> None:
        """Rows ``row0 ..`` of ``attr`` viewed 2-D; NF4 when its size divides into NF4 blocks."""
        from slimtune.quant.nf4 import can_quantize, quantize_nf4  # torchao (~80 MB): only for a model with experts

        value = value.reshape(-1, self.shapes[attr][-1])
        key = f"{attr}_{row0}"
        if can_quantize(value.shape):
            value = quantize_nf4(value)
        self.pieces[key] = nn.Parameter(value, requires_grad=False)
        self.index[attr].append((row0, value.shape[0], key))
        self.index[attr].sort()

    def covered_rows(self, attr: str) -> int:
        return sum(n for _, n, _ in self.index[attr])

    def rows(self, attr: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of ``attr`` viewed 2-D, in the base dtype (NF4 dequantized as torchao does)."""
        parts = []
        for row0, n, key in self.index[attr]:
            a, b = max(start, row0), min(end, row0 + n)
            if a < b:
                parts.append(base_rows(self.pieces[key], a - row0, b - row0))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _linear(self, x: torch.Tensor, attr: str, expert: int) -> torch.Tensor:
        per = self.shapes[attr][1]
        start, end = expert * per, (expert + 1) * per
        outs = []
        for row0, n, key in self.index[attr]:
            a, b = max(start, row0), min(end, row0 + n)
            if a >= b:
                continue
            w = self.pieces[key]
            if is_nf4(w) and (a, b) == (row0, row0 + n):
                from slimtune.quant.nf4 import nf4_linear  # an NF4 weight exists: torchao is loaded already

                outs.append(nf4_linear(x, w))
            else:
                outs.append(nn.functional.linear(x, base_rows(w, a - row0, b - row0).to(x.dtype)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in hit:
            expert = int(expert[0])
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert])
            state = hidden_states[token_idx]
            gate, up = self._linear(state, "gate_up_proj", expert).chunk(2, dim=-1)
            out = self._linear(self.act_fn(gate) * up, "down_proj", expert)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        nf4 = sum(1 for p in self.pieces.values() if type(p).__name__ == "NF4Tensor" or "NF4" in type(p.data).__name__)
        return f"experts={self.num_experts}, pieces={len(self.pieces)}, nf4={nf4}"


def fused_experts(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if _is_fused_experts(m, dict(m.named_parameters(recurse=False)))]


def frozen_nf4_keys(config) -> set[str]:
    """Published keys of the weights slimtune holds in NF4 without an adapter (MoE experts): the offline
    merge with ``--merge-base quantized`` round-trips them too, as training saw them."""
    model = meta_model(config)
    experts = fused_experts(model)
    if not experts:
        return set()
    check_supported(model)
    prefixes = tuple(f"{name}." for name in experts)
    return {p.key for p in checkpoint_layout(model) if p.param.startswith(prefixes)}


# --- Tiny models for tests and docs --------------------------------------------------------------------


def tiny_config(family: Family, vocab_size: int = 259, **overrides):
    """The family's config at test widths (every projection divides into NF4 blocks), bf16. A
    vision-language family's vocabulary is ``vocab_size`` text tokens and its image tokens after them."""
    from transformers import AutoConfig  # lazy: the merge path imports this module, never transformers

    special = dict(pad_token_id=vocab_size - 3, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1)
    values = dict(family.tiny, vocab_size=vocab_size, dtype="bfloat16", **special)
    if family.model_type != "gpt2":
        values["max_position_embeddings"] = 256
    if vision_parts(family.model_type):  # vision-language: the image tokens come after the text vocabulary
        values = tiny_values(family.model_type, values)
    values.update(overrides)
    return AutoConfig.for_model(family.model_type, **values)


def family_table() -> str:
    """The README's table of supported families (``python -m slimtune.families`` prints it)."""
    rows = ["| family | `model_type` | default targets (`all-linear`) | notes |", "| --- | --- | --- | --- |"]
    for f in FAMILIES + VISION_FAMILIES:
        targets = " ".join(f"`{t}`" for t in default_targets(f.model_type))
        rows.append(f"| {f.name} | `{f.model_type}` | {targets} | {f.notes} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(family_table())
