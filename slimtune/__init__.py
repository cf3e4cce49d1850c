"""slimtune: QLoRA fine-tuning whose checkpoints are written as a stream, in bounded memory."""

import logging as _logging

# Optional CUDA kernels that torchao cannot load on this machine are not used by NF4: keep the noise out.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

__version__ = "0.1.0"

from slimtune.checkpoint.save import SaveResult, save_checkpoint  # noqa: E402
from slimtune.lora import LoRAConfig  # noqa: E402
from slimtune.model import load_qlora_model  # noqa: E402

__all__ = ["LoRAConfig", "SaveResult", "load_qlora_model", "save_checkpoint", "__version__"]
