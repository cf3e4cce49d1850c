"""A base checkpoint on disk read by row range (``BaseCheckpoint``): the merge, verify and both GGUF
exports read their base (and a merged checkpoint) through it, never a whole file.

Example::

    base = BaseCheckpoint("models/llama")
    rows = base.rows("model.layers.0.mlp.up_proj.weight", 0, 16)
    base.close()
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from slimtune.formats.bnb import BnbNF4Weight, aux_owner, is_aux_key, read_4bit_weights, refuse_8bit
from slimtune.formats.hf import checkpoint_files, module_kinds, read_config_dict
from slimtune.formats.hub import ModelSource, resolve_model
from slimtune.formats.manifest import ReadCheck
from slimtune.formats.safetensors import SafetensorsReader


class RowBuffers(Protocol):
    """Where rows are read into (``checkpoint.staging.BufferPool``): reused buffers instead of fresh tensors."""

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class BaseCheckpoint:
    """A base checkpoint on disk (a directory, or a hub id ``resolve_model`` fetches): tensor names,
    shapes and dtypes from the headers, rows on demand. With ``check`` (a folded ``ReadCheck`` of the
    base), every byte read is hashed as it is read. With ``drop_behind`` (one pass that reads each byte
    once and nothing else reading the files beside it), what was read is let go from the page cache and
    what comes next is read ahead (``SafetensorsReader``)."""

    def __init__(
        self, model_dir: str | Path | ModelSource, pool: RowBuffers | None = None, check: ReadCheck | None = None, drop_behind: bool = False
    ):
        self.source = resolve_model(model_dir)
        self.dir = self.source.path
        self.pool = pool
        self.config = read_config_dict(self.dir)
        refuse_8bit(self.config, str(self.dir / "config.json"))
        self._kinds: tuple[dict[str, str], str | None] | None = None
        taps = [(h.path, check and check.tap(h.path)) for h in checkpoint_files(self.dir)]
        self.readers = [SafetensorsReader(path, tap and tap.seen, drop_behind) for path, tap in taps]
        self.location = {key: r for r in self.readers for key in r.tensors}
        for key, reader in self.location.items():  # every tensor passes through torch: refuse before writing
            reader.torch_shape(key)
        self.bnb: dict[str, BnbNF4Weight] = read_4bit_weights(self.location, str(self.dir))
        self.keys = [k for k in self.location if not (is_aux_key(k) and aux_owner(k) in self.bnb)]

    @property
    def module_kinds(self) -> tuple[dict[str, str], str | None]:
        """Each module's kind (linear, conv1d, embedding, ...) and the output embedding's name."""
        if self._kinds is None:
            self._kinds = module_kinds(self.config, {k: self.shape(k) for k in self.keys})
        return self._kinds

    def shape(self, key: str) -> tuple[int, ...]:
        return self.bnb[key].shape if key in self.bnb else self.location[key].entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self.bnb[key].dtype if key in self.bnb else self.location[key].entry(key).dtype

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        if key in self.bnb:
            return self.bnb[key].rows(start, end)
        reader = self.location[key]
        entry = reader.entry(key)
        if self.pool is None or not entry.shape:
            return reader.read(key, start, end)
        return reader.read(key, start, end, out=self.pool.take((end - start, *entry.shape[1:]), entry.dtype))

    def close(self) -> None:
        for r in self.readers:
            r.close()
