"""What a fine-tuning checkpoint carries beside its weights: the tokenizer files (with the chat template
training rendered conversations with), the model card (README.md, ``checkpoint/card.py``) at the root and
in ``adapter/``, and ``slimtune_format.json`` (the prompt format; ``formats/format_record.py`` makes, writes
and reads it). ``CheckpointDocs`` stages them once per run and hands each save its files, which the save
copies in under its manifest.

Example::

    docs = CheckpointDocs(tokenizer, cfg, data, hf_config, torch.bfloat16, nf4_report(model))
    options = SaveOptions(write, extra_files=docs.files(step=10, total_steps=10, epoch=1, train_loss=1.2, merged=True),
                          tokenizer_dir=docs.tokenizer_dir)
    docs.close()
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from slimtune.checkpoint.card import CardFacts, model_card
from slimtune.config import Config
from slimtune.formats.format_record import new_format_record, write_format_record
from slimtune.formats.hf import PROCESSOR_FILES, tokenizer_files
from slimtune.formats.hub import ModelSource
from slimtune.formats.layout import ADAPTER_DIR, FORMAT_NAME
from slimtune.model import load_tokenizer
from slimtune.prompts import FALLBACK_CHAT_TEMPLATE


class CheckpointDocs:
    """The tokenizer files with the chat template training rendered conversations with (the fallback one
    when the base tokenizer had none), the model card and slimtune_format.json (the prompt format).
    Staged in a temporary directory (``close`` removes it) and copied in by each save, under its manifest."""

    def __init__(self, tokenizer, cfg: Config, base: ModelSource, data, hf_config, merged_dtype: torch.dtype, nf4: dict):
        self._tmp = tempfile.TemporaryDirectory(prefix="slimtune-docs-")
        self.root = Path(self._tmp.name)
        self.tokenizer_dir = self.root / "tokenizer"
        base_files = tokenizer_files(base.path)
        if getattr(tokenizer, "chat_template", None) and base_files:  # the base's files as they are, as an offline merge
            self.tokenizer_dir.mkdir()  # copies them (a save_pretrained would add its load arguments to tokenizer_config.json)
            for src in base_files:
                shutil.copyfile(src, self.tokenizer_dir / src.name)
        else:  # the saved copy gets the template training rendered chat rows with
            tokenizer.save_pretrained(str(self.tokenizer_dir))
            load_tokenizer(self.tokenizer_dir, chat_template=FALLBACK_CHAT_TEMPLATE).save_pretrained(str(self.tokenizer_dir))
            for name in ("generation_config.json", *PROCESSOR_FILES):  # the base's, as an offline merge copies them
                if (base.path / name).is_file():
                    shutil.copyfile(base.path / name, self.tokenizer_dir / name)
        template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        hub_data = list(getattr(data, "datasets", []))  # the hub datasets read: name, revision (commit), subset, split
        self.record = {**new_format_record(data.shapes, template), "nf4": nf4, "base": base.record(), "datasets": hub_data}
        self.common = dict(
            base=base.name,
            base_revision=base.revision,
            model_type=str(getattr(hf_config, "model_type", "unknown")),
            lora=dict(
                rank=cfg.lora.rank,
                alpha=cfg.lora.alpha,
                dropout=cfg.lora.dropout,
                use_rslora=cfg.lora.use_rslora,
                target_modules=list(cfg.lora.target_modules),
            ),
            files=data.files,
            datasets=sorted({d["name"] for d in hub_data}),
            shapes=dict(data.shapes),
            prompt_format=self.record["prompt_format"],
            merged_dtype=str(merged_dtype).removeprefix("torch."),
            nf4=nf4,
        )

    def files(self, **facts) -> dict[str, Path]:
        """The save's extra files by their path in the checkpoint; ``facts``: this step's ``CardFacts``
        beyond the run's (step, total_steps, epoch, train_loss, merged, eval)."""
        card = self.root / "README.md"
        card.write_text(model_card(CardFacts(**self.common, **facts)))
        fmt = self.root / FORMAT_NAME
        write_format_record(fmt, self.record)
        extra = {"README.md": card, f"{ADAPTER_DIR}/README.md": card, FORMAT_NAME: fmt}
        extra.update({f"{ADAPTER_DIR}/{p.name}": p for p in tokenizer_files(self.tokenizer_dir)})
        return extra

    def close(self) -> None:
        self._tmp.cleanup()
