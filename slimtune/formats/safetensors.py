"""The safetensors format, streamed. The reference library writes from a whole state dict and reads by
mapping whole files; slimtune writes the header from known shapes and then the bytes in offset order, and
reads any row range of a tensor into a buffer of its own. Format: 8-byte little-endian header length N,
N bytes of JSON, then the data buffer with each tensor's [begin, end) offsets relative to it."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from slimtune.errors import SlimtuneError

DTYPE_TO_NAME = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_TO_NAME.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's place in a safetensors file: known before any byte is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


def build_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """Header bytes (length prefix included, JSON padded with spaces to a multiple of 8) and the entries
    with their offsets, in the given order, which is the order the bytes must then be written in."""
    entries: list[TensorEntry] = []
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in tensors:
        if name in header:
            raise SlimtuneError(f"tensor {name!r} appears twice in one safetensors file")
        if dtype not in DTYPE_TO_NAME:
            raise SlimtuneError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        entry = TensorEntry(name, dtype, tuple(int(d) for d in shape), offset, 0)
        entry = TensorEntry(name, dtype, entry.shape, offset, offset + entry.nbytes)
        offset = entry.end
        entries.append(entry)
        header[name] = {"dtype": DTYPE_TO_NAME[dtype], "shape": list(entry.shape), "data_offsets": [entry.begin, entry.end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, entries


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are all declared up front; ``write`` takes the next bytes
    (whole tensors or row chunks) in declaration order. Hashes as it writes, so the manifest needs no
    second read. Use as a context manager; ``close`` checks every declared byte arrived and fsyncs."""

    def __init__(self, path: str | Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, self.entries = build_header(tensors, metadata)
        self.size = len(header) + (self.entries[-1].end if self.entries else 0)
        self._sha = hashlib.sha256()
        self._file: BinaryIO = open(self.path, "wb")
        self._index = 0
        self._written_in_tensor = 0
        self._emit(header)

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._sha.update(data)

    def write(self, chunk: torch.Tensor) -> None:
        """Append the next contiguous piece of the current tensor (it must be on the CPU)."""
        if self._index >= len(self.entries):
            raise SlimtuneError(f"{self.path}: more data than the header declares")
        entry = self.entries[self._index]
        if chunk.dtype != entry.dtype:
            raise SlimtuneError(f"{self.path}: tensor {entry.name}: got {chunk.dtype}, header says {entry.dtype}")
        nbytes = chunk.numel() * chunk.element_size()
        if self._written_in_tensor + nbytes > entry.nbytes:
            raise SlimtuneError(f"{self.path}: tensor {entry.name}: more bytes than its shape {list(entry.shape)}")
        if nbytes:
            self._emit(tensor_bytes(chunk))
        self._written_in_tensor += nbytes
        if self._written_in_tensor == entry.nbytes:
            self._index += 1
            self._written_in_tensor = 0
            while self._index < len(self.entries) and self.entries[self._index].nbytes == 0:
                self._index += 1

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._file.closed:
            return
        missing = [e.name for e in self.entries[self._index :] if e.nbytes]
        if missing:
            self._file.close()
            raise SlimtuneError(f"{self.path}: closed before tensor(s) {missing[:3]} were written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without a copy."""
    t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and check a header against the format rules: contiguous offsets from 0 with no gaps or
    overlaps, sizes matching shapes, and a file exactly as long as the header says."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SlimtuneError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SlimtuneError(f"{path}: header length {n} does not fit in a file of {size} bytes (truncated or not safetensors)")
            raw = f.read(n)
    except OSError as e:
        raise SlimtuneError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SlimtuneError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SlimtuneError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries = []
    for name, info in header.items():
        try:
            dtype = NAME_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SlimtuneError(f"{path}: tensor {name}: malformed entry {info!r} (unknown dtype or missing shape/data_offsets)") from None
        entry = TensorEntry(name, dtype, shape, begin, end)
        if end - begin != entry.nbytes:
            raise SlimtuneError(
                f"{path}: tensor {name}: offsets [{begin}, {end}) hold {end - begin} bytes, "
                f"shape {list(shape)} {info['dtype']} needs {entry.nbytes}"
            )
        entries.append(entry)
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise SlimtuneError(f"{path}: tensor {entry.name}: data starts at {entry.begin}, expected {position} (gap or overlap)")
        position = entry.end
    if 8 + n + position != size:
        raise SlimtuneError(f"{path}: file is {size} bytes, header declares {8 + n + position} (truncated or trailing bytes)")
    return SafetensorsHeader(path, 8 + n, {e.name: e for e in entries}, dict(metadata))


class SafetensorsReader:
    """Reads tensors or row ranges of them with plain file reads into buffers the caller owns, so RSS
    never holds more than what was asked for (no mapping of whole files)."""

    def __init__(self, path: str | Path):
        self.header = read_header(path)
        self.path = self.header.path
        self._file = open(self.path, "rb")

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.header.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise SlimtuneError(f"{self.path}: no tensor named {name!r}") from None

    def read(self, name: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, end) of tensor ``name`` (the whole tensor by default), read into ``out`` if given."""
        entry = self.entry(name)
        rows = entry.shape[0] if entry.shape else 1
        end = rows if end is None else end
        row_shape = entry.shape[1:]
        row_bytes = entry.nbytes // rows if rows else 0
        shape = (end - start, *row_shape) if entry.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype)
        elif out.dtype != entry.dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous():
            raise ValueError(f"buffer {out.dtype} {list(out.shape)} does not fit {name} rows {start}:{end}")
        nbytes = (end - start) * row_bytes if entry.shape else entry.nbytes
        if nbytes:
            self._file.seek(self.header.data_start + entry.begin + start * row_bytes)
            got = self._file.readinto(tensor_bytes(out))
            if got != nbytes:
                raise SlimtuneError(f"{self.path}: tensor {name}: read {got} of {nbytes} bytes (file changed or truncated)")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
