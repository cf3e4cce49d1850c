"""A live model as an ordered stream of named tensors (``tensors.StreamTensor``), each produced on demand,
rows at a time: the merged weights in the family's published layout, and the adapters.

Every writer in slimtune consumes this one type: the in-training save, the offline merge, verification.
A StreamTensor knows its name, shape and dtype up front (so headers can be written first) and makes any
row range of itself when asked, so memory holds one chunk, never the model."""

from __future__ import annotations

import torch
from torch import nn

from slimtune.checkpoint.staging import to_host as plain_to_host
from slimtune.distributed import is_dtensor, split_rows
from slimtune.errors import SlimtuneError
from slimtune.facts import facts_of
from slimtune.families import NF4Experts
from slimtune.formats.peft import lora_key
from slimtune.lora import LoRALinear, lora_modules, lora_row_merge, qlora_linears
from slimtune.quant import base_rows
from slimtune.tensors import StreamTensor, ToHost, scalar_source


class LocalRows:
    """The rows of a tensor this process holds: all of a plain tensor, or a DTensor's Shard(0) local
    shard (FSDP2's layout, rows split as ``split_rows``), addressed by global row numbers."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.shape, self.start = name, tuple(tensor.shape), 0
        data = tensor.detach()
        if is_dtensor(data):
            from torch.distributed.tensor import Replicate, Shard  # a DTensor exists: torch.distributed.tensor is loaded

            mesh, placements = data.device_mesh, data.placements
            if mesh.ndim != 1 or not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements):
                raise SlimtuneError(f"{name}: placements {placements} on a {mesh.ndim}-D mesh; the export handles Shard(0) and Replicate")
            local = data.to_local()
            if isinstance(placements[0], Shard):
                self.start, end = split_rows(self.shape[0], mesh.size())[mesh.get_local_rank()]
                if local.shape[0] != end - self.start:
                    expected = f"rows {self.start}:{end} of {self.shape[0]}"
                    raise SlimtuneError(f"{name}: the local shard has {local.shape[0]} rows, expected {expected}")
            data = local
        self.data = data

    def __call__(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) (global numbers) of the local data; any other rows are an error."""
        s, e = start - self.start, end - self.start
        if s < 0 or e > self.data.shape[0]:
            held = f"{self.start}:{self.start + self.data.shape[0]}"
            raise SlimtuneError(f"{self.name}: rows {start}:{end} asked of a rank that holds rows {held}")
        return base_rows(self.data, s, e)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (a collective: every rank calls it, in the same order)."""
    t = t.detach()
    return t.full_tensor() if is_dtensor(t) else t


def tensor_source(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None, to_host: ToHost = plain_to_host) -> StreamTensor:
    """A plain tensor (embedding, norm, bias) as a stream entry, cast per chunk if dtype differs."""
    out_dtype = dtype or tensor.dtype
    if tensor.dim() == 0:
        data = full_tensor(tensor)
        return scalar_source(name, out_dtype, lambda: data)
    local = LocalRows(name, tensor)
    return StreamTensor(name, local.shape, out_dtype, lambda s, e: to_host(local(s, e), out_dtype))


def merged_lora_source(name: str, module: LoRALinear, dtype: torch.dtype, to_host: ToHost = plain_to_host) -> StreamTensor:
    """W + scale * B @ A (and DoRA's rescale) for a LoRA linear: fp32 math on the weight's device, one
    rounding to ``dtype``, then to the host. On an FSDP-sharded model each rank makes the rows it holds:
    its local NF4 rows dequantized, its rows of B, and A all-gathered (r x in, small) when the stream is
    made, so every rank gathers the same tensors in the same order. A fan_in_fan_out weight (Conv1D,
    [in, out]) gets the transposed update: rows of (B @ A)^T are A[:, rows]^T @ B^T."""
    shape = tuple(module.weight.shape)
    weight = LocalRows(name, module.weight)
    if module.lora_a is None:
        return StreamTensor(name, shape, dtype, lambda s, e: to_host(weight(s, e), dtype))
    a = full_tensor(module.lora_a.weight)
    b = full_tensor(module.lora_b.weight) if module.fan_in_fan_out else LocalRows(name + " lora_B", module.lora_b.weight)
    merge = lora_row_merge(a, b, module.scaling, transposed=module.fan_in_fan_out)
    return StreamTensor(name, shape, dtype, lambda s, e: to_host(merge(weight(s, e), s, e), dtype))


def merged_tensor_stream(model: nn.Module, dtype: torch.dtype | None = None, to_host: ToHost = plain_to_host) -> list[StreamTensor]:
    """The merged model in the family's published layout (transformers' conversions reversed, as
    save_pretrained writes it: per-expert MoE tensors, GPT-NeoX's embed_out); tied weights appear once.
    Chunks are computed where the model lives (CPU or GPU) and handed to the writer by ``to_host``."""
    facts = facts_of(model)
    if facts is None:
        raise ValueError("model was not built by slimtune.model (no checkpoint layout)")
    layout = facts.layout
    loras = qlora_linears(model)
    stream: list[StreamTensor] = []
    for place in layout:
        module_name, _, attr = place.param.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, LoRALinear) and attr == "weight":
            src = merged_lora_source(place.key, loras[module_name], dtype or module.weight.dtype, to_host)
        elif isinstance(module, NF4Experts):
            src = _expert_source(module, attr, dtype or next(iter(module.pieces.values())).dtype, to_host)
        else:
            data = getattr(module, attr).detach()
            cast = dtype if data.is_floating_point() else None
            src = tensor_source(place.key, data if place.whole or data.dim() < 2 else data.reshape(-1, data.shape[-1]), cast, to_host)
        if not place.whole:
            src = _rows_of(src, place)
        stream.append(src)
    return stream


def _expert_source(module: NF4Experts, attr: str, dtype: torch.dtype, to_host: ToHost) -> StreamTensor:
    """A fused expert parameter viewed [E * rows, cols], from the pieces the experts layer holds."""
    e, rows, cols = module.shapes[attr]
    return StreamTensor(attr, (e * rows, cols), dtype, lambda s, t: to_host(module.rows(attr, s, t), dtype))


def _rows_of(src: StreamTensor, place) -> StreamTensor:
    """The rows of a parameter (``src``: its [-1, last dim] view) that one published tensor holds."""
    r0, tail = place.row0, tuple(place.shape[1:])
    if not place.shape:
        return scalar_source(place.key, src.dtype, lambda: src.rows(r0, r0 + 1))
    per = place.num_rows // place.shape[0]
    return StreamTensor(place.key, tuple(place.shape), src.dtype, lambda s, e: src.rows(r0 + s * per, r0 + e * per).reshape(e - s, *tail))


def adapter_tensor_stream(model: nn.Module) -> list[StreamTensor]:
    """The adapters under PEFT's key names, in their training dtype (fp32)."""
    stream = []
    for name, module in lora_modules(model).items():
        stream.append(tensor_source(lora_key(name, "lora_A"), module.lora_a.weight))
        stream.append(tensor_source(lora_key(name, "lora_B"), module.lora_b.weight))
    return stream
