"""The element of every checkpoint stream: a ``StreamTensor`` (name, shape, dtype up front, any row range
on demand), read in row chunks; and the dtype names the CLI and configs use.

A writer knows every shape before the first byte (headers first), and memory holds one chunk, never the
model. The streams themselves (a live model's merged weights, a base + adapter on disk) are made above
this layer (``checkpoint/stream.py``, ``merge.py``); formats only map entries to entries.

Example::

    t = StreamTensor("w", (4, 3), torch.float32, lambda s, e: torch.ones(e - s, 3))
    [c.shape for c in row_chunks(t, chunk_bytes=24)]  # [torch.Size([2, 3]), torch.Size([2, 3])]"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # as the CLI and configs spell them

ToHost = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
"""(chunk on its device, dtype) -> contiguous CPU chunk in that dtype: how a stream hands rows to a writer."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without a copy."""
    t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t``. One vectorized sum decides almost always (a NaN or an infinity makes
    the sum non-finite; a finite sum means there is none); only a non-finite sum (a bad value, or finite
    values whose float32 sum overflows) pays for the element-wise check, several times slower.
    Example: ``all_finite(torch.tensor([1.0, float("inf")])) is False``"""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


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


def scalar_source(name: str, dtype: torch.dtype, read: Callable[[], torch.Tensor]) -> StreamTensor:
    """A 0-d tensor as a stream entry: its one value read whole (a row range means nothing for it), as
    a CPU tensor of shape () in ``dtype``. Every stream that meets one (a live model's, a merge from
    files, a GGUF source) makes it here. Example: ``scalar_source("s", torch.float32, lambda: torch.tensor(2))``"""
    return StreamTensor(name, (), dtype, lambda s, e: read().to(device="cpu", dtype=dtype).reshape(()).contiguous())


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
