"""GRPO's loss family and its metrics, as TRL 1.16's ``GRPOTrainer`` computes them, over a micro-batch of
sampled completions (prompt then completion in one row, the completion's tokens labelled).

- ``group_advantages``: the rewards' group-relative advantages, (r - mean of its group) / (std + 1e-4),
  the std that of the group (``scale_rewards`` group), of the whole generation batch (batch) or none
  (unscaled); and the means TRL logs (``reward``, ``reward_std``, ``frac_reward_zero_std``).
- ``completion_logps``: each completion token's log-probability under logits / temperature (fp32,
  differentiable) and its entropy (detached), chunk by chunk of positions with a hand-written backward,
  as ``preference_loss.sequence_logps`` (no fp32 copy of the logits).
- ``policy_loss``: the clipped surrogate, with r = exp(logp - old logp) per token (``importance_sampling_level``
  token) or exp of the sequence's mean log-ratio (sequence, GSPO), clipped to [1 - epsilon, 1 + epsilon_high];
  per token -min(r A, clip(r) A) + beta * k3 (k3 = exp(ref - logp) - (ref - logp) - 1, only when beta > 0,
  times r with ``use_bias_correction_kl``, TRL's default: r is 1 in value on-policy but not in gradient),
  reduced as ``loss_type`` says:

  - grpo: each sequence's token mean, averaged over the step's sequences;
  - bnpo: the micro-batch's token mean, averaged over the step's micro-batches;
  - dr_grpo: the token sum over (the step's sequences x max_completion_length);
  - dapo (TRL's default): the token sum over the step's completion tokens.

  The old log-probabilities are the policy's at generation time (stored when ``num_iterations`` > 1), else
  the current ones detached (r = 1). The metrics (``kl``, ``entropy``, ``clip_ratio/*``) are TRL's
  masked means, kept as sums so micro-batches and ranks add up.

Example: ``loss, sums = policy_loss(logps, batch, GRPOLoss(), StepCounts(sequences=8, tokens=240, micro_batches=1))``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimtune.data import IGNORE_INDEX
from slimtune.token_loss import token_logps

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
IMPORTANCE_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
# policy_loss's sums, in order: tokens, sequences, then the numerators of TRL's masked means
SUMS = ("tokens", "sequences", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class GRPOLoss:
    """The loss's hyperparameters (the config's grpo.*, TRL's names and defaults); ``epsilon_high`` None
    is ``epsilon``; ``temperature`` scales the logits as sampling did."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_completion_length: int = 256
    temperature: float = 1.0
    use_bias_correction_kl: bool = True

    @property
    def upper(self) -> float:
        """1 + epsilon_high (or epsilon): the ratio's upper clip."""
        return 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


@dataclass(frozen=True)
class StepCounts:
    """What the loss is divided by: the optimizer step's completions, their trained tokens and its
    micro-batches, over every rank."""

    sequences: int
    tokens: int
    micro_batches: int = 1


@dataclass(frozen=True)
class Advantages:
    """``group_advantages``'s result: one advantage per completion and TRL's reward means."""

    advantages: torch.Tensor  # [completions] fp32
    reward: float  # mean reward (unscorable completions left out)
    reward_std: float  # the rewards' std over the batch
    frac_reward_zero_std: float  # share of completions whose scaling std is 0


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> Advantages:
    """TRL's advantages of ``rewards`` [prompts x num_generations] (each prompt's completions adjacent; NaN:
    no reward function scored it): r minus its group's mean, divided by (std + 1e-4) unless ``scale_rewards``
    is none; the std (unbiased, NaN skipped) is the group's (group, none) or the whole batch's (batch).
    An unscorable completion's advantage is 0.

    Example: ``group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2).advantages  # ~[0.71, -0.71, 0, 0]``"""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(SCALE_REWARDS)}")
    rewards = rewards.float()
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards) if rewards.numel() > 1 else torch.zeros(()).expand_as(rewards)
        std = std.expand_as(rewards)
    elif num_generations > 1:
        std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    reward, reward_std = float(torch.nanmean(rewards)), float(_nanstd(rewards))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), reward, reward_std, float(zero_std.float().mean()))


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std of ``x`` ignoring NaNs (NaN with fewer than two values), over ``dim`` or all of it."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True) if keep else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep) if keep else (~torch.isnan(x)).sum()
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep) if keep else torch.nanmean((x - mean) ** 2)
    correction = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(count, float("nan"), dtype=torch.float32))
    out = torch.sqrt(variance * correction)
    return out.squeeze(dim) if keep else out


