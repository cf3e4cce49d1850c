"""The training state of a checkpoint, written by every rank together through
``torch.distributed.checkpoint`` into ``train_state/`` (each rank its shards, the coordinator the
metadata), so a run resumes on another number of ranks through DCP's resharding: the adapters, optimizer,
scheduler, loss scaler, data position and each rank's RNG states. Values that are not tensors are stored
as tensors of ``torch.save`` bytes, read back with ``weights_only=True``; DCP's own ``.metadata`` is a
pickle, so a run directory must come from a trusted source. The RNG streams it carries are captured, restored
and seeded here (``rng_state``, ``set_rng_state``, ``seed_everything``); what the tree holds is
``run_state.training_state``'s.

Example::

    files = save_train_state({"adapter": adapters, "rng": {"0": rng_state()}}, tmp)   # every rank
    restored = load_train_state(ckpt, template)                                     # fills template in place
    set_rng_state(restored["rng"]["0"])
"""

from __future__ import annotations

import io
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.utils import _pytree as pytree

from slimtune.errors import SlimtuneError, first_line

TRAIN_STATE_DIR = "train_state"  # torch.distributed.checkpoint: every rank writes its shards


def save_train_state(state: dict, tmp: Path) -> list[str]:
    """Every rank: write ``state`` with DCP into ``tmp/train_state`` (each rank its shards, the
    coordinator the metadata; files fsynced). Returns the files' paths relative to ``tmp``: the
    ``shared_write`` of ``write_checkpoint``.

    Example: ``save_checkpoint(model, out, options, ranks, partial(save_train_state, state))``"""
    where = tmp / TRAIN_STATE_DIR
    writer = dcp.FileSystemWriter(str(where), single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: nothing to say
            dcp.save(_pack(state), storage_writer=writer)
    except dcp.api.CheckpointException as e:  # a full disk on some rank: its OSError, so the caller reports one line
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        raise next((f for f in failures if isinstance(f, OSError)), failures[0] if failures else e) from None
    return sorted(str(p.relative_to(tmp)) for p in where.rglob("*") if p.is_file())


_PACKED = "packed_value"  # {"packed_value": uint8 tensor} stands for a value that is not a tensor


def _pack(tree: dict, metadata: dict | None = None) -> dict:
    """Nested dicts with tensors kept and every other value as ``{"packed_value": uint8 tensor}`` of its
    ``torch.save`` bytes (so loading never unpickles: ``weights_only=True``). With DCP ``metadata`` (for
    loading): packed values become empty tensors of the saved size, and entries the checkpoint lacks are
    left out. The nodes are non-empty dicts of str keys; anything else (a list too) is one value."""
    out: dict = {}
    for path, value in pytree.tree_leaves_with_path(tree, is_leaf=lambda x: x is not tree and _is_value(x)):
        keys = [k.key for k in path]
        flat = ".".join(map(str, keys))  # DCP's name for it
        if isinstance(value, torch.Tensor):
            packed = value if metadata is None or flat in metadata else None
        elif metadata is None:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            packed = {_PACKED: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}
        else:
            saved = metadata.get(f"{flat}.{_PACKED}")
            packed = None if saved is None else {_PACKED: torch.empty(tuple(saved.size), dtype=torch.uint8)}
        if packed is not None:
            node = out
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = packed
    return out


def _is_value(x: object) -> bool:
    return not (isinstance(x, dict) and x and all(isinstance(k, str) for k in x) and _PACKED not in x)


def _unpack(tree: dict) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and set(value) == {_PACKED}:
            out[key] = torch.load(io.BytesIO(value[_PACKED].numpy().tobytes()), map_location="cpu", weights_only=True)
        elif isinstance(value, dict):
            out[key] = _unpack(value)
        else:
            out[key] = value
    return out


def load_train_state(path: Path, template: dict) -> dict:
    """Read ``path``'s training state into ``template`` (the same nested layout as saved, holding
    this process's tensors or DTensors, which DCP fills in place, resharding as needed) and return
    it with the plain values unpacked. Entries of ``template`` the checkpoint lacks (the RNG of a
    rank that did not exist then) are left out of the result. Every rank calls this.

    Example: ``restored = load_train_state(Path("run/step-000100"), template)``"""
    where = path / TRAIN_STATE_DIR
    try:
        metadata = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise SlimtuneError(f"{where}: cannot read the training state ({type(e).__name__}: {e})") from None
    packed = _pack(template, metadata)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(packed, checkpoint_id=str(where))
    except Exception as e:  # noqa: BLE001
        first = first_line(e)
        raise SlimtuneError(f"{where}: cannot load the training state ({first})") from None
    return _unpack(packed)


def rng_state() -> dict:
    """Python, NumPy, torch and CUDA generator states, as plain containers and tensors."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` captured."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CUDA's too): the streams ``rng_state`` captures.

    Example: ``seed_everything(cfg.seed + ranks.rank)``"""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
