"""slimtune: QLoRA fine-tuning whose checkpoints are written as a stream, in bounded memory."""

__version__ = "0.1.0"
__all__ = [
    "LoRAConfig",
    "MergeSource",
    "SaveOptions",
    "SaveResult",
    "WriteOptions",
    "load_qlora_model",
    "merge_from_files",
    "save_checkpoint",
    "__version__",
]

_EXPORTS = {
    "LoRAConfig": "slimtune.lora",
    "MergeSource": "slimtune.formats.merge_source",
    "SaveResult": "slimtune.checkpoint.save",
    "SaveOptions": "slimtune.checkpoint.save",
    "WriteOptions": "slimtune.checkpoint.writer",
    "save_checkpoint": "slimtune.checkpoint.save",
    "load_qlora_model": "slimtune.model",
    "merge_from_files": "slimtune.merge",
}


def __getattr__(name: str):
    """Imported on first use: the offline merge should not pay for torchao and transformers."""
    if name in _EXPORTS:
        import importlib  # lazy on purpose: see the docstring

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'slimtune' has no attribute {name!r}")
