"""The safetensors format, streamed. The reference library writes from a whole state dict and reads by
mapping whole files; slimtune builds the header from known shapes (``build_header``; the one writer,
``slimtune.checkpoint.writer``, then puts the bytes at their offsets) and reads any row range of a tensor
into a buffer of its own. Format: 8-byte little-endian header length N,
N bytes of JSON, then the data buffer with each tensor's [begin, end) offsets relative to it."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slimtune.diskio import can_advise, drop_cached, read_ahead
from slimtune.errors import SlimtuneError
from slimtune.formats.strict_json import Pairs, json_kind, loads_json, safe_name, safe_repr
from slimtune.tensors import tensor_bytes

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
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
}
NAME_TO_DTYPE = {v: k for k, v in DTYPE_TO_NAME.items()}
# Every dtype the reference knows, with its width in bits. F4/F6 have no torch dtype of the same layout:
# slimtune reads and checks such files but cannot pass those tensors through a merge.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a merge may cast
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
_U64 = 2**64 - 1
_TORCH_MAX_DIM = 2**63 - 1  # torch sizes are int64


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's place in a safetensors file: known before any byte is written. ``dtype`` is None for
    the reference's dtypes torch cannot hold (F4, F6_*); ``dtype_name`` is the header's spelling."""

    name: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0
    dtype_name: str = ""

    @property
    def type_name(self) -> str:
        return self.dtype_name or DTYPE_TO_NAME[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BITS[self.type_name] // 8


def build_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """Header bytes (length prefix included, JSON padded with spaces to a multiple of 8) and the entries
    with their offsets, in the given order, which is the order the bytes must then be written in.
    Refuses anything the reference reader (or slimtune's) would refuse to read back."""
    entries: list[TensorEntry] = []
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {_utf8(str(k), "metadata key"): _utf8(str(v), "metadata value") for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in tensors:
        if not isinstance(name, str) or name == "__metadata__":
            raise SlimtuneError(f"tensor name {safe_repr(name)} cannot be stored in safetensors")
        _utf8(name, "tensor name")
        if name in header:
            raise SlimtuneError(f"tensor {safe_name(name)} appears twice in one safetensors file")
        if dtype not in DTYPE_TO_NAME:
            raise SlimtuneError(f"tensor {safe_name(name)}: dtype {dtype} cannot be stored in safetensors")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 or d > _U64 for d in dims):
            raise SlimtuneError(f"tensor {safe_name(name)}: shape {list(dims)} has a dimension outside [0, 2**64)")
        entry = TensorEntry(name, dtype, dims, offset, 0)
        entry = TensorEntry(name, dtype, dims, offset, offset + entry.nbytes)
        if entry.end > _U64:
            raise SlimtuneError(f"tensor {safe_name(name)}: data ends at byte {entry.end}, beyond what safetensors can address")
        offset = entry.end
        entries.append(entry)
        header[name] = {"dtype": DTYPE_TO_NAME[dtype], "shape": list(entry.shape), "data_offsets": [entry.begin, entry.end]}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise SlimtuneError(f"safetensors header of {len(raw):,} bytes is over the format's {MAX_HEADER_BYTES:,}-byte limit")
    return struct.pack("<Q", len(raw)) + raw, entries


def _utf8(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SlimtuneError(f"{what} {safe_repr(text)} is not valid Unicode (lone surrogate); safetensors cannot store it") from None
    return text


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and check a header by the reference implementation's rules (safetensors' ``read_metadata``):
    at most 100,000,000 header bytes of UTF-8 JSON as serde_json reads it; known dtypes only (all of
    them, including those slimtune cannot compute on); shapes and offsets unsigned 64-bit integers, never
    coerced; offsets contiguous from 0 in offset order, each tensor's size matching its shape without
    overflow, and the file exactly as long as the header says. Nothing is allocated beyond the header."""
    path = Path(path)
    try:
        if path.is_dir():
            raise SlimtuneError(f"{path}: is a directory, not a safetensors file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SlimtuneError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise SlimtuneError(f"{path}: header length {n:,} is over the format's limit of {MAX_HEADER_BYTES:,} bytes")
            if 8 + n > size:
                raise SlimtuneError(f"{path}: header length {n:,} does not fit in a file of {size:,} bytes (truncated or not safetensors)")
            raw = f.read(n)
    except OSError as e:
        raise SlimtuneError(f"{path}: cannot read: {e.strerror or e}") from None
    tensors, metadata = parse_header(raw, str(path))
    position = 0
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position or entry.end < entry.begin:
            raise SlimtuneError(
                f"{path}: tensor {safe_name(entry.name)}: data_offsets [{entry.begin}, {entry.end}], expected to start at {position} "
                "(tensors must be contiguous, without gaps or overlaps)"
            )
        position = entry.end
        numel = 1
        for d in entry.shape:  # the reference multiplies left to right and refuses any overflow
            numel *= d
            if numel > _U64:
                raise SlimtuneError(f"{path}: tensor {safe_name(entry.name)}: shape {list(entry.shape)} overflows 64 bits")
        bits = numel * DTYPE_BITS[entry.dtype_name]
        if bits > _U64:
            raise SlimtuneError(f"{path}: tensor {safe_name(entry.name)}: shape {list(entry.shape)} overflows 64 bits")
        if bits % 8:
            raise SlimtuneError(f"{path}: tensor {safe_name(entry.name)}: {numel} {entry.dtype_name} elements do not fill whole bytes")
        if entry.end - entry.begin != bits // 8:
            raise SlimtuneError(
                f"{path}: tensor {safe_name(entry.name)}: offsets [{entry.begin}, {entry.end}) hold {entry.end - entry.begin} bytes, "
                f"shape {list(entry.shape)} {entry.dtype_name} needs {bits // 8}"
            )
    if 8 + n + position != size:
        raise SlimtuneError(f"{path}: file is {size:,} bytes, header declares {8 + n + position:,} (truncated or trailing bytes)")
    return SafetensorsHeader(path, 8 + n, tensors, metadata)


_INFO_FIELDS = ("dtype", "shape", "data_offsets")


def parse_header(raw: bytes, where: str) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The header JSON's tensors (header order; a repeated name keeps its last entry, as the reference
    does) and ``__metadata__``, every field type-checked as serde reads it."""
    pairs = loads_json(raw, f"{where}: header", duplicates="keep", expect=dict)
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] | None = None
    seen_metadata = False
    for name, info in pairs:
        if name == "__metadata__":
            if seen_metadata:
                raise SlimtuneError(f"{where}: header has __metadata__ twice")
            seen_metadata = True
            if info is None:
                continue
            if not isinstance(info, Pairs) or not all(isinstance(v, str) for _, v in info):
                raise SlimtuneError(f"{where}: __metadata__ must be an object of string values, found {_describe(info)}")
            metadata = dict(info)
            continue
        tensors.pop(name, None)  # the last entry of a repeated name wins, at its own position
        tensors[name] = _tensor_info(name, info, where)
    return tensors, metadata or {}


