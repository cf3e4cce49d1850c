"""GRPO's generation: the policy's own forward samples completions for a batch of prompts, batched over
prompts x generations with a KV cache (transformers' ``DynamicCache``), in chunks of at most
``generation_batch_tokens`` positions (prompt + completion, padded) so the cache and the logits of one
chunk stay bounded. The NF4 weights are dequantized layer by layer inside each forward, once per
decode step for the whole chunk: no dequantized copy of the model exists.

Sampling draws from ``torch.Generator``s seeded by the caller (the run's seed and step), so a resumed
run samples what the uninterrupted run sampled: logits / temperature, then top-k, then top-p (nucleus)
filtering, then one multinomial draw per row per step (a draw per row even after the row stopped, so
the stream of draws never depends on when rows stop). Temperature 0 is greedy. Given one generator per
prompt (``row_generators``), each row draws from its own: its completion then depends on its prompt,
its seed and the logits only, not on which chunk or rank it is sampled in (2 ranks sample what one does).

Under FSDP2 (``ranks`` of a process group) every forward is a collective: each rank samples its own
prompts, and the ranks run the same number of chunks (a rank with fewer runs one-token filler chunks,
discarded) and of decode steps (until every rank's rows have stopped). A completion ends at
the first stop token (kept: it is part of the completion, as TRL keeps the eos) or at
``max_completion_length`` (then it is truncated).

Example: ``out = sample(model, [ids_a, ids_b], SamplingSpec(max_completion_length=64, stop_ids=(2,)), torch.Generator().manual_seed(7))``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from slimtune.distributed import SINGLE, Ranks, all_sum


@dataclass(frozen=True)
class SamplingSpec:
    """How completions are drawn (the config's grpo.* sampling keys) and where they stop."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    generation_batch_tokens: int = 16384  # padded prompt + completion positions per chunk


@dataclass
class Completions:
    """``sample``'s result, one entry per prompt given, in order."""

    ids: list[list[int]]  # the completion's tokens, a stop token included
    truncated: list[bool]  # reached max_completion_length without a stop token
    tokens: int = 0  # completion tokens generated in all


def stop_ids_of(tokenizer, generation_eos: int | list[int] | None = None) -> tuple[int, ...]:
    """The stop tokens: the tokenizer's eos and generation_config.json's eos_token_id (an id or a list).

    Example: ``stop_ids_of(tok, [2, 49152])  # (2, 49152)``"""
    ids = []
    for value in (getattr(tokenizer, "eos_token_id", None), generation_eos):
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return tuple(sorted(set(int(i) for i in ids)))


def row_generators(seed: int, first: int, count: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per completion ``first .. first + count - 1`` of a generation batch seeded by ``seed``:
    completion j's draws are the same whichever chunk or rank samples it.

    Example: ``sample(model, prompts, spec, row_generators(seed, 0, len(prompts)))``"""
    return [torch.Generator(device).manual_seed((seed * 1_000_003 + first + j) % 2**63) for j in range(count)]


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: list[torch.Tensor],
    spec: SamplingSpec,
    generator: torch.Generator | list[torch.Generator],
    ranks: Ranks = SINGLE,
) -> Completions:
    """Completions of ``prompts`` (token id tensors, one per completion wanted: repeat a prompt for
    several generations), chunk by chunk (``SamplingSpec.generation_batch_tokens``), dropout off;
    ``generator`` one for all rows, or a list (one per prompt, ``row_generators``). Under a process group
    every rank calls it with its own prompts (possibly none).

    Example: ``sample(model, [p] * 4, SamplingSpec(max_completion_length=32), torch.Generator().manual_seed(0)).ids``"""
    was_training = model.training
    model.eval()
    out = Completions([], [])
    chunks, start = _chunks(prompts, spec), 0
    count = max(ranks.gather(len(chunks), "generation")) if ranks.world_size > 1 else len(chunks)
    try:
        for k in range(count):
            if k >= len(chunks):  # this rank has no prompts left: a filler chunk keeps the collectives in step
                _sample_chunk(model, [torch.tensor([spec.pad_id])], spec, torch.Generator(), ranks, filler=True)
                continue
            chunk = chunks[k]
            drawn = generator[start : start + len(chunk)] if isinstance(generator, list) else generator
            ids, truncated = _sample_chunk(model, chunk, spec, drawn, ranks)
            out.ids += ids
            out.truncated += truncated
            start += len(chunk)
    finally:
        model.train(was_training)
    out.tokens = sum(len(i) for i in out.ids)
    return out


def _chunks(prompts: list[torch.Tensor], spec: SamplingSpec) -> list[list[torch.Tensor]]:
    """Consecutive prompts whose padded length (longest prompt + max_completion_length) x rows fits the budget (one row at least)."""
    chunks, current, longest = [], [], 0
    for p in prompts:
        width = max(longest, len(p)) + spec.max_completion_length
        if current and width * (len(current) + 1) > spec.generation_batch_tokens:
            chunks.append(current)
            current, longest = [], 0
        current.append(p)
        longest = max(longest, len(p))
    return chunks + ([current] if current else [])


def _sample_chunk(model: nn.Module, prompts: list[torch.Tensor], spec: SamplingSpec, generator, ranks: Ranks, filler: bool = False):
    """One chunk: left-padded prompts through the model once (prefill), then one token per step from the
    cache, until every row (on every rank) has stopped; a ``filler`` chunk's rows count as stopped."""
    device = next(p for p in model.parameters()).device
    rows, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((rows, width), spec.pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = p.long()
        mask[i, width - len(p) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    cache = DynamicCache()
    stops = torch.tensor(spec.stop_ids or [-1], device=device)
    done = torch.full((rows,), filler, dtype=torch.bool, device=device)
    tokens = []
    step_ids, positions = input_ids, (mask.cumsum(dim=1) - 1).clamp(min=0)
    for _ in range(spec.max_completion_length):
        # the last position by index (a contiguous copy of its hidden states): logits_to_keep=1 hands the output
        # head a strided slice, and torch's bf16 linear on a strided [rows, 1, hidden] input takes a path that
        # held ~1 GB and 2.9 s for a 128k x 512 head (8 rows; contiguous: 8 MB, 0.02 s; the same values)
        last = torch.tensor([step_ids.shape[1] - 1], device=device)
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=last)
        logits = out.logits[:, -1]
        nxt = _draw(logits.float(), spec, generator)
        nxt = torch.where(done, torch.full_like(nxt, spec.pad_id), nxt)
        tokens.append(nxt)
        done |= torch.isin(nxt, stops)
        if _all_stopped(done, ranks):
            break
        step_ids, positions = nxt.unsqueeze(1), positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
    drawn = torch.stack(tokens, dim=1).cpu()
    ids, truncated = [], []
    stop_set = set(spec.stop_ids)
    for row in drawn.tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in stop_set), None)
        ids.append(row if end is None else row[:end])
        truncated.append(end is None)
    return ids, truncated


def _all_stopped(done: torch.Tensor, ranks: Ranks) -> bool:
    """Every row of this chunk has stopped, on every rank (one small all-reduce per decode step under a group)."""
    if ranks.world_size == 1:
        return bool(done.all())
    return float(all_sum((~done).sum().float(), ranks)) == 0.0


def _draw(logits: torch.Tensor, spec: SamplingSpec, generator: torch.Generator | list[torch.Generator]) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else a multinomial draw from the filtered distribution."""
    if spec.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / spec.temperature
    if spec.top_k and spec.top_k < logits.shape[-1]:
        kth = torch.topk(logits, spec.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if spec.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - ordered.softmax(dim=-1) > spec.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if isinstance(generator, list):  # one generator per row
        return torch.cat([_multinomial(probs[i : i + 1], g) for i, g in enumerate(generator)])
    return _multinomial(probs, generator)


def _multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs`` from ``generator`` (on the generator's device), back on the probs' device."""
    if probs.device != generator.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
