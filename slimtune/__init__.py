"""slimtune: QLoRA fine-tuning whose checkpoints are written as a stream, in bounded memory."""

import logging as _logging

# Optional CUDA kernels that torchao cannot load on this machine are not used by NF4: keep the noise out.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

__version__ = "0.1.0"
__all__ = [
    "LoRAConfig",
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
