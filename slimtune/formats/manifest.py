"""slimtune_manifest.json, the file that makes a directory a complete checkpoint: every file's relative
path, size and sha256. One reader (checked field by field) and one checker for everyone: ``verify``,
resume and the run directory's pruning all ask ``manifest_problems``.

Example::

    problems = manifest_problems(Path("run/step-000100"))  # [] when every byte is as recorded
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import torch
from tqdm.auto import tqdm

from slimtune.errors import SlimtuneError
from slimtune.fileio import write_atomic
from slimtune.formats.layout import MANIFEST_NAME
from slimtune.formats.strict_json import json_kind, load_json, safe_name
from slimtune.profiler import in_context, stage
from slimtune.runtime import usable_cores
from slimtune.tensors import tensor_bytes

MANIFEST_FORMAT = "slimtune-checkpoint/1"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_HASH_LANES = 8  # threads hashing files at once, each with an 8 MB buffer: at most 64 MB


@dataclass(frozen=True)
class FileRecord:
    """A file as the manifest lists it."""

    path: str
    size: int
    sha256: str


def write_manifest(directory: Path, records: list[FileRecord], extra: dict | None = None) -> None:
    """Written last: its presence is what makes a directory a checkpoint (fsynced, renamed into place)."""
    data = {"format": MANIFEST_FORMAT, **(extra or {}), "files": [asdict(r) for r in records]}
    write_atomic(Path(directory) / MANIFEST_NAME, json.dumps(data, indent=2), sync=True)


def sha256_file(path: str | Path, block: int = 8 * 1024 * 1024) -> str:
    """The sha256 of a file, read in blocks (the one hashing helper; writers hash as they write)."""
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hash_lanes(files: int) -> int:
    """How many files are hashed at once: one thread per file, at most one per usable core (and 8):
    hashlib releases the GIL on large buffers, so the threads run on as many cores.
    Example: ``hash_lanes(4)`` -> 2 where the process may use 2 cores"""
    return max(1, min(files, usable_cores(), _MAX_HASH_LANES))


def in_lanes(fn: Callable, items: list) -> Iterator:
    """``fn`` of every item, yielded in the items' order, computed ``hash_lanes(len(items))`` at a time
    on threads (each in a copy of the caller's context, so hashing counts toward its profile); the
    first exception is raised in its turn, once every thread has stopped.
    Example: ``list(in_lanes(sha256_file, paths))``"""
    if len(items) <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(hash_lanes(len(items)), thread_name_prefix="slimtune-sha256") as pool:
        futures = [pool.submit(in_context(fn), item) for item in items]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def sha256_bytes(data: bytes | str) -> str:
    """The sha256 of bytes (a str as UTF-8): what the file holding them will hash to."""
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a checkpoint directory, checked: the expected format, and ``files`` a list of
    {path (relative, inside the directory), size (integer >= 0), sha256 (64 hex digits)}, no path twice."""
    path = Path(directory) / MANIFEST_NAME
    if not path.exists():
        raise SlimtuneError(f"{directory}: no {MANIFEST_NAME}; not a complete slimtune checkpoint")
    data = load_json(path, expect=dict, what="manifest")
    if data.get("format") != MANIFEST_FORMAT:
        raise SlimtuneError(f"{path}: format {safe_name(repr(data.get('format')))[:80]}, expected {MANIFEST_FORMAT!r}")
    files = data.get("files")
    if not isinstance(files, list):
        raise SlimtuneError(f"{path}: files must be a list, found {json_kind(files)}")
    seen = set()
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise SlimtuneError(f"{path}: files[{i}] must be an object, found {json_kind(entry)}")
        rel, size, digest = entry.get("path"), entry.get("size"), entry.get("sha256")
        if not isinstance(rel, str) or not _is_inside(rel):
            raise SlimtuneError(
                f"{path}: files[{i}].path must be a relative path inside the checkpoint, found {safe_name(repr(rel))[:120]}"
            )
        if rel in seen:
            raise SlimtuneError(f"{path}: {safe_name(rel)} is listed twice")
        seen.add(rel)
        if type(size) is not int or size < 0:
            raise SlimtuneError(f"{path}: files[{i}].size must be a non-negative integer, found {json_kind(size)}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise SlimtuneError(f"{path}: files[{i}].sha256 must be 64 lowercase hex digits")
    return data


def _is_inside(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and "\\" not in rel and "\x00" not in rel and not p.is_absolute() and ".." not in p.parts and rel == p.as_posix()


def manifest_problems(directory: str | Path, only: Iterable[str] | None = None, progress: bool = False, extra: bool = True) -> list[str]:
    """Every way the directory differs from its manifest: unreadable manifest, missing files, sizes and
    sha256 (of the files in ``only``, or all), and (``extra``) files on disk the manifest does not list.
    Empty when the checkpoint is exactly as written. Files are hashed ``hash_lanes`` at a time, each
    with a plain sha256 of its bytes; the problems come in the files' order."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except SlimtuneError as e:
        return [str(e)]
    listed = {f["path"]: f for f in manifest["files"]}
    problems = []
    if extra:
        on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}
        problems += [f"{directory / safe_name(rel)}: not listed in the manifest" for rel in sorted(on_disk - set(listed))]
    wanted = sorted(listed) if only is None else list(only)

    def check(rel: str) -> list[str]:
        path = directory / rel
        try:
            return _file_problems(path, listed.get(rel))
        except OSError as e:
            return [f"{path}: cannot read: {e.strerror or e}"]

    for found in tqdm(in_lanes(check, wanted), total=len(wanted), desc="sha256", unit="file", disable=not progress):
        problems += found
    return problems


def _file_problems(path: Path, entry: dict | None) -> list[str]:
    if entry is None:
        return [f"{path}: not listed in the manifest"]
    if not path.is_file():
        return [f"{path}: listed in the manifest but missing"]
    if path.stat().st_size != entry["size"]:
        return [f"{path}: {path.stat().st_size} bytes, the manifest says {entry['size']}"]
    if sha256_file(path) != entry["sha256"]:
        return [f"{path}: sha256 differs from the manifest (changed or corrupted bytes)"]
    return []


class FileTap:
    """The sha256 of one file fed with the bytes its reader reads or its writer writes (``seen``), in file
    order: bytes behind the hashed prefix are skipped (hashed already), a read past it first has the gap
    read from the file and hashed. Reads in file order, as a merge of a checkpoint makes them, are hashed
    from the reader's own buffers and nothing is read twice; any order is still exact, reading each byte
    at most twice. A writer's bytes are hashed from its own chunks (``hexdigest``), with nothing read back.

    The hashing runs on a thread of its own that trails the reader (``_TAP_QUEUE`` reads behind at most;
    it ends when idle and starts again with the next read): the reader goes on to its next read and its
    work on these bytes while they are hashed. Each queued read holds its buffer (a pooled one is not
    reused until it is hashed). ``stage_name``: the profiler stage its hashing is timed under.
    Example: ``tap = FileTap(path, "hash"); tap.seen(0, header); tap.seen(len(header), chunk); tap.hexdigest(size)``"""

    def __init__(self, path: Path, stage_name: str = "verify"):
        self.path, self.stage_name = path, stage_name
        self.sha = hashlib.sha256()
        self.pos = 0  # bytes [0, pos) are hashed
        self.extra = 0  # bytes this tap read itself (gaps and the tail)
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(_TAP_QUEUE)
        self._lock = threading.Lock()  # the worker's start and end
        self._worker: threading.Thread | None = None

    def seen(self, offset: int, data: torch.Tensor | memoryview) -> None:
        """Bytes [offset, offset + its size) of the file, as just read into ``data`` (a tensor, or its bytes),
        hashed on the tap's thread, which holds ``data`` until then: the reader must not write to it again,
        and a pooled buffer goes back to its pool once the tap lets it go (``BufferPool.take``)."""
        self._queue.put((offset, data))
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=in_context(self._run), name="slimtune-sha256-read", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_TAP_IDLE_S)
            except queue.Empty:
                item = None
            if item is None:  # idle, or problems() waits: end unless a read came in meanwhile
                with self._lock:
                    if self._queue.empty():
                        self._worker = None
                        return
                continue
            offset, data = item
            del item
            try:
                if self.error is None:
                    with stage(self.stage_name, device_work=False):
                        self._update(offset, data if isinstance(data, memoryview) else tensor_bytes(data))
            except BaseException as e:  # noqa: BLE001 - reported by problems()
                self.error = e
            del data  # the buffer goes back to its pool now, not with the next read

    def _update(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        if end <= self.pos:
            return
        if offset > self.pos:
            self._fill(offset)
        self.sha.update(data[self.pos - offset :])
        self.pos = end

    def _drain(self) -> None:
        """Wait until every read handed to ``seen`` is hashed."""
        with self._lock:
            worker = self._worker
        if worker is not None:  # no read is queued without one (seen() starts it)
            self._queue.put(None)
            worker.join()

    def _fill(self, end: int | None) -> None:
        """Hash bytes [pos, end) (to the end of the file: None) read from the file itself."""
        buf = bytearray(8 * 1024 * 1024)
        view = memoryview(buf)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.pos)
            while end is None or self.pos < end:
                n = f.readinto(view if end is None else view[: min(len(buf), end - self.pos)])
                if not n:
                    break
                self.sha.update(view[:n])
                self.pos += n
                self.extra += n

    def hexdigest(self, size: int) -> str:
        """The sha256 of the file's first ``size`` bytes, once every byte handed to ``seen`` is hashed
        (bytes never handed to it read from the file); an error of the hashing thread is raised here."""
        self._drain()
        if self.error is not None:
            raise self.error
        self._fill(size)
        if self.pos != size:
            raise SlimtuneError(f"{self.path}: {self.pos} bytes hashed, expected {size}")
        return self.sha.hexdigest()

    def problems(self, entry: dict) -> list[str]:
        self._drain()
        if self.error is not None:
            if isinstance(self.error, OSError):
                raise self.error
            return [f"{self.path}: cannot hash what was read: {self.error}"]
        if not self.path.is_file():
            return [f"{self.path}: listed in the manifest but missing"]
        self._fill(None)
        if self.pos != entry["size"]:
            return [f"{self.path}: {self.pos} bytes, the manifest says {entry['size']}"]
        if self.sha.hexdigest() != entry["sha256"]:
            return [f"{self.path}: sha256 differs from the manifest (changed or corrupted bytes)"]
        return []


_TAP_QUEUE = 2
"""Reads a tap's thread may trail its reader by, beside the one it hashes (each holds the reader's
buffer until hashed: a pool for such a reader has ``TAP_HOLDS`` buffers more)."""
TAP_HOLDS = _TAP_QUEUE + 1
_TAP_IDLE_S = 0.5
"""A tap's thread ends after this long with nothing to hash (a failed command leaves none behind)."""


class ReadCheck:
    """The sha256 of every file a command reads from a checkpoint with a manifest, against the manifest.
    By default computed in one pass by a background thread while the command works, the files hashed
    ``hash_lanes`` at a time (hashlib releases the GIL: the pass runs beside the work on other cores, and
    reads what the page cache mostly holds already). With ``fold``, no pass: the command hands the files it reads in file order to
    ``tap(path)`` and gives the tap every byte it reads (``SafetensorsReader(path, observe=tap.seen)``), so
    those bytes are hashed from its own buffers and read once; the files it did not tap are hashed by
    ``done()``. ``done()`` waits for the check and raises the first mismatch as one ``SlimtuneError``
    line; call it before anything made from the bytes is put under its final name. Build with ``read_check``.

    Example::

        check = read_check(Path("runs/1/step-000100"))
        ...  # read and write
        check.done()   # SlimtuneError("runs/1/step-000100/model.safetensors: sha256 differs from the manifest ...")
    """

    def __init__(self, directory: Path, files: list[str], fold: bool = False):
        self.directory, self.files = directory, files
        self._problems: list[str] = []
        self._taps: dict[str, FileTap] = {}
        self._thread = None if fold else threading.Thread(target=self._run, name=f"sha256 {directory.name}", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        try:
            self._problems = manifest_problems(self.directory, only=self.files, extra=False)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by done()
            self._problems = [f"{self.directory}: cannot check the manifest's sha256: {e}"]

    def tap(self, path: str | Path) -> FileTap | None:
        """With ``fold``: the tap of ``path`` when it is one of the checked files (None otherwise), to be
        given every byte read from it (``seen``) from now on."""
        if self._thread is not None:
            return None
        target = Path(path).resolve()
        for rel in self.files:
            if (self.directory / rel).resolve() == target:
                return self._taps.setdefault(rel, FileTap(self.directory / rel))
        return None

    @property
    def bytes_reread(self) -> int:
        """Bytes the taps read themselves (gaps and tails): 0 when every tapped file was read in order."""
        return sum(t.extra for t in self._taps.values())

    def _folded_problems(self) -> list[str]:
        try:
            listed = {f["path"]: f for f in read_manifest(self.directory)["files"]}
            untapped = [rel for rel in self.files if rel not in self._taps]
            problems = manifest_problems(self.directory, only=untapped, extra=False) if untapped else []
            for rel, tap in self._taps.items():
                try:
                    problems += tap.problems(listed[rel])
                except OSError as e:
                    problems.append(f"{tap.path}: cannot read: {e.strerror or e}")
            return problems
        except SlimtuneError as e:
            return [str(e)]

    def done(self) -> None:
        if self._thread is None:
            with stage("verify", device_work=False):
                self._problems = self._folded_problems()
        else:
            self._thread.join()
        _refuse(self._problems)


def _refuse(problems: list[str]) -> None:
    """The first problem (and how many more) as one ``SlimtuneError`` line; nothing where there is none."""
    if problems:
        more = "" if len(problems) == 1 else f" (and {len(problems) - 1} more)"
        raise SlimtuneError(problems[0] + more + "; --no-verify reads it as it is")


def read_check(path: str | Path, verify: bool = True, fold: bool = False) -> ReadCheck | None:
    """A ``ReadCheck`` of the files under ``path`` (a checkpoint, or a directory inside one such as
    ``step-N/adapter``) as the manifest of ``path`` or of its parent lists them; None when ``verify`` is
    off or neither has a manifest (a plain Hugging Face directory: nothing to check against). A manifest
    that is there but unreadable is one ``SlimtuneError`` line. ``fold``: hashed from the command's own
    reads (``ReadCheck.tap``) instead of a pass of its own. The small files other libraries parse are
    checked here, before it returns (``_check_parsed_files``)."""
    path = Path(path)
    if not verify or not path.is_dir():
        return None
    for root in (path, path.parent):
        if (root / MANIFEST_NAME).exists():
            prefix = "" if root == path else path.name + "/"
            listed = read_manifest(root)["files"]
            entries = [f for f in listed if f["path"].startswith(prefix) and (prefix or "/" not in f["path"])]
            if entries:
                _check_parsed_files(root, entries)
                return ReadCheck(root, [f["path"] for f in entries], fold)
    return None


_PARSED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".yaml", ".tiktoken")
_PARSED_MAX_BYTES = 64 * 1024 * 1024


def _check_parsed_files(root: Path, entries: list[dict]) -> None:
    """The small files other libraries parse (config, tokenizer files, the chat template: by suffix, at most
    64 MB each) hashed now, before anything reads them: a damaged one is this one ``SlimtuneError`` line,
    never a parser's message first. The weights are hashed as they are read (``ReadCheck``)."""
    small = [f["path"] for f in entries if f["path"].endswith(_PARSED_SUFFIXES) and f["size"] <= _PARSED_MAX_BYTES]
    _refuse(manifest_problems(root, only=small, extra=False) if small else [])


def checks_done(*checks: ReadCheck | None) -> None:
    """``done()`` of every check given (None: nothing to check)."""
    for check in checks:
        if check is not None:
            check.done()
