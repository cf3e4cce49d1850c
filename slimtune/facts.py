"""What slimtune knows about a model it built, kept beside the model rather than on it (no attributes on
transformers' objects): the family's published checkpoint layout, the resolved LoRA targets, the
key renamings of the checkpoint, the directory it was loaded from, and partly assembled parameters
while a sharded model loads. Held in a ``WeakKeyDictionary``: the facts go when the model goes.

Example::

    facts = facts_of(model)          # None for a model slimtune did not build
    print(facts.targets, facts.source_dir)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn


@dataclass
class ModelFacts:
    layout: list = field(default_factory=list)  # families.Placement, in the published checkpoint's order
    targets: list[str] = field(default_factory=list)  # the linears holding adapters
    rename: Callable[[str], str] = str  # a checkpoint key -> the model's key (transformers' renamings)
    source_dir: Path | None = None  # the base checkpoint the model was loaded from (None: built in memory)
    base_name: str | None = None  # what checkpoints record as its base: the hub id, or source_dir (formats.hub.ModelSource.name)
    staging: dict = field(default_factory=dict)  # sharded loading: parameter -> (whole tensor, elements filled)


_FACTS: weakref.WeakKeyDictionary[nn.Module, ModelFacts] = weakref.WeakKeyDictionary()


def remember(model: nn.Module, facts: ModelFacts) -> ModelFacts:
    """Keep ``facts`` beside ``model`` (replacing any) and return them."""
    _FACTS[model] = facts
    return facts


def facts_of(model: nn.Module) -> ModelFacts | None:
    """The facts slimtune keeps beside ``model``, or None for a model it did not build."""
    return _FACTS.get(model)