def completion_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits / temperature) of each next token [rows, T], fp32, differentiable in ``logits``;
    the entropy of that distribution at each position [rows, T], detached). Position t predicts label
    t + 1; both are 0 where that label is IGNORE_INDEX.

    Example: ``logps, entropy = completion_logps(model(input_ids).logits, labels, temperature=0.9)``"""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(logits.device)
    entropy = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    logps = token_logps(logits, targets, temperature, entropy)
    return logps, entropy


def completion_batch(prompts: list[torch.Tensor], completions: list[list[int]], masked: list[bool], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + completion rows as TRL lays them out: the prompts left-padded, the completions right-padded
    after them; ``labels`` the completion's tokens (IGNORE_INDEX elsewhere and on a ``masked`` row: a
    truncated completion under mask_truncated_completions, whose completion is also out of the attention mask).

    Example: ``completion_batch([torch.tensor([5, 6])], [[7, 2]], [False], pad_id=0)["labels"]  # [[-100, -100, 7, 2]]``"""
    rows, width, length = len(prompts), max(len(p) for p in prompts), max(1, max(len(c) for c in completions))
    input_ids = torch.full((rows, width + length), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width + length), dtype=torch.long)
    labels = torch.full((rows, width + length), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        input_ids[i, width - len(p) : width] = p.long()
        mask[i, width - len(p) : width] = 1
        input_ids[i, width : width + len(c)] = torch.tensor(c, dtype=torch.long)
        if not masked[i]:
            mask[i, width : width + len(c)] = 1
            labels[i, width : width + len(c)] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def trained_mask(labels: torch.Tensor) -> torch.Tensor:
    """[rows, T] fp32: 1 where position t's next token (label t + 1) is trained, as ``completion_logps`` aligns."""
    return F.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False).float()


def policy_loss(logps: torch.Tensor, batch: dict, loss: GRPOLoss, counts: StepCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's share of the step's loss (``loss.loss_type``'s reduction with ``counts``) and the
    detached metric sums (``SUMS`` order). ``batch``: ``labels`` [rows, T], ``advantages`` [rows],
    ``old_logps`` [rows, T] or None (then r = 1), ``ref_logps`` [rows, T] (when beta > 0), ``entropy`` [rows, T]
    (``completion_logps``'s), all aligned as ``completion_logps`` returns them; ``live`` [rows] (optional:
    0 on a rank's filler row, which counts as no completion).

    Example: ``loss, sums = policy_loss(logps, batch, GRPOLoss("grpo"), StepCounts(8, 240))``"""
    mask = trained_mask(batch["labels"]).to(logps.device)
    row_tokens = mask.sum(dim=1).clamp(min=1.0)
    adv = batch["advantages"].to(logps.device).float().unsqueeze(1)
    old = batch.get("old_logps")
    old = logps.detach() if old is None else old.to(logps.device)
    log_ratio = logps - old
    if loss.importance_sampling_level == "token":
        log_weights = log_ratio
    elif loss.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(dim=1) / row_tokens).unsqueeze(1)
    else:
        raise ValueError(f"unknown importance_sampling_level {loss.importance_sampling_level!r}; expected token or sequence")
    lower = 1 - loss.epsilon
    coef = torch.exp(log_weights)
    per_token = -torch.min(coef * adv, torch.clamp(coef, lower, loss.upper) * adv)
    kl = None
    if loss.beta != 0.0:
        ref = batch["ref_logps"].to(logps.device)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if loss.use_bias_correction_kl:  # times the (differentiable) ratio: the unbiased reverse-KL gradient
            kl = kl * coef
        per_token = per_token + loss.beta * kl
    total = _reduce(per_token * mask, row_tokens, mask, loss, counts)
    low = ((coef < lower) & (adv < 0)).float()
    high = ((coef > loss.upper) & (adv > 0)).float()
    sums = torch.stack(
        [
            mask.sum(),
            batch["live"].to(mask.device).float().sum() if "live" in batch else torch.tensor(float(mask.shape[0]), device=mask.device),
            (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(()),
            (batch["entropy"].to(mask.device) * mask).sum(),
            *(_clip_sum(x, mask) for x in (low, high, torch.maximum(low, high))),
        ]
    )
    return total, sums


def grpo_metric_means(sums: torch.Tensor, loss: GRPOLoss, prefix: str = "") -> dict[str, float]:
    """TRL's logged means from summed ``policy_loss`` sums: ``kl`` (when beta > 0), ``entropy`` and
    ``clip_ratio/{low,high,region}_mean``, per trained token (per completion for the clip ratios at the
    sequence level).

    Example: ``record.update(grpo_metric_means(all_sum(sums, ranks), GRPOLoss()))``"""
    values = dict(zip(SUMS, sums.tolist(), strict=True))
    tokens, sequences = max(1.0, values["tokens"]), max(1.0, values["sequences"])
    per_clip = sequences if loss.importance_sampling_level == "sequence" else tokens
    out = {f"{prefix}entropy": values["entropy"] / tokens}
    if loss.beta != 0.0:
        out[f"{prefix}kl"] = values["kl"] / tokens
    for name in SUMS[4:]:
        out[f"{prefix}{name}"] = values[name] / per_clip
    return out


def _reduce(masked: torch.Tensor, row_tokens: torch.Tensor, mask: torch.Tensor, loss: GRPOLoss, counts: StepCounts) -> torch.Tensor:
    """The micro-batch's share of the step's loss under ``loss.loss_type`` (the module docstring's list)."""
    if loss.loss_type == "grpo":
        return (masked.sum(dim=1) / row_tokens).sum() / max(1, counts.sequences)
    if loss.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / max(1, counts.micro_batches)
    if loss.loss_type == "dr_grpo":
        return masked.sum() / (max(1, counts.sequences) * loss.max_completion_length)
    if loss.loss_type == "dapo":
        return masked.sum() / max(1, counts.tokens)
    raise ValueError(f"unknown loss_type {loss.loss_type!r}; expected one of {', '.join(LOSS_TYPES)}")


def _clip_sum(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A clip indicator's count: per completion at the sequence level ([rows, 1]), per trained token else."""
    return flags.sum() if flags.shape[1] == 1 else (flags * mask).sum()
