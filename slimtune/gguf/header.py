"""The head of a GGUF file: its header, metadata and tensor infos, serialized by the ``gguf`` package's
``GGUFWriter`` into a file of their own (``write_head``); the export appends the data section after them
through its own file descriptor (``slimtune.gguf.export``).

Everything here is the package's public writer but one fast path, kept in this module alone: arrays of
strings and of numbers (the vocabulary's ~10^5 tokens, token types and merges) packed in one go, not
item by item, through the writer's private ``_pack_val`` and ``_simple_value_packing``. It runs only
where the installed ``gguf`` is of a release series it was checked against (``fast_packing``, from the
package's metadata) and still has those names; any other ``gguf`` gets the public writer as it is: the
same bytes, packed item by item.

Example::

    size = write_head(Path("m.gguf"), "llama", [("general.name", "tiny", None)], [("t", (2, 32), 68, Q.Q8_0)])
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np

_FAST_SERIES = ((0, 17), (0, 18), (0, 19))
"""The ``gguf`` release series (major, minor) whose private packing ``_PackedWriter`` was checked against
(tests/test_gguf_header.py compares its bytes with the public writer's on the installed one): a new
series joins once that test passes with it."""

TensorInfo = tuple[str, tuple[int, ...], int, gguf.GGMLQuantizationType]
"""One tensor's info: GGUF name, shape (as the file lists it), bytes in the data section, GGML type."""


def fast_packing(version: str | None = None) -> bool:
    """Whether ``write_head`` packs arrays in one go: the installed ``gguf`` (or ``version``) is of a
    series in ``_FAST_SERIES`` and its writer has the private names the fast path reads.
    Example: ``fast_packing("0.19.0")`` is True, ``fast_packing("0.99.0")`` False."""
    if version is None:
        try:
            version = importlib.metadata.version("gguf")
        except importlib.metadata.PackageNotFoundError:  # a source tree on the path: no version to check
            return False
    series = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    packing = getattr(gguf.GGUFWriter, "_simple_value_packing", None)
    return series in _FAST_SERIES and callable(getattr(gguf.GGUFWriter, "_pack_val", None)) and isinstance(packing, dict)


def write_head(path: Path, arch: str, kv: list[tuple], tensors: Iterable[TensorInfo]) -> int:
    """Write the header, the metadata ``kv`` (key, value, value type or None: the package's inference; a
    list with an element type is an array of it) and the infos of ``tensors`` (data offsets aligned to
    ``gguf.GGUF_DEFAULT_ALIGNMENT``, in order) into ``path``, created or truncated. Returns the bytes
    written: the data section starts at the next aligned offset."""
    writer = (_PackedWriter if fast_packing() else gguf.GGUFWriter)(None, arch)
    for key, value, vtype in kv:
        _add_kv(writer, key, value, vtype)
    for name, shape, nbytes, qtype in tensors:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    try:
        writer.write_header_to_file(path=Path(path))
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()
    return os.path.getsize(path)


def _add_kv(writer: gguf.GGUFWriter, key: str, value, vtype) -> None:
    """One metadata pair; a list with an element type is an array of that type."""
    if vtype is None:
        vtype = gguf.GGUFValueType.get_type(value)
    if isinstance(value, (list, tuple)) and vtype != gguf.GGUFValueType.ARRAY:
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=vtype)
    else:
        writer.add_key_value(key, value, vtype)


class _PackedWriter(gguf.GGUFWriter):
    """``gguf.GGUFWriter`` whose arrays of strings and of numbers are packed in one go, not item by item:
    the same bytes; anything else (another byte order, bool or nested arrays, mixed items) is the
    package's. Only where ``fast_packing()`` says so."""

    def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
        V = gguf.GGUFValueType
        if vtype != V.ARRAY or self.endianess != gguf.GGUFEndian.LITTLE or not isinstance(val, (list, tuple)) or not val:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        ltype = sub_type
        if ltype is None:  # the package's inference, for items all of one plain type (``type(True)`` is not int)
            first = type(val[0])
            if first not in (str, int, float) or not all(type(v) is first for v in val):
                return super()._pack_val(val, vtype, add_vtype, sub_type)
            ltype = V.get_type(val[0])
        fmt = self._simple_value_packing.get(ltype)
        if ltype == V.STRING and all(type(v) is str for v in val):
            encoded = [v.encode("utf-8") for v in val]
            body = b"".join(struct.pack("<Q", len(e)) + e for e in encoded)
        elif fmt is not None and ltype != V.BOOL:
            body = struct.pack(f"<{len(val)}{fmt}", *val)
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        return (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", ltype, len(val)) + body
