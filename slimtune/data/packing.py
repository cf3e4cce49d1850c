"""Examples -> training batches: optional packing of several examples into one row (attention kept
within each document), the deterministic seeded order of an epoch, its optimizer steps of micro-batches,
and padded micro-batches.

Example: ``batches = epoch_steps(epoch_order(len(examples), seed=0, epoch=0), batch_size=4, accumulation=2)``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slimtune.data.shapes import IGNORE_INDEX, Example
from slimtune.data.vision import PIXEL_INPUTS
from slimtune.distributed import Ranks, split_rows

if TYPE_CHECKING:
    from slimtune.data.vision import ImageInputs


def pack(examples: list[Example], max_seq_len: int, seed: int) -> list[Example]:
    """Documents concatenated into rows of at most ``max_seq_len`` tokens (seeded order, first fit in
    order: a row is closed when the next document does not fit). ``position_ids`` restart at 0 at each
    document, which is what makes transformers' attention block-diagonal (no token attends across a
    document boundary); the first token of each document is never a target, as unpacked."""
    if not examples:
        return []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed * 31 + 7)).tolist()
    rows: list[list[Example]] = [[]]
    used = 0
    for i in order:
        e = examples[i]
        if used + len(e.input_ids) > max_seq_len and rows[-1]:
            rows.append([])
            used = 0
        rows[-1].append(e)
        used += len(e.input_ids)
    packed = []
    for docs in rows:
        labels = [d.labels.clone() for d in docs]
        for lab in labels:
            lab[0] = IGNORE_INDEX
        packed.append(
            Example(
                torch.cat([d.input_ids for d in docs]),
                torch.cat(labels),
                torch.cat([torch.arange(len(d.input_ids), dtype=torch.int32) for d in docs]),
            )
        )
    return packed


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The example order of one epoch: a function of (seed, epoch) only, so a resumed run sees the same."""
    if not shuffle:
        return list(range(num_examples))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def epoch_steps(order: list[int], batch_size: int, accumulation: int) -> list[list[list[int]]]:
    """The epoch as optimizer steps, each a list of micro-batches of example indices. The last step of an
    epoch may hold fewer micro-batches (and the last micro-batch fewer examples)."""
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


def collate(examples: list[Example], pad_id: int, images: ImageInputs | None = None) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (IGNORE_INDEX on padding). Packed rows get
    position_ids instead of an attention mask (the padding tail is one more document of its own). Vision
    rows' images are decoded here by ``images`` (the processor's pixel values, ``data/vision.py``), and
    Gemma 3's ``token_type_ids`` (1 on image tokens) made from the ids.

    Example: ``collate([example], pad_id=0)["input_ids"].shape`` -> (1, len(example.input_ids))"""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    packed = examples[0].position_ids is not None
    positions = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = e.input_ids
        labels[row, :n] = e.labels
        mask[row, :n] = 1
        if packed:
            positions[row, :n] = e.position_ids
            positions[row, n:] = torch.arange(length - n)
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
    if packed:
        batch["position_ids"] = positions
    if images is not None:
        batch.update(images.pixels(examples))
        batch.update(images.token_type_ids(input_ids))
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the forward pass gets from a collated batch: packed rows pass position_ids and no attention
    mask, and no cache: transformers then builds the block-diagonal causal mask from the position resets
    (with a cache it would not look for them). A vision batch's image inputs go with them.

    Example: ``model(**model_inputs(collate(examples, pad_id))).logits``"""
    pixels = {k: batch[k] for k in PIXEL_INPUTS if k in batch}
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False, **pixels}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False, **pixels}


def rank_batch(
    examples: list[Example], batch: list[int], ranks: Ranks, pad_id: int, images: ImageInputs | None = None
) -> dict[str, torch.Tensor]:
    """This rank's contiguous slice of a global micro-batch (``split_rows``), collated. A rank whose
    slice is empty (a short last batch) still runs the forward and backward passes FSDP2's collectives
    need, on one example with no trained token: it adds nothing to the loss or the gradients.

    Example: ``rank_batch(data.train, [0, 1, 2], Ranks(1, 2), pad_id=0)`` collates examples 2 only"""
    start, end = split_rows(len(batch), ranks.world_size)[ranks.rank]
    if end > start:
        return collate([examples[i] for i in batch[start:end]], pad_id, images)
    filler = collate([examples[batch[0]]], pad_id, images)
    filler["labels"].fill_(IGNORE_INDEX)
    return filler
