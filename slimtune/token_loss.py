"""The next-token loss of training and evaluation, in bounded memory.

``token_loss_sum`` is the next-token cross-entropy in fp32 over chunks of positions with a hand-written
backward: the forward keeps nothing but the logits autograd holds anyway (no saved chunk graphs), the
backward makes each chunk's gradient (softmax minus one-hot, scaled) in place in one fp32 buffer and
writes it in the logits' dtype: bit for bit the gradient autograd makes through F.cross_entropy (the
same log-softmax, exp, subtraction and cast), without the recomputed forward, the one-hot tensor, the
zero-filled gradient of the gather and the separate cast pass of a checkpointed autograd graph. No
fp32 copy of the whole logits exists (with a 128k vocabulary those of one 2048-token sequence are 1 GB)."""

from __future__ import annotations

import torch

from slimtune.data import IGNORE_INDEX

LOSS_CHUNK_BYTES = 64 * 2**20  # fp32 per chunk on a GPU: few, large kernels
CPU_LOSS_CHUNK_BYTES = 2 * 2**20  # on a CPU: every pass over a chunk stays in cache (vocab 128k, 1024 positions: 6.4 s -> 3.3 s)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over the trained (non -100) labels, in fp32, chunk by chunk of
    positions (``chunk_rows``: at most 64 MB of fp32 at a time, 2 MB on a CPU); differentiable in ``logits``.

    Example: ``token_loss_sum(model(input_ids).logits, labels) / trained_tokens``"""
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts t + 1
    return _ChunkedCrossEntropy.apply(logits, targets.to(logits.device))


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, entropy: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits / temperature)[target] of each position [rows, T], fp32, differentiable in
    ``logits``; 0 where the target is IGNORE_INDEX. With an ``entropy`` buffer [rows, T] the entropy of the
    same distribution is written there (no gradient; 0 where not trained). Chunk by chunk of positions, as
    ``token_loss_sum``: the backward writes g (onehot - softmax) / temperature in the logits' dtype. The
    preference losses (temperature 1, no entropy) and GRPO's (both) share it.

    Example: ``logps = token_logps(logits, F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX))``"""
    return _ChunkedTokenLogps.apply(logits, targets, float(temperature), entropy)


def chunk_rows(logits: torch.Tensor) -> int:
    """Positions per chunk of a chunked loss over ``logits`` [..., vocab]: as many as fit ``LOSS_CHUNK_BYTES``
    of fp32 on a GPU, ``CPU_LOSS_CHUNK_BYTES`` on a CPU. Every row's values are the same whatever the chunk
    (row-wise kernels), so the loss is too. Used by ``token_loss_sum`` and ``token_logps``.

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


class _ChunkedTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: torch.Tensor | None) -> torch.Tensor:
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        flat_entropy = None if entropy is None else entropy.view(-1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        rows = chunk_rows(logits)
        for start in range(0, flat.shape[0], rows):
            x = flat[start : start + rows].float() / temperature  # exact for temperature 1
            t = flat_targets[start : start + rows]
            live = t != IGNORE_INDEX
            if flat_entropy is None:
                picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=-1)
            else:  # the whole log-softmax is needed for the entropy: the picked value is read from it
                logp = torch.log_softmax(x, dim=-1)
                picked = logp.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                flat_entropy[start : start + rows] = torch.where(live, -(logp.exp() * logp).sum(dim=-1), 0.0)
            out[start : start + rows] = torch.where(live, picked, 0.0)
        ctx.temperature = temperature
        ctx.save_for_backward(logits, targets)
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat, flat_targets, flat_grad = logits.reshape(-1, vocab), targets.reshape(-1), grad.reshape(-1)
        out = torch.empty_like(flat)
        rows = chunk_rows(logits)
        for start in range(0, flat.shape[0], rows):
            t = flat_targets[start : start + rows]
            g = torch.where(t != IGNORE_INDEX, flat_grad[start : start + rows], 0.0).unsqueeze(1) / ctx.temperature
            p = torch.log_softmax(flat[start : start + rows].float() / ctx.temperature, dim=-1).exp_()
            p.mul_(-g).scatter_add_(1, t.clamp(min=0).unsqueeze(1), g)  # g (onehot - softmax) / temperature
            out[start : start + rows] = p
        return out.view_as(logits), None, None, None
