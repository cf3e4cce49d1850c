"""One optimizer step of QLoRA training, and its loss, with no host synchronisation inside.

``optimizer_step`` (what the recipe's ``train_step`` calls once it has collated the batch) runs the
forward and backward passes of a global step's micro-batches (this rank's slices), clips the adapters'
gradient norm, steps AdamW and the schedule, and returns the step's loss as a tensor on the device: the
caller reads it once (``.item()``, the logged loss), the only point at which the host waits for the
device. The token counts the loss is averaged over come from the host (``step_token_counts``: the
examples' labels, every rank's slice included), so no count is reduced across ranks or read back from
the device.

``token_loss_sum`` is the next-token cross-entropy in fp32 over chunks of positions with a hand-written
backward: the forward keeps nothing but the logits autograd holds anyway (no saved chunk graphs), the
backward makes each chunk's gradient (softmax minus one-hot, scaled) in place in one fp32 buffer and
writes it in the logits' dtype: bit for bit the gradient autograd makes through F.cross_entropy (the
same log-softmax, exp, subtraction and cast), without the recomputed forward, the one-hot tensor, the
zero-filled gradient of the gather and the separate cast pass of a checkpointed autograd graph. No
fp32 copy of the whole logits exists (with a 128k vocabulary those of one 2048-token sequence are 1 GB)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from slimtune.data import IGNORE_INDEX, model_inputs
from slimtune.memory import HeapTrim

LOSS_CHUNK_BYTES = 64 * 2**20  # fp32 per chunk on a GPU: few, large kernels
CPU_LOSS_CHUNK_BYTES = 2 * 2**20  # on a CPU: every pass over a chunk stays in cache (vocab 128k, 1024 positions: 6.4 s -> 3.3 s)
TRIM_COST_SHARE = 0.02  # the step's heap trims may cost ~2% of the training time (memory.HeapTrim)


def step_heap_trim() -> HeapTrim:
    """The heap trim a run keeps across its steps (``StepParts.trim``): after each micro-batch's backward,
    what the step freed goes back to the system once the process grew 64 MB, at most as often as keeps
    the re-faulting under ``TRIM_COST_SHARE`` of the time.

    Example: ``parts = StepParts(..., trim=step_heap_trim())``"""
    return HeapTrim(cost_share=TRIM_COST_SHARE)


@dataclass
class StepParts:
    """What an optimizer step works on, set up once by the recipe."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    params: list[nn.Parameter]
    max_grad_norm: float | None
    device: torch.device
    trim: HeapTrim = field(default_factory=step_heap_trim)  # the run's, kept across its steps


def step_token_counts(examples: list) -> tuple[int, int]:
    """(trained tokens, tokens) of a global step's examples (every rank's, all micro-batches), counted on
    the host as the collated batches would count them: the loss's denominator and the throughput's
    numerator, the same on every rank without a collective or a read back from the device.

    Example: ``step_token_counts([examples[i] for batch in plan[step] for i in batch])`` -> (1012, 1024)"""
    trained = sum(int((e.labels[1:] != IGNORE_INDEX).sum()) for e in examples)
    return trained, sum(len(e.input_ids) for e in examples)


def optimizer_step(parts: StepParts, micro_batches: list[dict[str, torch.Tensor]], trained_tokens: int) -> torch.Tensor:
    """Forward and backward over ``micro_batches`` (CPU tensors, moved here), the loss of each the token
    mean over the step's ``trained_tokens`` so their gradients add up to the step's; then unscale (fp16),
    clip, AdamW, schedule. Returns this rank's
    share of the step's loss, detached, on the device (no host sync).

    Example: ``loss = optimizer_step(parts, [batch], trained)``; ``loss.item()`` to log it"""
    loss_sum = torch.zeros((), dtype=torch.float32, device=parts.device)
    for mb in micro_batches:
        mb = {k: v.to(parts.device, non_blocking=True) for k, v in mb.items()}
        logits = parts.model(**model_inputs(mb)).logits
        loss = token_loss_sum(logits, mb["labels"]) / max(1, trained_tokens)
        del logits
        parts.scaler.scale(loss).backward()
        loss_sum += loss.detach()
        parts.trim()  # what the micro-batch freed goes back to the system (a CPU step's activations: HeapTrim)
    apply_gradients(parts)
    return loss_sum


def apply_gradients(parts: StepParts) -> None:
    """The end of every optimizer step once its micro-batches' gradients are in: unscale (fp16), clip the
    adapters' gradient norm, AdamW, zero the gradients, schedule (the preference recipe's step ends so too).

    Example: ``loss.backward(); apply_gradients(parts)``"""
    parts.scaler.unscale_(parts.optimizer)
    if parts.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(parts.params, parts.max_grad_norm, foreach=True)
    parts.scaler.step(parts.optimizer)  # fp16 only: the scaler reads its inf check back (a sync); bf16/fp32: none
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the trained (non -100) labels, in fp32, chunk by chunk of
    positions (``chunk_rows``: at most 64 MB of fp32 at a time, 2 MB on a CPU); differentiable in ``logits``.

    Example: ``token_loss_sum(model(input_ids).logits, labels) / trained_tokens``"""
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts t + 1
    return _ChunkedCrossEntropy.apply(logits, targets.to(logits.device))


def chunk_rows(logits: torch.Tensor) -> int:
    """Positions per chunk of a chunked loss over ``logits`` [..., vocab]: as many as fit ``LOSS_CHUNK_BYTES``
    of fp32 on a GPU, ``CPU_LOSS_CHUNK_BYTES`` on a CPU. Every row's values are the same whatever the chunk
    (row-wise kernels), so the loss is too. Used by ``token_loss_sum`` and ``preference.sequence_logps``.

    Example: ``for start in range(0, flat.shape[0], chunk_rows(logits)): ...``"""
    chunk_bytes = LOSS_CHUNK_BYTES if logits.is_cuda else CPU_LOSS_CHUNK_BYTES
    return max(1, chunk_bytes // (4 * logits.shape[-1]))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        rows = chunk_rows(logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], rows):
            x = flat[start : start + rows].float()
            t = flat_targets[start : start + rows]
            chunk_lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(t != IGNORE_INDEX, chunk_lse - picked, 0.0).sum()
        ctx.save_for_backward(logits, targets)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        out = torch.empty_like(flat)
        rows = chunk_rows(logits)
        for start in range(0, flat.shape[0], rows):
            t = flat_targets[start : start + rows]
            g = torch.where(t != IGNORE_INDEX, grad, 0.0).unsqueeze(1)  # d(sum)/d(loss_i), 0 where not trained
            p = torch.log_softmax(flat[start : start + rows].float(), dim=-1).exp_()  # softmax, as autograd's own backward makes it
            p.mul_(g).scatter_add_(1, t.clamp(min=0).unsqueeze(1), -g)  # s * g - g at the target: autograd's order
            out[start : start + rows] = p
        return out.view_as(logits), None
