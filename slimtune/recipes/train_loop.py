"""The loops every objective shares: the micro-batch loop of one optimizer step (``optimizer_step``), the
no-grad loop over held-out rows (``no_grad_batches``) and the non-finite-loss check (``check_finite``).

``optimizer_step`` runs the forward and backward passes of a global step's micro-batches (this rank's
slices; the objective's ``micro_batch_loss`` computes each one's share of the step's loss), clips the
adapters' gradient norm, steps AdamW and the schedule (``apply_gradients``) and returns the step's loss
and figure sums as one tensor on the device: the caller reads it once, the only point at which the host
waits for the device. The counts a loss is averaged over come from the host (the objective's
``prepare_step``: every rank's rows of the step), so no count is reduced across ranks or read back.

Example: ``totals = all_sum(optimizer_step(run.parts, objective, step), ranks).cpu()``"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from slimtune.distributed import reshard
from slimtune.errors import SlimtuneError
from slimtune.recipes.objective import Objective, StepBatches
from slimtune.recipes.run import Run, StepParts


def optimizer_step(parts: StepParts, objective: Objective, step: StepBatches) -> torch.Tensor:
    """Forward and backward over ``step.micro_batches`` (CPU tensors, moved here), each one's loss its
    share of the step's so their gradients add up to the step's; then ``apply_gradients``. Returns this
    rank's [loss, *figure sums] of the step, detached, fp32, on the device (no host sync).

    Example: ``totals = optimizer_step(run.parts, run.objective, run.objective.prepare_step(run, batch))``"""
    totals = None
    for mb in step.micro_batches:
        inputs = {k: v.to(parts.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
        loss, sums = objective.micro_batch_loss(parts.model, inputs, step)
        parts.scaler.scale(loss).backward()
        part = torch.cat([loss.detach().reshape(1).float(), sums])
        totals = part if totals is None else totals + part
        parts.trim()  # what the micro-batch freed goes back to the system (a CPU step's activations: HeapTrim)
    apply_gradients(parts)
    return totals if totals is not None else torch.zeros(1, dtype=torch.float32, device=parts.device)


def apply_gradients(parts: StepParts) -> None:
    """The end of every optimizer step once its micro-batches' gradients are in: unscale (fp16), clip the
    adapters' gradient norm, AdamW, zero the gradients, schedule.

    Example: ``loss.backward(); apply_gradients(parts)``"""
    parts.scaler.unscale_(parts.optimizer)
    if parts.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(parts.params, parts.max_grad_norm, foreach=True)
    parts.scaler.step(parts.optimizer)  # fp16 only: the scaler reads its inf check back (a sync); bf16/fp32: none
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()


def check_finite(run: Run, loss: float) -> None:
    """Stop the run in one line when the step's loss is NaN or infinite (fp16's loss scaler skips such a
    step itself and lowers its scale, so there it is no error).

    Example: ``check_finite(run, step_loss)``"""
    if not math.isfinite(loss) and not run.parts.scaler.is_enabled():
        raise SlimtuneError(f"the loss is {loss} at step {run.at.global_step}; lower optimizer.lr or check the data")


def no_grad_batches(run: Run, rows: list, collate: Callable[[Run, list, list[int]], dict]) -> Iterator[tuple[dict, list[int]]]:
    """Every batch of ``rows`` (training.batch_size each, this rank's slice by ``collate``) on the device,
    with dropout off, no gradient and the RNG state forked around it, so training continues exactly as
    without the pass; yields (inputs, the batch's row indices). Every rank runs each batch (FSDP2 needs
    all for each forward); the model is resharded after.

    Example: ``for inputs, indices in no_grad_batches(run, run.inputs.data.eval, objective.collate): ...``"""
    model, device, size = run.model, run.where.device, run.cfg.training.batch_size
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for start in range(0, len(rows), size):
            indices = list(range(start, min(start + size, len(rows))))
            yield {k: v.to(device) for k, v in collate(run, rows, indices).items()}, indices
    model.train(was_training)
    reshard(model)
