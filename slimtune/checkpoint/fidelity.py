"""What the merge costs: the merged model evaluated without writing or loading it. Inside
``merged_forward`` every LoRA linear computes with its merged weight round(W' + s * B @ A), made per layer
on the fly by the very rows the merged save streams (``merged_lora_source``, the same row chunks, fp32
math and one rounding to the merged dtype), then a plain ``F.linear`` in that dtype, as transformers runs
the merged checkpoint. Memory: one layer's merged weight at a time, never the merged model.

Example::

    with merged_forward(model, torch.bfloat16):
        merged_loss = evaluate(model, ...)      # the eval loss of the merged save, before it is written
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from slimtune.checkpoint.stream import merged_lora_source
from slimtune.diskio import DEFAULT_CHUNK_BYTES
from slimtune.lora import LoRALinear, qlora_linears
from slimtune.tensors import row_chunks


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The save's to_host without the move: the same single rounding, on the weight's device."""
    return x.to(dtype)


def merged_weight(name: str, module: LoRALinear, dtype: torch.dtype, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """The merged weight of one LoRA linear as the merged save writes it (bit for bit: same stream, same
    chunks), on the module's device. Example: ``w = merged_weight("model.layers.0.self_attn.q_proj", m, torch.bfloat16)``"""
    source = merged_lora_source(name, module, dtype, _cast)
    return torch.cat(list(row_chunks(source, chunk_bytes)))


@contextmanager
def merged_forward(model: nn.Module, dtype: torch.dtype | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[nn.Module]:
    """Within the block the model's LoRA linears run on their merged weights in ``dtype`` (default: each
    base weight's own dtype, as the merged save without a dtype); the adapters are untouched. Single
    process (the FSDP2-sharded case is not wired)."""
    modules = qlora_linears(model)
    try:
        for name, m in modules.items():
            m.merged_weight = partial(merged_weight, name, m, dtype or m.weight.dtype, chunk_bytes)
        yield model
    finally:
        for m in modules.values():
            m.merged_weight = None
