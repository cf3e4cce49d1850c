"""A checkpoint as an ordered stream of named tensors, each produced on demand, rows at a time.

Every writer in slimtune consumes this one type: the in-training save, the offline merge, verification.
A StreamTensor knows its name, shape and dtype up front (so headers can be written first) and makes any
row range of itself when asked, so memory holds one chunk, never the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from slimtune.checkpoint.staging import to_host as plain_to_host
from slimtune.formats.peft import PEFT_PREFIX
from slimtune.formats.safetensors import dtype_size
from slimtune.lora import LoRALinear, lora_modules, merge_lora_rows, qlora_linears
from slimtune.quant import is_nf4


@dataclass(frozen=True)
class StreamTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]
    """rows(start, end) -> contiguous CPU tensor of shape (end - start, *shape[1:]) in ``dtype``."""

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        n = dtype_size(self.dtype)
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes if self.shape else dtype_size(self.dtype)


def row_chunks(t: StreamTensor, chunk_bytes: int, start: int = 0, end: int | None = None) -> Iterator[torch.Tensor]:
    """Rows [start, end) of the tensor (all by default) in consecutive chunks of at most ``chunk_bytes``
    (at least one row)."""
    end = t.num_rows if end is None else end
    if not t.shape:
        if end > start:
            yield t.rows(0, 1)
        return
    if t.row_bytes == 0:  # an empty tensor ([2**62, 0] is valid): one chunk, never 2**62 of them
        yield t.rows(0, t.num_rows)
        return
    step = max(1, chunk_bytes // max(1, t.row_bytes))
    for s in range(start, end, step):
        yield t.rows(s, min(s + step, end))


ToHost = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def base_rows(weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows of a frozen base weight in its own dtype: NF4 dequantized exactly as torchao does."""
    if is_nf4(weight):
        from slimtune.quant.nf4 import dequantize_nf4_rows

        return dequantize_nf4_rows(weight, start, end)
    return weight.detach()[start:end]


def tensor_source(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None, to_host: ToHost = plain_to_host) -> StreamTensor:
    """A plain tensor (embedding, norm, bias) as a stream entry, cast per chunk if dtype differs."""
    out_dtype = dtype or tensor.dtype
    data = tensor.detach()
    if data.dim() == 0:
        return StreamTensor(name, (), out_dtype, lambda s, e: plain_to_host(data.reshape(1), out_dtype).reshape(()))
    return StreamTensor(name, tuple(data.shape), out_dtype, lambda s, e: to_host(data[s:e], out_dtype))


def merged_lora_source(name: str, module: LoRALinear, dtype: torch.dtype, to_host: ToHost = plain_to_host) -> StreamTensor:
    """W + scale * B @ A (and DoRA's rescale) for a LoRA linear: fp32 math on the weight's device, one
    rounding to ``dtype``, then to the host."""
    if module.lora_a is None:
        return StreamTensor(
            name, (module.out_features, module.in_features), dtype, lambda s, e: to_host(base_rows(module.weight, s, e), dtype)
        )
    a = module.lora_a.weight.detach()
    b = module.lora_b.weight.detach()
    magnitude = None if module.magnitude is None else module.magnitude.detach()

    def rows(start: int, end: int) -> torch.Tensor:
        m = None if magnitude is None else magnitude[start:end]
        merged = merge_lora_rows(base_rows(module.weight, start, end), a, b[start:end], module.scaling, m)
        return to_host(merged, dtype)

    return StreamTensor(name, (module.out_features, module.in_features), dtype, rows)


def merged_tensor_stream(model: nn.Module, dtype: torch.dtype | None = None, to_host: ToHost = plain_to_host) -> list[StreamTensor]:
    """The merged model, in Hugging Face names and parameter order; tied weights appear once.
    Chunks are computed where the model lives (CPU or GPU) and handed to the writer by ``to_host``."""
    loras = qlora_linears(model)
    stream: list[StreamTensor] = []
    adapter_prefixes = tuple(f"{name}.{part}" for name in loras for part in ("lora_a.", "lora_b.", "magnitude"))
    for name, param in model.named_parameters():
        if name.startswith(adapter_prefixes):
            continue  # folded into the merged weight
        module_name, _, attr = name.rpartition(".")
        module = loras.get(module_name)
        if module is not None and attr == "weight":
            stream.append(merged_lora_source(name, module, dtype or module.weight.dtype, to_host))
        else:
            stream.append(tensor_source(name, param, dtype, to_host))
    for name, buf in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(module_name)
        if attr not in owner._non_persistent_buffers_set:
            stream.append(tensor_source(name, buf, dtype, to_host))
    return stream


def adapter_tensor_stream(model: nn.Module) -> list[StreamTensor]:
    """The adapters under PEFT's key names, in their training dtype (fp32)."""
    stream = []
    for name, module in lora_modules(model).items():
        stream.append(tensor_source(f"{PEFT_PREFIX}{name}.lora_A.weight", module.lora_a.weight))
        stream.append(tensor_source(f"{PEFT_PREFIX}{name}.lora_B.weight", module.lora_b.weight))
        if module.magnitude is not None:
            stream.append(tensor_source(f"{PEFT_PREFIX}{name}.lora_magnitude_vector", module.magnitude))
    return stream
