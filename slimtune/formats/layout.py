"""The one spelling of a checkpoint directory's layout: where the merged model, the adapter, the
manifest, the format record and the recipe state are. It reads a ``step-N`` directory, a merged model
directory (``slimtune merge``'s or any Hugging Face one) and a PEFT adapter directory alike::

    step-000100/
        config.json, *.safetensors, model.safetensors.index.json   the merged model (not in adapter-only saves)
        adapter/adapter_config.json, adapter/adapter_model.safetensors   the adapter, in PEFT's file names
        slimtune_format.json         what training recorded: prompt format, chat template, NF4 blocks
        recipe_state.pt, train_state/   what resume reads
        slimtune_manifest.json       every file's size and sha256, written last

Example: ``CheckpointLayout("runs/1/step-000100").adapter_dir  # Path("runs/1/step-000100/adapter")``"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "slimtune_manifest.json"  # every file's size and sha256 (``formats/manifest.py``)
ADAPTER_DIR = "adapter"  # where a slimtune checkpoint keeps its adapter
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
ADAPTER_WEIGHTS_PATH = f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"
FORMAT_NAME = "slimtune_format.json"
STATE_NAME = "recipe_state.pt"


@dataclass(frozen=True)
class CheckpointLayout:
    """The places in the directory ``root``; properties that look at the disk say so."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def adapter_dir(self) -> Path | None:
        """The adapter directory on disk: ``root`` itself when it holds adapter_config.json (a PEFT save),
        else ``root/adapter`` when that does (a slimtune checkpoint), else None."""
        for place in (self.root, self.root / ADAPTER_DIR):
            if (place / ADAPTER_CONFIG).is_file():
                return place
        return None

    @property
    def has_merged(self) -> bool:
        """Whether a merged (Hugging Face) model is on disk here: config.json and safetensors beside it."""
        return (self.root / "config.json").is_file() and any(self.root.glob("*.safetensors"))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def recipe_state(self) -> Path:
        return self.root / STATE_NAME

    @property
    def format_record(self) -> Path | None:
        """slimtune_format.json on disk: the checkpoint's, or for its ``adapter/`` the one above it."""
        return next((p for p in (self.root / FORMAT_NAME, self.root.parent / FORMAT_NAME) if p.is_file()), None)
