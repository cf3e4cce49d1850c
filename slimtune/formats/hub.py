"""Models named by Hugging Face Hub id: ``org/name`` or ``org/name@revision``, wherever slimtune takes a model
directory (``model.path``, ``--base``). ``resolve_model`` turns either form into a local directory:

- a local directory of that name wins (one warning line says so);
- a hub id is resolved by ``huggingface_hub.snapshot_download``: its cache (``HF_HOME``, ``HF_HUB_CACHE``),
  ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, its token from the environment (``HF_TOKEN``) or its login file, its
  progress bars. Only the files slimtune reads are fetched (``hub_files()``: top-level safetensors and index,
  config, generation config, tokenizer files, chat template), never ``*.bin``, ``*.pth``, ``*.gguf`` or
  subfolders such as ``original/``. Online, the repo's file list is checked before anything is downloaded:
  a repo without safetensors weights fails with nothing fetched.

Every failure (no network, a gated repo without a token, an unknown repo, a missing revision, no
safetensors, a malformed id) is one ``SlimtuneError`` line. Nothing is ever created at a path that looks
like a hub id; the hub's own cache is the only place anything is written.

Datasets by hub id (``dataset.path``, ``dataset.mix``, ``dataset.eval_path``) are
``org/name[@revision][:split]`` or ``org/name[@revision][:subset:split]`` (split ``train`` when none is
named): ``resolve_dataset`` fetches the dataset repo's snapshot the same way (every file of it, the same
cache, switches and errors; ``HF_DATASETS_OFFLINE`` counts as offline too) and ``data.readers`` reads the
split through ``datasets.load_dataset``. A local file or directory of the same name wins.

Example::

    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct@main")
    source.path, source.hub_id, source.revision   # snapshot dir, "HuggingFaceTB/SmolLM2-135M-Instruct", "<40 hex>"
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from slimtune.errors import SlimtuneError, first_line
from slimtune.formats.strict_json import safe_name

log = logging.getLogger(__name__)

_SUBFOLDERS = ("*/*",)  # original/, onnx/, ...: never fetched
# org/name[@revision]: the hub's name rules (letters, digits, - _ .; no leading - or .), one slash.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[^\s@]{1,200}))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelSource:
    """A model directory and where it came from. ``os.PathLike``: ``Path(source)`` is the directory.

    ``name`` is what a checkpoint records as its base (``base_model_name_or_path``): the hub id for a hub
    model, the directory otherwise; ``revision`` the resolved commit hash (None for a local directory)."""

    path: Path
    hub_id: str | None = None
    revision: str | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.hub_id or str(self.path)

    @property
    def label(self) -> str:
        """``org/name@<commit>`` for a hub model, the directory otherwise (for log lines and messages)."""
        return f"{self.hub_id}@{self.revision}" if self.hub_id else str(self.path)

    def record(self) -> dict:
        """What slimtune_format.json and the merge manifest record: ``{"name": ..., "revision": ...}``."""
        return {"name": self.name, "revision": self.revision}


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``text`` has the shape of a hub id, else None (a path: absolute,
    ``./x``, ``~/x``, more than one slash, characters the hub does not allow).

    Example: ``parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")``; ``parse_hub_id("./org/name") is None``"""
    if not isinstance(text, str):
        return None
    match = _HUB_ID.fullmatch(text)
    if match is None or "--" in match["repo"] or ".." in match["repo"] or match["repo"].endswith(".git"):
        return None
    return match["repo"], match["revision"]


def is_hub_id(text: object) -> bool:
    """Whether ``text`` would be looked up on the hub when no local directory has its name."""
    return isinstance(text, str) and parse_hub_id(text) is not None


_RESOLVED: dict[tuple, ModelSource] = {}