def _describe(value: object) -> str:
    if isinstance(value, Pairs):
        return "an object with other values" if value else "an object"
    return json_kind(value)


def _tensor_info(name: str, info: object, where: str) -> TensorEntry:
    label = f"{where}: tensor {safe_name(name)}"
    if isinstance(info, Pairs):
        fields: dict[str, object] = {}
        for key, value in info:
            if key in _INFO_FIELDS:
                if key in fields:
                    raise SlimtuneError(f"{label}: field {key!r} appears twice")
                fields[key] = value
        for key in _INFO_FIELDS:
            if key not in fields:
                raise SlimtuneError(f"{label}: missing field {key!r}")
        dtype, shape, offsets = (fields[k] for k in _INFO_FIELDS)
    elif isinstance(info, list):  # serde also reads a struct from a sequence of its fields
        if len(info) != 3:
            raise SlimtuneError(f"{label}: entry must be an object with dtype, shape and data_offsets")
        dtype, shape, offsets = info
    else:
        raise SlimtuneError(f"{label}: entry is {json_kind(info)}, expected an object with dtype, shape and data_offsets")
    if isinstance(dtype, Pairs) and len(dtype) == 1 and dtype[0][1] is None:
        dtype = dtype[0][0]  # serde's externally tagged form of a unit variant: {"F32": null}
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        found = safe_repr(dtype) if isinstance(dtype, str) else json_kind(dtype)
        raise SlimtuneError(f"{label}: unknown dtype {found} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or isinstance(shape, Pairs) or not all(_is_u64(d) for d in shape):
        raise SlimtuneError(f"{label}: shape must be a list of integers in [0, 2**64), found {_short(shape)}")
    if not isinstance(offsets, list) or isinstance(offsets, Pairs) or len(offsets) != 2 or not all(_is_u64(x) for x in offsets):
        raise SlimtuneError(f"{label}: data_offsets must be two integers in [0, 2**64), found {_short(offsets)}")
    return TensorEntry(name, NAME_TO_DTYPE.get(dtype), tuple(shape), offsets[0], offsets[1], dtype)


def _is_u64(x: object) -> bool:
    return type(x) is int and 0 <= x <= _U64


def _short(value: object) -> str:
    if isinstance(value, Pairs):
        return "an object"
    text = safe_repr(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


READ_AHEAD = 256 * 1024 * 1024  # bytes a one-pass stream (drop_behind) has the kernel read ahead of it


class SafetensorsReader:
    """Reads tensors or row ranges of them with plain file reads into buffers the caller owns, so RSS
    never holds more than what was asked for (no mapping of whole files). ``observe(offset, data)`` is
    given the bytes of every read, at their file offset (a sha256 check hashing what is read:
    ``formats.manifest.ReadCheck.tap``). With ``drop_behind`` (a stream that reads each byte once), the
    pages of every read are let go from the page cache once copied out (posix_fadvise DONTNEED): a cold
    stream through a file larger than free memory otherwise has the kernel reclaim pages in the
    reader's own time, ~1 s of system CPU per GB here against ~0.2 s with the drop. Such a stream also
    has the kernel read ``READ_AHEAD`` bytes ahead of it (``_read_ahead``)."""

    def __init__(self, path: str | Path, observe: Callable[[int, torch.Tensor], None] | None = None, drop_behind: bool = False):
        self.header = read_header(path)
        self.path = self.header.path
        self._observe = observe
        self._file = open(self.path, "rb")
        self._drop_behind = drop_behind and can_advise()  # Linux; elsewhere reads as usual
        self._ahead = 0  # with drop_behind: the kernel was asked to read the file up to here

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.header.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise SlimtuneError(f"{self.path}: no tensor named {safe_repr(name)}") from None

    def torch_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, refused when torch cannot hold it: the format allows dimensions up
        to 2**64 - 1 (an empty [2**63, 0] is valid safetensors), torch's sizes are signed 64-bit."""
        entry = self.entry(name)
        if any(d > _TORCH_MAX_DIM for d in entry.shape):
            raise SlimtuneError(
                f"{self.path}: tensor {safe_name(name)} has shape {list(entry.shape)}: a dimension over 2**63 - 1, "
                "which safetensors allows and torch cannot hold"
            )
        return entry.shape

    def read(self, name: str, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, end) of tensor ``name`` (the whole tensor by default), read into ``out`` if given."""
        entry = self.entry(name)
        self.torch_shape(name)
        if entry.dtype is None:
            raise SlimtuneError(f"{self.path}: tensor {safe_name(name)} has dtype {entry.dtype_name}, which torch cannot hold")
        rows = entry.shape[0] if entry.shape else 1
        end = rows if end is None else end
        if not 0 <= start <= end <= rows:
            raise ValueError(f"rows {start}:{end} are outside tensor {name} of {rows} rows")
        row_shape = entry.shape[1:]
        row_bytes = entry.nbytes // rows if rows else 0
        shape = (end - start, *row_shape) if entry.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype)
        elif out.dtype != entry.dtype or tuple(out.shape) != tuple(shape) or not out.is_contiguous():
            raise ValueError(f"buffer {out.dtype} {list(out.shape)} does not fit {name} rows {start}:{end}")
        nbytes = (end - start) * row_bytes if entry.shape else entry.nbytes
        if nbytes:
            offset = self.header.data_start + entry.begin + start * row_bytes
            self._file.seek(offset)
            data = tensor_bytes(out)
            got = self._file.readinto(data)
            if got != nbytes:
                raise SlimtuneError(f"{self.path}: tensor {name}: read {got} of {nbytes} bytes (file changed or truncated)")
            if self._observe is not None:  # the tensor itself: holding it keeps a pooled buffer from reuse
                self._observe(offset, out)
            if self._drop_behind:  # whole pages inside the range only: a neighbour's partial page stays
                drop_cached(self._file.fileno(), offset, nbytes)
                self._read_ahead(offset + nbytes)
        return out

    def _read_ahead(self, end: int) -> None:
        """Have the kernel start reading the next ``READ_AHEAD`` bytes after ``end`` (POSIX_FADV_WILLNEED
        submits the reads and returns), topped up each time half of it was consumed: a stream's next chunk
        comes from the disk while this one is merged and written, not when it is asked for."""
        if end + READ_AHEAD // 2 <= self._ahead:
            return
        start = max(end, self._ahead)
        self._ahead = end + READ_AHEAD
        read_ahead(self._file.fileno(), start, self._ahead - start)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
