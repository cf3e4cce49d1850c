"""The preference losses (DPO's sigmoid, IPO, SimPO) and their metrics, as TRL 1.16 computes them, over
collated pairs (``data.rank_pairs``: the chosen sequences, then the rejected ones).

``sequence_logps`` is each sequence's summed log-probability of its answer tokens, chunk by chunk of
positions with a hand-written backward like ``token_loss.token_loss_sum``'s (no fp32 copy of the logits, no
saved chunk graphs): a preference step holds what an SFT step over the same 2N sequences holds.
``pair_loss`` is the objective over a micro-batch (TRL's formulas, named below), averaged over the
global step's pairs, and ``PairMetrics`` the sums TRL's logged means are made of:

- dpo (``DPOTrainer``, loss_type sigmoid): -log sigmoid(beta ((c - c_ref) - (r - r_ref))), c and r the
  answers' summed log-probabilities;
- ipo (``DPOTrainer``, loss_type ipo): ((c - c_ref) / |c| - (r - r_ref) / |r| - 1 / (2 beta))^2, |c| and
  |r| the answers' token counts;
- simpo (``CPOTrainer``, loss_type simpo): -(1 - ls) log sigmoid(beta (c / |c| - r / |r|) - gamma)
  - ls log sigmoid(-(...)), plus cpo_alpha times the chosen answers' token-mean next-token loss; no
  reference.

Rewards: beta (c - c_ref) and beta (r - r_ref) (dpo, ipo), beta c / |c| and beta r / |r| (simpo); the
accuracy counts chosen > rejected strictly, the margin is their difference; logps/* are c and r (the
token means for simpo), as TRL logs them.

Example: ``loss, sums = pair_loss(model(**model_inputs(batch)).logits, batch, PreferenceLoss("dpo"), pairs=8, chosen_tokens=90)``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimtune.data import IGNORE_INDEX
from slimtune.token_loss import token_logps

OBJECTIVES = ("dpo", "ipo", "simpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """The objective and its hyperparameters (the config's training.objective and preference.*)."""

    objective: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> PreferenceLoss:
        p = cfg.preference
        return cls(cfg.training.objective, p.beta, p.label_smoothing, p.simpo_gamma, p.cpo_alpha)

    @property
    def uses_reference(self) -> bool:
        return self.objective != "simpo"


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's trained tokens [rows], fp32, differentiable in ``logits``;
    their count [rows]). Position t predicts label t + 1, as in ``token_loss.token_loss_sum``.

    Example: ``logps, counts = sequence_logps(model(input_ids).logits, labels)``"""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(logits.device)
    per_token = token_logps(logits, targets)
    return per_token.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def pair_loss(logits: torch.Tensor, batch: dict, loss: PreferenceLoss, pairs: int, chosen_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective over this micro-batch's live pairs, divided by the global step's ``pairs`` (and, for
    SimPO's next-token term, its ``chosen_tokens``), so micro-batches and ranks add up to the step's mean;
    and the detached metric sums (``PairMetrics.SUMS`` order).

    Example: ``loss, sums = pair_loss(logits, batch, PreferenceLoss("ipo", beta=0.1), pairs=4, chosen_tokens=40)``"""
    logps, counts = sequence_logps(logits, batch["labels"])
    n = logps.shape[0] // 2
    live = batch["live"].to(logps.device)
    c, r = logps[:n], logps[n:]
    nc, nr = counts[:n].clamp(min=1).float(), counts[n:].clamp(min=1).float()
    ref_c, ref_r = batch["ref_logps"].to(logps.device)
    beta = loss.beta
    nll = torch.zeros((), device=logps.device)
    if loss.objective == "simpo":
        avg_c, avg_r = c / nc, r / nr
        z = beta * (avg_c - avg_r - loss.simpo_gamma / beta)
        per_pair = -F.logsigmoid(z) * (1 - loss.label_smoothing) - F.logsigmoid(-z) * loss.label_smoothing
        chosen_r, rejected_r = beta * avg_c.detach(), beta * avg_r.detach()
        shown_c, shown_r = avg_c.detach(), avg_r.detach()
        if loss.cpo_alpha:
            nll = -(c * live).sum() / max(1, chosen_tokens)
    else:
        dc, dr = c - ref_c, r - ref_r
        if loss.objective == "dpo":
            per_pair = -F.logsigmoid(beta * (dc - dr))
        elif loss.objective == "ipo":
            per_pair = (dc / nc - dr / nr - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference objective {loss.objective!r}; expected one of {', '.join(OBJECTIVES)}")
        chosen_r, rejected_r = beta * dc.detach(), beta * dr.detach()
        shown_c, shown_r = c.detach(), r.detach()
    total = (per_pair * live).sum() / max(1, pairs) + loss.cpo_alpha * nll
    metrics = torch.stack(
        [
            live.sum(),
            (chosen_r * live).sum(),
            (rejected_r * live).sum(),
            ((chosen_r > rejected_r).float() * live).sum(),
            ((chosen_r - rejected_r) * live).sum(),
            (shown_c * live).sum(),
            (shown_r * live).sum(),
            nll.detach() * max(1, chosen_tokens),
        ]
    )
    return total, metrics


def pair_metric_means(sums: torch.Tensor, chosen_tokens: int, loss: PreferenceLoss, prefix: str = "") -> dict[str, float]:
    """TRL's logged means from the summed ``pair_loss`` metrics (``prefix`` "eval_" for evaluation); SimPO
    with cpo_alpha also logs ``nll_loss``, as TRL's CPO trainer does.

    Example: ``record.update(pair_metric_means(all_sum(sums, ranks), tokens, loss))``"""
    values = sums.tolist()
    count = max(1.0, values[0])
    out = {f"{prefix}{name}": v / count for name, v in zip(METRICS, values[1:7], strict=True)}
    if loss.objective == "simpo" and loss.cpo_alpha:
        out[f"{prefix}nll_loss"] = values[7] / max(1, chosen_tokens)
    return out
