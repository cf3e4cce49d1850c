"""Hugging Face checkpoint directories: config.json, safetensors shards and their index, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.errors import SlimtuneError
from slimtune.formats.safetensors import SafetensorsHeader, read_header

if TYPE_CHECKING:
    from transformers import PretrainedConfig

INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """config.json of a local checkpoint, with errors that name the file (never a hub lookup)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SlimtuneError(f"{model_dir}: no such model directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise SlimtuneError(f"{path}: missing (a Hugging Face checkpoint directory needs config.json)")
    try:
        json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SlimtuneError(f"{path}: not valid JSON ({e})") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise SlimtuneError(f"{path}: not a usable model config ({e})") from None


def export_config_dict(config: PretrainedConfig, dtype_name: str | None = None) -> dict:
    """The config to write beside merged weights: no quantization_config, dtype as written."""
    data = config.to_dict()
    data.pop("quantization_config", None)
    data.pop("_name_or_path", None)
    if dtype_name:
        data["torch_dtype"] = dtype_name
        data["dtype"] = dtype_name
    return data


def checkpoint_files(model_dir: str | Path) -> list[SafetensorsHeader]:
    """Headers of the checkpoint's safetensors files, checked, in index order (or name order)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SlimtuneError(f"{index}: malformed index ({e!r})") from None
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            if not (model_dir / name).is_file():
                raise SlimtuneError(f"{index}: lists {name}, which is missing from {model_dir}")
        headers = [read_header(model_dir / name) for name in names]
        for h in headers:
            for key in h.tensors:
                if weight_map.get(key) != h.path.name:
                    raise SlimtuneError(f"{index}: tensor {key} is in {h.path.name} but the index says {weight_map.get(key)}")
        return headers
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin"))
        hint = " (found .bin weights: convert them to safetensors first)" if bins else ""
        raise SlimtuneError(f"{model_dir}: no *.safetensors weights{hint}")
    return [read_header(f) for f in files]


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def index_dict(weight_map: dict[str, str], total_size: int) -> dict:
    return {"metadata": {"total_size": total_size}, "weight_map": weight_map}


def tokenizer_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    return [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