def resolve_model(model: str | os.PathLike) -> ModelSource:
    """The local directory of ``model``: a ``ModelSource`` as it is, an existing directory (which wins over a
    hub id of the same name, with one warning), or a hub id resolved through huggingface_hub (downloaded into
    its cache when needed). Resolved once per process for the same id, cache and endpoint. A name that is
    neither is ``SlimtuneError`` ``no such model directory``.

    Example: ``resolve_model("org/name").path``  # .../models--org--name/snapshots/<commit>"""
    if isinstance(model, ModelSource):
        return model
    text = os.fspath(model)
    hub = parse_hub_id(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if hub is not None:
            log.warning("%s: the local directory %s is used, not the hub repo of that name", text, path.resolve())
        return ModelSource(path.resolve() if hub is not None else path)
    if hub is None:
        raise SlimtuneError(f"{safe_name(text)}: no such model directory")
    from huggingface_hub import constants  # only where a hub id is resolved

    key = (text, os.getcwd(), constants.HF_HUB_CACHE, constants.ENDPOINT, constants.is_offline_mode())
    if key not in _RESOLVED:
        _RESOLVED[key] = _from_hub(*hub)
        log.info("%s: hub revision %s (%s)", text, _RESOLVED[key].revision, _RESOLVED[key].path)
    return _RESOLVED[key]


# org/name[@revision] then :split or :subset:split (git refs hold no colon; subset and split names are
# the hub's config and split names: letters, digits, - _ .).
_SPLIT = re.compile(r"[\w][\w.-]{0,99}")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")  # a missing local data file, not a repo


@dataclass(frozen=True)
class DatasetSource:
    """A dataset split and where it came from: ``path`` the snapshot (or local) directory ``datasets`` reads,
    ``hub_id`` and ``revision`` (the commit) for a hub dataset, ``subset`` (the config name) and ``split``."""

    path: Path
    split: str = "train"
    subset: str | None = None
    hub_id: str | None = None
    revision: str | None = None

    @property
    def label(self) -> str:
        """``org/name@<commit>:split`` (``:subset:split`` with a subset), or the directory: for log lines and
        the data files a checkpoint records."""
        where = f"{self.hub_id}@{self.revision}" if self.hub_id else str(self.path)
        return ":".join([where, *([self.subset] if self.subset else []), self.split])

    def record(self) -> dict:
        """What slimtune_format.json records: ``{"name", "revision", "subset", "split"}``."""
        return {"name": self.hub_id or str(self.path), "revision": self.revision, "subset": self.subset, "split": self.split}


def parse_dataset_id(text: str) -> tuple[str, str | None, str | None, str] | None:
    """``(repo_id, revision, subset, split)`` when ``text`` has the shape of a dataset hub id
    (``org/name[@revision][:split]`` or ``org/name[@revision][:subset:split]``), else None: a path, or a
    name ending in a data file suffix (``data/train.jsonl`` is a missing file, never a repo).

    Example: ``parse_dataset_id("org/name@v1:default:test") == ("org/name", "v1", "default", "test")``"""
    if not isinstance(text, str) or text.count(":") > 2:
        return None
    head, *tail = text.split(":")
    hub = parse_hub_id(head)
    if hub is None or hub[0].lower().endswith(_DATA_SUFFIXES) or not all(_SPLIT.fullmatch(t) for t in tail):
        return None
    subset, split = (None, tail[0]) if len(tail) == 1 else (tail[0], tail[1]) if tail else (None, "train")
    return hub[0], hub[1], subset, split


def is_dataset_id(text: object) -> bool:
    """Whether ``text`` would be looked up on the hub as a dataset when no local file has its name."""
    return isinstance(text, str) and parse_dataset_id(text) is not None


def resolve_dataset(text: str) -> DatasetSource:
    """The local directory holding the dataset named ``text`` (``parse_dataset_id``): a local directory of
    the repo's name wins (one warning line), else the hub snapshot at the revision, fetched into the hub
    cache when needed (offline: from the cache only). The split and subset are checked when read.

    Example: ``resolve_dataset("org/name:test").label``  # org/name@<commit>:test"""
    parsed = parse_dataset_id(text)
    if parsed is None:
        raise SlimtuneError(f"{safe_name(text)}: no such dataset file, and not a hub dataset id (org/name[@revision][:split])")
    repo, revision, subset, split = parsed
    local = Path(repo).expanduser()
    if local.is_dir():
        log.warning("%s: the local directory %s is used, not the hub dataset of that name", text, local.resolve())
        return DatasetSource(local.resolve(), split, subset)
    from huggingface_hub import constants  # only where a hub id is resolved

    key = ("dataset", repo, revision, os.getcwd(), constants.HF_HUB_CACHE, constants.ENDPOINT, _datasets_offline())
    if key not in _RESOLVED:
        _RESOLVED[key] = _dataset_from_hub(repo, revision)
        log.info("%s: hub revision %s (%s)", text, _RESOLVED[key].revision, _RESOLVED[key].path)
    found = _RESOLVED[key]
    return DatasetSource(found.path, split, subset, repo, found.revision)


def _datasets_offline() -> bool:
    """HF_HUB_OFFLINE, or HF_DATASETS_OFFLINE (the datasets library's own switch)."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _dataset_from_hub(repo: str, revision: str | None) -> ModelSource:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise SlimtuneError(f"{repo}: not a valid hub id ({safe_name(first_line(e))})") from None
    where = safe_name(f"hub dataset {repo}" + (f"@{revision}" if revision else ""))
    offline = _datasets_offline()
    if not offline:
        try:  # the repo's answer first: unknown, gated or a missing revision is one line before anything is fetched
            HfApi().dataset_info(repo, revision=revision)
        except Exception as e:  # noqa: BLE001 - sorted by _hub_error; unreachable: try the cache below
            problem = _hub_error(e, where)
            if problem is not None:
                raise problem from None
            offline = True
            log.warning("%s: the hub cannot be reached (%s); looking in the cache", where, safe_name(first_line(e)))
    try:
        folder = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=offline)
    except Exception as e:  # noqa: BLE001 - every hub failure is one line
        raise (_hub_error(e, where) or _cache_miss(e, where, offline)) from None
    path = Path(folder)
    return ModelSource(path, repo, path.name if _COMMIT.fullmatch(path.name) else None)


def hub_files() -> tuple[str, ...]:
    """What slimtune reads of a model repo (``formats.hf``), as snapshot_download patterns; fetched at the
    repo's top level only."""
    from slimtune.formats.hf import INDEX_NAME, TOKENIZER_FILES  # torch: only where a hub model is fetched

    return ("config.json", INDEX_NAME, "*.safetensors", *TOKENIZER_FILES)


def _from_hub(repo: str, revision: str | None) -> ModelSource:
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise SlimtuneError(f"{repo}: not a valid hub id ({safe_name(first_line(e))})") from None
    where = safe_name(f"hub repo {repo}" + (f"@{revision}" if revision else ""))
    offline = constants.is_offline_mode()
    if not offline:
        try:  # the file list first: a repo slimtune cannot read is refused before anything is fetched
            info = HfApi().model_info(repo, revision=revision)
        except Exception as e:  # noqa: BLE001 - sorted by _hub_error; unreachable: try the cache below
            problem = _hub_error(e, where)
            if problem is not None:
                raise problem from None
            offline = True
            log.warning("%s: the hub cannot be reached (%s); looking in the cache", where, safe_name(first_line(e)))
        else:
            files = [s.rfilename for s in info.siblings or []]
            if files and not any("/" not in f and f.endswith(".safetensors") for f in files):
                raise SlimtuneError(f"{where}: holds no *.safetensors weights at its top level, which is all slimtune reads")
    try:
        folder = snapshot_download(
            repo, revision=revision, allow_patterns=list(hub_files()), ignore_patterns=list(_SUBFOLDERS), local_files_only=offline
        )
    except Exception as e:  # noqa: BLE001 - every hub failure is one line
        raise (_hub_error(e, where) or _cache_miss(e, where, offline)) from None
    path = Path(folder)
    if not any(path.glob("*.safetensors")):
        raise SlimtuneError(f"{where}: holds no *.safetensors weights at its top level, which is all slimtune reads")
    commit = path.name if _COMMIT.fullmatch(path.name) else None
    return ModelSource(path, repo, commit)


def _hub_error(e: Exception, where: str) -> SlimtuneError | None:
    """The one line for a hub answer that is final (gated, unknown, no such revision); None for the others
    (unreachable, offline), where the cache may still hold the snapshot."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return SlimtuneError(f"{where}: the repo is gated; accept its terms on the hub and set HF_TOKEN (or `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return SlimtuneError(f"{where}: no such repo on the hub, or it is private (set HF_TOKEN for private repos)")
    if isinstance(e, RevisionNotFoundError):
        return SlimtuneError(f"{where}: the repo has no such revision (a branch, tag or commit hash)")
    if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code in (401, 403):
        return SlimtuneError(f"{where}: access refused ({e.response.status_code}); set HF_TOKEN to a token that may read it")
    return None


def _cache_miss(e: Exception, where: str, offline: bool) -> SlimtuneError:
    from huggingface_hub import constants
    from huggingface_hub.errors import IncompleteSnapshotError

    cache = constants.HF_HUB_CACHE
    if isinstance(e, IncompleteSnapshotError):
        return SlimtuneError(f"{where}: the cached snapshot in {cache} is incomplete and the hub cannot be reached to complete it")
    if isinstance(e, FileNotFoundError | ConnectionError) or offline:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else "HF_DATASETS_OFFLINE is set"
            if _datasets_offline()
            else f"the hub ({constants.ENDPOINT}) cannot be reached"
        )
        return SlimtuneError(f"{where}: not in the hub cache ({cache}) and {why}")
    return SlimtuneError(f"{where}: {type(e).__name__}: {safe_name(first_line(e))}")
