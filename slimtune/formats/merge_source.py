"""Where a merged model comes from: a checkpoint (``src``: a merged model, or a slimtune checkpoint
holding ``adapter/``), or a PEFT adapter merged into a base; which base weights the adapter is merged
into (``merge_base``); whether the files read are checked against their manifest (``verify``). Merge,
verify, both GGUF exports, generate and chat take one ``MergeSource``; ``MergeSource.resolve`` makes it
from the command line or from a checkpoint and its ``slimtune_format.json``.

Example::

    source = MergeSource.resolve(checkpoint=Path("runs/1/step-000100"), base="models/llama", merge_base="quantized")
    source.adapter_dir, source.record.get("chat_template")
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from slimtune.errors import SlimtuneError
from slimtune.formats.format_record import read_format_record
from slimtune.formats.hub import ModelSource
from slimtune.formats.layout import CheckpointLayout

MERGE_BASES = ("original", "quantized")
"""``original``: the adapter merged into W itself; ``quantized``: into dequant(NF4(W)), the weights a QLoRA
adapter was trained against."""


def check_merge_base(name: str) -> str:
    """``name`` when it is one of ``MERGE_BASES``, else one error line.
    Example: ``check_merge_base("quantized")``"""
    if name not in MERGE_BASES:
        raise SlimtuneError(f"merge base {name!r}: expected 'original' or 'quantized'")
    return name


@dataclass(frozen=True)
class MergeSource:
    """A merged model's sources (see the module docstring); the merge base's name is checked here.

    Example: ``MergeSource(base=Path("base"), adapter=Path("run/step-10/adapter"), merge_base="quantized")``"""

    base: str | Path | ModelSource | None = None
    """The base model: a directory or a hub id (``org/name[@revision]``)."""
    adapter: str | Path | None = None
    """A PEFT adapter directory (or a checkpoint holding ``adapter/``); None: ``checkpoint``'s."""
    merge_base: str = "original"
    verify: bool = True
    """Hash the files read that have a manifest while they are read; a mismatch is one error line."""
    checkpoint: str | Path | None = None
    """A checkpoint: its merged model, its ``adapter/``, its tokenizer and ``slimtune_format.json``."""

    def __post_init__(self) -> None:
        check_merge_base(self.merge_base)
        for name in ("adapter", "checkpoint"):  # held as paths, whatever was given
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))

    @classmethod
    def resolve(
        cls,
        checkpoint: str | Path | None = None,
        base: str | Path | ModelSource | None = None,
        adapter: str | Path | None = None,
        merge_base: str | None = None,
        verify: bool = True,
    ) -> MergeSource:
        """The one resolver. ``merge_base`` None: what the checkpoint was trained against, as its record
        says: ``original`` for a merged model (or no checkpoint), ``quantized`` for an adapter trained by
        slimtune on an NF4 base (``slimtune_format.json`` with an ``nf4`` entry), ``original`` otherwise.
        Example: ``MergeSource.resolve(checkpoint="runs/1/step-000010", base="base")``"""
        if merge_base is None:
            trained_on_nf4 = (
                checkpoint is not None and not CheckpointLayout(checkpoint).has_merged and "nf4" in read_format_record(checkpoint)
            )
            merge_base = MERGE_BASES[trained_on_nf4]
        return cls(base, adapter, merge_base, verify, checkpoint)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MergeSource:
        """The source a command's arguments name (``src`` or ``checkpoint``, ``--base``, ``--adapter``,
        ``--merge-base``, ``--no-verify``; the ones a command lacks take their defaults).
        Example: ``MergeSource.from_args(build_parser().parse_args(["export", "ckpt"]))``"""
        given = vars(args)
        return cls.resolve(
            given.get("src", given.get("checkpoint")),
            given.get("base"),
            given.get("adapter"),
            given.get("merge_base", "original"),
            given.get("verify", True),
        )

    @property
    def adapter_dir(self) -> Path | None:
        """``adapter``, else the checkpoint's adapter directory (``CheckpointLayout.adapter_dir``), else None."""
        if self.adapter is not None:
            return self.adapter
        return CheckpointLayout(self.checkpoint).adapter_dir if self.checkpoint is not None else None

    @property
    def _dirs(self) -> list[Path]:
        """The directories that may hold the tokenizer and the format record, the adapter's first."""
        return [d for d in (self.adapter_dir, self.checkpoint) if d is not None]

    @cached_property
    def record(self) -> dict:
        """What training recorded (``slimtune_format.json``: the chat template it used) in the first of the
        adapter's directory and the checkpoint that has it; empty when neither has."""
        return next((r for r in map(read_format_record, self._dirs) if r), {})

    def tokenizer_dir(self, fallback: Path) -> Path:
        """The first of the adapter's directory and the checkpoint that holds tokenizer files, else ``fallback`` (the base's)."""
        return next((d for d in self._dirs if (d / "tokenizer_config.json").is_file()), fallback)
